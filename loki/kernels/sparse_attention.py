"""Exact attention over the selected tokens only (Loki Algorithm 1, lines 6-7), in Triton.

``out[b, hq] = softmax(scale * q_hat[b, hq] . K_hat[b, kv, idx]^T) V[b, kv, idx]`` over the first
``counts[b]`` entries of the selection ``idx``; by Lemma 1 the scores against the full-dim rotated keys
are the exact scores.  The selected rows are read in place (no gathered copies).

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim
(64, 96, 128, any <= 256), K the selection's width (a bound on counts), H the selection's head axis:
H = HQ (one selection per query head) or H = HKV (one shared per KV head).

Design (flash-decoding): a 2-D grid over (B x H, splits of the K selected tokens).  Each program walks
its share of the selection in tiles of BLOCK_K tokens with an online softmax and writes a partial
(max, sum, unnormalised output); a second kernel merges the splits.  With H = HKV one program serves all
G query heads of its KV head and reads each selected K/V row once ([G, D] x [D, BLOCK_K] on the tensor
cores).  k is a runtime value (no recompile per k); accumulation is fp32.

Bytes in flight: the gathers are latency-bound (each tile's rows depend on an index load), so on the
one-head-per-program path the loop is software-pipelined by hand by default (``prefetch``): the rows of
tile i+1 and the indices of tile i+2 are requested before tile i is computed, and many small splits keep
enough programs resident.  The GQA group path does not prefetch by default (``ATTN_DEFAULTS``): there every
variant measured alike, prefetch included (docs/kernels.md).  Row offsets inside a
head are 32-bit when they cannot overflow.  With per-query-head selections the approximate scores of the
selection stage can stand in for the first d dims of every selected key (``prefix_scores``): the kernel
then reads only K[t, d:] and V[t], 448 of 512 bytes per token at D = 128, d = 32.
"""

from __future__ import annotations

import math

import torch

from loki._checks import check_count, check_no_grad, resolve_scale
from loki._triton import tl, triton
from loki.reference.sparse import sparse_attention as sparse_attention_reference

from .common import NUM_SMS_DEFAULT, check_triton_device, interpreter_tile, interpreting, num_sms
from .launch import launch, new_output, pdl

__all__ = ["ATTN_DEFAULTS", "sparse_attention", "sparse_attention_reference", "choose_num_splits"]

_LOG2E = 1.4426950408889634


@triton.jit
def _load_idx(i_base, offs, hi, OFF32: tl.constexpr):
    """Token positions of one tile of the selection (0 where masked) and the tile's mask."""
    tmask = offs < hi
    tok = tl.load(i_base + offs, mask=tmask, other=0)
    if OFF32:
        tok = tok.to(tl.int32)
    else:
        tok = tok.to(tl.int64)
    return tok, tmask


@triton.jit
def _gather_rows(tok, tmask, k_base, v_base, ps_base, stride_ks, stride_vs, offs_d, kd_mask, vd_mask,
                 PREFIX: tl.constexpr):
    """The selected K rows (only the dims in kd_mask), V rows and, with PREFIX, their approximate scores."""
    kt = tl.load(k_base + tok[:, None] * stride_ks + offs_d[None, :], mask=tmask[:, None] & kd_mask[None, :],
                 other=0.0)
    vt = tl.load(v_base + tok[:, None] * stride_vs + offs_d[None, :], mask=tmask[:, None] & vd_mask[None, :],
                 other=0.0)
    if PREFIX:
        ps = tl.load(ps_base + tok, mask=tmask, other=0.0)
    else:
        ps = tl.zeros(tok.shape, tl.float32)
    return kt, vt, ps


@triton.jit
def _head_tile(q, kt, vt, ps, tmask, m_i, l_i, acc, qk_scale, PREFIX: tl.constexpr, SLOTS: tl.constexpr):
    """Online-softmax update of one query head with one tile of selected rows (fp32 FMA).  SLOTS: m_i,
    l_i [BLOCK_K] and acc [BLOCK_K, BLOCK_D] hold one running softmax per token slot (all elementwise);
    otherwise m_i, l_i are scalars and acc is [BLOCK_D] (two cross-warp reductions per tile)."""
    s = tl.sum(kt.to(tl.float32) * q[None, :], axis=1)
    if PREFIX:
        s += ps * qk_scale
    s = tl.where(tmask, s, float("-inf"))
    if SLOTS:
        m_new = tl.maximum(m_i, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * vt.to(tl.float32)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), axis=0)
    return m_new, l_i, acc


