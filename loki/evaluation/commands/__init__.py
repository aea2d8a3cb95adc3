"""CLI subcommands of the evaluation package (each module: ``add_arguments(parser)`` and ``run(args) -> int``)
and their shared helpers."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

__all__ = [
    "UsageError",
    "add_device_arguments",
    "add_model_arguments",
    "check_input_file",
    "check_model_folder",
    "check_output_file",
    "fail",
    "fraction_or_count",
    "load_model_from_args",
    "model_device",
    "positive_int",
    "set_threads",
]


class UsageError(Exception):
    """A user error on the command line: ``loki`` prints ``error: <message>`` and exits 2 (no traceback)."""


def set_threads(threads: int | None) -> int:
    """Set torch's CPU threads: ``threads`` when given, else 1 on machines with at most 2 cores (two threads
    that share the cores with other work can be 10x slower), else torch's default.  Returns the count."""
    import torch

    if threads is not None and (isinstance(threads, bool) or int(threads) < 1):
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if threads is None and (os.cpu_count() or 1) <= 2:
        threads = 1
    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def fail(msg: str) -> int:
    """Print ``error: msg`` on stderr and return the exit status 2 (bad arguments)."""
    print(f"error: {msg}", file=sys.stderr)
    return 2


def fraction_or_count(text: str) -> int | float:
    """argparse type: ``0.25`` is a fraction in (0, 1], ``16`` a count >= 1."""
    try:
        if any(c in text for c in ".eE"):
            v = float(text)
            if math.isnan(v) or not 0.0 < v <= 1.0:
                raise argparse.ArgumentTypeError(f"a fraction must lie in (0, 1], got {text}")
            return v
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.25 or a count like 16, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"a count must be >= 1, got {text}")
    return v


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``, shared by every command that runs a model."""
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the model runs: auto = a CUDA GPU when present, else the CPU (default: auto)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="model weights and activations (default: float32; the sparse methods compute "
                        "scores and softmax in float32 either way)")


def model_device(args):
    """The torch device of ``args.device``; a ValueError (for :func:`fail`) when CUDA is asked for and absent."""
    from loki.evaluation.models import resolve_device

    return resolve_device(getattr(args, "device", "auto"))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def check_input_file(path: str | None, option: str) -> str | None:
    """Why ``path`` (given with ``option``) is not a readable file, or None when it is (or was not given)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if p.is_dir():
        return f"{option} {p} is a directory, not a file"
    if not p.exists():
        return f"{option} {p} does not exist"
    if not os.access(p, os.R_OK):
        return f"{option} {p} is not readable"
    return None


def check_output_file(path: str | os.PathLike, option: str) -> str | None:
    """Why a file cannot be written at ``path`` (given with ``option``), or None when it can: checked before any
    long computation, so that its result is not lost at the end.  The folder must exist and accept a new file
    (a temporary file is created and removed); an existing file must be a writable file, not a folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        return f"{option} {p} is a directory; give a file path"
    folder = p.parent
    if not folder.exists():
        return f"{option}: output folder {folder} does not exist"
    if not folder.is_dir():
        return f"{option}: {folder} is not a folder"
    if p.exists() and not os.access(p, os.W_OK):
        return f"{option} {p} is not writable"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".loki-write-check-"):
            pass
    except OSError as exc:
        return f"{option}: cannot write into {folder} ({exc.strerror or exc})"
    return None


def check_model_folder(path: str | None, option: str = "--model") -> str | None:
    """Why ``path`` is not a local transformers model folder, or None when it is (or was not given)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_dir():
        return f"{option} {p}: no such folder (a local transformers model folder with config.json)"
    if not (p / "config.json").is_file():
        return f"{option} {p} is not a transformers model folder (config.json missing)"
    return None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    add_device_arguments(parser)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: 1 on machines with <= 2 cores, else torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def load_model_from_args(args):
    """``(model, tokenizer)`` of ``--model`` (or the embedded default model); a bad ``--model`` or ``--threads``
    raises :class:`UsageError`."""
    from loki.evaluation.models import load_default_model, load_model

    set_threads(getattr(args, "threads", None))
    kw = dict(device=model_device(args), dtype=getattr(args, "dtype", "float32"))
    if args.model:
        err = check_model_folder(args.model)
        if err:
            raise UsageError(err)
        return load_model(args.model, **kw)
    return load_default_model(progress=lambda m: print(m, file=sys.stderr), **kw)
