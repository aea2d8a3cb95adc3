#!/usr/bin/env python3
"""Write or check the committed ASV benchmark list, ``.asv/results/benchmarks.json``.

ASV rewrites that file from the suite's discovery on every ``asv run``; the copy in the repository must be the
current suite's (``ci/gate.py`` reads units and parameter names from it, ``asv publish`` its benchmarks), so that
a run leaves it unchanged.  This script discovers the suite exactly as ASV does (``asv_runner discover`` in a
child process of this interpreter, in a scratch folder) and writes the file with ASV's own writer.

Usage::

    python ci/asv_benchmark_list.py            # rewrite .asv/results/benchmarks.json
    python ci/asv_benchmark_list.py --check    # exit 1 (naming the benchmarks that differ) when it is stale

Exit status: 0 written or current, 1 stale (``--check``), 2 the suite could not be discovered.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".asv" / "results" / "benchmarks.json"
API_VERSION = 2  # asv 0.6's benchmarks.json

__all__ = ["discover", "stale", "main"]


def discover(benchmark_dir: str | os.PathLike = ROOT / "benchmarks", python: str = sys.executable) -> dict:
    """``{name: benchmark}`` of the suite, as ASV's discovery writes it (raises RuntimeError when it fails)."""
    from asv import runner

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # as ASV does; ASV_PYTHONPATH is its replacement
        if "ASV_PYTHONPATH" in env:
            env["PYTHONPATH"] = env.pop("ASV_PYTHONPATH")
        proc = subprocess.run([python, runner.BENCHMARK_RUN_SCRIPT, "discover", str(Path(benchmark_dir).resolve()),
                               str(out)], cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"benchmark discovery failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        return {b["name"]: b for b in json.loads(out.read_text())}


def _load(path: Path) -> dict:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.pop("version", None)
    return data


def stale(path: Path, current: dict) -> list[str]:
    """Names whose entry in ``path`` differs from ``current`` (added, removed or changed), sorted."""
    if not path.is_file():
        return sorted(current)
    old = _load(path)
    return sorted(n for n in set(old) | set(current) if old.get(n) != current.get(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 when the committed list is stale")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the benchmark list (default: %(default)s)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        current = discover()
    except RuntimeError as exc:
        print(f"asv_benchmark_list: {exc}", file=sys.stderr)
        return 2
    diff = stale(out, current)
    if args.check:
        if diff:
            print(f"asv_benchmark_list: {out} is stale ({len(diff)} benchmarks differ: {', '.join(diff[:8])}"
                  f"{' ...' if len(diff) > 8 else ''}); run `python ci/asv_benchmark_list.py` and commit it",
                  file=sys.stderr)
            return 1
        print(f"asv_benchmark_list: {out} is current ({len(current)} benchmarks)")
        return 0
    from asv import util

    out.parent.mkdir(parents=True, exist_ok=True)
    util.write_json(str(out), current, api_version=API_VERSION)
    print(f"asv_benchmark_list: wrote {out} ({len(current)} benchmarks, {len(diff)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
