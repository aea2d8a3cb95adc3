"""Approximate scores and the first level of the split select in one kernel (Loki Algorithm 1, lines 3-5, for few
long rows), in Triton.

With few selection rows (B=1 with 8 KV heads: 8 rows) the decode step scores the keys (``approx_scores``) and then
runs the split select of ``select_split.py``: two level launches and a compaction launch, each latency-bound (~6 us
per level launch at 8 x 131072 on an H100, docs/kernels.md).  Here the scoring kernel is laid out on the split
select's grid, (rows, C chunks of CH tokens): program (r, c) streams the keys of its chunk in tiles of BLOCK_S,
writes the row's scores (the same values as ``approx_scores``: -inf outside the valid tokens) and, from the
scores still in registers, the level-1 histogram of its chunk, the row's -1 padding and ticket, exactly as
``select_split._split_level_kernel`` with LEVEL = 1 writes them.  The select then continues at level 2
(``select_split._launch_split(first_level=2)``): one launch fewer and one pass over the scores fewer.

Rows: ``gqa_select="query"``: (b, hq), one query head against its KV head's keys; ``"kv"``: (b, h), the sum or
max over the G query heads of KV head h, computed from one read of the keys.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, d leading principal
dims, H the selection's head axis, R = B x H rows, K the selection width (>= max(counts)).
"""

from __future__ import annotations

import torch

from loki._triton import tl, triton

from ._common import interpreter_tile, interpreting, key_block, num_sms
from ._keys import _ordered_key
from .launch import launch, new_output, pdl
from .select_split import _launch_split, _layout, _warps, split_launch_config, split_workspace

__all__ = ["score_select_split"]


