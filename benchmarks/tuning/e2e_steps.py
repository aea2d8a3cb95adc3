"""Is a compiled decode step host-bound, and in which launch-gap state is it?  One process.

    PYTHONPATH=. python3 -m benchmarks.tuning.e2e_steps --path loki_compiled --layers 32
    PYTHONPATH=. python3 -m benchmarks.tuning.e2e_steps --path loki_compiled@int8 --timeline --graph-dump
    PYTHONPATH=. python3 -m benchmarks.tuning.e2e_steps --path loki_compiled,loki_compiled@int8

The compiled forward of ``loki bench --e2e``'s decode step (static cache, CUDA graphs, Llama-3-8B dimensions with
random weights, bf16) after a few warm-up steps, measured three ways: per step with a sync after it (the host's
enqueue time, and the device's time from an event before the enqueue to one after it), back to back (``--steps``
steps, one sync at the end: what a decode loop gets), and optionally a profile of a few back-to-back steps whose
kernel timeline gives :func:`benchmarks.tuning.e2e_profile.launch_gaps` (``--timeline``; the timeline is written to
``$OUT``).  ``--graph-dump`` writes the captured CUDA graphs as Graphviz text.  The process compiles a step itself
unless the Inductor cache (``TORCHINDUCTOR_CACHE_DIR``) already holds it, and that matters: a step compiled in its own
process was 4-5% slower than the same step loaded from the cache, in every kernel gap rather than in any kernel
(results/launch-gaps-h200-2026-11-28/NOTES.md).  Run a path twice with the same cache directory to see both.

Several paths (comma-separated) are built one after the other in this process, each timed right after it is built
and all again in ``--rounds`` rounds: the launch-gap state is the process's, not a graph's, and the latest build sets
it (results/launch-state-h200-2026-11-28/NOTES.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time

import torch


def measure_steps(step, first: int, n: int, sync=None, clock=time.perf_counter, events=None) -> dict:
    """Time ``step(i)`` for i = first..first+n-1 once with a sync after each call and once back to back.

    ``sync`` waits for the device (default ``torch.cuda.synchronize``); ``events`` makes a (start, end) pair of
    device events with ``record()`` and ``elapsed_time(other)`` in ms (default CUDA events; None on the CPU: the
    device time is then the host's).  Returns the medians of the host enqueue (ms) and the synced device time (ms) per
    step, and the back-to-back time per step (ms), the steps i = first + n .. first + 2n - 1."""
    sync = sync or torch.cuda.synchronize
    host, dev = [], []
    for i in range(first, first + n):
        pair = events() if events else None
        t0 = clock()
        if pair:
            pair[0].record()
        step(i)
        if pair:
            pair[1].record()
        t1 = clock()
        sync()
        host.append((t1 - t0) * 1e3)
        dev.append(pair[0].elapsed_time(pair[1]) if pair else (clock() - t0) * 1e3)
    sync()
    t0 = clock()
    for i in range(first + n, first + 2 * n):
        step(i)
    sync()
    back = (clock() - t0) * 1e3 / n
    return {"host_enqueue_ms": sorted(host)[n // 2], "device_synced_ms": sorted(dev)[n // 2],
            "back_to_back_ms": back}


def dump_graphs_when_captured() -> list:
    """Make every CUDA graph created from now on (Inductor's CUDA-graph trees create theirs with
    ``torch.cuda.CUDAGraph()``) keep its cudaGraph_t for ``debug_dump``; returns the list they are added to.  Kept
    graphs are instantiated at their first replay instead of at the end of their capture (torch destroys the
    cudaGraph_t of a graph that is not kept, and ``debug_dump`` then writes nothing)."""
    graphs = []

    class _KeptGraph(torch.cuda.CUDAGraph):
        def __new__(cls, keep_graph: bool = False):
            g = super().__new__(cls, True)
            graphs.append(g)
            return g

        def __init__(self, keep_graph: bool = False):  # the bound C++ object takes keep_graph here, not in __new__
            super().__init__(True)
            self.enable_debug_mode()

    torch.cuda.CUDAGraph = _KeptGraph
    return graphs


def _cuda_events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def plan_steps(seq_len: int, steps: int, n_paths: int, rounds: int, warm: int, extra: int) -> tuple[int, int]:
    """(cache fill, steps per path) of a run: each path takes ``warm`` warm-up steps, the synced and back-to-back loops
    (``2 * steps``) after it is built and again in each of ``rounds`` later rounds (only with several paths), and
    ``extra`` profiled steps; the steps fill the cache's last slots.  SystemExit names the bad argument."""
    per_path = warm + 2 * steps * (1 + (rounds if n_paths > 1 else 0)) + extra
    if steps < 1 or rounds < 0 or seq_len - per_path < 1:
        raise SystemExit(f"--steps must be >= 1 and --rounds >= 0 with {per_path} steps per path < --seq-len "
                         f"{seq_len}, got --steps {steps} --rounds {rounds}")
    return seq_len - per_path, per_path


def add_step_arguments(ap: argparse.ArgumentParser, steps: int, steps_help: str) -> None:
    """The model and step arguments of the step timers (this module and ``launch_state``)."""
    ap.add_argument("--model", default="llama3-8b", help="model dimensions (loki.bench.e2e.E2E_MODELS)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32768, help="cache length; the steps fill its last slots")
    ap.add_argument("--k", type=int, default=2048, help="Loki's token budget")
    ap.add_argument("--steps", type=int, default=steps, help=steps_help)


def model_dims(a) -> dict:
    """The parsed ``--model`` and ``--layers`` as model dimensions; SystemExit naming ``--model`` for an unknown one."""
    from loki.bench import e2e

    if a.model not in e2e.E2E_MODELS:
        raise SystemExit(f"--model must be one of {sorted(e2e.E2E_MODELS)}, got {a.model!r}")
    return dict(e2e.E2E_MODELS[a.model], num_hidden_layers=a.layers)


def check_path(flag: str, p: str) -> None:
    """A path the step timers can build: loki_compiled, loki_compiled@native / @int8 (its score copy) or
    sdpa_compiled; SystemExit naming ``flag`` otherwise."""
    base, _, fmt = p.partition("@")
    if base not in ("loki_compiled", "sdpa_compiled") or fmt not in ("", "native", "int8") or (
            fmt and base != "loki_compiled"):
        raise SystemExit(f"{flag} must be loki_compiled[@native|@int8] or sdpa_compiled, got {p!r}")


def main(argv=None) -> int:
    from loki.bench import e2e

    from .e2e_profile import _kernel_events, compiled_step, launch_gaps

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="loki_compiled",
                    help="a compiled path of loki bench --e2e; a Loki path may name its score copy: "
                    "loki_compiled@int8.  Several, comma-separated, are built in that order in this one process (a "
                    "model each), each timed right after it is built and all again in --rounds rounds")
    add_step_arguments(ap, 40, "steps in each of the synced and back-to-back loops")
    ap.add_argument("--rounds", type=int, default=2, help="with several paths: times every path is timed again, in "
                    "order, after all are built")
    ap.add_argument("--graph-dump", action="store_true",
                    help="write every captured CUDA graph to $OUT as Graphviz text (cudaGraphDebugDotPrint, gzipped), "
                    "to compare two processes' graphs node by node")
    ap.add_argument("--timeline", action="store_true",
                    help="profile 6 more back-to-back steps: launch gaps printed, the kernel timeline written to $OUT")
    a = ap.parse_args(argv)
    dims = model_dims(a)
    paths = a.path.split(",")
    for p in paths:
        check_path("--path", p)
    if len(set(paths)) != len(paths):
        raise SystemExit(f"--path names a path twice: {a.path!r}")
    extra, warm = (6 if a.timeline else 0), 8
    n0, per_path = plan_steps(a.seq_len, a.steps, len(paths), a.rounds, warm, extra)
    if not torch.cuda.is_available():
        raise SystemExit("e2e_steps needs a CUDA device")
    graphs = dump_graphs_when_captured() if a.graph_dump else None
    out = os.environ.get("OUT", ".")
    steps, used = {}, dict.fromkeys(paths, 0)

    def run(p, n):  # the next n steps of path p
        first = used[p]
        used[p] += n
        return steps[p], first

    def report(p, r, after):
        r.update(path=p, after_building=after, layers=a.layers, batch=a.batch, seq_len=a.seq_len, k=a.k,
                 device=torch.cuda.get_device_name())
        print(json.dumps({k: v for k, v in r.items() if k != "launch_gaps"}))
        lg = r.get("launch_gaps", {})
        if lg.get("n"):
            print(f"launch gaps: median {lg['median_us']:.2f} us, {lg['early_starts']} early starts of {lg['n']}")
        print(f"RESULT {p} L={a.layers} ({after}): host enqueue {r['host_enqueue_ms']:.2f} ms/step, device "
              f"{r['device_synced_ms']:.2f} ms/step (synced), back-to-back {r['back_to_back_ms']:.2f} ms/step")

    with torch.no_grad(), e2e.sdpa_context("native-gqa"):
        for j, p in enumerate(paths):
            path, _, fmt = p.partition("@")
            model = e2e.build_model(e2e.llama_config(dims), "cuda")
            steps[p] = compiled_step(model, path, a.batch, a.seq_len, n0, per_path, a.k, "auto", fmt or "native")
            t0 = time.perf_counter()
            step, first = run(p, warm)
            for i in range(first, first + warm):
                step(i)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            _dump(graphs, out, p, a.layers)
            step, first = run(p, 2 * a.steps)
            r = measure_steps(step, first, a.steps, events=_cuda_events)
            if a.timeline:
                step, first = run(p, extra)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for i in range(first, first + extra):
                        step(i)
                    torch.cuda.synchronize()
                evs = sorted(_kernel_events(prof))
                r["launch_gaps"] = launch_gaps(evs)
                with gzip.open(os.path.join(out, f"timeline-{p.replace('@', '-')}-L{a.layers}.json.gz"), "wt") as f:
                    json.dump(evs, f)
            r["first_steps_s"] = first_s
            report(p, r, "built: " + ", ".join(paths[: j + 1]))
        for rnd in range(a.rounds if len(paths) > 1 else 0):
            for p in paths:
                step, first = run(p, 2 * a.steps)
                report(p, measure_steps(step, first, a.steps, events=_cuda_events), f"round {rnd + 1}, all built")
    return 0


def _dump(graphs, out: str, label: str, layers: int) -> None:
    """Write the graphs captured since the last call (``dump_graphs_when_captured``'s list, emptied here) gzipped."""
    for j, g in enumerate(graphs or []):
        dot = os.path.join(out, f"graph-{label.replace('@', '-')}-L{layers}-{j}.dot")
        g.debug_dump(dot)
        if not os.path.exists(dot):
            print(f"graph {j}: debug_dump wrote nothing")
            continue
        with open(dot, "rb") as src, gzip.open(dot + ".gz", "wb") as dst:
            dst.write(src.read())
        os.remove(dot)
    if graphs:
        graphs.clear()


if __name__ == "__main__":
    raise SystemExit(main())
