"""The KV cache under Loki: :class:`LokiCacheLayer` rotates keys into the basis once per token, as they are
written (``K_hat = K P``), and keeps the contiguous key prefix of the Triton path; the layers of a
``DynamicCache`` are converted in place (:func:`convert_cache`) and turned back into plain layers with plain keys
(:func:`restore_caches`) when Loki is disabled or enabled with new settings.

Shape letters: B batch, HQ query heads, HKV key/value heads, S cached tokens, D head dim.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from loki._hf import config_num_layers, text_config
from loki.kernels.cache_write import check_write, write_rotated, write_rotated_reference
from loki.reference import rotate_keys

from .config import LokiError, LokiState, state_of

__all__ = ["LokiCacheLayer", "LokiStaticCacheLayer", "convert_cache", "loki_cache", "restore_caches"]


def _dynamic_layer_class():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class LokiCacheLayer:
    """Mixin of the KV cache layers used under Loki (combined with the transformers layer class in use).

    ``update`` rotates the incoming keys into the PCA basis, ``K_hat = K P`` (per KV head), before the base class
    appends them, so every key is rotated exactly once.  ``loki_P`` ([HKV, D, D]) is None for methods that use
    the keys in their own coordinates.  ``loki_acc`` holds H2O's accumulated attention ([B, HQ, S]).
    For the Triton decode path, ``loki_prefix`` ([B, HKV, S, d], rows of d contiguous values) keeps the first d
    rotated dims of every key (written once per token into ``loki_prefix_buf``, a buffer with spare capacity),
    so the approximate scores read exactly d/D of the key bytes; ``loki_prefix_d`` (the d of the enabled
    setting) is None when no prefix is kept.
    """

    _layer_type = None  # never auto-register in transformers' layer-type mappings

    def update(self, key_states, value_states, *args, **kwargs):
        owner = getattr(self, "loki_owner", None)
        if owner is not None and not owner.active:
            raise LokiError(
                "this KV cache was filled while Loki was enabled (its keys are stored in the PCA basis) and Loki has "
                "been disabled since: extending it would mix rotated and plain keys. disable_loki restores the "
                "caches it knows (the ones used with the model); this one is a copy or was never used with the "
                "model: start a new cache, or call enable_loki again before using it"
            )
        P = getattr(self, "loki_P", None)
        if P is not None:
            if P.device != key_states.device:
                P = self.loki_P = P.to(key_states.device)  # moved once, not on every step
            key_states = rotate_keys(key_states, P)
        dp = getattr(self, "loki_prefix_d", None)
        if dp is not None and (key_states.is_cuda or getattr(self, "loki_prefix_always", False)):
            self._append_prefix(key_states[..., :dp])
        return super().update(key_states, value_states, *args, **kwargs)

    def _append_prefix(self, new: torch.Tensor) -> None:
        """Append [B, HKV, L, dp] to the key prefix, in place into a buffer with spare capacity (a concatenation
        would copy the whole prefix on every decode step); ``loki_prefix`` is the filled part of the buffer."""
        prev = getattr(self, "loki_prefix", None)
        buf = getattr(self, "loki_prefix_buf", None)
        n = 0 if prev is None else prev.shape[-2]
        need = n + new.shape[-2]
        fits = (buf is not None and prev is not None and buf.shape[-2] >= need and buf.shape[:2] == new.shape[:2]
                and buf.dtype == new.dtype and buf.device == new.device and prev.data_ptr() == buf.data_ptr()
                and prev.stride() == buf.stride())
        if not fits:
            cap = max(need + 256, int(1.25 * (buf.shape[-2] if buf is not None else 0)))
            cap = -(-cap // 256) * 256
            nb = torch.empty(*new.shape[:2], cap, new.shape[-1], dtype=new.dtype, device=new.device)
            if n:
                nb[:, :, :n].copy_(prev)
            buf = self.loki_prefix_buf = nb
        buf[:, :, n:need].copy_(new)
        self.loki_prefix = buf[:, :, :need]

    def _map_state(self, fn):
        for name in ("loki_acc", "loki_prefix"):
            t = getattr(self, name, None)
            if t is not None:
                setattr(self, name, fn(t))
        self.loki_prefix_buf = None  # the mapped prefix is a new tensor: the next append re-buffers it

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        super().batch_repeat_interleave(repeats)
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._map_state(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove):
        super().crop(tokens_to_remove)
        if self.keys is not None:
            n = self.keys.shape[-2]
            self.loki_acc = None if getattr(self, "loki_acc", None) is None else self.loki_acc[..., :n]
            if getattr(self, "loki_prefix", None) is not None:
                self.loki_prefix = self.loki_prefix[..., :n, :]

    def reset(self):
        super().reset()
        self.loki_acc = None
        self.loki_prefix = None
        self.loki_prefix_buf = None


def _mark_static(t: torch.Tensor) -> None:
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)


class LokiStaticCacheLayer(LokiCacheLayer):
    """Mixin of the static cache layers used under Loki (combined with transformers' ``StaticLayer``).

    ``update`` rotates the new keys into the basis and writes keys, values and the key prefix in place at the
    new tokens' positions (the layer's own write counter, ``cumulative_length``, where transformers keeps one,
    else ``cache_kwargs["cache_position"]``).  ``loki_P_q`` is the query transform on the layer's device.
    """

    loki_static = True

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self._loki_allocate()

    def _loki_allocate(self) -> None:
        dev = self.keys.device
        for name in ("loki_P", "loki_P_q", "loki_P_inv"):
            t = getattr(self, name, None)
            if t is not None:
                # read by every compiled step: a static address, or CUDA graphs would copy it in at each replay
                t = t.to(dev).contiguous()
                _mark_static(t)
                setattr(self, name, t)
        dp = getattr(self, "loki_prefix_d", None)
        want = dp is not None and (dev.type == "cuda" or getattr(self, "loki_prefix_always", False))
        if want and getattr(self, "loki_prefix", None) is None:
            self.loki_prefix = self.keys[..., :dp].contiguous()  # zeros, or the rotated keys already there
            _mark_static(self.loki_prefix)

    def _positions(self, n: int, args, kwargs) -> torch.Tensor:
        counter = getattr(self, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            return torch.arange(n, device=self.keys.device) + counter
        cache_kwargs = args[0] if args else kwargs.get("cache_kwargs")
        pos = cache_kwargs.get("cache_position") if isinstance(cache_kwargs, dict) else None
        if pos is None:
            raise LokiError("a static cache layer needs the positions of the new tokens "
                            "(cache_kwargs['cache_position'])")
        return pos.to(self.keys.device)

    def update(self, key_states, value_states, *args, **kwargs):
        owner = getattr(self, "loki_owner", None)
        if owner is not None and not owner.active:
            raise LokiError(
                "this static KV cache was filled while Loki was enabled (its keys are stored in the PCA basis) and "
                "Loki has been disabled since: start a new cache, or call enable_loki again before using it"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos = self._positions(key_states.shape[-2], args, kwargs)
        counter = getattr(self, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.add_(key_states.shape[-2])
        prefix = getattr(self, "loki_prefix", None)
        # inside a model forward the step metadata checked the positions and the batch (eager), or the forward is
        # compiled (no host sync possible; the kernel's stores stay inside the cache): no sync here
        inside = owner is not None and owner.in_forward
        check = not inside and not torch.compiler.is_compiling()
        if self.loki_P is not None:
            if self.keys.is_cuda or getattr(self, "loki_prefix_always", False):
                # rotation and the three writes in one kernel (one op in a compiled graph), bounds checked
                write_rotated(self.keys, self.values, prefix, key_states, value_states, self.loki_P, pos.long(),
                              check_positions=check)
            else:  # the PyTorch backend on the CPU: the reference writes, bounds checked the same way
                check_write(self.keys, self.values, prefix, key_states, value_states, self.loki_P, pos.long(),
                            check_positions=check)
                write_rotated_reference(self.keys, self.values, prefix, key_states, value_states, self.loki_P,
                                        pos.long())
            return self.keys, self.values
        if check or key_states.shape[0] != self.keys.shape[0]:
            check_write(self.keys, self.values, prefix, key_states, value_states, None, pos.long(),
                        check_positions=check)
        self.keys.index_copy_(2, pos, key_states)
        self.values.index_copy_(2, pos, value_states)
        if prefix is not None:
            prefix.index_copy_(2, pos, key_states[..., : prefix.shape[-1]])
        return self.keys, self.values

    def crop(self, tokens_to_remove):
        super(LokiCacheLayer, self).crop(tokens_to_remove)  # the static layer's own crop: moves its counter

    def reset(self):
        super(LokiCacheLayer, self).reset()
        prefix = getattr(self, "loki_prefix", None)
        if prefix is not None:
            prefix.zero_()

    def _map_state(self, fn):
        prefix = getattr(self, "loki_prefix", None)
        if prefix is not None:
            self.loki_prefix = fn(prefix)


def convert_static_layer(layer, transforms, prefix_d, prefix_always, owner):
    """A Loki copy of a plain ``StaticLayer`` (same tensors; keys already written are rotated in place).
    ``transforms``: the layer's :class:`~loki.integrations.transformers.config.LayerTransforms`."""
    new = _with_class(layer, _loki_layer_class(type(layer), LokiStaticCacheLayer))
    new.loki_owner, new.loki_acc, new.loki_prefix, new.loki_prefix_buf = owner, None, None, None
    new.loki_prefix_d = prefix_d
    new.loki_prefix_always = prefix_always
    new.loki_P, new.loki_P_q, new.loki_P_inv = transforms
    P = new.loki_P
    if getattr(new, "is_initialized", False) and getattr(new, "keys", None) is not None:
        if P is not None:
            new.keys.copy_(rotate_keys(new.keys, P.to(new.keys.device)))  # in place: the address stays
        new._loki_allocate()
    return new