@triton.jit
def _sparse_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, counts_ptr, ps_ptr,
    m_ptr, l_ptr, o_ptr,
    qk_scale, H, KV_DIV, TOKENS_PER_SPLIT, NSPLIT,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ih,
    stride_pb, stride_ph,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
    G_SEL: tl.constexpr, G_PAD: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    PREFETCH: tl.constexpr, OFF32: tl.constexpr, PREFIX: tl.constexpr, D_SKIP: tl.constexpr,
    SLOTS: tl.constexpr, PDL: tl.constexpr,
):
    """Partial softmax attention of G_SEL query heads over one split of one selection row.

    s_t = scale * q . K[t] over the selected t; with PREFIX (per-query-head selections) the first D_SKIP
    dims come from the approximate scores already computed for the selection (q[:d] . K[t, :d], Lemma 1:
    the full score is that plus q[d:] . K[t, d:]), so only the K[t, d:] bytes are read.  PREFETCH
    issues the gathers of tile i+1 and the index load of tile i+2 before computing tile i.  SLOTS (one
    query head per program) keeps a running softmax per token slot of the tile and combines the slots once
    at the end, so the loop has no cross-warp reduction (no barrier) at all.
    """
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    b = pid // H
    hs = pid % H
    kv = hs // KV_DIV
    hq0 = hs * G_SEL
    if PDL:  # programmatic dependent launch: start early, wait here for the selection to be complete
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    count = tl.load(counts_ptr + b).to(tl.int64)
    lo = split * TOKENS_PER_SPLIT
    hi = tl.minimum(lo + TOKENS_PER_SPLIT, count)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    kd_mask = dmask & (offs_d >= D_SKIP)
    k_base = k_ptr + b * stride_kb + kv * stride_kh
    v_base = v_ptr + b * stride_vb + kv * stride_vh
    i_base = idx_ptr + b * stride_ib + hs * stride_ih
    ps_base = ps_ptr + b * stride_pb + hs * stride_ph
    ar = tl.arange(0, BLOCK_K)
    # partial results: [B, HQ, NSPLIT] for m, l and [B, HQ, NSPLIT, BLOCK_D] for o (contiguous)
    part = (b * (H * G_SEL) + hq0) * NSPLIT + split
    if G_SEL == 1:
        q = tl.load(q_ptr + b * stride_qb + hq0 * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        q = q * qk_scale
        if SLOTS:  # one running softmax per token slot of the tile: no cross-warp reduction inside the loop
            m_i = tl.full((BLOCK_K,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_K,), tl.float32)
            acc = tl.zeros((BLOCK_K, BLOCK_D), tl.float32)
        else:
            m_i = tl.max(tl.full((BLOCK_K,), float("-inf"), tl.float32), axis=0)
            l_i = tl.sum(tl.zeros((BLOCK_K,), tl.float32), axis=0)
            acc = tl.zeros((BLOCK_D,), tl.float32)
        if PREFETCH:
            tok, tmask = _load_idx(i_base, lo + ar, hi, OFF32)
            kt, vt, ps = _gather_rows(tok, tmask, k_base, v_base, ps_base, stride_ks, stride_vs, offs_d, kd_mask,
                                      dmask, PREFIX)
            tok1, m1 = _load_idx(i_base, lo + BLOCK_K + ar, hi, OFF32)
            for start in range(lo, hi, BLOCK_K):
                kt_n, vt_n, ps_n = _gather_rows(tok1, m1, k_base, v_base, ps_base, stride_ks, stride_vs, offs_d,
                                                kd_mask, dmask, PREFIX)
                tok2, m2 = _load_idx(i_base, start + 2 * BLOCK_K + ar, hi, OFF32)
                m_i, l_i, acc = _head_tile(q, kt, vt, ps, tmask, m_i, l_i, acc, qk_scale, PREFIX, SLOTS)
                kt, vt, ps, tmask = kt_n, vt_n, ps_n, m1
                tok1, m1 = tok2, m2
        else:
            for start in range(lo, hi, BLOCK_K):
                tok, tmask = _load_idx(i_base, start + ar, hi, OFF32)
                kt, vt, ps = _gather_rows(tok, tmask, k_base, v_base, ps_base, stride_ks, stride_vs, offs_d,
                                          kd_mask, dmask, PREFIX)
                m_i, l_i, acc = _head_tile(q, kt, vt, ps, tmask, m_i, l_i, acc, qk_scale, PREFIX, SLOTS)
        if SLOTS:  # combine the slots once
            m_all = tl.max(m_i, axis=0)
            w = tl.exp2(m_i - tl.where(m_all == float("-inf"), 0.0, m_all))
            l_all = tl.sum(l_i * w, axis=0)
            o_all = tl.sum(acc * w[:, None], axis=0)
            tl.store(m_ptr + part, m_all)
            tl.store(l_ptr + part, l_all)
            tl.store(o_ptr + part * BLOCK_D + offs_d, o_all)
        else:
            tl.store(m_ptr + part, m_i)
            tl.store(l_ptr + part, l_i)
            tl.store(o_ptr + part * BLOCK_D + offs_d, acc)
    else:
        offs_g = tl.arange(0, G_PAD)
        gmask = offs_g < G_SEL
        q = tl.load(q_ptr + b * stride_qb + (hq0 + offs_g[:, None]) * stride_qh + offs_d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
        if PREFETCH:
            tok, tmask = _load_idx(i_base, lo + ar, hi, OFF32)
            kt, vt, ps = _gather_rows(tok, tmask, k_base, v_base, ps_base, stride_ks, stride_vs, offs_d, dmask,
                                      dmask, False)
            tok1, m1 = _load_idx(i_base, lo + BLOCK_K + ar, hi, OFF32)
            for start in range(lo, hi, BLOCK_K):
                kt_n, vt_n, ps_n = _gather_rows(tok1, m1, k_base, v_base, ps_base, stride_ks, stride_vs, offs_d,
                                                dmask, dmask, False)
                tok2, m2 = _load_idx(i_base, start + 2 * BLOCK_K + ar, hi, OFF32)
                m_i, l_i, acc = _group_tile(q, kt, vt, tmask, m_i, l_i, acc, qk_scale, UPCAST, IEEE)
                kt, vt, tmask = kt_n, vt_n, m1
                tok1, m1 = tok2, m2
        else:
            for start in range(lo, hi, BLOCK_K):
                tok, tmask = _load_idx(i_base, start + ar, hi, OFF32)
                kt, vt, ps = _gather_rows(tok, tmask, k_base, v_base, ps_base, stride_ks, stride_vs, offs_d,
                                          dmask, dmask, False)
                m_i, l_i, acc = _group_tile(q, kt, vt, tmask, m_i, l_i, acc, qk_scale, UPCAST, IEEE)
        gpart = part + offs_g * NSPLIT
        tl.store(m_ptr + gpart, m_i, mask=gmask)
        tl.store(l_ptr + gpart, l_i, mask=gmask)
        tl.store(o_ptr + gpart[:, None] * BLOCK_D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _group_tile(q, kt, vt, tmask, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update of the G query heads of a group with one tile of selected rows (tensor cores)."""
    if UPCAST:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    if IEEE:
        s = tl.dot(q, tl.trans(kt), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kt))
    s = s * qk_scale
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
    else:
        pv = tl.dot(p.to(vt.dtype), vt)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _merge_splits_kernel(
    m_ptr, l_ptr, o_ptr, out_ptr,
    NSPLIT, stride_ob, stride_oh, HQ,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLIT: tl.constexpr, PDL: tl.constexpr,
):
    """out = sum_j 2^(m_j - M) o_j / sum_j 2^(m_j - M) l_j over the splits j of one (b, hq)."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HQ
    hq = pid % HQ
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs_j = tl.arange(0, BLOCK_SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    jmask = offs_j < NSPLIT
    base = pid * NSPLIT
    m = tl.load(m_ptr + base + offs_j, mask=jmask, other=float("-inf"))
    l = tl.load(l_ptr + base + offs_j, mask=jmask, other=0.0)
    M = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp2(m - M), 0.0)
    L = tl.sum(l * w, axis=0)
    o = tl.load(o_ptr + (base + offs_j)[:, None] * BLOCK_D + offs_d[None, :], mask=jmask[:, None], other=0.0)
    acc = tl.sum(o * w[:, None], axis=0) / L
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + offs_d, acc.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


def choose_num_splits(rows: int, K: int, block_k: int, *, programs_per_sm: int = 2, min_splits: int = 4,
                      min_tiles: int = 4, max_splits: int = 64, num_sms: int = NUM_SMS_DEFAULT,
                      many_rows_per_sm: float | None = None, min_splits_many: int | None = None) -> int:
    """Splits of the K selected tokens: at least ``min_splits`` (``min_splits_many`` when there are at least
    ``many_rows_per_sm`` rows per SM) and enough for ``programs_per_sm`` programs per SM over the rows x
    splits grid, but each split keeps at least ``min_tiles`` tiles of work; at most ``max_splits``.
    (H100, one head per program, 40 heads: B=16 -> 3 splits, B=4 -> 4, B=1 S=16384 -> 7.)"""
    if many_rows_per_sm is not None and min_splits_many is not None and rows >= many_rows_per_sm * num_sms:
        min_splits = min_splits_many
    max_by_work = max(1, K // (min_tiles * block_k))
    want = max(min_splits, math.ceil(programs_per_sm * num_sms / max(rows, 1)))
    return int(max(1, min(want, max_by_work, max_splits)))


#: Launch defaults per path (G_SEL = 1: one query head per program, FMA; G_SEL > 1: a GQA group per
#: program on the tensor cores), measured on an H100 (docs/kernels.md): tile, warps, software prefetch,
#: per-slot softmax, and the split-count rule (``choose_num_splits``).
ATTN_DEFAULTS = {
    "head": dict(block_k=32, num_warps=4, prefetch=True, slots=True,
                 splits=dict(programs_per_sm=2, min_splits=4, min_tiles=4, max_splits=64, many_rows_per_sm=4,
                             min_splits_many=3)),
    "group": dict(block_k=64, num_warps=4, prefetch=False, slots=False,
                  splits=dict(programs_per_sm=4, min_splits=1, min_tiles=2, max_splits=64)),
}


def sparse_attention(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    v_cache: torch.Tensor,
    idx: torch.Tensor,
    counts: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch: bool | None = None,
    slots: bool | None = None,
    prefix_scores: torch.Tensor | None = None,
    prefix_dims: int = 0,
) -> torch.Tensor:
    """softmax(scale * q_hat K_hat[idx]^T) V[idx] over the first ``counts[b]`` entries of each idx row.

    q_hat: [B, HQ, D]; k_hat, v_cache: [B, HKV, S, D] (fp16, bf16 or fp32, last dim contiguous);
    idx: [B, H, K] int32 or int64 with H in {HQ, HKV} (entries at positions >= counts[b] are ignored
    and never read); counts: [B] int on the same device, 1 <= counts[b] <= K.
    Returns out [B, HQ, D] in q_hat's dtype (fp32 accumulation).  scale defaults to 1/sqrt(D).
    Matches ``sparse_attention_reference``.

    ``prefix_scores`` ([B, HQ, S] fp32, per-query-head selections only, H = HQ) with ``prefix_dims`` = d:
    the approximate scores ``q_hat[:d] . K_hat[t, :d]`` of the selection stage; the kernel then reads only
    ``K_hat[t, d:]`` and adds them (saves d/D of the selected K bytes).  ``prefetch`` issues the next
    tile's gathers before the current tile's math; ``slots`` (one query head per program) keeps one
    running softmax per token slot; ``num_splits``, ``block_k``, ``num_warps``, ``num_stages`` override the
    launch configuration (defaults: ``ATTN_DEFAULTS``).
    """
    if q_hat.dim() != 3 or k_hat.dim() != 4 or v_cache.shape != k_hat.shape:
        raise ValueError(f"expected q_hat [B, HQ, D], k_hat and v_cache [B, HKV, S, D]; got "
                         f"{list(q_hat.shape)}, {list(k_hat.shape)}, {list(v_cache.shape)}")
    B, HQ, D = q_hat.shape
    _, HKV, S, _ = k_hat.shape
    if idx.dim() != 3 or idx.shape[0] != B or idx.shape[1] not in (HQ, HKV):
        raise ValueError(f"idx must have shape [B, H, K] with B={B}, H in (HQ={HQ}, HKV={HKV}); got {list(idx.shape)}")
    if counts.shape != (B,):
        raise ValueError(f"counts must have shape [B]=[{B}], got {list(counts.shape)}")
    if idx.dtype not in (torch.int32, torch.int64) or counts.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"idx and counts must be int32 or int64, got {idx.dtype} and {counts.dtype}")
    check_triton_device(q_hat, "sparse_attention")
    check_no_grad("sparse_attention (Triton)", q_hat=q_hat, k_hat=k_hat, v_cache=v_cache)
    num_splits = check_count(num_splits, "num_splits")
    if block_k is not None and (check_count(block_k, "block_k", minimum=16) & (block_k - 1)):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    H, K = idx.shape[1], idx.shape[2]
    if K < 1:
        raise ValueError(f"idx must hold at least one selected token per row (K >= 1), got shape {list(idx.shape)}")
    G = HQ // HKV
    if H == HQ:
        g_sel, kv_div = 1, G
    else:
        g_sel, kv_div = G, 1
    use_prefix = prefix_scores is not None and prefix_dims > 0
    if use_prefix:
        if H != HQ:
            raise ValueError("prefix_scores needs per-query-head selections (idx [B, HQ, K])")
        if (prefix_scores.shape != (B, HQ, S) or prefix_scores.dtype != torch.float32
                or prefix_scores.stride(-1) != 1 or not 0 < prefix_dims <= D):
            raise ValueError(f"prefix_scores must be a contiguous fp32 [B, HQ, S]=[{B}, {HQ}, {S}] tensor and "
                             f"0 < prefix_dims <= D={D}; got {prefix_scores.dtype} {list(prefix_scores.shape)}, "
                             f"prefix_dims={prefix_dims}")
    q_hat = q_hat if q_hat.stride(-1) == 1 else q_hat.contiguous()
    k_hat = k_hat if k_hat.stride(-1) == 1 else k_hat.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    sm_scale = resolve_scale(scale, D)
    BLOCK_D = triton.next_power_of_2(D)
    interp = interpreting()
    rows = B * H  # programs per split
    dflt = ATTN_DEFAULTS["head" if g_sel == 1 else "group"]
    if block_k is None:
        block_k = interpreter_tile(K, 1024, 16) if interp else dflt["block_k"]
    if num_splits is None:
        num_splits = 1 if interp else choose_num_splits(rows, K, block_k, num_sms=num_sms(q_hat.device),
                                                         **dflt["splits"])
    num_warps = dflt["num_warps"] if num_warps is None else num_warps
    prefetch = dflt["prefetch"] if prefetch is None else prefetch
    slots = dflt["slots"] if slots is None else slots
    num_stages = dflt.get("num_stages") if num_stages is None else num_stages
    tokens_per_split = triton.cdiv(triton.cdiv(K, num_splits), block_k) * block_k
    num_splits = triton.cdiv(K, tokens_per_split)
    dev = q_hat.device
    # partial (max, sum, output) of every split in one workspace
    n_ml = B * HQ * num_splits
    n_pad = triton.cdiv(n_ml, 32) * 32  # keep every part 128-byte aligned
    ws = new_output((2 * n_pad + n_ml * BLOCK_D,), torch.float32, dev)
    m_part, l_part, o_part = ws[:n_ml], ws[n_pad:n_pad + n_ml], ws[2 * n_pad:]
    if out is None:
        out = new_output((B, HQ, D), q_hat.dtype, dev)
    elif out.shape != (B, HQ, D) or out.dtype != q_hat.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a {q_hat.dtype} tensor of shape [B, HQ, D]=[{B}, {HQ}, {D}]")
    upcast = interp or q_hat.dtype == torch.float32
    ieee = q_hat.dtype == torch.float32 or interp
    g_pad = max(16, triton.next_power_of_2(g_sel))
    # 32-bit row offsets inside one head when they cannot overflow
    off32 = S * max(k_hat.stride(2), v_cache.stride(2)) < 2**31
    ps = prefix_scores if use_prefix else ws
    use_pdl = pdl(dev)
    launch(_sparse_attn_split_kernel, (rows, num_splits), [
        q_hat, k_hat, v_cache, idx, counts, ps,
        m_part, l_part, o_part,
        sm_scale * _LOG2E, H, kv_div, tokens_per_split, num_splits,
        q_hat.stride(0), q_hat.stride(1),
        k_hat.stride(0), k_hat.stride(1), k_hat.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        idx.stride(0), idx.stride(1),
        ps.stride(0) if use_prefix else 0, ps.stride(1) if use_prefix else 0,
        D, BLOCK_D, block_k, g_sel, g_pad, upcast, ieee,
        bool(prefetch), off32, use_prefix, prefix_dims if use_prefix else 0,
        bool(slots) and g_sel == 1, use_pdl,
    ], dict(num_warps=num_warps, pdl=use_pdl, **({} if num_stages is None else {"num_stages": num_stages})))
    launch(_merge_splits_kernel, (B * HQ,), [
        m_part, l_part, o_part, out,
        num_splits, out.stride(0), out.stride(1), HQ,
        D, BLOCK_D, max(2, triton.next_power_of_2(num_splits)), use_pdl,
    ], dict(num_warps=4, pdl=use_pdl))
    return out
