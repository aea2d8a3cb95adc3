"""Loki inside Hugging Face transformers (5.x): ``enable_loki(model, basis, k=..., d=...)`` / ``disable_loki``.

How it plugs in (public transformers APIs only, no model class is patched):

* An attention function is registered under the name ``"loki"`` with ``transformers.AttentionInterface`` and
  the sdpa mask builder under the same name with ``transformers.masking_utils.AttentionMaskInterface``;
  ``model.set_attn_implementation("loki")`` switches the model to it and ``disable_loki`` restores the
  implementation the model had before.
* Keys are stored in the PCA basis **once per token, when they are written to the KV cache**: the layers of a
  ``DynamicCache`` (the cache ``generate`` builds, one a caller passes, or one created here when the caller asks
  for a cache without giving one) are turned into :class:`LokiCacheLayer` s, whose ``update`` rotates the new
  keys ``K_hat = K P`` before appending them.  The cache is never re-projected as a whole.  Values are not
  rotated.  A forward pre-hook on the decoder model does this conversion (and points the attention function
  at the cache of the current call); the hook is removed by ``disable_loki``, which also turns those caches back
  into plain layers with plain keys (as does ``enable_loki`` with new settings), so a cache outlives the
  settings it was filled under.
* Pre- and post-rotary bases: the cache stores post-rotary keys, and both kinds of basis are applied to them.
  Lemma 1 of the paper (``(q P)(K P)^T = q K^T``) holds for *any* orthogonal ``P``, so attention over the full
  rotated keys is exact either way; a basis fitted before the rotary embedding (``rotary="pre"``) is simply
  another orthogonal matrix, whose leading ``d`` directions capture the post-rotary keys' variance less well.
* Prefill (query length > 1) runs dense causal attention (the causal mask is applied here: a custom
  implementation gets ``attention_mask=None`` for unpadded batches).  Every decode step (query length 1) runs
  the selected method with ``q_hat = rotate_query(q, P_layer)`` against the rotated cache.  A forward without a
  cache (``use_cache=False``, e.g. ``generate(..., use_cache=False)``) is refused with ``semantics="generate"``
  (the default) for every method but "dense": every forward would be a dense prefill.
  With ``semantics="decode"`` the prefill is sparse too: every query row ``i`` attends like a decode step over
  the ``i + 1`` tokens it sees (:func:`teacher_forced_attention`), so loglikelihoods and perplexities measure
  the method.
* Methods (``method=``): ``"loki"`` (Algorithm 1), ``"exact_topk"`` (oracle selection), ``"pcaattn"`` (attention
  from the first ``d`` rotated dims), ``"dense"``, ``"sparq"`` (``d`` is SparQ's ``r``) and ``"h2o"`` (generation
  only).  ``k`` and ``d`` are counts (int) or fractions (float in (0, 1]); a fractional ``k`` is a fraction of
  each sequence's current valid length, at least 1; an int ``k`` larger than the sequence keeps all tokens.
* Padding: left-padded batches (``generate`` with ``padding_side="left"``) work; the valid tokens of every
  sequence, ``[starts, lengths)``, are read from the attention mask.  Right padding works for single forwards but
  not for ``generate``, whose new tokens follow the padding (a mask with holes, refused).
* ``backend="triton"`` needs CUDA tensors (or ``TRITON_INTERPRET=1`` on the CPU) and no gradient (the kernels
  have no backward; run under ``torch.no_grad()``); ``"auto"`` takes the PyTorch path where either fails.

Supported architectures: Llama (incl. SmolLM), Mistral, Qwen2 and Qwen3 (attention modules with rotary
embeddings and a KV cache of post-rotary keys).

Shape letters: B batch, HQ query heads, HKV key/value heads, L query length, S key length (cache + new tokens),
D head dim, R query rows flattened over batch and query positions.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

import torch

from .._checks import check_no_grad, check_triton_device, resolve_d, resolve_k
from ..reference import (
    dense_attention,
    exact_topk_attention,
    expand_to_query_heads,
    h2o_attention,
    pcaattn_attention,
    rotate_keys,
    rotate_query,
    sparq_attention,
)
from ..reference.teacher_forced import teacher_forced_rows

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LokiCacheLayer",
    "LokiConfig",
    "LokiError",
    "METHODS",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "disable_loki",
    "enable_loki",
    "is_loki_enabled",
    "loki_attention_forward",
    "loki_cache",
    "teacher_forced_attention",
]

#: The name registered with ``AttentionInterface`` / ``AttentionMaskInterface``.
ATTN_IMPLEMENTATION = "loki"
#: Decode-time methods selectable with ``method=``.
METHODS = ("loki", "exact_topk", "pcaattn", "dense", "sparq", "h2o")
#: Methods that need the PCA basis (they read the rotated cache).
BASIS_METHODS = ("loki", "pcaattn")
SEMANTICS = ("generate", "decode")
BACKENDS = ("auto", "torch", "triton")
#: model_type -> attention module class name.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaAttention",
    "mistral": "MistralAttention",
    "qwen2": "Qwen2Attention",
    "qwen3": "Qwen3Attention",
}
# Score entries of one block of rows in the teacher-forced path (None: loki.reference.teacher_forced's default
# for the device).
_ROW_CHUNK_ELEMENTS = None


class LokiError(RuntimeError):
    """Loki attention was used in a way it does not support."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one Loki supports."""


