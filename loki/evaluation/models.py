"""Loading models for the evaluation: local transformers folders and the embedded default model
SmolLM2-135M-Instruct (its GGUF file, the float32 conversion and the cache folder: :mod:`loki.embedded`,
re-exported here), and the device and dtype choices of the commands.

The embedded model: LlamaForCausalLM, L = 30 layers, hidden 576, HQ = 9 query heads, HKV = 3 key/value heads,
D = 64, RoPE theta 1e5, 134.5 M parameters.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from loki.embedded import (
    DEFAULT_GGUF,
    DEFAULT_MODEL_NAME,
    DEFAULT_PACKAGE,
    EmbeddedModelError,
    cache_root,
    default_gguf_path,
    default_model_dir,
)

__all__ = [
    "DEVICES",
    "DTYPES",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_PACKAGE",
    "DEFAULT_GGUF",
    "EmbeddedModelError",
    "cache_root",
    "default_gguf_path",
    "default_model_dir",
    "load_default_model",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]

#: ``--device`` choices of the evaluation commands ("auto": CUDA when present, else the CPU).
DEVICES = ("auto", "cpu", "cuda")
#: ``--dtype`` choices: the dtype the model's weights and activations run in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` (or None): ``cuda`` when a CUDA device is present, else ``cpu``; ``"cpu"``, ``"cuda"`` or
    ``"cuda:N"`` as given, with an error naming ``device`` when CUDA is asked for and absent."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but no CUDA device is available (use 'cpu' or 'auto')")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from ``"float32"``, ``"bfloat16"``, ``"float16"`` (or the dtype itself)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def load_model(path: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32, attn_implementation: str = "sdpa",
               device: str | torch.device | None = "cpu"):
    """Load ``(model, tokenizer)`` from a local transformers folder (eval mode, no downloads) in ``dtype`` on
    ``device`` (:func:`resolve_device`: "auto", "cpu", "cuda")."""
    dtype, device = resolve_dtype(dtype), resolve_device(device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no transformers model folder at {path} (config.json missing)")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model.to(device).eval()
    return model, tokenizer


def load_default_model(
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike | None = None,
    progress=None,
    device: str | torch.device | None = "cpu",
):
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct, float32 on the CPU by default, eval mode
    (``device="auto"`` picks CUDA when present).

    The first call converts the GGUF file (~15 s) and caches it; later calls reload the cache (~2 s).
    """
    model, tokenizer = load_model(
        default_model_dir(cache_dir, progress=progress), dtype=dtype, attn_implementation=attn_implementation,
        device=device,
    )
    model.config.name_or_path = DEFAULT_MODEL_NAME
    return model, tokenizer
