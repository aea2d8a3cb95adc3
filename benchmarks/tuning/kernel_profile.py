"""Per-kernel device time of the decode step's stages on a GPU (torch.profiler), to see where a step's time goes.

    PYTHONPATH=. python3 -m benchmarks.tuning.kernel_profile [--reps 20] [--out kernels-profile.json]

Cases (bf16 caches, d = 32 of D = 128, Llama-3-8B attention dims GQA 32/8, one selection per KV group):
the split select alone on random fp32 scores (8 x 131072 and 64 x 32768,
                                              top-2048), and the decode step (``DecodeRun.step``)
at B=16 S=8192 k=2048 (k_f 0.25) with the raw-sum and softmax-max aggregates and at B=1 S=131072 and B=8
S=32768 (k=2048).  ``PROFILE_ONLY=<text>`` profiles only the cases whose name contains it.
Each case runs ``--reps`` times under the profiler after a warm-up; per kernel name: mean device us per call
of the case and launches per call; and the time of one CUDA-graph replay of the case (L2 flushed), which adds the
gaps between the kernels.  Prints one block per case and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch


def kernel_rows(prof, calls: int) -> list[tuple[str, float, float]]:
    """(kernel name, device us per call, launches per call) of a torch.profiler run over ``calls`` calls, the
    most expensive first (shared with ``e2e_profile``)."""
    per = collections.defaultdict(lambda: [0.0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total / calls
            per[ev.name][1] += 1 / calls
    return sorted(((n, t, c) for n, (t, c) in per.items()), key=lambda r: -r[1])


def profile(fn, reps: int) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = kernel_rows(prof, reps)
    return {"total_us": sum(t for _, t, _ in rows),
            "kernels": [{"name": n[:80], "us": round(t, 2), "per_call": c} for n, t, c in rows]}


def cases(dev):
    from loki.bench.harness import make_bench_inputs
    from loki.kernels import make_key_prefix, select_topk_split
    from loki.testing.decode import kernel_run

    for B, H, S, k in ((1, 8, 131072, 2048), (8, 8, 32768, 2048)):
        scores = torch.randn(B, H, S, device=dev)
        counts = torch.full((B,), k, dtype=torch.int32, device=dev)
        yield f"split select {B}x{H}x{S} k={k}", (lambda s=scores, c=counts, k=k: select_topk_split(s, c, k_max=k))
    for B, S, k, agg in ((16, 8192, 2048, "sum"), (16, 8192, 2048, "softmax-max"), (1, 131072, 2048, "sum"),
                         (1, 131072, 2048, "softmax-max"), (8, 32768, 2048, "sum"), (8, 32768, 2048, "softmax-max")):
        x = make_bench_inputs(B, 32, 8, S, 128, device=dev, dtype=torch.bfloat16)
        kp = make_key_prefix(x.k_cache, 32)
        counts = torch.full((B,), k, dtype=torch.int32, device=dev)
        run = kernel_run(x.q, x.k_cache, d=32, gqa_select="kv", aggregate=agg)

        def step(x=x, kp=kp, counts=counts, k=k, run=run):
            return run.step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=kp, lengths=x.lengths,
                            starts=x.starts, counts=counts, width=k, return_indices=True)
        yield f"decode step kv:{agg} B={B} S={S} k={k}", step
        if agg == "softmax-max" and S <= 8192:
            from loki.kernels.score_select_softmax import score_select_softmax

            for opts in (dict(block_s=64), dict(block_s=256), dict(num_warps=4), dict(num_warps=16),
                         dict(num_stages=2), dict(block_s=256, num_warps=16)):
                def fused(x=x, kp=kp, counts=counts, k=k, opts=opts):
                    return score_select_softmax(x.q, kp, 32, x.lengths, x.starts, counts, k,
                                                aggregate="softmax-max", **opts)
                yield f"fused softmax-max select {opts} B={B} S={S} k={k}", fused


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="profiled calls per case (default 20)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernels-profile.json"),
                    help="JSON file to write")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from loki.bench.harness import time_ms_graph

    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "pdl": os.environ.get("LOKI_PDL", "0"), "cases": {}}
    only = os.environ.get("PROFILE_ONLY")
    for name, fn in cases(dev):
        if only and only not in name:
            continue
        r = profile(fn, args.reps)
        try:  # one CUDA-graph replay (L2 flushed): kernels plus the gaps between them
            r["graph_us"] = time_ms_graph(fn) * 1e3
        except Exception as exc:  # noqa: BLE001 - a case that cannot be captured still reports its kernels
            r["graph_us"] = None
            r["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
        res["cases"][name] = r
        graph = "-" if r["graph_us"] is None else f"{r['graph_us']:.1f}"
        print(f"\n## {name}: {r['total_us']:.1f} us of kernels per call, {graph} us per CUDA-graph replay")
        for kr in r["kernels"][:12]:
            print(f"{kr['us']:9.2f} us {kr['per_call']:5.1f}x  {kr['name']}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
