"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference"), in plain
PyTorch: the decode reference ``quest_attention`` and the page selection the teacher-forced rows share with it.

The keys of a sequence are grouped in pages of ``page_size`` tokens (16 by default, as in Quest), aligned to the
sequence's first valid token: page ``p`` holds the tokens ``starts + p * page_size <= s < starts + (p + 1) *
page_size``.  Per page and channel the page metadata keeps the smallest and largest key, ``m_p`` and ``M_p``
([D] each).  A query ``q`` bounds its score with any key of the page from above by

    u_p = sum_j max(q_j M_pj, q_j m_pj)      (Quest, Algorithm 1, "criticality" of a page)

The page holding the current token (the last valid one) is always kept, as in Quest; of the other pages the
``ceil(k / page_size) - 1`` with the largest bound are selected (ties to the lowest page), so a row selects
``ceil(k / page_size)`` pages.  Exact attention then runs over the valid tokens of the selected pages.

GQA: by default each query head selects its own pages (``gqa_select="query"``, the paper's per-head selection);
``gqa_select="kv"`` shares one selection per KV head, the group's page bounds combined by ``aggregate`` as the other
methods combine token scores (:func:`~loki.reference.selection.aggregate_group_scores`; "agreement" is not defined
for pages).

A decode step reads the page metadata (``2 D`` values per page and KV head: ``1 / page_size`` of the bytes of the
keys and values) and then the keys and values of the selected pages' tokens (:mod:`loki.reference.accounting`).

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim, P pages,
R query rows (one for a decode step), H the selection's head axis (HQ for per-query-head selection, HKV for
per-KV-head selection), K selected tokens.
"""

from __future__ import annotations

from numbers import Integral

import torch

from .._checks import check_decode_inputs, valid_token_mask
from .accounting import QUEST_PAGE_SIZE, record_selection, tallying
from .common import default_scale
from .dense import dense_attention
from .selection import GQA_AGGREGATES, GQA_SELECT_MODES, aggregate_group_scores, budget, token_ranks

__all__ = ["QUEST_PAGE_SIZE", "check_page_size", "page_bounds", "page_metadata", "pages_to_tokens",
           "quest_attention", "quest_row_selection", "select_pages"]


def check_page_size(page_size) -> int:
    """``page_size`` as an int >= 1 (a ValueError naming it otherwise)."""
    if isinstance(page_size, bool) or not isinstance(page_size, Integral) or int(page_size) < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    return int(page_size)


def _check_mode(gqa_select: str, aggregate: str) -> None:
    if gqa_select not in GQA_SELECT_MODES:
        raise ValueError(f"gqa_select must be one of {GQA_SELECT_MODES}, got {gqa_select!r}")
    if aggregate not in GQA_AGGREGATES:
        raise ValueError(f"aggregate must be one of {GQA_AGGREGATES}, got {aggregate!r}")
    if gqa_select == "kv" and aggregate == "agreement":
        raise ValueError("aggregate='agreement' shares tokens between KV heads by their heads' disagreement on tokens; "
                         "it is not defined for Quest's pages (use 'softmax-max', 'max', 'sum', 'softmax-sum' or "
                         "'union')")


def page_ids(starts: torch.Tensor, lengths: torch.Tensor, S: int, page_size: int) -> torch.Tensor:
    """The page of every token: ``(s - starts[b]) // page_size`` for ``starts[b] <= s < lengths[b]``, and the spare
    page ``P = ceil(S / page_size)`` for the tokens outside.  starts, lengths: [B] -> [B, S] int64."""
    pos = torch.arange(S, device=starts.device)[None, :]
    st = starts.long()[:, None]
    inside = (pos >= st) & (pos < lengths.long()[:, None])
    P = -(-S // page_size)
    return torch.where(inside, torch.div(pos - st, page_size, rounding_mode="floor"), P)


def page_metadata(
    k_cache: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    *,
    page_size: int = QUEST_PAGE_SIZE,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's page metadata: the per-channel minimum and maximum key of every page.

    k_cache: [B, HKV, S, D]; starts, lengths: [B] (the valid tokens ``starts <= s < lengths``, pages aligned to
    ``starts``) -> ``(k_min, k_max)``, each [B, HKV, P, D] in ``compute_dtype`` with ``P = ceil(S / page_size)``.
    Only valid tokens enter a page (whatever the cache holds elsewhere stays out); a page with no valid token holds
    zeros (never selected: it lies beyond the current page)."""
    page_size = check_page_size(page_size)
    B, HKV, S, D = k_cache.shape
    P = -(-S // page_size)
    pid = page_ids(starts, lengths, S, page_size)  # [B, S], P for tokens outside
    idx = pid[:, None, :, None].expand(B, HKV, S, D)
    k = k_cache.to(compute_dtype)
    init = torch.zeros(B, HKV, P + 1, D, dtype=compute_dtype, device=k.device)
    k_min = init.scatter_reduce(2, idx, k, reduce="amin", include_self=False)
    k_max = init.scatter_reduce(2, idx, k, reduce="amax", include_self=False)
    return k_min[:, :, :P], k_max[:, :, :P]


def page_bounds(q: torch.Tensor, k_min: torch.Tensor, k_max: torch.Tensor) -> torch.Tensor:
    """Upper bounds of ``q . k`` over every page: ``u_p = sum_j max(q_j M_pj, q_j m_pj)``, computed as
    ``q+ . M_p + q- . m_p`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``; equal since ``M >= m``), unscaled.

    q: [B, HQ, R, D]; k_min, k_max: [B, HKV, P, D] (:func:`page_metadata`) -> [B, HQ, R, P] in q's dtype."""
    B, HQ, R, D = q.shape
    HKV, P = k_max.shape[1], k_max.shape[2]
    G = HQ // HKV
    qg = q.reshape(B, HKV, G * R, D)
    u = torch.matmul(qg.clamp(min=0), k_max.transpose(-1, -2)) + torch.matmul(qg.clamp(max=0),
                                                                               k_min.transpose(-1, -2))
    return u.view(B, HQ, R, P)


def select_pages(
    bounds: torch.Tensor,
    n_visible: torch.Tensor,
    counts: torch.Tensor,
    *,
    HKV: int,
    page_size: int = QUEST_PAGE_SIZE,
    gqa_select: str,
    aggregate: str,
    scale: float,
) -> torch.Tensor:
    """The pages every row keeps: the page of its current token, and the ``ceil(counts / page_size) - 1`` other
    pages of largest bound (ties to the lowest page), of the pages before the current one.

    bounds: [B, HQ, R, P] (:func:`page_bounds`); n_visible, counts: [B, R] int (the tokens a row sees, pages
    aligned to its first one, and its token budget; a row with ``counts = 0`` keeps nothing) -> [B, H, R, P] bool
    (H = HQ for ``gqa_select="query"``, HKV for ``"kv"``, whose bounds are combined over the group by
    ``aggregate`` with the attention ``scale`` for the softmax aggregates)."""
    _check_mode(gqa_select, aggregate)
    B, HQ, R, P = bounds.shape
    page_size = check_page_size(page_size)
    n_pages = torch.div(n_visible.long() + page_size - 1, page_size, rounding_mode="floor")  # [B, R]
    current = n_pages - 1  # the page of the row's last visible token (-1: the row sees nothing)
    want = torch.div(counts.long() + page_size - 1, page_size, rounding_mode="floor").minimum(n_pages)
    need = (want - 1).clamp(min=0)  # pages to choose besides the current one
    p = torch.arange(P, device=bounds.device)
    cand = p < current[..., None]  # [B, R, P]: whole pages before the current one
    s = bounds.masked_fill(~cand[:, None], float("-inf"))
    if gqa_select == "kv":
        s = aggregate_group_scores(s, HKV, aggregate, scale=scale).masked_fill(~cand[:, None], float("-inf"))
    keep = (token_ranks(s) < need[:, None, :, None]) & cand[:, None]
    cur = (p == current[..., None]) & (want > 0)[..., None]  # [B, R, P]
    return keep | cur[:, None]


def pages_to_tokens(keep: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, S: int,
                    page_size: int = QUEST_PAGE_SIZE) -> torch.Tensor:
    """The tokens of the kept pages: keep [B, H, R, P] bool; starts, lengths: [B] (the page layout's valid range)
    -> [B, H, R, S] bool (tokens outside ``[starts, lengths)`` never kept)."""
    B, H, R, P = keep.shape
    pid = page_ids(starts, lengths, S, page_size).clamp(max=P)  # [B, S]
    spare = torch.zeros(B, H, R, 1, dtype=torch.bool, device=keep.device)
    return torch.gather(torch.cat([keep, spare], dim=-1), -1, pid[:, None, None, :].expand(B, H, R, S))


def quest_row_selection(
    q: torch.Tensor,
    k: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    counts: torch.Tensor,
    *,
    page_size: int = QUEST_PAGE_SIZE,
    gqa_select: str,
    aggregate: str,
    scale: float,
) -> torch.Tensor:
    """Quest's selection for a block of query rows, each as a decode step over the tokens it sees (the teacher-forced
    rows of :mod:`loki.reference.teacher_forced`).

    q: [B, HQ, R, D]; k: [B, HKV, S, D] (the keys' own coordinates); starts, lengths: [B, R] (row ``(b, i)`` sees
    ``starts[b, i] <= s < lengths[b, i]``, its pages aligned to ``starts[b, i]``); counts: [B, R] token budgets ->
    [B, H, R, S] bool, the tokens of the pages each row keeps (exactly what :func:`quest_attention` keeps for that
    row).  The page metadata is computed once per sequence when its rows share their first token (every causal
    window, left padding included); rows that do not (sliding windows) are done one at a time."""
    B, HQ, R, D = q.shape
    S = k.shape[2]
    starts, lengths = starts.long(), lengths.long()
    n = (lengths - starts).clamp_min(0)
    seen = n > 0
    first = torch.where(seen, starts, S).amin(dim=1)  # [B]: the rows that see tokens, their first one
    last = torch.where(seen, starts, -1).amax(dim=1)
    if bool(((first != last) & (last >= 0)).any()):  # one sync per block
        return torch.cat([quest_row_selection(q[:, :, r : r + 1], k, starts[:, r : r + 1], lengths[:, r : r + 1],
                                              counts[:, r : r + 1], page_size=page_size, gqa_select=gqa_select,
                                              aggregate=aggregate, scale=scale) for r in range(R)], dim=2)
    st = torch.where(last >= 0, last, 0)
    end = torch.full_like(st, S)
    # every page before a row's current page lies inside [starts, lengths) of that row: metadata over [st, S) serves
    # every row (pages at or past a row's current page are never its candidates)
    k_min, k_max = page_metadata(k, st, end, page_size=page_size, compute_dtype=q.dtype)
    keep = select_pages(page_bounds(q, k_min, k_max), n, counts, HKV=k.shape[1], page_size=page_size,
                        gqa_select=gqa_select, aggregate=aggregate, scale=scale)
    pos = torch.arange(S, device=q.device)
    visible = (pos >= starts[..., None]) & (pos < lengths[..., None])  # [B, R, S]
    return pages_to_tokens(keep, st, end, S, page_size) & visible[:, None]


def quest_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    k: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    page_size: int = QUEST_PAGE_SIZE,
    gqa_select: str,
    aggregate: str,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_indices: bool = False,
):
    """Quest: pages of ``page_size`` tokens, the current page and the ``ceil(k / page_size) - 1`` pages of largest
    upper bound ``sum_j max(q_j M_j, q_j m_j)``, then exact attention over their valid tokens (module docstring).

    q: [B, HQ, D]; k_cache, v_cache: [B, HKV, S, D] in the keys' own coordinates (the bounds are not invariant
    under a rotation); ``k`` a token count or a fraction of each sequence's valid tokens (the one budget rule,
    :func:`~loki.reference.selection.budget`).  Returns out [B, HQ, D] (and ``(idx [B, H, K], counts [B, H])``
    when ``return_indices``: each row's selected tokens in increasing order, -1 pads, and how many there are).
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q, k_cache, v_cache, lengths, starts)
    page_size = check_page_size(page_size)
    _check_mode(gqa_select, aggregate)
    counts = budget(k, lengths, starts, B, S, q.device)  # [B]
    n = (lengths - starts).long()
    k_min, k_max = page_metadata(k_cache, starts, lengths, page_size=page_size, compute_dtype=compute_dtype)
    bounds = page_bounds(q.to(compute_dtype)[:, :, None], k_min, k_max)  # [B, HQ, 1, P]
    keep = select_pages(bounds, n[:, None], counts[:, None], HKV=HKV, page_size=page_size, gqa_select=gqa_select,
                        aggregate=aggregate, scale=default_scale(D, scale))
    mask = pages_to_tokens(keep, starts, lengths, S, page_size)[:, :, 0]  # [B, H, S]
    mask &= valid_token_mask(lengths, starts, S)[:, None, :]
    if tallying():  # the bytes accounting (loki.reference.accounting)
        record_selection(mask[:, :, None], n.reshape(B, 1), HKV)
    out = dense_attention(q, k_cache, v_cache, lengths, starts, scale=scale, mask=mask, compute_dtype=compute_dtype)
    if not return_indices:
        return out
    sel_counts = mask.sum(-1)  # [B, H]
    pos = torch.arange(S, device=q.device).expand_as(mask)
    order = torch.sort(torch.where(mask, pos, S), dim=-1).values[..., : max(1, int(sel_counts.max()))]
    return out, (torch.where(order < S, order, -1), sel_counts)