_LOKI_LAYER_CLASSES: dict[tuple[type, type], type] = {}


def _loki_layer_class(base: type, mixin: type = LokiCacheLayer) -> type:
    """The Loki class of a transformers layer class: ``mixin`` (dynamic or static Loki layer) over ``base``, made
    once per pair."""
    if issubclass(base, mixin):
        return base
    cls = _LOKI_LAYER_CLASSES.get((mixin, base))
    if cls is None:
        cls = type(f"Loki{base.__name__}", (mixin, base), {"_layer_type": None, "__module__": __name__})
        _LOKI_LAYER_CLASSES[(mixin, base)] = cls
    return cls


def _with_class(layer, cls: type):
    """A layer of class ``cls`` holding ``layer``'s state (the same tensors)."""
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)
    return new


def convert_cache(cache, state: LokiState, num_layers: int) -> None:
    """Turn the layers of a ``DynamicCache`` into Loki layers (in place; keys already there are rotated once)."""
    DynamicLayer = _dynamic_layer_class()
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise LokiError(
            f"Loki needs a transformers Cache with per-layer storage (DynamicCache); got {type(cache).__name__}"
        )
    replicate = getattr(cache, "layer_class_to_replicate", None)
    while len(layers) < num_layers and replicate is not None:
        layers.append(replicate())
    if not any(r() is cache for r in state.caches):
        state.caches[:] = [r for r in state.caches if r() is not None]
        state.caches.append(weakref.ref(cache))
    cfg = state.config
    for idx, layer in enumerate(layers[:num_layers]):
        if isinstance(layer, LokiCacheLayer):
            if getattr(layer, "loki_owner", None) is state.owner:
                continue
            # converted under other settings (an earlier enable_loki): back to plain keys, then converted again
            layers[idx] = layer = _restore_layer(layer)
        tr = state.transforms(idx)
        P = tr.key
        if _is_static_layer(layer):
            if cfg.method == "h2o":
                raise LokiError("method='h2o' keeps per-token state that a static cache does not hold: use a "
                                "DynamicCache (no cache_implementation)")
            layers[idx] = convert_static_layer(layer, tr, cfg.prefix_dims, cfg.backend == "triton", state.owner)
            continue
        if not isinstance(layer, DynamicLayer):
            raise LokiError(
                f"Loki supports DynamicCache and StaticCache layers (generate's default cache and "
                f"cache_implementation='static'); layer {idx} of the cache is a {type(layer).__name__}. Pass no "
                f"cache, a DynamicCache, a StaticCache or loki_static_cache(model, ...)."
            )
        # same state, Loki update; the cache keeps its identity
        layers[idx] = layer = _with_class(layer, _loki_layer_class(type(layer)))
        layer.loki_acc = None
        layer.loki_prefix = None
        layer.loki_prefix_buf = None
        # a sliding-window layer drops keys inside its own update: no prefix buffer beside it
        layer.loki_prefix_d = None if getattr(layer, "is_sliding", False) else cfg.prefix_dims
        layer.loki_prefix_always = cfg.backend == "triton"
        layer.loki_owner = state.owner
        if P is not None:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                P = P.to(layer.keys.device)
                layer.keys = rotate_keys(layer.keys, P)  # tokens cached before enable_loki
            layer.loki_P = P
            layer.loki_P_inv = tr.inverse  # K = K_hat P_k^-1 = K_hat P_q^T
        else:
            layer.loki_P = None
            layer.loki_P_inv = None
        keys = getattr(layer, "keys", None)
        if layer.loki_prefix_d is not None and keys is not None and keys.numel() > 0 and (
                keys.is_cuda or layer.loki_prefix_always):
            layer.loki_prefix = keys[..., : layer.loki_prefix_d].contiguous()
    cache.loki_owner = state.owner  # converted: the decoder's pre-hook skips this cache from now on


