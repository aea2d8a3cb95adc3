"""Every query row of a window as one decode step, batched with masks (teacher forcing).

A window of L query rows against S keys, where row ``i`` of sequence ``b`` sees the tokens
``starts[b, i] <= s < lengths[b, i]`` and attends exactly as a decode step over them would: the decode
references (:mod:`loki.reference.methods`) applied row by row, computed here as masked attention over whole
blocks of rows.  A row's top-k set becomes a mask: its ``k_i``-th largest selection score is read from one
``topk`` of the row, every score above it is kept, and ties at the threshold go to the lowest indices first
(as :func:`~loki.reference.selection.select_topk`).  The exact scores are then softmaxed under that mask.
Rows are processed in blocks whose key range stops at the block's last visible token, so a causal window
costs about half of the full ``L x S`` score matrix.

Quest selects pages rather than tokens (:func:`~loki.reference.quest.quest_row_selection`, the page metadata
computed once per sequence for the block).  While a :func:`~loki.reference.accounting.tally_diagnostics` block is
open, every selection also records its recall of the exact top-k set and the attention mass it captures.

This is what makes decode-time-semantics perplexity cost a small multiple of a dense forward rather than one
decode step per row; ``tests/test_teacher_forced.py`` checks it against the per-row decode references.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), L query rows, S keys, D head dim,
H the selection's head axis (HQ for per-query-head selection, HKV for per-KV-head selection), R rows of a block.
"""

from __future__ import annotations

import torch

from .._checks import budget_counts, check_budget, resolve_d
from .accounting import QUEST_PAGE_SIZE, diagnosing, record_components, record_diagnostics, record_selection
from .common import default_scale
from .masks import masked_softmax, per_query_head, topk_mask
from .quest import check_page_size, quest_row_selection
from .score_formats import check_score_format, quantize_score_keys
from .selection import GQA_AGGREGATES, aggregate_group_scores, agreement_counts, group_union_sizes

__all__ = ["ROW_METHODS", "attend", "grouped_scores", "masked_softmax", "per_query_head", "teacher_forced_rows",
           "topk_mask"]

#: Methods computed here (H2O keeps state across steps and runs as an actual decode loop).
ROW_METHODS = ("loki", "exact_topk", "pcaattn", "dense", "sparq", "quest")

_NEG_INF = float("-inf")


