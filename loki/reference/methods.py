"""Decode-time attention methods of the Loki paper, in plain PyTorch: the single reference used by the
tests, the Triton kernels, the benchmarks and the integrations.

- ``loki_attention``: Loki, Algorithm 1 (approximate scores from d principal dims, top-k, exact attention
  over the selected tokens on the rotated keys, Lemma 1).
- ``exact_topk_attention``: oracle selection by exact scores, then exact attention.
- ``pcaattn_attention``: PCAAttn (paper appendix): attention computed with the first d rotated dims only.
- ``sparq_attention``: SparQ (Ribar et al. 2023): top-r |q| components, scaled approximate softmax, top-k,
  mean-value reallocation.
- ``h2o_attention``: H2O (Zhang et al. 2023): heavy hitters by accumulated attention plus a recent window,
  the budget split equally.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim,
d leading principal dims, r SparQ query components, K selected tokens.
Tokens ``starts[b] <= s < lengths[b]`` of sequence b are valid; k and d are counts (int) or fractions
(float) resolved per sequence (k from the valid length, at least 1).
"""

from __future__ import annotations

import torch

from .._checks import check_decode_inputs, resolve_d, valid_token_mask
from .accounting import diagnosing, record_components, record_diagnostics, record_selection, tallying
from .common import default_scale, expand_to_query_heads
from .dense import dense_attention, exact_scores, masked_values
from .selection import agreement_budget, approx_scores, budget, group_selection, topk_indices
from .sparse import select_and_attend

__all__ = [
    "loki_attention",
    "exact_topk_attention",
    "pcaattn_attention",
    "sparq_attention",
    "h2o_attention",
]


def loki_attention(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    d: int | float,
    k: int | float | None = None,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    gqa_select: str,
    aggregate: str,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_indices: bool = False,
    counts: torch.Tensor | None = None,
    score_format: str = "native",
):
    """Loki (Algorithm 1) on keys already stored in the PCA basis.

    q_hat: [B, HQ, D] (q P, see ``rotate_query``); k_hat: [B, HKV, S, D] (K P); v_cache: [B, HKV, S, D].
    The budget is ``k`` (an int count or a fraction, resolved per sequence by ``budget``) or ``counts`` ([B] int,
    the tokens each sequence attends, already resolved; exactly one of the two).
    Returns out [B, HQ, D] (and ``(idx [B, H, K], counts)`` when ``return_indices``: counts [B], or [B, HKV]
    for the ``"agreement"`` aggregate, whose KV heads read different numbers of tokens).
    ``gqa_select="query"`` (as the paper's code) selects per query head; ``"kv"`` shares one selection per KV
    head, from the group's scores combined by ``aggregate`` (one of ``GQA_AGGREGATES``:
    :func:`~loki.reference.selection.aggregate_group_scores`; not read for "query").  Both are required: the
    library's defaults are decided by :class:`loki.LokiSettings`.  ``score_format``: how the approximate scores
    read the leading dims (:mod:`loki.reference.score_formats`); the attention reads the keys as given.
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q_hat, k_hat, v_cache, lengths, starts)
    if (k is None) == (counts is None):
        raise ValueError("give the budget as exactly one of k (a count or a fraction) and counts ([B] int)")
    head_scores, s = approx_scores(q_hat, k_hat, d, lengths, starts, gqa_select=gqa_select, aggregate=aggregate,
                                   scale=scale, compute_dtype=compute_dtype, return_both=True,
                                   score_format=score_format)
    if counts is None:
        counts = budget(k, lengths, starts, B, S, q_hat.device)
    if gqa_select == "kv" and aggregate == "agreement":
        counts = agreement_budget(head_scores, HKV, counts, lengths - starts)
    out, idx = select_and_attend(s, counts, q_hat, k_hat, v_cache, lengths - starts, scale=scale,
                                 compute_dtype=compute_dtype)
    return (out, (idx, counts)) if return_indices else out


def exact_topk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    k: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    gqa_select: str,
    aggregate: str,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_indices: bool = False,
):
    """Oracle top-k: select by exact scores q . K^T, then exact attention over the selected tokens.

    q: [B, HQ, D]; k_cache, v_cache: [B, HKV, S, D] -> out [B, HQ, D] (and ``(idx, counts)``).
    Same as ``loki_attention`` with d = D in any orthogonal basis.
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q, k_cache, v_cache, lengths, starts)
    s = exact_scores(q, k_cache, lengths, starts, compute_dtype=compute_dtype)
    counts = budget(k, lengths, starts, B, S, q.device)
    if gqa_select == "kv":
        s, counts = group_selection(s, counts, HKV, aggregate, valid_token_mask(lengths, starts, S), lengths - starts,
                                    default_scale(D, scale))
    elif gqa_select != "query":
        raise ValueError(f"gqa_select must be 'query' or 'kv', got {gqa_select!r}")
    out, idx = select_and_attend(s, counts, q, k_cache, v_cache, lengths - starts, scale=scale,
                                 compute_dtype=compute_dtype)
    return (out, (idx, counts)) if return_indices else out


