"""The decode step's query rotation ``q_hat = q P_q`` (each query head with the basis of its KV head, fp32
accumulation) in one small Triton kernel, and as a torch custom op, ``torch.ops.loki.rotate_query``.

Why: the reference rotation (``loki.reference.rotate_query``, an fp32 ``einsum``) becomes a batched fp32 GEMM on
CUDA (a cuBLAS kernel without tensor cores: 7.4 us per layer at B=1 with 32 query heads on an H100, for 0.5 MB of
basis and 8 KB of queries).  Here a grid of (B x HKV, D / BLOCK_J) programs each loads a [D, BLOCK_J] slice of its
KV head's basis and the group's G query rows once and writes G x BLOCK_J outputs.

Registered per device like ``loki::decode_step``: on CUDA the kernel, on the CPU the reference (the CPU
interpreter runs the kernel through :func:`rotate_query_triton`).  Importing this module probes no device.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV), D head dim.
"""

from __future__ import annotations

import torch

from loki._triton import tl, triton
from loki.reference import rotate_query as rotate_query_reference

from .common import check_triton_device
from .launch import launch, new_output

__all__ = ["rotate_query_fast", "rotate_query_op", "rotate_query_reference", "rotate_query_triton"]


@triton.jit
def _rotate_query_kernel(
    q_ptr, p_ptr, out_ptr,
    HKV, stride_qb, stride_qh, stride_ob, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_J: tl.constexpr,
):
    """out[b, h*G + g, j] = sum_i q[b, h*G + g, i] P[h, i, j] (fp32) for one (b, h) and one block of j."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HKV
    h = pid % HKV
    offs_g = tl.arange(0, GP)
    offs_i = tl.arange(0, D)
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    gm = offs_g < G
    hq = h * G + offs_g
    q = tl.load(q_ptr + b * stride_qb + hq[:, None] * stride_qh + offs_i[None, :], mask=gm[:, None],
                other=0.0).to(tl.float32)  # [GP, D]
    P = tl.load(p_ptr + h * D * D + offs_i[:, None] * D + offs_j[None, :])  # [D, BLOCK_J] fp32
    y = tl.sum(q[:, :, None] * P[None, :, :], axis=1)  # [GP, BLOCK_J]
    tl.store(out_ptr + b * stride_ob + hq[:, None] * stride_oh + offs_j[None, :],
             y.to(out_ptr.dtype.element_ty), mask=gm[:, None])


def _check(q: torch.Tensor, P: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 3 or P.dim() != 3 or P.shape[1:] != (q.shape[-1], q.shape[-1]) or q.shape[1] % P.shape[0]:
        raise ValueError(f"expected q [B, HQ, D] and P [HKV, D, D] with HQ a multiple of HKV, got {list(q.shape)} "
                         f"and {list(P.shape)}")
    B, HQ, D = q.shape
    return B, HQ, P.shape[0], D


def _kernel_fits(q: torch.Tensor, P: torch.Tensor) -> bool:
    D = q.shape[-1]
    return D >= 16 and D & (D - 1) == 0 and P.dtype == torch.float32


def rotate_query_triton(q: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``q P`` per KV head with the Triton kernel (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``):
    q [B, HQ, D] (any float dtype), P [HKV, D, D] fp32, D a power of two >= 16.  Returns [B, HQ, D] in
    q's dtype (fp32 accumulation, as the reference)."""
    B, HQ, HKV, D = _check(q, P)
    check_triton_device(q, "rotate_query")
    if not _kernel_fits(q, P):
        raise ValueError(f"the rotation kernel takes fp32 bases and a power-of-two D >= 16, got {P.dtype} D={D}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    P = P.contiguous()  # a no-op for the integration's bases (``LokiState.transforms`` keeps them contiguous)
    out = new_output((B, HQ, D), q.dtype, q.device)
    if B == 0:
        return out
    G = HQ // HKV
    block_j = min(32, D)
    launch(_rotate_query_kernel, (B * HKV, D // block_j), [
        q, P, out, HKV, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        G, triton.next_power_of_2(G), D, block_j,
    ], dict(num_warps=4))
    return out


def rotate_query_fast(q: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``q P`` per KV head with the kernel where it fits (fp32 basis, power-of-two D >= 16), the
    reference otherwise (contiguous [B, HQ, D] in q's dtype either way)."""
    _check(q, P)
    if not _kernel_fits(q, P):
        return rotate_query_reference(q, P).contiguous()
    return rotate_query_triton(q, P)


@torch.library.custom_op("loki::rotate_query", mutates_args=(), device_types="cuda")
def rotate_query_op(q: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``q P`` per KV head (q [B, HQ, D], P [HKV, D, D] fp32) -> [B, HQ, D] in q's dtype: on CUDA
    :func:`rotate_query_fast`, on the CPU the reference."""
    return rotate_query_fast(q, P)


@rotate_query_op.register_kernel("cpu")
def _rotate_query_cpu(q, P):
    return rotate_query_reference(q, P).contiguous()


@rotate_query_op.register_fake
def _(q, P):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
