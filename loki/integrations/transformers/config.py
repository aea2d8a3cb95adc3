"""The settings of an enabled model (:class:`LokiConfig`, frozen) apart from its run-time state (:class:`LokiState`:
the basis per device, the cache of the current forward, the hooks and the caches converted), and the errors.

Shape letters: L decoder layers, HKV key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from loki._checks import CacheOverflowError

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BACKENDS",
    "BASIS_METHODS",
    "CacheOverflowError",
    "LayerTransforms",
    "METHODS",
    "SEMANTICS",
    "LokiConfig",
    "LokiError",
    "LokiState",
    "UnsupportedModelError",
    "state_of",
]

#: The name registered with ``AttentionInterface`` / ``AttentionMaskInterface``.
ATTN_IMPLEMENTATION = "loki"
#: Decode-time methods selectable with ``method=``.
METHODS = ("loki", "exact_topk", "pcaattn", "dense", "sparq", "h2o", "quest")
#: Methods that need the PCA basis (they read the rotated cache).
BASIS_METHODS = ("loki", "pcaattn")
SEMANTICS = ("generate", "decode")
BACKENDS = ("auto", "torch", "triton")


class LokiError(RuntimeError):
    """Loki attention was used in a way it does not support."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one Loki supports."""


@dataclass(frozen=True, eq=False)
class LokiConfig:
    """The settings of one enabled model (see :func:`~loki.integrations.transformers.enable_loki`), fixed
    for as long as it stays enabled."""

    method: str
    k: int | float
    d: int | float
    gqa_select: str = "query"
    aggregate: str = "sum"
    backend: str = "auto"
    semantics: str = "generate"
    h2o_recent_fraction: float = 0.5
    # score entries of one block of rows in the teacher-forced path (None: loki.reference.teacher_forced's
    # default for the device)
    chunk_elements: int | None = None
    prefix_dims: int | None = None  # d of the contiguous key-prefix buffer kept for the Triton path (None: none)
    components: torch.Tensor | None = field(default=None, repr=False)  # [L, HKV, D, D] fp32 (the basis)
    query_components: torch.Tensor | None = field(default=None, repr=False)  # [L, HKV, D, D] of a score basis
    previous_implementation: str | None = None
    covered_positions: int | None = None  # the basis was fitted on positions below this (None: unknown)

    @property
    def rotates(self) -> bool:
        return self.method in BASIS_METHODS


class LayerTransforms(NamedTuple):
    """The transforms of one layer, [HKV, D, D] fp32 each (None for methods that read keys in their own
    coordinates): ``key`` P_k (``K_hat = K P_k``, stored in the cache), ``query`` P_q (``q_hat = q P_q``; P_k itself
    for an orthogonal PCA basis, the dual of P_k for a score-aware pair, ``P_q P_k^T = I``) and ``inverse``
    (``K = K_hat inverse``: ``P_q^T``, which is ``P_k^T`` for an orthogonal basis)."""

    key: torch.Tensor | None
    query: torch.Tensor | None
    inverse: torch.Tensor | None


class CacheOwner:
    """Identifies the ``enable_loki`` call whose basis the keys of a cache layer are stored in.  Copies of a cache
    (``copy.deepcopy``) share it, so they learn when Loki was disabled."""

    __slots__ = ("active", "in_forward")

    def __init__(self):
        self.active = True
        self.in_forward = False  # set by the decoder's hooks: the step metadata checked this forward's writes

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclass(eq=False)
class LokiState:
    """The run-time state of one enabled model, ``model._loki_config`` (shared by its attention modules): its
    :class:`LokiConfig` and what changes while it runs."""

    config: LokiConfig
    # Per forward call: the cache being used (set by the pre-hook), or None without a cache, and the step
    # metadata of the forward (``metadata.ForwardMetadata``: every layer's row ranges and budgets).
    current_cache: Any = field(default=None, repr=False)
    forward: Any = field(default=None, repr=False)
    warned_positions: bool = False  # the warning about keys past covered_positions was given
    warned_compiled_reference: bool = False  # the warning about the reference in a compiled step
    handles: list = field(default_factory=list, repr=False)
    # The token every cache layer converted under these settings points to (inactive after disable_loki), and
    # weak references to the caches converted, which disable_loki restores.
    owner: CacheOwner = field(default_factory=CacheOwner, repr=False)
    caches: list = field(default_factory=list, repr=False)
    _per_device: dict = field(default_factory=dict, repr=False)

    def transforms(self, layer_idx: int, device: torch.device | None = None) -> LayerTransforms:
        """The key, query and inverse transforms of one layer (:class:`LayerTransforms`), fp32 on ``device`` (the
        config's device when None; cached per device).  The one place every path (dynamic and static caches,
        torch and Triton, cache conversion and restoration) takes them from."""
        cfg = self.config
        if cfg.components is None:
            return LayerTransforms(None, None, None)
        dev = cfg.components.device if device is None else torch.device(device)
        per = self._per_device.get(dev)
        if per is None:
            key = cfg.components.to(device=dev, dtype=torch.float32).contiguous()
            query = key if cfg.query_components is None else cfg.query_components.to(
                device=dev, dtype=torch.float32).contiguous()
            per = (key, query, query.transpose(-1, -2).contiguous())
            self._per_device[dev] = per
        return LayerTransforms(per[0][layer_idx], per[1][layer_idx], per[2][layer_idx])


def state_of(model) -> LokiState:
    """The :class:`LokiState` of an enabled model (``LokiError`` when Loki is not enabled on it)."""
    state = getattr(model, "_loki_config", None)
    if state is None:
        raise LokiError("Loki is not enabled on this model (call enable_loki first)")
    return state
