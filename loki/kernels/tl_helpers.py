"""The ``@triton.jit`` helpers the stage kernels share, in one module so that the kernels stand side by side and
none imports another's private functions: the order-preserving key of an fp32 score (both Triton selects), the
threshold select of one row and its compaction (the select and the fused score-select kernels), and the running
log-sum-exp and the group's probability score (the softmax aggregates, fused or not), and the int8 score copy's
rounding (the cache write, and the scores kernel where a cache keeps no copy).

Imports nothing of ``loki.kernels``.
"""

from __future__ import annotations

from loki._triton import tl, triton

__all__ = ["bf16_rne", "compact", "group_probability", "int8_codes", "int8_to_f16", "int8_to_f32", "ordered_key",
           "running_lse", "score_keys", "select_row"]


@triton.jit
def ordered_key(x):
    """fp32 -> uint32 with the same order: flip all bits of negatives, set the sign bit of non-negatives.
    -0.0 is first mapped to +0.0 (equal scores tie) and every NaN to the canonical +NaN (above +inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(x.shape, 1, tl.uint32) << 31
    bits = tl.where(bits == sign, tl.zeros(x.shape, tl.uint32), bits)  # -0.0 -> +0.0
    bits = tl.where(x != x, tl.full(x.shape, 0x7FC00000, tl.uint32), bits)  # NaN -> +NaN
    flip = tl.where((bits & sign) != 0, tl.full(x.shape, 0xFFFFFFFF, tl.uint32), sign)
    return bits ^ flip


@triton.jit
def int8_to_f16(x):
    """int8 codes -> fp16, exactly, without the conversion unit: the fp16 with bits 0x6400 + (x + 128) is
    1024 + (x + 128) (fp16 holds every integer of [1024, 2048)), so one integer add, a bitcast and one fp16 subtract
    give x.  Triton lowers ``x.to(tl.float16)`` to I2F, which an H100 issues at a quarter of the integer add's rate:
    the int8 score copy's conversions otherwise cost more than its bytes (results/int8-convert-h100-2026-11-28)."""
    return (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def int8_to_f32(x):
    """int8 codes -> fp32, exactly, as :func:`int8_to_f16`: bits 0x4B000000 + (x + 128) are 2**23 + (x + 128)."""
    return (x.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even by integer ops, as torch rounds (the CPU interpreter's cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def int8_codes(y, div):
    """``round(y / div)`` (IEEE division, ties to even, as ``torch.round``) clamped to [-127, 127], as int8: the codes
    of the "int8" score copy (``loki.reference.score_formats``), written by the cache write and computed in place by
    the scores kernel where a cache keeps no copy."""
    q = tl.math.div_rn(y, div)
    r = tl.floor(q + 0.5)
    r = tl.where((r - q == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)  # a tie rounded up to odd
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


@triton.jit
def score_keys(k_ptrs, kmask, SCALED: tl.constexpr):
    """A tile of the keys the approximate scores read, as fp32: an int8 score copy's codes with ``SCALED``
    (:func:`int8_to_f32`; the caller multiplies each token's products by its scale), else the 16-bit prefix."""
    if SCALED:
        return int8_to_f32(tl.load(k_ptrs, mask=kmask, other=0))
    return tl.load(k_ptrs, mask=kmask, other=0.0).to(tl.float32)


@triton.jit
def compact(key, pos_in_row, in_row, thr, kk, n_gt_total, gt_base, eq_base, base, K):
    """Write the positions of keys > thr and of the first ties (== thr) into their slots; -1 into slots
    kk..K-1 of this chunk's position range.  Returns the updated (gt_base, eq_base)."""
    gt = (key > thr) & in_row
    eq = (key == thr) & in_row
    packed = gt.to(tl.uint32) | (eq.to(tl.uint32) << 16)
    incl = tl.cumsum(packed, axis=0)
    pos_gt = gt_base + (incl & 0xFFFF).to(tl.int32) - 1
    pos_eq = n_gt_total + eq_base + (incl >> 16).to(tl.int32) - 1
    take_eq = eq & (pos_eq < kk)
    pos = tl.where(gt, pos_gt, pos_eq)
    tl.store(base + pos, pos_in_row.to(tl.int32), mask=gt | take_eq)
    tl.store(base + pos_in_row, tl.full(pos_in_row.shape, -1, tl.int32),
             mask=(pos_in_row >= kk) & (pos_in_row < K))
    tot = tl.sum(packed, axis=0)
    return gt_base + (tot & 0xFFFF).to(tl.int32), eq_base + (tot >> 16).to(tl.int32)


@triton.jit
def select_row(row, S, kk, base, K, BLOCK: tl.constexpr, CHUNK: tl.constexpr, RADIX_BITS: tl.constexpr,
                EARLY_EXIT: tl.constexpr):
    """base[:kk] = positions of the kk largest of the S fp32 scores at ``row``; base[kk:K] = -1.

    Threshold: the largest uint32 T with #(key >= T) >= kk, built from the top bit down (with
    EARLY_EXIT: the first T on that path with exactly kk keys >= T, when there is one).
    """
    offs = tl.arange(0, BLOCK)
    in_row = offs < S
    key = ordered_key(tl.load(row + offs, mask=in_row, other=float("-inf")))
    key = tl.where(in_row, key, 0)  # below every real key (-inf maps to 0x007FFFFF)
    one = tl.full((), 1, tl.uint32)
    thr = tl.zeros((), tl.uint32)
    if EARLY_EXIT:
        # any T with exactly kk keys >= T will do: stop as soon as the running threshold has that count
        n_ge = tl.full((), BLOCK + 1, tl.int32)
        i = tl.zeros((), tl.int32)
        while (i < 32) & (n_ge != kk):
            cand = thr | (one << (31 - i).to(tl.uint32))
            c = tl.sum((key >= cand).to(tl.int32), axis=0)
            take = c >= kk
            thr = tl.where(take, cand, thr)
            n_ge = tl.where(take, c, n_ge)
            i += 1
    elif RADIX_BITS == 1:
        for i in tl.static_range(32):
            cand = thr | (one << (31 - i))
            c = tl.sum((key >= cand).to(tl.int32), axis=0)
            thr = tl.where(c >= kk, cand, thr)
    else:
        for i in tl.static_range(16):
            c1 = thr | (one << (30 - 2 * i))
            c2 = thr | ((one + one) << (30 - 2 * i))
            c3 = c1 | c2
            # three counts in one reduction: 21-bit fields of an int64 (S <= 32768 < 2^21)
            packed = ((key >= c1).to(tl.int64) | ((key >= c2).to(tl.int64) << 21)
                      | ((key >= c3).to(tl.int64) << 42))
            tot = tl.sum(packed, axis=0)
            n1 = (tot & 0x1FFFFF).to(tl.int32)
            n2 = ((tot >> 21) & 0x1FFFFF).to(tl.int32)
            n3 = (tot >> 42).to(tl.int32)
            thr = tl.where(n3 >= kk, c3, tl.where(n2 >= kk, c2, tl.where(n1 >= kk, c1, thr)))
    n_gt_total = tl.sum(((key > thr) & in_row).to(tl.int32), axis=0)
    zero = tl.zeros((), tl.int32)
    if BLOCK <= CHUNK:
        compact(key, offs, in_row, thr, kk, n_gt_total, zero, zero, base, K)
    else:
        gt_base = zero
        eq_base = zero
        offs_c = tl.arange(0, CHUNK)
        for c0 in range(0, S, CHUNK):
            p = c0 + offs_c
            m = p < S
            kc = ordered_key(tl.load(row + p, mask=m, other=float("-inf")))
            gt_base, eq_base = compact(kc, p, m, thr, kk, n_gt_total, gt_base, eq_base, base, K)


@triton.jit
def running_lse(m2, l2, x):
    """One step of a running (max, sum of exp) kept per lane: the pairs (m2, l2) with the new values x (-inf for
    none), elementwise; lanes that saw nothing yet stay (-inf, 0) without a NaN."""
    m_new = tl.maximum(m2, x)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, l2 * tl.exp(m2 - ref) + tl.exp(x - ref)


@triton.jit
def group_probability(x, mx, log_sum, scale, SUM: tl.constexpr):
    """The group's probability score of a [GP, T] tile of scores x (-inf for invalid tokens and padded heads):
    sum (SUM) or max over axis 0 of exp(y), y = (scale * x - mx) - log_sum (each head's log-softmax; mx, log_sum:
    [GP], finite).  The max is taken on y (one exp per token); 0 where every y is -inf."""
    y = (x * scale - mx[:, None]) - log_sum[:, None]
    if SUM:
        return tl.sum(tl.exp(y), axis=0)
    return tl.exp(tl.max(y, axis=0))