# --------------------------------------------------------------------------------------------- settings
class _CacheOwner:
    """Identifies the ``enable_loki`` call whose basis the keys of a cache layer are stored in.  Copies of a cache
    (``copy.deepcopy``) share it, so they learn when Loki was disabled."""

    __slots__ = ("active",)

    def __init__(self):
        self.active = True

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclass
class LokiConfig:
    """The settings of one enabled model (see :func:`enable_loki`)."""

    method: str
    k: int | float
    d: int | float
    gqa_select: str = "query"
    aggregate: str = "sum"
    backend: str = "auto"
    semantics: str = "generate"
    h2o_recent_fraction: float = 0.5
    chunk_elements: int | None = _ROW_CHUNK_ELEMENTS
    prefix_dims: int | None = None  # d of the contiguous key-prefix buffer kept for the Triton path (None: none)
    components: torch.Tensor | None = None  # [L, HKV, D, D] fp32 (the basis), None for basis-free methods
    query_components: torch.Tensor | None = None  # [L, HKV, D, D] fp32 query transform of a score basis
    previous_implementation: str | None = None
    covered_positions: int | None = None  # the basis was fitted on positions below this (None: unknown)
    warned_positions: bool = False  # the warning about keys past covered_positions was given
    _per_device: dict = field(default_factory=dict, repr=False)
    # Per forward call: the cache being used (set by the pre-hook), or None without a cache.
    current_cache: Any = field(default=None, repr=False)
    intervals_cache: dict | None = field(default=None, repr=False)  # per forward: row intervals by mask
    handles: list = field(default_factory=list, repr=False)
    # The token every cache layer converted under these settings points to (inactive after disable_loki), and
    # weak references to the caches converted, which disable_loki restores.
    owner: _CacheOwner = field(default_factory=lambda: _CacheOwner(), repr=False)
    caches: list = field(default_factory=list, repr=False)

    @property
    def rotates(self) -> bool:
        return self.method in BASIS_METHODS

    def layer_basis(self, layer_idx: int, device: torch.device) -> torch.Tensor | None:
        """P (the key transform) of one layer, [HKV, D, D] fp32 on ``device`` (cached per device)."""
        return self._on_device("keys", self.components, layer_idx, device)

    def layer_query_basis(self, layer_idx: int, device: torch.device) -> torch.Tensor | None:
        """The query transform of one layer: P_q of a score basis, else P itself (orthogonal)."""
        if self.query_components is None:
            return self.layer_basis(layer_idx, device)
        return self._on_device("queries", self.query_components, layer_idx, device)

    def _on_device(self, which, tensor, layer_idx, device):
        if tensor is None:
            return None
        comps = self._per_device.get((which, device))
        if comps is None:
            comps = tensor.to(device=device, dtype=torch.float32)
            self._per_device[(which, device)] = comps
        return comps[layer_idx]


# --------------------------------------------------------------------------------------------- cache
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


_LOKI_LAYER_CLASSES: dict[type, type] = {}


def _loki_layer_class(base: type) -> type:
    if issubclass(base, LokiCacheLayer):
        return base
    cls = _LOKI_LAYER_CLASSES.get(base)
    if cls is None:
        cls = type(f"Loki{base.__name__}", (LokiCacheLayer, base), {"_layer_type": None, "__module__": __name__})
        _LOKI_LAYER_CLASSES[base] = cls
    return cls


