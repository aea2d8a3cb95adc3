"""Loki: low-rank-key sparse attention (Singhania et al., NeurIPS 2024).

The user API: :func:`calibrate` fits a :class:`PCABasis` of a model's keys, :func:`enable_loki` /
:func:`disable_loki` switch a Hugging Face model to Loki attention (settings in one :class:`LokiSettings`, every
"auto" decided once), :func:`loki_cache` makes a KV cache for it (dynamic, or static for ``torch.compile``), and
:func:`decode_attention` is one Loki decode step on keys stored in the basis.  The PyTorch references of every
method live in ``loki.reference``, the Triton kernels in ``loki.kernels``, calibration in ``loki.calibration``, the
evaluation in ``loki.evaluation``.

Importing ``loki`` never probes a device (the device is resolved when a kernel launches) and imports neither
torch nor transformers: the names above are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:
    from .basis import PCABasis
    from .calibration import calibrate
    from .integrations.transformers import disable_loki, enable_loki
    from .integrations.transformers.caches import loki_cache
    from .kernels import decode_attention
    from .settings import LokiSettings

# Imported on first use (PEP 562), so that `import loki` (and `loki --help`) does not import torch.
_EXPORTS = {
    "LokiSettings": ".settings",
    "PCABasis": ".basis",
    "calibrate": ".calibration",
    "decode_attention": ".kernels",
    "disable_loki": ".integrations.transformers",
    "enable_loki": ".integrations.transformers",
    "loki_cache": ".integrations.transformers.caches",  # imports transformers
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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

