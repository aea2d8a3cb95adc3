"""What the ASV benchmark modules share: ``SkipNotImplemented`` (ASV's skip, NotImplementedError outside ASV) and
:func:`skip`, which says why, the ``unit`` decorator of ``track_*`` functions, and the check that a GPU benchmark
can run at this commit."""

from __future__ import annotations

import json
import os
import sys

try:
    from asv_runner.benchmarks.mark import SkipNotImplemented
except ImportError:  # asv_runner is present wherever ASV runs; this keeps the modules importable anyway
    SkipNotImplemented = NotImplementedError

__all__ = ["SKIP_LOG_ENV", "SkipNotImplemented", "skip", "unit", "why_not_runnable_on_gpu"]

#: The file (JSON lines) where :func:`skip` records every n/a case with its reason; set by ci/asv_plugin.py
#: around ``asv run`` and by ci/asv_cpu.py, which print every n/a with its reason after the run.
SKIP_LOG_ENV = "LOKI_ASV_SKIP_LOG"


def skip(bench, reason: str, *params) -> None:
    """Skip a benchmark case (ASV records it as n/a) and say why: ASV drops a skip's message, so the reason goes to
    stderr (``asv run --show-stderr`` shows it) and to the file named by ``$LOKI_ASV_SKIP_LOG``, from which the
    run's summary lists every n/a case with its reason.  ``bench`` is the benchmark instance (or a
    ``module.Class`` name), ``params`` the case's parameter values."""
    if not isinstance(bench, str):
        bench = f"{type(bench).__module__.rsplit('.', 1)[-1]}.{type(bench).__name__}"
    print(f"n/a: {bench}({', '.join(map(str, params))}): {reason}", file=sys.stderr)
    path = os.environ.get(SKIP_LOG_ENV)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"benchmark": bench, "params": [str(p) for p in params], "reason": reason}) + "\n")
        except OSError:
            pass  # the reason is on stderr all the same
    raise SkipNotImplemented(reason)


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
        return "needs a CUDA device (torch.cuda.is_available() is False here)"
    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError as exc:
        return f"this commit lacks {lacking}: {exc}"
    return None
