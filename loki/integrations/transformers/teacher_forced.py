"""Attention of every query row with decode-time semantics (teacher forcing), and the dispatch of a batch of
decode-step rows to the selected method (the PyTorch references, or the Loki decode step of
:mod:`loki.kernels.decode`).

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length (cache + new tokens),
D head dim, R query rows flattened over batch and query positions.
"""

from __future__ import annotations

import torch

from loki.kernels.decode import decode_attention
from loki.reference import (
    dense_attention,
    exact_topk_attention,
    h2o_attention,
    pcaattn_attention,
    quest_attention,
    rotate_keys,
    sparq_attention,
)
from loki.reference.teacher_forced import teacher_forced_rows

from .config import BASIS_METHODS, METHODS
from .metadata import direct_ranges
from .rows import rotate_rows, triton_backend

__all__ = ["decode_rows", "loki_decode", "teacher_forced_attention"]


def teacher_forced_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    method: str = "loki",
    k: int | float = 1.0,
    d: int | float = 1.0,
    P: torch.Tensor | None = None,
    P_q: torch.Tensor | None = None,
    keys_rotated: bool = False,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    gqa_select: str = "query",
    aggregate: str = "sum",
    backend: str = "auto",
    chunk_elements: int | None = None,
    k_prefix: torch.Tensor | None = None,
    ranges: tuple | None = None,
) -> torch.Tensor:
    """Attention of every query row with decode-time semantics (teacher forcing).

    Row ``i`` (absolute position ``S - L + i``) attends like a decode step over the tokens it sees: with a
    causal mask and no padding, the ``S - L + i + 1`` first tokens, of which a fractional ``k`` selects
    ``ceil(k * (S - L + i + 1))``.  Several rows are computed at once as masked attention
    (:func:`loki.reference.teacher_forced.teacher_forced_rows`, blocks of at most ``chunk_elements`` scores).

    query: [B, HQ, L, D] (post-rotary, original coordinates); key, value: [B, HKV, S, D] (post-rotary keys,
    already in the basis when ``keys_rotated``); P: [HKV, D, D] basis of this layer (needed for "loki" and
    "pcaattn"); P_q: the query transform of a score basis (default P, an orthogonal basis);
    attention_mask: optional [B, 1, L, S] bool (True = attend) or additive float mask; without it the L rows are
    the last L of the S keys (causal, every key valid); every row's visible tokens must be one contiguous range.
    ``ranges``: ``(starts, lengths, any_)`` ([B, L] each), what every row sees, already known (a model forward's
    step metadata); the mask is not read then.  Returns [B, HQ, L, D] in query's dtype; rows that
    see no token return zeros.  ``method="h2o"`` is not supported (it is sequential by nature).
    ``k_prefix``: optional [B, HKV, S, dp] contiguous copy of the rotated keys' first dims, used by the Triton
    Loki path on single-row (decode) calls.
    """
    B, HQ, L, D = query.shape
    _, HKV, S, _ = key.shape
    if method == "h2o":
        raise ValueError("teacher_forced_attention does not support method='h2o'")
    if P_q is None:
        P_q = P
    if method in BASIS_METHODS:
        if P is None:
            raise ValueError(f"method={method!r} needs the layer's basis P [HKV, D, D]")
        q_use = rotate_rows(query, P_q)
        k_use = key if keys_rotated else rotate_keys(key, P)
    else:
        if keys_rotated:
            if P is None:
                raise ValueError("keys_rotated=True needs P to rotate the queries")
            q_use = rotate_rows(query, P_q)  # Lemma 1: exact and dense scores are invariant
        else:
            q_use = query
        k_use = key
    if method == "sparq" and keys_rotated:
        raise ValueError("SparQ works in the keys' own coordinates; pass unrotated keys")
    if ranges is None:
        g = direct_ranges(k, B, L, S, query.device, attention_mask)
        ranges = (g.starts, g.lengths, g.any_)
    starts, lengths, any_ = ranges  # [B, L]
    if L == 1:  # plain decode step: the cache in place, no row gather, no host sync
        kp = k_prefix[:, :, :S] if k_prefix is not None else None
        o = decode_rows(method, q_use[:, :, 0], k_use, value, k=k, d=d, lengths=lengths[:, 0], starts=starts[:, 0],
                        gqa_select=gqa_select, aggregate=aggregate, scale=scale, backend=backend, k_prefix=kp)
        return o.to(query.dtype)[:, :, None].masked_fill(~any_[:, None, :, None], 0)
    # rows that see no token come back as zeros
    starts, lengths = torch.where(any_, starts, 0), torch.where(any_, lengths, 0)
    return teacher_forced_rows(q_use, k_use, value, starts, lengths, method=method, k_budget=k, d=d, scale=scale,
                               gqa_select=gqa_select, aggregate=aggregate, block_elements=chunk_elements)


def decode_rows(method, q, kc, vc, *, k, d, lengths, starts, gqa_select, aggregate, scale, backend,
                 acc=None, recent_fraction=0.5, k_prefix=None):
    """Dispatch one batch of decode-step rows. q: [R, HQ, D]; kc, vc: [R, HKV, S, D]; lengths, starts: [R]."""
    # k goes through as given: the one budget rule (loki._checks.budget_counts) keeps every valid token for an int
    # count above them
    lengths = lengths.to(torch.int32)
    starts = starts.to(torch.int32)
    if method == "loki":
        return loki_decode(q, kc, vc, d=d, k=k, lengths=lengths, starts=starts, gqa_select=gqa_select,
                           aggregate=aggregate, scale=scale, backend=backend, k_prefix=k_prefix)
    if method == "exact_topk":
        return exact_topk_attention(q, kc, vc, k=k, lengths=lengths, starts=starts, gqa_select=gqa_select,
                                    aggregate=aggregate, scale=scale)
    if method == "pcaattn":
        return pcaattn_attention(q, kc, vc, d=d, lengths=lengths, starts=starts, scale=scale)
    if method == "dense":
        return dense_attention(q, kc, vc, lengths, starts, scale=scale)
    if method == "sparq":
        return sparq_attention(q, kc, vc, r=d, k=k, lengths=lengths, starts=starts, scale=scale)
    if method == "quest":
        return quest_attention(q, kc, vc, k=k, lengths=lengths, starts=starts, gqa_select=gqa_select,
                               aggregate=aggregate, scale=scale)
    if method == "h2o":
        return h2o_attention(q, kc, vc, acc, k=k, lengths=lengths, starts=starts, scale=scale,
                             recent_fraction=recent_fraction, return_weights=True)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def loki_decode(q_hat, k_hat, v, *, d, k, lengths, starts, gqa_select, aggregate, scale, backend, k_prefix=None):
    """One decode step of Loki through ``loki.kernels.decode_attention`` (torch or Triton backend; the Triton
    path reads the approximate scores from the cache's contiguous key prefix when one is kept)."""
    backend = "triton" if triton_backend(backend, q_hat) else "torch"
    extra = {"k_prefix": k_prefix} if backend == "triton" and k_prefix is not None else {}
    # lengths and starts come from the step metadata (checked there): no second check, no host sync
    return decode_attention(q_hat, k_hat, v, d=d, k=k, lengths=lengths, starts=starts, backend=backend,
                            gqa_select=gqa_select, aggregate=aggregate, scale=scale, check_values=False, **extra)
