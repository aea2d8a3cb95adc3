"""The approximate-scores kernel over an int8 score copy of 2d dims against the native bf16 prefix of d dims (the
same bytes but one 16-bit scale per token), on a GPU.

    PYTHONPATH=. python -m benchmarks.tuning.score_formats --out results/score-formats.json

Llama-3-8B attention dims (32 query heads, 8 KV heads, D = 128, native d = 32, int8 d = 64), bf16 caches, the
scores of one decode step (`loki.kernels.approx_scores`'s launch): per query head (what the default's softmax-max
aggregate scores before its group pass) and the group's sum.  Each int8 result is first checked against the
reference's ``score_format="int8"`` (`loki.reference.approx_scores`).  Times: one CUDA-graph replay with the L2
flushed (median, us); bytes read: the keys' prefix (plus the scales) and the scores written.  Writes JSON to --out
and prints a short table last.  ``--smoke``: tiny shapes, no timing (the CPU interpreter or a GPU); ``--variants``:
the int8 copy at other blocks and warps; ``--pipeline``: both copies with 4-16 tiles per program and 2-3 stages;
``--mma8``: the per-head scores as int8 tensor-core products (``dot="int8"``) at other tiles, warps and stages.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch

SHAPES = [  # name, B, HQ, HKV, S, D, d (native)
    ("llama3-8b B=1 S=131072", 1, 32, 8, 131072, 128, 32),
    ("llama3-8b B=8 S=32768", 8, 32, 8, 32768, 128, 32),
    ("llama3-8b B=16 S=8192", 16, 32, 8, 8192, 128, 32),
]
SMOKE_SHAPES = [("smoke", 2, 4, 2, 300, 64, 16)]


def run(smoke: bool, variants: bool = False, pipeline: bool = False, mma8: bool = False) -> list[dict]:
    from loki.bench.harness import time_ms_graph
    from loki.kernels.approx_scores import launch_approx_scores
    from loki.reference import approx_scores
    from loki.reference.score_formats import encode_int8_score_keys
    from loki.testing.inputs import make_decode_inputs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name, B, HQ, HKV, S, D, d in SMOKE_SHAPES if smoke else SHAPES:
        x = make_decode_inputs(B, HQ, HKV, S, D, dtype=torch.bfloat16, device=device, seed=0)
        prefix = x.k_cache[..., :d].contiguous()
        codes, scale = encode_int8_score_keys(x.k_cache[..., : 2 * d])
        heads = torch.empty(B, HQ, S, dtype=torch.float32, device=device)
        agg = torch.empty(B, HKV, S, dtype=torch.float32, device=device)
        for mode in ("per query head", "group sum"):
            ho, ao = (heads, None) if mode == "per query head" else (None, agg)
            out = ho if ho is not None else ao
            written = out.numel() * 4
            cases = {
                f"bf16 prefix, d={d}": (partial(launch_approx_scores, x.q, prefix, d, x.lengths, x.starts, ho, ao,
                                                "sum"), prefix.numel() * 2),
                f"int8 copy, d={2 * d}": (partial(launch_approx_scores, x.q, codes, 2 * d, x.lengths, x.starts, ho, ao,
                                                  "sum", prefix_scale=scale), codes.numel() + scale.numel() * 2),
            }
            if ho is not None:
                cases[f"int8 copy, d={2 * d}, int8 products"] = (partial(
                    launch_approx_scores, x.q, codes, 2 * d, x.lengths, x.starts, ho, ao, "sum", prefix_scale=scale,
                    dot="int8"), codes.numel() + scale.numel() * 2)
            if mma8 and ho is not None and not smoke:
                for (tiles, stages), bs, nw in itertools.product(((1, 1), (4, 2), (4, 3), (8, 3)), (64, 128, 256),
                                                                 (2, 4)):
                    cases[f"int8 copy, d={2 * d}, int8 products, block {bs}, {nw} warps, {tiles} tiles, {stages} "
                          "stages"] = (partial(
                              launch_approx_scores, x.q, codes, 2 * d, x.lengths, x.starts, ho, ao, "sum",
                              block_s=bs, num_warps=nw, prefix_scale=scale, dot="int8", tiles=tiles,
                              num_stages=stages), codes.numel() + scale.numel() * 2)
            if variants and not smoke:
                for bs in (64, 128, 256, 512):
                    for nw in (2, 4, 8):
                        cases[f"int8 copy, d={2 * d}, block {bs}, {nw} warps"] = (partial(
                            launch_approx_scores, x.q, codes, 2 * d, x.lengths, x.starts, ho, ao, "sum", block_s=bs,
                            num_warps=nw, prefix_scale=scale), codes.numel() + scale.numel() * 2)
            if pipeline and not smoke:
                for tiles, stages in ((4, 2), (4, 3), (8, 2), (8, 3), (16, 3)):
                    for bs, nw in ((None, None), (256, 4), (128, 4)):
                        tag = f"{tiles} tiles, {stages} stages" + ("" if bs is None else f", block {bs}, {nw} warps")
                        cases[f"bf16 prefix, d={d}, {tag}"] = (partial(
                            launch_approx_scores, x.q, prefix, d, x.lengths, x.starts, ho, ao, "sum", block_s=bs,
                            num_warps=nw, tiles=tiles, num_stages=stages), prefix.numel() * 2)
                        for dot in ((True, False) if ho is not None else (None,)):
                            cases[f"int8 copy, d={2 * d}, {tag}" + (", CUDA cores" if dot is False else "")] = (
                                partial(launch_approx_scores, x.q, codes, 2 * d, x.lengths, x.starts, ho, ao, "sum",
                                        block_s=bs, num_warps=nw, prefix_scale=scale, dot=dot, tiles=tiles,
                                        num_stages=stages), codes.numel() + scale.numel() * 2)
            base = None
            for label, (fn, read) in cases.items():
                fn()
                if label.startswith("int8"):
                    want = approx_scores(x.q, x.k_cache, 2 * d, x.lengths, x.starts, score_format="int8",
                                         gqa_select="query" if ho is not None else "kv", aggregate="sum")
                    fin = torch.isfinite(want)
                    err = float((out[fin] - want[fin]).abs().max()) / max(1.0, float(want[fin].abs().max()))
                    ok = err <= 1e-4 and torch.equal(torch.isneginf(out), torch.isneginf(want))
                else:
                    ok = True
                us = None if smoke else 1000 * time_ms_graph(fn)
                row = {"shape": name, "B": B, "HQ": HQ, "HKV": HKV, "S": S, "D": D, "mode": mode, "keys": label,
                       "read_bytes": read, "written_bytes": written, "us": us, "ok": bool(ok)}
                if us is not None:
                    row["TB/s"] = (read + written) / us / 1e6
                    base = us if base is None else base
                    row["vs bf16"] = us / base
                rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (checks the script)")
    ap.add_argument("--variants", action="store_true", help="also the int8 scores at other tiles and warps")
    ap.add_argument("--pipeline", action="store_true",
                    help="also both copies with several tiles per program, their loads pipelined (stages)")
    ap.add_argument("--mma8", action="store_true",
                    help="also the int8 copy's per-head scores as int8 products at other tiles, warps and stages")
    args = ap.parse_args(argv)
    rows = run(args.smoke, args.variants, args.pipeline, args.mma8)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"\n{card} (us: CUDA-graph replay, L2 flushed)")
    print("| shape | scores | keys | bytes read + written (MB) | us | TB/s | vs bf16 | ok |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        us = "-" if r["us"] is None else f"{r['us']:.1f}"
        bw = f"{r['TB/s']:.2f}" if "TB/s" in r else "-"
        vs = f"{r['vs bf16']:.2f}" if "vs bf16" in r else "-"
        print(f"| {r['shape']} | {r['mode']} | {r['keys']} | {(r['read_bytes'] + r['written_bytes']) / 1e6:.1f} | "
              f"{us} | {bw} | {vs} | {r['ok']} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
