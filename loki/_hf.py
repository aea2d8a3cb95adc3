"""The one adapter to Hugging Face transformers models and configs, shared by the basis, calibration, the
integration and the evaluation: the supported architectures, a config's head dim / KV heads / layer count and
fingerprint, the decoder and attention modules of a model, and the keyword its forward takes the cache under.

Nothing here imports transformers: configs and models are read through their attributes.

Shape letters: L = decoder layers, HKV = key/value heads, D = head dim.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from types import MappingProxyType
from typing import Any, NamedTuple

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Architecture",
    "attention_modules",
    "attention_windows",
    "cache_keyword",
    "config_fields",
    "config_fingerprint",
    "config_head_dim",
    "config_identity",
    "config_kv_heads",
    "config_model_name",
    "config_num_layers",
    "decoder",
    "forward_argument",
    "expected_shape",
    "text_config",
]


class Architecture(NamedTuple):
    """The transformers classes of one supported ``model_type``."""

    causal_lm: str  # the *ForCausalLM class
    attention: str  # the attention module class of its decoder layers


#: model_type -> its transformers classes: the architectures Loki supports (attention modules with rotary
#: embeddings and a KV cache of post-rotary keys).  SmolLM models are Llama.
SUPPORTED_ARCHITECTURES = MappingProxyType({
    "llama": Architecture("LlamaForCausalLM", "LlamaAttention"),
    "mistral": Architecture("MistralForCausalLM", "MistralAttention"),
    "qwen2": Architecture("Qwen2ForCausalLM", "Qwen2Attention"),
    "qwen3": Architecture("Qwen3ForCausalLM", "Qwen3Attention"),
})


# --------------------------------------------------------------------------------------------- configs
def text_config(config):
    """The decoder's text config of ``config`` (itself for a plain decoder config)."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter(decoder=True)
        except TypeError:
            return getter()
    return config


def config_head_dim(config) -> int:
    """D of ``config``: ``head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    config = text_config(config)
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(config.hidden_size) // int(config.num_attention_heads)


def config_kv_heads(config) -> int:
    """HKV of ``config`` (``num_key_value_heads``, falling back to ``num_attention_heads``)."""
    config = text_config(config)
    hkv = getattr(config, "num_key_value_heads", None)
    return int(hkv if hkv else config.num_attention_heads)


def config_num_layers(config) -> int:
    """L of ``config`` (``num_hidden_layers`` of its text config)."""
    return int(text_config(config).num_hidden_layers)


def expected_shape(config) -> tuple[int, int, int]:
    """``(L, HKV, D)`` that a basis for ``config`` must have."""
    return (config_num_layers(config), config_kv_heads(config), config_head_dim(config))


def _rope_fields(config) -> Any:
    rope = getattr(config, "rope_parameters", None)
    if rope:
        return rope
    return {"rope_theta": getattr(config, "rope_theta", None), "rope_scaling": getattr(config, "rope_scaling", None)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 500000 and 500000.0 (config JSON vs. code defaults) hash alike
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    return str(value)


def config_fields(config) -> dict[str, Any]:
    """The architecture-relevant fields of ``config`` that :func:`config_fingerprint` hashes."""
    config = text_config(config)
    return _jsonable(
        {
            "model_type": getattr(config, "model_type", None),
            "num_hidden_layers": getattr(config, "num_hidden_layers", None),
            "num_attention_heads": getattr(config, "num_attention_heads", None),
            "num_key_value_heads": config_kv_heads(config),
            "head_dim": config_head_dim(config),
            "hidden_size": getattr(config, "hidden_size", None),
            "rope": _rope_fields(config),
            "vocab_size": getattr(config, "vocab_size", None),
        }
    )


def config_fingerprint(config) -> str:
    """sha256 (hex) of the canonical JSON of :func:`config_fields` of a transformers config.

    Two configs with the same architecture fields (model type, layer/head counts, head dim, hidden size, rotary
    parameters, vocabulary size) share a fingerprint; a different ``rope_theta`` changes it.
    """
    blob = json.dumps(config_fields(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def config_model_name(config) -> str:
    """A readable name for ``config``: ``name_or_path`` when set, else its ``model_type``."""
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    return str(name) if name else str(getattr(config, "model_type", "unknown model"))


def config_identity(config, model_name: str | None = None) -> dict[str, Any]:
    """The metadata that ties a basis to ``config`` (``model_name``, ``config_hash``, ``config_fields``; all None
    without a config, except a ``model_name`` given)."""
    if config is None:
        return {"model_name": model_name, "config_hash": None, "config_fields": None}
    return {"model_name": model_name if model_name is not None else config_model_name(config),
            "config_hash": config_fingerprint(config), "config_fields": config_fields(config)}


# --------------------------------------------------------------------------------------------- models
def decoder(model):
    """The module that owns the decoder layers and receives the cache (``LlamaModel`` inside the CausalLM)."""
    base = getattr(model, "base_model", model)
    return base if base is not None else model


def attention_modules(model) -> list:
    """The attention modules of ``model``'s decoder layers, in layer order."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and hasattr(m, "q_proj")]


def cache_keyword(module) -> str:
    """The keyword under which ``module``'s forward takes the KV cache: ``cache`` (transformers 5.2x) or
    ``past_key_values``."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def attention_windows(model) -> list:
    """The sliding window of every attention module of ``model``, in layer order (None: full attention): the
    module's own ``sliding_window`` where it keeps one (Qwen2, Qwen3: per layer type), else the config's for
    Mistral (all its layers attend through ``config.sliding_window`` when set), else None (Llama)."""
    config = text_config(model.config)
    out = []
    for m in attention_modules(model):
        if hasattr(m, "sliding_window"):
            w = m.sliding_window
        elif getattr(config, "model_type", None) == "mistral":
            w = getattr(config, "sliding_window", None)
        else:
            w = None
        out.append(int(w) if w else None)
    return out


def forward_argument(module, name: str, args: tuple, kwargs: dict):
    """The value of ``module.forward``'s argument ``name`` in a call ``(args, kwargs)`` (a forward pre-hook's
    view), or None when it was not passed."""
    if name in kwargs:
        return kwargs[name]
    params = list(inspect.signature(module.forward).parameters)
    if name in params and params.index(name) < len(args):
        return args[params.index(name)]
    return None