@triton.jit
def _score_level1_kernel(
    q_ptr, k_ptr, s_ptr, lengths_ptr, starts_ptr, counts_ptr, idx_ptr, ws_ptr,
    S, d, H, K, C, KV_DIV,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_sb, stride_sh,
    stride_ib, stride_ih, stride_wr,
    G_SCORE: tl.constexpr, AGG_MAX: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    CH: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr,
):
    """scores of chunk c of row r (query heads r_h*G_SCORE .. +G_SCORE-1 against KV head r_h // KV_DIV, summed or
    max'ed), then the level-1 histogram of their keys, the row's -1 padding and ticket (``_split_level_kernel``)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    b = r // H
    h = r % H
    kv = h // KV_DIV
    if PDL:  # programmatic dependent launch (launch.py): wait for the previous kernel's writes
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    kk = tl.maximum(tl.minimum(tl.load(counts_ptr + b).to(tl.int32), K), 0)  # never more than K slots
    row = s_ptr + b * stride_sb + h * stride_sh
    out = idx_ptr + b * stride_ib + h * stride_ih
    k_base = k_ptr + b * stride_kb + kv * stride_kh
    q_base = q_ptr + b * stride_qb + h * G_SCORE * stride_qh
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < d
    qs = tl.zeros((BLOCK_D,), tl.float32)  # the sum over the group's heads: one dot product with the summed query
    for g in tl.static_range(G_SCORE):
        qs += tl.load(q_base + g * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    hist = tl.zeros((NB,), tl.int32)
    for t0 in range(0, CH, BLOCK_S):
        p = c * CH + t0 + tl.arange(0, BLOCK_S)
        valid = (p >= start) & (p < length)
        kt = tl.load(k_base + p[:, None] * stride_ks + offs_d[None, :], mask=valid[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        if AGG_MAX and G_SCORE > 1:
            s = tl.full((BLOCK_S,), float("-inf"), tl.float32)
            for g in tl.static_range(G_SCORE):
                q = tl.load(q_base + g * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
                s = tl.maximum(s, tl.sum(kt * q[None, :], axis=1))
        else:
            s = tl.sum(kt * qs[None, :], axis=1)
        s = tl.where(valid, s, float("-inf"))
        m = p < S
        tl.store(row + p, s, mask=m)
        digit = ((_ordered_key(s) >> (32 - BITS)) & (NB - 1)).to(tl.int32)
        hist += tl.histogram(digit, NB, mask=m)
        tl.store(out + p, tl.full((BLOCK_S,), -1, tl.int32), mask=(p >= kk) & (p < K))
    ws = ws_ptr + r * stride_wr
    if c == 0:
        _, off_state, _ = _layout(C, NB)
        tl.store(ws + off_state + 8, 0)  # the row's ticket for the compaction launch
    tl.store(ws + C * NB + c * NB + tl.arange(0, NB), hist)  # level 1's histograms: (1 % 2) * C * NB on


def score_select_split(q_hat, k_src, d: int, lengths, starts, counts, K: int, *, gqa_select: str = "query",
                       aggregate: str = "sum", scores: torch.Tensor | None = None, idx: torch.Tensor | None = None,
                       chunk: int | None = None, block_s: int | None = None):
    """Scores ([B, H, S] fp32, as ``approx_scores``) and the top-``counts[b]`` indices of every row ([B, H, K]
    int32, the split select's: the set of ``select_topk``, ties to the lowest position), with the scoring and
    the select's first level in one launch (then ``levels`` more launches of ``select_split``).

    q_hat: [B, HQ, D]; k_src: [B, HKV, S, Dk] with Dk >= d (the rotated keys or a ``k_prefix`` buffer, last dim
    contiguous); lengths, starts, counts: [B] int on the device (validated by the caller: 1 <= counts[b] <= valid
    tokens of b <= K <= S); ``aggregate`` "sum" or "max" (for ``gqa_select="kv"``).  ``scores`` (optional): the
    [B, H, S] fp32 output (last dim contiguous; rows may be padded).  ``chunk``, ``block_s``: launch choices
    (defaults: ``split_launch_config``'s chunk, the scores kernels' key tile).  Returns ``(scores, idx)``.
    """
    if q_hat.dim() != 3 or k_src.dim() != 4 or k_src.shape[0] != q_hat.shape[0] or q_hat.shape[1] % k_src.shape[1]:
        raise ValueError(f"expected q_hat [B, HQ, D] and k_src [B, HKV, S, Dk] with HQ a multiple of HKV; got "
                         f"{list(q_hat.shape)} and {list(k_src.shape)}")
    if gqa_select not in ("query", "kv") or aggregate not in ("sum", "max"):
        raise ValueError(f"gqa_select must be 'query' or 'kv' and aggregate 'sum' or 'max'; got {gqa_select!r}, "
                         f"{aggregate!r}")
    B, HQ, _ = q_hat.shape
    _, HKV, S, _ = k_src.shape
    if not 1 <= d <= k_src.shape[-1]:
        raise ValueError(f"d={d} must lie in [1, {k_src.shape[-1]}] (the key dims k_src holds)")
    if not 1 <= K <= S:
        raise ValueError(f"K={K} must lie in [1, S={S}]")
    G = HQ // HKV
    H, g_score, kv_div = (HQ, 1, G) if gqa_select == "query" else (HKV, G, 1)
    dev = q_hat.device
    if scores is None:
        scores = new_output((B, H, S), torch.float32, dev)
    if idx is None:
        idx = new_output((B, H, K), torch.int32, dev)
    R = B * H
    cfg = split_launch_config(S, R, num_sms(dev))
    chunk = cfg["chunk"] if chunk is None else chunk
    BLOCK_D = triton.next_power_of_2(d)
    if block_s is None:
        block_s = interpreter_tile(S, 2048) if interpreting() else key_block(BLOCK_D, k_src.stride(2) == d)
    block_s = min(block_s, chunk)
    bits, NB, C = cfg["bits"], 1 << cfg["bits"], -(-S // chunk)
    ws = split_workspace(R, S, chunk, bits, dev)
    use_pdl = pdl(dev)
    launch(_score_level1_kernel, (R, C), [
        q_hat, k_src, scores, lengths, starts, counts, idx, ws,
        S, d, H, K, C, kv_div,
        q_hat.stride(0), q_hat.stride(1),
        k_src.stride(0), k_src.stride(1), k_src.stride(2),
        scores.stride(0), scores.stride(1),
        idx.stride(0), idx.stride(1), ws.stride(0),
        g_score, aggregate == "max", block_s, BLOCK_D, chunk, bits, NB, use_pdl,
    ], dict(num_warps=4, pdl=use_pdl))
    warps = _warps(chunk)
    _launch_split(scores, counts, idx, K, chunk, bits, cfg["levels"], cfg["cand_block"], warps,
                  max(warps, _warps(cfg["cand_block"])), ws=ws, first_level=2)
    return scores, idx
