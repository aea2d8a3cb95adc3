"""Approximate attention scores from the leading principal dims (Loki Algorithm 1, lines 3-4), in Triton.

``s[b, hq, t] = q_hat[b, hq, :d] . K_hat[b, hq // G, t, :d]`` for every cached token t, -inf outside the
valid tokens ``starts[b] <= t < lengths[b]``.  Optionally (GQA "kv" selection) the per-KV-head aggregate
over the G query heads of a group: sum or max here, the softmax aggregates from the per-query-head scores in two
more launches (``group_softmax.py``; probabilities, of which ``approx_scores`` returns the log).

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim,
d leading principal dims (runtime, d <= D).

Design: a 2-D grid over (B x HKV, token blocks).  Each program reads a [BLOCK_S, d] tile of the rotated
keys (only the first d dims of each row: d/D of the key bytes) once and scores it against all G query
heads of its group, so the key read is shared across the group.  Tails and invalid tokens are masked;
invalid rows are not even read.

Key layout: the first d dims can be read in place from ``k_hat`` (a strided read of 64 of every 256
bytes at D = 128, d = 32 in bf16: on an H100 it takes 1.4-1.5x the time of reading the same bytes
contiguously), or from an optional contiguous prefix buffer ``k_prefix: [B, HKV, S, dp]`` (dp >= d; the
cache keeps the first dp rotated dims of every key a second time, ``make_key_prefix``), which reads
exactly d/D of the key bytes when dp = d (78-92% of copy bandwidth on an H100).
"""

from __future__ import annotations

import torch

from loki._checks import check_decode_inputs, check_no_grad, resolve_d, resolve_scale
from loki._triton import tl, triton
from loki.reference.selection import GQA_SELECT_MODES, check_kernel_aggregate
from loki.reference.selection import approx_scores as approx_scores_reference

from .common import check_triton_device, interpreter_tile, interpreting, key_block
from .group_softmax import SOFTMAX_AGGREGATES, launch_group_softmax
from .launch import launch, new_output, pdl
from .tl_helpers import bf16_rne, int8_codes, int8_to_f16, int8_to_f32, score_keys

__all__ = ["approx_scores", "approx_scores_reference", "make_key_prefix"]


#: The tensor-core products of an int8 copy's per-head scores when ``launch_approx_scores`` is not told: "int8" (the
#: codes as loaded, the query in four int8 pieces; needs d >= 32) or "f16" (the codes converted, the query in two fp16
#: halves). On an H200 "int8" takes 0.93-0.97x the bf16 prefix's time, "f16" 1.21-1.29x
#: (results/int8-products-h200-2026-11-28/).
INT8_PRODUCTS = "int8"


