"""What the decode steps read, measured from their selections: the bytes accounting of the evaluation.

A decode step of a top-k method reads ``d/D`` of every visible key to score the tokens (``d`` leading dims of the
basis), then the keys and values of the tokens it selected.  Per KV head, the tokens read are the *distinct*
tokens the group's selections hold: with one selection per KV head (``gqa_select="kv"``) exactly k, with one
selection per query head between k and G k.  Relative to dense attention (every key and value once)::

    bytes_fraction = d / (2 D) + u / n

with ``u`` the distinct tokens read per KV head and ``n`` the tokens the row sees.  The byte model of every method,
the score phase (:func:`score_fraction`) plus the selection (:func:`step_bytes_fraction`), is written once here:
Loki and Double Sparsity (a Loki basis) ``d / (2D)``, SparQ ``r / (2D)``, Quest ``1 / page_size`` (its page metadata,
a minimum and a maximum key per page), H2O nothing, exact top-k every key (``1/2``, then only the selection's
values).  The references record
``u / n`` of every row and KV head while a :func:`tally_selections` block is open (the evaluation engine's rows,
:mod:`loki.reference.teacher_forced`, and the decode references of :mod:`loki.reference.methods`); nothing is
recorded otherwise, nor while ``torch.compile`` traces.  Sums stay on the device: reading a tally is the only host
sync.

The diagnostics of a selection are tallied the same way (:func:`tally_diagnostics`): per layer and query head, the
recall of the exact top-k set (the tokens the exact scores ``q . k`` would select at the same budget, ties to the
lowest position) and the exact attention mass the selection captures (and the mass of the exact top-k set, the
most any selection of that many tokens can capture), recorded by the references that select
(:func:`record_diagnostics`) while a block is open.

Shape letters: B batch, H the selection's head axis (HQ or HKV), HQ query heads, HKV key/value heads, R query rows,
S tokens, K selected tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .masks import masked_softmax, per_query_head, topk_mask
from .score_formats import check_score_format, score_elements
from .selection import selection_mask

__all__ = ["BYTE_METHODS", "DIAGNOSTIC_FIELDS", "QUEST_PAGE_SIZE", "DiagnosticsTally", "SelectionTally",
           "diagnosing", "record_diagnostics", "record_indices", "record_selection", "score_fraction",
           "record_components", "selection_quality", "step_bytes_fraction", "tally_diagnostics", "tally_selections",
           "tallying"]

_OPEN: list = []

#: Quest's page size: the tokens whose minimum and maximum keys one page's metadata keeps (16, as in Quest).
QUEST_PAGE_SIZE = 16
#: The methods of the byte model (:func:`score_fraction`, :func:`step_bytes_fraction`).
BYTE_METHODS = ("full", "dense", "exact_topk", "loki", "pcaattn", "sparq", "h2o", "quest")


def score_fraction(method: str, d: int | float | None = None, D: int | None = None, *,
                   page_size: int = QUEST_PAGE_SIZE, components: float | None = None,
                   score_format: str = "native") -> float:
    """The bytes one decode step reads to score the visible tokens, relative to dense attention (the keys and values
    of every visible token once, ``2 n D`` values per KV head):

    - ``"loki"`` (and Double Sparsity, a Loki basis), ``"pcaattn"``: ``d`` of the ``D`` dims of every key,
      ``d / (2D)``; ``"sparq"``: the key components its query heads read, ``components / 2`` where ``components`` is
      the measured mean number of distinct components per KV group over ``D`` (:attr:`SelectionTally.
      component_fraction`: the heads of a group pick their own ``r`` components of their shared keys), else
      ``r / (2D)``, one head's (``d`` is SparQ's ``r``);
    - ``"quest"``: the page metadata, ``2 D`` values per page of ``page_size`` tokens, ``1 / page_size``;
    - ``"exact_topk"``: every key whole, ``1/2``;
    - ``"h2o"``: nothing (its scores are the attention it computed); ``"full"``, ``"dense"``: nothing beyond the
      attention itself.

    ``d``: a count or a fraction of ``D`` (:func:`loki._checks.resolve_d`), needed for loki, pcaattn and sparq.
    ``score_format``: Loki's score copy (:mod:`.score_formats`): ``d`` dims at its bits plus a 16-bit scale per token
    for a quantized one, :func:`~loki.reference.score_formats.score_elements` ``/ (2D)``."""
    from .._checks import resolve_d

    if method not in BYTE_METHODS:
        raise ValueError(f"method must be one of {BYTE_METHODS}, got {method!r}")
    if method == "sparq" and components is not None:
        return float(components) / 2
    if method in ("loki", "pcaattn", "sparq"):
        if d is None or D is None:
            raise ValueError(f"method {method!r} needs d and D for its score bytes")
        dd = resolve_d(d, D, name="r" if method == "sparq" else "d")
        if method == "loki":
            return score_elements(score_format, dd) / (2 * D)
        check_score_format(score_format, method)
        return dd / (2 * D)
    if method == "quest":
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        return 1.0 / page_size
    if method == "exact_topk":
        return 0.5
    return 0.0


def step_bytes_fraction(method: str, selected: float | None, d: int | float | None = None, D: int | None = None, *,
                        page_size: int = QUEST_PAGE_SIZE, components: float | None = None,
                        score_format: str = "native") -> float | None:
    """The bytes one decode step reads relative to dense attention: :func:`score_fraction` plus the keys and values of
    the ``u`` distinct tokens read per KV head, ``selected = u / n`` of the ``n`` visible ones (measured from the
    selections, :class:`SelectionTally`); exact top-k has read the keys to score and adds the values only,
    ``1/2 + u/(2n)``; PCAAttn reads every value, ``d/(2D) + 1/2``; dense attention 1.  None when a sparse method's
    ``selected`` is None (not measured).  ``components``: SparQ's measured key components (:func:`score_fraction`)."""
    sf = score_fraction(method, d, D, page_size=page_size, components=components, score_format=score_format)
    if method in ("full", "dense"):
        return 1.0
    if method == "pcaattn":
        return sf + 0.5
    if selected is None:
        return None
    if method == "exact_topk":
        return sf + selected / 2
    return sf + selected


