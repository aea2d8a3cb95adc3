"""Approximate scores and top-k selection in one kernel (Loki Algorithm 1, lines 3-5), in Triton.

One program per selection row: it streams the row's keys (the first d rotated dims, from ``k_hat`` in
place or from the contiguous ``k_prefix`` buffer), writes the row's approximate scores (-inf outside the
valid tokens, the same values as ``approx_scores``), then runs the exact threshold select of
``select.py`` on the row it has just written (re-read from L2) and writes the row's indices.

Why: with two kernels the selection (latency- and ALU-bound, ~10-15 us per row) only starts once every
row is scored, and the scoring pass carries its own launch, ramp and tail.  Fused, the select of one
program overlaps the key streaming of the other programs resident on the same multiprocessor, so the
selection mostly hides behind the memory-bound scoring.  This pays when there are enough rows to keep
every multiprocessor busy (a program per row: B x H programs); with few rows (B=1) the scoring of a row
by one program is too slow and the two-kernel path stays (``score_select_fusable``).

Rows: ``gqa_select="query"``: (b, hq), the scores of one query head against its KV head's keys;
``"kv"``: (b, h), the sum or max over the G query heads of KV head h, computed from one read of the keys.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim,
d leading principal dims, H the selection's head axis, K the selection width (>= max(counts)).
"""

from __future__ import annotations

import torch

from loki._triton import tl, triton

from .common import interpreter_tile, interpreting, key_block, num_sms
from .launch import launch, new_output, pdl
from .select import TRITON_SELECT_MAX_S, compaction_chunk, select_launch_config
from .tl_helpers import score_keys, select_row

__all__ = ["FUSED_DEFAULTS", "score_select", "score_select_fusable"]

#: When the fused kernel is used by the decode step (measured on an H100, docs/kernels.md): at least
#: ``min_rows_per_sm`` selection rows per multiprocessor and rows of at most ``max_s`` tokens.
FUSED_DEFAULTS = dict(min_rows_per_sm=0.75, max_s=8192, num_stages=3)


