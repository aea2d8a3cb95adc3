"""The softmax aggregates of a shared GQA selection ("softmax-max", "softmax-sum") in Triton.

From the per-query-head approximate scores ``s[b, hq, t]`` ([B, HQ, S] fp32, -inf outside the valid tokens
``starts[b] <= t < lengths[b]``), the score of token t for KV head h is, with ``y_g[t] = (scale * s_g[t] - max_g)
- log(sum_g)`` the log-softmax of head g over the row's valid tokens (``max_g``, ``sum_g``: the max of
``scale * s_g`` and the sum of ``exp(scale * s_g - max_g)`` over them; g = h*G .. h*G + G - 1):

- ``"softmax-max"``: ``exp(max_g y_g[t])``, the largest of the heads' probabilities;
- ``"softmax-sum"``: ``sum_g exp(y_g[t])``, their sum;

fp32, -inf (not 0) outside the valid tokens, so that they rank below every valid token, a probability that
underflowed to 0 included.  The kernels write probabilities; ``loki.reference.selection.aggregate_group_scores``
(the reference, same order of operations for ``y_g``) returns their log (``max_g y_g``, ``logsumexp_g y_g``).
``exp`` of the reference's value is the kernels' value up to fp32 rounding, and the order of the tokens is the
same: exp is increasing, and distinct log-probabilities below about -2 stay distinct (``exp`` turns one ulp of
y into several ulps of p).  Where the orders can differ: tokens whose probability underflows (y below about -87,
or -103 where denormals are kept) tie at 0 and go lowest position first, and log-probabilities above about -2
(probabilities above ~0.1: a handful of tokens per head) one ulp apart can round to one probability.

Why probabilities: the split select resolves the top 12 bits of the fp32 score's ordered key first
(``select_split.py``: sign, exponent, 3 mantissa bits); log-probabilities crowd into a few octaves (-30 .. -5),
so thousands of tokens share the threshold's 12-bit prefix and overflow its final select's register tile, while
their probabilities spread over tens of octaves.  ``loki.kernels.approx_scores`` returns the reference's log
values (the ``log`` of these).

Two launches:

1. ``_lse_partial_kernel``, grid (B*HQ, NC): every row is cut into NC chunks of CHUNK tokens (NC chosen so that
   few long rows still give a few programs per multiprocessor: B=1, 32 query heads, S=131072 gives 16 chunks of
   8192 tokens); each program reduces the valid tokens of its chunk to a (max, sum of exp) pair (a running pair
   per lane, two exps per token, one reduction across the block at the end: a reduction per tile took 10.9 us at
   B=1 S=131072 with 32 heads on an H100) and writes it to the partials [2, B*HQ, NC].
2. ``_group_aggregate_kernel``, grid (B*HKV, S/BLOCK_T): each program combines the NC partials of its G heads
   into their (max, log sum), reads the G heads' scores of its BLOCK_T tokens once and writes the group's
   probability score.

With many rows the decode step runs all of it, the scores and the select in one kernel instead
(``score_select_softmax.py``, the same values).

Bytes beyond the per-query-head scores (which the approximate-scores kernel writes instead of the per-KV-head
ones: G times the score bytes): two reads of the [B, HQ, S] fp32 scores and one write of the [B, HKV, S] result;
8 bytes per (row, chunk) of partials.  No host sync, no atomics; every output from ``launch.new_output``.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length.
"""

from __future__ import annotations

import torch

from loki._triton import tl, triton
from loki.settings import SOFTMAX_AGGREGATES as _SOFTMAX

from .common import interpreter_tile, interpreting, num_sms
from .launch import launch, new_output, pdl
from .tl_helpers import group_probability, running_lse

__all__ = ["GROUP_SOFTMAX_DEFAULTS", "SOFTMAX_AGGREGATES", "group_softmax_scores", "lse_chunking"]

#: The aggregates computed here (the others of ``loki.reference.GQA_AGGREGATES`` the kernels implement, "sum"
#: and "max", come straight out of the approximate-scores kernel).
SOFTMAX_AGGREGATES = tuple(sorted(a.value for a in _SOFTMAX))

#: Launch rules (to be tuned on a GPU): ``block`` tokens per step of the partial reduction, at least
#: ``programs_per_sm`` programs per multiprocessor (rows x chunks) unless the rows are too short, at most
#: ``max_chunks`` chunks per row, ``tile`` elements ([G, BLOCK_T] scores) per program of the aggregation.
GROUP_SOFTMAX_DEFAULTS = dict(block=1024, programs_per_sm=4, max_chunks=64, tile=4096)


