"""Approximate scores (Loki Algorithm 1, lines 3-4) and top-k selection, in plain PyTorch.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim,
d leading principal dims, K selected tokens, H the selection's head axis (HQ for per-query-head
selection, HKV for per-KV-head selection).
"""

from __future__ import annotations

import torch

from loki.settings import KERNEL_AGGREGATES as _KERNEL_AGGREGATES
from loki.settings import Aggregate, GQAMode

from .._checks import (
    budget_counts,
    check_budget,
    check_decode_inputs,
    check_row_counts,
    resolve_d,
    resolve_scale,
    valid_token_mask,
)
from .score_formats import quantize_score_keys

__all__ = ["DEFAULT_KV_AGGREGATE", "GQA_SELECT_MODES", "GQA_AGGREGATES", "KERNEL_AGGREGATES", "approx_scores",
           "aggregate_group_scores", "agreement_budget", "agreement_counts", "budget", "check_kernel_aggregate",
           "group_selection", "group_union_sizes", "select_topk", "selection_mask", "token_ranks", "topk_indices"]

#: "query": every query head selects its own tokens (the paper's code repeats KV heads).  "kv": one selection per KV
#: head from the group's aggregated scores; each selected KV row is read once (``enable_loki``'s default for method
#: "loki" on a GQA model).  The functions here take the mode explicitly (``loki.settings`` decides the defaults).
GQA_SELECT_MODES = tuple(m.value for m in GQAMode if m is not GQAMode.AUTO)
#: How the scores of a GQA group are combined for a shared ("kv") selection (:func:`aggregate_group_scores`).
GQA_AGGREGATES = tuple(a.value for a in Aggregate if a is not Aggregate.AUTO)
#: The aggregates the Triton kernels implement ("union" and "agreement" run on the PyTorch reference only).
KERNEL_AGGREGATES = tuple(a for a in GQA_AGGREGATES if Aggregate(a) in _KERNEL_AGGREGATES)
#: The aggregate of a shared selection by default: ``enable_loki(..., aggregate="auto")`` for method "loki" with
#: one selection per KV group, and the accuracy suite's kv rows (each head's scores softmax-normalised before the
#: group's maximum: the most accurate shared selection the kernels run).
DEFAULT_KV_AGGREGATE = Aggregate.SOFTMAX_MAX.value


def _check_mode(gqa_select: str, aggregate: str) -> None:
    if gqa_select not in GQA_SELECT_MODES:
        raise ValueError(f"gqa_select must be one of {GQA_SELECT_MODES}, got {gqa_select!r}")
    if aggregate not in GQA_AGGREGATES:
        raise ValueError(f"aggregate must be one of {GQA_AGGREGATES}, got {aggregate!r}")


def check_kernel_aggregate(aggregate: str, what: str = "the Triton kernels") -> None:
    """Refuse an ``aggregate`` the Triton kernels do not implement (no silent fallback to another one)."""
    if aggregate in KERNEL_AGGREGATES:
        return
    if aggregate not in GQA_AGGREGATES:
        raise ValueError(f"aggregate must be one of {GQA_AGGREGATES}, got {aggregate!r}")
    raise ValueError(f"aggregate={aggregate!r} is not implemented by {what} (they implement {KERNEL_AGGREGATES}); "
                     "use backend='torch' (the PyTorch reference) for it")


