"""Top-k selection by FlashInfer's radix top-k (``flashinfer.top_k``): the optional, opt-in backend of
``select_topk(method="flashinfer")`` (never chosen by ``method="auto"``; the decode step does not take it).

Needs the ``flashinfer-python`` package (not a dependency of Loki; its kernels compile on first use and run on
CUDA tensors).  :func:`flashinfer_topk_available` tries the import once, the first time it is called; importing
this module imports nothing of FlashInfer and touches no device.

Semantics are the project's (``loki.reference.selection.topk_indices``): the positions of the counts[b] largest
scores of every row, ties to the lowest position, -0.0 == +0.0, NaN above +inf, -1 after counts[b].  What FlashInfer
gives (read in its 0.6.13 source, ``include/flashinfer/topk.cuh``):

- ``tie_break=TopKTieBreak.SMALL`` (implies ``deterministic=True``) takes the lowest indices among scores equal to
  the k-th largest.  It runs only the single-block "FilteredTopK" kernel, which takes k <= 2048
  (``FILTERED_TOPK_MAX_K``; a larger k fails with ``cudaErrorNotSupported``) and 128 KB of shared memory per block;
  hence :data:`FLASHINFER_MAX_K`.
- Its order of scores is that of the raw bits (flip every bit of a negative, set the sign bit of a
  non-negative): -0.0 ranks strictly below +0.0, a NaN with the sign bit set below -inf, and NaNs of different
  payloads differ.  So the scores are first copied with -0.0 written as +0.0 and every NaN as the one +NaN
  (``canonicalize=True``, one pass over the scores); after that the bit order is the project's order.
- Deterministic mode sorts the selected indices in ascending order, and ``sorted=True`` then applies a stable sort
  by value: (value descending, index ascending), the project's selection order.  With counts below K the first
  counts[b] entries of the sorted top-K are therefore the row's top counts[b] (the top counts[b] of a strict total
  order are a prefix of its top K); the rest are written -1.  With ``uniform=True`` (every count equals K) the
  unsorted selection is enough.
- Capture in a CUDA graph: FlashInfer compiles its kernels on the first call and allocates a cached 1 MB scratch
  buffer then, so call once outside the capture (as for the Triton kernels).

Shape letters: B batch, H the selection's head axis, S cache length, K the selection width (>= max(counts)).
"""

from __future__ import annotations

import functools

import torch

from loki._triton import tl, triton

from .common import interpreter_tile, interpreting
from .launch import launch, new_output

__all__ = ["FLASHINFER_MAX_K", "flashinfer_topk_available", "require_flashinfer", "select_topk_flashinfer"]

#: The largest selection width of FlashInfer's tie-break path (``FILTERED_TOPK_MAX_K`` in its topk.cuh).
FLASHINFER_MAX_K = 2048
#: Scores per program of the canonicalising copy on a GPU.
_COPY_BLOCK = 4096


