"""The KV cache layers Loki owns: explicit subclasses of transformers' ``DynamicLayer`` (:class:`LokiDynamicLayer`),
``DynamicSlidingWindowLayer`` (:class:`LokiSlidingWindowLayer`) and ``StaticLayer`` (:class:`LokiStaticLayer`), each
holding one :class:`LayerStore` (``layer.loki``: the enable call it belongs to, the layer's transforms, the key
prefix the kernels read, H2O's accumulated attention).  Adopting caches and the one factory of caches,
``loki_cache``, are in :mod:`.caches`.

Keys are stored in the basis once per token, when they are written (``K_hat = K P``), by one write
(:func:`write_tokens`: the ``loki::write_rotated`` op, the rotation and the writes of keys, values and key prefix in
one Triton kernel, or its PyTorch reference on a CPU without the Triton backend).  A static layer writes in place
at the new tokens' positions; a dynamic layer writes into buffers with spare capacity (grown by a quarter when
full) whose filled part its ``keys`` / ``values`` are, so a decode step writes one token instead of copying the
cache.  A sliding-window layer rotates its keys (``loki.reference.rotate_keys``) before transformers' own update,
which drops the tokens that leave the window; it keeps no key prefix.

This module imports transformers; ``loki.integrations.transformers`` imports it only when a cache is made.

Shape letters: B batch, HKV key/value heads, L new tokens, S cached tokens (``max_cache_len`` for a static
layer), D head dim, dp key-prefix dims.
"""

from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from loki.kernels.cache_write import check_write, write_int8_prefix, write_rotated, write_rotated_reference
from loki.reference import rotate_keys
from loki.reference.score_formats import encode_int8_score_keys, score_copy_bytes

from .state import CacheOwner, LayerTransforms, LokiError

__all__ = [
    "LayerStore",
    "LokiDynamicLayer",
    "LokiSlidingWindowLayer",
    "LokiStaticLayer",
    "write_tokens",
]


class LayerStore:
    """Loki's part of one cache layer.

    ``owner``: the enable call whose basis the keys are stored in; ``transforms``: the layer's
    :class:`~.state.LayerTransforms` (``key`` None for methods that keep keys in their own coordinates);
    ``prefix_dims``: dp of the key prefix kept for the kernels (None: none); ``triton``: the Triton backend was asked
    for by name (the kernels' write and prefix on the CPU interpreter too); ``prefix``: [B, HKV, S, dp], the first dp
    rotated dims of every key, contiguous rows, or None; ``int8``: the prefix is the "int8" score copy
    (``ResolvedSettings.int8_prefix``): ``prefix`` then holds int8 codes of the stored keys' first dp dims and
    ``prefix_scale`` [B, HKV, S] bf16 their per-token scales (``encode_int8_score_keys``; None otherwise); ``acc``:
    H2O's accumulated attention [B, HQ, S] or None.
    """

    __slots__ = ("owner", "transforms", "prefix_dims", "triton", "int8", "prefix", "prefix_scale", "acc")

    def __init__(self, owner: CacheOwner, transforms: LayerTransforms, prefix_dims: int | None, triton: bool,
                 int8: bool = False):
        self.owner = owner
        self.transforms = transforms
        self.prefix_dims = prefix_dims
        self.triton = triton
        self.int8 = int8 and prefix_dims is not None
        self.prefix = None
        self.prefix_scale = None
        self.acc = None

    def check_active(self) -> None:
        if not self.owner.active:
            raise LokiError(
                "this KV cache was filled while Loki was enabled (its keys are stored in the PCA basis) and Loki has "
                "been disabled since: extending it would mix rotated and plain keys. disable_loki restores the "
                "caches it knows (the ones used with the model); this one is a copy or was never used with the "
                "model: start a new cache, or call enable_loki again before using it")

    def to(self, device, *, static: bool = False) -> None:
        """Move the transforms to ``device`` once (a layer on another device than the basis); ``static``: mark them
        as fixed addresses (read by every compiled step: CUDA graphs would copy them in at each replay)."""
        moved = []
        for t in self.transforms:
            if t is not None and t.device != device:
                t = t.to(device).contiguous()
            if t is not None and static and not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(t)
            moved.append(t)
        self.transforms = LayerTransforms(*moved)

    def kernel_writes(self, device) -> bool:
        """Whether writes take the Triton kernel: on CUDA, or on the CPU interpreter when asked for by name."""
        return device.type == "cuda" or self.triton

    def keeps_prefix(self, device) -> bool:
        return self.prefix_dims is not None and self.kernel_writes(device)

    def new_prefix(self, keys: torch.Tensor):
        """``(prefix, prefix_scale)`` of ``keys`` [B, HKV, S, D] (stored keys, or zeros), fresh contiguous tensors:
        the keys' first dp dims and None, or for an int8 copy their codes and scales."""
        if self.int8:
            return encode_int8_score_keys(keys[..., : self.prefix_dims])
        return keys[..., : self.prefix_dims].contiguous(), None


