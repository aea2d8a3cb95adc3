"""Capturing the keys of a Hugging Face causal LM, before and after the rotary embedding.

Shape letters: B = batch, S = sequence length, L = decoder layers, HKV = key/value heads, D = head dim.

* **pre-rotary** keys are what enters the rotary function: a forward hook on each layer's ``self_attn.k_proj``
  (its output, bias included, reshaped to ``[B, S, HKV, D]``).  Architectures that normalise keys before the
  rotary embedding (``self_attn.k_norm``, e.g. Qwen3) are hooked on ``k_norm`` instead.
* **post-rotary** keys are what the KV cache stores: the model runs with a fresh, unbounded
  :class:`transformers.DynamicCache` and the keys are read from ``cache.layers[l].keys`` (``[B, HKV, S, D]``)
  after the forward pass (a cache without config has no sliding-window layers, so every key is kept).

Keys stay in memory for one batch only; nothing is written to disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loki._hf import SUPPORTED_ARCHITECTURES, cache_keyword, config_head_dim, config_kv_heads

# SUPPORTED_ARCHITECTURES: the architectures calibration is tested on (loki._hf); any decoder with
# ``model.layers[i].self_attn.k_proj`` and a rotary embedding in the same layout works.


@dataclass
class KeyLayout:
    """Where the keys of ``model`` live: its decoder (base model), attention modules and key shape."""

    base: nn.Module
    attentions: list[nn.Module]
    num_kv_heads: int
    head_dim: int

    @property
    def num_layers(self) -> int:
        return len(self.attentions)


def _unsupported(model: nn.Module, why: str) -> ValueError:
    name = type(model).__name__
    return ValueError(
        f"model is not supported ({name}: {why}); key calibration needs a decoder with rotary embeddings and "
        f"`model.layers[i].self_attn.k_proj`, as in {', '.join(a.causal_lm for a in SUPPORTED_ARCHITECTURES.values())}"
        " (SmolLM is Llama)"
    )


def key_layout(model: nn.Module) -> KeyLayout:
    """Locate the decoder layers and key projections of a causal LM.

    Raises:
        ValueError: the model has no decoder layers with ``self_attn.k_proj`` or no rotary embedding, with a
            message listing the supported architectures.
    """
    base = getattr(model, "base_model", None)
    if base is None:
        base = model
    layers = getattr(base, "layers", None)
    if layers is None and hasattr(model, "get_decoder"):
        try:
            base = model.get_decoder()
            layers = getattr(base, "layers", None)
        except (AttributeError, NotImplementedError):
            layers = None
    if layers is None or len(layers) == 0:
        raise _unsupported(model, "no `layers` list of decoder layers")
    attentions = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not isinstance(getattr(attn, "k_proj", None), nn.Module):
            raise _unsupported(model, f"layer {i} has no `self_attn.k_proj`")
        attentions.append(attn)
    has_rotary = hasattr(base, "rotary_emb") or any(hasattr(a, "rotary_emb") for a in attentions)
    if not has_rotary:
        raise _unsupported(model, "no rotary embedding (`rotary_emb`)")
    head_dim = getattr(attentions[0], "head_dim", None) or config_head_dim(model.config)
    return KeyLayout(base=base, attentions=attentions, num_kv_heads=config_kv_heads(model.config),
                     head_dim=int(head_dim))


class PreRotaryKeyHooks:
    """Context manager: forward hooks that keep each layer's pre-rotary keys of the latest forward pass.

    After a forward pass ``hooks.keys[l]`` is ``[B, S, HKV, D]`` in the model's dtype (``k_norm`` output when the
    attention module has one, else ``k_proj`` output).
    """

    def __init__(self, layout: KeyLayout):
        self.layout = layout
        self.keys: list[torch.Tensor | None] = [None] * layout.num_layers
        self._handles: list = []

    def _hook(self, layer: int):
        D = self.layout.head_dim

        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.keys[layer] = out.detach().reshape(*out.shape[:2], -1, D)

        return hook

    def __enter__(self) -> PreRotaryKeyHooks:
        for l, attn in enumerate(self.layout.attentions):
            k_norm = getattr(attn, "k_norm", None)
            target = k_norm if isinstance(k_norm, nn.Module) else attn.k_proj
            self._handles.append(target.register_forward_hook(self._hook(l)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        self.keys = [None] * self.layout.num_layers


def cache_keys(cache, layer: int) -> torch.Tensor:
    """Keys ``[B, HKV, S, D]`` stored in ``cache`` for ``layer`` (transformers 5.x ``cache.layers[l].keys``)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        keys = layers[layer].keys
    else:  # older cache API
        keys = cache.key_cache[layer]
    if keys is None:
        raise RuntimeError(f"the KV cache holds no keys for layer {layer}")
    return keys


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``position_ids [B, S]``: 0, 1, ... over the real tokens of each row (padding gets 0), so a left-padded
    row has the same rotary phases as the same row without padding."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)


