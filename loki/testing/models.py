"""Tiny random Hugging Face causal LMs for tests (no downloads).

Every model is built from a config with a few layers and heads, random weights from a fixed seed, in float32 and
eval mode.  Shape letters used in this module: L = layers, HQ = query heads, HKV = key/value heads, D = head dim.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

TINY_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def _config_class(arch: str):
    import transformers

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {', '.join(TINY_ARCHITECTURES)}, got {arch!r}")
    config_name, model_name = classes[arch]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def tiny_config(
    arch: str = "llama",
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 256,
    seed: int = 0,
    **overrides: Any,
):
    """A small config of ``arch`` ("llama", "mistral", "qwen2" or "qwen3"): L = num_layers, HQ = num_heads,
    HKV = num_kv_heads, D = head_dim, hidden size HQ * D.

    ``seed`` is not part of the config; it is accepted so that :func:`tiny_model` can forward its arguments.
    ``overrides`` are passed to the config class (e.g. ``rope_theta=5e5``, ``sliding_window=8``).
    The returned object is a fresh config: build each model from its own copy (:func:`tiny_model` does).
    """
    del seed
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    config_cls, _ = _config_class(arch)
    hidden = num_heads * head_dim
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    if arch in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.name_or_path = f"loki-tiny-{arch}"
    return config


def tiny_model(
    arch: str = "llama",
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 256,
    seed: int = 0,
    config=None,
    **overrides: Any,
) -> torch.nn.Module:
    """A randomly initialised ``*ForCausalLM`` of ``arch`` (see :func:`tiny_config`), float32, eval mode.

    Weights are drawn from ``seed`` without touching the global RNG state.  When ``config`` is given it is
    deep-copied and used instead of building one (the model class follows ``config.model_type``).
    """
    if config is None:
        config = tiny_config(arch, num_layers, num_heads, num_kv_heads, head_dim, vocab_size, **overrides)
        _, model_cls = _config_class(arch)
    else:
        config = copy.deepcopy(config)
        _, model_cls = _config_class(config.model_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(copy.deepcopy(config))
    return model.to(torch.float32).eval()


class ByteTokenizer:
    """A tokenizer for tiny models (no files): every UTF-8 byte of a text is one token, ``byte % (vocab_size - 1) +
    1`` (0 is EOS).  Enough for ``loki.evaluation.data.token_windows`` and the calibration's token batches."""

    eos_token_id = 0
    bos_token_id = None

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        if isinstance(text, (list, tuple)):
            return {"input_ids": [self(t)["input_ids"] for t in text]}
        return {"input_ids": [b % (self.vocab_size - 1) + 1 for b in str(text).encode()]}

    def decode(self, ids) -> str:
        return bytes(int(i) - 1 for i in ids if 0 < int(i) <= 256).decode("utf-8", errors="replace")