@triton.jit
def _pow2_of_max(v, UP: tl.constexpr):
    """Per row of v, from the exponent bits of its largest magnitude a (as a power of two, so that products by it are
    exact): m = 2**(5 - floor(log2 a)) (32 <= a m < 64) when ``UP``, else 1 / m.  The exponent fields are clamped to
    the normal range (rows of magnitude below 2**-121 or not finite)."""
    e = ((tl.max(tl.abs(v), axis=1).to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
    field = 259 - e if UP else e - 5
    field = tl.minimum(tl.maximum(field, 1), 254)
    return (field << 23).to(tl.float32, bitcast=True)


@triton.jit
def _approx_scores_kernel(
    q_ptr, k_ptr, out_ptr, agg_ptr, lengths_ptr, starts_ptr, scale_ptr,
    S, d, HKV,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_ob, stride_oh,
    stride_ab, stride_ah,
    stride_cb, stride_ch,
    G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_HEADS: tl.constexpr, WRITE_AGG: tl.constexpr, AGG_MAX: tl.constexpr, SCALED: tl.constexpr,
    DOT: tl.constexpr, MMA8: tl.constexpr, G_PAD: tl.constexpr, EVEN_D: tl.constexpr, TILES: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr,
):
    """s[g, t] = sum_{j<d} q_hat[h*G+g, j] K_hat[h, t, j] for one (b, h) and TILES blocks of BLOCK_S tokens t (a
    loop that ``NUM_STAGES`` pipelines: the next tile's keys load while this one is scored). ``SCALED``: the keys
    are an int8 score copy, each token's row times its scale (``scale_ptr`` [B, HKV, S] bf16), its codes
    converted by integer adds (``int8_to_f16``/``int8_to_f32``, not the conversion unit). ``DOT``: the group's
    per-head scores of an int8 copy as tensor-core products: the codes are exact in fp16 and each query, over its
    largest magnitude, is split into two fp16 halves (``q = m (hi + lo)``, about 22 of fp32's 24 mantissa bits),
    accumulated in fp32. ``MMA8``: instead, the int8 codes go to the tensor cores as they are loaded: each query
    scaled by a power of two m to 32 <= max |m q| < 64, is written as four int8 pieces (``m q = p0 + p1/128 +
    p2/128**2 + p3/128**3`` up to 2**-22, i.e. 2**-27 of the largest), the [4 G_PAD, d] pieces times the [d,
    BLOCK_S] codes is one exact int32 product (keys along its columns, as the scores are stored), and the pieces'
    rows are weighted and summed in fp32. ``QUANT`` (with ``SCALED``): the keys are the cache's own keys, and each
    token's first d dims are rounded to the int8 copy here, as the cache write would have stored them (its bf16
    scale, its codes: ``bf16_rne``, ``int8_codes``), so the scores are the copy's (bit for bit with ``MMA8``; the
    fp32 sums of the other paths follow the tile's layout, which the 16-bit load sets), at the read of the 16-bit
    dims. ``EVEN_D``: d fills the tile (a row mask only, so the loads are vectors)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    b = pid_bh // HKV
    h = pid_bh % HKV
    if PDL:  # programmatic dependent launch (launch.py): wait for the previous kernel's writes
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < d
    k_base = k_ptr + b * stride_kb + h * stride_kh
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    if MMA8:  # the group's queries as four int8 pieces each (rows piece * G_PAD + g), to 2**-27 of the largest
        qg = tl.load(q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                     mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [G_PAD, BLOCK_D]
        inv_m = _pow2_of_max(qg, False)  # 1 / m per head
        rows = tl.arange(0, 4 * G_PAD)
        piece = rows // G_PAD
        rg = rows % G_PAD
        qr = tl.load(q_ptr + b * stride_qb + (h * G + rg)[:, None] * stride_qh + offs_d[None, :],
                     mask=(rg < G)[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [4 G_PAD, BLOCK_D]
        x = qr * _pow2_of_max(qr, True)[:, None]  # |x| < 64, exactly
        pc = piece[:, None]
        q8 = tl.zeros((4 * G_PAD, BLOCK_D), tl.float32)
        for j in tl.static_range(4):  # the pieces of weight 128**-j: exact subtractions and power-of-two products
            pj = tl.floor(x + 0.5)
            q8 = tl.where(pc == j, pj, q8)
            x = (x - pj) * 128.0
        q8 = q8.to(tl.int8)
        wrow = tl.where(piece == 0, 1.0, tl.where(piece == 1, 2.0**-7, 2.0**-14))
        wrow = tl.where(piece == 3, 2.0**-21, wrow)  # 128**-piece, exactly
    if DOT:  # the group's queries, each over its largest magnitude and split into two fp16 halves
        qg = tl.load(q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                     mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [G_PAD, BLOCK_D]
        qmax = tl.max(tl.abs(qg), axis=1)
        qmax = tl.where(qmax > 0, qmax, 1.0)  # in fp16's range
        qn = qg / qmax[:, None]
        q_hi = qn.to(tl.float16)
        q_lo = (qn - q_hi.to(tl.float32)).to(tl.float16)
    # the sum over the group's heads is one dot product with the summed query (fp32)
    qs = tl.zeros((BLOCK_D,), tl.float32)
    if WRITE_AGG and not WRITE_HEADS and not AGG_MAX and not DOT:
        for g in tl.static_range(G):
            qs += tl.load(q_ptr + b * stride_qb + (h * G + g) * stride_qh + offs_d, mask=dmask, other=0.0).to(
                tl.float32)
    for i in tl.range(0, TILES, num_stages=NUM_STAGES):
        offs_s = (pid_s * TILES + i) * BLOCK_S + tl.arange(0, BLOCK_S)
        in_range = offs_s < S
        valid = (offs_s >= start) & (offs_s < length)
        if EVEN_D:
            kmask = valid[:, None]
        else:
            kmask = valid[:, None] & dmask[None, :]
        k_ptrs = k_base + offs_s[:, None] * stride_ks + offs_d[None, :]
        if QUANT:  # the int8 copy of the keys in place: each token's scale and codes (invalid rows: zeros)
            kx = tl.load(k_ptrs, mask=kmask, other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
            row_scale = bf16_rne(tl.math.div_rn(tl.max(tl.abs(kx), axis=1), 127.0)).to(tl.float32)
            div = tl.where(row_scale > 0, row_scale, 1.0)
            codes8 = int8_codes(kx, tl.broadcast_to(div[:, None], (BLOCK_S, BLOCK_D)))
        elif SCALED:  # one scale per token: s = scale * (q . codes)
            row_scale = tl.load(scale_ptr + b * stride_cb + h * stride_ch + offs_s, mask=valid, other=0.0).to(
                tl.float32)
        else:
            row_scale = tl.full((BLOCK_S,), 1.0, tl.float32)
        if MMA8:
            if QUANT:
                codes = codes8
            else:
                codes = tl.load(k_ptrs, mask=kmask, other=0)  # [BLOCK_S, BLOCK_D] int8
            acc = tl.dot(q8, tl.trans(codes), out_dtype=tl.int32)  # [4 G_PAD, BLOCK_S], exact
            part = tl.reshape(acc.to(tl.float32) * wrow[:, None], (4, G_PAD, BLOCK_S))
            sg = tl.sum(part, axis=0) * inv_m[:, None] * row_scale[None, :]  # [G_PAD, BLOCK_S]
            sg = tl.where(valid[None, :], sg, float("-inf"))
            if WRITE_HEADS:
                tl.store(out_ptr + b * stride_ob + (h * G + offs_g)[:, None] * stride_oh + offs_s[None, :], sg,
                         mask=gmask[:, None] & in_range[None, :])
            if WRITE_AGG:
                if AGG_MAX:
                    agg = tl.max(tl.where(gmask[:, None], sg, float("-inf")), axis=0)
                else:
                    agg = tl.sum(tl.where(gmask[:, None], sg, 0.0), axis=0)
                agg = tl.where(valid, agg, float("-inf"))
                tl.store(agg_ptr + b * stride_ab + h * stride_ah + offs_s, agg, mask=in_range)
        elif DOT:
            if QUANT:
                codes = int8_to_f16(codes8)
            else:
                codes = int8_to_f16(tl.load(k_ptrs, mask=kmask, other=0))  # [BLOCK_S, BLOCK_D]
            sg = tl.dot(codes, tl.trans(q_hi), out_dtype=tl.float32)
            sg = tl.dot(codes, tl.trans(q_lo), acc=sg, out_dtype=tl.float32)  # [BLOCK_S, G_PAD]
            sg = tl.where(valid[:, None], sg * qmax[None, :] * row_scale[:, None], float("-inf"))
            if WRITE_HEADS:
                tl.store(out_ptr + b * stride_ob + (h * G + offs_g)[None, :] * stride_oh + offs_s[:, None], sg,
                         mask=in_range[:, None] & gmask[None, :])
            if WRITE_AGG:
                if AGG_MAX:
                    agg = tl.max(tl.where(gmask[None, :], sg, float("-inf")), axis=1)
                else:
                    agg = tl.sum(tl.where(gmask[None, :], sg, 0.0), axis=1)
                agg = tl.where(valid, agg, float("-inf"))
                tl.store(agg_ptr + b * stride_ab + h * stride_ah + offs_s, agg, mask=in_range)
        else:
            if QUANT:
                kt = int8_to_f32(codes8)
            else:
                kt = score_keys(k_ptrs, kmask, SCALED)
            if WRITE_AGG and not WRITE_HEADS and not AGG_MAX:
                agg = tl.sum(kt * qs[None, :], axis=1)
                if SCALED:
                    agg = agg * row_scale
            else:
                if AGG_MAX:
                    agg = tl.full((BLOCK_S,), float("-inf"), tl.float32)
                else:
                    agg = tl.zeros((BLOCK_S,), tl.float32)
                for g in tl.static_range(G):
                    hq = h * G + g
                    q = tl.load(q_ptr + b * stride_qb + hq * stride_qh + offs_d, mask=dmask, other=0.0).to(
                        tl.float32)
                    s = tl.sum(kt * q[None, :], axis=1)
                    if SCALED:
                        s = s * row_scale
                    s = tl.where(valid, s, float("-inf"))
                    if WRITE_HEADS:
                        tl.store(out_ptr + b * stride_ob + hq * stride_oh + offs_s, s, mask=in_range)
                    if WRITE_AGG:
                        if AGG_MAX:
                            agg = tl.maximum(agg, s)
                        else:
                            agg = agg + s
            if WRITE_AGG:
                agg = tl.where(valid, agg, float("-inf"))
                tl.store(agg_ptr + b * stride_ab + h * stride_ah + offs_s, agg, mask=in_range)


def launch_softmax_group_scores(q_hat, k_src, dd, lengths, starts, heads_out, agg_out, HKV, aggregate, scale,
                                 block_s=None, prefix_scale=None, quantize=False):
    """A softmax ``aggregate`` of a "kv" selection, unfused: the per-query-head scores into ``heads_out`` [B, HQ, S],
    then the group's probability scores into ``agg_out`` [B, HKV, S] (``group_softmax.py``; two launches)."""
    launch_approx_scores(q_hat, k_src, dd, lengths, starts, heads_out, None, "sum", block_s,
                         prefix_scale=prefix_scale, quantize=quantize)
    launch_group_softmax(heads_out, lengths, starts, agg_out, HKV, aggregate, scale)


def make_key_prefix(k_hat: torch.Tensor, d: int) -> torch.Tensor:
    """The contiguous prefix buffer ``k_prefix: [B, HKV, S, d]`` (a copy of ``k_hat[..., :d]``) that lets
    the approximate scores read exactly d/D of the key bytes.  A cache keeps it beside ``k_hat`` and
    appends each new key's first d rotated dims to both."""
    return k_hat[..., :d].contiguous()


def check_key_prefix(k_prefix: torch.Tensor, k_hat: torch.Tensor, dd: int,
                     prefix_scale: torch.Tensor | None = None) -> torch.Tensor:
    B, HKV, S, _ = k_hat.shape
    want = torch.int8 if prefix_scale is not None else k_hat.dtype
    if (k_prefix.dim() != 4 or tuple(k_prefix.shape[:3]) != (B, HKV, S) or not dd <= k_prefix.shape[3]
            or k_prefix.dtype != want or k_prefix.device != k_hat.device):
        raise ValueError(f"k_prefix must be a {want} tensor [B, HKV, S, dp]=[{B}, {HKV}, {S}, >={dd}] on "
                         f"{k_hat.device}, got {k_prefix.dtype} {list(k_prefix.shape)} on {k_prefix.device}")
    if prefix_scale is not None and (tuple(prefix_scale.shape) != (B, HKV, S) or prefix_scale.dtype != torch.bfloat16
                                     or prefix_scale.device != k_hat.device or prefix_scale.stride(-1) != 1):
        raise ValueError(f"prefix_scale must be a contiguous bfloat16 tensor [B, HKV, S]=[{B}, {HKV}, {S}] on "
                         f"{k_hat.device}, got {prefix_scale.dtype} {list(prefix_scale.shape)}")
    return k_prefix if k_prefix.stride(-1) == 1 else k_prefix.contiguous()


def launch_approx_scores(q_hat, k_hat, dd, lengths, starts, heads_out, agg_out, aggregate, block_s=None,
                          num_warps=None, prefix_scale=None, dot=None, tiles=None, num_stages=None, quantize=False):
    """Launch the scores kernel; ``k_hat`` is the full [B, HKV, S, D] keys or a prefix buffer [.., dp] (int8 codes with
    ``prefix_scale`` [B, HKV, S] bf16 for an int8 score copy, whose per-head scores run on the tensor cores unless
    ``dot=False``: ``dot="int8"`` as int8 products of the codes and the query's int8 pieces when d >= 32, else and
    with ``dot=True`` or ``"f16"`` as fp16 products of the converted codes and the query's fp16 halves; default
    :data:`INT8_PRODUCTS`). ``quantize``: ``k_hat`` holds 16-bit keys (no ``prefix_scale``) whose first ``dd`` dims
    the kernel rounds to the int8 copy per token as it reads them: the scores of an int8 setting on a cache that keeps
    no copy, from the copy's codes and scales (the same scores up to the order of fp32 sums). ``tiles`` blocks of
    ``block_s`` keys per program (default 1; 4 for fp16 products), ``num_stages`` pipelining them."""
    if aggregate not in ("sum", "max"):  # the kernel sums unless told "max": never another aggregate silently
        raise ValueError(f"the approximate-scores kernel aggregates by 'sum' or 'max', got {aggregate!r}")
    B, HQ, _ = q_hat.shape
    _, HKV, S, D = k_hat.shape
    G = HQ // HKV
    BLOCK_D = triton.next_power_of_2(dd)
    contiguous_rows = k_hat.stride(2) == dd  # a prefix buffer of exactly d dims: one contiguous stream
    if quantize and (prefix_scale is not None or k_hat.dtype == torch.int8):
        raise ValueError("quantize rounds 16-bit keys to the int8 copy in place: pass the keys, not a copy and its "
                         "prefix_scale")
    scaled = prefix_scale is not None or quantize
    if block_s is None:
        if interpreting():
            block_s = interpreter_tile(S, 2048)
        else:  # an int8 copy: 128 keys, 2 warps, the fastest measured on an H100 (results/score-formats-h100-...)
            block_s = 128 if scaled else key_block(BLOCK_D, contiguous_rows)
    if num_warps is None:
        num_warps = 2 if scaled else 4
    dummy = heads_out if heads_out is not None else agg_out
    ho = heads_out if heads_out is not None else dummy
    ao = agg_out if agg_out is not None else dummy
    blocks = triton.cdiv(S, block_s)
    # an int8 copy's per-head scores on the tensor cores (tl.dot takes tiles of at least 16 in every dimension)
    if dot not in (None, True, False, "int8", "f16"):
        raise ValueError(f"dot must be None, True, False, 'int8' or 'f16', got {dot!r}")
    if dot is None or dot is True:
        dot = INT8_PRODUCTS if dot is None else "f16"
    tensor_cores = scaled and heads_out is not None and block_s >= 16 and dot is not False
    use_mma8 = tensor_cores and BLOCK_D >= 32 and dot == "int8"
    use_dot = tensor_cores and BLOCK_D >= 16 and not use_mma8
    if tiles is None:  # an int8 copy's per-head scores as fp16 products: 4 tiles per program, 2 stages, the fastest
        # measured on an H100 (results/int8-convert-h100-2026-11-28); everything else, int8 products included, one
        # tile, as fast as any measured (results/int8-products-h200-2026-11-28)
        tiles = 4 if use_dot and not interpreting() else 1
        tiles = max(1, min(tiles, blocks))
    if num_stages is None:
        num_stages = 2 if tiles > 1 and not interpreting() else 1
    nc = triton.cdiv(blocks, tiles)
    grid = (B * HKV, nc)
    use_pdl = pdl(q_hat.device)
    sc = prefix_scale if prefix_scale is not None else lengths  # a placeholder pointer when not SCALED
    # the int8 pieces take 4 rows per head (the product's rows: at least 16); the fp16 halves' columns at least 16
    G_PAD = max(4, triton.next_power_of_2(G)) if use_mma8 else max(16, triton.next_power_of_2(G))
    launch(_approx_scores_kernel, grid, [
        q_hat, k_hat, ho, ao, lengths, starts, sc,
        S, dd, HKV,
        q_hat.stride(0), q_hat.stride(1),
        k_hat.stride(0), k_hat.stride(1), k_hat.stride(2),
        ho.stride(0), ho.stride(1),
        ao.stride(0), ao.stride(1),
        sc.stride(0) if prefix_scale is not None else 0, sc.stride(1) if prefix_scale is not None else 0,
        G, block_s, BLOCK_D,
        heads_out is not None, agg_out is not None, aggregate == "max", scaled, use_dot, use_mma8,
        G_PAD,
        BLOCK_D == dd, tiles, num_stages, use_pdl, quantize,
    ], dict(num_warps=num_warps, pdl=use_pdl))


def approx_scores(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    d: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    *,
    gqa_select: str,
    aggregate: str,
    return_both: bool = False,
    out: torch.Tensor | None = None,
    block_s: int | None = None,
    k_prefix: torch.Tensor | None = None,
    scale: float | None = None,
    prefix_scale: torch.Tensor | None = None,
):
    """Approximate scores ``q_hat[:d] . K_hat[:, :d]^T`` (unscaled, fp32), -inf outside valid tokens.

    q_hat: [B, HQ, D]; k_hat: [B, HKV, S, D] (last dim contiguous); lengths, starts: [B] int.
    Returns [B, H, S] fp32 with H = HQ for ``gqa_select="query"`` and H = HKV for ``"kv"`` (the group's
    scores combined by ``aggregate``: "sum", "max", or a softmax aggregate with the attention ``scale``, default
    ``1/sqrt(D)``; ``loki.reference.selection.aggregate_group_scores``).  A softmax aggregate comes back in the
    reference's log space: the kernels compute probabilities (``group_softmax.py``, what the decode step selects
    on) and this function takes their ``log`` (one more pass over [B, HKV, S]; a probability that underflowed to
    0 gives -inf there, where the reference has a finite value below about -87).  ``return_both`` returns
    ``(per_query_head [B, HQ, S], per_kv_head [B, HKV, S])`` from the same pass over the keys.
    ``out`` (optional) receives the [B, H, S] result.  ``k_prefix`` (optional): [B, HKV, S, dp], dp >= d,
    holding ``k_hat[..., :dp]`` contiguously (``make_key_prefix``); the keys are then read from it.
    Matches ``approx_scores_reference``.  With ``prefix_scale`` [B, HKV, S] bf16, ``k_prefix`` is the "int8" score
    copy (int8 codes, :func:`loki.reference.score_formats.encode_int8_score_keys`) and the result matches the
    reference's ``score_format="int8"`` (up to the order of the rounding: the kernel scales each token's dot product).
    """
    if gqa_select not in GQA_SELECT_MODES:
        raise ValueError(f"gqa_select must be one of {GQA_SELECT_MODES}, got {gqa_select!r}")
    check_kernel_aggregate(aggregate, "approx_scores (Triton)")
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q_hat, k_hat, k_hat, lengths, starts)
    check_triton_device(q_hat, "approx_scores")
    check_no_grad("approx_scores (Triton)", q_hat=q_hat, k_hat=k_hat, k_prefix=k_prefix)
    dd = resolve_d(d, D)
    scale = resolve_scale(scale, D)
    softmax = aggregate in SOFTMAX_AGGREGATES
    if k_hat.stride(-1) != 1:
        k_hat = k_hat.contiguous()
    if q_hat.stride(-1) != 1:
        q_hat = q_hat.contiguous()
    want_heads = return_both or gqa_select == "query" or (softmax and gqa_select == "kv")
    want_agg = return_both or gqa_select == "kv"
    heads_out = agg_out = None
    if want_heads:
        heads_out = out if (out is not None and gqa_select == "query") else new_output(
            (B, HQ, S), torch.float32, q_hat.device)
    if want_agg:
        agg_out = out if (out is not None and gqa_select == "kv") else new_output(
            (B, HKV, S), torch.float32, q_hat.device)
    for t, H in ((heads_out, HQ), (agg_out, HKV)):
        if t is not None and (t.shape != (B, H, S) or t.dtype != torch.float32 or t.stride(-1) != 1):
            raise ValueError(f"out must be a contiguous fp32 tensor of shape [B, H, S]=[{B}, {H}, {S}]")
    if prefix_scale is not None and k_prefix is None:
        raise ValueError("prefix_scale is the scale of an int8 score copy: pass the copy's codes as k_prefix")
    k_src = k_hat if k_prefix is None else check_key_prefix(k_prefix, k_hat, dd, prefix_scale)
    if softmax and agg_out is not None:  # per-query-head scores, then the group's softmax aggregate
        launch_softmax_group_scores(q_hat, k_src, dd, lengths, starts, heads_out, agg_out, HKV, aggregate, scale,
                                     block_s, prefix_scale=prefix_scale)
        agg_out.clamp_(min=0).log_()  # the kernel's probabilities (-inf: invalid) -> the reference's log values
    else:
        launch_approx_scores(q_hat, k_src, dd, lengths, starts, heads_out, agg_out, aggregate, block_s,
                             prefix_scale=prefix_scale)
    if return_both:
        return heads_out, agg_out
    return heads_out if gqa_select == "query" else agg_out
