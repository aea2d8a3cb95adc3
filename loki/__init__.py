"""Loki: low-rank-key sparse attention (Singhania et al., NeurIPS 2024).

The user API: :func:`calibrate` fits a :class:`PCABasis` of a model's keys, :func:`enable_loki` /
:func:`disable_loki` switch a Hugging Face model to Loki attention, and :func:`decode_attention` is one Loki
decode step on keys stored in the basis.  The PyTorch references of every method live in ``loki.reference``,
the Triton kernels in ``loki.kernels``, calibration in ``loki.calibration``, the evaluation in
``loki.evaluation``.

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
    from .kernels import decode_attention

# Imported on first use (PEP 562), so that `import loki` (and `loki --help`) does not import torch.
_EXPORTS = {
    "PCABasis": ".basis",
    "calibrate": ".calibration",
    "decode_attention": ".kernels",
    "disable_loki": ".integrations.transformers",
    "enable_loki": ".integrations.transformers",
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
    "PCABasis",
    "__version__",
    "calibrate",
    "decode_attention",
    "disable_loki",
    "enable_loki",
]
