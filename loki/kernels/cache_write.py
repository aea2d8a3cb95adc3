"""Writing new tokens into a static Loki cache in one kernel: each new key rotated into the basis (``K P``, fp32
accumulation) and stored with its value and its key prefix (the first dp rotated dims, or their int8 score copy:
codes and a per-token scale) at the token's position.

Without it a compiled decode step spends four kernels per layer on this (the rotation's small fp32 product, its
cast, and one ``index_copy_`` each for keys, values and prefix) and their launch gaps in the CUDA graph.  The
op ``torch.ops.loki.write_rotated`` mutates the cache tensors in place (declared, so ``torch.compile`` keeps it a
mutation of the static buffers); on tensors the Triton kernel cannot take it runs the PyTorch reference
(``write_rotated_reference``), whose rounding it matches up to the order of the fp32 sum.

Shape letters: B batch, HKV key/value heads, L new tokens, S = max cache length, D head dim, dp prefix dims.
"""

from __future__ import annotations

import torch

from loki._checks import CacheOverflowError
from loki._triton import tl, triton

from .common import interpreting
from .launch import launch
from .tl_helpers import bf16_rne, int8_codes

__all__ = ["check_write", "write_int8_prefix", "write_rotated", "write_rotated_reference"]


@triton.jit
def _rotated_block(k, p_ptr, h, offs_i, jb, D: tl.constexpr, BLOCK_J: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Dims jb*BLOCK_J.. of a key rotated into the basis, fp32 sums, rounded to the cache's dtype as stored (every
    program sums a [D, BLOCK_J] tile in the same order, so a recomputed block equals the stored one)."""
    offs_j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    P = tl.load(p_ptr + h * D * D + offs_i[:, None] * D + offs_j[None, :])  # [D, BLOCK_J] fp32
    return tl.sum(k[:, None] * P, axis=0).to(OUT_DTYPE), offs_j


@triton.jit
def _write_rotated_kernel(
    k_ptr, v_ptr, p_ptr, pos_ptr, keys_ptr, values_ptr, prefix_ptr, scale_ptr,
    L, HKV, dp, B_CACHE, S_CACHE,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_cb, stride_ch, stride_cs,
    stride_wb, stride_wh, stride_ws,
    stride_xb, stride_xh, stride_xs,
    stride_sb, stride_sh,
    D: tl.constexpr, BLOCK_J: tl.constexpr, HAS_PREFIX: tl.constexpr, INT8: tl.constexpr,
    DP_BLOCKS: tl.constexpr,
):
    """keys[b, h, pos[l]] = k[b, h, l] @ P[h]; values[b, h, pos[l]] = v[b, h, l]; prefix[.., :dp] = keys[.., :dp],
    or with ``INT8`` the "int8" score copy of keys[.., :dp] as stored (``encode_int8_score_keys``: codes in prefix,
    the bf16 scale in ``scale_ptr`` [B, HKV, S]), written by the token's first program, which rotates the DP_BLOCKS
    blocks of the prefix again for its largest magnitude.

    Every store is masked to the cache's own rows (``0 <= pos < S_CACHE``, ``b < B_CACHE``): whatever it is
    given, the kernel never writes outside the cache tensors (the host checks raise before launching)."""
    l_idx = tl.program_id(0).to(tl.int64)  # tokens on grid axis 0 (up to 2^31 - 1: a long prefill fits)
    pid = tl.program_id(1).to(tl.int64)  # batch x KV heads on axis 1 (at most 65535)
    b = pid // HKV
    h = pid % HKV
    p = tl.load(pos_ptr + l_idx).to(tl.int64)
    inside = (p >= 0) & (p < S_CACHE) & (b < B_CACHE)
    p = tl.where(inside, p, 0)
    offs_i = tl.arange(0, D)
    offs_j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)  # this program's output dims (axis 2)
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + l_idx * stride_kl + offs_i).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + l_idx * stride_vl + offs_j)
    tl.store(values_ptr + b * stride_cb + h * stride_ch + p * stride_cs + offs_j, v, mask=(offs_j < D) & inside)
    P = tl.load(p_ptr + h * D * D + offs_i[:, None] * D + offs_j[None, :])  # [D, BLOCK_J] fp32
    y = tl.sum(k[:, None] * P, axis=0)
    tl.store(keys_ptr + b * stride_wb + h * stride_wh + p * stride_ws + offs_j, y.to(keys_ptr.dtype.element_ty),
             mask=(offs_j < D) & inside)
    if HAS_PREFIX and not INT8:
        tl.store(prefix_ptr + b * stride_xb + h * stride_xh + p * stride_xs + offs_j,
                 y.to(prefix_ptr.dtype.element_ty), mask=(offs_j < dp) & inside)
    if INT8:
        if tl.program_id(2) == 0:
            out_dtype = keys_ptr.dtype.element_ty
            amax = tl.zeros((), tl.float32)
            for jb in tl.static_range(DP_BLOCKS):
                yj, oj = _rotated_block(k, p_ptr, h, offs_i, jb, D, BLOCK_J, out_dtype)
                amax = tl.maximum(amax, tl.max(tl.where(oj < dp, tl.abs(yj.to(tl.float32)), 0.0), axis=0))
            sc = bf16_rne(tl.math.div_rn(amax, 127.0))
            div = tl.where(sc.to(tl.float32) > 0, sc.to(tl.float32), 1.0)
            tl.store(scale_ptr + b * stride_sb + h * stride_sh + p, sc, mask=inside)
            for jb in tl.static_range(DP_BLOCKS):
                yj, oj = _rotated_block(k, p_ptr, h, offs_i, jb, D, BLOCK_J, out_dtype)
                tl.store(prefix_ptr + b * stride_xb + h * stride_xh + p * stride_xs + oj,
                         int8_codes(yj.to(tl.float32), div), mask=(oj < dp) & inside)


def write_int8_prefix(keys, prefix, prefix_scale, pos) -> None:
    """The int8 score copy of the keys already written at ``pos``: their stored (rotated, cache-dtype) first dp dims
    encoded by ``encode_int8_score_keys`` and written at the same positions (plain torch ops, no host sync)."""
    from loki.reference.score_formats import encode_int8_score_keys

    codes, scale = encode_int8_score_keys(keys.index_select(2, pos)[..., : prefix.shape[-1]])
    prefix.index_copy_(2, pos, codes)
    prefix_scale.index_copy_(2, pos, scale)


def write_rotated_reference(keys, values, prefix, k_new, v_new, P, pos, prefix_scale=None) -> None:
    """The same writes in PyTorch: ``K P`` in fp32 (``loki.reference.rotate_keys``), then ``index_copy_``; with
    ``prefix_scale`` the prefix is the int8 score copy (:func:`write_int8_prefix`)."""
    from loki.reference import rotate_keys

    k_hat = rotate_keys(k_new, P)
    keys.index_copy_(2, pos, k_hat)
    values.index_copy_(2, pos, v_new)
    if prefix is not None and prefix_scale is not None:
        write_int8_prefix(keys, prefix, prefix_scale, pos)
    elif prefix is not None:
        prefix.index_copy_(2, pos, k_hat[..., : prefix.shape[-1]])


def _kernel_fits(keys, values, prefix, k_new, v_new, P, prefix_scale=None) -> bool:
    D = keys.shape[-1]
    ok = (keys.is_cuda or interpreting()) and D >= 16 and D & (D - 1) == 0 and P.dtype == torch.float32
    ok = ok and all(t.stride(-1) == 1 for t in (keys, values, k_new, v_new))
    ok = ok and (prefix_scale is None or (prefix is not None and prefix_scale.stride(-1) == 1))
    return ok and (prefix is None or prefix.stride(-1) == 1)


def check_write(keys, values, prefix, k_new, v_new, P, pos, *, check_positions: bool = True) -> None:
    """Refuse a write that does not fit the cache, before anything is written: the batch and heads of the new
    tokens must equal the cache's, and every position must lie in ``[0, max_cache_len)`` (``check_positions``:
    one host sync; skipped while a CUDA graph is captured, where the kernel's masked stores still keep every
    write inside the cache)."""
    if k_new.dim() != 4 or v_new.shape[:3] != k_new.shape[:3]:
        raise ValueError(f"new keys and values must be [B, HKV, L, D] of one shape, got {list(k_new.shape)} and "
                         f"{list(v_new.shape)}")
    B, HKV, L, D = k_new.shape
    Bc, Hc, S, Dc = keys.shape
    if B != Bc:
        raise CacheOverflowError(f"the batch has {B} sequences but the static cache was allocated for batch_size="
                                 f"{Bc}: make the cache with batch_size={B} (or let it allocate at its first write)")
    if HKV != Hc or D != Dc or values.shape[:3] != keys.shape[:3] or (P is not None and P.shape != (HKV, D, D)):
        raise ValueError(f"new keys [B, HKV, L, D]={list(k_new.shape)} do not match the cache "
                         f"{list(keys.shape)} / values {list(values.shape)}"
                         + ("" if P is None else f" / basis {list(P.shape)}"))
    if prefix is not None and (prefix.shape[:3] != keys.shape[:3] or prefix.shape[-1] > D):
        raise ValueError(f"the key prefix {list(prefix.shape)} does not match the cache {list(keys.shape)}")
    if pos.dim() != 1 or pos.shape[0] != L or pos.dtype.is_floating_point:
        raise ValueError(f"pos must be [L]=[{L}] integer positions, got {pos.dtype} {list(pos.shape)}")
    capturing = pos.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_positions and L and not capturing:
        lo, hi = (int(v) for v in torch.stack([pos.min(), pos.max()]).tolist())
        if lo < 0 or hi >= S:
            raise CacheOverflowError(f"writing positions {lo}..{hi} into a static cache of max_cache_len={S}: "
                                     f"the prompt and the new tokens must fit in max_cache_len (make the cache "
                                     f"with max_cache_len >= {hi + 1})")


def write_rotated(keys: torch.Tensor, values: torch.Tensor, prefix: torch.Tensor | None, k_new: torch.Tensor,
                  v_new: torch.Tensor, P: torch.Tensor, pos: torch.Tensor, check_positions: bool = True,
                  prefix_scale: torch.Tensor | None = None) -> None:
    """Write L new tokens into a static cache in place (the op ``torch.ops.loki.write_rotated``, every argument
    passed: an op's mutated argument left to its default breaks torch's in-place bookkeeping).

    keys, values: [B, HKV, S, D]; prefix: [B, HKV, S, dp] or None; k_new, v_new: [B, HKV, L, D] (keys in their
    own coordinates); P: [HKV, D, D] fp32, the basis; pos: [L] int64, the positions written.  ``prefix_scale``
    [B, HKV, S] bf16: ``prefix`` holds the int8 score copy (int8 codes of the stored keys' first dp dims, written with
    their scales in the same kernel).  Shapes and positions are checked before anything is written
    (:func:`check_write`; ``check_positions=False`` skips the positions' host sync for a caller that checked them
    already); the kernel's stores are masked to the cache.
    """
    _write_rotated_op(keys, values, prefix, prefix_scale, k_new, v_new, P, pos, check_positions)


@torch.library.custom_op("loki::write_rotated", mutates_args=("keys", "values", "prefix", "prefix_scale"))
def _write_rotated_op(keys: torch.Tensor, values: torch.Tensor, prefix: torch.Tensor | None,
                      prefix_scale: torch.Tensor | None, k_new: torch.Tensor, v_new: torch.Tensor, P: torch.Tensor,
                      pos: torch.Tensor, check_positions: bool) -> None:
    """:func:`write_rotated`, as the op."""
    check_write(keys, values, prefix, k_new, v_new, P, pos, check_positions=check_positions)
    if prefix_scale is not None and (prefix is None or prefix_scale.shape != prefix.shape[:3]
                                     or prefix.dtype != torch.int8 or prefix_scale.dtype != torch.bfloat16):
        raise ValueError("prefix_scale [B, HKV, S] bf16 goes with an int8 prefix [B, HKV, S, dp] (the int8 score "
                         f"copy), got {None if prefix is None else (prefix.dtype, list(prefix.shape))} and "
                         f"{prefix_scale.dtype} {list(prefix_scale.shape)}")
    if not _kernel_fits(keys, values, prefix, k_new, v_new, P, prefix_scale):
        write_rotated_reference(keys, values, prefix, k_new, v_new, P, pos, prefix_scale)
        return
    B, HKV, L, D = k_new.shape
    if B == 0 or L == 0:
        return
    P = P.contiguous()  # a no-op for the integration's bases (``LokiState.transforms`` keeps them contiguous)
    pre = prefix if prefix is not None else keys
    if B * HKV > 65535:
        raise ValueError(f"batch x KV heads = {B * HKV} exceeds the 65535 programs of a grid axis")
    block_j = min(32, D)
    dp = pre.shape[-1] if prefix is not None else 0
    sc = prefix_scale if prefix_scale is not None else pos  # a placeholder pointer without an int8 copy
    launch(_write_rotated_kernel, (L, B * HKV, D // block_j), [
        k_new, v_new, P, pos, keys, values, pre, sc, L, HKV, dp,
        keys.shape[0], keys.shape[2],
        k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1), v_new.stride(2),
        values.stride(0), values.stride(1), values.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        pre.stride(0), pre.stride(1), pre.stride(2),
        sc.stride(0) if prefix_scale is not None else 0, sc.stride(1) if prefix_scale is not None else 0,
        D, block_j, prefix is not None, prefix_scale is not None, triton.cdiv(dp, block_j),
    ], dict(num_warps=4))


@_write_rotated_op.register_fake
def _(keys, values, prefix, prefix_scale, k_new, v_new, P, pos, check_positions) -> None:
    return None
