"""What a basis file and its calibration statistics must satisfy, apart from the basis itself: the basis error,
the heads whose calibration data determine no basis (:func:`constant_heads`) and whether a file is a basis file
(:func:`is_basis_file`).  Re-exported by :mod:`loki.basis`.

Shape letters: L = decoder layers, HKV = key/value heads.
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["BasisError", "constant_heads", "is_basis_file"]

_META_KEY = "loki.basis"
_FORMAT = "loki.pca_basis.v1"


class BasisError(ValueError):
    """A PCA basis is malformed, unreadable, or does not belong to the model it is used with."""


def constant_heads(stats, what: str = "keys", rel_tol: float = 1e-10) -> torch.Tensor:
    """``[L, HKV]`` bool: the heads of ``stats`` (:class:`~loki.calibration.stats.KeyStatistics`) whose ``what``
    have no variance (constant vectors, or a single token), where no basis is determined by the data; calibration
    gives them the identity (any orthonormal basis ranks tokens with equal keys alike) and warns, naming them.

    Raises:
        BasisError: the statistics hold NaN or inf (naming the first layer and KV head), or no head has any
            variance (too little calibration data: nothing would be fitted at all).
    """
    try:
        stats.check_finite(what)
    except ValueError as exc:
        raise BasisError(str(exc)) from None
    mask = stats.constant_heads(rel_tol)
    if bool(mask.all()):
        raise BasisError(f"no layer or KV head has any variance in its calibration {what} ({stats.num_tokens} "
                         "token(s) seen, constant in every head): calibrate on more, varied text")
    if bool(mask.any()):
        heads = [(int(l), int(h)) for l, h in mask.nonzero()]
        shown = ", ".join(f"layer {l} KV head {h}" for l, h in heads[:4])
        more = f" and {len(heads) - 4} more" if len(heads) > 4 else ""
        warnings.warn(f"constant calibration {what} (no variance) in {shown}{more}: these heads get the identity "
                      "basis (all their tokens score alike, so any basis selects equally well)", RuntimeWarning,
                      stacklevel=3)
    return mask


def is_basis_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file written by :meth:`PCABasis.save` (a safetensors file whose metadata carries the
    basis format); reads the header only.  Model weights and any other file give False."""
    from safetensors import safe_open

    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # not a safetensors file, unreadable, a folder, ...
        return False
    return meta.get("loki.format") == _FORMAT or _META_KEY in meta
