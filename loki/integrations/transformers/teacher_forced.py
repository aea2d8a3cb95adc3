"""Attention of every query row with decode-time semantics (teacher forcing): row ``i`` attends like a decode step
over the tokens it sees, computed for all rows at once by the reference (:func:`loki.reference.teacher_forced.
teacher_forced_rows`).  :func:`teacher_forced_rows_of` is what the attention function runs for a forward of more
than one row under ``semantics="decode"``; :func:`teacher_forced_attention` is the same on plain tensors.

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length (cache + new tokens),
D head dim.
"""

from __future__ import annotations

import torch

from loki.reference import rotate_keys
from loki.reference.teacher_forced import teacher_forced_rows
from loki.settings import LokiSettings, Method, ResolvedSettings

from .run import rotate_rows
from .state import LayerTransforms
from .step import LayerRanges, direct_plan

__all__ = ["teacher_forced_attention", "teacher_forced_rows_of"]


def teacher_forced_rows_of(s: ResolvedSettings, query, key, value, ranges: LayerRanges, *,
                           transforms: LayerTransforms, keys_rotated: bool, scale: float | None,
                           chunk_elements: int | None) -> torch.Tensor:
    """Every row of ``query`` [B, HQ, L, D] (its own coordinates) as a decode step of ``s.method`` over key, value
    [B, HKV, S, D] (keys in the basis when ``keys_rotated``), what each row sees from ``ranges``.  Returns
    [B, HQ, L, D] in query's dtype; rows that see no token give zeros."""
    if s.method is Method.H2O:
        raise ValueError("teacher-forced rows do not support method='h2o' (it is sequential by nature)")
    if s.method is Method.SPARQ and keys_rotated:
        raise ValueError("SparQ works in the keys' own coordinates; pass unrotated keys")
    if s.method.needs_basis or keys_rotated:
        if transforms.key is None:
            raise ValueError(f"method={s.method.value!r} needs the layer's basis (P [HKV, D, D])")
        q_use = rotate_rows(query, transforms.query)  # for the other methods: Lemma 1, scores are the same
        k_use = key if keys_rotated else rotate_keys(key, transforms.key)
    else:
        q_use, k_use = query, key
    starts, lengths, any_ = ranges.starts, ranges.lengths, ranges.any_  # [B, L]
    starts, lengths = torch.where(any_, starts, 0), torch.where(any_, lengths, 0)  # rows that see nothing: zeros
    return teacher_forced_rows(q_use, k_use, value, starts, lengths, method=s.method.value, k_budget=s.k, d=s.d,
                               scale=scale, block_elements=chunk_elements, score_dims=transforms.score_dims,
                               **s.kernel_args(), **s.reference_args())


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
    gqa_select: str = "auto",
    aggregate: str = "auto",
    chunk_elements: int | None = None,
    score_format: str = "native",
) -> torch.Tensor:
    """Attention of every query row with decode-time semantics (teacher forcing), on plain tensors.

    Row ``i`` (absolute position ``S - L + i``) attends like a decode step over the tokens it sees: with a
    causal mask and no padding, the ``S - L + i + 1`` first tokens, of which a fractional ``k`` selects
    ``ceil(k * (S - L + i + 1))``.  query: [B, HQ, L, D] (post-rotary, original coordinates); key, value:
    [B, HKV, S, D] (post-rotary keys, already in the basis when ``keys_rotated``); P: [HKV, D, D] basis of this
    layer (needed for "loki" and "pcaattn"); P_q: the query transform of a score basis (default P, an orthogonal
    basis); attention_mask: optional [B, 1, L, S] bool (True = attend) or additive float mask; without it the L rows
    are the last L of the S keys (causal, every key valid); every row's visible tokens must be one contiguous range.
    ``gqa_select`` / ``aggregate``: "auto" as ``enable_loki`` decides them (:class:`loki.LokiSettings`);
    ``score_format``: Loki's score copy of the keys' d leading dims ("native", the keys as given, by default).  Returns
    [B, HQ, L, D] in query's dtype; rows that see no token return zeros.  ``method="h2o"`` is not supported (it is
    sequential by nature).
    """
    B, HQ, L, D = query.shape
    HKV, S = key.shape[1], key.shape[2]
    s = LokiSettings(k=k, d=d, method=method, gqa_select=gqa_select, aggregate=aggregate,
                     backend="torch", score_format=score_format).resolve_shapes(num_q_heads=HQ, num_kv_heads=HKV,
                                                                                head_dim=D)
    if P is not None and P_q is None:
        P_q = P
    inverse = None if P_q is None else P_q.transpose(-1, -2)
    if keys_rotated and P is None:
        raise ValueError("keys_rotated=True needs P to rotate the queries")
    plan = direct_plan(s, B=B, L=L, S=S, device=query.device, attention_mask=attention_mask)
    out = teacher_forced_rows_of(s, query, key, value, plan.groups[0], transforms=LayerTransforms(P, P_q, inverse),
                                 keys_rotated=keys_rotated, scale=scale, chunk_elements=chunk_elements)
    return out.to(query.dtype)
