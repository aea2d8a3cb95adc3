"""Host-launch overhead of the decode step: SDPA vs the Loki step through Triton's normal launch path
(``DecodeTuning(use_plan=False)``) vs the recorded direct-launch path (``DecodePlan``), do_bench (L2 flushed) and CUDA
graph, plus the host time per call (back to back, no sync).  ``PYTHONPATH=. python -m benchmarks.tuning.host``."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from .._shapes import TARGET_SHAPES, shape_dims


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> int:
    from loki.bench.harness import _sdpa_fn, make_bench_inputs, time_ms, time_ms_graph
    from loki.kernels import make_key_prefix
    from loki.kernels.decode import DecodeTuning, selection_bound
    from loki.testing.decode import kernel_run, kernel_step

    rows = []
    for name in TARGET_SHAPES[:3]:
        B, HQ, HKV, S, D, mode = shape_dims(name)
        x = make_bench_inputs(B, HQ, HKV, S, D)
        d, K = 32, selection_bound(0.25, S)
        counts = torch.full((B,), K, dtype=torch.int32, device="cuda")
        kp = make_key_prefix(x.k_cache, d)
        sdpa, _ = _sdpa_fn(x.q, x.k_cache, x.v_cache, HQ != HKV)
        common = dict(d=d, k_max=K, gqa_select=mode, aggregate="sum", uniform=True, select_method="triton",
                      k_prefix=kp)
        noplan = DecodeTuning(use_plan=False)

        def old(x=x, counts=counts, common=common, noplan=noplan):
            return kernel_step(x.q, x.k_cache, x.v_cache, x.lengths, x.starts, counts, tuning=noplan, **common)

        run = kernel_run(x.q, x.k_cache, d=d, gqa_select=mode, aggregate="sum")

        def new(x=x, counts=counts, run=run, kp=kp, K=K):
            return run.step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=kp, lengths=x.lengths,
                            starts=x.starts, counts=counts, width=K, return_indices=True)
        a, b = old()[1], new()[1]  # the first call of a signature records the plan; the next ones replay it
        a2, b2 = old()[1], new()[1]
        torch.cuda.synchronize()
        same = bool(torch.equal(a, b) and torch.equal(a2, b2))
        r = {"shape": name, "same_output": same}
        for pname, fn in (("sdpa", sdpa), ("loki_noplan", old), ("loki_plan", new)):
            r[pname] = time_ms(fn)
            r[pname + "_graph"] = time_ms_graph(fn)
            r[pname + "_host_us"] = host_us(fn)
        rows.append(r)
        print(json.dumps(r), flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "host_bench.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}  (ms; x = SDPA / provider in the same run; host = us per call)")
    print("| shape | sdpa | noplan | x | plan | x | graph sdpa | graph noplan | graph plan | x graph plan | "
          "host sdpa/noplan/plan us | same |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['sdpa']:.3f} | {r['loki_noplan']:.3f} | {r['sdpa'] / r['loki_noplan']:.2f} | "
              f"{r['loki_plan']:.3f} | {r['sdpa'] / r['loki_plan']:.2f} | {r['sdpa_graph']:.3f} | "
              f"{r['loki_noplan_graph']:.3f} | {r['loki_plan_graph']:.3f} | "
              f"{r['sdpa_graph'] / r['loki_plan_graph']:.2f} | {r['sdpa_host_us']:.0f}/{r['loki_noplan_host_us']:.0f}/"
              f"{r['loki_plan_host_us']:.0f} | {r['same_output']} |")
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
