"""Exact top-k selection with each row split over many programs (Loki Algorithm 1, line 5, for few long rows).

Shape letters: B batch, H the selection's head axis, S cache length, K the selection width (>= max(counts)),
R = B * H rows, C = ceil(S / CH) chunks of CH scores per row.

Why: the one-program-per-row select of ``select.py`` keeps a row in registers and is latency-bound when there
are few rows (B=1 with 8 KV heads: 8 programs on 132 multiprocessors), and it stops at
``TRITON_SELECT_MAX_S`` keys per row.  Here every row is cut into C chunks and a grid of (R, C) programs
finds the row's threshold as a radix select over the order-preserving uint32 keys of ``tl_helpers.ordered_key``, BITS
bits of the key per launch:

1. level launches ``l = 1..LEVELS``: each program histograms digit l (bits ``32 - l*BITS ..``) of the keys
   of its chunk that match the prefix found so far (``tl.histogram``, 2**BITS bins, stored per chunk: no
   atomics, no zeroed memory).  From level 2 on, every program first re-derives digit l-1 from the
   per-chunk histograms of the previous launch (a [C, 2**BITS] load and a prefix sum: the digit that holds
   the ``need``-th largest key, and how many keys of each chunk lie above it); program 0 of the row stores
   the prefix and the count still needed, each program adds its own chunk's keys above the prefix to its
   "sure" count.  Level 1 also writes -1 into the row's slots ``counts[b]..K-1`` and zeroes the row's
   ticket.
2. the compaction launch resolves the last digit (prefix P of ``LEVELS*BITS`` bits), then each program
   writes, in position order, the positions of its keys whose prefix is above P (sure to be selected;
   slots from the per-chunk sure counts of the earlier chunks) and of its keys with prefix P (the
   candidates, slots from the earlier chunks' candidate counts) into the workspace.  When every candidate
   is needed they go straight to the output.  Otherwise the last program of the row to finish (a ticket,
   ``atomic_add`` with acq_rel) selects the ``need`` largest candidates: a bit search below the bits that
   the smallest and largest candidate share, with early exit, then one packed prefix sum; the candidates
   are in position order, so the lowest positions win ties.  Up to CAND_BLOCK candidates this runs in
   registers; more (heavy ties in a narrow range) loop over the candidates in tiles (correct, slower).

Launches: LEVELS + 1 (3 with the defaults), all through ``launch.launch`` (recorded and replayed by
``DecodePlan``), no host sync, CUDA-graph capturable.  Workspace: one int32 [R, W] buffer from
``launch.new_output`` (2 x C x 2**BITS histogram counts, C sure counts, the row state and ticket, and S
candidate slots per row), every element read written earlier in the same call.

Output: idx [B, H, K] int32 like ``select.py``: the sure positions (ascending), then the chosen candidates
(those above the threshold, then the ties, each ascending); -1 from ``counts[b]`` on.  The SET is the one of
``loki.reference.selection.topk_indices`` (lowest position first among equal scores; -0.0 == +0.0; NaN
above +inf); the order is deterministic.

Could be fused later: level 1 into the scores kernel's epilogue (its keys are in registers there), and the
level launches into one with a per-row arrival counter (a launch less per level, ~2-3 us each).
"""

from __future__ import annotations

import torch

from loki._checks import check_counts
from loki._triton import tl, triton

from .common import NUM_SMS_DEFAULT, check_triton_device, interpreting, num_sms
from .launch import launch, new_output, pdl
from .tl_helpers import ordered_key

__all__ = ["SPLIT_DEFAULTS", "select_topk_split", "split_launch_config", "use_split_select"]

#: Launch defaults (to be tuned on the GPU; docs/kernels.md): key bits resolved per level launch, level
#: launches, programs aimed at per multiprocessor (sets the chunk, within ``chunk_range``), candidates the
#: final select holds in registers (4096: 2048 was 4.6 us faster alone at 8 rows of 131072 on an H100, 0.3%
#: of the whole forward, but crowded probabilities then overflow the tile; results/select-final-h100-2026-11-28/).
SPLIT_DEFAULTS = dict(bits=6, levels=2, programs_per_sm=4, chunk_range=(1024, 16384), cand_block=4096)
#: When ``select_topk(method="triton")`` uses the split select (to be tuned on the GPU): rows longer than the
#: register select takes, or rows of at least ``min_s`` keys when there are fewer than ``max_rows_per_sm``
#: rows per multiprocessor.
SPLIT_RULE = dict(min_s=8192, max_rows_per_sm=1.0)
#: Largest per-chunk histogram tile a program loads (C_BLOCK x 2**BITS counts); longer rows get larger chunks.
_MAX_HIST_TILE = 8192


