"""Exact attention over selected tokens only (Loki Algorithm 1, lines 6-7), in plain PyTorch.

Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim, K selected
tokens, H the selection's head axis (HQ or HKV).
"""

from __future__ import annotations

import torch

from .._checks import check_row_counts
from .accounting import record_indices, tallying
from .common import default_scale, gather_rows
from .selection import select_topk

__all__ = ["select_and_attend", "sparse_attention"]


def select_and_attend(scores, counts, q_hat, k_hat, v_cache, n_visible, *, scale=None,
                      compute_dtype: torch.dtype = torch.float32):
    """The top ``counts`` tokens of each row of ``scores`` [B, H, S] (:func:`~loki.reference.selection.select_topk`,
    tallied for the bytes accounting when it runs, ``n_visible`` [B] tokens per sequence) and exact attention over
    them (:func:`sparse_attention`): returns (out [B, HQ, D], idx [B, H, K]).  The shared tail of the selecting
    references."""
    idx = select_topk(scores, counts)
    if tallying():  # the bytes accounting (loki.reference.accounting)
        B, HKV, S, _ = k_hat.shape
        record_indices(idx, n_visible, HKV, S)
    return sparse_attention(q_hat, k_hat, v_cache, idx, counts, scale=scale, compute_dtype=compute_dtype), idx


def sparse_attention(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    idx: torch.Tensor,
    counts: torch.Tensor,
    *,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
):
    """softmax(scale * q_hat K_hat[idx]^T) V[idx] over the first ``counts[b]`` entries of each idx row.

    By Lemma 1 the scores against the full-dimension rotated keys equal the original q . k, so the
    result is exact attention restricted to the selected tokens.
    q_hat: [B, HQ, D]; k_hat, v_cache: [B, HKV, S, D]; idx: [B, H, K] int (H in {HQ, HKV}; entries at
    positions >= the row's count are ignored); counts: [B], or [B, H] (a count per idx row) -> out [B, HQ, D] in
    q_hat's dtype
    (and the log-sum-exp of the scaled scores, [B, HQ] fp32, when ``return_lse``).
    """
    B, HQ, D = q_hat.shape
    if idx.dim() != 3 or idx.shape[0] != B:
        raise ValueError(f"idx must have shape [B, H, K] with B={B}, got {list(idx.shape)}")
    K = idx.shape[2]
    per_row = check_row_counts(counts, B, idx.shape[1])  # H = idx.shape[1]
    if B and (int(counts.min()) < 1 or int(counts.max()) > K):
        raise ValueError(f"counts must lie in [1, K={K}] (K = idx.shape[2]), got {counts.tolist()}")
    kg = gather_rows(k_hat, idx, HQ).to(compute_dtype)  # [B, HQ, K, D]
    vg = gather_rows(v_cache, idx, HQ).to(compute_dtype)
    s = torch.einsum("bhd,bhkd->bhk", q_hat.to(compute_dtype), kg) * default_scale(D, scale)
    c = counts.to(idx.device)
    c = c.repeat_interleave(HQ // c.shape[1], dim=1) if per_row else c[:, None]  # [B, HQ] or [B, 1]
    keep = torch.arange(K, device=idx.device)[None, None, :] < c[:, :, None]
    s = s.masked_fill(~keep, float("-inf"))
    vg = vg.masked_fill(~keep[..., None], 0)  # padding entries read row 0, which may be invalid (NaN)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhk,bhkd->bhd", p, vg).to(q_hat.dtype)
    return (out, lse.float()) if return_lse else out
