"""Decode-step variants at the performance targets, timed in one process on the GPU: the previous path
(scores and select as two kernels, 4+ attention splits, chunked compaction everywhere), the current
default (fused score+select where it pays, 3 splits with many rows, register compaction for few rows), programmatic
dependent launch (``LOKI_PDL``) on/off, and the fused kernel forced on/off.  Every variant's output is
checked against the PyTorch reference, and its selection against exact top-k of the reference scores,
before it is timed.  ``--stages`` times the score/select stages alone (two kernels vs fused, launch
configurations).  ``--int8``: the default configuration's step (softmax-max for a shared selection) on the bf16
prefix of d dims against the int8 score copy of 2d dims, unfused and fused (``DecodeTuning(fuse_select=True)``).

    PYTHONPATH=. python3 -m benchmarks.tuning.fusion --out $OUT [--quick] [--only "mha-B16-S4096,..."] [--stages]
        [--int8]

Writes ``fusion.json`` (or ``stages.json``) under --out and prints a table last (ms; x = SDPA / variant
in the same run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

from .._shapes import FUSION_SHAPES, shape_dims


def _selection_ok(idx, s_ref, K):
    """K distinct valid positions per row, each scoring (by the reference scores) at least the row's K-th
    largest reference score up to rounding (the kernel's fp32 sums may order near-ties differently)."""
    if idx.shape[-1] != K or bool((idx < 0).any()):
        return False
    srt = torch.sort(idx.long(), -1).values
    if bool((srt[..., 1:] == srt[..., :-1]).any()):
        return False
    kth = torch.topk(s_ref, K, dim=-1).values[..., -1:]
    got = torch.gather(s_ref, -1, idx.long())
    return bool((got >= kth - 1e-4 * (kth.abs() + 1)).all())


def stage_sweep(x, kp, counts, K, d, mode, s_ref):
    """Scores + select as two kernels against the fused kernel over launch configurations (CUDA graph)."""
    from loki.bench.harness import time_ms_graph
    from loki.kernels import score_select, select_topk
    from loki.kernels.approx_scores import launch_approx_scores

    B, HQ, _ = x.q.shape
    HKV, S = x.k_cache.shape[1], x.k_cache.shape[2]
    H = HQ if mode == "query" else HKV
    scores = torch.empty(B, H, S, device="cuda")
    out = {}

    def run(name, fn, check=True):
        try:
            idx = fn()
            torch.cuda.synchronize()
            ok = _selection_ok(idx, s_ref, K) if check else True
            out[name] = {"ok": ok, "ms": time_ms_graph(fn) if ok else float("nan")}
        except Exception as e:  # noqa: BLE001 - a configuration that fails is recorded, not fatal
            out[name] = {"ok": False, "error": repr(e)[:300]}
        print(name, out[name], flush=True)

    def scores_fn(**kw):
        def fn():
            launch_approx_scores(x.q, kp, d, x.lengths, x.starts, scores if mode == "query" else None,
                                  None if mode == "query" else scores, "sum", **kw)
        return fn

    def two():
        scores_fn()()
        return select_topk(scores, counts, k_max=K, method="triton")

    run("scores", scores_fn(), check=False)
    run("select", lambda: select_topk(scores, counts, k_max=K, method="triton"))
    run("two kernels", two)
    run("fused", lambda: score_select(x.q, kp, d, x.lengths, x.starts, counts, K, gqa_select=mode,
                                      scores=scores, aggregate="sum")[1])
    for w, bs, st in ((8, 256, 3), (16, 1024, 2), (8, 512, 3), (4, 512, 2)):
        run(f"fused w{w} bs{bs} st{st}", lambda w=w, bs=bs, st=st: score_select(
            x.q, kp, d, x.lengths, x.starts, counts, K, gqa_select=mode, scores=scores, num_warps=w, block_s=bs,
            num_stages=st, aggregate="sum")[1])
    return out


def int8_variants(x, counts, K, d, mode) -> dict:
    """The default configuration's step (``mode``; softmax-max for "kv") over the bf16 prefix of d dims, then over
    the int8 score copy of 2d dims (the same bytes) unfused and fused: each checked against the reference's
    ``score_format`` first (output within 2e-2, a selection of the reference scores' top K up to rounding), then
    timed (ms, and in a CUDA graph)."""
    import loki.reference as R
    from loki.bench.harness import time_ms, time_ms_graph
    from loki.kernels import make_key_prefix
    from loki.kernels.decode import DecodeTuning
    from loki.reference.score_formats import encode_int8_score_keys
    from loki.testing.decode import kernel_run

    agg = "softmax-max" if mode == "kv" else "sum"
    codes, scale = encode_int8_score_keys(x.k_cache[..., : 2 * d])
    cases = {"bf16 prefix, d, default": (d, make_key_prefix(x.k_cache, d), None, None, "native"),
             "int8 copy, 2d, unfused": (2 * d, codes, scale, False, "int8"),
             "int8 copy, 2d, fused": (2 * d, codes, scale, True, "int8")}
    out = {}
    for vname, (dd, kp, sc, fuse, fmt) in cases.items():
        ref = R.loki_attention(x.q, x.k_cache, x.v_cache, d=dd, counts=counts, gqa_select=mode, aggregate=agg,
                               score_format=fmt)
        s_ref = R.approx_scores(x.q, x.k_cache, dd, gqa_select=mode, aggregate=agg, score_format=fmt)
        run = kernel_run(x.q, x.k_cache, d=dd, gqa_select=mode, aggregate=agg, tuning=DecodeTuning(fuse_select=fuse))

        def step(run=run, kp=kp, sc=sc):
            return run.step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=kp, lengths=x.lengths,
                            starts=x.starts, counts=counts, width=K, return_indices=True, prefix_scale=sc)
        try:
            idx, res = step()
            idx2, res2 = step()  # the recorded plan's replay
            torch.cuda.synchronize()
            err = max((res.float() - ref.float()).abs().max().item(), (res2.float() - ref.float()).abs().max().item())
            ok = bool(err < 2e-2 and _selection_ok(idx, s_ref, K) and _selection_ok(idx2, s_ref, K))
            v = {"ok": ok, "err": err}
            if ok:
                v["ms"], v["graph_ms"] = time_ms(step), time_ms_graph(step)
        except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, not fatal
            v = {"ok": False, "error": repr(e)[:300]}
        out[vname] = v
        print(vname, json.dumps(v), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="three shapes only")
    ap.add_argument("--only", default=None, help="comma-separated shape names to run")
    ap.add_argument("--stages", action="store_true", help="time the score/select stages instead")
    ap.add_argument("--attn", action="store_true", help="attention launch variants in the whole step")
    ap.add_argument("--int8", action="store_true",
                    help="the default step on the bf16 prefix against the int8 score copy, unfused and fused")
    args = ap.parse_args(argv)

    L = importlib.import_module("loki.kernels.launch")
    SA = importlib.import_module("loki.kernels.sparse_attention")
    SEL = importlib.import_module("loki.kernels.select")
    import loki.reference as R
    from loki.bench.harness import _sdpa_fn, make_bench_inputs, measure_copy_bandwidth, time_ms, time_ms_graph
    from loki.kernels import make_key_prefix
    from loki.kernels.decode import DecodeTuning, selection_bound
    from loki.testing.decode import kernel_run

    copy = measure_copy_bandwidth()
    shapes = FUSION_SHAPES[:3] if args.quick else FUSION_SHAPES
    if args.only:
        shapes = [s for s in shapes if s in args.only.split(",")]
    rows = []
    for name in shapes:
        B, HQ, HKV, S, D, mode = shape_dims(name)
        d = 32
        x = make_bench_inputs(B, HQ, HKV, S, D)
        K = selection_bound(0.25, S)
        counts = torch.full((B,), K, dtype=torch.int32, device="cuda")
        kp = make_key_prefix(x.k_cache, d)
        H = HQ if mode == "query" else HKV
        floor = (B * HKV * S * d * 2 + B * H * K * 2 * D * 2) / (copy * 1e9) * 1e3
        ref_out = R.loki_attention(x.q, x.k_cache, x.v_cache, d=d, k=0.25, gqa_select=mode, aggregate="sum")
        s_ref = R.approx_scores(x.q, x.k_cache, d, gqa_select=mode, aggregate="sum")
        sdpa, _ = _sdpa_fn(x.q, x.k_cache, x.v_cache, HQ != HKV)
        r = {"shape": name, "B": B, "HQ": HQ, "HKV": HKV, "S": S, "D": D, "d": d, "K": K, "mode": mode,
             "floor_ms": floor, "sdpa": time_ms(sdpa), "sdpa_graph": time_ms_graph(sdpa), "variants": {}}
        if args.stages:
            r["stages"] = stage_sweep(x, kp, counts, K, d, mode, s_ref)
            rows.append(r)
            continue
        if args.int8:
            r["variants"] = int8_variants(x, counts, K, d, mode)
            rows.append(r)
            continue

        def variant(vname, fuse, use_pdl, previous=False, num_splits=None, head=None, r=r, x=x, counts=counts,
                    kp=kp, K=K, mode=mode, ref_out=ref_out, s_ref=s_ref, d=d, name=name):
            old = (L.PDL, SEL.FEW_ROWS_REGISTER_COMPACT, dict(SA.ATTN_DEFAULTS["head"]))
            hd = SA.ATTN_DEFAULTS["head"]
            SA.ATTN_DEFAULTS["head"] = dict(hd, splits=dict(hd["splits"]), **(head or {}))
            L.PDL = use_pdl
            if previous:  # the kernels' configuration before this round
                SEL.FEW_ROWS_REGISTER_COMPACT = 0
                SA.ATTN_DEFAULTS["head"]["splits"]["min_splits_many"] = 4
            tuning = DecodeTuning(fuse_select=fuse, num_splits=num_splits)
            run = kernel_run(x.q, x.k_cache, d=d, gqa_select=mode, aggregate="sum", tuning=tuning)
            try:
                def step():
                    return run.step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=kp, lengths=x.lengths,
                                    starts=x.starts, counts=counts, width=K, return_indices=True)
                os.environ["LOKI_POISON_OUTPUTS"] = "1"
                idx, out = step()  # the first call of a signature records the plan
                idx2, out2 = step()  # the recorded plan's replay
                os.environ.pop("LOKI_POISON_OUTPUTS", None)
                torch.cuda.synchronize()
                err = max((out.float() - ref_out.float()).abs().max().item(),
                          (out2.float() - ref_out.float()).abs().max().item())
                ok = bool(err < 2e-2 and _selection_ok(idx, s_ref, K) and _selection_ok(idx2, s_ref, K)
                          and not torch.isnan(out).any())
                v = {"ok": ok, "err": err}
                if ok:
                    v["ms"] = time_ms(step)
                    v["graph_ms"] = time_ms_graph(step)
                r["variants"][vname] = v
                print(name, vname, json.dumps(v), flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that fails to build or run is recorded, not fatal
                r["variants"][vname] = {"ok": False, "error": repr(e)[:300]}
                print(name, vname, "ERROR", repr(e)[:300], flush=True)
            finally:
                L.PDL, SEL.FEW_ROWS_REGISTER_COMPACT, SA.ATTN_DEFAULTS["head"] = old

        if args.attn:
            variant("default", None, False)
            for bk in (16, 32, 64):
                for st in (2, 3, 4):
                    for w in (4, 8):
                        variant(f"attn bk{bk} w{w} stages{st} no-prefetch", None, False,
                                head=dict(block_k=bk, num_warps=w, num_stages=st, prefetch=False))
            for st in (2, 3):
                variant(f"attn bk32 w4 stages{st} prefetch", None, False, head=dict(num_stages=st))
            rows.append(r)
            continue
        variant("previous (two kernels, 4+ splits)", False, False, previous=True)
        variant("default", None, False)
        variant("default + PDL", None, True)
        variant("two kernels", False, False)
        variant("fused", True, False)
        rows.append(r)
    os.makedirs(args.out, exist_ok=True)
    out_name = "stages.json" if args.stages else "fusion.json"
    with open(os.path.join(args.out, out_name), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": copy, "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    dev = torch.cuda.get_device_name()
    if args.stages:
        print(f"\n{dev}, bf16, d=32, k_f=0.25: score/select stages (ms, CUDA graph, L2 flushed)")
        print("| shape | variant | ms | ok |\n|---|---|---|---|")
        for r in rows:
            for vn, v in r["stages"].items():
                print(f"| {r['shape']} | {vn} | {v.get('ms', float('nan')):.4f} | {v['ok']} |")
        return 0 if all(v["ok"] for r in rows for v in r["stages"].values()) else 1
    print(f"\n{dev}, bf16, D=128, k_f=d_f=0.25, copy {copy:.0f} GB/s (ms, do_bench with L2 flush / CUDA graph; "
          "x = SDPA / variant, same run)")
    print("| shape | sdpa | floor | variant | ms | x | graph | x graph | x floor | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for r in rows:
        for vn, v in r["variants"].items():
            bad += not v["ok"]
            ms, g = v.get("ms", float("nan")), v.get("graph_ms", float("nan"))
            print(f"| {r['shape']} | {r['sdpa']:.4f} | {r['floor_ms']:.4f} | {vn} | {ms:.4f} | {r['sdpa'] / ms:.2f} | "
                  f"{g:.4f} | {r['sdpa_graph'] / g:.2f} | {ms / r['floor_ms']:.2f} | {v['ok']} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