def pcaattn_attention(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    d: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """PCAAttn: softmax(scale * q_hat[:d] K_hat[:, :d]^T) V over all valid tokens (scale 1/sqrt(D)).

    q_hat: [B, HQ, D]; k_hat, v_cache: [B, HKV, S, D] -> [B, HQ, D].
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q_hat, k_hat, v_cache, lengths, starts)
    dd = resolve_d(d, D)
    s = approx_scores(q_hat, k_hat, dd, lengths, starts, compute_dtype=compute_dtype, gqa_select="query",
                      aggregate="sum") * default_scale(D, scale)
    p = torch.softmax(s, dim=-1)
    v = masked_values(v_cache, lengths, starts, compute_dtype)
    out = torch.einsum("bhgs,bhsd->bhgd", p.view(B, HKV, HQ // HKV, S), v)
    return out.reshape(B, HQ, D).to(q_hat.dtype)


def sparq_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    r: int | float,
    k: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_indices: bool = False,
):
    """SparQ attention (Ribar et al. 2023, Algorithm 1), per query head.

    1. i1 = the r components of largest |q|;
    2. s_hat = softmax(q[i1] . K[:, i1]^T / sqrt(D * ||q[i1]||_1 / ||q||_1));
    3. i2 = top-k of s_hat;  alpha = sum(s_hat[i2]);
    4. y = softmax(scale * q . K[i2]^T) V[i2];
    5. out = alpha * y + (1 - alpha) * mean(V over valid tokens).
    q: [B, HQ, D]; k_cache, v_cache: [B, HKV, S, D]; r and k counts or fractions -> [B, HQ, D].
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q, k_cache, v_cache, lengths, starts)
    rr = resolve_d(r, D, name="r")
    qf = q.to(compute_dtype)
    i1 = topk_indices(qf.abs(), rr)  # [B, HQ, r], ties to the lowest component
    q_r = torch.gather(qf, -1, i1)
    # K[:, i1] per query head: gather columns of the head's KV rows.
    kq = expand_to_query_heads(k_cache, HQ).to(compute_dtype)  # [B, HQ, S, D]
    k_r = torch.gather(kq, -1, i1[:, :, None, :].expand(B, HQ, S, rr))
    l1_ratio = q_r.abs().sum(-1) / qf.abs().sum(-1).clamp_min(torch.finfo(compute_dtype).tiny)
    temp = torch.sqrt(D * l1_ratio).clamp_min(torch.finfo(compute_dtype).tiny)  # [B, HQ]
    s_hat = torch.einsum("bhr,bhsr->bhs", q_r, k_r) / temp[..., None]
    valid = valid_token_mask(lengths, starts, S)
    s_hat = torch.softmax(s_hat.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    counts = budget(k, lengths, starts, B, S, q.device)
    y, idx = select_and_attend(s_hat, counts, q, k_cache, v_cache, lengths - starts, scale=scale,
                               compute_dtype=compute_dtype)
    if tallying():
        record_components(i1[:, :, None, :], (lengths - starts)[:, None], HKV, D)  # the key components read
    keep = idx >= 0
    alpha = (torch.gather(s_hat, -1, idx.clamp(min=0)) * keep).sum(-1)  # [B, HQ]
    n = valid.sum(-1).to(compute_dtype)  # [B]
    v_mean = masked_values(v_cache, lengths, starts, compute_dtype).sum(2) / n[:, None, None]  # [B, HKV, D]
    v_mean = expand_to_query_heads(v_mean, HQ)
    out = alpha[..., None] * y.to(compute_dtype) + (1 - alpha[..., None]) * v_mean
    out = out.to(q.dtype)
    return (out, (idx, counts)) if return_indices else out


def h2o_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    acc_scores: torch.Tensor,
    *,
    k: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    recent_fraction: float = 0.5,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_weights: bool = False,
):
    """H2O: attend to the ``k - w`` heavy hitters plus the ``w = floor(recent_fraction * k)`` most recent
    tokens (an equal split by default).

    Heavy hitters are the tokens outside the recent window with the largest accumulated attention
    ``acc_scores`` ([B, HQ, S] or [B, HKV, S]: the sum of the attention each token received from earlier
    queries; the caller accumulates the returned weights). This is the mask form of H2O used to evaluate
    it at a matched budget (no eviction state), as in the Loki paper's comparison.
    q: [B, HQ, D]; k_cache, v_cache: [B, HKV, S, D] -> out [B, HQ, D] (and weights [B, HQ, S]).
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q, k_cache, v_cache, lengths, starts)
    a = acc_scores
    if a.dim() != 3 or a.shape[0] != B or a.shape[2] != S or a.shape[1] not in (HQ, HKV):
        raise ValueError(f"acc_scores must have shape [B, HQ or HKV, S]=[{B}, {HQ}|{HKV}, {S}], got {list(a.shape)}")
    if not 0.0 <= recent_fraction <= 1.0:
        raise ValueError(f"recent_fraction={recent_fraction} must lie in [0, 1]")
    counts = budget(k, lengths, starts, B, S, q.device)
    recent = torch.floor(counts.double() * recent_fraction).long()
    heavy = counts - recent
    pos = torch.arange(S, device=q.device)[None, :]
    L = lengths.long()[:, None]
    valid = valid_token_mask(lengths, starts, S)
    in_recent = (pos >= L - recent[:, None]) & valid  # [B, S]
    H = acc_scores.shape[1]
    cand = acc_scores.to(compute_dtype).masked_fill(~(valid & ~in_recent)[:, None, :], float("-inf"))
    mask = in_recent[:, None, :].expand(B, H, S).clone()
    hmax = int(heavy.max()) if B else 0
    if hmax > 0:
        top = topk_indices(cand, hmax)  # [B, H, hmax], ties to the earliest token
        keep = torch.arange(hmax, device=q.device)[None, None, :] < heavy[:, None, None]
        mask.scatter_(-1, top, keep | mask.gather(-1, top))
    if tallying():
        record_selection(mask[:, :, None], (lengths - starts).reshape(B, 1), HKV)
    if diagnosing():  # recall of the exact top-k set, attention mass (loki.reference.accounting)
        exact = exact_scores(q, k_cache, lengths, starts, compute_dtype=compute_dtype)
        record_diagnostics(mask[:, :, None], exact[:, :, None], valid[:, None, None, :], counts[:, None],
                           (lengths - starts).reshape(B, 1), default_scale(D, scale))
    return dense_attention(q, k_cache, v_cache, lengths, starts, scale=scale, mask=mask,
                           compute_dtype=compute_dtype, return_weights=return_weights)
