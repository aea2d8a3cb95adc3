"""SparQ-style decode attention kernels: the baseline the Loki paper compares its kernels against.

Computes the same function as ``loki.reference.sparq_attention`` (Ribar et al. 2023, Algorithm 1):
the r query components of largest |q|, approximate scores from those components of the keys with the
SparQ temperature, top-k, exact attention over the selected tokens, and the mean-value reallocation
``out = alpha * y + (1 - alpha) * mean(V)``.

Faithful to the design of the original SparQ Triton kernels, deliberately *not* optimised further:
- the keys are stored twice, row-major ``k_cache [B, HKV, S, D]`` and transposed ``k_cache_t
  [B, HKV, D, S]`` (the r-component scores read r contiguous rows of the transposed copy);
- both kernels use a 1-D grid over batch x query heads and loop serially over chunks of the sequence
  (no split of the sequence across programs, no sharing of a KV head across its query heads);
- selection is ``torch.topk``; the mean of V is kept beside the cache (SparQ maintains it as a running
  mean; ``v_mean`` computes it when not given).

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), S cache length, D head dim,
r query components, K selected tokens.
"""

from __future__ import annotations

import torch

from loki._checks import (
    check_budget,
    check_count,
    check_decode_inputs,
    check_no_grad,
    resolve_d,
    resolve_scale,
    valid_token_mask,
)
from loki._triton import tl, triton
from loki.reference.methods import sparq_attention as sparq_attention_reference
from loki.reference.selection import budget, topk_indices

from .common import check_triton_device, interpreter_tile, interpreting
from .launch import new_output
from .select import select_topk

__all__ = ["sparq_attention", "sparq_attention_reference", "sparq_prepare"]

_LOG2E = 1.4426950408889634


