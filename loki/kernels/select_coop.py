"""Exact top-k selection with each row split over programs that meet at row barriers (one launch: few long rows).

Shape letters: B batch, H the selection's head axis, S cache length, K the selection width (>= max(counts)),
R = B * H rows, P programs per row, CH = the scores one program holds (a power of two, P * CH >= S).

Why: the split select of ``select_split.py`` resolves the threshold over LEVELS + 1 launches, and every program
of every launch re-reads and re-reduces all the row's per-chunk histograms; the last program of a row then
selects among ~1000 candidates alone.  At B=1 with 8 KV heads and S = 131072 that costs ~40 us per step inside
the decode graph.  Here the R * P programs are all resident at once (at most one per
multiprocessor), each loads its CH scores into registers once, and the programs of a row meet at a spin barrier
on a per-row counter after every radix level:

1. level ``l = 1..LEVELS`` (BITS bits each; 4 x 8 = the whole uint32 key of ``_keys.py``): each program stores
   the histogram of digit l of its keys that match the prefix found so far (``tl.histogram``, 2**BITS bins, no
   atomics), arrives at the row's barrier, then every program reduces the row's [P, 2**BITS] histograms itself
   (``_update``: the digit holding the ``need``-th largest key, and per program the keys above the prefix).  The
   levels stop early once every key of the threshold's bucket is needed.
2. compaction (same launch): a key above the final prefix is selected, one equal to it (ties, or a whole bucket)
   is selected while its rank among the row's equal keys, in position order, is below the count still needed.
   Slots come from the per-program counts: the selected keys above the prefix in ascending position, then the
   equal ones in ascending position.  No candidate buffer, no serial final select.

A tiny launch before (``_coop_init_kernel``) zeroes the row counters.  Both launches go through
``launch.launch`` (recorded and replayed by ``DecodePlan``), with no host sync; CUDA-graph capturable.  The
grid must fit the GPU at once (``coop_launch_config`` refuses shapes that would not); under a limit of
multiprocessors (MPS, green contexts) pass ``max_sms`` accordingly or use ``select_split``.

The CPU interpreter runs programs one after another, so it cannot spin: there (and with ``phased=True``) the same
code runs as LEVELS + 1 launches without barriers, each program replaying the earlier levels' updates from the
stored histograms (``_replay``).  Both modes select the same set and write the same order.

Output: idx [B, H, K] int32 like ``select.py``; -1 from ``counts[b]`` on.  The SET is the one of
``loki.reference.selection.topk_indices`` (lowest position first among equal scores; -0.0 == +0.0; NaN above
+inf).
"""

from __future__ import annotations

import torch

from loki._checks import check_counts
from loki._triton import tl, triton

from ._common import NUM_SMS_DEFAULT, check_triton_device, interpreting, num_sms
from ._keys import _ordered_key
from .launch import launch, new_output

__all__ = ["COOP_DEFAULTS", "coop_launch_config", "select_topk_coop", "use_coop_select"]

#: Launch defaults (docs/kernels.md): whether ``select_topk(method="triton")`` takes this select where it fits,
#: key bits per level (LEVELS = 32 / bits), the largest and smallest chunk one program holds, the most programs
#: per row (the [P, 2**bits] histogram tile every program reduces after each level), warps per program.
COOP_DEFAULTS = dict(enabled=True, bits=8, max_chunk=16384, min_chunk=1024, max_programs=32, num_warps=16)
#: Row counter, then padding to a 16-word boundary, then LEVELS x [P, 2**bits] histograms.
HEAD = 16
_HEAD = tl.constexpr(HEAD)


