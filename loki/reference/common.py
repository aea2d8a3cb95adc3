"""Building blocks shared by the reference methods: rotation into a PCA basis, gathers, masked softmax.

Shape letters: B batch, HQ query heads, HKV key/value heads (G = HQ // HKV query heads per group),
S cache length, D head dim, K selected tokens, H either HQ or HKV (a selection's head axis).
"""

from __future__ import annotations

import torch

from .._checks import resolve_scale

__all__ = ["rotate_query", "rotate_keys", "gather_rows", "expand_to_query_heads", "default_scale"]


def default_scale(D: int, scale: float | None) -> float:
    """The attention scale: ``1/sqrt(D)`` unless given (Loki uses the full head dim, never d); a given scale
    must be a finite number > 0 (``loki._checks.resolve_scale``)."""
    return resolve_scale(scale, D)


def _check_basis(P: torch.Tensor, HKV: int, D: int, name: str) -> None:
    if P.dim() != 3 or P.shape[0] != HKV or P.shape[1] != D or P.shape[2] != D:
        raise ValueError(f"{name} must have shape [HKV, D, D]=[{HKV}, {D}, {D}], got {list(P.shape)}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Rotations run in fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def rotate_query(q: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """q_hat = q P, each query head rotated with the basis of its KV head.

    q: [B, HQ, D]; P: [HKV, D, D] (columns are principal directions) -> q_hat: [B, HQ, D] in q's dtype.
    """
    B, HQ, D = q.shape
    HKV = P.shape[0]
    _check_basis(P, HKV, D, "P")
    if HQ % HKV:
        raise ValueError(f"query heads HQ={HQ} must be a multiple of the basis' KV heads HKV={HKV}")
    ct = _compute_dtype(q)
    qf = q.to(ct).view(B, HKV, HQ // HKV, D)
    return torch.einsum("bhgd,hde->bhge", qf, P.to(ct)).reshape(B, HQ, D).to(q.dtype)


def rotate_keys(k: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """K_hat = K P per KV head. k: [B, HKV, S, D] (or [B, HKV, D]); P: [HKV, D, D] -> same shape as k."""
    HKV, D = k.shape[1], k.shape[-1]
    _check_basis(P, HKV, D, "P")
    ct = _compute_dtype(k)
    # contiguous: einsum returns the head-major layout of its batched product, and a cache that keeps such a
    # tensor pays for it on every append (a strided torch.cat) and every kernel read
    if k.dim() == 3:
        return torch.einsum("bhd,hde->bhe", k.to(ct), P.to(ct)).to(k.dtype).contiguous()
    return torch.einsum("bhsd,hde->bhse", k.to(ct), P.to(ct)).to(k.dtype).contiguous()


def expand_to_query_heads(x: torch.Tensor, HQ: int) -> torch.Tensor:
    """Repeat a per-KV-head tensor [B, HKV, ...] to per-query-head [B, HQ, ...] (GQA)."""
    HKV = x.shape[1]
    if HKV == HQ:
        return x
    return x.repeat_interleave(HQ // HKV, dim=1)


def gather_rows(cache: torch.Tensor, idx: torch.Tensor, HQ: int) -> torch.Tensor:
    """Rows of a cache picked per query head, without expanding the cache over query heads.

    cache: [B, HKV, S, D]; idx: [B, H, K] with H in {HQ, HKV} (entries < 0 are padding and read row 0)
    -> [B, HQ, K, D].
    """
    B, HKV, S, D = cache.shape
    H, K = idx.shape[1], idx.shape[2]
    G = HQ // HKV
    if H == HKV:
        idx = expand_to_query_heads(idx, HQ)
    elif H != HQ:
        raise ValueError(f"idx has {H} heads; expected HQ={HQ} or HKV={HKV}")
    safe = idx.clamp(min=0).reshape(B, HKV, G * K)
    rows = torch.gather(cache, 2, safe[..., None].expand(B, HKV, G * K, D))
    return rows.reshape(B, HQ, K, D)
