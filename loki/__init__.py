"""Loki: low-rank-key sparse attention (Singhania et al., NeurIPS 2024).

The user API: :func:`calibrate` fits a :class:`PCABasis` of a model's keys, :func:`enable_loki` /
:func:`disable_loki` switch a Hugging Face model to Loki attention (settings in one :class:`LokiSettings`, every
"auto" decided once), :func:`loki_cache` makes a KV cache for it (dynamic, or static for ``torch.compile``), and
:func:`decode_attention` is one Loki decode step on keys stored in the basis.  The PyTorch references of every
method live in ``loki.reference``, the Triton kernels in ``loki.kernels``, calibration in ``loki.calibration``, the
evaluation in ``loki.evaluation``.

Importing ``loki`` never probes a device (the device is resolved when a kernel launches) and does not import
transformers.
"""

from ._version import __version__
from .basis import PCABasis
from .calibration import calibrate
from .integrations.transformers import disable_loki, enable_loki
from .kernels import decode_attention
from .settings import LokiSettings

__all__ = [
    "LokiSettings",
    "PCABasis",
    "__version__",
    "calibrate",
    "decode_attention",
    "disable_loki",
    "enable_loki",
    "loki_cache",
]


def __getattr__(name):  # loki_cache's module imports transformers: loaded when first asked for
    if name == "loki_cache":
        from .integrations.transformers.layers import loki_cache

        return loki_cache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