@triton.jit
def _row_barrier(ctr, target):
    """Arrive at the row's counter and wait until ``target`` programs have arrived (all the row's programs are
    resident: the launch config guarantees it).  Stores before it are visible to loads with ``.cg`` after it."""
    tl.debug_barrier()
    seen = tl.atomic_add(ctr, 1, sem="acq_rel") + 1
    while seen < target:
        seen = tl.load(ctr, volatile=True)
    tl.atomic_add(ctr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _update(hist, P, need, prefix, above_c, NB: tl.constexpr, BITS: tl.constexpr, P_BLOCK: tl.constexpr):
    """One level's reduction of the row's histograms hist[p, j] (p < P): the digit holding the need-th largest
    of the keys matching ``prefix``; returns (prefix extended by it, keys still needed in it, per program the
    keys above the new prefix (``above_c`` accumulated), per program the keys equal to it, whether all of the
    bucket is needed)."""
    pp = tl.arange(0, P_BLOCK)
    jj = tl.arange(0, NB)
    h = tl.load(hist + pp[:, None] * NB + jj[None, :], mask=(pp < P)[:, None], other=0, cache_modifier=".cg")
    tot = tl.sum(h, axis=0)
    ge = tl.sum(tot, axis=0) - tl.cumsum(tot, axis=0) + tot  # keys with digit >= j
    d = tl.max(tl.where(ge >= need, jj, -1), axis=0)
    above = tl.sum(tl.where(jj > d, tot, 0), axis=0)
    at = tl.sum(tl.where(jj == d, tot, 0), axis=0)
    above_c += tl.sum(tl.where(jj[None, :] > d, h, 0), axis=1)
    at_c = tl.sum(tl.where(jj[None, :] == d, h, 0), axis=1)
    need = need - above
    return (prefix << BITS) | d.to(tl.uint32), need, above_c, at_c, at == need


@triton.jit
def _histogram(key, m, prefix, hist, p, LEVEL: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr):
    """Store this program's histogram of digit LEVEL of its keys that match the prefix of the earlier levels."""
    if LEVEL == 1:
        sel = m
    else:
        sel = m & ((key >> (32 - (LEVEL - 1) * BITS)) == prefix)
    digit = ((key >> (32 - LEVEL * BITS)) & (NB - 1)).to(tl.int32)
    tl.store(hist + p * NB + tl.arange(0, NB), tl.histogram(digit, NB, mask=sel))


@triton.jit
def _coop_init_kernel(ws_ptr, stride_wr):
    """Zero row r's barrier counter (the workspace is otherwise written before it is read)."""
    tl.store(ws_ptr + tl.program_id(0).to(tl.int64) * stride_wr, 0)


@triton.jit
def _coop_select_kernel(
    scores_ptr, counts_ptr, idx_ptr, ws_ptr,
    S, H, K, P,
    stride_sb, stride_sh, stride_ib, stride_ih, stride_wr,
    PHASE: tl.constexpr, LEVELS: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr,
    P_BLOCK: tl.constexpr,
):
    """Program (row r = b * H + h, part p).  PHASE 0: every level and the compaction, with row barriers; PHASE
    1..LEVELS: that level's histogram only (after replaying the earlier levels); PHASE LEVELS + 1: compaction."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    b = r // H
    h = r % H
    kk = tl.maximum(tl.minimum(tl.load(counts_ptr + b).to(tl.int32), K), 0)  # never more than K slots
    ws = ws_ptr + r * stride_wr
    out = idx_ptr + b * stride_ib + h * stride_ih
    pos = p * CH + tl.arange(0, CH)
    m = pos < S
    key = _ordered_key(tl.load(scores_ptr + b * stride_sb + h * stride_sh + pos, mask=m, other=float("-inf")))
    if PHASE <= 1:
        tl.store(out + pos, tl.full((CH,), -1, tl.int32), mask=(pos >= kk) & (pos < K))
    prefix = tl.zeros((), tl.uint32)
    need = kk
    above_c = tl.zeros((P_BLOCK,), tl.int32)
    at_c = tl.zeros((P_BLOCK,), tl.int32)
    done = kk == 0
    shift = 32
    for level in tl.static_range(1, LEVELS + 1):
        if PHASE == 0 or PHASE >= level:
            if not done:
                hist = ws + _HEAD + (level - 1) * P * NB
                if PHASE == 0 or PHASE == level:
                    _histogram(key, m, prefix, hist, p, level, BITS, NB)
                if PHASE == 0:
                    _row_barrier(ws, level * P)
                if PHASE == 0 or PHASE > level:
                    prefix, need, above_c, at_c, done = _update(hist, P, need, prefix, above_c, NB, BITS, P_BLOCK)
                    done = done | (level == LEVELS)
                    shift = 32 - level * BITS
    if (PHASE == 0 or PHASE == LEVELS + 1) and kk > 0:
        pp = tl.arange(0, P_BLOCK)
        n_gt = tl.sum(above_c, axis=0)
        base_gt = tl.sum(tl.where(pp < p, above_c, 0), axis=0)
        base_eq = tl.sum(tl.where(pp < p, at_c, 0), axis=0)
        hi = key >> shift
        gt = m & (hi > prefix)
        eq = m & (hi == prefix)
        packed = gt.to(tl.uint32) | (eq.to(tl.uint32) << 16)
        incl = tl.cumsum(packed, axis=0)
        slot_gt = base_gt + (incl & 0xFFFF).to(tl.int32) - 1
        rank_eq = base_eq + (incl >> 16).to(tl.int32) - 1
        tl.store(out + tl.where(gt, slot_gt, n_gt + rank_eq), pos, mask=gt | (eq & (rank_eq < need)))


def _p2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def coop_launch_config(S: int, rows: int, num_sms: int = NUM_SMS_DEFAULT, *, bits: int | None = None,
                       chunk: int | None = None) -> dict | None:
    """Launch options for ``rows`` rows of S keys, or None when the grid cannot be resident at once within the
    defaults' limits (then use ``select_split``): ``programs`` per row (P, at most ``max_programs``, and
    ``rows * P <= num_sms``: one program per multiprocessor, whatever its registers), ``chunk`` (CH, a power of
    two in [min_chunk, max_chunk] with P * CH >= S), ``bits``, ``levels`` and ``num_warps``.  Under the
    interpreter the chunk is at least 8192 (few large tiles run faster there).  A given ``chunk`` (a power of
    two) is taken as it is, within the same limits."""
    d = COOP_DEFAULTS
    bits = d["bits"] if bits is None else bits
    budget = min(d["max_programs"], num_sms // max(1, rows))
    if budget < 1:
        return None
    if chunk is None:
        chunk = max(d["min_chunk"], _p2(-(-S // budget)))
        if interpreting():
            chunk = max(chunk, 8192)
        chunk = min(chunk, _p2(S))
    if chunk > d["max_chunk"]:
        return None
    programs = -(-S // chunk)
    if programs > budget:
        return None
    return dict(programs=programs, chunk=chunk, bits=bits, levels=-(-32 // bits),
                num_warps=min(d["num_warps"], max(4, chunk // 512)))


def use_coop_select(S: int, rows: int, num_sms: int = NUM_SMS_DEFAULT) -> bool:
    """Whether the row-barrier select fits these rows (``coop_launch_config`` is not None)."""
    return coop_launch_config(S, rows, num_sms) is not None


def select_topk_coop(
    scores: torch.Tensor,
    counts: torch.Tensor,
    *,
    k_max: int | None = None,
    out: torch.Tensor | None = None,
    max_sms: int | None = None,
    bits: int | None = None,
    chunk: int | None = None,
    phased: bool | None = None,
) -> torch.Tensor:
    """Indices of the ``counts[b]`` largest scores of every row, each row split over programs meeting at row
    barriers.

    scores: [B, H, S] fp32 (-inf marks tokens that may not be chosen; other float dtypes are converted first);
    counts: [B] int on the scores' device, 1 <= counts[b] <= the finite scores of each row of batch b;
    ``k_max``: an int bound K >= max(counts) (default ``int(counts.max())``, a host sync; a larger count is
    clamped to K on the device).  Returns idx: [B, H, K] int32 (or ``out``), entries from counts[b] on -1; the same
    set as ``loki.reference.selection.select_topk`` (ties to the lowest position), deterministic order.
    ``max_sms`` (multiprocessors the grid may occupy, default all of the device's), ``bits`` (a divisor of 32
    up to 8) and ``chunk`` (scores per program, a power of two
    >= 16) override the launch defaults; ``phased`` runs
    one launch per level without barriers (the default under the interpreter).  Raises ValueError when the rows
    cannot be split within the limits of :func:`coop_launch_config`.
    """
    if scores.dim() != 3:
        raise ValueError(f"scores must have shape [B, H, S], got {list(scores.shape)}")
    B, H, S = scores.shape
    check_triton_device(scores, "select_topk_coop")
    check_counts(counts, B, scores.device)
    if bits is not None and (bits not in (1, 2, 4, 8)):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")
    if chunk is not None and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    if max_sms is not None and max_sms < 1:
        raise ValueError(f"max_sms must be >= 1, got {max_sms}")
    if B == 0 or H == 0:
        K = 0 if k_max is None or B == 0 else int(k_max)
        return torch.empty(B, H, K, dtype=torch.int32, device=scores.device)
    K = int(counts.max()) if k_max is None else int(k_max)
    if not 1 <= K <= S:
        raise ValueError(f"k_max={K} must lie in [1, S={S}]")
    sms = num_sms(scores.device) if max_sms is None else min(max_sms, num_sms(scores.device))
    cfg = coop_launch_config(S, B * H, sms, bits=bits, chunk=chunk)
    if cfg is None:
        raise ValueError(f"{B * H} rows of S={S} do not fit one resident grid: use select_topk_split")
    if scores.dtype != torch.float32:
        scores = scores.float()
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    idx = out if out is not None else new_output((B, H, K), torch.int32, scores.device)
    if idx.shape != (B, H, K) or idx.dtype != torch.int32 or idx.stride(-1) != 1:
        raise ValueError(f"out must be a contiguous int32 tensor of shape [B, H, K]=[{B}, {H}, {K}]")
    _launch_coop(scores, counts, idx, K, cfg, interpreting() if phased is None else phased)
    return idx


def _launch_coop(scores, counts, idx, K: int, cfg: dict, phased: bool) -> None:
    B, H, S = scores.shape
    R, P, NB, levels = B * H, cfg["programs"], 1 << cfg["bits"], cfg["levels"]
    ws = new_output((R, HEAD + levels * P * NB), torch.int32, scores.device)
    common = [scores, counts, idx, ws, S, H, K, P, scores.stride(0), scores.stride(1), idx.stride(0),
              idx.stride(1), ws.stride(0)]
    meta = [levels, cfg["bits"], NB, cfg["chunk"], max(16, _p2(P))]
    opts = dict(num_warps=cfg["num_warps"])
    if not phased:
        launch(_coop_init_kernel, (R,), [ws, ws.stride(0)], dict(num_warps=1))
        launch(_coop_select_kernel, (R, P), common + [0] + meta, opts)
        return
    for phase in range(1, levels + 2):
        launch(_coop_select_kernel, (R, P), common + [phase] + meta, dict(opts))
