"""The settings of an enabled model (:class:`LokiConfig`, frozen) apart from its run-time state (:class:`LokiState`:
the basis per device, the cache of the current forward, the hooks and the caches converted), and the errors.

Shape letters: L decoder layers, HKV key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BACKENDS",
    "BASIS_METHODS",
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
METHODS = ("loki", "exact_topk", "pcaattn", "dense", "sparq", "h2o")
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


class CacheOwner:
    """Identifies the ``enable_loki`` call whose basis the keys of a cache layer are stored in.  Copies of a cache
    (``copy.deepcopy``) share it, so they learn when Loki was disabled."""

    __slots__ = ("active",)

    def __init__(self):
        self.active = True

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclass(eq=False)
class LokiState:
    """The run-time state of one enabled model, ``model._loki_config`` (shared by its attention modules): its
    :class:`LokiConfig` and what changes while it runs."""

    config: LokiConfig
    # Per forward call: the cache being used (set by the pre-hook), or None without a cache, and the row
    # intervals computed per attention mask.
    current_cache: Any = field(default=None, repr=False)
    intervals_cache: dict | None = field(default=None, repr=False)
    warned_positions: bool = False  # the warning about keys past covered_positions was given
    handles: list = field(default_factory=list, repr=False)
    # The token every cache layer converted under these settings points to (inactive after disable_loki), and
    # weak references to the caches converted, which disable_loki restores.
    owner: CacheOwner = field(default_factory=CacheOwner, repr=False)
    caches: list = field(default_factory=list, repr=False)
    _per_device: dict = field(default_factory=dict, repr=False)

    def layer_basis(self, layer_idx: int, device: torch.device) -> torch.Tensor | None:
        """P (the key transform) of one layer, [HKV, D, D] fp32 on ``device`` (cached per device)."""
        return self._on_device("keys", self.config.components, layer_idx, device)

    def layer_query_basis(self, layer_idx: int, device: torch.device) -> torch.Tensor | None:
        """The query transform of one layer: P_q of a score basis, else P itself (orthogonal)."""
        if self.config.query_components is None:
            return self.layer_basis(layer_idx, device)
        return self._on_device("queries", self.config.query_components, layer_idx, device)

    def _on_device(self, which, tensor, layer_idx, device):
        if tensor is None:
            return None
        comps = self._per_device.get((which, device))
        if comps is None:
            comps = tensor.to(device=device, dtype=torch.float32)
            self._per_device[(which, device)] = comps
        return comps[layer_idx]


def state_of(model) -> LokiState:
    """The :class:`LokiState` of an enabled model (``LokiError`` when Loki is not enabled on it)."""
    state = getattr(model, "_loki_config", None)
    if state is None:
        raise LokiError("Loki is not enabled on this model (call enable_loki first)")
    return state