def grouped_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Scores of every query head against its KV head: q [B, HQ, R, e] x k [B, HKV, S, e] -> [B, HQ, R, S]."""
    B, HQ, R, e = q.shape
    HKV, S = k.shape[1], k.shape[2]
    G = HQ // HKV
    s = torch.matmul(q.reshape(B, HKV, G * R, e), k.transpose(-1, -2))
    return s.view(B, HQ, R, S)


def attend(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Weights [B, HQ, R, S] times values [B, HKV, S, D] -> [B, HQ, R, D]."""
    B, HQ, R, S = p.shape
    HKV, D = v.shape[1], v.shape[-1]
    return torch.matmul(p.reshape(B, HKV, (HQ // HKV) * R, S), v).view(B, HQ, R, D)


def _block(method, q, k, v, visible, n_visible, counts, *, dd, scale, gqa_select, aggregate, starts=None,
           lengths=None, page_size=QUEST_PAGE_SIZE, k_score=None, score_mask=None):
    """One block of rows. q: [B, HQ, R, D]; k, v: [B, HKV, S, D] (fp32); visible: [B, 1, R, S] bool;
    n_visible, counts (tokens to select), starts, lengths (what each row sees; Quest's pages): [B, R]; k_score:
    Loki's score copy of the keys' dd leading dims [B, HKV, S, dd] (None: the keys' own); score_mask: [HQ, m] fp32,
    Loki's approximate scores on the first m dims with each head's dims beyond its own zeroed (None: dd dims each)
    -> [B, HQ, R, D] fp32."""
    B, HQ, R, D = q.shape
    HKV = k.shape[1]
    if method == "dense":
        return attend(masked_softmax(grouped_scores(q, k) * scale, visible), v)
    if method == "pcaattn":
        return attend(masked_softmax(grouped_scores(q[..., :dd], k[..., :dd]) * scale, visible), v)
    budget = counts  # [B, R]: the nominal budget of each row (the diagnostics' exact top-k has as many tokens)
    counts = counts[:, None]  # [B, 1, R]: one budget for every head of a row
    if method == "sparq":
        # SparQ (per query head): the r largest |q| components, a tempered softmax of the partial scores
        i1 = torch.topk(q.abs(), dd, dim=-1).indices
        record_components(i1, n_visible, HKV, D)  # the key components the group's heads read (bytes accounting)
        q_r = torch.zeros_like(q).scatter_(-1, i1, q.gather(-1, i1))
        l1_ratio = q_r.abs().sum(-1) / q.abs().sum(-1).clamp_min(torch.finfo(q.dtype).tiny)
        temp = torch.sqrt(D * l1_ratio).clamp_min(torch.finfo(q.dtype).tiny)  # [B, HQ, R]
        s_hat = masked_softmax(grouped_scores(q_r, k) / temp[..., None], visible)
        sel = topk_mask(s_hat.masked_fill(~visible, _NEG_INF), counts)
        record_selection(sel, n_visible, HKV)
        exact = grouped_scores(q, k)
        if diagnosing():
            record_diagnostics(sel, exact, visible, budget, n_visible, scale)
        alpha = (s_hat * sel).sum(-1, keepdim=True)  # [B, HQ, R, 1]
        y = attend(masked_softmax(exact * scale, sel), v)
        v_mean = attend((visible / n_visible[:, None, :, None].clamp_min(1)).expand(B, HQ, R, -1), v)
        return alpha * y + (1 - alpha) * v_mean
    if method == "quest":  # pages of min/max keys, the current page and the pages of largest upper bound
        sel = quest_row_selection(q, k, starts, lengths, budget, page_size=page_size, gqa_select=gqa_select,
                                  aggregate=aggregate, scale=scale)
        record_selection(sel, n_visible, HKV)
        exact = grouped_scores(q, k)
        if diagnosing():
            record_diagnostics(sel, exact, visible, budget, n_visible, scale)
        return attend(masked_softmax(exact * scale, per_query_head(sel, HQ)), v)
    if method == "loki" and score_mask is not None:  # per-head dims (an allocation): the first m, masked per head
        m = score_mask.shape[-1]
        approx = grouped_scores(q[..., :m] * score_mask[None, :, None, :], k[..., :m])
        lead = grouped_scores(q[..., :m], k[..., :m])  # the exact scores summed as the uniform rows sum them
        exact = lead + grouped_scores(q[..., m:], k[..., m:]) if m < D else lead
    elif method == "loki":  # approximate scores from the first d dims; the rest completes the exact scores
        lead = grouped_scores(q[..., :dd], k[..., :dd])
        approx = lead if k_score is None else grouped_scores(q[..., :dd], k_score)
        exact = lead + grouped_scores(q[..., dd:], k[..., dd:]) if dd < D else lead
    elif method == "exact_topk":
        exact = approx = grouped_scores(q, k)
    else:
        raise ValueError(f"method must be one of {ROW_METHODS}, got {method!r}")
    approx = approx.masked_fill(~visible, _NEG_INF)
    if gqa_select == "kv":  # the softmax aggregates normalise each head over the tokens its row sees
        if aggregate == "agreement":  # per-KV-head budgets from the union of each group's own top-k sets
            counts = agreement_counts(group_union_sizes(topk_mask(approx, counts), HKV), counts[:, 0], n_visible)
        approx = aggregate_group_scores(approx, HKV, aggregate, scale=scale).masked_fill(~visible, _NEG_INF)
    elif gqa_select != "query":
        raise ValueError(f"gqa_select must be 'query' or 'kv', got {gqa_select!r}")
    sel = topk_mask(approx, counts)
    record_selection(sel, n_visible, HKV)  # the bytes accounting (loki.reference.accounting), when tallying
    if diagnosing():  # recall of the exact top-k set and attention mass (loki.reference.accounting)
        record_diagnostics(sel, exact, visible, budget, n_visible, scale)
    return attend(masked_softmax(exact * scale, per_query_head(sel, HQ)), v)


def teacher_forced_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    *,
    method: str,
    k_budget: int | float = 1.0,
    d: int | float = 1.0,
    scale: float | None = None,
    gqa_select: str,
    aggregate: str,
    block_elements: int | None = None,
    page_size: int = QUEST_PAGE_SIZE,
    score_format: str = "native",
    score_dims: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query row as a decode step of ``method`` over the tokens the row sees.

    q: [B, HQ, L, D] and k: [B, HKV, S, D] in the coordinates the method reads (for "loki" and "pcaattn" the
    rotated ``q_hat``/``K_hat``; any orthogonal basis or none for the others, by Lemma 1; SparQ and Quest in the
    keys' own coordinates); v: [B, HKV, S, D]; starts, lengths: [B, L] int, row ``(b, i)`` sees
    ``starts[b, i] <= s < lengths[b, i]``.  ``k_budget``/``d`` are counts or fractions as in the decode
    references (``d`` is SparQ's ``r``; unused by Quest, whose pages hold ``page_size`` tokens), the budget
    resolved from each row's own visible count; ``gqa_select`` and ``aggregate`` (one of ``GQA_AGGREGATES``) as in
    the decode references; ``score_format``: Loki's score copy of the keys
    (:func:`~loki.reference.score_formats.quantize_score_keys`); ``score_dims``: [HKV] ints, the dims each KV
    head's approximate scores use instead of ``d`` (an allocation, :mod:`loki.calibration.allocation`; "loki" with
    the native copy only).  Computed in
    fp32 in blocks of rows of at most ``block_elements`` score entries (default 2^24 on the CPU, 2^27 on a
    GPU).  Returns [B, HQ, L, D] in q's dtype; a row that sees no token gives zeros.
    """
    if method not in ROW_METHODS:
        raise ValueError(f"method must be one of {ROW_METHODS}, got {method!r}")
    if aggregate not in GQA_AGGREGATES:
        raise ValueError(f"aggregate must be one of {GQA_AGGREGATES}, got {aggregate!r}")
    B, HQ, L, D = q.shape
    S = k.shape[2]
    dd = resolve_d(d, D, name="r" if method == "sparq" else "d")
    page_size = check_page_size(page_size)
    scale = default_scale(D, scale)
    starts, lengths = starts.long(), lengths.long()
    n_visible = (lengths - starts).clamp_min(0)
    # the one budget rule: an int count above a row's visible tokens keeps them all; 0 for a row that sees nothing
    counts = budget_counts(check_budget(k_budget), n_visible)
    ends = lengths.amax(dim=0).tolist()  # per row: the last key any sequence's row i sees (one host sync)
    if block_elements is None:
        block_elements = 1 << 27 if q.is_cuda else 1 << 24
    pos = torch.arange(S, device=q.device)
    out = torch.empty(B, HQ, L, D, dtype=q.dtype, device=q.device)
    # blocks of rows: at most block_elements scores; on the CPU at least 8 blocks on long windows, so that the
    # key range of each block follows the causal diagonal (half the work); on a GPU as few blocks as fit, since
    # there every block costs kernel launches and two host syncs
    rows = max(1, block_elements // max(1, B * HQ * S))
    if not q.is_cuda:
        rows = min(rows, max(16, -(-L // 8)))
    kf, vf = k.float(), v.float()
    check_score_format(score_format, method)
    score_mask = None
    if score_dims is not None:
        if method != "loki" or score_format != "native":
            raise ValueError(f"score_dims apply to method='loki' with the native score copy, got method={method!r}, "
                             f"score_format={score_format!r}")
        HKV = k.shape[1]
        sd = torch.as_tensor(score_dims, device=q.device).long().reshape(-1)
        if sd.numel() != HKV or int(sd.min()) < 1 or int(sd.max()) > D:
            raise ValueError(f"score_dims must be {HKV} ints in [1, {D}], got {sd.tolist()}")
        m = int(sd.max())
        score_mask = (torch.arange(m, device=q.device)[None, :] < sd.repeat_interleave(HQ // HKV)[:, None]).float()
    # the score copy is quantized per token, so once for the window
    k_score = quantize_score_keys(kf[..., :dd], score_format) if method == "loki" and score_format != "native" \
        else None
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        s_end = max(1, max(ends[r0:r1]))
        p = pos[:s_end]
        visible = (p >= starts[:, r0:r1, None]) & (p < lengths[:, r0:r1, None])  # [B, R, s_end]
        o = _block(method, q[:, :, r0:r1].float(), kf[:, :, :s_end], vf[:, :, :s_end], visible[:, None],
                   n_visible[:, r0:r1], counts[:, r0:r1], dd=dd, scale=scale, gqa_select=gqa_select,
                   aggregate=aggregate, starts=starts[:, r0:r1], lengths=lengths[:, r0:r1], page_size=page_size,
                   k_score=None if k_score is None else k_score[:, :, :s_end], score_mask=score_mask)
        out[:, :, r0:r1] = o.to(q.dtype)
    return out
