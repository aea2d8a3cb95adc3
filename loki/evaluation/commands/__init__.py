"""CLI subcommands of the evaluation package (each module: ``add_arguments(parser)`` and ``run(args) -> int``)
and their shared helpers."""

from __future__ import annotations

import argparse
import math
import sys

__all__ = ["add_device_arguments", "add_model_arguments", "fail", "fraction_or_count", "load_model_from_args",
           "model_device", "set_threads"]


def set_threads(threads: int | None) -> int:
    """Set torch's CPU threads: ``threads`` when given, else 1 on machines with at most 2 cores (two threads
    that share the cores with other work can be 10x slower), else torch's default.  Returns the count."""
    import os

    import torch

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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    add_device_arguments(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on machines with <= 2 cores, else torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def load_model_from_args(args):
    from loki.evaluation.models import load_default_model, load_model

    set_threads(getattr(args, "threads", None))
    kw = dict(device=model_device(args), dtype=getattr(args, "dtype", "float32"))
    if args.model:
        return load_model(args.model, **kw)
    return load_default_model(progress=lambda m: print(m, file=sys.stderr), **kw)