def _convert_cache(cache, cfg: LokiConfig, num_layers: int) -> None:
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
    if not any(r() is cache for r in cfg.caches):
        cfg.caches[:] = [r for r in cfg.caches if r() is not None]
        cfg.caches.append(weakref.ref(cache))
    for idx, layer in enumerate(layers[:num_layers]):
        if isinstance(layer, LokiCacheLayer):
            if getattr(layer, "loki_owner", None) is cfg.owner:
                continue
            # converted under other settings (an earlier enable_loki): back to plain keys, then converted again
            layers[idx] = layer = _restore_layer(layer)
        if not isinstance(layer, DynamicLayer):
            raise LokiError(
                f"Loki supports DynamicCache layers (the default cache of generate); layer {idx} of the cache is a "
                f"{type(layer).__name__}. Pass no cache (or a DynamicCache) and no cache_implementation."
            )
        P = None if cfg.components is None else cfg.components[idx]
        cls = _loki_layer_class(type(layer))
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)  # same state, Loki update; the cache keeps its identity
        layers[idx] = layer = new
        layer.loki_acc = None
        layer.loki_prefix = None
        layer.loki_prefix_buf = None
        # a sliding-window layer drops keys inside its own update: no prefix buffer beside it
        layer.loki_prefix_d = None if getattr(layer, "is_sliding", False) else cfg.prefix_dims
        layer.loki_prefix_always = cfg.backend == "triton"
        layer.loki_owner = cfg.owner
        if P is not None:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                P = P.to(layer.keys.device)
                layer.keys = rotate_keys(layer.keys, P)  # tokens cached before enable_loki
            layer.loki_P = P
            # K = K_hat P^-1: P^T for an orthogonal basis, P_q^T for a score basis (P_q P_k^T = I)
            inv = P if cfg.query_components is None else cfg.query_components[idx].to(P.device)
            layer.loki_P_inv = inv.transpose(-1, -2).contiguous()
        else:
            layer.loki_P = None
            layer.loki_P_inv = None
        keys = getattr(layer, "keys", None)
        if layer.loki_prefix_d is not None and keys is not None and keys.numel() > 0 and (
                keys.is_cuda or layer.loki_prefix_always):
            layer.loki_prefix = keys[..., : layer.loki_prefix_d].contiguous()


def _restore_layer(layer):
    """A plain layer (the transformers class the Loki layer was made from) with the same state and the keys back in
    their own coordinates (``K = K_hat P^-1``, exact up to rounding); Loki's own state is dropped."""
    base = next(c for c in type(layer).__mro__[1:] if not issubclass(c, LokiCacheLayer))
    new = base.__new__(base)
    new.__dict__.update({k: v for k, v in layer.__dict__.items() if not k.startswith("loki_")})
    P_inv = getattr(layer, "loki_P_inv", None)
    keys = getattr(new, "keys", None)
    if P_inv is not None and keys is not None and keys.numel() > 0:
        new.keys = rotate_keys(keys, P_inv.to(keys.device))
    return new


def _restore_caches(cfg: LokiConfig) -> None:
    """Turn the layers of every live cache converted under ``cfg`` back into plain layers with plain keys."""
    for ref in cfg.caches:
        cache = ref()
        layers = getattr(cache, "layers", None) if cache is not None else None
        for idx, layer in enumerate(layers or []):
            if isinstance(layer, LokiCacheLayer) and getattr(layer, "loki_owner", None) is cfg.owner:
                layers[idx] = _restore_layer(layer)
    cfg.caches.clear()


def loki_cache(model) -> Any:
    """A new ``DynamicCache`` for ``model`` whose layers store keys in the model's Loki basis.

    Pass it to ``generate(..., past_key_values=cache)`` (or ``cache=`` on newer transformers) or to forward;
    without it, the cache ``generate`` builds is converted on the first forward call.
    """
    from transformers import DynamicCache

    cfg = _state(model)
    config = model.config
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    _convert_cache(cache, cfg, _num_layers(model))
    return cache


# --------------------------------------------------------------------------------------------- enable / disable
def _num_layers(model) -> int:
    return int(model.config.get_text_config(decoder=True).num_hidden_layers)


def _decoder(model):
    """The module that owns the decoder layers and receives the cache (``LlamaModel`` inside the CausalLM)."""
    base = getattr(model, "base_model", model)
    return base if base is not None else model


def _cache_parameter(decoder) -> str:
    """The name under which the decoder's forward takes the cache: ``cache`` (5.2x) or ``past_key_values``."""
    import inspect

    params = inspect.signature(decoder.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _attention_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and hasattr(m, "q_proj")]


def _check_architecture(model) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(f"{t} ({c})" for t, c in SUPPORTED_ARCHITECTURES.items())
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"Loki does not support model_type={model_type!r} ({type(model).__name__}); supported architectures: "
            f"{supported}. SmolLM models are Llama."
        )
    want = SUPPORTED_ARCHITECTURES[model_type]
    mods = _attention_modules(model)
    names = sorted({type(m).__name__ for m in mods})
    if not mods or names != [want]:
        raise UnsupportedModelError(
            f"Loki expects {want} attention modules in a {model_type} model, found {names or 'none'}; "
            f"supported architectures: {supported}"
        )


def _check_count_or_fraction(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (Integral, Real)):
        raise TypeError(f"{name} must be an int count or a float fraction in (0, 1], got {value!r}")
    if isinstance(value, Integral):
        if int(value) < 1:
            raise ValueError(f"{name}={value} is out of range: a count must be at least 1")
    else:
        f = float(value)
        if math.isnan(f) or not 0.0 < f <= 1.0:
            raise ValueError(f"{name}={value} is out of range: a fraction must lie in (0, 1]")


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, loki_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _state(model) -> LokiConfig:
    cfg = getattr(model, "_loki_config", None)
    if cfg is None:
        raise LokiError("Loki is not enabled on this model (call enable_loki first)")
    return cfg


def is_loki_enabled(model) -> bool:
    return getattr(model, "_loki_config", None) is not None


