"""Kernel variants at the target shapes, timed in one process on the GPU.

    PYTHONPATH=. python3 -m benchmarks.tuning.variants --out $OUT

For each target shape (``benchmarks._shapes.TARGET_SHAPES``): torch SDPA and per stage the launch variants
of the kernels (scores: strided vs ``k_prefix``, block sizes; select: warps, early exit; attention: prefetch,
score reuse, block sizes, splits), each checked against a reference before it is timed; then the full default
pipeline, with and without ``k_prefix``, under do_bench and as a CUDA-graph replay.  Also the host time of one
call at B=1 and (``LOKI_L2_EXPERIMENT=1``) an L2 fetch-granularity experiment on the strided scores read.

Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim.
"""

from __future__ import annotations

import ctypes
import json
import os
import time

import torch

from loki.bench import harness

from .._shapes import SHAPES, TARGET_SHAPES, shape_dims

#: Launch variants beside the defaults (``ATTN_DEFAULTS``, ``select_launch_config``; docs/kernels.md has the
#: rounds that chose them).
SCORES_VARIANTS = [(256, 4)]
SPLITS = (4, 8, 16, 32)


def SELECT_VARIANTS(S, rows):  # noqa: N802
    v = [{}, {"early_exit": False}]  # the default exits the 1-bit search early
    if rows < 66:
        v += [{"num_warps": 32}, {"num_warps": 32, "early_exit": True}]
    return v


ATTN_HEAD_VARIANTS = [
    {},  # the default: block_k 32, 4 warps, prefetch, slots
    dict(slots=True, block_k=32, num_warps=4),
    dict(slots=True, block_k=64, num_warps=4),
    dict(slots=True, block_k=64, num_warps=8),
    dict(slots=True, block_k=128, num_warps=8),
    dict(slots=True, prefetch=False, block_k=64, num_warps=4),
    dict(slots=True, prefetch=False, block_k=128, num_warps=8),
    dict(slots=True, prefetch=False, block_k=128, num_warps=4),
]
ATTN_GROUP_VARIANTS = [
    {},  # the default: block_k 64, no prefetch, 4 warps
    dict(block_k=16, num_warps=1),
    dict(block_k=16, num_warps=1, prefetch=True),
    dict(block_k=32, num_warps=1),
    dict(block_k=32, num_warps=2),
    dict(block_k=32, num_warps=2, prefetch=True),
    dict(block_k=64, num_warps=2),
]
TOTAL_VARIANTS_Q = [("slots64", dict(slots=True, block_k=64, num_warps=4)),
                    ("slots128w8", dict(slots=True, block_k=128, num_warps=8))]
TOTAL_VARIANTS_KV = [("grp16w1", dict(block_k=16, num_warps=1)), ("grp32w2", dict(block_k=32, num_warps=2))]


def _t(fn, rep=20):
    return harness.time_ms(fn, warmup=5, rep=rep)


def _valid_topk(idx, scores, K):
    """Selection invariants on the GPU: in range, no duplicates, every selected score >= the K-th largest."""
    idx = idx[..., :K].long()
    if bool((idx < 0).any()) or bool((idx >= scores.shape[-1]).any()):
        return False
    srt = torch.sort(idx, -1).values
    if bool((srt[..., 1:] == srt[..., :-1]).any()):
        return False
    kth = torch.topk(scores, K, dim=-1).values[..., -1:]
    return bool((torch.gather(scores, -1, idx) >= kth).all())


