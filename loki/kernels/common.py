"""Helpers shared by the Triton kernels' host code: whether Triton runs in the CPU interpreter and the device
check (both from ``loki._checks``), the device's multiprocessor count, and the tile-size rules that more than one
kernel follows.

Imports nothing else of ``loki.kernels`` (``launch`` and every kernel module import it).
"""

from __future__ import annotations

import torch

from loki._checks import check_triton_device
from loki._checks import triton_interpreting as interpreting
from loki._triton import triton

__all__ = ["NUM_SMS_DEFAULT", "check_triton_device", "interpreter_tile", "interpreting", "key_block", "num_sms"]

#: Multiprocessors assumed where no CUDA device is asked (the interpreter, rules evaluated on the CPU): an
#: H100 SXM, the GPU the launch rules were measured on (docs/kernels.md).
NUM_SMS_DEFAULT = 132
_SMS: dict = {}


def num_sms(device) -> int:
    """Multiprocessor count of a CUDA device (cached; :data:`NUM_SMS_DEFAULT` for any other device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return NUM_SMS_DEFAULT
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


def key_block(block_d: int, contiguous_rows: bool) -> int:
    """Keys per program step of the score kernels (``approx_scores``, ``score_select``) on a GPU: 16 KB of bf16
    keys from a prefix buffer of exactly d dims (one contiguous stream), else 128 rows (64 when the padded d
    exceeds 64) read in place."""
    if contiguous_rows:
        return max(16, 8192 // block_d)
    return 128 if block_d <= 64 else 64


def interpreter_tile(n: int, cap: int, minimum: int = 1) -> int:
    """A tile over all ``n`` elements under the interpreter (a power of two in ``[minimum, cap]``): the CPU
    interpreter runs few large tiles much faster than many small ones."""
    return min(cap, max(minimum, triton.next_power_of_2(n)))