def _prefix_dropped_warning(store: LayerStore, keys: torch.Tensor) -> str:
    """The warning of a static cache layer that leaves its key prefix out because it did not fit beside the keys and
    values (the keys and values fitted: a cache that fits dense's memory still runs)."""
    rows, dp = keys[..., 0].numel(), store.prefix_dims
    what = "int8 score copy" if store.int8 else "key prefix"
    need = rows * score_copy_bytes("int8" if store.int8 else "native", dp, keys.element_size())
    how = ("rounds the keys' first dims to the int8 copy as they read them in place" if store.int8 else
           "read the keys' first dims in place")
    return (f"Loki's {what} ({dp} dims of every key, {need / 2**20:.1f} MiB for this layer) did not fit beside the "
            f"static cache's keys and values on {keys.device}: this layer keeps none, and its scores kernel {how} "
            "(the same results, a slower read). enable_loki(..., key_prefix=False) keeps none on every layer")


def write_tokens(store: LayerStore, keys, values, prefix, k_new, v_new, pos, *, check: bool,
                 prefix_scale=None) -> None:
    """The one write of new tokens into a Loki cache layer's storage: keys rotated into the basis (``K P``) and
    written with their values and key prefix at positions ``pos`` ([L] int64), in place.  keys, values:
    [B, HKV, S, D]; prefix: [B, HKV, S, dp] or None; k_new, v_new: [B, HKV, L, D].  Bounds checked before anything
    is written (``check``: the positions too, one host sync).  ``prefix_scale`` [B, HKV, S] bf16: ``prefix`` is an
    int8 score copy (int8 codes of the keys as stored), written with them."""
    P = store.transforms.key
    if P is not None and store.kernel_writes(keys.device):
        write_rotated(keys, values, prefix, k_new, v_new, P, pos, check_positions=check, prefix_scale=prefix_scale)
        return
    check_write(keys, values, prefix, k_new, v_new, P, pos, check_positions=check)
    if P is not None:
        write_rotated_reference(keys, values, prefix, k_new, v_new, P, pos, prefix_scale)
        return
    keys.index_copy_(2, pos, k_new)
    values.index_copy_(2, pos, v_new)
    if prefix is not None and prefix_scale is not None:
        write_int8_prefix(keys, prefix, prefix_scale, pos)
    elif prefix is not None:
        prefix.index_copy_(2, pos, k_new[..., : prefix.shape[-1]])


