"""Dense decode attention and exact scores: the baselines every sparse method is measured against.

Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim.
"""

from __future__ import annotations

import torch

from .._checks import check_decode_inputs, valid_token_mask
from .common import default_scale, expand_to_query_heads

__all__ = ["dense_attention", "exact_scores", "masked_values"]


def masked_values(v_cache: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
                  compute_dtype: torch.dtype) -> torch.Tensor:
    """``v_cache`` [B, HKV, S, D] in ``compute_dtype`` with the rows outside each sequence's valid tokens set to
    zero: whatever those rows hold (stale data, NaN, inf) then never reaches the output, where a zero
    probability times NaN would be NaN."""
    valid = valid_token_mask(lengths, starts, v_cache.shape[2])
    return v_cache.to(compute_dtype).masked_fill(~valid[:, None, :, None], 0)


def exact_scores(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Unscaled scores q . K^T per query head, -inf outside each sequence's valid tokens.

    q: [B, HQ, D]; k_cache: [B, HKV, S, D] -> [B, HQ, S] in ``compute_dtype``.
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q, k_cache, k_cache, lengths, starts)
    G = HQ // HKV
    qg = q.to(compute_dtype).view(B, HKV, G, D)
    s = torch.einsum("bhgd,bhsd->bhgs", qg, k_cache.to(compute_dtype)).reshape(B, HQ, S)
    valid = valid_token_mask(lengths, starts, S)
    return s.masked_fill(~valid[:, None, :], float("-inf"))


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_weights: bool = False,
):
    """softmax(scale * q K^T) V over each sequence's valid tokens (and ``mask`` if given).

    q: [B, HQ, D]; k_cache, v_cache: [B, HKV, S, D]; lengths, starts: [B] (valid tokens
    ``starts <= s < lengths``); mask: optional [B, H, S] bool with H in {HQ, HKV}, True = attend.
    Returns out [B, HQ, D] in q's dtype (and the weights [B, HQ, S] in ``compute_dtype`` when asked).
    Computation in ``compute_dtype`` (fp32 by default; the tests also use fp64 and the input dtype).
    Cache rows outside ``[starts, lengths)`` are never read into the result (NaN there stays out).
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q, k_cache, v_cache, lengths, starts)
    s = exact_scores(q, k_cache, lengths, starts, compute_dtype=compute_dtype) * default_scale(D, scale)
    if mask is not None:
        if mask.dim() != 3 or mask.shape[0] != B or mask.shape[2] != S or mask.shape[1] not in (HQ, HKV):
            raise ValueError(f"mask must have shape [B, HQ or HKV, S]=[{B}, {HQ}|{HKV}, {S}], got {list(mask.shape)}")
        s = s.masked_fill(~expand_to_query_heads(mask.bool(), HQ), float("-inf"))
    p = torch.softmax(s, dim=-1)
    G = HQ // HKV
    v = masked_values(v_cache, lengths, starts, compute_dtype)
    out = torch.einsum("bhgs,bhsd->bhgd", p.view(B, HKV, G, S), v).reshape(B, HQ, D)
    out = out.to(q.dtype)
    return (out, p) if return_weights else out
