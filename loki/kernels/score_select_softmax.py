"""A shared GQA selection with a softmax aggregate ("softmax-max", "softmax-sum"): approximate scores, the
group's probability score and the top-k select of each row in one kernel (Loki Algorithm 1, lines 3-5), in Triton.

One program per selection row (b, h), h a KV head with the G query heads h*G .. h*G + G - 1:

1. pass 1 streams the row's keys once (the first d rotated dims, from ``k_hat`` in place or from the contiguous
   ``k_prefix`` buffer; ``tl.range`` with ``num_stages``, as ``score_select.py``), from the first tile that holds
   a valid token to the last, and stores the G heads' scores ``s_g`` (fp32, one dot product per head and key) into
   per-query-head scratch rows ``heads[b, h*G + g, :]`` (valid tokens only; contiguous stores);
2. ``tl.debug_barrier()``, then pass 2a reads the G scratch rows back in [GP, BLOCK_T] tiles (written by this
   program an instant ago: L2 hits) for each head's (max, sum of exp) of ``scale * s_g`` over the valid tokens (a
   running pair per lane, one reduction per head at the end), and pass 2b reads them once more and writes the
   row's probability score ``max_g`` (or ``sum_g``) of ``exp((scale * s_g - max_g) - log(sum_g))`` into
   ``scores[b, h, :]``, -inf outside the valid tokens (``group_softmax.py``: the same values as its two launches,
   up to the rounding of the sums, and why probabilities rather than the reference's log values).  Measured on
   an H100 (B=16 S=8192, GQA 32/8): a first version kept the heads' (max, sum) in pass 1 (with a reduction
   across the block per head and tile, or with [BLOCK_S, GP] tiles of scores) and took 150 us in pass 1 alone;
3. ``tl.debug_barrier()``, then the exact threshold select of ``select.py`` (``select_row``) on that row, as
   ``score_select.py`` does.

Against the unfused path (per-query-head scores, two group-softmax launches, the select: four launches) this
saves three launches and their ramps and tails, and lets the select of one program overlap the key streaming of
the others on its multiprocessor.  Used by the decode step
under the rule of ``score_select_fusable`` (enough rows to fill the GPU, rows of at most 8192 tokens).

Scratch: ``heads`` [B, HQ, S] fp32 (from ``launch.new_output``; only the valid tokens are written and read).
No host sync, no atomics.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim,
d leading principal dims, K the selection width (>= max(counts)).
"""

from __future__ import annotations

import torch

from loki._checks import resolve_scale
from loki._triton import tl, triton

from .common import interpreter_tile, interpreting, key_block, num_sms
from .group_softmax import SOFTMAX_AGGREGATES
from .launch import launch, new_output, pdl
from .score_select import FUSED_DEFAULTS, check_fused_args
from .select import compaction_chunk, select_launch_config
from .tl_helpers import group_probability, running_lse, score_keys, select_row

__all__ = ["SOFTMAX_FUSED_DEFAULTS", "score_select_softmax"]

#: Launch choices: at most ``max_group`` query heads per KV head (the heads' loop is unrolled); pass 1 reads the key
#: tile of ``score_select`` (``key_block``) per step; passes 2a and 2b read ``tile`` scores ([GP, BLOCK_T]) per step.
SOFTMAX_FUSED_DEFAULTS = dict(max_group=16, tile=4096)