@triton.jit
def _sparq_approx_kernel(
    qr_ptr, i1_ptr, inv_temp_ptr, kt_ptr, lengths_ptr, starts_ptr,
    shat_ptr, m_ptr, l_ptr,
    S, R, HQ, G,
    stride_kb, stride_kh, stride_kd,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """s_hat[t] = q[i1] . K^T[i1, t] / temp for all t (serial over chunks), with its softmax max and sum."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HQ
    hq = pid % HQ
    kv = hq // G
    start = tl.load(starts_ptr + b).to(tl.int64)
    length = tl.load(lengths_ptr + b).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    qr = tl.load(qr_ptr + pid * R + offs_r, mask=rmask, other=0.0)
    rows = tl.load(i1_ptr + pid * R + offs_r, mask=rmask, other=0).to(tl.int64)
    inv_temp = tl.load(inv_temp_ptr + pid)
    base = kt_ptr + b * stride_kb + kv * stride_kh + rows[:, None] * stride_kd
    m_i = tl.max(tl.full((BLOCK_S,), float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros((BLOCK_S,), tl.float32), axis=0)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        valid = (offs_s >= start) & (offs_s < length)
        kt = tl.load(base + offs_s[None, :], mask=rmask[:, None] & valid[None, :], other=0.0)
        s = tl.sum(kt.to(tl.float32) * qr[:, None], axis=0) * inv_temp
        s = tl.where(valid, s, float("-inf"))
        tl.store(shat_ptr + pid * S + offs_s, s, mask=offs_s < S)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk with no valid token (left padding)
        l_i = l_i * tl.exp(m_i - m_use) + tl.sum(tl.where(valid, tl.exp(s - m_use), 0.0), axis=0)
        m_i = m_new
    tl.store(m_ptr + pid, m_i)
    tl.store(l_ptr + pid, l_i)


@triton.jit
def _sparq_attn_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, counts_ptr, shat_ptr, m_ptr, l_ptr, vmean_ptr, out_ptr,
    qk_scale, S, HQ, G, K,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y = softmax(scale q . K[i2]^T) V[i2] (serial over chunks of i2); out = alpha y + (1 - alpha) v_mean."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HQ
    hq = pid % HQ
    kv = hq // G
    count = tl.load(counts_ptr + b).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + hq * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
    q = q * qk_scale
    m_hat = tl.load(m_ptr + pid)
    l_hat = tl.load(l_ptr + pid)
    k_base = k_ptr + b * stride_kb + kv * stride_kh
    v_base = v_ptr + b * stride_vb + kv * stride_vh
    m_i = tl.max(tl.full((BLOCK_K,), float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros((BLOCK_K,), tl.float32), axis=0)
    alpha_num = tl.sum(tl.zeros((BLOCK_K,), tl.float32), axis=0)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for k0 in range(0, count, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        tmask = offs < count
        tok = tl.load(idx_ptr + pid * K + offs, mask=tmask, other=0).to(tl.int64)
        lmask = tmask[:, None] & dmask[None, :]
        kt = tl.load(k_base + tok[:, None] * stride_ks + offs_d[None, :], mask=lmask, other=0.0)
        vt = tl.load(v_base + tok[:, None] * stride_vs + offs_d[None, :], mask=lmask, other=0.0)
        sh = tl.load(shat_ptr + pid * S + tok, mask=tmask, other=float("-inf"))
        alpha_num += tl.sum(tl.where(tmask, tl.exp(sh - m_hat), 0.0), axis=0)
        s = tl.sum(kt.to(tl.float32) * q[None, :], axis=1)
        s = tl.where(tmask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        corr = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * corr + tl.sum(p, axis=0)
        acc = acc * corr + tl.sum(p[:, None] * vt.to(tl.float32), axis=0)
        m_i = m_new
    alpha = alpha_num / l_hat
    vm = tl.load(vmean_ptr + (b * (HQ // G) + kv) * D + offs_d, mask=dmask, other=0.0)
    res = alpha * (acc / l_i) + (1.0 - alpha) * vm
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=dmask)


def sparq_prepare(k_cache: torch.Tensor, v_cache: torch.Tensor, lengths=None, starts=None):
    """What SparQ keeps beside its cache: the transposed key copy [B, HKV, D, S] and the mean of the
    valid values [B, HKV, D] (fp32).  Computed once per cache, outside the timed decode step."""
    B, HKV, S, D = k_cache.shape
    k_t = k_cache.transpose(-1, -2).contiguous()
    if lengths is None and starts is None:
        v_mean = v_cache.float().mean(dim=2)
    else:
        lengths = torch.full((B,), S, dtype=torch.int32, device=k_cache.device) if lengths is None else lengths
        starts = torch.zeros(B, dtype=torch.int32, device=k_cache.device) if starts is None else starts
        valid = valid_token_mask(lengths, starts, S)
        # rows outside the valid tokens are zeroed, not multiplied by 0 (NaN there would survive a product)
        v_valid = v_cache.float().masked_fill(~valid[:, None, :, None], 0)
        v_mean = v_valid.sum(dim=2) / valid.sum(-1).to(torch.float32)[:, None, None]
    return k_t, v_mean.contiguous()


def sparq_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    r: int | float,
    k: int | float,
    lengths: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    k_cache_t: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    k_max: int | None = None,
    block_s: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """SparQ attention with the SparQ-style kernels; same result as ``sparq_attention_reference``.

    q: [B, HQ, D]; k_cache, v_cache: [B, HKV, S, D]; k_cache_t: [B, HKV, D, S] (the transposed copy,
    made here when not given); v_mean: [B, HKV, D] fp32 mean of the valid values (computed when not
    given); r, k counts or fractions; k_max an int bound on the per-sequence counts (avoids a host sync).
    Returns out [B, HQ, D] in q's dtype.
    """
    B, HQ, HKV, S, D, lengths, starts = check_decode_inputs(q, k_cache, v_cache, lengths, starts)
    check_triton_device(q, "sparq_attention")
    check_no_grad("sparq_attention (Triton)", q=q, k_cache=k_cache, v_cache=v_cache)
    rr = resolve_d(r, D, name="r")
    k = check_budget(k)
    sm_scale = resolve_scale(scale, D)
    for name, blk in (("block_s", block_s), ("block_k", block_k)):
        if blk is not None and (check_count(blk, name, minimum=16) & (blk - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk}")
    if B == 0:  # an empty batch, as the reference
        return new_output((0, HQ, D), q.dtype, q.device) if out is None else out
    G = HQ // HKV
    if k_cache_t is None or v_mean is None:
        kt_new, vm_new = sparq_prepare(k_cache, v_cache, lengths, starts)
        k_cache_t = kt_new if k_cache_t is None else k_cache_t
        v_mean = vm_new if v_mean is None else v_mean
    if k_cache_t.shape != (B, HKV, D, S) or (k_cache_t.stride(-1) != 1 and S > 1):
        raise ValueError(f"k_cache_t must be a contiguous [B, HKV, D, S]=[{B}, {HKV}, {D}, {S}] tensor")
    if v_mean.shape != (B, HKV, D):
        raise ValueError(f"v_mean must have shape [B, HKV, D]=[{B}, {HKV}, {D}], got {list(v_mean.shape)}")
    v_mean = v_mean.float().contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    # Step 1 (tiny, in PyTorch as in SparQ): the r largest |q| components and the temperature.
    qf = q.float()
    i1 = topk_indices(qf.abs(), rr).to(torch.int32).contiguous()  # [B, HQ, r], ties as the reference
    q_r = torch.gather(qf, -1, i1.long()).contiguous()
    l1_ratio = q_r.abs().sum(-1) / qf.abs().sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
    inv_temp = 1.0 / torch.sqrt(D * l1_ratio).clamp_min(torch.finfo(torch.float32).tiny)
    inv_temp = inv_temp.contiguous()
    interp = interpreting()
    dev = q.device
    s_hat = new_output((B, HQ, S), torch.float32, dev)
    m_hat = new_output((B, HQ), torch.float32, dev)
    l_hat = new_output((B, HQ), torch.float32, dev)
    if block_s is None:
        block_s = interpreter_tile(S, 2048) if interp else 128
    _sparq_approx_kernel[(B * HQ,)](
        q_r, i1, inv_temp, k_cache_t, lengths, starts,
        s_hat, m_hat, l_hat,
        S, rr, HQ, G,
        k_cache_t.stride(0), k_cache_t.stride(1), k_cache_t.stride(2),
        BLOCK_R=max(2, triton.next_power_of_2(rr)), BLOCK_S=block_s, num_warps=4,
    )
    # Step 3: top-k of the approximate scores (torch.topk, sorted when counts differ).
    counts = budget(k, lengths, starts, B, S, dev)
    uniform = _all_full(lengths, starts, S)
    idx = select_topk(s_hat, counts, k_max=k_max, method="torch", uniform=uniform)
    idx = idx.contiguous()
    K = idx.shape[-1]
    if out is None:
        out = new_output((B, HQ, D), q.dtype, dev)
    if block_k is None:
        block_k = interpreter_tile(K, 1024, 16) if interp else 32
    _sparq_attn_kernel[(B * HQ,)](
        q, k_cache, v_cache, idx, counts, s_hat, m_hat, l_hat, v_mean, out,
        sm_scale * _LOG2E, S, HQ, G, K,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_K=block_k, num_warps=4,
    )
    return out


def _all_full(lengths: torch.Tensor, starts: torch.Tensor, S: int) -> bool:
    # check_decode_inputs already synchronised on these values; one more small check is cheap here.
    return bool(((lengths == S) & (starts == 0)).all())
