#!/usr/bin/env python3
"""The ASV suite on a machine without a GPU, in minutes, with progress, leaving no process behind.

What it runs: ``asv run --quick`` of this checkout's HEAD in the interpreter running this script (ASV's *existing*
environment), with a configuration of its own under ``--out`` (results, pages and scratch there, never in the
committed ``.asv/results``: the history there comes from the H100) and a machine of its own (``--machine``,
default ``cpu-dev``, recorded from ASV's defaults without questions).  The kernel and end-to-end benchmarks need
CUDA: they are reported n/a, each with its reason; the accuracy benchmarks (``bench_accuracy``: the ``tests``
profile of ``loki check`` on the embedded model) run and are then gated by ``ci/gate.py`` against that profile's
limits.

How it behaves:

- progress: ASV's own lines as they come, each with the elapsed time; the accuracy suite's steps (calibration,
  each perplexity setting, agreement) as it reaches them, from the progress file its ``setup_cache`` writes
  (``$LOKI_ASV_PROGRESS``; ASV itself shows a benchmark's output only when it ends); a line every 20 s of
  silence otherwise;
- every n/a with its reason (``ci/asv_plugin.na_report``);
- a time limit (``--time-limit``, default 290 s): past it, ASV is interrupted, then every process of its session
  (ASV puts each benchmark server in a process group of its own, so killing ASV alone orphans them) is killed,
  the script checks that none is left and exits 124; Ctrl-C does the same and exits 130;
- exit status: the gate's (0 passed, 1 a check failed, 2 unusable input), 124 on the time limit, or ASV's own
  when it fails.

Usage::

    python ci/asv_cpu.py                         # everything: n/a reasons for the GPU benchmarks, accuracy gated
    python ci/asv_cpu.py --bench '^bench_kernels' --no-gate    # the GPU modules only: n/a with reasons, seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRESS_ENV = "LOKI_ASV_PROGRESS"
SKIP_LOG_ENV = "LOKI_ASV_SKIP_LOG"


def _plugin():
    spec = importlib.util.spec_from_file_location("loki_asv_plugin", ROOT / "ci" / "asv_plugin.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_config(out: Path) -> Path:
    """``asv.conf.json`` of the repository with every folder under ``out`` (absolute paths: ASV resolves paths from
    the configuration's folder) and without the plugin (ASV imports plugins from that folder)."""
    lines = (ROOT / "asv.conf.json").read_text(encoding="utf-8").splitlines()
    conf = json.loads("\n".join(line for line in lines if not line.strip().startswith("//")))
    conf.update(repo=str(ROOT), benchmark_dir=str(ROOT / "benchmarks"), results_dir=str(out / "results"),
                html_dir=str(out / "html"), env_dir=str(out / "env"))
    conf.pop("plugins", None)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "asv.conf.json"
    path.write_text(json.dumps(conf, indent=1), encoding="utf-8")
    return path


def session_processes(sid: int) -> list[int]:
    """Ids of the live processes of session ``sid`` (Linux: /proc/<pid>/stat, field 6)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def stop_session(proc: subprocess.Popen, say) -> bool:
    """Interrupt ASV (so that it stops its benchmark servers itself), then kill whatever of its session is left;
    True when no process of the session remains."""
    sid = proc.pid  # started with start_new_session: the session id is its pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = session_processes(sid)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(1.0)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    left = session_processes(sid)
    say(f"stopped ASV and its benchmark processes; {len(left)} left" if left else
        "stopped ASV and its benchmark processes; none left")
    return not left


def run_streaming(cmd: list[str], env: dict, time_limit: float, progress_file: Path | None, say) -> int:
    """Run ``cmd`` in a session of its own, echo its output with the elapsed time, follow ``progress_file``;
    stop the whole session at ``time_limit`` (returns 124) or on Ctrl-C (130)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    last = [time.monotonic()]

    def pump():
        for line in proc.stdout:
            last[0] = time.monotonic()
            say(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    seen = ""
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            now = time.monotonic()
            if now - t0 > time_limit:
                say(f"time limit of {time_limit:.0f} s reached: stopping (nothing of this run is saved: ASV writes "
                    "results when a run ends; on a busy machine give it longer with --time-limit)")
                stop_session(proc, say)
                return 124
            if progress_file is not None and progress_file.is_file():
                text = progress_file.read_text(encoding="utf-8", errors="replace")
                newest = next((p.strip() for p in reversed(text.replace("\r", "\n").split("\n")) if p.strip()), "")
                if newest and newest != seen and now - last[0] >= 10:
                    seen = newest
                    last[0] = now
                    say(f"  (accuracy suite) {newest}")
            if now - last[0] >= 20:
                last[0] = now
                say("  still running (ASV prints a benchmark's line when it ends)")
    except KeyboardInterrupt:
        say("interrupted: stopping")
        stop_session(proc, say)
        return 130
    reader.join(timeout=5)
    left = session_processes(proc.pid)
    if left:  # ASV ended but left a worker behind: not ours to keep
        stop_session(proc, say)
    return proc.returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/loki-asv-cpu", help="folder of the configuration, results and pages "
                    "(default: %(default)s)")
    ap.add_argument("--machine", default="cpu-dev", help="ASV machine name of the results (default: %(default)s)")
    ap.add_argument("--bench", default=".", metavar="REGEX", help="benchmarks to run (ASV's --bench; default: all)")
    ap.add_argument("--time-limit", type=float, default=290.0, help="seconds before the run is stopped "
                    "(default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the accuracy suite (default: 1 on a "
                    "machine of two cores or fewer, else 2)")
    ap.add_argument("--no-gate", action="store_true", help="do not run ci/gate.py on the accuracy results")
    ap.add_argument("--show-stderr", action="store_true", help="ASV's --show-stderr: every benchmark's own output "
                    "(the n/a reasons are listed after the run either way)")
    args = ap.parse_args(argv)
    if args.time_limit <= 0:
        ap.error(f"--time-limit must be > 0, got {args.time_limit}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    t0 = time.monotonic()

    def say(msg: str) -> None:
        s = int(time.monotonic() - t0)
        print(f"[asv-cpu {s // 60:02d}:{s % 60:02d}] {msg}", flush=True)

    out = Path(args.out).resolve()
    conf = write_config(out)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    if not commit:
        print(f"error: {ROOT} is not a git checkout (ASV files results under a commit)", file=sys.stderr)
        return 2
    skips, progress = out / "skips.jsonl", out / "progress.log"
    for f in (skips, progress):
        f.unlink(missing_ok=True)
    # one torch thread on a machine of two cores or fewer (two threads sharing them with other work run several
    # times slower; loki's own commands decide so too), else two
    threads = args.threads or (1 if (os.cpu_count() or 1) <= 2 else 2)
    # the benchmark processes import this checkout's loki (ASV drops PYTHONPATH; ASV_PYTHONPATH is its own)
    env = dict(os.environ, ASV_PYTHONPATH=os.environ.get("ASV_PYTHONPATH", str(ROOT)),
               **{SKIP_LOG_ENV: str(skips), PROGRESS_ENV: str(progress),
                              "OMP_NUM_THREADS": str(threads), "LOKI_ASV_THREADS": str(threads),
                              "TOKENIZERS_PARALLELISM": "false"})
    py = sys.executable
    say(f"configuration {conf}; machine {args.machine}; commit {commit[:12]}; time limit {args.time_limit:.0f} s")
    subprocess.run([py, "-m", "asv", "machine", "--config", str(conf), "--machine", args.machine, "--yes"],
                   cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    since = time.time() - 1.0
    cmd = [py, "-m", "asv", "run", "--config", str(conf), "--python=same", "--machine", args.machine,
           f"--set-commit-hash={commit}", "--quick", "--launch-method", "forkserver", "--bench", args.bench]
    if args.show_stderr:
        cmd.append("--show-stderr")
    rc = run_streaming(cmd, env, args.time_limit - (time.monotonic() - t0), progress, say)
    for line in _plugin().na_report(str(out / "results"), str(skips), since):
        say(line)
    if rc:
        say(f"asv run ended with status {rc}")
        return rc
    if args.no_gate or not any(name.startswith("bench_accuracy") for name in _measured(out, args.machine)):
        say(f"done in {time.monotonic() - t0:.0f} s; results in {out / 'results'}")
        return 0
    gate = [py, str(ROOT / "ci" / "gate.py"), "--results", str(out / "results"), "--machine", args.machine,
            "--commit", commit, "--bench", "^bench_accuracy", "--repo", str(ROOT)]
    say("gate: " + " ".join(gate[1:]))
    proc = subprocess.run(gate, cwd=ROOT, capture_output=True, text=True, check=False)
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith(("gate:", "FAIL")):
            say(line)
    say(f"done in {time.monotonic() - t0:.0f} s; results in {out / 'results'}; gate exit status {proc.returncode}")
    return proc.returncode


def _measured(out: Path, machine: str) -> set[str]:
    """Benchmarks with a number in the run's results files."""
    names = set()
    for path in (out / "results" / machine).glob("*.json"):
        if path.name == "machine.json":
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        i = data.get("result_columns", []).index("result") if "result" in data.get("result_columns", []) else 0
        for name, row in data.get("results", {}).items():
            vals = row[i] if isinstance(row[i], list) else [row[i]]
            if any(isinstance(v, (int, float)) and v == v for v in vals):
                names.add(name)
    return names


if __name__ == "__main__":
    sys.exit(main())
