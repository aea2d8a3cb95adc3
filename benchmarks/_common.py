"""What the ASV benchmark modules share: ``SkipNotImplemented`` (ASV's skip, NotImplementedError outside ASV),
the ``unit`` decorator of ``track_*`` functions, and the check that a GPU benchmark can run at this commit."""

from __future__ import annotations

try:
    from asv_runner.benchmarks.mark import SkipNotImplemented
except ImportError:  # asv_runner is present wherever ASV runs; this keeps the modules importable anyway
    SkipNotImplemented = NotImplementedError

__all__ = ["SkipNotImplemented", "unit", "why_not_runnable_on_gpu"]


def unit(name: str):
    """Decorator: the unit ASV reports for a ``track_*`` function."""
    def deco(fn):
        fn.unit = name
        return fn

    return deco


def why_not_runnable_on_gpu(modules: tuple[str, ...], lacking: str) -> str | None:
    """Why a GPU benchmark cannot run here (no torch, no CUDA device, or ``modules`` missing at this commit:
    "this commit lacks <lacking>"), or None."""
    import importlib

    try:
        import torch
    except ImportError as exc:  # pragma: no cover
        return f"torch is not importable: {exc}"
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError as exc:
        return f"this commit lacks {lacking}: {exc}"
    return None