@functools.cache
def _load():
    """(the flashinfer module, None) when it imports and its top_k takes a tie rule, else (None, why not)."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any failure to import (missing package, CUDA or JIT dependencies)
        return None, f"{type(e).__name__}: {e}"
    topk = getattr(flashinfer, "topk", None)
    if not callable(getattr(flashinfer, "top_k", None)) or not hasattr(topk, "TopKTieBreak"):
        version = getattr(flashinfer, "__version__", "unknown")
        return None, f"flashinfer {version} has no top_k with a tie_break argument (flashinfer.topk.TopKTieBreak)"
    return flashinfer, None


def flashinfer_topk_available() -> bool:
    """Whether ``flashinfer`` imports and has ``top_k(..., tie_break=...)`` (the import is tried once and cached;
    nothing else is checked: no device is queried and nothing is compiled)."""
    return _load()[0] is not None


def require_flashinfer():
    """The flashinfer module, or an ImportError that names the method and says why it is not usable."""
    fi, why = _load()
    if fi is None:
        raise ImportError(
            "select_topk(method='flashinfer') needs the flashinfer-python package (a version whose top_k takes "
            f"tie_break; written against 0.6.13), which is not usable here ({why}); use method='triton' or "
            "method='auto' instead")
    return fi


@triton.jit
def _canonical_copy_kernel(src_ptr, dst_ptr, S, H, stride_b, stride_h, BLOCK: tl.constexpr):
    """dst[row, :] = src[b, h, :] with -0.0 written as +0.0 and every NaN as +NaN (0x7FC00000); dst contiguous."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < S
    x = tl.load(src_ptr + (row // H) * stride_b + (row % H) * stride_h + offs, mask=m, other=0.0)
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == (tl.full(x.shape, 1, tl.uint32) << 31), tl.zeros(x.shape, tl.uint32), bits)
    bits = tl.where(x != x, tl.full(x.shape, 0x7FC00000, tl.uint32), bits)
    tl.store(dst_ptr + row * S + offs, bits.to(tl.float32, bitcast=True), mask=m)


def _rows(scores: torch.Tensor, canonicalize: bool) -> torch.Tensor:
    """The scores as FlashInfer reads them: contiguous [B*H, S] rows on a 16-byte boundary (its vector loads),
    canonicalised (a new buffer) when asked."""
    B, H, S = scores.shape
    if canonicalize:
        rows = torch.empty(B * H, S, dtype=torch.float32, device=scores.device)
        if scores.stride(-1) != 1:
            scores = scores.contiguous()
        block = interpreter_tile(S, 1 << 16) if interpreting() else _COPY_BLOCK
        launch(_canonical_copy_kernel, (B * H, triton.cdiv(S, block)),
               [scores, rows, S, H, scores.stride(0), scores.stride(1), block], {})
        return rows
    if not scores.is_contiguous() or scores.data_ptr() % 16:
        scores = scores.contiguous() if not scores.is_contiguous() else scores.clone()
    return scores.view(B * H, S)


def select_topk_flashinfer(scores: torch.Tensor, counts: torch.Tensor, K: int, *, uniform: bool = False,
                           canonicalize: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """idx [B, H, K] int32: the positions of the ``counts[b]`` largest scores of every row by ``flashinfer.top_k``
    (``deterministic=True``, ``tie_break=TopKTieBreak.SMALL``), -1 after counts[b] (a count above K keeps K).

    scores: [B, H, S] fp32 on a CUDA device (-inf marks tokens that may not be chosen); counts: [B] int on the same
    device, 1 <= counts[b] <= the finite scores of each row of batch b; K: 1 <= K <= min(S, :data:`FLASHINFER_MAX_K`).
    ``uniform=True`` promises every count equals K (then the unsorted top-K is taken and no padding written;
    otherwise the top-K sorted by score, whose first counts[b] entries are kept).  ``canonicalize`` (default True):
    copy the scores with -0.0 as +0.0 and every NaN as +NaN first, for the project's order of equal zeros and NaN;
    False skips that pass when the caller knows the scores hold neither (FlashInfer then ranks +0.0 above -0.0).
    ``out``: an optional contiguous int32 [B, H, K] tensor to write.  Order within a row: unspecified with
    ``uniform``, by decreasing score otherwise.  Raises ImportError when flashinfer is not usable.
    """
    fi = require_flashinfer()
    if scores.dim() != 3:
        raise ValueError(f"scores must have shape [B, H, S], got {list(scores.shape)}")
    if scores.dtype != torch.float32:
        raise TypeError(f"select_topk(method='flashinfer') takes fp32 scores, got {scores.dtype}")
    B, H, S = scores.shape
    if not 1 <= K <= min(S, FLASHINFER_MAX_K):
        raise ValueError(f"k_max={K} must lie in [1, min(S={S}, {FLASHINFER_MAX_K})] for method='flashinfer' "
                         f"(FlashInfer's top_k with a tie rule selects at most {FLASHINFER_MAX_K} per row); "
                         "use method='triton' for more")
    if out is not None and (out.shape != (B, H, K) or out.dtype != torch.int32 or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous int32 tensor of shape [B, H, K]=[{B}, {H}, {K}]")
    idx = out if out is not None else new_output((B, H, K), torch.int32, scores.device)
    if B * H == 0:
        return idx
    _, top = fi.top_k(_rows(scores, canonicalize), K, sorted=not uniform, deterministic=True,
                      tie_break=fi.topk.TopKTieBreak.SMALL)
    idx.copy_(top.view(B, H, K))
    if not uniform:
        pad = torch.arange(K, device=scores.device) >= counts.to(scores.device)[:, None, None]  # [B, 1, K]
        idx.masked_fill_(pad, -1)
    return idx
