"""Loki: low-rank-key sparse attention (Singhania et al., NeurIPS 2024).

Importing ``loki`` never probes a device: the references live in ``loki.reference``, the Triton kernels
in ``loki.kernels`` (the device is resolved when a kernel launches), calibration in ``loki.calibration``.
"""

from ._version import __version__
from .reference import (
    dense_attention,
    exact_topk_attention,
    h2o_attention,
    loki_attention,
    pcaattn_attention,
    rotate_keys,
    rotate_query,
    sparq_attention,
)

__all__ = [
    "__version__",
    "dense_attention",
    "exact_topk_attention",
    "h2o_attention",
    "loki_attention",
    "pcaattn_attention",
    "rotate_keys",
    "rotate_query",
    "sparq_attention",
]