def run_shape(name, model, B, S, mode, copy_gbps, rows, dev="cuda"):
    from loki.kernels import make_key_prefix, select_topk, sparse_attention, sparse_attention_reference
    from loki.kernels.approx_scores import launch_approx_scores
    from loki.kernels.decode import DecodeTuning
    from loki.testing.decode import kernel_step

    HQ, HKV, D = harness.MODELS[model]
    x = harness.make_bench_inputs(B, HQ, HKV, S, D, device=dev)
    q, kc, vc = x.q, x.k_cache, x.v_cache
    d, K = D // 4, S // 4
    H = HQ if mode == "query" else HKV
    es = 2
    kp = make_key_prefix(kc, d)
    counts = torch.full((B,), K, dtype=torch.int32, device=dev)
    floor_bytes = B * HKV * S * d * es + 2 * B * H * K * D * es
    floor_ms = floor_bytes / (copy_gbps * 1e9) * 1e3
    res = {"shape": name, "B": B, "S": S, "HQ": HQ, "HKV": HKV, "D": D, "d": d, "K": K, "mode": mode,
           "floor_ms": floor_ms, "stages": {}}

    def add(stage, variant, fn, nbytes=None, ok=True, **extra):
        try:
            ms = _t(fn)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(shape=name, stage=stage, variant=variant, error=f"{type(e).__name__}: {str(e)[:160]}"))
            print(f"  {stage:9s} {variant:40s} ERROR {type(e).__name__}: {str(e)[:160]}", flush=True)
            return None
        r = dict(shape=name, stage=stage, variant=variant, ms=ms, ok=ok, **extra)
        if nbytes:
            r["pct_copy_bw"] = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbps
        rows.append(r)
        print(f"  {stage:9s} {variant:40s} {ms:8.4f} ms ok={ok}"
              + (f" {r['pct_copy_bw']:.0f}% bw" if nbytes else ""), flush=True)
        return ms

    sdpa, _ = harness._sdpa_fn(q, kc, vc, HQ != HKV)
    res["sdpa"] = add("total", "sdpa", sdpa)
    # ---- scores
    scores = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    ho, ao = (scores, None) if mode == "query" else (None, scores)
    sbytes = B * HKV * S * d * es
    launch_approx_scores(q, kc, d, x.lengths, x.starts, ho, ao, "sum")
    ref_scores = scores.clone()
    add("scores", "strided k_hat", lambda: launch_approx_scores(q, kc, d, x.lengths, x.starts, ho, ao, "sum"),
        sbytes)
    for bs, nw in SCORES_VARIANTS:
        scores.fill_(float("nan"))
        launch_approx_scores(q, kp, d, x.lengths, x.starts, ho, ao, "sum", block_s=bs, num_warps=nw)
        ok = bool(torch.allclose(scores, ref_scores, rtol=1e-5, atol=1e-5))
        add("scores", f"k_prefix bs={bs} w={nw}", lambda bs=bs, nw=nw: launch_approx_scores(
            q, kp, d, x.lengths, x.starts, ho, ao, "sum", block_s=bs, num_warps=nw), sbytes, ok=ok)
    scores.copy_(ref_scores)
    # ---- select
    for kw in SELECT_VARIANTS(S, B * H):
        try:
            idx = select_topk(scores, counts, k_max=K, method="triton", **kw)
            ok = _valid_topk(idx, scores, K)
        except Exception as e:  # noqa: BLE001
            print(f"  select {kw} ERROR {type(e).__name__}: {str(e)[:160]}")
            continue
        add("select", " ".join(f"{a}={b}" for a, b in kw.items()) or "default",
            lambda kw=kw: select_topk(scores, counts, k_max=K, method="triton", **kw), ok=ok)
    # ---- attention
    idx = select_topk(scores, counts, k_max=K, method="triton")
    ref = sparse_attention_reference(q, kc, vc, idx.long(), counts)
    abytes = 2 * B * H * K * D * es

    def chk(o):
        return bool((o.float() - ref.float()).abs().max().item() < 2e-2)

    for v in (ATTN_HEAD_VARIANTS if mode == "query" else ATTN_GROUP_VARIANTS):
        kw = dict(v)
        if mode == "query":
            kw.update(prefix_scores=scores, prefix_dims=d)
        bk = kw.get("block_k", 64)
        for ns in [None] + [n for n in SPLITS if n <= max(1, K // bk)]:
            try:
                o = sparse_attention(q, kc, vc, idx, counts, num_splits=ns, **kw)
                ok = chk(o)
            except Exception as e:  # noqa: BLE001
                print(f"  attention {v} ERROR {type(e).__name__}: {str(e)[:200]}")
                break
            tag = (" ".join(f"{a}={b}" for a, b in v.items()) or "default") + f" splits={ns}"
            add("attention", tag, lambda ns=ns, kw=kw: sparse_attention(q, kc, vc, idx, counts, num_splits=ns, **kw),
                abytes, ok=ok)
    # ---- full pipeline
    common = dict(d=d, k_max=K, gqa_select=mode, aggregate="sum", uniform=True)
    res["new_noprefix"] = add("total", "new, no k_prefix", lambda: kernel_step(
        q, kc, vc, x.lengths, x.starts, counts, **common), floor_bytes)
    res["new"] = add("total", "new, k_prefix", lambda: kernel_step(
        q, kc, vc, x.lengths, x.starts, counts, k_prefix=kp, **common), floor_bytes)
    for name_, opts in (TOTAL_VARIANTS_Q if mode == "query" else TOTAL_VARIANTS_KV):
        tuned = DecodeTuning(attn_options=opts)
        res[name_] = add("total", f"new, k_prefix, {name_}", lambda tuned=tuned: kernel_step(
            q, kc, vc, x.lengths, x.starts, counts, k_prefix=kp, tuning=tuned, **common), floor_bytes)
        try:
            res["graph_" + name_] = harness.time_ms_graph(lambda tuned=tuned: kernel_step(
                q, kc, vc, x.lengths, x.starts, counts, k_prefix=kp, tuning=tuned, **common))
        except Exception as e:  # noqa: BLE001
            print("  graph ERROR", type(e).__name__, str(e)[:200])
    try:
        res["graph_sdpa"] = harness.time_ms_graph(sdpa)
        res["graph_new"] = harness.time_ms_graph(lambda: kernel_step(
            q, kc, vc, x.lengths, x.starts, counts, k_prefix=kp, **common))
    except Exception as e:  # noqa: BLE001
        print("  graph ERROR", type(e).__name__, str(e)[:200])
    # host time of one call (GPU work is small at B=1: the host is the limit there)
    if B == 1 and dev == "cuda":
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            kernel_step(q, kc, vc, x.lengths, x.starts, counts, k_prefix=kp, **common)
        torch.cuda.synchronize()
        res["host_us_per_call"] = (time.perf_counter() - t0) / n * 1e6
        print(f"  host+gpu per back-to-back call: {res['host_us_per_call']:.1f} us")
    out = kernel_step(q, kc, vc, x.lengths, x.starts, counts, k_prefix=kp, **common)[1]
    idx2 = select_topk(scores, counts, k_max=K, method="triton")
    ref2 = sparse_attention_reference(q, kc, vc, idx2.long(), counts)
    res["pipeline_err"] = (out.float() - ref2.float()).abs().max().item()
    return res


def l2_granularity_experiment(rows):
    """Strided scores and the attention gathers under cuCtxSetLimit(MAX_L2_FETCH_GRANULARITY) 32/64/128."""
    from loki.kernels import select_topk, sparse_attention
    from loki.kernels.approx_scores import launch_approx_scores

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        print("no libcuda:", e)
        return
    HQ, HKV, D = harness.MODELS["llama2-13b"]
    B, S = 16, 4096
    x = harness.make_bench_inputs(B, HQ, HKV, S, D)
    scores = torch.empty(B, HQ, S, device="cuda")
    launch_approx_scores(x.q, x.k_cache, 32, x.lengths, x.starts, scores, None, "sum")
    counts = torch.full((B,), S // 4, dtype=torch.int32, device="cuda")
    idx = select_topk(scores, counts, k_max=S // 4, method="triton")
    val = ctypes.c_size_t(0)
    cuda.cuCtxGetLimit(ctypes.byref(val), ctypes.c_int(5))
    default = val.value
    for g in (32, 64, 128, default):
        rc = cuda.cuCtxSetLimit(ctypes.c_int(5), ctypes.c_size_t(g))
        cuda.cuCtxGetLimit(ctypes.byref(val), ctypes.c_int(5))
        t_s = _t(lambda: launch_approx_scores(x.q, x.k_cache, 32, x.lengths, x.starts, scores, None, "sum"))
        t_a = _t(lambda: sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts))
        rows.append(dict(shape="mha-B16-S4096", stage="l2-granularity", variant=f"set {g} rc={rc} now={val.value}",
                         scores_ms=t_s, attention_ms=t_a))
        print(f"  L2 fetch granularity set {g} (rc {rc}, now {val.value}, default {default}): strided scores "
              f"{t_s:.4f} ms, attention {t_a:.4f} ms", flush=True)


def main(out_dir: str) -> int:
    import triton

    os.makedirs(out_dir, exist_ok=True)
    name = torch.cuda.get_device_name()
    copy_gbps = harness.measure_copy_bandwidth()
    print(f"# {name}: copy {copy_gbps:.0f} GB/s, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows, shapes = [], []
    t0 = time.time()
    for name_ in TARGET_SHAPES:
        print(f"== {name_} ({time.time() - t0:.0f} s)", flush=True)
        model, B, S = SHAPES[name_]
        shapes.append(run_shape(name_, model, B, S, shape_dims(name_)[-1], copy_gbps, rows))
        torch.cuda.empty_cache()
    if os.environ.get("LOKI_L2_EXPERIMENT") == "1":
        print(f"== L2 granularity ({time.time() - t0:.0f} s)", flush=True)
        l2_granularity_experiment(rows)
    with open(os.path.join(out_dir, "variants.json"), "w") as f:
        json.dump({"device": name, "copy_gbps": copy_gbps, "shapes": shapes, "rows": rows}, f, indent=1)
    summarize(name, copy_gbps, shapes, rows, t0)
    return 0


def summarize(name, copy_gbps, shapes, rows, t0):
    """Short table: the totals (x SDPA, do_bench / CUDA graph) and the best variant per stage."""
    print(f"\n# {name}, copy {copy_gbps:.0f} GB/s ({time.time() - t0:.0f} s)")
    for r in shapes:
        best = {}
        for row in rows:
            if row["shape"] == r["shape"] and "ms" in row and row.get("ok", True) and row["stage"] != "total":
                if row["stage"] not in best or row["ms"] < best[row["stage"]][0]:
                    best[row["stage"]] = (row["ms"], row["variant"])
        tot = [("new", "new", "graph_new")]
        tot += [(n, n, "graph_" + n) for n, _ in (TOTAL_VARIANTS_Q if r["mode"] == "query" else TOTAL_VARIANTS_KV)]
        parts = []
        for label, k1, k2 in tot:
            if r.get(k1):
                g = r.get(k2)
                gs = f"/{r['graph_sdpa'] / g:.2f}g" if g and r.get("graph_sdpa") else ""
                parts.append(f"{label} {r[k1]:.3f}={r['sdpa'] / r[k1]:.2f}x{gs}")
        print(f"{r['shape']}: sdpa {r['sdpa']:.3f} floor {r['floor_ms']:.3f} | " + " | ".join(parts))
        print("   best: " + " / ".join(f"{s_}: {best[s_][0]:.4f} ({best[s_][1]})"
                                     for s_ in ("scores", "select", "attention") if s_ in best))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON (default: $OUT or .)")
    raise SystemExit(main(ap.parse_args().out))
