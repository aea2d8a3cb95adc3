"""Diagnostics that locate the loss of a sparse method: per layer and head, how much of the exact top-k set its
selection recalls and how much of the exact attention mass it captures, measured in the evaluation engine's own
teacher-forced pass (every query row a decode step: :func:`loki.evaluation.perplexity.perplexity` with
``diagnostics=True``).

For every row and query head the references that select (:mod:`loki.reference.teacher_forced`, and H2O's decode
step) record, while :func:`layer_diagnostics` is open (:func:`loki.reference.accounting.tally_diagnostics`):

- ``recall``: ``|A ∩ E| / k``, with ``A`` the tokens the method attends (its selection, read by the query head: a
  shared selection is the group's) and ``E`` the exact top-k set, the ``k`` tokens of largest exact score ``q . k``
  at the row's budget (ties to the lowest position).  1 for exact top-k per query head; a shared selection, even
  exact top-k's, recalls less (the group's compromise).
- ``mass``: the exact attention probability ``softmax(q . K^T / sqrt(D))`` over the row's visible tokens, summed over
  ``A``: 1 is lossless, and the output error of attention restricted to ``A`` is bounded by ``1 - mass``.
- ``oracle_mass``: the same over ``E``: the most any selection of ``k`` tokens captures.

A method that keeps more than ``k`` tokens (Quest keeps whole pages) can recall more than one of ``k`` only up to 1
and capture more than the oracle's mass.  Averages are over the *informative* rows (those whose budget is below the
tokens they see; the first rows of a window keep everything and would read 1), per layer and query head, and per
KV head (the group's mean); ``all_rows`` gives the means over every row.

Shape letters: L layers, HQ query heads, HKV key/value heads.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from loki._hf import attention_modules
from loki.reference.accounting import DIAGNOSTIC_FIELDS, tally_diagnostics

__all__ = ["DIAGNOSTICS", "layer_diagnostics", "merge_sums", "naming_layers", "summarize_diagnostics"]

#: The diagnostics reported per layer and head (:data:`loki.reference.accounting.DIAGNOSTIC_FIELDS` without the
#: row count).
DIAGNOSTICS = DIAGNOSTIC_FIELDS[1:]


@contextmanager
def naming_layers(model, name_layer):
    """Inside the block, ``name_layer(layer)`` runs as each of ``model``'s attention modules starts (a forward
    pre-hook; the layer is the module's ``layer_idx``, else its position); the hooks are removed afterwards."""
    handles = []
    for i, module in enumerate(attention_modules(model)):
        layer = int(getattr(module, "layer_idx", i))

        def hook(mod, args, layer=layer):
            name_layer(layer)

        handles.append(module.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def layer_diagnostics(model):
    """Tally the diagnostics of every selection made inside the block, by layer: :func:`naming_layers` tells the
    tally which layer each record belongs to.  ``with layer_diagnostics(model) as t: model(...)``;
    then ``t.cpu_sums()`` (:class:`~loki.reference.accounting.DiagnosticsTally`) and :func:`summarize_diagnostics`."""
    with tally_diagnostics() as tally, naming_layers(model, lambda layer: setattr(tally, "layer", layer)):
        yield tally


def merge_sums(parts) -> dict[int, torch.Tensor]:
    """The sum of several tallies' ``cpu_sums()`` (dicts ``{layer: [2, 4, HQ]}``; None entries are skipped)."""
    out: dict[int, torch.Tensor] = {}
    for part in parts:
        for layer, t in (part or {}).items():
            out[layer] = t.clone() if layer not in out else out[layer] + t
    return out


def _ratio(num: torch.Tensor, den: torch.Tensor, digits: int | None = 5) -> list:
    """num / den elementwise as floats (rounded to ``digits``; None where den = 0)."""
    return [None if float(d) == 0 else (float(n / d) if digits is None else round(float(n / d), digits))
            for n, d in zip(num.flatten(), den.flatten())]


def summarize_diagnostics(sums: dict[int, torch.Tensor], num_kv_heads: int) -> dict:
    """Per layer and head means of :data:`DIAGNOSTICS` from tallied sums (``{layer: [2, 4, HQ]}``).

    Returns ``{"layers": [l, ...], "rows": informative rows per layer (each query head has as many), and for each
    diagnostic ``x``: "x": [L][HQ] (per query head), "x_kv": [L][HKV] (the group's mean), "x_per_layer": [L],
    "x_mean" (over layers and heads), then "all_rows": {"rows", "x_mean"} over every row}``; a mean over no row is
    None.  Layer -1 collects records made outside any named layer."""
    if not sums:
        return {"layers": [], "rows": [], **{f"{x}_mean": None for x in DIAGNOSTICS}, "all_rows": {}}
    layers = sorted(sums)
    t = torch.stack([sums[layer].double() for layer in layers])  # [L, 2, 4, HQ]
    HQ = t.shape[-1]
    if HQ % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} does not divide the {HQ} query heads of the tally")
    G = HQ // num_kv_heads
    inf = t[:, 0]  # [L, 4, HQ], informative rows
    rows = inf[:, 0]  # [L, HQ]
    out: dict = {"layers": layers, "rows": [int(r) for r in rows[:, 0]]}
    for j, name in enumerate(DIAGNOSTICS, start=1):
        s = inf[:, j]
        out[name] = [_ratio(s[i], rows[i]) for i in range(len(layers))]
        kv_s = s.view(len(layers), num_kv_heads, G).sum(-1)
        kv_r = rows.view(len(layers), num_kv_heads, G).sum(-1)
        out[f"{name}_kv"] = [_ratio(kv_s[i], kv_r[i]) for i in range(len(layers))]
        out[f"{name}_per_layer"] = _ratio(s.sum(-1), rows.sum(-1))
        out[f"{name}_mean"] = _ratio(s.sum(), rows.sum(), None)[0]
    allr = t[:, 1]
    out["all_rows"] = {"rows": int(allr[:, 0, 0].sum()),
                       **{f"{name}_mean": _ratio(allr[:, j].sum(), allr[:, 0].sum(), None)[0]
                          for j, name in enumerate(DIAGNOSTICS, start=1)}}
    return out
