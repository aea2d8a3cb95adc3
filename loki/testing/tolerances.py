"""The one tolerance table: errors are judged relative to the reference's own error (flash-attention's rule).

A result computed at input precision is compared with the float64 reference; it passes when its error is
at most ``FACTOR`` times the error of the same PyTorch math run at input precision, plus a small
absolute floor per dtype (for cases where the reference's own error happens to be ~0).
"""

from __future__ import annotations

import torch

__all__ = ["ATOL", "FACTOR", "max_error", "assert_close_to_reference"]

FACTOR = 2.0
ATOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 8e-3,
}


def max_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).abs().max()) if x.numel() else 0.0


def assert_close_to_reference(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, dtype: torch.dtype,
                              what: str = "output") -> None:
    """out and ref_lowp at input precision, ref64 the float64 reference of the same math."""
    assert out.shape == ref64.shape, f"{what}: shape {list(out.shape)} != reference {list(ref64.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output?)"
    err = max_error(out, ref64)
    base = max_error(ref_lowp, ref64)
    bound = FACTOR * base + ATOL[dtype]
    assert err <= bound, f"{what}: max error {err:.3g} > {FACTOR} x reference error {base:.3g} + atol {ATOL[dtype]:.1g}"