@triton.jit
def _lse_partial_kernel(
    s_ptr, lengths_ptr, starts_ptr, m_ptr, l_ptr,
    HQ, CHUNK, NC, scale,
    stride_sb, stride_sh,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """(max, sum exp(x - max)) of x = scale * s over the valid tokens of chunk c of row (b, hq): (-inf, 0) for a
    chunk without any."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = row // HQ
    hq = row % HQ
    if PDL:  # programmatic dependent launch (launch.py): wait for the previous kernel's writes
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    start = tl.load(starts_ptr + b).to(tl.int32)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    c0 = c * CHUNK
    hi = tl.minimum(c0 + CHUNK, length)
    lo = c0 + (tl.maximum(start, c0) - c0) // BLOCK * BLOCK  # the first tile holding a valid token
    base = s_ptr + b * stride_sb + hq * stride_sh
    ar = tl.arange(0, BLOCK)
    # a running (max, sum of exp) per lane (elementwise: no reduction across the block per tile), one reduction
    # of each at the end; lanes that saw no valid token yet keep (-inf, 0) without a NaN
    m2 = tl.full((BLOCK,), float("-inf"), tl.float32)
    l2 = tl.zeros((BLOCK,), tl.float32)
    for t0 in range(lo, hi, BLOCK):
        offs = t0 + ar
        ok = (offs >= start) & (offs < hi)
        m2, l2 = running_lse(m2, l2, tl.load(base + offs, mask=ok, other=float("-inf")) * scale)
    m = tl.max(m2, axis=0)  # -inf for a chunk without a valid token
    l = tl.sum(l2 * tl.exp(m2 - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    tl.store(m_ptr + row * NC + c, m)
    tl.store(l_ptr + row * NC + c, l)


@triton.jit
def _group_aggregate_kernel(
    s_ptr, m_ptr, l_ptr, agg_ptr, lengths_ptr, starts_ptr,
    S, HKV, NC, scale,
    stride_sb, stride_sh,
    stride_ab, stride_ah,
    G: tl.constexpr, GP: tl.constexpr, NCP: tl.constexpr, BLOCK_T: tl.constexpr, SUM: tl.constexpr,
    PDL: tl.constexpr,
):
    """agg[b, h, t] for one block of tokens t: max (or sum) over the group's heads g of
    exp((scale * s_g[t] - max_g) - log(sum_g)), from the partials of each head's row."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HKV
    h = pid % HKV
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    offs_t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = (offs_t >= start) & (offs_t < length)
    g = tl.arange(0, GP)
    gm = g < G
    hq = h * G + g  # [GP]
    cc = tl.arange(0, NCP)
    pmask = gm[:, None] & (cc < NC)[None, :]
    pidx = (b * HKV * G + hq)[:, None] * NC + cc[None, :]
    pm = tl.load(m_ptr + pidx, mask=pmask, other=float("-inf"))
    pl = tl.load(l_ptr + pidx, mask=pmask, other=0.0)
    mx = tl.where(gm, tl.max(pm, axis=1), 0.0)  # each head's max over its row (finite: a row has valid tokens)
    log_sum = tl.log(tl.where(gm, tl.sum(pl * tl.exp(pm - mx[:, None]), axis=1), 1.0))
    x = tl.load(s_ptr + b * stride_sb + hq[:, None] * stride_sh + offs_t[None, :],
                mask=gm[:, None] & valid[None, :], other=float("-inf"))
    agg = tl.where(valid, group_probability(x, mx, log_sum, scale, SUM), float("-inf"))
    tl.store(agg_ptr + b * stride_ab + h * stride_ah + offs_t, agg, mask=offs_t < S)


def lse_chunking(rows: int, S: int, device, *, block: int | None = None,
                 num_chunks: int | None = None) -> tuple[int, int, int]:
    """(BLOCK, CHUNK, NC) of the partial log-sum-exp launch for ``rows`` rows of S tokens: tiles of BLOCK tokens,
    chunks of CHUNK tokens (a multiple of BLOCK), NC = ceil(S / CHUNK) chunks per row.  ``num_chunks`` asks for a
    number of chunks (the result may have fewer: whole tiles per chunk)."""
    dflt = GROUP_SOFTMAX_DEFAULTS
    if block is None:
        block = interpreter_tile(S, 512, 16) if interpreting() else min(dflt["block"],
                                                                         max(128, triton.next_power_of_2(S)))
    tiles = triton.cdiv(S, block)
    if num_chunks is None:
        num_chunks = triton.cdiv(dflt["programs_per_sm"] * num_sms(device), max(rows, 1))
        num_chunks = min(num_chunks, 4 if interpreting() else dflt["max_chunks"])
    num_chunks = max(1, min(num_chunks, tiles, dflt["max_chunks"]))
    chunk = triton.cdiv(tiles, num_chunks) * block
    return block, chunk, triton.cdiv(S, chunk)


def launch_group_softmax(heads, lengths, starts, agg, HKV: int, aggregate: str, scale: float, *,
                          block: int | None = None, num_chunks: int | None = None, block_t: int | None = None):
    """Write the group scores ``agg`` [B, HKV, S] (last dim contiguous) of ``aggregate`` from ``heads``
    [B, HQ, S] fp32 (last dim contiguous): two launches, the partials from ``new_output``."""
    if aggregate not in SOFTMAX_AGGREGATES:
        raise ValueError(f"aggregate must be one of {SOFTMAX_AGGREGATES}, got {aggregate!r}")
    B, HQ, S = heads.shape
    G = HQ // HKV
    dev = heads.device
    blk, chunk, nc = lse_chunking(B * HQ, S, dev, block=block, num_chunks=num_chunks)
    part = new_output((2, B * HQ, nc), torch.float32, dev)
    use_pdl = pdl(dev)
    launch(_lse_partial_kernel, (B * HQ, nc), [
        heads, lengths, starts, part[0], part[1],
        HQ, chunk, nc, float(scale),
        heads.stride(0), heads.stride(1),
        blk, use_pdl,
    ], dict(num_warps=4, pdl=use_pdl))
    GP = triton.next_power_of_2(G)
    if block_t is None:
        cap = interpreter_tile(S, 1024) if interpreting() else max(16, GROUP_SOFTMAX_DEFAULTS["tile"] // GP)
        block_t = min(cap, max(16, triton.next_power_of_2(S)))
    launch(_group_aggregate_kernel, (B * HKV, triton.cdiv(S, block_t)), [
        heads, part[0], part[1], agg, lengths, starts,
        S, HKV, nc, float(scale),
        heads.stride(0), heads.stride(1),
        agg.stride(0), agg.stride(1),
        G, GP, triton.next_power_of_2(nc), block_t, aggregate == "softmax-sum", use_pdl,
    ], dict(num_warps=4, pdl=use_pdl))
    return agg


def group_softmax_scores(scores: torch.Tensor, HKV: int, aggregate: str, lengths: torch.Tensor,
                         starts: torch.Tensor, *, scale: float, out: torch.Tensor | None = None,
                         block: int | None = None, num_chunks: int | None = None,
                         block_t: int | None = None) -> torch.Tensor:
    """The group scores [B, HKV, S] fp32 of a softmax ``aggregate`` from per-query-head scores ``scores``
    [B, HQ, S] fp32 (-inf outside the valid tokens; last dim contiguous) as probabilities: ``exp`` of
    ``aggregate_group_scores(scores, HKV, aggregate, scale=scale)`` on the valid tokens (up to fp32 rounding; the
    module docstring says where the order of tokens can differ), -inf outside them.  lengths, starts: [B] int on
    the scores' device, ``0 <= starts[b] < lengths[b] <= S`` (trusted).  ``out``: an optional [B, HKV, S] fp32
    result (last dim contiguous); ``block``, ``num_chunks``, ``block_t``: launch choices beside
    :func:`lse_chunking`'s (tests)."""
    if scores.dim() != 3 or scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores must be a [B, HQ, S] fp32 tensor, last dim contiguous; got {scores.dtype} "
                         f"{list(scores.shape)}")
    B, HQ, S = scores.shape
    if HKV < 1 or HQ % HKV:
        raise ValueError(f"HKV={HKV} must divide the query heads HQ={HQ}")
    if out is None:
        out = new_output((B, HKV, S), torch.float32, scores.device)
    elif out.shape != (B, HKV, S) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be an fp32 tensor [B, HKV, S]=[{B}, {HKV}, {S}], last dim contiguous")
    if B == 0 or S == 0:
        return out
    return launch_group_softmax(scores, lengths, starts, out, HKV, aggregate, scale, block=block,
                                 num_chunks=num_chunks, block_t=block_t)