@dataclass(eq=False)
class SelectionTally:
    """The sum of ``u / n`` over the recorded rows and KV heads (every layer of every forward) and their count."""

    frac_sum: torch.Tensor | float = 0.0
    rows: torch.Tensor | int = 0
    # SparQ's key components: the sum over rows and KV groups of the distinct components read over D, and the count
    comp_sum: torch.Tensor | float = 0.0
    comp_rows: torch.Tensor | int = 0

    def add_components(self, comp_sum: torch.Tensor, rows: torch.Tensor) -> None:
        self.comp_sum = self.comp_sum + (comp_sum if not isinstance(self.comp_sum, torch.Tensor)
                                         else comp_sum.to(self.comp_sum.device))
        self.comp_rows = self.comp_rows + (rows if not isinstance(self.comp_rows, torch.Tensor)
                                           else rows.to(self.comp_rows.device))

    @property
    def component_fraction(self) -> float | None:
        """The mean number of distinct key components a KV group's query heads read, over D (None: nothing
        recorded: a method that reads a fixed prefix of components)."""
        n = int(self.comp_rows)
        return float(self.comp_sum) / n if n else None

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


def record_components(comp: torch.Tensor, n_visible: torch.Tensor, HKV: int, D: int) -> None:
    """Record the key components SparQ's query heads read: ``comp`` [B, HQ, R, r] int, the components of each head
    and row, of rows that see ``n_visible`` [B, R] tokens (rows that see none are skipped).  The heads of a KV group
    read the union of their components of the group's keys.  A no-op outside :func:`tally_selections`."""
    if not tallying():
        return
    B, HQ, R, _ = comp.shape
    onehot = torch.zeros(B, HQ, R, D, dtype=torch.bool, device=comp.device).scatter_(-1, comp, True)
    union = onehot.view(B, HKV, HQ // HKV, R, D).any(dim=2).sum(dim=-1, dtype=torch.float64)  # [B, HKV, R]
    seen = n_visible.to(comp.device)[:, None, :].expand(B, HKV, R) > 0
    frac = torch.where(seen, union / D, 0.0).sum()
    cnt = seen.sum()
    for t in _OPEN:
        t.add_components(frac, cnt)


def record_indices(idx: torch.Tensor, n_valid: torch.Tensor, HKV: int, S: int) -> None:
    """Record the selection of one decode step: ``idx`` [B, H, K] int (-1 pads), ``n_valid`` [B] the tokens each
    sequence sees, S the cache length.  A no-op outside :func:`tally_selections`."""
    if not tallying():
        return
    B = idx.shape[0]
    record_selection(selection_mask(idx, S)[:, :, None], n_valid.reshape(B, 1), HKV)


_DIAG_OPEN: list = []
#: What :class:`DiagnosticsTally` sums per layer and query head, in this order (over rows).
DIAGNOSTIC_FIELDS = ("rows", "recall", "mass", "oracle_mass")


@dataclass(eq=False)
class DiagnosticsTally:
    """Sums per layer and query head of the diagnostics of every recorded row.

    ``layer`` names the layer the next records belong to: whoever runs the layers sets it (the evaluation's hooks,
    :func:`loki.evaluation.diagnostics.layer_diagnostics`); records made while it is None go under layer -1.
    ``sums[layer]``: [2, 4, HQ] float64 on the device of the records: the rows set (0: *informative* rows, whose
    budget is below the tokens they see; 1: every row that sees a token) x :data:`DIAGNOSTIC_FIELDS` (the number of
    rows, and the sums of recall, mass and oracle mass over them)."""

    layer: int | None = None
    sums: dict = field(default_factory=dict)

    def add(self, part: torch.Tensor) -> None:
        key = -1 if self.layer is None else int(self.layer)
        prev = self.sums.get(key)
        if prev is not None and prev.device != part.device:
            part = part.to(prev.device)
        self.sums[key] = part if prev is None else prev + part

    def cpu_sums(self) -> dict[int, torch.Tensor]:
        """``sums`` on the CPU (the one host sync of a tally)."""
        return {k: v.cpu() for k, v in self.sums.items()}


@contextmanager
def tally_diagnostics():
    """Record the diagnostics of every selection the references make inside the block: ``with tally_diagnostics()
    as t: ...`` then ``t.sums`` (or :func:`loki.evaluation.diagnostics.layer_diagnostics`, which also names the
    layers).  Blocks may nest."""
    t = DiagnosticsTally()
    _DIAG_OPEN.append(t)
    try:
        yield t
    finally:
        _DIAG_OPEN.remove(t)


def diagnosing() -> bool:
    """Whether a :func:`tally_diagnostics` block is open (and no ``torch.compile`` trace is running)."""
    return bool(_DIAG_OPEN) and not torch.compiler.is_compiling()


def selection_quality(sel: torch.Tensor, exact: torch.Tensor, visible: torch.Tensor, counts: torch.Tensor,
                      scale: float) -> dict[str, torch.Tensor]:
    """The quality of a selection against the exact scores, per row and query head.

    sel: [B, H, R, S] bool (H = HQ, or HKV for a selection shared by each KV group, read by every query head of the
    group); exact: [B, HQ, R, S] the exact scores ``q . k`` (unscaled; entries outside ``visible`` are ignored);
    visible: [B, 1, R, S] bool; counts: [B, R] int, the budget (the exact top-k set has ``counts`` tokens, ties to
    the lowest position).  Returns ``{"recall", "mass", "oracle_mass"}``, each [B, HQ, R] float64:
    ``|sel & E| / counts`` (0 where counts = 0), the exact attention probability (``softmax(scale * exact)`` over
    the visible tokens) summed over ``sel``, and over the exact top-k set ``E``."""
    HQ = exact.shape[1]
    if sel.shape[1] != HQ:
        sel = per_query_head(sel, HQ)
    ct = torch.float64 if exact.dtype == torch.float64 else torch.float32
    s = exact.to(ct).masked_fill(~visible, float("-inf"))
    counts = counts.long()
    top = topk_mask(s, counts[:, None])  # [B, HQ, R, S]
    p = masked_softmax(s * scale, visible)
    c = counts[:, None].to(torch.float64)
    hit = (sel & top).sum(-1, dtype=torch.float64)
    recall = torch.where(c > 0, hit / c.clamp_min(1), 0.0)
    mass = (p * sel).sum(-1, dtype=torch.float64)
    oracle = (p * top).sum(-1, dtype=torch.float64)
    return {"recall": recall, "mass": mass, "oracle_mass": oracle}


def record_diagnostics(sel: torch.Tensor, exact: torch.Tensor, visible: torch.Tensor, counts: torch.Tensor,
                       n_visible: torch.Tensor, scale: float) -> None:
    """Record the diagnostics (:func:`selection_quality`) of a selection of rows that see ``n_visible`` [B, R]
    tokens (rows that see none are skipped; a row is *informative* when its budget ``counts`` is below
    ``n_visible``).  A no-op outside :func:`tally_diagnostics`."""
    if not diagnosing():
        return
    q = selection_quality(sel, exact, visible, counts, scale)
    B, HQ, R = q["recall"].shape
    n = n_visible.long().to(sel.device)
    seen = (n > 0)[:, None, :].expand(B, HQ, R)
    informative = seen & (counts.long().to(sel.device) < n)[:, None, :]
    part = torch.zeros(2, len(DIAGNOSTIC_FIELDS), HQ, dtype=torch.float64, device=sel.device)
    for i, rows in enumerate((informative, seen)):
        w = rows.to(torch.float64)
        part[i, 0] = w.sum(dim=(0, 2))
        for j, name in enumerate(DIAGNOSTIC_FIELDS[1:], start=1):
            part[i, j] = (q[name] * w).sum(dim=(0, 2))
    for t in _DIAG_OPEN:
        t.add(part)
