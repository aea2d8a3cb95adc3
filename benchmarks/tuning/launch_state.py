"""Which part of building a compiled step sets the process's launch-gap state?  One process.

    PYTHONPATH=. python3 -m benchmarks.tuning.launch_state --probe loki_compiled --build loki_compiled@int8
    PYTHONPATH=. python3 -m benchmarks.tuning.launch_state --probe loki_compiled --build loki_compiled --fresh

A compiled decode step's kernels wait about 0.1 us or about 0.4 us for each other inside its CUDA graph, 0.45 ms per
step apart at Llama-3-8B dims; the state is the process's, two graphs share it, and the latest build sets it
(results/launch-state-h200-2026-11-28/NOTES.md).  This builds the ``--probe`` path's step (as ``e2e_steps`` does),
times it, then builds the ``--build`` path on a second model one stage at a time, timing the probe step back to back
after each stage:

* ``model``: the second model's weights;
* ``loki``: Loki enabled on it (a Loki path);
* ``cache``: its cache made and filled (the int8 encoding for ``@int8``);
* ``eager``: one uncompiled forward step on that cache;
* ``compile``: the first call of its compiled forward (Dynamo and Inductor; CUDA-graph trees run it without a graph);
* ``capture``: the next calls (the graph recorded, then replayed).

``--fresh`` makes Inductor compile the second step in this process (its caches off for that build), the cold-process
case; ``--inductor KEY=VALUE`` patches an Inductor setting for that build (``triton.autotune_pointwise=False``) and
``--stop-workers`` / ``--profile-once`` / ``--empty-cache`` add last stages that shut Inductor's compile workers
down / run one profiler session / hand the caching allocator's free blocks back; ``--idle SECONDS`` adds a first
stage that leaves the GPU idle that long (a compile leaves it idle for most of a minute); ``--triggers a,b,...``
runs cheap pieces of what a compile does (``launch_triggers.py``) one stage each before the build, and ``--build
none`` leaves the build out.  Every row also counts the processes that hold a context on the GPU (``nvidia-smi``),
the current stream the probe ran on, and the SM and memory clocks and performance state read right after the probe.
The stage after which the probe's time moves is the one that sets the state: of a build's stages, on an H200, it
is always ``compile`` (results/launch-state-h200-2026-11-28/NOTES.md); of the triggers, the first kernel run on a
second stream (results/launch-streams-h200-2026-12-01/NOTES.md).  Both models live at once: at the defaults
(Llama-3-8B dims, 32 layers, B=8, S=32768) about 105 GB, so a card of 80 GB takes ``--layers 16``.  Run it twice
with one ``TORCHINDUCTOR_CACHE_DIR``: the first process compiles the probe's step (and so starts in the slow state),
the second loads it and starts in the fast one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

STAGES = ("model", "loki", "cache", "eager", "compile", "capture")


def run_stages(stages, probe) -> list[dict]:
    """``probe()`` (ms per step) before any stage and after each of ``stages`` ((name, fn) pairs, run in order);
    returns one row per probe: the stage it followed ("before" first), its time and the stage's own wall time (s)."""
    rows = [{"after": "before", "probe_ms": probe(), "stage_s": 0.0}]
    for name, fn in stages:
        t0 = time.perf_counter()
        fn()
        rows.append({"after": name, "probe_ms": probe(), "stage_s": time.perf_counter() - t0})
    return rows


