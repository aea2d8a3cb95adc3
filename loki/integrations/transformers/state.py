"""The state of one enabled model (:class:`LokiState`): its resolved settings (``loki.settings``), the basis
transforms of every layer (:class:`Transforms`), the forward in progress (its :class:`~.step.StepPlan`), the
kernels' :class:`~loki.kernels.plan.DecodeRun`, the hooks, and the caches it stores keys in; and the errors.

The state hangs off the model in one attribute, ``_loki`` (the model and each of its attention modules, which the
attention function receives); nothing else of Loki is set on transformers objects.

Shape letters: L decoder layers, HKV key/value heads, D head dim.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from loki._checks import CacheOverflowError
from loki.settings import Method, ResolvedSettings

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CacheOverflowError",
    "CacheOwner",
    "LayerTransforms",
    "LokiError",
    "LokiState",
    "METHODS",
    "UnsupportedModelError",
    "state_of",
]

#: The name registered with ``AttentionInterface``.
ATTN_IMPLEMENTATION = "loki"
#: Decode-time methods selectable with ``method=`` (:class:`loki.settings.Method`).
METHODS = tuple(m.value for m in Method)


class LokiError(RuntimeError):
    """Loki attention was used in a way it does not support."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one Loki supports."""


class LayerTransforms(NamedTuple):
    """The transforms of one layer, [HKV, D, D] fp32 each (None for methods that read keys in their own
    coordinates): ``key`` P_k (``K_hat = K P_k``, stored in the cache), ``query`` P_q (``q_hat = q P_q``; P_k itself
    for an orthogonal PCA basis, the dual of P_k for a score-aware pair, ``P_q P_k^T = I``) and ``inverse``
    (``K = K_hat inverse``: ``P_q^T``, which is ``P_k^T`` for an orthogonal basis); ``score_dims``: [HKV] int64,
    the dims each KV head scores on where the basis allocates them (:mod:`loki.calibration.allocation`; the
    evaluation engine only), else None."""

    key: torch.Tensor | None
    query: torch.Tensor | None
    inverse: torch.Tensor | None
    score_dims: torch.Tensor | None = None


class Transforms:
    """The basis of an enabled model, ``[L, HKV, D, D]`` (key transforms, and the query transforms of a score-aware
    pair), as :class:`LayerTransforms` per layer and device (fp32, contiguous, made once per device)."""

    def __init__(self, key: torch.Tensor | None, query: torch.Tensor | None, score_dims: torch.Tensor | None = None):
        self.key, self.query, self.score_dims = key, query, score_dims
        self._per_device: dict = {}

    def layer(self, idx: int, device=None) -> LayerTransforms:
        if self.key is None:
            return LayerTransforms(None, None, None)
        dev = self.key.device if device is None else torch.device(device)
        per = self._per_device.get(dev)
        if per is None:
            key = self.key.to(device=dev, dtype=torch.float32).contiguous()
            query = key if self.query is None else self.query.to(device=dev, dtype=torch.float32).contiguous()
            dims = None if self.score_dims is None else self.score_dims.to(dev)
            per = (key, query, query.transpose(-1, -2).contiguous(), dims)
            self._per_device[dev] = per
        return LayerTransforms(per[0][idx], per[1][idx], per[2][idx], None if per[3] is None else per[3][idx])


class CacheOwner:
    """Identifies the ``enable_loki`` call whose basis the keys of a cache layer are stored in.  Copies of a cache
    (``copy.deepcopy``) share it, so they learn when Loki was disabled."""

    __slots__ = ("active", "in_forward")

    def __init__(self):
        self.active = True
        self.in_forward = False  # inside a forward of the model: its step plan checked this forward's writes

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclass(eq=False)
class LokiState:
    """The run-time state of one enabled model (``model._loki``, shared by its attention modules)."""

    settings: ResolvedSettings
    transforms: Transforms
    previous_implementation: str | None = None
    covered_positions: int | None = None  # the basis was fitted on positions below this (None: unknown)
    # the forward in progress: its cache (None without one) and its step plan (what every layer's rows see)
    cache: Any = field(default=None, repr=False)
    plan: Any = field(default=None, repr=False)
    # the kernels' record-and-replay object of this model (``loki.kernels.plan.DecodeRun``), made at first use
    decode_run: Any = field(default=None, repr=False)
    warned: set = field(default_factory=set, repr=False)  # the one-time warnings given ("positions", "reference")
    handles: list = field(default_factory=list, repr=False)
    owner: CacheOwner = field(default_factory=CacheOwner, repr=False)
    caches: list = field(default_factory=list, repr=False)  # weak references to the caches adopted

    def remember_cache(self, cache) -> None:
        """Keep a weak reference to a cache whose layers store keys under these settings (``disable_loki``
        restores it)."""
        if not any(r() is cache for r in self.caches):
            self.caches[:] = [r for r in self.caches if r() is not None]
            self.caches.append(weakref.ref(cache))

    def warn_once(self, what: str, message: str, stacklevel: int = 3) -> None:
        if what not in self.warned:
            import warnings

            self.warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def state_of(model) -> LokiState:
    """The :class:`LokiState` of an enabled model (``LokiError`` when Loki is not enabled on it)."""
    state = getattr(model, "_loki", None)
    if state is None:
        raise LokiError("Loki is not enabled on this model (call enable_loki first)")
    return state