def aggregate_group_scores(scores: torch.Tensor, HKV: int, aggregate: str, *,
                           scale: float | None = None) -> torch.Tensor:
    """Combine per-query-head selection scores [B, HQ, ..., S] (e.g. [B, HQ, S], or [B, HQ, R, S] for rows of a
    window; the last dim holds the tokens, ``-inf`` the tokens a row does not see) into per-KV-head scores
    [B, HKV, ..., S] whose top-k is the group's shared selection:

    - ``"sum"``, ``"max"``: the raw scores summed or max'ed over the G heads of the group;
    - ``"softmax-sum"``, ``"softmax-max"``: each head's scores first turned into a softmax over the row's tokens
      with the attention scale, ``softmax(scale * s)`` (``scale`` required), then summed or max'ed over the group.
      Returned as the log of that sum or max (``logsumexp`` / max over the group of ``log_softmax``): the same
      order of tokens, without probabilities underflowing into ties.  Invariant to a constant added to one head's
      scores;
    - ``"union"``: each head ranks the row's tokens (rank 0 the largest score, ties to the lowest position, as
      :func:`topk_indices`), and a token's group score is minus its best rank over the group's heads.  The top-k
      of these scores is the round-robin merge of the heads' rankings: the union of every head's top-r tokens for
      the largest r whose union has at most k tokens, topped up with tokens of best rank r, lowest position first.
      So a KV head reads exactly k tokens; when the union of every head's top-ceil(k/G) tokens holds k or more
      tokens the selection lies within it (trimmed to the best ranks), otherwise it contains it (topped up).
      Depends on each head's order of tokens only.  fp32 scores (fp64 for fp64 input).
    - ``"agreement"``: the order of ``"softmax-max"``; what differs is the budget: the KV heads of a layer share
      their step's tokens in proportion to how much each group's heads disagree (:func:`agreement_counts`).

    With G = 1 every aggregate selects what per-query-head selection selects.
    """
    if aggregate not in GQA_AGGREGATES:
        raise ValueError(f"aggregate must be one of {GQA_AGGREGATES}, got {aggregate!r}")
    B, HQ = scores.shape[:2]
    rest = scores.shape[2:]

    def group(x):
        return x.reshape(B, HKV, HQ // HKV, *rest)

    if aggregate == "sum":
        return group(scores).sum(dim=2)
    if aggregate == "max":
        return group(scores).amax(dim=2)
    if aggregate == "union":
        best = group(token_ranks(scores)).amin(dim=2)
        return -best.to(torch.float64 if scores.dtype == torch.float64 else torch.float32)
    if scale is None:
        raise ValueError(f"aggregate={aggregate!r} needs the attention scale (scale=1/sqrt(D))")
    if aggregate == "agreement":
        aggregate = "softmax-max"
    lp = torch.log_softmax(scores * scale, dim=-1)
    lp = lp.masked_fill(torch.isneginf(scores), float("-inf"))  # a row that sees nothing: -inf, not NaN
    if aggregate == "softmax-sum":
        return torch.logsumexp(group(lp), dim=2)
    return group(lp).amax(dim=2)


def group_union_sizes(head_selection: torch.Tensor, HKV: int) -> torch.Tensor:
    """How many distinct tokens the query heads of each GQA group select together: ``head_selection``
    [B, HQ, ..., S] bool (each query head's own selection) -> [B, HKV, ...] int64, between the largest head's count
    (the heads agree) and G times it (they pick disjoint tokens)."""
    B, HQ = head_selection.shape[:2]
    return head_selection.reshape(B, HKV, HQ // HKV, *head_selection.shape[2:]).any(dim=2).sum(dim=-1)


def agreement_counts(union_sizes: torch.Tensor, counts: torch.Tensor, n_visible: torch.Tensor) -> torch.Tensor:
    """The per-KV-head budgets of the ``"agreement"`` aggregate: a step's ``HKV * counts`` tokens (what one shared
    selection of ``counts`` per KV head reads) shared among the KV heads of the layer in proportion to
    ``union_sizes`` (:func:`group_union_sizes` of the heads' own top-``counts`` sets: a group whose heads disagree
    gets more), rounded by largest remainders (ties to the lower KV head), each capped at the row's visible tokens.

    union_sizes: [B, HKV, ...] int; counts, n_visible: [B, ...] int (broadcastable) -> [B, HKV, ...] int64.  Exact
    integer arithmetic, so every caller (the decode references, the teacher-forced engine) gets the same budgets.
    A row whose union sizes are all 0 (no budget) keeps ``counts`` per head."""
    u = union_sizes.long()
    HKV = u.shape[1]
    counts = counts.long().unsqueeze(1).expand_as(u)
    total = counts * HKV  # [B, HKV, ...], the same along the head axis
    denom = u.sum(dim=1, keepdim=True).expand_as(u)
    num = total * u
    base = torch.where(denom > 0, num // denom.clamp_min(1), counts)
    rem = torch.where(denom > 0, num % denom.clamp_min(1), 0)  # fractional parts, over a denominator shared by row
    short = total[:, :1] - base.sum(dim=1, keepdim=True)  # tokens still to hand out (< HKV)
    # head i's place among its row's heads by fractional part, largest first, ties to the lower head: the heads j
    # ahead of it ([B, i, j, ...] below)
    heads = torch.arange(HKV, device=u.device).view(1, HKV, *([1] * (u.dim() - 2)))
    r_i, r_j = rem.unsqueeze(2), rem.unsqueeze(1)
    ahead = ((r_j > r_i) | ((r_j == r_i) & (heads.unsqueeze(1) < heads.unsqueeze(2)))).sum(dim=2)
    out = base + (ahead < short).long()
    return torch.minimum(out, n_visible.long().unsqueeze(1).expand_as(out))


def agreement_budget(head_scores: torch.Tensor, HKV: int, counts: torch.Tensor,
                     n_visible: torch.Tensor) -> torch.Tensor:
    """Per-KV-head budgets [B, HKV] of the ``"agreement"`` aggregate for decode steps: ``head_scores`` [B, HQ, S]
    (each query head's selection scores, -inf outside the visible tokens), ``counts``, ``n_visible`` [B]."""
    sel = selection_mask(select_topk(head_scores, counts), head_scores.shape[-1])
    return agreement_counts(group_union_sizes(sel, HKV), counts, n_visible)


def group_selection(head_scores: torch.Tensor, counts: torch.Tensor, HKV: int, aggregate: str, valid: torch.Tensor,
                    n_visible: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One selection per KV group (``gqa_select="kv"``) from per-query-head selection scores ``head_scores``
    [B, HQ, S] (-inf outside the visible tokens): the group's scores [B, HKV, S] (:func:`aggregate_group_scores`,
    -inf outside ``valid`` [B, S]) and the budget (``counts``, or per KV head the ``"agreement"`` aggregate's
    :func:`agreement_budget` from the heads' own selections; ``n_visible`` [B])."""
    if aggregate == "agreement":
        counts = agreement_budget(head_scores, HKV, counts, n_visible)
    s = aggregate_group_scores(head_scores, HKV, aggregate, scale=scale)
    return s.masked_fill(~valid[:, None, :], float("-inf")), counts


def selection_mask(idx: torch.Tensor, S: int) -> torch.Tensor:
    """The tokens ``idx`` [..., K] (int, -1 pads) select as a bool mask [..., S]."""
    sel = torch.zeros(*idx.shape[:-1], S + 1, dtype=torch.bool, device=idx.device)
    sel.scatter_(-1, torch.where(idx >= 0, idx, S).long(), True)  # pads land in the spare slot S
    return sel[..., :S]


def approx_scores(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    d: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    *,
    gqa_select: str,
    aggregate: str,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_both: bool = False,
    score_format: str = "native",
):
    """Approximate scores from the first d rotated dims: ``q_hat[:d] . K_hat[:, :d]^T`` (unscaled).

    q_hat: [B, HQ, D]; k_hat: [B, HKV, S, D] -> [B, H, S] in ``compute_dtype``, -inf outside valid
    tokens; H = HQ for ``gqa_select="query"``, HKV for ``"kv"`` (group scores combined by ``aggregate``,
    :func:`aggregate_group_scores`; the softmax aggregates use ``scale``, default ``1/sqrt(D)``).
    ``return_both`` returns ``(per_query_head [B, HQ, S], result)`` from the same pass (as the kernels'
    ``approx_scores``).  ``score_format``: the keys' dims as the score copy holds them
    (:func:`loki.reference.score_formats.quantize_score_keys`; "native", the cache's own, by default).
    """
    _check_mode(gqa_select, aggregate)
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q_hat, k_hat, k_hat, lengths, starts)
    dd = resolve_d(d, D)
    qg = q_hat[..., :dd].to(compute_dtype).view(B, HKV, HQ // HKV, dd)
    k_lead = quantize_score_keys(k_hat[..., :dd], score_format)
    s = torch.einsum("bhgd,bhsd->bhgs", qg, k_lead.to(compute_dtype)).reshape(B, HQ, S)
    valid = valid_token_mask(lengths, starts, S)
    heads = s = s.masked_fill(~valid[:, None, :], float("-inf"))
    if gqa_select == "kv":
        s = aggregate_group_scores(s, HKV, aggregate, scale=resolve_scale(scale, D))
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return (heads, s) if return_both else s


def budget(k: int | float, lengths: torch.Tensor | None, starts: torch.Tensor | None, B: int, S: int,
           device: torch.device | None = None) -> torch.Tensor:
    """Tokens to select per sequence, [B] int64, from a count or a fraction of each valid length
    (:func:`loki._checks.budget_counts`, the one budget rule: an int count above the valid tokens keeps them all)."""
    n = torch.full((B,), S, dtype=torch.long, device=device) if lengths is None else lengths.long()
    if starts is not None:
        n = n - starts.long()
    return budget_counts(check_budget(k), n)


def _order_keys(scores: torch.Tensor) -> torch.Tensor:
    """One unique int64 key per fp32/fp16/bf16 score whose descending order is the selection order: the
    order-preserving 32 bits of the fp32 score above the complemented position (ties to the lowest position;
    -0.0 equals +0.0; NaN above every number)."""
    S = scores.shape[-1]
    x = scores.float() + 0.0  # -0.0 + 0.0 = +0.0: -0.0 ties with +0.0 (and x is a new tensor)
    x = torch.where(torch.isnan(x), float("nan"), x)  # one NaN bit pattern (positive: above +inf); no host sync
    bits = x.view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: flip the magnitude bits; signed int order == float order
    rev = 0xFFFFFFFF - torch.arange(S, device=scores.device, dtype=torch.long)  # a lower position: a larger key
    return (key.long() << 32) | rev


def topk_indices(scores: torch.Tensor, K: int, *, sorted: bool = True) -> torch.Tensor:
    """Indices of the K largest entries along the last dim, ties broken by the lowest index first.

    The one tie rule of every selection in Loki (this reference, the ``torch`` method of the kernels and the
    Triton threshold select): among equal scores the token with the lowest position is taken first; -0.0 and
    +0.0 are equal; NaN ranks above every number (as in ``torch.topk``).  ``torch.topk`` alone leaves the
    order of ties unspecified (it differs between CPU and CUDA and with the row length), so the scores are
    made unique first: fp32/fp16/bf16 scores become one int64 key per entry, the order-preserving 32 bits of
    the fp32 score above the complemented position, and ``torch.topk`` runs on the keys; fp64 scores use a
    stable descending sort.  ``sorted=True`` returns them by decreasing score (ties by increasing index);
    ``sorted=False`` in unspecified order (the same set).
    scores: [..., S] floating -> [..., K] int64.
    """
    S = scores.shape[-1]
    if not 0 <= K <= S:
        raise ValueError(f"K={K} must lie in [0, S={S}]")
    if scores.dtype == torch.float64:
        x = torch.where(scores == 0, 0.0, scores)
        return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :K]
    top = torch.topk(_order_keys(scores), K, dim=-1, sorted=sorted).values
    return 0xFFFFFFFF - (top & 0xFFFFFFFF)


def token_ranks(scores: torch.Tensor) -> torch.Tensor:
    """The rank of every entry in the selection order of its row (0 = selected first; :func:`topk_indices`'s
    order, ties to the lowest index): scores [..., S] floating -> [..., S] int64."""
    S = scores.shape[-1]
    if scores.dtype == torch.float64:
        x = torch.where(scores == 0, 0.0, scores)
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices
    else:
        order = 0xFFFFFFFF - (torch.sort(_order_keys(scores), dim=-1, descending=True).values & 0xFFFFFFFF)
    pos = torch.arange(S, device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, pos)


def select_topk(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Indices of the ``counts`` largest scores of every row (Loki Algorithm 1, line 5).

    scores: [B, H, S] (-inf marks tokens that may not be chosen); counts: [B] int (one budget per sequence) or
    [B, H] (one per row, as the ``"agreement"`` aggregate gives), 1 <= each count <= the finite scores of its row
    -> idx: [B, H, K] int64 with K = the largest count, sorted by decreasing score, ties by increasing token
    position (:func:`topk_indices`); entries at positions >= the row's count are -1 (padding).  An empty batch
    (B = 0) gives idx [0, H, 0].
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must have shape [B, H, S], got {list(scores.shape)}")
    B, H, S = scores.shape
    per_row = check_row_counts(counts, B, H)
    if B == 0:
        return torch.empty(0, H, 0, dtype=torch.long, device=scores.device)
    kmax = int(counts.max())
    if kmax < 1 or kmax > S or int(counts.min()) < 1:
        raise ValueError(f"counts must lie in [1, S={S}], got {counts.tolist()}")
    idx = topk_indices(scores, kmax)
    c = counts.to(scores.device)
    keep = torch.arange(kmax, device=scores.device) < (c[:, :, None] if per_row else c[:, None, None])
    return idx.masked_fill(~keep, -1)
