"""Where an end-to-end decode step's time goes, for ``loki bench --e2e``'s paths, from torch.profiler.

    PYTHONPATH=. python3 -m benchmarks.tuning.e2e_profile --model llama2-7b --batch 8 --seq-len 4096
    PYTHONPATH=. python3 -m benchmarks.tuning.e2e_profile --model llama3-8b --layers 8 --batch 8 \\
        --seq-len 32768 --k 2048 --generate 16

Default: the compiled forward of the decode step (static caches, CUDA graphs) over a few steps, its kernels
grouped by name, and the device's idle time in a step charged to the kernels that waited (``idle_gaps``).  ``--generate
N``: whole greedy ``model.generate`` calls as the end-to-end benchmark times them (:mod:`loki.bench.e2e_generate`: the
cache holding the prompt, generate compiling its own decode step), one call of N + 1 new tokens and one of 1 profiled
with CPU and CUDA activities; per generated token, the differences of the two: wall time, the device's busy time (the
union of the kernels' intervals), the host-only time (wall - busy: the GPU idle, waiting for the host), kernel launches,
the kernels by name, and the CPU operators by self time.  Between a dense and a Loki path this says what the integration
adds to a ``generate`` step beyond the forward.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch


def _prepare(model, path, B, S, n_fill, k, aggregate, device, score_format="native"):
    """Loki enabled for a Loki path (:func:`enable_for`), and the path's cache holding ``n_fill`` random tokens
    (:func:`filled_cache`)."""
    enable_for(model, path, k, aggregate, device, score_format)
    return filled_cache(model, path, B, S, n_fill, device)


def enable_for(model, path, k, aggregate, device, score_format="native") -> None:
    """Loki enabled on ``model`` with a random basis for a Loki path (``score_format`` "int8": the int8 copy of 2d
    dims, d_f 0.5, the native copy's bytes at d_f 0.25; the Triton kernels on CUDA); nothing for a dense path."""
    from loki.basis import PCABasis
    from loki.bench import e2e
    from loki.integrations.transformers import enable_loki

    if path.startswith("loki"):
        L, _, HKV, D = e2e._dims(model.config)
        enable_loki(model, PCABasis.random(L, HKV, D, seed=0), k=k, d=0.25 if score_format == "native" else 0.5,
                    aggregate=aggregate, score_format=score_format,
                    backend="auto" if torch.device(device).type == "cuda" else "torch")  # gqa_select: the default


def filled_cache(model, path, B, S, n_fill, device):
    """``path``'s cache of S tokens (``loki.bench.e2e.make_cache``) holding ``n_fill`` random tokens."""
    from loki.bench import e2e

    cache = e2e.make_cache(model, path, B, S)
    e2e.fill_cache(cache, model.config, B, n_fill, device=device, dtype=next(model.parameters()).dtype)
    return cache


def _release(model, path):
    from loki.integrations.transformers import disable_loki

    if path.startswith("loki"):
        disable_loki(model)
    if hasattr(model, "_compiled_call"):
        del model._compiled_call  # generate's compiled forward
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compiled_step(model, path, B, S, n_fill, n_steps, k, aggregate="auto", score_format="native"):
    """``path``'s compiled decode step on ``model`` (``mode="reduce-overhead"``: static cache, CUDA graphs), the
    cache holding ``n_fill`` random tokens: ``step(i)`` writes position ``n_fill + i`` for i < ``n_steps``.  Its
    position tensors are built here, once, so a step launches only the compiled forward (shared by
    :func:`profile_path` and ``e2e_steps``)."""
    from loki._hf import cache_keyword

    if n_fill < 1 or n_fill + n_steps > S:
        raise ValueError(f"n_fill + n_steps must fit in the cache of {S} tokens with n_fill >= 1, got {n_fill} + "
                         f"{n_steps}")
    cache = _prepare(model, path, B, S, n_fill, k, aggregate, "cuda", score_format)
    fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    key = cache_keyword(model)
    ids = torch.randint(0, 1000, (B, 1), device="cuda")
    pos = [(torch.full((B, 1), n_fill + i, device="cuda"), torch.tensor([n_fill + i], device="cuda"))
           for i in range(n_steps)]

    def step(i):
        torch.compiler.cudagraph_mark_step_begin()
        fn(input_ids=ids, position_ids=pos[i][0], cache_position=pos[i][1], use_cache=True, **{key: cache})

    return step


def profile_path(model, path, B, S, steps=8, prof_steps=4, k=0.25, aggregate="auto", sdpa_backend="default",
                 score_format="native"):
    """The compiled forward of ``path``'s decode step: kernels per step, grouped by name."""
    from loki.bench import e2e

    from .kernel_profile import kernel_rows

    step = compiled_step(model, path, B, S, S - steps - prof_steps, steps + prof_steps, k, aggregate, score_format)
    with torch.no_grad(), e2e.sdpa_context(sdpa_backend):
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(steps, steps + prof_steps):
                step(i)
            torch.cuda.synchronize()
    rows = kernel_rows(prof, prof_steps)
    gaps = _gaps(prof, prof_steps)
    gaps["launch_gaps"] = launch_gaps(_kernel_events(prof))
    step = None  # it holds the cache and the compiled forward: released here
    _release(model, path)
    return {"total_us": sum(t for _, t, _ in rows), "kernels": sum(c for _, _, c in rows), **gaps,
            "top": [{"name": n[:90], "us": t, "count": c} for n, t, c in rows[:30]]}


def _kernel_events(prof) -> list:
    """(start, end, name) in us of every device activity of a torch.profiler run."""
    return [(ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
            if ev.device_type == torch.autograd.DeviceType.CUDA]


def _gaps(prof, calls: int) -> dict:
    """:func:`idle_gaps` of a torch.profiler run's kernels over ``calls`` steps."""
    return idle_gaps(_kernel_events(prof), calls)


def launch_gaps(events, max_gap_us: float = 50.0, top: int = 10) -> dict:
    """The device's gap from one kernel to the next within a step: for each kernel (by start time) its start minus
    the latest end of the kernels before it (negative: it started before they ended), gaps above ``max_gap_us``
    (waits on the host, step boundaries) left out.  Returns the count, median, 10th and 90th percentiles (us), how
    many started early, the sum of the positive gaps (us), and per pair of consecutive kernel names the count and
    median gap, largest sum first.  A process runs its CUDA graphs in one of two states, which the latest build of
    a step sets (results/launch-state-h200-2026-11-28/): median about 0.1 us with some early starts, or about
    0.4 us with none; the second costs ~0.45 ms per 1,000 kernels."""
    evs = sorted(events)
    gaps, pairs = [], collections.defaultdict(list)
    end = evs[0][1] if evs else 0.0
    for (_, _, prev), (s, e, name) in zip(evs, evs[1:]):
        g = s - end
        end = max(end, e)
        if g <= max_gap_us:
            gaps.append(g)
            pairs[(prev[:40], name[:40])].append(g)
    if not gaps:
        return {"n": 0}
    q = sorted(gaps)

    def pct(p):
        return q[min(len(q) - 1, int(p * len(q)))]

    rows = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"n": len(q), "median_us": pct(0.5), "p10_us": pct(0.1), "p90_us": pct(0.9),
            "early_starts": sum(g < 0 for g in q), "sum_us": sum(g for g in q if g > 0),
            "pairs": [{"from": a, "to": b, "count": len(v), "median_us": sorted(v)[len(v) // 2]}
                      for (a, b), v in rows]}


def idle_gaps(events, calls: int, top: int = 15) -> dict:
    """Of kernels ``events`` ((start, end, name), us) over ``calls`` steps, per step: the device span from the
    first kernel's start to the last one's end, the busy time (the union of the kernels' intervals) and the idle
    rest; and the idle time before each kernel name (since every kernel before it ended), summed, the largest
    first: where a step's time outside kernels goes (results/cold-process-2026-11-28)."""
    evs = sorted(events)
    if not evs:
        return {}
    span = evs[-1][1] - evs[0][0]
    busy = _busy_us([(s, e) for s, e, _ in evs])
    before, end = collections.Counter(), evs[0][0]
    for s, e, name in evs:
        if s > end:
            before[name] += (s - end) / calls
        end = max(end, e)
    return {"span_us": span / calls, "busy_us": busy / calls, "idle_us": (span - busy) / calls,
            "idle_before": [{"name": n[:90], "us": t} for n, t in before.most_common(top)]}


def _busy_us(intervals) -> float:
    """Length of the union of [start, end) intervals (us)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _summary(prof, wall_ms: float) -> dict:
    """Wall, device busy and kernel time, launches, kernels and CPU operators of one profiled call."""
    kernels, intervals, cpu = collections.Counter(), [], collections.Counter()
    launches = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels[ev.name] += ev.device_time_total
            intervals.append((ev.time_range.start, ev.time_range.end))
            launches += 1
        else:
            cpu[ev.name] += ev.self_cpu_time_total
    return {"wall_us": wall_ms * 1e3, "busy_us": _busy_us(intervals), "kernel_us": sum(kernels.values()),
            "launches": launches, "kernels": kernels, "cpu": cpu}


def profile_generate(model, path, B, S, new_tokens=16, k=0.25, aggregate="auto", sdpa_backend="default",
                     device="cuda", top=25, score_format="native") -> dict:
    """Whole ``generate`` calls of ``path`` (see the module docstring): per generated token, the difference of a
    profiled call of N + 1 new tokens and one of 1."""
    from loki._hf import cache_keyword
    from loki.bench import e2e

    N = int(new_tokens)
    n0 = S - N - 1
    cache = _prepare(model, path, B, S, n0 - 1, k, aggregate, device, score_format)
    key = cache_keyword(model)
    g = torch.Generator(device="cpu").manual_seed(11)
    ids = torch.randint(0, int(model.config.vocab_size), (B, n0), generator=g).to(device)
    mask = torch.ones_like(ids)
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    def call(n):
        e2e.rewind(cache, n0 - 1)
        kw = {key: cache, "attention_mask": mask, "max_new_tokens": n, "min_new_tokens": n, "do_sample": False,
              "pad_token_id": 0}
        if path.endswith("_eager") or not cuda:
            kw["disable_compile"] = True
        return model.generate(ids, **kw)

    out = {}
    with torch.no_grad(), e2e.sdpa_context(sdpa_backend):
        for n in (1, N + 1, 1, N + 1):  # generate compiles and records its step on the first calls
            call(n)
        for name, n in (("1", 1), ("N+1", N + 1)):
            sync()
            with torch.profiler.profile(activities=acts) as prof:
                t0 = time.perf_counter()
                call(n)
                sync()
                wall = (time.perf_counter() - t0) * 1e3
            out[name] = _summary(prof, wall)
    cache = None
    _release(model, path)
    a, b = out["1"], out["N+1"]
    per = {f: (b[f] - a[f]) / N for f in ("wall_us", "busy_us", "kernel_us", "launches")}
    per["host_only_us"] = per["wall_us"] - per["busy_us"]

    def diff(field):
        d = {n: (b[field][n] - a[field].get(n, 0.0)) / N for n in b[field]}
        return [{"name": n[:90], "us": round(v, 2)} for n, v in sorted(d.items(), key=lambda x: -x[1])[:top]]

    return {"new_tokens": N, "per_token": per, "kernels": diff("kernels"), "cpu_ops": diff("cpu"),
            "calls": {name: {f: v for f, v in r.items() if f not in ("kernels", "cpu")} for name, r in out.items()}}


def _print_generate(spec, r):
    p = r["per_token"]
    print(f"\n## {spec} generate: per token {p['wall_us'] / 1e3:.3f} ms wall, {p['busy_us'] / 1e3:.3f} ms device "
          f"busy, {p['host_only_us'] / 1e3:.3f} ms host-only, {p['kernel_us'] / 1e3:.3f} ms of kernels, "
          f"{p['launches']:.0f} launches")
    for t in r["kernels"][:12]:
        print(f"{t['us']:9.1f} us  kernel  {t['name']}")
    for t in r["cpu_ops"][:12]:
        print(f"{t['us']:9.1f} us  cpu     {t['name']}")


def main(argv=None) -> int:
    from loki.bench import e2e

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--paths", default="sdpa_compiled,loki_compiled",
                    help="comma-separated paths; a Loki path may name its aggregate, e.g. loki_compiled:sum (default: "
                    "enable_loki's, softmax-max for a shared selection), and its score copy, e.g. loki_compiled@int8 "
                    "(int8 codes of 2d dims, d_f 0.5)")
    ap.add_argument("--k", default="0.25", help="Loki budget: a fraction (0.25) or a token count (2048)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    ap.add_argument("--sdpa-backend", default="native-gqa", help="dense SDPA variant (loki.bench.e2e)")
    ap.add_argument("--generate", type=int, default=None, metavar="N",
                    help="profile whole generate calls of N + 1 and 1 new tokens instead of the forward")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dims = dict(e2e.E2E_MODELS[a.model])
    if a.layers:
        dims["num_hidden_layers"] = a.layers
    model = e2e.build_model(e2e.llama_config(dims), "cuda")
    k = float(a.k) if "." in a.k else int(a.k)
    res = {}
    for spec in a.paths.split(","):
        path, _, fmt = spec.partition("@")
        path, _, agg = path.partition(":")
        if a.generate:
            r = res[spec] = profile_generate(model, path, a.batch, a.seq_len, a.generate, k=k, aggregate=agg or "auto",
                                             sdpa_backend=a.sdpa_backend, score_format=fmt or "native")
            _print_generate(spec, r)
            continue
        r = res[spec] = profile_path(model, path, a.batch, a.seq_len, k=k, aggregate=agg or "auto",
                                     sdpa_backend=a.sdpa_backend, score_format=fmt or "native")
        print(f"\n## {spec} {a.model} L={dims['num_hidden_layers']} B={a.batch} S={a.seq_len} k={k}: "
              f"{r['total_us'] / 1e3:.3f} ms of kernels per step, {r['kernels']:.0f} kernels")
        for t in r["top"]:
            print(f"{t['us']:9.1f} us {t['count']:5.0f}x  {t['name']}")
        if "span_us" in r:
            print(f"device span {r['span_us'] / 1e3:.3f} ms per step, busy {r['busy_us'] / 1e3:.3f}, idle "
                  f"{r['idle_us'] / 1e3:.3f}; idle before:")
            for t in r["idle_before"]:
                print(f"{t['us']:9.1f} us  {t['name']}")
        lg = r.get("launch_gaps", {})
        if lg.get("n"):
            print(f"launch gaps: median {lg['median_us']:.2f} us (p10 {lg['p10_us']:.2f}, p90 {lg['p90_us']:.2f}) over "
                  f"{lg['n']} kernels, {lg['early_starts']} started before the previous one ended")
    kind = "generate-profile" if a.generate else "profile"
    name = f"{kind}-{a.model}-B{a.batch}-S{a.seq_len}-k{a.k}.json"
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "layers": dims["num_hidden_layers"], **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