@triton.jit
def _score_select_kernel(
    q_ptr, k_ptr, s_ptr, lengths_ptr, starts_ptr, counts_ptr, idx_ptr, c_ptr,
    S, d, H, K, KV_DIV,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_sb, stride_sh,
    stride_ib, stride_ih,
    stride_cb, stride_ch,
    G_SCORE: tl.constexpr, AGG_MAX: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr, EARLY_EXIT: tl.constexpr,
    NUM_STAGES: tl.constexpr, EVEN_D: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr,
):
    """scores[b, h, :] (query heads h*G_SCORE .. +G_SCORE-1 against KV head h // KV_DIV, combined by sum or
    max when G_SCORE > 1) then idx[b, h, :counts[b]] = the positions of its counts[b] largest entries.
    ``SCALED``: the keys are an int8 score copy, each token's dot products times its scale (``c_ptr`` [B, HKV, S]
    bf16), as ``approx_scores``."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    kv = h // KV_DIV
    hq0 = h * G_SCORE
    if PDL:  # programmatic dependent launch (launch.py): wait for the previous kernel's writes
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    row = s_ptr + b * stride_sb + h * stride_sh
    k_base = k_ptr + b * stride_kb + kv * stride_kh
    q_base = q_ptr + b * stride_qb + hq0 * stride_qh
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < d
    ar = tl.arange(0, BLOCK_S)
    # the sum over a group's heads is one dot product with the summed query (fp32)
    qs = tl.zeros((BLOCK_D,), tl.float32)
    for g in tl.static_range(G_SCORE):
        qs += tl.load(q_base + g * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    for s0 in tl.range(0, S, BLOCK_S, num_stages=NUM_STAGES):
        offs_s = s0 + ar
        valid = (offs_s >= start) & (offs_s < length)
        kmask = valid[:, None] & (dmask | EVEN_D)[None, :]  # EVEN_D (d fills the tile): a row mask, vector loads
        kt = score_keys(k_base + offs_s[:, None] * stride_ks + offs_d[None, :], kmask, SCALED)
        if SCALED:
            rs = tl.load(c_ptr + b * stride_cb + kv * stride_ch + offs_s, mask=valid, other=0.0).to(tl.float32)
        if AGG_MAX and G_SCORE > 1:
            agg = tl.full((BLOCK_S,), float("-inf"), tl.float32)
            for g in tl.static_range(G_SCORE):
                q = tl.load(q_base + g * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
                sg = tl.sum(kt * q[None, :], axis=1)
                if SCALED:
                    sg = sg * rs
                agg = tl.maximum(agg, sg)
        else:
            agg = tl.sum(kt * qs[None, :], axis=1)
            if SCALED:
                agg = agg * rs
        tl.store(row + offs_s, tl.where(valid, agg, float("-inf")), mask=offs_s < S)
    tl.debug_barrier()  # the row's scores, written by every thread, are read back by every thread
    kk = tl.minimum(tl.load(counts_ptr + b).to(tl.int32), K)  # never more than the K slots of the row
    select_row(row, S, kk, idx_ptr + b * stride_ib + h * stride_ih, K, BLOCK, CHUNK, RADIX_BITS, EARLY_EXIT)


def score_select_fusable(rows: int, S: int, device, *, min_rows_per_sm: float | None = None,
                         max_s: int | None = None) -> bool:
    """Whether the decode step uses the fused kernel for ``rows`` selection rows of length S."""
    min_rows_per_sm = FUSED_DEFAULTS["min_rows_per_sm"] if min_rows_per_sm is None else min_rows_per_sm
    max_s = FUSED_DEFAULTS["max_s"] if max_s is None else max_s
    return S <= min(max_s, TRITON_SELECT_MAX_S) and rows >= min_rows_per_sm * num_sms(device)


def check_fused_args(q_hat, k_src, d: int, K: int, name: str) -> tuple[int, int, int, int]:
    """The shapes of a fused score-select kernel's inputs (``score_select``, ``score_select_softmax``), checked:
    q_hat [B, HQ, D], k_src [B, HKV, S, Dk] with HQ a multiple of HKV, S <= ``TRITON_SELECT_MAX_S``,
    1 <= d <= Dk, 1 <= K <= S.  Returns (B, HQ, HKV, S)."""
    if q_hat.dim() != 3 or k_src.dim() != 4 or k_src.shape[0] != q_hat.shape[0] or q_hat.shape[1] % k_src.shape[1]:
        raise ValueError(f"expected q_hat [B, HQ, D] and k_src [B, HKV, S, Dk] with HQ a multiple of HKV; got "
                         f"{list(q_hat.shape)} and {list(k_src.shape)}")
    B, HQ, _ = q_hat.shape
    _, HKV, S, _ = k_src.shape
    if S > TRITON_SELECT_MAX_S:
        raise ValueError(f"{name} handles rows of at most {TRITON_SELECT_MAX_S} tokens, got S={S}")
    if not 1 <= d <= k_src.shape[-1]:
        raise ValueError(f"d={d} must lie in [1, {k_src.shape[-1]}] (the key dims k_src holds)")
    if not 1 <= K <= S:
        raise ValueError(f"K={K} must lie in [1, S={S}]")
    return B, HQ, HKV, S


def score_select(q_hat, k_src, d: int, lengths, starts, counts, K: int, *, gqa_select: str,
                 aggregate: str, scores: torch.Tensor | None = None, idx: torch.Tensor | None = None,
                 block_s: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 early_exit: bool = True, chunk: int | None = None, prefix_scale: torch.Tensor | None = None):
    """Scores ([B, H, S] fp32, as ``approx_scores``) and the top-``counts[b]`` indices of every row
    ([B, H, K] int32, as ``select_topk(method="triton")``) from one launch.  ``prefix_scale`` [B, HKV, S] bf16
    (validated by the caller) makes ``k_src`` an int8 score copy's codes (``approx_scores``'s int8 scores).

    q_hat: [B, HQ, D]; k_src: [B, HKV, S, Dk] with Dk >= d (the rotated keys or a ``k_prefix`` buffer, last
    dim contiguous); lengths, starts, counts: [B] int on the device (validated by the caller: 1 <= counts[b]
    <= valid tokens of b <= K <= S).  ``chunk`` (a power of two): the select's compaction chunk for longer
    rows.  Returns ``(scores, idx)``.
    """
    B, HQ, HKV, S = check_fused_args(q_hat, k_src, d, K, "score_select")
    if gqa_select not in ("query", "kv") or aggregate not in ("sum", "max"):
        raise ValueError(f"gqa_select must be 'query' or 'kv' and aggregate 'sum' or 'max'; got {gqa_select!r}, "
                         f"{aggregate!r}")
    G = HQ // HKV
    if gqa_select == "query":
        H, g_score, kv_div = HQ, 1, G
    else:
        H, g_score, kv_div = HKV, G, 1
    dev = q_hat.device
    if scores is None:
        scores = new_output((B, H, S), torch.float32, dev)
    if idx is None:
        idx = new_output((B, H, K), torch.int32, dev)
    BLOCK_D = triton.next_power_of_2(d)
    BLOCK = triton.next_power_of_2(S)
    if block_s is None:
        block_s = interpreter_tile(S, 1024) if interpreting() else key_block(BLOCK_D, k_src.stride(2) == d)
    warps, bits, _ = select_launch_config(S, B * H, num_sms(dev))
    num_warps = warps if num_warps is None else num_warps
    num_stages = FUSED_DEFAULTS["num_stages"] if num_stages is None else num_stages
    rows = B * H
    sc = prefix_scale if prefix_scale is not None else lengths  # a placeholder pointer when not SCALED
    launch(_score_select_kernel, (rows,), [
        q_hat, k_src, scores, lengths, starts, counts, idx, sc,
        S, d, H, K, kv_div,
        q_hat.stride(0), q_hat.stride(1),
        k_src.stride(0), k_src.stride(1), k_src.stride(2),
        scores.stride(0), scores.stride(1),
        idx.stride(0), idx.stride(1),
        sc.stride(0) if prefix_scale is not None else 0, sc.stride(1) if prefix_scale is not None else 0,
        g_score, aggregate == "max", block_s, BLOCK_D,
        BLOCK, chunk or compaction_chunk(S, rows, num_sms(dev)), bits, bool(early_exit),
        num_stages, BLOCK_D == d, prefix_scale is not None, pdl(dev),
    ], dict(num_warps=num_warps, pdl=pdl(dev)))
    return scores, idx