def _grow(n: int) -> int:
    return -(-max(n + 256, int(1.25 * n)) // 256) * 256


class LokiDynamicLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys are stored in the basis, in buffers with spare capacity (see the module
    docstring); ``keys`` and ``values`` are their filled part."""

    _layer_type = None  # never registered in transformers' layer-type mappings

    def __init__(self, store: LayerStore):
        super().__init__()
        self.loki = store
        self._buffers = None  # (keys, values, prefix or None, prefix scale or None), each [B, HKV, capacity, ...]

    def _filled(self, n: int):
        """The buffers, when ``keys`` / ``values`` are still their first n slots (nothing outside replaced them)."""
        bufs = self._buffers
        if bufs is None or n == 0:
            return None
        kb, vb = bufs[:2]
        for t, b in ((self.keys, kb), (self.values, vb)):
            if t.data_ptr() != b.data_ptr() or t.stride() != b.stride() or t.shape[:2] != b.shape[:2]:
                return None
        return bufs

    def _reserve(self, need: int, k_new: torch.Tensor, v_new: torch.Tensor):
        n = self.get_seq_length()
        bufs = self._filled(n)
        if bufs is not None and bufs[0].shape[2] >= need and bufs[0].shape[0] == k_new.shape[0]:
            return bufs
        B, HKV, _, D = k_new.shape
        cap = _grow(need)
        dev = k_new.device
        kb = torch.empty(B, HKV, cap, D, dtype=k_new.dtype, device=dev)
        vb = torch.empty(B, HKV, cap, v_new.shape[-1], dtype=v_new.dtype, device=dev)
        dp = self.loki.prefix_dims if self.loki.keeps_prefix(dev) else None
        int8 = dp is not None and self.loki.int8
        pb = None if dp is None else torch.empty(B, HKV, cap, dp, dtype=torch.int8 if int8 else k_new.dtype,
                                                 device=dev)
        sb = torch.empty(B, HKV, cap, dtype=torch.bfloat16, device=dev) if int8 else None
        if n:
            kb[:, :, :n].copy_(self.keys)
            vb[:, :, :n].copy_(self.values)
            if int8:
                codes, scale = self.loki.new_prefix(self.keys)
                pb[:, :, :n].copy_(codes)
                sb[:, :, :n].copy_(scale)
            elif pb is not None:
                pb[:, :, :n].copy_(self.keys[..., :dp])
        self._buffers = (kb, vb, pb, sb)
        return self._buffers

    def update(self, key_states, value_states, *args, **kwargs):
        self.loki.check_active()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.loki.to(key_states.device)
        n = self.get_seq_length()
        L = key_states.shape[-2]
        kb, vb, pb, sb = self._reserve(n + L, key_states, value_states)
        pos = torch.arange(n, n + L, device=kb.device)
        write_tokens(self.loki, kb, vb, pb, key_states, value_states, pos, check=False, prefix_scale=sb)
        self.keys, self.values = kb[:, :, : n + L], vb[:, :, : n + L]
        self.loki.prefix = None if pb is None else pb[:, :, : n + L]
        self.loki.prefix_scale = None if sb is None else sb[:, :, : n + L]
        return self.keys, self.values

    def _drop_buffers(self) -> None:
        """After transformers edited ``keys`` / ``values`` (new tensors): the next update buffers them again."""
        self._buffers = None
        self.loki.prefix = None
        self.loki.prefix_scale = None

    def _map_acc(self, fn) -> None:
        if self.loki.acc is not None:
            self.loki.acc = fn(self.loki.acc)

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._drop_buffers()
        self._map_acc(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        super().batch_repeat_interleave(repeats)
        self._drop_buffers()
        self._map_acc(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._drop_buffers()
        self._map_acc(lambda t: t[indices, ...])

    def crop(self, tokens_to_remove):
        super().crop(tokens_to_remove)
        self._drop_buffers()
        n = self.get_seq_length()
        self._map_acc(lambda t: t[..., :n])

    def reset(self):
        super().reset()
        self._drop_buffers()
        self.loki.acc = None


class LokiSlidingWindowLayer(DynamicSlidingWindowLayer):
    """A ``DynamicSlidingWindowLayer`` whose keys are rotated into the basis before transformers' own update (which
    drops the tokens leaving the window); no key prefix."""

    _layer_type = None

    def __init__(self, store: LayerStore, sliding_window: int):
        super().__init__(sliding_window=sliding_window)
        self.loki = store

    def update(self, key_states, value_states, *args, **kwargs):
        self.loki.check_active()
        self.loki.to(key_states.device)
        if self.loki.transforms.key is not None:
            key_states = rotate_keys(key_states, self.loki.transforms.key)
        return super().update(key_states, value_states, *args, **kwargs)

    def reset(self):
        super().reset()
        self.loki.acc = None


class LokiStaticLayer(StaticLayer):
    """A ``StaticLayer`` whose keys are stored in the basis: keys, values and the key prefix preallocated to
    ``max_cache_len`` at the first write (or ``loki_cache(..., batch_size=...)``) and written in place at the new
    tokens' positions (the layer's write counter, ``cumulative_length``, where transformers keeps one, else
    ``cache_kwargs["cache_position"]``): fixed addresses for compiled steps and CUDA graphs."""

    _layer_type = None

    def __init__(self, store: LayerStore, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.loki = store

    def lazy_initialization(self, key_states, value_states) -> None:
        self.allocate_kv(key_states, value_states, hint=True)
        self.allocate_prefix()

    def allocate_kv(self, key_states, value_states, *, hint: bool = False) -> None:
        """The layer's keys and values (transformers' allocation).  ``hint``: layer by layer at the first write, so
        earlier layers may hold key prefixes; out of memory, the error then also says how such a cache fits where
        a dense one does."""
        try:
            super().lazy_initialization(key_states, value_states)
        except torch.OutOfMemoryError as exc:
            if not hint or not self.loki.keeps_prefix(key_states.device):
                raise
            raise torch.OutOfMemoryError(
                f"{exc}\nThe keys and values of a layer of Loki's static cache did not fit beside the earlier layers' "
                "key prefixes: loki_cache(model, static=True, max_cache_len=..., batch_size=B) allocates every "
                "layer's keys and values first (a prefix that then does not fit is left out, with the same "
                "results), or enable_loki(..., key_prefix=False) keeps none") from None

    def allocate_prefix(self) -> None:
        """The layer's key prefix beside its allocated keys (once; one that does not fit is left out, with a
        warning: the kernels then read the keys' dims in place, the same scores), and its transforms on the keys'
        device as fixed addresses."""
        dev = self.keys.device
        self.loki.to(dev, static=True)
        if self.loki.keeps_prefix(dev) and self.loki.prefix is None:
            # zeros, or the keys written (their int8 copy and its scales for an int8 setting)
            try:
                self.loki.prefix, self.loki.prefix_scale = self.loki.new_prefix(self.keys)
            except torch.OutOfMemoryError:
                # the prefix is a copy of the keys' first dims (or their int8 rounding): without it the kernels
                # read them in place (the same scores and logits, a strided read; the int8 rounding done as they
                # read), so a cache that fits dense's memory still runs
                warnings.warn(_prefix_dropped_warning(self.loki, self.keys), RuntimeWarning, stacklevel=2)
                self.loki.prefix_dims, self.loki.int8 = None, False
                return
            if not torch.compiler.is_compiling():
                for t in (self.loki.prefix, self.loki.prefix_scale):
                    if t is not None:
                        torch._dynamo.mark_static_address(t)

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
        if not self.loki.owner.active:
            raise LokiError(
                "this static KV cache was filled while Loki was enabled (its keys are stored in the PCA basis) and "
                "Loki has been disabled since: start a new cache, or call enable_loki again before using it")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        pos = self._positions(key_states.shape[-2], args, kwargs).long()
        counter = getattr(self, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.add_(key_states.shape[-2])
        # inside a model forward the step plan checked the positions and the batch (eager), or the forward is
        # compiled (no host sync possible; the kernel's stores stay inside the cache): no sync here
        check = not self.loki.owner.in_forward and not torch.compiler.is_compiling()
        write_tokens(self.loki, self.keys, self.values, self.loki.prefix, key_states, value_states, pos,
                     check=check, prefix_scale=self.loki.prefix_scale)
        return self.keys, self.values

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        if self.loki.prefix is not None:
            self.loki.prefix = self.loki.prefix.index_select(0, beam_idx.to(self.loki.prefix.device))
        if self.loki.prefix_scale is not None:
            self.loki.prefix_scale = self.loki.prefix_scale.index_select(0, beam_idx.to(self.loki.prefix_scale.device))

    def reset(self):
        super().reset()
        if self.loki.prefix is not None:
            self.loki.prefix.zero_()
        if self.loki.prefix_scale is not None:
            self.loki.prefix_scale.zero_()
