"""What the decode steps read, measured from their selections: the bytes accounting of the evaluation.

A decode step of a top-k method reads ``d/D`` of every visible key to score the tokens (``d`` leading dims of the
basis), then the keys and values of the tokens it selected.  Per KV head, the tokens read are the *distinct*
tokens the group's selections hold: with one selection per KV head (``gqa_select="kv"``) exactly k, with one
selection per query head between k and G k.  Relative to dense attention (every key and value once)::

    bytes_fraction = d / (2 D) + u / n

with ``u`` the distinct tokens read per KV head and ``n`` the tokens the row sees.  The references record
``u / n`` of every row and KV head while a :func:`tally_selections` block is open (the evaluation engine's rows,
:mod:`loki.reference.teacher_forced`, and the decode references of :mod:`loki.reference.methods`); nothing is
recorded otherwise, nor while ``torch.compile`` traces.  Sums stay on the device: reading a tally is the only host
sync.

Shape letters: B batch, H the selection's head axis (HQ or HKV), HKV key/value heads, R query rows, S tokens,
K selected tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .selection import selection_mask

__all__ = ["SelectionTally", "record_indices", "record_selection", "tally_selections", "tallying"]

_OPEN: list = []


@dataclass(eq=False)
class SelectionTally:
    """The sum of ``u / n`` over the recorded rows and KV heads (every layer of every forward) and their count."""

    frac_sum: torch.Tensor | float = 0.0
    rows: torch.Tensor | int = 0

    def add(self, frac_sum: torch.Tensor, rows: torch.Tensor) -> None:
        if isinstance(self.frac_sum, torch.Tensor) and self.frac_sum.device != frac_sum.device:
            frac_sum, rows = frac_sum.to(self.frac_sum.device), rows.to(self.frac_sum.device)
        self.frac_sum = self.frac_sum + frac_sum
        self.rows = self.rows + rows

    @property
    def count(self) -> int:
        """Rows x KV heads recorded (every layer counts its own)."""
        return int(self.rows)

    @property
    def selected_fraction(self) -> float | None:
        """The mean of ``u / n``: distinct tokens read per KV head over the tokens seen (None: nothing recorded)."""
        n = self.count
        return float(self.frac_sum) / n if n else None


@contextmanager
def tally_selections():
    """Record every selection the references make inside the block: ``with tally_selections() as t: ...`` then
    ``t.selected_fraction``.  Blocks may nest (each records everything inside it)."""
    t = SelectionTally()
    _OPEN.append(t)
    try:
        yield t
    finally:
        _OPEN.remove(t)


def tallying() -> bool:
    """Whether a :func:`tally_selections` block is open (and no ``torch.compile`` trace is running)."""
    return bool(_OPEN) and not torch.compiler.is_compiling()


def record_selection(sel: torch.Tensor, n_visible: torch.Tensor, HKV: int) -> None:
    """Record a selection: ``sel`` [B, H, R, S] bool (H = HQ: per query head, or HKV) of rows that see
    ``n_visible`` [B, R] tokens (rows that see none are skipped).  A no-op outside :func:`tally_selections`."""
    if not tallying():
        return
    B, H, R, S = sel.shape
    if H != HKV:
        sel = sel.reshape(B, HKV, H // HKV, R, S).any(dim=2)
    u = sel.sum(dim=-1, dtype=torch.float64)  # [B, HKV, R]: distinct tokens read per KV head
    n = n_visible.to(sel.device)[:, None, :].expand(B, HKV, R)
    seen = n > 0
    frac = torch.where(seen, u / n.clamp_min(1).double(), 0.0).sum()
    cnt = seen.sum()
    for t in _OPEN:
        t.add(frac, cnt)


def record_indices(idx: torch.Tensor, n_valid: torch.Tensor, HKV: int, S: int) -> None:
    """Record the selection of one decode step: ``idx`` [B, H, K] int (-1 pads), ``n_valid`` [B] the tokens each
    sequence sees, S the cache length.  A no-op outside :func:`tally_selections`."""
    if not tallying():
        return
    B = idx.shape[0]
    record_selection(selection_mask(idx, S)[:, :, None], n_valid.reshape(B, 1), HKV)
