"""Which caches are Loki's: adopting a transformers cache (:func:`adopt_cache`: each of its layers replaced by the
Loki layer of its class from :mod:`.layers`, holding the same tensors, keys already written rotated once), giving
it back (:func:`restore_caches`, for ``disable_loki``: plain layers with plain keys again), and the one factory of
caches, :func:`loki_cache`.

A cache ``generate`` builds (or a caller passes) is adopted on the first forward.  This module imports
transformers; ``loki.integrations.transformers`` imports it only when a cache is made.

Shape letters: B batch, HKV key/value heads, D head dim.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from loki._hf import attention_modules, config_head_dim, config_kv_heads, config_num_layers, text_config
from loki.reference import rotate_keys
from loki.settings import Backend, Method

from .layers import LayerStore, LokiDynamicLayer, LokiSlidingWindowLayer, LokiStaticLayer
from .state import LokiError, LokiState, state_of

__all__ = ["adopt_cache", "is_adopted", "loki_cache", "restore_caches"]

_LOKI_LAYERS = (LokiDynamicLayer, LokiSlidingWindowLayer, LokiStaticLayer)
#: The plain transformers class of each Loki layer class, and back.
_PLAIN = {LokiDynamicLayer: DynamicLayer, LokiSlidingWindowLayer: DynamicSlidingWindowLayer,
          LokiStaticLayer: StaticLayer}
_LOKI_OF = {plain: loki for loki, plain in _PLAIN.items()}
_LOKI_ATTRS = ("loki", "_buffers")


def _new_store(state: LokiState, idx: int, sliding: bool) -> LayerStore:
    s = state.settings
    return LayerStore(state.owner, state.transforms.layer(idx), None if sliding else s.prefix_dims,
                      s.backend is Backend.TRITON, int8=s.int8_prefix)


def _adopt_layer(layer, state: LokiState, idx: int):
    """The Loki layer of ``layer``'s class holding its state (keys already written rotated into the basis)."""
    cls = _LOKI_OF.get(type(layer))
    if cls is None:
        raise LokiError(
            f"Loki supports the cache layers {tuple(c.__name__ for c in _LOKI_OF)} (generate's default cache, "
            f"sliding windows and cache_implementation='static'); layer {idx} of the cache is a "
            f"{type(layer).__name__}. Pass no cache, a DynamicCache, a StaticCache or loki_cache(model, ...).")
    if cls is LokiStaticLayer and state.settings.method is Method.H2O:
        raise LokiError("method='h2o' keeps per-token state that a static cache does not hold: use a DynamicCache "
                        "(no cache_implementation)")
    store = _new_store(state, idx, sliding=cls is LokiSlidingWindowLayer)
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)  # the same tensors and counters
    new.loki = store
    if cls is LokiDynamicLayer:
        new._buffers = None
    P = store.transforms.key
    keys = getattr(new, "keys", None)
    written = getattr(new, "is_initialized", False) and keys is not None and keys.numel() > 0
    if written and P is not None:
        if cls is LokiStaticLayer:
            keys.copy_(rotate_keys(keys, P.to(keys.device)))  # in place: the address stays
        else:
            new.keys = rotate_keys(keys, P.to(keys.device))
    if cls is LokiStaticLayer and getattr(new, "is_initialized", False):
        new.allocate_prefix()
    return new


def _restore_layer(layer):
    """The plain transformers layer of a Loki layer, with the same state and the keys back in their own coordinates
    (``K = K_hat P^-1``, exact up to rounding)."""
    plain = _PLAIN[type(layer)]
    new = plain.__new__(plain)
    new.__dict__.update({k: v for k, v in layer.__dict__.items() if k not in _LOKI_ATTRS})
    P_inv = layer.loki.transforms.inverse
    keys = getattr(new, "keys", None)
    if P_inv is not None and keys is not None and keys.numel() > 0:
        back = rotate_keys(keys, P_inv.to(keys.device))
        if plain is StaticLayer:
            keys.copy_(back)
        else:
            new.keys = back
    return new


def is_adopted(cache, state: LokiState, num_layers: int) -> bool:
    """Whether every layer of ``cache`` is a Loki layer of this enable call (checked on the first and last)."""
    layers = getattr(cache, "layers", None)
    if not layers or len(layers) < num_layers:
        return False
    return all(isinstance(lay, _LOKI_LAYERS) and lay.loki.owner is state.owner
               for lay in (layers[0], layers[num_layers - 1]))