def _is_static_layer(layer) -> bool:
    """A transformers ``StaticLayer`` of full attention (sliding-window and indexed static layers are refused:
    their writes wrap around or carry extra state)."""
    from transformers.cache_utils import StaticLayer

    if not isinstance(layer, StaticLayer):
        return False
    base = next(c for c in type(layer).__mro__ if not issubclass(c, LokiCacheLayer))
    if base is not StaticLayer or getattr(layer, "is_sliding", False):
        raise LokiError(f"Loki supports full-attention StaticLayer caches, not {base.__name__} (sliding-window or "
                        "indexed layers): use a DynamicCache for this model")
    return True


def _restore_layer(layer):
    """A plain layer (the transformers class the Loki layer was made from) with the same state and the keys back in
    their own coordinates (``K = K_hat P^-1``, exact up to rounding); Loki's own state is dropped."""
    base = next(c for c in type(layer).__mro__[1:] if not issubclass(c, LokiCacheLayer))
    new = _with_class(layer, base)
    for name in [k for k in new.__dict__ if k.startswith("loki_")]:
        del new.__dict__[name]
    P_inv = getattr(layer, "loki_P_inv", None)
    keys = getattr(new, "keys", None)
    if P_inv is not None and keys is not None and keys.numel() > 0:
        new.keys = rotate_keys(keys, P_inv.to(keys.device))
    return new


def restore_caches(state: LokiState) -> None:
    """Turn the layers of every live cache converted under ``state`` back into plain layers with plain keys."""
    for ref in state.caches:
        cache = ref()
        layers = getattr(cache, "layers", None) if cache is not None else None
        for idx, layer in enumerate(layers or []):
            if isinstance(layer, LokiCacheLayer) and getattr(layer, "loki_owner", None) is state.owner:
                layers[idx] = _restore_layer(layer)
    state.caches.clear()


def loki_cache(model) -> Any:
    """A new ``DynamicCache`` for ``model`` whose layers store keys in the model's Loki basis.

    Pass it to ``generate(..., past_key_values=cache)`` (or ``cache=`` on newer transformers) or to forward;
    without it, the cache ``generate`` builds is converted on the first forward call.
    """
    from transformers import DynamicCache

    state = state_of(model)
    cache = DynamicCache(config=text_config(model.config))
    convert_cache(cache, state, config_num_layers(model.config))
    return cache
