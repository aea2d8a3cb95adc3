"""Score dims allocated per layer and KV head from a basis' spectrum, at the same total (a study on the engine).

The default scores every (layer, KV head) on its first ``d`` dims.  A head whose scores sit in few dims could give
dims to one whose scores spread over many, at the same total bytes.  :func:`allocate_score_dims` hands out the
``L * HKV * d`` dims greedily by the spectrum each head would keep (``PCABasis.eigenvalues``: key variance for a PCA
basis, score variance for a score-aware pair): ``"relative"`` by each head's share of its own total (the top-k
ranking of a head is unchanged by scaling its scores, so what counts is the part of them its dims leave out),
``"absolute"`` by the values themselves.  Every head keeps at least ``min_dims``.  Each head's spectrum is
decreasing, so the greedy order is the largest values overall, taken as prefixes per head.

:func:`with_score_dims` records an allocation on a copy of the basis (``extra["score_dims"]``, [L][HKV] ints).  The
evaluation engine (``enable_loki(..., semantics="decode")``: perplexity, ``loki compare``'s rows) scores head ``h``
of layer ``l`` on its first ``score_dims[l][h]`` dims; the decode steps (``semantics="generate"``, the caches, the
kernels) refuse such a basis.  The bytes are the default's: the mean of the allocation is ``d``.
"""

from __future__ import annotations

import torch

__all__ = ["ALLOCATIONS", "allocate_score_dims", "score_dims_of", "with_score_dims"]

ALLOCATIONS = ("relative", "absolute")


def allocate_score_dims(basis, d: int | float, *, how: str = "relative", min_dims: int = 1) -> torch.Tensor:
    """``[L, HKV]`` int64 dims per layer and KV head summing to ``L * HKV * d`` (``d`` a count or a fraction of D,
    resolved as the settings resolve it), each in ``[min_dims, D]``, handed out by ``basis.eigenvalues`` (see the
    module docstring; ``how``: "relative" or "absolute")."""
    from loki._checks import resolve_d

    if how not in ALLOCATIONS:
        raise ValueError(f"how must be one of {ALLOCATIONS}, got {how!r}")
    e = basis.eigenvalues.detach().to(torch.float64).clamp_min(0.0)
    L, HKV, D = e.shape
    dd = resolve_d(d, D)
    if not 1 <= min_dims <= dd:
        raise ValueError(f"min_dims must lie in [1, d={dd}], got {min_dims}")
    if how == "relative":
        e = e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    extra = L * HKV * (dd - min_dims)  # dims beyond every head's minimum
    rest = e[..., min_dims:].reshape(L * HKV, D - min_dims).T.reshape(-1)  # dim-major: [D - min_dims, L * HKV]
    take = torch.zeros_like(rest, dtype=torch.bool)
    if extra:
        # ties to the lower dim, then the lower (layer, head): equal spectra share the dims out evenly
        order = torch.sort(rest, descending=True, stable=True).indices[:extra]
        take[order] = True
    return min_dims + take.view(D - min_dims, L * HKV).sum(0).view(L, HKV)


def with_score_dims(basis, dims: torch.Tensor):
    """A copy of ``basis`` whose ``extra["score_dims"]`` is ``dims`` ([L, HKV] ints in [1, D])."""
    L, HKV, D = basis.eigenvalues.shape
    dims = torch.as_tensor(dims)
    if tuple(dims.shape) != (L, HKV) or int(dims.min()) < 1 or int(dims.max()) > D:
        raise ValueError(f"score dims must be [{L}, {HKV}] ints in [1, {D}], got shape {list(dims.shape)}")
    from dataclasses import replace

    return replace(basis, extra=dict(basis.extra, score_dims=[[int(x) for x in row] for row in dims.tolist()]))


def score_dims_of(basis) -> torch.Tensor | None:
    """The basis' allocated score dims, ``[L, HKV]`` int64, or None."""
    dims = (basis.extra or {}).get("score_dims")
    return None if dims is None else torch.tensor(dims, dtype=torch.long)