@triton.jit
def _layout(C, NB: tl.constexpr):
    """Offsets in a workspace row: two [C, NB] histograms, then C sure counts, 16 state words, candidates."""
    off_sure = 2 * C * NB
    off_state = off_sure + ((C + 15) // 16) * 16
    return off_sure, off_state, off_state + 16


@triton.jit
def _chunk_keys(row, c, S, CH: tl.constexpr):
    """Keys, positions and validity of chunk c of a score row (invalid lanes: key of -inf, masked anyway)."""
    p = c * CH + tl.arange(0, CH)
    m = p < S
    return ordered_key(tl.load(row + p, mask=m, other=float("-inf"))), p, m


@triton.jit
def _resolve(hist, C, need, NB: tl.constexpr, C_BLOCK: tl.constexpr):
    """From per-chunk histograms hist[c, j] (c < C) of one digit: the digit d holding the need-th largest key,
    the keys with a larger digit, and per chunk ([C_BLOCK]) the keys with a larger digit and those with d."""
    cc = tl.arange(0, C_BLOCK)
    jj = tl.arange(0, NB)
    h = tl.load(hist + cc[:, None] * NB + jj[None, :], mask=(cc < C)[:, None], other=0)
    tot = tl.sum(h, axis=0)
    ge = tl.sum(tot, axis=0) - tl.cumsum(tot, axis=0) + tot  # keys with digit >= j
    d = tl.max(tl.where(ge >= need, jj, -1), axis=0)
    above = tl.sum(tl.where(jj > d, tot, 0), axis=0)
    above_c = tl.sum(tl.where(jj[None, :] > d, h, 0), axis=1)
    at_c = tl.sum(tl.where(jj[None, :] == d, h, 0), axis=1)
    return d, above, above_c, at_c


@triton.jit
def _resolved(ws, C, kk, LEVEL: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, C_BLOCK: tl.constexpr):
    """Digits 1..LEVEL of the threshold: (prefix of LEVEL*BITS bits, keys still needed with that prefix, per
    chunk the keys above it at digit LEVEL and those with it)."""
    if LEVEL == 1:
        prefix = tl.zeros((), tl.uint32)
        need = kk
    else:
        _, off_state, _ = _layout(C, NB)
        st = ws + off_state + 4 * ((LEVEL - 1) % 2)
        prefix = tl.load(st).to(tl.uint32, bitcast=True)
        need = tl.load(st + 1)
    d, above, above_c, at_c = _resolve(ws + (LEVEL % 2) * C * NB, C, need, NB, C_BLOCK)
    return (prefix << BITS) | d.to(tl.uint32), need - above, above_c, at_c


@triton.jit
def _cand_tile(cand, row, t0, n, CAND_BLOCK: tl.constexpr):
    """Keys and positions of candidates t0..t0+CAND_BLOCK-1 (written by other programs of this launch)."""
    i = t0 + tl.arange(0, CAND_BLOCK)
    m = i < n
    pos = tl.load(cand + i, mask=m, other=0, cache_modifier=".cg")
    key = ordered_key(tl.load(row + pos, mask=m, other=0.0))
    return tl.where(m, key, 0), pos, m


@triton.jit
def _start(kmin, kmax):
    """The bits every candidate shares (those of kmin and kmax, the threshold's too) and the low bits left."""
    diff = kmin ^ kmax
    top = tl.zeros((), tl.int32)
    for i in tl.static_range(32):
        top = tl.where(((diff >> i) & 1) != 0, i + 1, top)
    sh = tl.minimum(top, 31).to(tl.uint32)
    return tl.where(top >= 32, tl.zeros((), tl.uint32), (kmin >> sh) << sh), top


@triton.jit
def _emit(key, pos, m, thr, need, n_gt, gt_base, eq_base, out):
    """Write the positions of keys > thr and of the first ties (== thr, in order) into out[:need].  Returns the
    updated (gt_base, eq_base)."""
    gt = (key > thr) & m
    eq = (key == thr) & m
    packed = gt.to(tl.uint32) | (eq.to(tl.uint32) << 16)
    incl = tl.cumsum(packed, axis=0)
    slot_gt = gt_base + (incl & 0xFFFF).to(tl.int32) - 1
    slot_eq = n_gt + eq_base + (incl >> 16).to(tl.int32) - 1
    tl.store(out + tl.where(gt, slot_gt, slot_eq), pos, mask=gt | (eq & (slot_eq < need)))
    tot = tl.sum(packed, axis=0)
    return gt_base + (tot & 0xFFFF).to(tl.int32), eq_base + (tot >> 16).to(tl.int32)


@triton.jit
def _final_in_registers(cand, row, n, need, out, TILE: tl.constexpr):
    """The final select of n <= TILE candidates held in registers (see :func:`_final_select`).  (Two bits per
    step, three counts packed in one int64 reduction, measured no faster on an H100: docs/kernels.md.)"""
    one = tl.full((), 1, tl.uint32)
    key, pos, m = _cand_tile(cand, row, 0, n, TILE)
    thr, bit = _start(tl.min(tl.where(m, key, tl.full((TILE,), 0xFFFFFFFF, tl.uint32)), axis=0),
                      tl.max(key, axis=0))
    n_ge = n
    while (bit > 0) & (n_ge != need):
        bit -= 1
        c = thr | (one << bit.to(tl.uint32))
        cnt = tl.sum((key >= c).to(tl.int32), axis=0)
        thr = tl.where(cnt >= need, c, thr)
        n_ge = tl.where(cnt >= need, cnt, n_ge)
    n_gt = tl.sum((key > thr).to(tl.int32), axis=0)
    _emit(key, pos, m, thr, need, n_gt, 0, 0, out)


@triton.jit
def _final_select(cand, row, n, need, out, CAND_BLOCK: tl.constexpr):
    """out[:need] = positions of the need largest of the n candidates cand[:n] (ascending positions), ties to
    the lowest position.  Threshold: the largest T with #(key >= T) >= need, or (early exit) the first T on the
    way with exactly need keys >= T.  Up to CAND_BLOCK / 4 candidates in a quarter-size tile (each one-bit step
    is a block reduction whose cost grows with the tile), up to CAND_BLOCK in a full one, more in a loop."""
    one = tl.full((), 1, tl.uint32)
    top = tl.full((CAND_BLOCK,), 0xFFFFFFFF, tl.uint32)
    if n <= CAND_BLOCK // 4:
        _final_in_registers(cand, row, n, need, out, CAND_BLOCK // 4)
    elif n <= CAND_BLOCK:
        _final_in_registers(cand, row, n, need, out, CAND_BLOCK)
    else:  # many candidates (ties or a narrow range): every step loops over them
        kmin = tl.full((), 0xFFFFFFFF, tl.uint32)
        kmax = tl.zeros((), tl.uint32)
        for t0 in range(0, n, CAND_BLOCK):
            key, pos, m = _cand_tile(cand, row, t0, n, CAND_BLOCK)
            kmin = tl.minimum(kmin, tl.min(tl.where(m, key, top), axis=0))
            kmax = tl.maximum(kmax, tl.max(key, axis=0))
        thr, bit = _start(kmin, kmax)
        n_ge = n
        while (bit > 0) & (n_ge != need):
            bit -= 1
            c = thr | (one << bit.to(tl.uint32))
            cnt = tl.zeros((), tl.int32)
            for t0 in range(0, n, CAND_BLOCK):
                key, pos, m = _cand_tile(cand, row, t0, n, CAND_BLOCK)
                cnt += tl.sum((key >= c).to(tl.int32), axis=0)
            thr = tl.where(cnt >= need, c, thr)
            n_ge = tl.where(cnt >= need, cnt, n_ge)
        n_gt = tl.zeros((), tl.int32)
        for t0 in range(0, n, CAND_BLOCK):
            key, pos, m = _cand_tile(cand, row, t0, n, CAND_BLOCK)
            n_gt += tl.sum((key > thr).to(tl.int32), axis=0)
        gt_base = tl.zeros((), tl.int32)
        eq_base = tl.zeros((), tl.int32)
        for t0 in range(0, n, CAND_BLOCK):
            key, pos, m = _cand_tile(cand, row, t0, n, CAND_BLOCK)
            gt_base, eq_base = _emit(key, pos, m, thr, need, n_gt, gt_base, eq_base, out)


@triton.jit
def _split_level_kernel(
    scores_ptr, counts_ptr, idx_ptr, ws_ptr,
    S, H, K, C,
    stride_sb, stride_sh, stride_ib, stride_ih, stride_wr,
    LEVEL: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr, C_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Level launch LEVEL, program (row r = b * H + h, chunk c): the per-chunk histogram of digit LEVEL of the
    keys matching the prefix of digits 1..LEVEL-1 (resolved here from the previous launch's histograms)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    b = r // H
    h = r % H
    if PDL:  # programmatic dependent launch (launch.py): wait for the previous kernel's results
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    kk = tl.maximum(tl.minimum(tl.load(counts_ptr + b).to(tl.int32), K), 0)  # never more than K slots
    ws = ws_ptr + r * stride_wr
    off_sure, off_state, _ = _layout(C, NB)
    key, p, m = _chunk_keys(scores_ptr + b * stride_sb + h * stride_sh, c, S, CH)
    if LEVEL == 1:
        sel = m
        pad = (p >= kk) & (p < K)
        tl.store(idx_ptr + b * stride_ib + h * stride_ih + p, tl.full((CH,), -1, tl.int32), mask=pad)
        if c == 0:
            tl.store(ws + off_state + 8, 0)  # the row's ticket for the compaction launch
    else:
        prefix, need, above_c, _ = _resolved(ws, C, kk, LEVEL - 1, BITS, NB, C_BLOCK)
        sure = tl.sum(tl.where(tl.arange(0, C_BLOCK) == c, above_c, 0), axis=0)
        if LEVEL > 2:
            sure += tl.load(ws + off_sure + c)
        tl.store(ws + off_sure + c, sure)
        if c == 0:
            st = ws + off_state + 4 * ((LEVEL - 1) % 2)
            tl.store(st, prefix.to(tl.int32, bitcast=True))
            tl.store(st + 1, need)
        sel = m & ((key >> (32 - (LEVEL - 1) * BITS)) == prefix)
    digit = ((key >> (32 - LEVEL * BITS)) & (NB - 1)).to(tl.int32)
    tl.store(ws + (LEVEL % 2) * C * NB + c * NB + tl.arange(0, NB), tl.histogram(digit, NB, mask=sel))


@triton.jit
def _split_compact_kernel(
    scores_ptr, counts_ptr, idx_ptr, ws_ptr,
    S, H, K, C,
    stride_sb, stride_sh, stride_ib, stride_ih, stride_wr,
    LEVELS: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr, C_BLOCK: tl.constexpr,
    CAND_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Compaction launch, program (row r, chunk c): sure positions to idx, candidates to the workspace (or to
    idx when all are needed); the row's last program to finish selects among the candidates."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    b = r // H
    h = r % H
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    kk = tl.maximum(tl.minimum(tl.load(counts_ptr + b).to(tl.int32), K), 0)
    ws = ws_ptr + r * stride_wr
    row = scores_ptr + b * stride_sb + h * stride_sh
    out = idx_ptr + b * stride_ib + h * stride_ih
    off_sure, off_state, off_cand = _layout(C, NB)
    prefix, need, sure_c, cand_c = _resolved(ws, C, kk, LEVELS, BITS, NB, C_BLOCK)
    cc = tl.arange(0, C_BLOCK)
    if LEVELS > 1:
        sure_c += tl.load(ws + off_sure + cc, mask=cc < C, other=0)
    n_sure = tl.sum(sure_c, axis=0)
    n_cand = tl.sum(cand_c, axis=0)
    base_sure = tl.sum(tl.where(cc < c, sure_c, 0), axis=0)
    base_cand = tl.sum(tl.where(cc < c, cand_c, 0), axis=0)
    key, p, m = _chunk_keys(row, c, S, CH)
    hi = key >> (32 - LEVELS * BITS)
    sure = m & (hi > prefix)
    cand = m & (hi == prefix)
    packed = sure.to(tl.uint32) | (cand.to(tl.uint32) << 16)
    incl = tl.cumsum(packed, axis=0)
    pos = p.to(tl.int32)
    tl.store(out + base_sure + (incl & 0xFFFF).to(tl.int32) - 1, pos, mask=sure)
    slot = base_cand + (incl >> 16).to(tl.int32) - 1
    if need == n_cand:  # every candidate is selected: no final select
        tl.store(out + n_sure + slot, pos, mask=cand)
    else:
        tl.store(ws + off_cand + slot, pos, mask=cand)
        tl.debug_barrier()  # every thread's candidates are stored before the ticket is taken
        ticket = tl.atomic_add(ws + off_state + 8, 1, sem="acq_rel")
        if ticket == C - 1:  # the row's last program: every candidate is in the workspace
            _final_select(ws + off_cand, row, n_cand, need, out + n_sure, CAND_BLOCK)


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def use_split_select(S: int, rows: int, num_sms: int = NUM_SMS_DEFAULT, max_register_s: int = 32768) -> bool:
    """Whether ``select_topk(method="triton")`` uses the split select for ``rows`` rows of S keys: rows longer
    than the register select takes (``max_register_s``), or few rows (fewer than
    ``SPLIT_RULE["max_rows_per_sm"]`` per multiprocessor) of at least ``SPLIT_RULE["min_s"]`` keys."""
    if S > max_register_s:
        return True
    return S >= SPLIT_RULE["min_s"] and rows < SPLIT_RULE["max_rows_per_sm"] * num_sms


def split_launch_config(S: int, rows: int, num_sms: int = NUM_SMS_DEFAULT, *, bits: int | None = None) -> dict:
    """Default launch options for ``rows`` rows of S keys: ``chunk`` (a power of two aiming at
    ``programs_per_sm`` programs per multiprocessor, within ``chunk_range``, large enough that the per-chunk
    histograms fit one tile; the whole row, up to 8192, under the interpreter), ``bits``, ``levels``,
    ``cand_block``, ``num_warps`` (one per 512 chunk elements, 4 to 16) and ``compact_warps`` for the compaction
    launch (at least one per 512 candidates of ``cand_block``: ptxas gives 209 registers to the compaction kernel
    with 4096 candidates on 4 warps, 128 on 8)."""
    d = SPLIT_DEFAULTS
    bits = d["bits"] if bits is None else bits
    lo, hi = d["chunk_range"]
    chunk = min(hi, max(lo, _p2(-(-rows * S // (d["programs_per_sm"] * num_sms)))))
    if interpreting():  # few large tiles run much faster there
        chunk = max(chunk, 8192)
    chunk = max(16, min(chunk, _p2(S)))
    max_chunks = max(1, _MAX_HIST_TILE >> bits)
    chunk = max(chunk, _p2(-(-S // max_chunks)))
    cand_block = max(16, min(d["cand_block"], _p2(S)))
    warps = _warps(chunk)
    return dict(chunk=chunk, bits=bits, levels=d["levels"], cand_block=cand_block, num_warps=warps,
                compact_warps=max(warps, _warps(cand_block)))


def _warps(block: int) -> int:
    return max(4, min(16, block // 512))


def _check_options(S: int, chunk: int, bits: int, levels: int, cand_block: int) -> None:
    if not 1 <= bits <= 11:
        raise ValueError(f"bits must lie in [1, 11], got {bits}")
    if levels < 1 or levels * bits > 32:
        raise ValueError(f"levels must be >= 1 with levels * bits <= 32, got levels={levels}, bits={bits}")
    for name, v in (("chunk", chunk), ("cand_block", cand_block)):
        if v < 16 or v > 32768 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two in [16, 32768], got {v}")
    if max(16, _p2(-(-S // chunk))) << bits > 4 * _MAX_HIST_TILE:
        raise ValueError(f"chunk={chunk} gives too many chunks for S={S} with bits={bits}: use a larger chunk")


def _launch_split(scores, counts, idx, K: int, chunk: int, bits: int, levels: int, cand_block: int,
                  num_warps: int, compact_warps: int) -> None:
    B, H, S = scores.shape
    R, NB, C = B * H, 1 << bits, -(-S // chunk)
    C_BLOCK = max(16, _p2(C))
    width = 2 * C * NB + -(-C // 16) * 16 + 16 + -(-S // 16) * 16  # _layout, then S candidate slots
    ws = new_output((R, width), torch.int32, scores.device)
    use_pdl = pdl(scores.device)
    common = [scores, counts, idx, ws, S, H, K, C, scores.stride(0), scores.stride(1), idx.stride(0),
              idx.stride(1), ws.stride(0)]
    for level in range(1, levels + 1):
        launch(_split_level_kernel, (R, C), common + [level, bits, NB, chunk, C_BLOCK, use_pdl],
               dict(num_warps=num_warps, pdl=use_pdl))
    launch(_split_compact_kernel, (R, C), common + [levels, bits, NB, chunk, C_BLOCK, cand_block, use_pdl],
           dict(num_warps=compact_warps, pdl=use_pdl))


def select_topk_split(
    scores: torch.Tensor,
    counts: torch.Tensor,
    *,
    k_max: int | None = None,
    out: torch.Tensor | None = None,
    chunk: int | None = None,
    bits: int | None = None,
    levels: int | None = None,
    cand_block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Indices of the ``counts[b]`` largest scores of every row, each row split over ceil(S / chunk) programs.

    scores: [B, H, S] fp32 (-inf marks tokens that may not be chosen; other float dtypes are converted first);
    counts: [B] int on the scores' device, 1 <= counts[b] <= the finite scores of each row of batch b;
    ``k_max``: an int bound K >= max(counts) (default ``int(counts.max())``, a host sync; a larger count is
    clamped to K on the device).  Returns idx: [B, H, K] int32 (or ``out``, contiguous int32 [B, H, K]), entries
    from counts[b] on -1; the same set as ``loki.reference.selection.select_topk`` (ties to the lowest
    position), in a deterministic order.  Options (defaults from :func:`split_launch_config`): ``chunk`` scores
    per program (a power of two, 16..32768), ``bits`` key bits per level launch (1..11), ``levels`` level
    launches (``levels * bits <= 32``), ``cand_block`` candidates the final select holds in registers (a power
    of two), ``num_warps`` (every launch; default from the chunk, and for the compaction launch at least one warp
    per 512 of ``cand_block``).  ``select_topk(method="split")`` calls this.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must have shape [B, H, S], got {list(scores.shape)}")
    B, H, S = scores.shape
    check_triton_device(scores, "select_topk(method='split')")
    check_counts(counts, B, scores.device)
    if B == 0 or H == 0:
        K = 0 if k_max is None or B == 0 else int(k_max)
        return torch.empty(B, H, K, dtype=torch.int32, device=scores.device)
    K = int(counts.max()) if k_max is None else int(k_max)
    if not 1 <= K <= S:
        raise ValueError(f"k_max={K} must lie in [1, S={S}]")
    if scores.dtype != torch.float32:
        scores = scores.float()
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    cfg = split_launch_config(S, B * H, num_sms(scores.device), bits=bits)
    chunk = cfg["chunk"] if chunk is None else chunk
    levels = cfg["levels"] if levels is None else levels
    cand_block = cfg["cand_block"] if cand_block is None else cand_block
    _check_options(S, chunk, cfg["bits"], levels, cand_block)
    idx = out if out is not None else new_output((B, H, K), torch.int32, scores.device)
    if idx.shape != (B, H, K) or idx.dtype != torch.int32 or idx.stride(-1) != 1:
        raise ValueError(f"out must be a contiguous int32 tensor of shape [B, H, K]=[{B}, {H}, {K}]")
    warps = _warps(chunk) if num_warps is None else num_warps
    _launch_split(scores, counts, idx, K, chunk, cfg["bits"], levels, cand_block, warps,
                  max(warps, _warps(cand_block)) if num_warps is None else num_warps)
    return idx