@triton.jit
def _score_select_softmax_kernel(
    q_ptr, k_ptr, h_ptr, s_ptr, lengths_ptr, starts_ptr, counts_ptr, idx_ptr, c_ptr,
    S, d, HKV, K, scale,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_hb, stride_hh,
    stride_sb, stride_sh,
    stride_ib, stride_ih,
    stride_cb, stride_ch,
    G: tl.constexpr, GP: tl.constexpr, SUM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr,
    EARLY_EXIT: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN_D: tl.constexpr, SCALED: tl.constexpr,
    PDL: tl.constexpr,
):
    """scores[b, h, :] = the group's probability score (max or, with SUM, sum over the G query heads of KV head h
    of their softmax over the row's valid tokens), then idx[b, h, :counts[b]] = its counts[b] largest entries.
    ``SCALED``: the keys are an int8 score copy, each head's dot product times the token's scale (``c_ptr``
    [B, HKV, S] bf16), as ``approx_scores``."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HKV
    h = pid % HKV
    if PDL:  # programmatic dependent launch (launch.py): wait for the previous kernel's writes
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    row = s_ptr + b * stride_sb + h * stride_sh
    k_base = k_ptr + b * stride_kb + h * stride_kh
    q_base = q_ptr + b * stride_qb + (h * G) * stride_qh
    h_base = h_ptr + b * stride_hb + (h * G) * stride_hh
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < d
    gi = tl.arange(0, GP)
    ar = tl.arange(0, BLOCK_S)
    # pass 1: stream the keys once; per tile, each head's scores (a dot product per key, as the fused raw-"max"
    # kernel computes them) stored into its scratch row: contiguous stores, nothing else per tile
    for s0 in tl.range(start // BLOCK_S * BLOCK_S, length, BLOCK_S, num_stages=NUM_STAGES):
        offs_s = s0 + ar
        valid = (offs_s >= start) & (offs_s < length)
        kmask = valid[:, None] & (dmask | EVEN_D)[None, :]  # EVEN_D (d fills the tile): a row mask, vector loads
        kt = score_keys(k_base + offs_s[:, None] * stride_ks + offs_d[None, :], kmask, SCALED)
        if SCALED:
            rs = tl.load(c_ptr + b * stride_cb + h * stride_ch + offs_s, mask=valid, other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            q = tl.load(q_base + g * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
            sg = tl.sum(kt * q[None, :], axis=1)
            if SCALED:
                sg = sg * rs
            tl.store(h_base + g * stride_hh + offs_s, sg, mask=valid)
    tl.debug_barrier()  # the heads' scores, written by every thread, are read back by every thread
    # pass 2a: each head's (max, sum of exp) of scale * s over the valid tokens, from its scratch row (L2): a
    # running pair per lane and head (elementwise), one reduction per head after the loop
    gm = gi < G
    at = tl.arange(0, BLOCK_T)
    lo = start // BLOCK_T * BLOCK_T
    m2 = tl.full((GP, BLOCK_T), float("-inf"), tl.float32)
    l2 = tl.zeros((GP, BLOCK_T), tl.float32)
    for t0 in range(lo, length, BLOCK_T):
        offs_t = t0 + at
        ok = gm[:, None] & ((offs_t >= start) & (offs_t < length))[None, :]
        x = tl.load(h_base + gi[:, None] * stride_hh + offs_t[None, :], mask=ok, other=float("-inf")) * scale
        m2, l2 = running_lse(m2, l2, x)
    top = tl.where(gm, tl.max(m2, axis=1), 0.0)  # [GP]: each real head's max (finite: a row has a valid token)
    l = tl.sum(l2 * tl.exp(m2 - top[:, None]), axis=1)
    # pass 2: the group's probability score of every token of the row (-inf outside the valid tokens)
    mx = top
    log_sum = tl.log(tl.where(gm, l, 1.0))
    for t0 in range(0, S, BLOCK_T):
        offs_t = t0 + at
        valid = (offs_t >= start) & (offs_t < length)
        x = tl.load(h_base + gi[:, None] * stride_hh + offs_t[None, :], mask=gm[:, None] & valid[None, :],
                    other=float("-inf"))
        agg = tl.where(valid, group_probability(x, mx, log_sum, scale, SUM), float("-inf"))
        tl.store(row + offs_t, agg, mask=offs_t < S)
    tl.debug_barrier()  # the row's scores, written by every thread, are read back by every thread
    kk = tl.minimum(tl.load(counts_ptr + b).to(tl.int32), K)  # never more than the K slots of the row
    select_row(row, S, kk, idx_ptr + b * stride_ib + h * stride_ih, K, BLOCK, CHUNK, RADIX_BITS, EARLY_EXIT)


def score_select_softmax(q_hat, k_src, d: int, lengths, starts, counts, K: int, *, aggregate: str,
                         scale: float | None = None, scores: torch.Tensor | None = None,
                         heads: torch.Tensor | None = None, idx: torch.Tensor | None = None,
                         block_s: int | None = None, block_t: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, early_exit: bool = True, chunk: int | None = None,
                         prefix_scale: torch.Tensor | None = None):
    """The group probability scores ([B, HKV, S] fp32: ``exp`` of the reference's
    ``approx_scores(..., gqa_select="kv", aggregate=aggregate, scale=scale)``, -inf outside the valid tokens) and
    the top-``counts[b]`` indices of every row ([B, HKV, K] int32, as ``select_topk(method="triton")``) from one
    launch.

    q_hat: [B, HQ, D] (last dim contiguous); k_src: [B, HKV, S, Dk] with Dk >= d (the rotated keys or a
    ``k_prefix`` buffer, last dim contiguous); lengths, starts, counts: [B] int on the device (validated by the
    caller: ``0 <= starts[b] < lengths[b] <= S``, ``1 <= counts[b] <= lengths[b] - starts[b]``, counts[b] <= K <= S;
    they bound the kernel's reads).  ``aggregate``: "softmax-max" or "softmax-sum"; ``scale``: the attention scale
    (default ``1/sqrt(D)``).  ``heads``: the [B, HQ, S] fp32 scratch of per-query-head scores (last dim contiguous;
    default from ``new_output``); ``scores``, ``idx``: optional outputs.  ``block_s``, ``block_t``, ``num_warps``,
    ``num_stages``, ``early_exit``, ``chunk``: launch choices beside the defaults (tests, tuning).  ``prefix_scale``
    [B, HKV, S] bf16 (validated by the caller) makes ``k_src`` an int8 score copy's codes.  Returns
    ``(scores, idx)``.
    """
    B, HQ, HKV, S = check_fused_args(q_hat, k_src, d, K, "score_select_softmax")
    D = q_hat.shape[-1]
    G = HQ // HKV
    if aggregate not in SOFTMAX_AGGREGATES:
        raise ValueError(f"aggregate must be one of {SOFTMAX_AGGREGATES}, got {aggregate!r}")
    if G > SOFTMAX_FUSED_DEFAULTS["max_group"]:
        raise ValueError(f"score_select_softmax takes at most {SOFTMAX_FUSED_DEFAULTS['max_group']} query heads per "
                         f"KV head, got G={G}")
    scale = resolve_scale(scale, D)
    dev = q_hat.device
    for name, t, shape, dtype in (("scores", scores, (B, HKV, S), torch.float32),
                                  ("heads", heads, (B, HQ, S), torch.float32), ("idx", idx, (B, HKV, K), torch.int32)):
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype or t.stride(-1) != 1):
            raise ValueError(f"{name} must be a {dtype} tensor {list(shape)}, last dim contiguous")
    scores = new_output((B, HKV, S), torch.float32, dev) if scores is None else scores
    heads = new_output((B, HQ, S), torch.float32, dev) if heads is None else heads
    idx = new_output((B, HKV, K), torch.int32, dev) if idx is None else idx
    GP = triton.next_power_of_2(G)
    BLOCK_D = triton.next_power_of_2(d)
    BLOCK = triton.next_power_of_2(S)
    if block_s is None:
        block_s = interpreter_tile(S, 1024) if interpreting() else key_block(BLOCK_D, k_src.stride(2) == d)
    if block_t is None:
        cap = interpreter_tile(S, 1024) if interpreting() else max(16, SOFTMAX_FUSED_DEFAULTS["tile"] // GP)
        block_t = min(cap, max(16, BLOCK))
    rows = B * HKV
    warps, bits, _ = select_launch_config(S, rows, num_sms(dev))
    num_warps = warps if num_warps is None else num_warps
    num_stages = FUSED_DEFAULTS["num_stages"] if num_stages is None else num_stages
    sc = prefix_scale if prefix_scale is not None else lengths  # a placeholder pointer when not SCALED
    launch(_score_select_softmax_kernel, (rows,), [
        q_hat, k_src, heads, scores, lengths, starts, counts, idx, sc,
        S, d, HKV, K, float(scale),
        q_hat.stride(0), q_hat.stride(1),
        k_src.stride(0), k_src.stride(1), k_src.stride(2),
        heads.stride(0), heads.stride(1),
        scores.stride(0), scores.stride(1),
        idx.stride(0), idx.stride(1),
        sc.stride(0) if prefix_scale is not None else 0, sc.stride(1) if prefix_scale is not None else 0,
        G, GP, aggregate == "softmax-sum", block_s, BLOCK_D,
        block_t, BLOCK, chunk or compaction_chunk(S, rows, num_sms(dev)), bits, bool(early_exit),
        num_stages, BLOCK_D == d, prefix_scale is not None, pdl(dev),
    ], dict(num_warps=num_warps, pdl=pdl(dev)))
    return scores, idx