def enable_loki(
    model,
    basis=None,
    k: int | float = 0.25,
    d: int | float = 0.25,
    *,
    method: str = "loki",
    gqa_select: str = "query",
    aggregate: str = "sum",
    backend: str = "auto",
    semantics: str = "generate",
    h2o_recent_fraction: float = 0.5,
    model_name: str | None = None,
):
    """Switch ``model`` (a Llama/Mistral/Qwen2/Qwen3 ``*ForCausalLM`` or base model) to Loki attention.

    Args:
        basis: a :class:`loki.basis.PCABasis` (or a path to one) calibrated on this model; required for
            ``method`` "loki" and "pcaattn", ignored otherwise.  It is validated against ``model.config``:
            a basis of another model raises :class:`loki.basis.BasisError`.
        k: tokens attended per decode step: an int count or a float fraction (of each sequence's valid length,
            at least 1).
        d: leading principal dims for the approximate scores (SparQ's ``r`` for ``method="sparq"``): an int
            count (<= D) or a float fraction of D.
        method: one of :data:`METHODS`.
        gqa_select: "query" (each query head selects its own tokens) or "kv" (one selection per KV head from the
            group's scores combined by ``aggregate``: "sum" or "max").
        backend: "auto" (Triton kernel on CUDA, PyTorch elsewhere), "torch" or "triton" for the Loki decode step.
        semantics: "generate" (dense prefill, sparse decode steps) or "decode" (every query row attends like a
            decode step over the tokens it sees; for loglikelihood and perplexity evaluation).
        h2o_recent_fraction: H2O's share of the budget given to the most recent tokens.

    Returns ``model`` (modified in place).  Calling it again replaces the previous settings.
    """
    _check_architecture(model)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if gqa_select not in ("query", "kv"):
        raise ValueError(f"gqa_select must be 'query' or 'kv', got {gqa_select!r}")
    if aggregate not in ("sum", "max"):
        raise ValueError(f"aggregate must be 'sum' or 'max', got {aggregate!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if method == "h2o" and semantics == "decode":
        raise ValueError("method='h2o' keeps state across decode steps and supports semantics='generate' only")
    if isinstance(h2o_recent_fraction, bool) or not isinstance(h2o_recent_fraction, Real):
        raise TypeError(f"h2o_recent_fraction must be a number in [0, 1], got {h2o_recent_fraction!r}")
    if not 0.0 <= float(h2o_recent_fraction) <= 1.0:
        raise ValueError(f"h2o_recent_fraction={h2o_recent_fraction} must lie in [0, 1]")
    _check_count_or_fraction("k", k)
    _check_count_or_fraction("d", d)
    if backend == "triton":
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            check_triton_device(device, "backend='triton'")
        except RuntimeError as exc:
            raise ValueError(f"{exc} (the model is on {device})") from None
    from ..basis import PCABasis, config_head_dim

    D = config_head_dim(model.config)
    resolve_d(d, D, name="d")
    resolve_k(k, torch.ones(1, dtype=torch.long), 1 << 62, name="k")

    components = query_components = None
    if method in BASIS_METHODS:
        if basis is None:
            raise ValueError(f"method={method!r} needs a PCA basis (basis=PCABasis or a path to one)")
        if not isinstance(basis, (PCABasis, str, os.PathLike)):
            raise TypeError(f"basis must be a PCABasis or the path of a basis file, got {type(basis).__name__}")
        if not isinstance(basis, PCABasis):
            basis = PCABasis.load(basis, config=model.config, model_name=model_name)
        else:
            basis.validate(model.config, model_name=model_name)
        components = basis.components.detach().to(torch.float32)
        if basis.query_components is not None:
            query_components = basis.query_components.detach().to(torch.float32)

    if is_loki_enabled(model):
        disable_loki(model)
    _register()
    cfg = LokiConfig(
        method=method, k=k, d=d, gqa_select=gqa_select, aggregate=aggregate, backend=backend,
        semantics=semantics, h2o_recent_fraction=float(h2o_recent_fraction), components=components,
        prefix_dims=resolve_d(d, D) if method == "loki" and backend != "torch" else None,
        query_components=query_components,
        previous_implementation=getattr(model.config, "_attn_implementation", None),
        covered_positions=basis.covered_positions if components is not None else None,
    )
    num_layers = _num_layers(model)
    decoder = _decoder(model)

    cache_param = _cache_parameter(decoder)

    def pre_hook(module, args, kwargs):
        present = [n for n in ("cache", "past_key_values") if kwargs.get(n) is not None]
        cache = kwargs[present[0]] if present else None
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = bool(getattr(module.config, "use_cache", True))
        if cache is None and not use_cache and cfg.semantics == "generate" and cfg.method != "dense":
            # Refused rather than run: without a cache every forward is a prefill, which semantics="generate"
            # computes densely, so generate(..., use_cache=False) would silently be dense attention.
            raise LokiError(
                f"use_cache=False: Loki (method={cfg.method!r}, semantics='generate') runs its sparse attention in "
                "the decode steps over the KV cache; without a cache every forward is a dense prefill, so "
                "generate(..., use_cache=False) would silently run dense attention. Pass use_cache=True (the "
                "default), or enable_loki(..., semantics='decode') to make every row of a cache-less forward "
                "attend like a decode step"
            )
        if cache is None and use_cache:
            from transformers import DynamicCache

            cache = DynamicCache(config=module.config.get_text_config(decoder=True))
            kwargs[cache_param] = cache
        if cache is not None:
            _convert_cache(cache, cfg, num_layers)
        cfg.current_cache = cache
        cfg.intervals_cache = {}
        return args, kwargs

    def post_hook(module, args, kwargs, output):
        cfg.current_cache = None
        cfg.intervals_cache = None
        return output

    cfg.handles = [
        decoder.register_forward_pre_hook(pre_hook, with_kwargs=True),
        decoder.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
    ]
    for m in _attention_modules(model):
        m._loki_config = cfg
    model._loki_config = cfg
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def disable_loki(model):
    """Undo :func:`enable_loki`: remove the hooks and restore the attention implementation of before.

    The caches used with the model while Loki was enabled are restored in place: their layers become plain
    transformers layers again and their keys, stored in the PCA basis, are rotated back (exact up to rounding),
    so a cache can be reused with the model after ``disable_loki``.  A copy of such a cache that the model never
    saw refuses to grow (``LokiError``) instead of mixing rotated and plain keys.
    """
    cfg = getattr(model, "_loki_config", None)
    if cfg is None:
        return model
    _restore_caches(cfg)
    cfg.owner.active = False
    for h in cfg.handles:
        h.remove()
    for m in _attention_modules(model):
        if getattr(m, "_loki_config", None) is cfg:
            del m._loki_config
    del model._loki_config
    model.set_attn_implementation(cfg.previous_implementation or "sdpa")
    return model


# --------------------------------------------------------------------------------------------- attention math
def _rotate_rows(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """x: [B, HQ, L, D] -> x P per KV head (query heads of a group share their KV head's basis)."""
    B, HQ, L, D = x.shape
    flat = x.transpose(1, 2).reshape(B * L, HQ, D)
    return rotate_query(flat, P).reshape(B, L, HQ, D).transpose(1, 2)


def _allowed_mask(attention_mask, B: int, L: int, S: int, device) -> torch.Tensor:
    """[B, L, S] bool, True = query row may attend to the key (causal, padding, windows)."""
    if attention_mask is None:
        q_pos = torch.arange(L, device=device)[:, None] + (S - L)
        return (torch.arange(S, device=device)[None, :] <= q_pos).expand(B, L, S)
    m = attention_mask
    if m.dim() == 4:
        if m.shape[1] != 1:
            raise LokiError(f"per-head attention masks are not supported, got shape {list(m.shape)}")
        m = m[:, 0]
    if m.dim() != 3:
        raise LokiError(f"expected a [B, 1, L, S] attention mask, got shape {list(attention_mask.shape)}")
    if m.dtype != torch.bool:
        m = m == 0  # additive float mask: 0 = attend
    m = m[..., -S:] if m.shape[-1] > S else m
    return m.expand(B, L, S)


def _row_intervals(allowed: torch.Tensor):
    """starts, lengths ([B, L] int64) of each row's attended tokens, and the rows that attend to none."""
    S = allowed.shape[-1]
    pos = torch.arange(S, device=allowed.device)
    any_ = allowed.any(-1)
    starts = torch.where(allowed, pos, S).amin(-1)
    lengths = torch.where(allowed, pos + 1, 0).amax(-1)
    count = allowed.sum(-1)
    if bool(((lengths - starts != count) & any_).any()):
        raise LokiError(
            "Loki needs each query's visible tokens to be one contiguous range, and the attention mask has holes. "
            "Pad batches on the left (tokenizer.padding_side='left'): with right padding, the tokens generated "
            "after a padded prompt leave the padding in the middle of the sequence"
        )
    starts = torch.where(any_, starts, 0)
    lengths = torch.where(any_, lengths, 1)
    return starts, lengths, any_


def _loki_decode(q_hat, k_hat, v, *, d, k, lengths, starts, gqa_select, aggregate, scale, backend, k_prefix=None):
    """One decode step of Loki through ``loki.kernels.decode_attention`` (torch or Triton backend; the Triton
    path reads the approximate scores from the cache's contiguous key prefix when one is kept)."""
    from ..kernels.decode import decode_attention

    backend = "triton" if _triton_backend(backend, q_hat) else "torch"
    extra = {"k_prefix": k_prefix} if backend == "triton" and k_prefix is not None else {}
    # lengths and starts come from _row_intervals (checked there): no second check, no host sync
    return decode_attention(q_hat, k_hat, v, d=d, k=k, lengths=lengths, starts=starts, backend=backend,
                            gqa_select=gqa_select, aggregate=aggregate, scale=scale, check_values=False, **extra)


def _decode_rows(method, q, kc, vc, *, k, d, lengths, starts, gqa_select, aggregate, scale, backend,
                 acc=None, recent_fraction=0.5, k_prefix=None):
    """Dispatch one batch of decode-step rows. q: [R, HQ, D]; kc, vc: [R, HKV, S, D]; lengths, starts: [R]."""
    S = kc.shape[2]
    kk = min(int(k), S) if isinstance(k, Integral) else k
    lengths = lengths.to(torch.int32)
    starts = starts.to(torch.int32)
    if method == "loki":
        return _loki_decode(q, kc, vc, d=d, k=kk, lengths=lengths, starts=starts, gqa_select=gqa_select,
                            aggregate=aggregate, scale=scale, backend=backend, k_prefix=k_prefix)
    if method == "exact_topk":
        return exact_topk_attention(q, kc, vc, k=kk, lengths=lengths, starts=starts, gqa_select=gqa_select,
                                    aggregate=aggregate, scale=scale)
    if method == "pcaattn":
        return pcaattn_attention(q, kc, vc, d=d, lengths=lengths, starts=starts, scale=scale)
    if method == "dense":
        return dense_attention(q, kc, vc, lengths, starts, scale=scale)
    if method == "sparq":
        return sparq_attention(q, kc, vc, r=d, k=kk, lengths=lengths, starts=starts, scale=scale)
    if method == "h2o":
        return h2o_attention(q, kc, vc, acc, k=kk, lengths=lengths, starts=starts, scale=scale,
                             recent_fraction=recent_fraction, return_weights=True)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def teacher_forced_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    method: str = "loki",
    k: int | float = 1.0,
    d: int | float = 1.0,
    P: torch.Tensor | None = None,
    P_q: torch.Tensor | None = None,
    keys_rotated: bool = False,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    gqa_select: str = "query",
    aggregate: str = "sum",
    backend: str = "auto",
    chunk_elements: int | None = _ROW_CHUNK_ELEMENTS,
    k_prefix: torch.Tensor | None = None,
    intervals_cache: dict | None = None,
) -> torch.Tensor:
    """Attention of every query row with decode-time semantics (teacher forcing).

    Row ``i`` (absolute position ``S - L + i``) attends like a decode step over the tokens it sees: with a
    causal mask and no padding, the ``S - L + i + 1`` first tokens, of which a fractional ``k`` selects
    ``ceil(k * (S - L + i + 1))``.  Several rows are computed at once as masked attention
    (:func:`loki.reference.teacher_forced.teacher_forced_rows`, blocks of at most ``chunk_elements`` scores).

    query: [B, HQ, L, D] (post-rotary, original coordinates); key, value: [B, HKV, S, D] (post-rotary keys,
    already in the basis when ``keys_rotated``); P: [HKV, D, D] basis of this layer (needed for "loki" and
    "pcaattn"); P_q: the query transform of a score basis (default P, an orthogonal basis);
    attention_mask: optional [B, 1, L, S] bool (True = attend) or additive float mask, default causal;
    every row's visible tokens must be one contiguous range.  Returns [B, HQ, L, D] in query's dtype; rows that
    see no token return zeros.  ``method="h2o"`` is not supported (it is sequential by nature).
    ``k_prefix``: optional [B, HKV, S, dp] contiguous copy of the rotated keys' first dims, used by the Triton
    Loki path on single-row (decode) calls.  ``intervals_cache``: a dict kept for one model forward, in which
    the rows' visible ranges are computed (and checked, one host sync) once per attention mask, not per layer.
    """
    B, HQ, L, D = query.shape
    _, HKV, S, _ = key.shape
    if method == "h2o":
        raise ValueError("teacher_forced_attention does not support method='h2o'")
    if P_q is None:
        P_q = P
    if method in BASIS_METHODS:
        if P is None:
            raise ValueError(f"method={method!r} needs the layer's basis P [HKV, D, D]")
        q_use = _rotate_rows(query, P_q)
        k_use = key if keys_rotated else rotate_keys(key, P)
    else:
        if keys_rotated:
            if P is None:
                raise ValueError("keys_rotated=True needs P to rotate the queries")
            q_use = _rotate_rows(query, P_q)  # Lemma 1: exact and dense scores are invariant
        else:
            q_use = query
        k_use = key
    if method == "sparq" and keys_rotated:
        raise ValueError("SparQ works in the keys' own coordinates; pass unrotated keys")
    starts, lengths, any_ = _mask_intervals(attention_mask, B, L, S, query.device, intervals_cache)  # [B, L]
    if L == 1:  # plain decode step: the cache in place, no row gather, no host sync
        kp = k_prefix[:, :, :S] if k_prefix is not None else None
        o = _decode_rows(method, q_use[:, :, 0], k_use, value, k=k, d=d, lengths=lengths[:, 0], starts=starts[:, 0],
                         gqa_select=gqa_select, aggregate=aggregate, scale=scale, backend=backend, k_prefix=kp)
        o = o.to(query.dtype)[:, :, None]
        if any_ is not None:
            o = o.masked_fill(~any_[:, None, :, None], 0)
        return o
    # rows that see no token come back as zeros
    return teacher_forced_rows(q_use, k_use, value, starts, lengths, method=method, k_budget=k, d=d, scale=scale,
                               gqa_select=gqa_select, aggregate=aggregate, block_elements=chunk_elements)


def _mask_intervals(attention_mask, B: int, L: int, S: int, device, memo: dict | None):
    """starts, lengths ([B, L]) and the rows that see a token (None: all) of an attention mask, computed (and
    checked, one host sync) once per mask object within a model forward when ``memo`` is that forward's dict;
    no mask work at all for a decode step without a mask."""
    if attention_mask is None and L == 1:
        return (torch.zeros(B, 1, dtype=torch.long, device=device),
                torch.full((B, 1), S, dtype=torch.long, device=device), None)
    key = (id(attention_mask), B, L, S, device)
    hit = None if memo is None else memo.get(key)
    if hit is not None and hit[0] is attention_mask:
        return hit[1]
    res = _row_intervals(_allowed_mask(attention_mask, B, L, S, device))
    if memo is not None:
        memo[key] = (attention_mask, res)  # the mask is kept alive with its entry: its id stays unique
    return res


def _triton_backend(backend: str, query: torch.Tensor) -> bool:
    """Whether a decode step with this ``backend`` setting runs the Triton kernels ("auto": on CUDA tensors that
    need no gradient; the kernels have no backward)."""
    if backend == "triton":
        return True
    return backend == "auto" and query.is_cuda and not (torch.is_grad_enabled() and query.requires_grad)


def _check_triton_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """backend='triton' at forward time: a device the kernels run on, and no gradient wanted."""
    try:
        check_triton_device(query, "enable_loki(backend='triton')")
        check_no_grad("Loki's Triton decode step (enable_loki(backend='triton'))", query=query, key=key,
                      value=value)
    except RuntimeError as exc:
        raise LokiError(str(exc)) from None


def _loki_decode_fast(cfg, query, key, value, attention_mask, P_q, scale, prefix):
    """One decode step (L = 1) of Loki on the Triton kernels with as little host work as possible: the rows'
    visible ranges, per-sequence budgets and the selection bound are computed once per forward (every layer
    shares them) and the kernels are called through ``loki_decode_step`` (whose recorded launches replay from
    the third layer of a step on).  Same result as ``teacher_forced_attention`` on this path.
    Returns [B, 1, HQ, D]."""
    from ..kernels.decode import loki_decode_step, selection_bound
    from ..reference import budget

    B, HQ, _, D = query.shape
    S = key.shape[2]
    memo = cfg.intervals_cache if cfg.intervals_cache is not None else {}
    mkey = ("decode", id(attention_mask), B, S, query.device)
    hit = memo.get(mkey)
    if hit is None or hit[0] is not attention_mask:
        st, ln, any_ = _mask_intervals(attention_mask, B, 1, S, query.device, memo)
        starts, lengths = st[:, 0].to(torch.int32), ln[:, 0].to(torch.int32)
        any_ = None if any_ is None else any_[:, 0]
        counts = budget(cfg.k, lengths, starts, B, S, query.device)
        # the selection width rounded up to a multiple of 16 (entries past each count are -1 and never read): a
        # growing cache then keeps the same Triton specialisation of the index rows' stride
        K = min(S, -(-selection_bound(cfg.k, S) // 16) * 16)
        hit = (attention_mask, starts, lengths, any_, counts, K, resolve_d(cfg.d, D))
        memo[mkey] = hit
    _, starts, lengths, any_, counts, K, dd = hit
    q_hat = _rotate_rows(query, P_q)[:, :, 0]  # [B, HQ, D]
    _, out = loki_decode_step(q_hat, key, value, lengths, starts, counts, d=dd, k_max=K, gqa_select=cfg.gqa_select,
                              aggregate=cfg.aggregate, scale=scale, select_method="triton", k_prefix=prefix)
    if any_ is not None:
        out = out.masked_fill(~any_[:, None, None], 0)
    return out.to(query.dtype)[:, None]


def _dense_prefill(query, key, value, allowed, scale, want_weights=False):
    """Dense attention with a [B, L, S] bool mask; fully masked rows give zeros. Returns [B, HQ, L, D]."""
    HQ = query.shape[1]
    k_rep = expand_to_query_heads(key, HQ)
    v_rep = expand_to_query_heads(value, HQ)
    any_ = allowed.any(-1)  # [B, L]
    if want_weights:
        s = torch.matmul(query.float(), k_rep.float().transpose(-1, -2)) * scale
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out = torch.matmul(p, v_rep.float()).to(query.dtype)
        return out, p
    out = torch.nn.functional.scaled_dot_product_attention(query, k_rep, v_rep, attn_mask=allowed[:, None],
                                                           scale=scale)
    return out.masked_fill(~any_[:, None, :, None], 0), None


def loki_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as ``"loki"`` (transformers' AttentionInterface signature).

    query: [B, HQ, L, D]; key, value: [B, HKV, S, D] (post-rotary, including the cache; keys are in the PCA
    basis when the cache is a Loki cache of a basis method); attention_mask: [B, 1, L, S] bool or None.
    Returns (out [B, L, HQ, D], None).
    """
    cfg: LokiConfig | None = getattr(module, "_loki_config", None)
    if cfg is None:
        raise LokiError(
            f"{type(module).__name__} runs with attn_implementation='loki' but Loki is not enabled on its model "
            "(two models sharing one config object? deep-copy the config, or call enable_loki on this model)"
        )
    B, HQ, L, D = query.shape
    S = key.shape[2]
    layer_idx = module.layer_idx
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(D)
    if cfg.covered_positions is not None and S > cfg.covered_positions and not cfg.warned_positions:
        cfg.warned_positions = True
        warnings.warn(
            f"the KV cache holds {S} tokens but the Loki basis was calibrated on positions below "
            f"{cfg.covered_positions}: post-rotary keys past them are described less well (calibrate with "
            f"max_positions >= the longest context used)", RuntimeWarning, stacklevel=2)
    cache = cfg.current_cache
    layer = cache.layers[layer_idx] if cache is not None and layer_idx < len(cache.layers) else None
    keys_rotated = layer is not None and getattr(layer, "loki_P", None) is not None
    P = cfg.layer_basis(layer_idx, query.device) if (cfg.rotates or keys_rotated) else None
    P_q = cfg.layer_query_basis(layer_idx, query.device) if P is not None else None

    if L > 1 and cfg.semantics == "generate" or cfg.method == "dense" and cfg.semantics == "generate":
        allowed = _allowed_mask(attention_mask, B, L, S, query.device)
        q_use = _rotate_rows(query, P_q) if keys_rotated else query
        want = cfg.method == "h2o"
        out, p = _dense_prefill(q_use, key, value, allowed, scale, want_weights=want)
        if want:
            if layer is None:
                raise LokiError("method='h2o' needs a KV cache (use_cache=True)")
            acc = p.sum(dim=2)  # [B, HQ, S]: attention each token received
            prev = layer.loki_acc
            if prev is not None and prev.shape[-1] == S - L:
                acc[..., : S - L] += prev
            layer.loki_acc = acc
        return out.transpose(1, 2).contiguous(), None

    if cfg.method == "h2o":
        if layer is None:
            raise LokiError("method='h2o' needs a KV cache (use_cache=True)")
        if getattr(layer, "is_sliding", False):
            raise LokiError("method='h2o' is not supported with sliding-window caches")
        starts, lengths, _ = _row_intervals(_allowed_mask(attention_mask, B, L, S, query.device))
        acc = layer.loki_acc
        if acc is None or acc.shape[-1] > S:
            acc = torch.zeros(B, HQ, S, device=query.device, dtype=torch.float32)
        elif acc.shape[-1] < S:
            acc = torch.nn.functional.pad(acc, (0, S - acc.shape[-1]))
        out, w = _decode_rows("h2o", query[:, :, 0], key, value, k=cfg.k, d=cfg.d, lengths=lengths[:, 0],
                              starts=starts[:, 0], gqa_select=cfg.gqa_select, aggregate=cfg.aggregate,
                              scale=scale, backend=cfg.backend, acc=acc, recent_fraction=cfg.h2o_recent_fraction)
        layer.loki_acc = acc + w
        return out[:, None].contiguous(), None

    if cfg.backend == "triton" and cfg.method == "loki":
        _check_triton_inputs(query, key, value)
    prefix = getattr(layer, "loki_prefix", None) if L == 1 and keys_rotated else None
    if prefix is not None and prefix.shape[-2] != S:
        prefix = None  # out of step with the keys (e.g. a cache edited outside Loki): read the keys in place
    if (L == 1 and cfg.method == "loki" and keys_rotated and P_q is not None
            and _triton_backend(cfg.backend, query)):
        return _loki_decode_fast(cfg, query, key, value, attention_mask, P_q, scale, prefix), None
    out = teacher_forced_attention(
        query, key, value, method=cfg.method, k=cfg.k, d=cfg.d, P=P, P_q=P_q, keys_rotated=keys_rotated,
        attention_mask=attention_mask, scale=scale, gqa_select=cfg.gqa_select, aggregate=cfg.aggregate,
        backend=cfg.backend, chunk_elements=cfg.chunk_elements, k_prefix=prefix,
        intervals_cache=cfg.intervals_cache,
    )
    return out.transpose(1, 2).contiguous(), None

