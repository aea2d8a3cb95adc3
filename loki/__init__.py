"""Loki: low-rank-key sparse attention (Singhania et al., NeurIPS 2024).

The user API: :func:`calibrate` fits a :class:`PCABasis` of a model's keys, :func:`enable_loki` /
:func:`disable_loki` switch a Hugging Face model to Loki attention, and :func:`decode_attention` is one Loki
decode step on keys stored in the basis.  The PyTorch references of every method live in ``loki.reference``,
the Triton kernels in ``loki.kernels``, calibration in ``loki.calibration``, the evaluation in
``loki.evaluation``.

Importing ``loki`` never probes a device (the device is resolved when a kernel launches) and does not import
transformers.
"""

from ._version import __version__
from .basis import PCABasis
from .calibration import calibrate
from .integrations.transformers import disable_loki, enable_loki
from .kernels import decode_attention

__all__ = [
    "PCABasis",
    "__version__",
    "calibrate",
    "decode_attention",
    "disable_loki",
    "enable_loki",
]