def _nvidia_smi(query: str) -> list[str] | None:
    """The non-empty lines ``nvidia-smi --<query> --format=csv,noheader`` prints, or None where it cannot run."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", f"--{query}", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [ln.strip() for ln in out.splitlines() if ln.strip()]


def gpu_processes() -> int | None:
    """How many processes hold a context on the GPUs (``nvidia-smi``), or None where it cannot say."""
    lines = _nvidia_smi("query-compute-apps=pid")
    return None if lines is None else len(lines)


def gpu_clocks() -> str | None:
    """The first GPU's SM and memory clocks (MHz) and performance state, as ``nvidia-smi`` reads them now, or None
    where it cannot say."""
    lines = _nvidia_smi("query-gpu=clocks.sm,clocks.mem,pstate")
    return lines[0] if lines else None


def profile_once(device="cuda") -> None:
    """One ``torch.profiler`` session (CPU and CUDA activities: CUPTI) around a small matmul, as Inductor's
    profiling benchmarker runs while it compiles."""
    x = torch.ones(256, 256, device=device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts):
        (x @ x).sum().item()


def stream_state() -> str:
    """The stream the probe's steps were enqueued on: its handle, whether it is the default stream, its priority and
    the priority range, so a build that leaves another current stream shows."""
    cur, default = torch.cuda.current_stream(), torch.cuda.default_stream()
    lo, hi = torch.cuda.Stream.priority_range()
    return (f"0x{cur.cuda_stream:x}{' (default)' if cur.cuda_stream == default.cuda_stream else ''} priority "
            f"{cur.priority} of [{hi}, {lo}]")


def _stop_workers() -> None:
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()


def first_stages(a, keep: list | None = None) -> list:
    """The stages before the build: "idle" (``--idle SECONDS``: the GPU left idle that long), then the
    ``--triggers`` (``launch_triggers.py``; what they allocate is appended to ``keep``), or none."""
    from .launch_triggers import parse_triggers, trigger_stages

    stages = [("idle", lambda: time.sleep(a.idle))] if a.idle > 0 else []
    if a.triggers:
        triggers, kept = trigger_stages(parse_triggers(a.triggers))
        stages += triggers
        if keep is not None:
            keep.append(kept)
    return stages


def last_stages(a) -> list:
    """The stages after the build: "again" (nothing: the probe timed once more), then those the flags ask for, in
    this order: "workers" (``--stop-workers``), "profiled" (``--profile-once``), "emptied" (``--empty-cache``)."""
    extra = [("workers", a.stop_workers, _stop_workers), ("profiled", a.profile_once, lambda: profile_once()),
             ("emptied", a.empty_cache, lambda: torch.cuda.empty_cache())]
    return [("again", lambda: None)] + [(name, fn) for name, on, fn in extra if on]


def parse_patches(items: list[str]) -> dict:
    """``KEY=VALUE`` strings as an Inductor config patch (True / False / ints parsed); refuses a key Inductor lacks."""
    import torch._inductor.config as cfg

    patch = {}
    for item in items:
        key, sep, value = item.partition("=")
        node = cfg
        for part in key.split(".")[:-1]:
            node = getattr(node, part, None)
        if not sep or node is None or not hasattr(node, key.split(".")[-1]):
            raise SystemExit(f"--inductor must be KEY=VALUE with a key of torch._inductor.config, got {item!r}")
        patch[key] = {"True": True, "False": False}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    return patch


def build_stages(dims: dict, path: str, B: int, S: int, n_fill: int, k: int, fresh: bool,
                 device="cuda", patch: dict | None = None) -> tuple[list, dict]:
    """The stages of building ``path``'s compiled step on a new model of ``dims`` (:data:`STAGES`, "loki" only for a
    Loki path), as (name, fn) pairs, and the dict they fill (model, cache, eager logits, compiled forward);
    ``fresh``: Inductor's caches off while it compiles; ``patch``: more Inductor settings while it compiles."""
    from loki._hf import cache_keyword
    from loki.bench import e2e

    from .e2e_profile import enable_for, filled_cache

    base, _, fmt = path.partition("@")
    st = {}
    pos = [(torch.full((B, 1), n_fill + i, device=device), torch.tensor([n_fill + i], device=device)) for i in range(4)]

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    def model():
        st["model"] = e2e.build_model(e2e.llama_config(dims), device)

    def loki():
        enable_for(st["model"], base, k, "auto", device, fmt or "native")

    def cache():
        m = st["model"]
        st["cache"] = filled_cache(m, base, B, S, n_fill, device)
        st["kw"] = {cache_keyword(m): st["cache"]}
        st["ids"] = torch.randint(0, m.config.vocab_size, (B, 1), device=device)

    def call(fn, i):
        return fn(input_ids=st["ids"], position_ids=pos[i][0], cache_position=pos[i][1], use_cache=True, **st["kw"])

    def eager():
        st["eager_logits"] = call(st["model"].forward, 0).logits
        sync()

    def compile_():
        import torch._inductor.config

        st["fn"] = torch.compile(st["model"].forward, mode="reduce-overhead", fullgraph=True)
        settings = {**({"force_disable_caches": True} if fresh else {}), **(patch or {})}
        with torch._inductor.config.patch(settings) if settings else contextlib.nullcontext():
            torch.compiler.cudagraph_mark_step_begin()
            call(st["fn"], 1)
        sync()

    def capture():
        for i in (2, 3):
            torch.compiler.cudagraph_mark_step_begin()
            call(st["fn"], i)
        sync()

    named = {"model": model, "loki": loki, "cache": cache, "eager": eager, "compile": compile_, "capture": capture}
    return [(n, named[n]) for n in STAGES if n != "loki" or base.startswith("loki")], st


