"""The one script sent to the GPU machine: correctness checks, block-size variants, the benchmark grid.

    PYTHONPATH=. python3 scripts/gpu_check.py --out $OUT [--quick] [--tune] [--no-bench]
    PYTHONPATH=. compute-sanitizer --tool memcheck python3 scripts/gpu_check.py --sanitize

Writes JSON / markdown / PNG under --out and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from loki.bench import harness  # noqa: E402


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def check(out_rows: list) -> bool:
    """Kernels vs references at decode shapes, outputs poisoned with NaN."""
    import loki.reference as R
    from loki.kernels import approx_scores, decode_attention, select_topk, sparq_attention
    from loki.testing.inputs import make_decode_inputs

    os.environ["LOKI_POISON_OUTPUTS"] = "1"
    ok = True
    cases = [  # B, HQ, HKV, S, D, dtype, mode
        (8, 40, 40, 4096, 128, torch.bfloat16, "query"),
        (4, 32, 8, 8192, 128, torch.bfloat16, "kv"),
        (2, 32, 8, 4099, 96, torch.float16, "query"),
        (3, 16, 2, 3000, 64, torch.float32, "kv"),
    ]
    for B, HQ, HKV, S, D, dtype, mode in cases:
        x = make_decode_inputs(B, HQ, HKV, S, D, dtype=dtype, device="cuda", ragged=True, left_pad=True)
        s = approx_scores(x.q, x.k_cache, 0.25, x.lengths, x.starts, gqa_select=mode)
        s_ref = R.approx_scores(x.q, x.k_cache, 0.25, x.lengths, x.starts, gqa_select=mode)
        fin = torch.isfinite(s_ref)
        e_s = _err(s[fin], s_ref[fin])
        counts = R.budget(0.25, x.lengths, x.starts, B, S, "cuda")
        idx = select_topk(s, counts, method="triton", k_max=(S + 3) // 4)
        idx_ref = R.select_topk(s, counts)
        # same set per row (exact top-k of the same scores; ties are measure-zero here)
        kr = idx_ref.shape[-1]
        a = torch.sort(torch.where(idx[..., :kr] >= 0, idx[..., :kr].long(), S), -1).values
        b = torch.sort(torch.where(idx_ref >= 0, idx_ref, S), -1).values
        sel_ok = bool(torch.equal(a, b)) and bool((idx[..., kr:] == -1).all())
        for sm in ("torch", "triton"):
            out = decode_attention(x.q, x.k_cache, x.v_cache, d=0.25, k=0.25, lengths=x.lengths, starts=x.starts,
                                   backend="triton", gqa_select=mode, select_method=sm)
            ref = decode_attention(x.q, x.k_cache, x.v_cache, d=0.25, k=0.25, lengths=x.lengths, starts=x.starts,
                                   backend="torch", gqa_select=mode)
            e_o = _err(out, ref)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            row_ok = e_s < 1e-3 and sel_ok and e_o < tol and not torch.isnan(out).any()
            ok &= row_ok
            out_rows.append(dict(case=f"B{B}-HQ{HQ}-HKV{HKV}-S{S}-D{D}-{str(dtype)[6:]}-{mode}-{sm}",
                                 score_err=e_s, select_equal=sel_ok, out_err=e_o, ok=row_ok))
        o = sparq_attention(x.q, x.k_cache, x.v_cache, r=16, k=0.125, lengths=x.lengths, starts=x.starts)
        r = R.sparq_attention(x.q, x.k_cache, x.v_cache, r=16, k=0.125, lengths=x.lengths, starts=x.starts)
        e = _err(o, r)
        ok &= e < (1e-4 if dtype == torch.float32 else 2e-2)
        out_rows.append(dict(case=f"sparq-B{B}-HQ{HQ}-HKV{HKV}-S{S}-D{D}-{str(dtype)[6:]}", out_err=e,
                             ok=e < (1e-4 if dtype == torch.float32 else 2e-2)))
    os.environ.pop("LOKI_POISON_OUTPUTS", None)
    return ok


def sanitize() -> None:
    """Odd shapes through every kernel once (run under compute-sanitizer)."""
    from loki.kernels import approx_scores, decode_attention, select_topk, sparq_attention, sparse_attention
    from loki.kernels.decode import selection_bound
    from loki.reference import budget
    from loki.testing.inputs import make_decode_inputs

    for B, HQ, HKV, S, D, dtype in [(1, 2, 2, 1, 64, torch.float32), (3, 6, 2, 97, 96, torch.bfloat16),
                                    (2, 8, 1, 1025, 128, torch.float16), (2, 12, 3, 4099, 96, torch.bfloat16)]:
        x = make_decode_inputs(B, HQ, HKV, S, D, dtype=dtype, device="cuda", ragged=True, left_pad=True)
        for mode in ("query", "kv"):
            s = approx_scores(x.q, x.k_cache, 7, x.lengths, x.starts, gqa_select=mode)
            for k in (1, 0.3, S):
                counts = budget(k, x.lengths, x.starts, B, S, "cuda")
                K = selection_bound(k, S)
                idx = select_topk(s, counts, method="triton", k_max=K)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, num_splits=3)
            decode_attention(x.q, x.k_cache, x.v_cache, d=0.25, k=0.25, lengths=x.lengths, starts=x.starts,
                             backend="triton", gqa_select=mode, select_method="triton")
        sparq_attention(x.q, x.k_cache, x.v_cache, r=8, k=0.25, lengths=x.lengths, starts=x.starts)
    torch.cuda.synchronize()
    print("sanitize: all kernels ran")


def tune(out_rows: list) -> None:
    """Block-size / split variants of each stage at the key shapes."""
    for model, B, S, mode in [("llama2-13b", 16, 4096, "query"), ("llama2-13b", 1, 16384, "query"),
                              ("llama3-8b", 16, 8192, "kv"), ("llama3-8b", 1, 16384, "kv")]:
        _tune_shape(out_rows, model, B, S, mode)
        torch.cuda.empty_cache()


def _tune_shape(out_rows, model, B, S, mode):
    from loki.kernels import select_topk, sparse_attention
    from loki.kernels.approx_scores import _launch_approx_scores

    HQ, HKV, D = harness.MODELS[model]
    x = harness.make_bench_inputs(B, HQ, HKV, S, D)
    H = HQ if mode == "query" else HKV
    K = S // 4
    counts = torch.full((B,), K, dtype=torch.int32, device="cuda")
    scores = torch.empty(B, H, S, device="cuda")
    ho, ao = (scores, None) if mode == "query" else (None, scores)
    tag = f"{model}-B{B}-S{S}-{mode}"
    for dd in (16, 32, 64):  # bytes per key row read: 32, 64, 128 (DRAM fetch granularity)
        t = harness.time_ms(lambda dd=dd: _launch_approx_scores(x.q, x.k_cache, dd, x.lengths, x.starts, ho, ao,
                                                                "sum"))
        out_rows.append(dict(shape=tag, stage="scores", variant=f"d={dd}", ms=t))
    _launch_approx_scores(x.q, x.k_cache, 32, x.lengths, x.starts, ho, ao, "sum")
    t = harness.time_ms(lambda: select_topk(scores, counts, k_max=K, method="triton"))
    out_rows.append(dict(shape=tag, stage="select", variant="triton", ms=t))
    idx = select_topk(scores, counts, k_max=K, method="triton")
    variants = [(None, None, 4, None)]
    for bk in (32, 64, 128):
        for ns in (None, 4, 16):
            for nw in (4, 8):
                for st in (2, 3, 4):
                    variants.append((bk, ns, nw, st))
    for bk, ns, nw, st in variants:
        try:
            t = harness.time_ms(lambda bk=bk, ns=ns, nw=nw, st=st: sparse_attention(
                x.q, x.k_cache, x.v_cache, idx, counts, block_k=bk, num_splits=ns, num_warps=nw, num_stages=st))
        except Exception as e:  # noqa: BLE001
            t = float("nan")
            print("tune error", tag, bk, ns, nw, st, type(e).__name__, str(e)[:200])
        out_rows.append(dict(shape=tag, stage="attention", variant=f"bk={bk} splits={ns} warps={nw} stages={st}",
                             ms=t))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sanitize", action="store_true")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seq-lens", nargs="+", type=int, default=None)
    p.add_argument("--batches", nargs="+", type=int, default=None)
    p.add_argument("--budgets", nargs="+", default=None)
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--tag", default=None)
    p.add_argument("--providers", nargs="+", default=None)
    a = p.parse_args()
    if a.sanitize:
        sanitize()
        return 0
    import triton

    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"do_bench flushes L2: {harness.do_bench_flushes_l2()}", flush=True)
    status = 0
    if not a.no_check:
        rows = []
        ok = check(rows)
        for r in rows:
            print(r, flush=True)
        print(f"CHECK {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s)", flush=True)
        status |= 0 if ok else 1
    if a.tune:
        rows = []
        tune(rows)
        with open(os.path.join(a.out, "tune.json"), "w") as f:
            json.dump(rows, f, indent=1)
        for r in rows:
            print(f"{r['shape']:28s} {r['stage']:9s} {r['variant']:26s} {r['ms']:.4f}")
        print(f"tune done ({time.time() - t0:.0f} s)", flush=True)
    if not a.no_bench:
        bp = argparse.ArgumentParser()
        harness.add_arguments(bp)
        argv = ["--out", a.out] + (["--quick"] if a.quick else [])
        for flag, val in (("--seq-lens", a.seq_lens), ("--batches", a.batches), ("--budgets", a.budgets),
                          ("--models", a.models), ("--providers", a.providers)):
            if val:
                argv += [flag, *map(str, val)]
        if a.tag:
            argv += ["--tag", a.tag]
        status |= harness.run(bp.parse_args(argv))
        print(f"bench done ({time.time() - t0:.0f} s)")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
