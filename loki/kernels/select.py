"""Top-k token selection per row (Loki Algorithm 1, line 5): ``torch.topk`` or an exact Triton threshold
select, behind one interface (``select_topk(scores, counts, method=...)``).

Shape letters: B batch, H the selection's head axis (HQ or HKV), S cache length, K = the bound on the
per-sequence counts (``max(counts) <= K``).

The Triton method ("triton") is an exact radix select: one program holds a whole score row in registers,
maps each fp32 score to an order-preserving int32 key, finds the k-th largest key by a 32-step bitwise
binary search (each step one count over the row), then compacts: every key above the threshold, plus
as many keys equal to it as are needed, is written with its position from a prefix sum.  Output order is
unspecified (like ``torch.topk(sorted=False)``); ties at the threshold are broken by position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loki.reference.selection import select_topk as select_topk_reference

from .approx_scores import check_triton_device, new_output

__all__ = ["SELECT_METHODS", "TRITON_SELECT_MAX_S", "select_topk", "select_topk_reference"]

SELECT_METHODS = ("torch", "triton")
#: Longest row the register-resident Triton select handles; longer rows fall back to ``torch.topk``.
TRITON_SELECT_MAX_S = 32768


@triton.jit
def _threshold_select_kernel(
    scores_ptr, counts_ptr, idx_ptr,
    S, H, K,
    stride_sb, stride_sh,
    stride_ib, stride_ih,
    BLOCK: tl.constexpr,
):
    """idx[b, h, :counts[b]] = positions of the counts[b] largest scores of row (b, h); idx[.., counts[b]:K] = -1."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    offs = tl.arange(0, BLOCK)
    in_row = offs < S
    x = tl.load(scores_ptr + b * stride_sb + h * stride_sh + offs, mask=in_row, other=float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    # Order-preserving map fp32 -> int32: negative floats get their magnitude bits flipped.
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    int_min = tl.full((BLOCK,), 1, tl.int32) << 31
    key = tl.where(in_row, key, int_min)
    kk = tl.load(counts_ptr + b).to(tl.int32)
    # Largest thr with #(key >= thr) >= kk: sign bit first, then bits 30..0.
    n_nonneg = tl.sum((key >= 0).to(tl.int32), axis=0)
    thr = (n_nonneg < kk).to(tl.int32) << 31  # 0, or INT32_MIN when fewer than kk keys are >= 0
    for i in tl.static_range(31):
        cand = thr | (1 << (30 - i))
        c = tl.sum((key >= cand).to(tl.int32), axis=0)
        thr = tl.where(c >= kk, cand, thr)
    gt = (key > thr) & in_row
    eq = (key == thr) & in_row
    n_gt = tl.sum(gt.to(tl.int32), axis=0)
    pos_gt = tl.cumsum(gt.to(tl.int32), axis=0) - 1
    pos_eq = n_gt + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    take_eq = eq & (pos_eq < kk)
    pos = tl.where(gt, pos_gt, pos_eq)
    base = idx_ptr + b * stride_ib + h * stride_ih
    tl.store(base + pos, offs.to(tl.int32), mask=gt | take_eq)
    tl.store(base + offs, tl.full((BLOCK,), -1, tl.int32), mask=(offs >= kk) & (offs < K))


def _select_triton(scores: torch.Tensor, counts: torch.Tensor, K: int, out: torch.Tensor | None):
    B, H, S = scores.shape
    check_triton_device(scores, "select_topk(method='triton')")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    idx = out if out is not None else new_output((B, H, K), torch.int32, scores.device)
    if idx.shape != (B, H, K) or idx.dtype != torch.int32 or idx.stride(-1) != 1:
        raise ValueError(f"out must be a contiguous int32 tensor of shape [B, H, K]=[{B}, {H}, {K}]")
    BLOCK = triton.next_power_of_2(S)
    num_warps = 4 if BLOCK <= 2048 else (8 if BLOCK <= 8192 else 16)
    _threshold_select_kernel[(B * H,)](
        scores, counts, idx, S, H, K,
        scores.stride(0), scores.stride(1), idx.stride(0), idx.stride(1),
        BLOCK=BLOCK, num_warps=num_warps,
    )
    return idx


def select_topk(
    scores: torch.Tensor,
    counts: torch.Tensor,
    *,
    k_max: int | None = None,
    method: str = "torch",
    uniform: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices of the ``counts[b]`` largest scores of every row, unsorted.

    scores: [B, H, S] fp32 (-inf marks tokens that may not be chosen); counts: [B] int on the scores'
    device, 1 <= counts[b] <= the number of finite scores of each row of batch b; ``k_max`` an int bound
    K >= max(counts) (pass it to avoid a host sync; default ``int(counts.max())``).
    Returns idx: [B, H, K], int64 for ``method="torch"``, int32 for ``"triton"``; entries at positions
    >= counts[b] are -1.  ``uniform=True`` promises all counts equal K (then ``torch.topk(sorted=False)``
    is enough; otherwise the torch method sorts so that the first counts[b] entries are the top ones).
    """
    if method not in SELECT_METHODS:
        raise ValueError(f"method must be one of {SELECT_METHODS}, got {method!r}")
    if scores.dim() != 3:
        raise ValueError(f"scores must have shape [B, H, S], got {list(scores.shape)}")
    B, H, S = scores.shape
    if counts.shape != (B,):
        raise ValueError(f"counts must have shape [B]=[{B}], got {list(counts.shape)}")
    K = int(counts.max()) if k_max is None else int(k_max)
    if not 1 <= K <= S:
        raise ValueError(f"k_max={K} must lie in [1, S={S}]")
    if method == "triton" and S <= TRITON_SELECT_MAX_S:
        return _select_triton(scores, counts, K, out)
    idx = torch.topk(scores, K, dim=-1, sorted=not uniform).indices
    if not uniform:
        keep = torch.arange(K, device=scores.device)[None, None, :] < counts.to(scores.device)[:, None, None]
        idx = idx.masked_fill(~keep, -1)
    if out is not None:
        out.copy_(idx)
        return out
    return idx