def main(argv=None) -> int:
    from loki.bench import e2e

    from .e2e_profile import compiled_step
    from .e2e_steps import add_step_arguments, check_path, dump_graphs_when_captured, measure_steps, model_dims
    from .graph_functions import Driver, changes, snapshot

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", default="loki_compiled", help="the path whose step is timed after every stage "
                    "(a compiled path of loki bench --e2e; loki_compiled@int8 names the int8 copy)")
    ap.add_argument("--build", default="loki_compiled@int8", help="the path built stage by stage on a second model "
                    "(none: no build, only the --triggers and last stages)")
    ap.add_argument("--triggers", default="", metavar="NAMES",
                    help="comma-separated cheap stages run before the build, one piece of a compile each "
                    "(benchmarks/tuning/launch_triggers.py; all: every one)")
    ap.add_argument("--fresh", action="store_true", help="Inductor compiles the built path in this process")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="an Inductor setting for the build (repeatable), e.g. triton.autotune_pointwise=False")
    ap.add_argument("--stop-workers", action="store_true",
                    help="a last stage that shuts Inductor's compile worker processes down")
    ap.add_argument("--profile-once", action="store_true",
                    help="a last stage that runs torch.profiler (CPU and CUDA activities) around one small matmul")
    ap.add_argument("--graph-functions", action="store_true",
                    help="keep the probe's CUDA graphs and print, after every stage, what changed in their kernel "
                    "nodes' functions, node attributes and edges (benchmarks/tuning/graph_functions.py)")
    ap.add_argument("--idle", type=float, default=0.0, metavar="SECONDS",
                    help="a first stage that leaves the GPU idle this long before the build (0: none)")
    ap.add_argument("--empty-cache", action="store_true",
                    help="a last stage that hands the caching allocator's free blocks back (torch.cuda.empty_cache)")
    add_step_arguments(ap, 30, "steps in each of the probe's synced and back-to-back loops")
    a = ap.parse_args(argv)
    dims = model_dims(a)
    for flag, p in (("--probe", a.probe), ("--build", a.build)):
        if not (flag == "--build" and p == "none"):
            check_path(flag, p)
    patch = parse_patches(a.inductor)
    if not a.idle >= 0:
        raise SystemExit(f"--idle must be a number of seconds >= 0, got {a.idle}")
    keep: list = []  # what the triggers allocate, alive to the end
    first, last = first_stages(a, keep), last_stages(a)
    n_build = 0 if a.build == "none" else len(STAGES)
    warm, probes = 8, 1 + len(first) + n_build + len(last)  # before, after each stage
    per_path = warm + 2 * a.steps * probes
    if a.steps < 1 or per_path >= a.seq_len - 4:
        raise SystemExit(f"--steps must be >= 1 with 8 + 2 * steps * {probes} < --seq-len - 4, got --steps {a.steps} "
                         f"--seq-len {a.seq_len}")
    if not torch.cuda.is_available():
        raise SystemExit("launch_state needs a CUDA device")
    n0 = a.seq_len - per_path
    used, procs, graph_changes = [0], [], []
    kept, watch = (dump_graphs_when_captured() if a.graph_functions else None), {}

    def probe():
        first = used[0]
        used[0] += 2 * a.steps
        ms = measure_steps(step, first, a.steps)["back_to_back_ms"]
        procs.append((gpu_processes(), stream_state(), gpu_clocks()))
        if watch:
            now = [snapshot(g.raw_cuda_graph(), watch["driver"]) for g in watch["graphs"]]
            graph_changes.append([ln for b, n in zip(watch["base"], now) for ln in changes(b, n)])
        return ms

    with torch.no_grad(), e2e.sdpa_context("native-gqa"):
        path, _, fmt = a.probe.partition("@")
        step = compiled_step(e2e.build_model(e2e.llama_config(dims), "cuda"), path, a.batch, a.seq_len, n0, per_path,
                             a.k, "auto", fmt or "native")
        for i in range(warm):
            step(i)
        used[0] = warm
        torch.cuda.synchronize()
        if kept is not None:  # the probe's graphs, as captured (the build's come later)
            watch["driver"], watch["graphs"] = Driver(), list(kept)
            watch["base"] = [snapshot(g.raw_cuda_graph(), watch["driver"]) for g in watch["graphs"]]
            print(f"watching {len(watch['graphs'])} graphs of the probe: "
                  f"{sum(len(b) for b in watch['base'] if isinstance(b, list))} kernel nodes")
        stages = [] if a.build == "none" else build_stages(dims, a.build, a.batch, a.seq_len, a.seq_len - 4, a.k,
                                                            a.fresh, patch=patch)[0]
        rows = run_stages(first + stages + last, probe)
        for r, n in zip(rows, procs):
            r["gpu_procs"], r["stream"], r["clocks"] = n
        for r, ch in zip(rows, graph_changes):
            r["graph_changes"] = ch
    head = f"probe {a.probe}, building {a.build}{' (compiled here)' if a.fresh else ''}, {torch.cuda.get_device_name()}"
    print(json.dumps({"probe": a.probe, "build": a.build, "fresh": a.fresh, "inductor": patch, "triggers": a.triggers,
                      "layers": a.layers, "batch": a.batch, "seq_len": a.seq_len, "k": a.k, "rows": rows}))
    print(head)
    for r in rows:
        print(f"RESULT after {r['after']:<8} probe {r['probe_ms']:.3f} ms/step  (stage {r['stage_s']:.1f} s, "
              f"{'?' if r['gpu_procs'] is None else r['gpu_procs']} processes on the GPU; stream {r['stream']}; "
              f"clocks {r['clocks'] or '?'})")
        for line in r.get("graph_changes", [])[:12]:
            print(f"    graphs: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
