"""End-to-end decode of Llama-3-8B dims (GQA 32/8, random weights, bf16) on a GPU: the compiled dense path against
compiled Loki with one selection per KV group, raw sums ("sum") and the default softmax-normalised scores
("softmax-max"), at B=16 S=8192 (k_f 0.25) and at B=1 S=131072 with the fixed budget k = 2048.

    PYTHONPATH=$PWD python3 tools/studies/e2e_aggregates.py --out e2e-aggregates.json     # about 5 minutes on an H100

Prints one line per path (ms per step, speed-up over the compiled dense path of the same setting) and writes JSON.
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    args = ap.parse_args(argv)
    import torch

    from loki.bench.e2e import Setting, run_grid
    from loki.bench.harness import measure_copy_bandwidth

    copy = measure_copy_bandwidth()
    rows = []
    for setting, k in ((Setting("llama3-8b", 16, 8192), 0.25), (Setting("llama3-8b", 1, 131072), 2048)):
        dense = run_grid([setting], paths=("sdpa_compiled",), steps=args.steps, k_f=k, sdpa_backend="native-gqa",
                         copy_gbps=copy)[0]
        base = dense["paths"]["sdpa_compiled"].get("ms_median")
        for agg in ("sum", "softmax-max"):
            r = run_grid([setting], paths=("loki_compiled",), steps=args.steps, k_f=k, sdpa_backend="native-gqa",
                         copy_gbps=copy, aggregate=agg)[0]
            ms = r["paths"]["loki_compiled"].get("ms_median")
            row = {"setting": setting.id, "k": k, "aggregate": agg, "dense_ms": base, "loki_ms": ms,
                   "speedup": base / ms if base and ms else None, "bytes": r.get("bytes"),
                   "floor_ms": r.get("floor_ms"), "paths": {**dense["paths"], **r["paths"]}}
            rows.append(row)
            print(f"{setting.id} k={k} {agg:12s} dense {base} ms, loki {ms} ms, "
                  f"x{row['speedup'] if row['speedup'] is None else round(row['speedup'], 3)}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": copy, "dtype": "bfloat16", "rows": rows},
                  f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
