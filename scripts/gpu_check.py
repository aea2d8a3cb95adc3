"""The one script sent to the GPU machine: correctness checks, kernel variants, the benchmark grid.

    PYTHONPATH=. python3 scripts/gpu_check.py --out $OUT [--quick] [--variants] [--no-bench]
    PYTHONPATH=. compute-sanitizer --tool memcheck python3 scripts/gpu_check.py --sanitize

Writes JSON / markdown / PNG under --out and prints a short table last.
"""

from __future__ import annotations

import argparse
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
    from loki.kernels import approx_scores, decode_attention, make_key_prefix, select_topk, sparq_attention
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
        kp = make_key_prefix(x.k_cache, D // 4)
        for sm in ("torch", "triton", "auto+k_prefix"):
            out = decode_attention(x.q, x.k_cache, x.v_cache, d=0.25, k=0.25, lengths=x.lengths, starts=x.starts,
                                   backend="triton", gqa_select=mode, select_method=sm.split("+")[0],
                                   k_prefix=kp if "k_prefix" in sm else None, aggregate="sum")
            ref = decode_attention(x.q, x.k_cache, x.v_cache, d=0.25, k=0.25, lengths=x.lengths, starts=x.starts,
                                   backend="torch", gqa_select=mode, aggregate="sum")
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
    from loki.kernels import (
        approx_scores,
        decode_attention,
        make_key_prefix,
        score_select,
        select_topk,
        sparq_attention,
        sparse_attention,
    )
    from loki.kernels import launch as launch_mod
    from loki.kernels.decode import selection_bound
    from loki.reference import budget
    from loki.testing.inputs import make_decode_inputs

    for B, HQ, HKV, S, D, dtype in [(1, 2, 2, 1, 64, torch.float32), (3, 6, 2, 97, 96, torch.bfloat16),
                                    (2, 8, 1, 1025, 128, torch.float16), (2, 12, 3, 4099, 96, torch.bfloat16)]:
        x = make_decode_inputs(B, HQ, HKV, S, D, dtype=dtype, device="cuda", ragged=True, left_pad=True)
        kp = make_key_prefix(x.k_cache, 9)
        for mode in ("query", "kv"):
            s = approx_scores(x.q, x.k_cache, 7, x.lengths, x.starts, gqa_select=mode)
            approx_scores(x.q, x.k_cache, 7, x.lengths, x.starts, gqa_select=mode, k_prefix=kp)
            approx_scores(x.q, x.k_cache, 9, x.lengths, x.starts, gqa_select=mode, k_prefix=kp)
            for k in (1, 0.3, S):
                counts = budget(k, x.lengths, x.starts, B, S, "cuda")
                K = selection_bound(k, S)
                idx = select_topk(s, counts, method="triton", k_max=K)
                select_topk(s, counts, method="triton", k_max=K, radix_bits=1, chunk=256)
                select_topk(s, counts, method="triton", k_max=K, radix_bits=2, early_exit=False)
                for aggregate in ("sum", "max"):  # the fused score+select kernel, in place and from the prefix
                    score_select(x.q, x.k_cache, 7, x.lengths, x.starts, counts, K, gqa_select=mode,
                                 aggregate=aggregate)
                    score_select(x.q, kp, 9, x.lengths, x.starts, counts, K, gqa_select=mode, aggregate=aggregate,
                                 chunk=256)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, num_splits=3, block_k=16)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, num_splits=3, prefetch=False)
                sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, num_splits=2, slots=False, prefetch=True)
                if mode == "query":
                    sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, prefix_scores=s, prefix_dims=7,
                                     block_k=16)
            decode_attention(x.q, x.k_cache, x.v_cache, d=0.25, k=0.25, lengths=x.lengths, starts=x.starts,
                             backend="triton", gqa_select=mode, select_method="triton", aggregate="sum")
            decode_attention(x.q, x.k_cache, x.v_cache, d=9, k=0.25, lengths=x.lengths, starts=x.starts,
                             backend="triton", gqa_select=mode, k_prefix=kp, aggregate="sum")
            launch_mod.PDL = True  # programmatic dependent launch through the whole step
            for _ in range(2):
                decode_attention(x.q, x.k_cache, x.v_cache, d=9, k=0.25, lengths=x.lengths, starts=x.starts,
                                 backend="triton", gqa_select=mode, k_prefix=kp, aggregate="sum")
            launch_mod.PDL = False
        sparq_attention(x.q, x.k_cache, x.v_cache, r=8, k=0.25, lengths=x.lengths, starts=x.starts)
    torch.cuda.synchronize()
    print("sanitize: all kernels ran")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sanitize", action="store_true")
    p.add_argument("--variants", action="store_true", help="time kernel variants at the target shapes")
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
    if a.variants:
        from benchmarks.tuning import variants

        status |= variants.main(a.out)
        print(f"variants done ({time.time() - t0:.0f} s)", flush=True)
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
