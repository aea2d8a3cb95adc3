"""The order-preserving uint32 key of an fp32 score, shared by the Triton selects (``select.py``, the one
program per row select, and ``select_split.py``, the select split over several programs per row).

Imports nothing of ``loki.kernels`` (both selects import it).
"""

from __future__ import annotations

from loki._triton import tl, triton

__all__: list[str] = []


@triton.jit
def _ordered_key(x):
    """fp32 -> uint32 with the same order: flip all bits of negatives, set the sign bit of non-negatives.
    -0.0 is first mapped to +0.0 (equal scores tie) and every NaN to the canonical +NaN (above +inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = tl.full(x.shape, 1, tl.uint32) << 31
    bits = tl.where(bits == sign, tl.zeros(x.shape, tl.uint32), bits)  # -0.0 -> +0.0
    bits = tl.where(x != x, tl.full(x.shape, 0x7FC00000, tl.uint32), bits)  # NaN -> +NaN
    flip = tl.where((bits & sign) != 0, tl.full(x.shape, 0xFFFFFFFF, tl.uint32), sign)
    return bits ^ flip
