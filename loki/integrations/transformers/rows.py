"""Query rows of an attention call: the rows rotated into the basis (with the layer's query transform), and
whether a step runs on the Triton kernels.  What each row sees comes from the step metadata (:mod:`.metadata`).

Shape letters: B batch, HQ query heads, L query length, D head dim.
"""

from __future__ import annotations

import torch

from loki._checks import check_no_grad, check_triton_device
from loki.reference import rotate_query

from .config import LokiError

__all__ = ["check_triton_inputs", "rotate_rows", "triton_backend"]


def rotate_rows(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """x: [B, HQ, L, D] -> x P per KV head (query heads of a group share their KV head's transform)."""
    B, HQ, L, D = x.shape
    flat = x.transpose(1, 2).reshape(B * L, HQ, D)
    return rotate_query(flat, P).reshape(B, L, HQ, D).transpose(1, 2)


def triton_backend(backend: str, query: torch.Tensor) -> bool:
    """Whether a decode step with this ``backend`` setting runs the Triton kernels ("auto": on CUDA tensors that
    need no gradient; the kernels have no backward)."""
    if backend == "triton":
        return True
    return backend == "auto" and query.is_cuda and not (torch.is_grad_enabled() and query.requires_grad)


def check_triton_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """backend='triton' at forward time: a device the kernels run on, and no gradient wanted."""
    try:
        check_triton_device(query, "enable_loki(backend='triton')")
        check_no_grad("Loki's Triton decode step (enable_loki(backend='triton'))", query=query, key=key,
                      value=value)
    except RuntimeError as exc:
        raise LokiError(str(exc)) from None
