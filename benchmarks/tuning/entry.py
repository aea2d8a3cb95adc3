"""The public entry points of the decode step on a GPU: ``decode_attention`` (the convenience path: every
check, budgets resolved per call) and ``plan_decode(...).run`` (checked once), against flash SDPA in the same
process, each timed eagerly (do_bench, L2 flushed) and as a CUDA-graph replay, plus the host time of one call.

Host time, two ways: ``host_us`` is the CPU time of one call started on an idle GPU (the call's launches are
asynchronous, so this is the time the caller's thread spends in it); ``wall_minus_device_us`` is the wall time
of a call followed by a synchronisation, minus the device time of the same call replayed as a CUDA graph (it
also counts the synchronisation's own latency, a few us).

    PYTHONPATH=. python3 -m benchmarks.tuning.entry        (writes entry.json under $OUT or .)
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

#: (name, B, HQ, HKV, S, D, gqa_select, k): the shapes of the fast-decode issue's table, and a fixed budget at long
#: context (k = 2048 of 131072).  ``ENTRY_ONLY=<text>`` runs only the cases whose name contains it.
CASES = (
    ("mha40-B16-S4096", 16, 40, 40, 4096, 128, "query", 0.25),
    ("mha40-B1-S16384", 1, 40, 40, 16384, 128, "query", 0.25),
    ("gqa32/8-B16-S8192", 16, 32, 8, 8192, 128, "kv", 0.25),
    ("gqa32/8-B1-S32768", 1, 32, 8, 32768, 128, "kv", 0.25),
    ("gqa32/8-B64-S4096", 64, 32, 8, 4096, 128, "kv", 0.25),
    ("mha32-D96-B8-S8192", 8, 32, 32, 8192, 96, "query", 0.25),
    ("gqa32/8-B1-S131072-k2048", 1, 32, 8, 131072, 128, "kv", 2048),
)


def host_us(fn, n: int = 100) -> float:
    """Median CPU time of one call of ``fn`` started with the GPU idle."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def wall_us(fn, n: int = 100) -> float:
    """Median wall time of one call of ``fn`` plus a synchronisation."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    from loki.bench.harness import _sdpa_fn, make_bench_inputs, time_ms, time_ms_graph
    from loki.kernels import decode_attention, make_key_prefix, plan_decode

    rows = []
    only = os.environ.get("ENTRY_ONLY")
    for name, B, HQ, HKV, S, D, mode, k in CASES:
        if only and only not in name:
            continue
        x = make_bench_inputs(B, HQ, HKV, S, D)
        d = D // 4
        kp = make_key_prefix(x.k_cache, d)
        lengths = torch.full((B,), S, dtype=torch.int32, device="cuda")
        starts = torch.zeros(B, dtype=torch.int32, device="cuda")
        sdpa, _ = _sdpa_fn(x.q, x.k_cache, x.v_cache, HQ != HKV)

        def conv(x=x, kp=kp, lengths=lengths, starts=starts, d=d, mode=mode, k=k):
            return decode_attention(x.q, x.k_cache, x.v_cache, d=d, k=k, lengths=lengths, starts=starts,
                                    backend="triton", gqa_select=mode, k_prefix=kp, check_values=False, aggregate="sum")

        plan = plan_decode(x.k_cache, x.v_cache, num_q_heads=HQ, d=d, k=k, k_prefix=kp, gqa_select=mode,
                           aggregate="sum")

        def planned(x=x, plan=plan, lengths=lengths, starts=starts):
            return plan.run(x.q, lengths, starts)

        a = conv()
        b = planned().clone()
        c = planned().clone()
        torch.cuda.synchronize()
        r = {"case": name, "B": B, "HQ": HQ, "HKV": HKV, "S": S, "D": D, "gqa_select": mode, "k": k,
             "plan_equals_convenience": bool(torch.equal(a, b) and torch.equal(a, c)), "replays": plan.replays > 0}
        for pname, fn in (("sdpa", sdpa), ("convenience", conv), ("plan", planned)):
            r[pname + "_ms"] = time_ms(fn)
            r[pname + "_graph_ms"] = time_ms_graph(fn)
            r[pname + "_host_us"] = host_us(fn)
            r[pname + "_wall_us"] = wall_us(fn)
            r[pname + "_wall_minus_device_us"] = r[pname + "_wall_us"] - 1e3 * r[pname + "_graph_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        del x, kp, plan
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "entry.json"), "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "dtype": "bfloat16", "k": "per case", "d_f": 0.25,
                   "rows": rows}, f, indent=1)
    print(f"\n{dev}, bf16, d_f = 0.25, k_f = 0.25 unless the case names k "
          "(ms; x = SDPA time / Loki time, same run; host in us per call)")
    print("| case | SDPA | conv | x | plan | x | graph SDPA | graph plan | x graph | host conv/plan | "
          "wall-dev conv/plan | equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['sdpa_ms']:.3f} | {r['convenience_ms']:.3f} | "
              f"{r['sdpa_ms'] / r['convenience_ms']:.2f} | {r['plan_ms']:.3f} | {r['sdpa_ms'] / r['plan_ms']:.2f} | "
              f"{r['sdpa_graph_ms']:.3f} | {r['plan_graph_ms']:.3f} | {r['sdpa_graph_ms'] / r['plan_graph_ms']:.2f} | "
              f"{r['convenience_host_us']:.0f}/{r['plan_host_us']:.0f} | "
              f"{r['convenience_wall_minus_device_us']:.0f}/{r['plan_wall_minus_device_us']:.0f} | "
              f"{r['plan_equals_convenience']} |")
    return 0 if all(r["plan_equals_convenience"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
