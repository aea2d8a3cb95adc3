"""The split-row select (``loki.kernels.select_split``) against ``torch.topk`` and the one-program-per-row Triton
select, alone and inside the decode step, on a GPU.

    PYTHONPATH=. python -m benchmarks.tuning.select_split --out results/select-split-h100.json

Select shapes (B, H, S, k; rows = B x H): 1 x 8 x 131072 top-2048 (target <= 15 us), 1 x 32 x 131072 top-2048, 8 x 8
x 32768 top-2048 (64 rows, target <= 25 us) and top-8192. Providers: plain ``torch.topk`` (no tie rule; checked by
the selection invariants), the project's exact torch method (int64 keys), the register select (rows up to 32768),
the split select with its defaults and a few launch variants (chunk, bits per level, levels, candidate tile), and
the default split replayed from a recorded ``DecodePlan`` (direct launches, the decode step's host path). Where
``flashinfer`` imports, in the same run on the same card: ``flashinfer.top_k`` with its defaults (no tie rule:
checked by the selection invariants, as plain ``torch.topk``), ``flashinfer.top_k`` with ``deterministic=True,
tie_break=SMALL`` (k <= 2048; the reference's exact set), ``flashinfer.topk.topk_clusters_exact`` (invariants) and
``select_topk(method="flashinfer")`` (that call behind the project's canonical copy of -0.0 and NaN); without it
those rows are left out with a note, and a FlashInfer call that fails on the card is a row with its error. Scores
are fp32; ``torch.topk`` and the FlashInfer calls run on bf16 scores too (the ``scores`` column; the split select
takes fp32 only). Every other result is checked against ``loki.reference.selection.select_topk`` (the same set, on
the same dtype) before it is timed. Times in ms: ``ms`` triton.testing.do_bench median (L2 flushed; includes the
host launch cost when that dominates), ``graph`` one CUDA-graph replay with the L2 flushed, ``graph_warm`` the same
with the scores in L2 (as inside the decode step, where they were just written). Then the decode step
(llama3-8b-like GQA 32/8, one selection per KV head: B=1 S=131072, 8 rows; B=8 S=32768, 64 rows; k=2048) with the
split, the register (S <= 32768) and the torch select, recorded plan, do_bench and graph.

Writes JSON to --out and prints the tables last (one per select shape, then the decode steps).  About 2-3 minutes
on an H100 (most of it compiling the variants; FlashInfer's first call compiles its kernels too); ``--budget``
seconds (default 240) stops adding variants once spent.  ``--smoke``: tiny shapes, no timing (the CPU interpreter
with ``TRITON_INTERPRET=1``, or a GPU), to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

SHAPES = [(1, 8, 131072, 2048), (1, 32, 131072, 2048), (8, 8, 32768, 2048), (8, 8, 32768, 8192)]
SPLIT_VARIANTS = [dict(chunk=1024), dict(chunk=2048), dict(chunk=4096), dict(chunk=8192), dict(bits=8),
                  dict(bits=5, levels=3), dict(bits=4, levels=3), dict(cand_block=1024), dict(cand_block=2048)]
SMOKE_SHAPES = [(1, 2, 3000, 100), (2, 2, 1500, 600)]
STEP_SHAPES = [  # name, B, HQ, HKV, S, D, k
    ("llama3-8b kv B=1 S=131072 (8 rows)", 1, 32, 8, 131072, 128, 2048),
    ("llama3-8b kv B=8 S=32768 (64 rows)", 8, 32, 8, 32768, 128, 2048),
]
SMOKE_STEP_SHAPES = [("smoke kv B=1 S=600", 1, 4, 2, 600, 32, 50)]


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not a checkout
        return None


def _same_set(idx, ref_sorted) -> bool:
    return bool(torch.equal(idx.long().sort(-1).values, ref_sorted))


def _times(fn, smoke: bool, errors: list | None = None) -> dict:
    """do_bench, graph and graph_warm times of ``fn``; with ``errors`` a list, a timing that raises (e.g. a call
    that cannot be captured in a CUDA graph) is noted there and left out instead."""
    from loki.bench.harness import time_ms, time_ms_graph

    if smoke:
        return {}
    out = {}
    for key, timer in (("ms", lambda: time_ms(fn)), ("graph", lambda: time_ms_graph(fn)),
                       ("graph_warm", lambda: time_ms_graph(fn, flush_bytes=16))):
        if errors is None:
            out[key] = timer()
            continue
        try:
            out[key] = timer()
        except Exception as e:  # noqa: BLE001 - reported in the row
            errors.append(f"{key}: {type(e).__name__}: {e}"[:300])
    return out


#: Providers run whatever the time budget (the comparison this script exists for).
ALWAYS = ("torch.topk", "register", "split", "flashinfer.top_k", "flashinfer.top_k tie=small", "flashinfer clusters",
          "loki method=flashinfer")


def _flashinfer():
    """The flashinfer module, or None after printing why not (once)."""
    from loki.kernels.select_flashinfer import _load

    fi, why = _load()
    if fi is None and not getattr(_flashinfer, "noted", False):
        print(f"note: flashinfer providers skipped ({why})", flush=True)
        _flashinfer.noted = True
    return fi


def _flashinfer_providers(scores, counts, k):
    """(name, launch options, fn, check) of the FlashInfer calls on ``scores`` (fp32 or bf16) [B, H, S]; check is
    "exact" (the reference's set) or "invariants" (no tie rule)."""
    from loki.kernels import select_topk
    from loki.kernels.select_flashinfer import FLASHINFER_MAX_K

    fi = _flashinfer()
    if fi is None:
        return []
    B, H, S = scores.shape
    rows = scores.reshape(B * H, S)

    def shaped(fn):
        return lambda: fn()[0 if fn is clusters else 1].view(B, H, k)

    def default():
        return fi.top_k(rows, k)

    def small():
        return fi.top_k(rows, k, deterministic=True, tie_break=fi.topk.TopKTieBreak.SMALL)

    def clusters():
        return fi.topk.topk_clusters_exact(rows, k)

    out = [("flashinfer.top_k", {}, shaped(default), "invariants")]
    if k <= FLASHINFER_MAX_K:
        out.append(("flashinfer.top_k tie=small", dict(deterministic=True, tie_break="SMALL"), shaped(small), "exact"))
    if hasattr(fi.topk, "topk_clusters_exact"):
        out.append(("flashinfer clusters", {}, shaped(clusters), "invariants"))
    if k <= FLASHINFER_MAX_K and scores.dtype == torch.float32:
        out.append(("loki method=flashinfer", dict(uniform=True),
                    lambda: select_topk(scores, counts, k_max=k, method="flashinfer", uniform=True), "exact"))
    return out


def _select_providers(scores, counts, k, cfg):
    """(name, launch options, fn, check) of every select timed at one shape on fp32 scores, then the bf16 ones."""
    from loki.kernels import select_topk, select_topk_split
    from loki.kernels.launch import DecodePlan, recording
    from loki.kernels.select import TRITON_SELECT_MAX_S, _select_triton

    bf16 = scores.to(torch.bfloat16)
    providers = [("torch.topk", {}, lambda: torch.topk(scores, k, dim=-1, sorted=False).indices, "invariants"),
                 ("torch exact", {}, lambda: select_topk(scores, counts, k_max=k, method="torch", uniform=True),
                  "exact")]
    if scores.shape[-1] <= TRITON_SELECT_MAX_S:
        providers.append(("register", {}, lambda: _select_triton(scores, counts, k, None), "exact"))
    providers.append(("split", cfg, lambda: select_topk_split(scores, counts, k_max=k), "exact"))
    with recording() as rec:
        idx = select_topk_split(scores, counts, k_max=k)
    plan = DecodePlan(rec.launches, (scores, counts), rec.buffers)
    ret = [id(b) for b in rec.buffers].index(id(idx))
    providers.append(("split plan", cfg, lambda: plan((scores, counts))[ret], "exact"))
    providers += _flashinfer_providers(scores, counts, k)
    for v in SPLIT_VARIANTS:
        providers.append(("split " + ",".join(f"{a}={b}" for a, b in v.items()), {**cfg, **v},
                          lambda v=v: select_topk_split(scores, counts, k_max=k, **v), "exact"))
    fp32 = [(*p, scores) for p in providers]
    bf = [("torch.topk", {}, lambda: torch.topk(bf16, k, dim=-1, sorted=False).indices, "invariants")]
    return fp32 + [(*p, bf16) for p in bf + _flashinfer_providers(bf16, counts, k)]


def bench_selects(budget_end: float, shapes, dev, smoke=False) -> list[dict]:
    import loki.reference as R
    from loki.kernels.common import num_sms
    from loki.kernels.select_split import split_launch_config
    from loki.testing.invariants import check_selection

    rows = []
    for B, H, S, k in shapes:
        g = torch.Generator().manual_seed(S + k)
        scores = torch.randn(B, H, S, generator=g).to(dev)
        counts = torch.full((B,), k, dtype=torch.int32, device=dev)
        refs = {}  # the reference's sorted sets by scores dtype (bf16 scores tie more)
        cfg = split_launch_config(S, B * H, num_sms(dev))
        for name, conf, fn, check, x in _select_providers(scores, counts, k, cfg):
            dtype = str(x.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")
            r = dict(shape=f"{B}x{H}x{S} k={k}", rows=B * H, S=S, k=k, provider=name, scores=dtype, config=conf)
            if time.time() > budget_end and name not in ALWAYS:
                rows.append(dict(r, skipped="time budget"))
                continue
            optional = "flashinfer" in name  # a FlashInfer call that fails on this card is a row, not a crash
            try:
                out = fn()
                if check == "invariants":  # no tie rule: the selection invariants only
                    r["ok"] = check_selection(out, x, counts) == B * H
                else:
                    if dtype not in refs:
                        refs[dtype] = R.select_topk(x, counts).sort(-1).values
                    r["ok"] = _same_set(out, refs[dtype])
                if r["ok"]:
                    errors = [] if optional else None
                    r.update(_times(fn, smoke, errors))
                    if errors:
                        r["error"] = "; ".join(errors)
            except Exception as e:  # noqa: BLE001 - reported in the row
                if not optional:
                    raise
                r["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def _step_fn(x, counts, d, k, kp, method, run):
    from loki.testing.decode import kernel_step

    if method == "triton":  # the recorded and replayed step
        def step():
            return run.step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=kp, lengths=x.lengths,
                            starts=x.starts, counts=counts, width=k, return_indices=True)
    else:
        def step():
            return kernel_step(x.q, x.k_cache, x.v_cache, x.lengths, x.starts, counts, d=d, k_max=k,
                               gqa_select="kv", aggregate="sum", uniform=True, select_method=method, k_prefix=kp)
    return step


def bench_steps(budget_end: float, shapes, dev, smoke=False) -> list[dict]:
    import loki.kernels.select_split as split_mod
    from loki.bench.harness import make_bench_inputs
    from loki.kernels import make_key_prefix
    from loki.kernels.select import TRITON_SELECT_MAX_S
    from loki.testing.decode import kernel_run

    rows = []
    for name, B, HQ, HKV, S, D, k in shapes:
        if time.time() > budget_end:
            rows.append(dict(shape=name, skipped="time budget"))
            continue
        x = make_bench_inputs(B, HQ, HKV, S, D, device=dev, dtype=torch.float32 if smoke else torch.bfloat16)
        d = 32 if D >= 64 else D // 4
        kp = make_key_prefix(x.k_cache, d)
        counts = torch.full((B,), k, dtype=torch.int32, device=dev)
        methods = [("split", "triton", 1), ("torch", "torch", 1)]
        if S <= TRITON_SELECT_MAX_S:
            methods.insert(1, ("register", "triton", 1 << 40))  # the rule's min_s out of reach
        outs, done = {}, []
        for label, method, min_s in methods:
            saved = split_mod.SPLIT_RULE["min_s"]
            split_mod.SPLIT_RULE["min_s"] = min_s
            try:
                run = kernel_run(x.q, x.k_cache, d=d, gqa_select="kv", aggregate="sum")
                step = _step_fn(x, counts, d, k, kp, method, run)
                for _ in range(3):  # recorded, replayed
                    idx, res = step()
                outs[label] = (idx.long().sort(-1).values, res.float())
                r = dict(shape=name, rows=B * HKV, S=S, k=k, provider=label, planned=run.replays > 0)
                r.update(_times(step, smoke))
            finally:
                split_mod.SPLIT_RULE["min_s"] = saved
            done.append(r)
            print(json.dumps(r), flush=True)
        base_idx, base_out = outs["torch"]
        for r in done:
            idx, res = outs[r["provider"]]
            r["same_selection_as_torch"] = bool(torch.equal(idx, base_idx))
            r["max_abs_diff_vs_torch"] = float((res - base_out).abs().max())
        rows += done
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--budget", type=float, default=240.0, help="seconds after which variants are skipped")
    p.add_argument("--no-step", action="store_true", help="skip the decode-step timings")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (CPU interpreter or GPU)")
    args = p.parse_args(argv)
    import triton

    from loki.kernels.common import interpreting

    dev = torch.device("cpu" if interpreting() else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke with TRITON_INTERPRET=1)")
    if dev.type == "cpu" and not args.smoke:
        raise SystemExit("timings need a GPU: unset TRITON_INTERPRET, or pass --smoke")
    t0 = time.time()
    end = t0 + args.budget
    selects = bench_selects(end, SMOKE_SHAPES if args.smoke else SHAPES, dev, args.smoke)
    steps = [] if args.no_step else bench_steps(end, SMOKE_STEP_SHAPES if args.smoke else STEP_SHAPES, dev,
                                                args.smoke)
    fi = _flashinfer()
    result = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
                  torch=torch.__version__, triton=triton.__version__,
                  flashinfer=getattr(fi, "__version__", None) if fi is not None else None,
                  commit=_commit(), seconds=round(time.time() - t0, 1), selects=selects, steps=steps)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)

    def cell(r, key):
        return f"{r[key] * 1e3:.1f}" if key in r else ("skip" if "skipped" in r else "-")

    def ok(r):
        return "error" if "error" in r else r.get("ok", "-")

    fi = _flashinfer()
    print(f"\n{result['device']}, triton {triton.__version__}, flashinfer {result['flashinfer']}, commit "
          f"{result['commit']} (us; graph = CUDA-graph replay, L2 flushed / warm; do_bench includes host launch cost)")
    for shape in dict.fromkeys(r["shape"] for r in selects):
        print(f"\nselect {shape}\n| provider | scores | do_bench | graph | graph warm | ok |")
        print("|---|---|---|---|---|---|")
        for r in (r for r in selects if r["shape"] == shape):
            print(f"| {r['provider']} | {r['scores']} | {cell(r, 'ms')} | {cell(r, 'graph')} | {cell(r, 'graph_warm')} "
                  f"| {ok(r)} |")
    for r in (r for r in selects if "error" in r):
        print(f"error: {r['shape']} {r['provider']} {r['scores']}: {r['error']}")
    if fi is None:
        print("(flashinfer not usable here: its rows are left out)")
    if steps:
        print("\ndecode step\n| shape | provider | do_bench | graph | graph warm | same selection as torch |\n"
              "|---|---|---|---|---|---|")
    for r in steps:
        if "provider" in r:
            print(f"| {r['shape']} | {r['provider']} | {cell(r, 'ms')} | {cell(r, 'graph')} | "
                  f"{cell(r, 'graph_warm')} | {r['same_selection_as_torch']} |")
    bad = [r for r in selects if r.get("ok") is False] + [r for r in steps if not r.get("same_selection_as_torch",
                                                                                           True)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