def adopt_cache(cache, state: LokiState, num_layers: int) -> None:
    """Replace the layers of a transformers ``Cache`` by Loki layers of this enable call (in place: the cache keeps
    its identity); layers of an earlier enable call are restored to plain keys first."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise LokiError(f"Loki needs a transformers Cache with per-layer storage (DynamicCache or StaticCache); got "
                        f"{type(cache).__name__}")
    replicate = getattr(cache, "layer_class_to_replicate", None)
    while len(layers) < num_layers and replicate is not None:
        layers.append(replicate())
    state.remember_cache(cache)
    for idx, layer in enumerate(layers[:num_layers]):
        if isinstance(layer, _LOKI_LAYERS):
            if layer.loki.owner is state.owner:
                continue
            layer = _restore_layer(layer)  # stored under other settings: back to plain keys first
        layers[idx] = _adopt_layer(layer, state, idx)


def restore_caches(state: LokiState) -> None:
    """Turn the layers of every live cache adopted under ``state`` back into plain layers with plain keys."""
    for ref in state.caches:
        cache = ref()
        layers = getattr(cache, "layers", None) if cache is not None else None
        for idx, layer in enumerate(layers or []):
            if isinstance(layer, _LOKI_LAYERS) and layer.loki.owner is state.owner:
                layers[idx] = _restore_layer(layer)
    state.caches.clear()


def loki_cache(model, *, static: bool = False, max_cache_len: int | None = None, batch_size: int | None = None):
    """A new KV cache for ``model`` (Loki enabled) whose layers store keys in the model's basis.

    ``static=False``: a transformers ``DynamicCache`` (Loki layers that grow).  ``static=True``: a transformers
    ``StaticCache`` of ``max_cache_len`` tokens (prompt + new tokens; writing past it raises ``CacheOverflowError``)
    for ``torch.compile`` and CUDA graphs; ``batch_size``: allocate every layer now (on each attention layer's device,
    in the model's dtype), default at the first write.  Pass it to ``generate`` or to forward under the model's
    cache keyword (``loki.integrations.transformers.cache_keyword(model)``); without one, the cache ``generate``
    builds is adopted on the first forward.
    """
    from transformers import DynamicCache, StaticCache

    state = state_of(model)
    cfg = text_config(model.config)
    n = config_num_layers(model.config)
    if not isinstance(static, bool):
        raise TypeError(f"static must be True or False, got {static!r}")
    if not static:
        if max_cache_len is not None or batch_size is not None:
            raise ValueError("max_cache_len and batch_size size a static cache: pass static=True with them")
        cache = DynamicCache(config=cfg)
        adopt_cache(cache, state, n)
        return cache
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
        raise ValueError(f"max_cache_len must be an int >= 1 for static=True, got {max_cache_len!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an int >= 1 or None, got {batch_size!r}")
    if state.settings.method is Method.H2O:
        raise LokiError("method='h2o' keeps per-token state that a static cache does not hold: use a DynamicCache")
    cov = state.covered_positions
    if cov is not None and max_cache_len > cov:
        import warnings

        warnings.warn(f"max_cache_len={max_cache_len} exceeds the positions the Loki basis was calibrated on "
                      f"({cov}): post-rotary keys past them are described less well", RuntimeWarning, stacklevel=2)
    cache = StaticCache(config=cfg, max_cache_len=max_cache_len)
    adopt_cache(cache, state, n)
    if batch_size is not None:
        HKV, D = config_kv_heads(model.config), config_head_dim(model.config)
        mods = attention_modules(model)
        layers = cache.layers[:n]
        for idx, layer in enumerate(layers):  # every layer's keys and values first, then the key prefixes
            w = mods[idx].k_proj.weight if idx < len(mods) else next(model.parameters())
            dtype = w.dtype if w.dtype.is_floating_point else torch.get_default_dtype()
            z = torch.zeros(batch_size, HKV, 0, D, dtype=dtype, device=w.device)
            if isinstance(layer, LokiStaticLayer):
                layer.allocate_kv(z, z)
            else:
                layer.lazy_initialization(z, z)
        for layer in layers:
            if isinstance(layer, LokiStaticLayer):
                layer.allocate_prefix()
    return cache