@torch.no_grad()
def batch_keys(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    rotary: str = "both",
    layout: KeyLayout | None = None,
) -> dict[str, list[torch.Tensor]]:
    """Run one forward pass and return the keys of every layer, ``{"pre"|"post": [L x [B, S, HKV, D]]}``.

    ``input_ids: [B, S]``; ``attention_mask: [B, S]`` (1 = token, 0 = padding; left or right padding).  Positions
    are computed from the mask (:func:`positions_from_mask`).  Keys at padded positions are returned too: select
    real tokens with ``keys[attention_mask.bool()]``.  ``rotary`` is "pre", "post" or "both".
    """
    if rotary not in ("pre", "post", "both"):
        raise ValueError(f"rotary must be 'pre', 'post' or 'both', got {rotary!r}")
    layout = layout or key_layout(model)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [B, S], got {list(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {list(input_ids.shape)}, got {list(attention_mask.shape)}"
        )
    want_pre = rotary in ("pre", "both")
    want_post = rotary in ("post", "both")
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions_from_mask(attention_mask),
        use_cache=want_post,
    )
    cache = None
    if want_post:
        from transformers import DynamicCache

        cache = DynamicCache()
        kwargs[cache_keyword(layout.base)] = cache
    result: dict[str, list[torch.Tensor]] = {}
    hooks = PreRotaryKeyHooks(layout)
    if want_pre:
        with hooks:
            layout.base(**kwargs)
        missing = [l for l, k in enumerate(hooks.keys) if k is None]
        if missing:
            raise RuntimeError(f"the k_proj hooks did not fire for layers {missing}")
        result["pre"] = list(hooks.keys)
    else:
        layout.base(**kwargs)
    if want_post:
        S = input_ids.shape[1]
        post = []
        for l in range(layout.num_layers):
            keys = cache_keys(cache, l)
            if keys.shape[-2] != S:
                raise RuntimeError(f"the KV cache of layer {l} holds {keys.shape[-2]} positions, expected {S}")
            post.append(keys.transpose(1, 2))  # [B, S, HKV, D]
        result["post"] = post
    return result


class AttentionRecorder:
    """Context manager: run ``model`` with a temporary attention function (transformers' AttentionInterface)
    that hands every layer's post-rotary ``query [B, HQ, S, D]`` and ``key [B, HKV, S, D]`` to
    ``callback(layer, query, key)`` and then computes causal attention itself (SDPA), so the model's outputs
    are unchanged.  Set ``recorder.valid`` ([B, S] bool, True = real token) before a padded forward pass; the
    previous attention implementation is restored on exit.
    """

    NAME = "loki_attention_recorder"

    def __init__(self, model: nn.Module, callback):
        self.model, self.callback = model, callback
        self.valid: torch.Tensor | None = None
        self._previous = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        self.callback(int(module.layer_idx), query, key)
        B, HQ, S, _ = query.shape
        G = HQ // key.shape[1]
        k, v = key.repeat_interleave(G, dim=1), value.repeat_interleave(G, dim=1)
        if self.valid is None:  # no padding: the causal kernel, no S x S mask in memory
            out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        else:
            causal = torch.ones(S, S, dtype=torch.bool, device=query.device).tril()
            mask = causal[None, None] & self.valid[:, None, None, :]
            out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    def __enter__(self) -> AttentionRecorder:
        from transformers import AttentionInterface

        AttentionInterface.register(self.NAME, self)
        self._previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.NAME)
        return self

    def __exit__(self, *exc) -> None:
        self.model.set_attn_implementation(self._previous)

