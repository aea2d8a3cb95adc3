"""Launch options of the row-barrier select (``loki.kernels.select_coop``) against the split select, on a GPU.

    PYTHONPATH=. python3 -m benchmarks.tuning.coop_sweep [--out coop-sweep.json]

Random fp32 scores, top-2048 of 8 rows x 131072 and 64 rows x 32768 (the decode step's rows at B=1 S=131072 and
B=8 S=32768 with 8 KV heads); every variant checked against ``torch.topk``'s set first, then timed as one
CUDA-graph replay with L2 flushed (``time_ms_graph``).  Variants: the split select; the row-barrier select with
its defaults, phased (one launch per level, no barriers), 4 and 2 bits per level, 4 / 8 / 16 warps, at most 8 /
16 / 32 programs per row.  Prints a table (us) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "coop-sweep.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    import loki.kernels.select_coop as coop
    from loki.bench.harness import time_ms_graph
    from loki.kernels import select_topk_coop, select_topk_split

    dev = torch.device("cuda")
    base = dict(coop.COOP_DEFAULTS)
    variants = [("split", None, {}), ("coop", {}, {}), ("coop phased", {}, dict(phased=True)),
                ("coop bits=4", {}, dict(bits=4)), ("coop bits=2", {}, dict(bits=2))]
    variants += [(f"coop warps={w}", dict(num_warps=w), {}) for w in (4, 8)]
    variants += [(f"coop max_programs={p}", dict(max_programs=p), {}) for p in (8, 16)]
    res = {"device": torch.cuda.get_device_name(), "cases": {}}
    for rows, S, k in ((8, 131072, 2048), (64, 32768, 2048)):
        scores = torch.randn(1, rows, S, device=dev)
        counts = torch.full((1,), k, dtype=torch.int32, device=dev)
        want = torch.topk(scores, k, dim=-1).indices.sort(-1).values
        case = res["cases"][f"{rows}x{S} k={k}"] = {}
        for name, patch, opts in variants:
            coop.COOP_DEFAULTS.clear()
            coop.COOP_DEFAULTS.update(base, **(patch or {}))
            if patch is None:
                fn = (lambda s=scores, c=counts, k=k: select_topk_split(s, c, k_max=k))
            else:
                fn = (lambda s=scores, c=counts, k=k, o=opts: select_topk_coop(s, c, k_max=k, **o))
            try:
                ok = bool(torch.equal(fn().long().sort(-1).values, want))
                us = time_ms_graph(fn) * 1e3
            except Exception as exc:  # noqa: BLE001 - a variant that does not fit is reported, not fatal
                ok, us = False, None
                case[name + " error"] = f"{type(exc).__name__}: {exc}"[:200]
            case[name] = {"us": us, "same_set": ok}
            print(f"{rows:3d}x{S:<6d} {name:24s} {'-' if us is None else f'{us:7.1f}'} us  same set: {ok}", flush=True)
    coop.COOP_DEFAULTS.clear()
    coop.COOP_DEFAULTS.update(base)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
