"""Decode-attention benchmark: Loki kernels against torch SDPA, eager attention, the pure-PyTorch Loki
reference and the SparQ-style kernels, with a per-stage breakdown and bandwidth accounting.

Wire it to a CLI with ``add_arguments(parser)`` and ``run(args) -> int``.  ``--e2e`` switches to the end-to-end
decode benchmark of whole models (:mod:`loki.bench.e2e`, :mod:`loki.bench.e2e_report`).

Timing: ``triton.testing.do_bench`` medians (warm-up excluded); do_bench clears the L2 cache before every
repetition (it writes a 256 MB buffer between runs), so every run reads the cache cold.  K and V are
distinct tensors.  Bandwidth: the bytes each method must move (dense: K and V once; Loki and SparQ: d/D of
K plus the k selected rows of K and V) over the measured time, and as a percentage of a device-to-device
copy measured in the same run.  Speed-ups are against torch SDPA measured in the same run.

Shape letters: B batch, HQ query heads, HKV key/value heads, S cache length, D head dim.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "MODELS",
    "BenchConfig",
    "add_arguments",
    "bench_config",
    "configs",
    "make_bench_inputs",
    "measure_copy_bandwidth",
    "run",
    "time_ms",
    "time_ms_graph",
    "write_markdown",
    "write_plot",
]

#: Model-like attention shapes: (HQ, HKV, D).
MODELS = {"llama2-13b": (40, 40, 128), "llama3-8b": (32, 8, 128)}
BATCHES = (1, 16)
SEQ_LENS = (2048, 4096, 8192, 16384, 32768)
BUDGETS = ((0.25, 0.25), (0.125, 0.25), (0.125, 0.5), (0.5, 0.5))  # (k_f, d_f)
QUICK = dict(models=("llama2-13b", "llama3-8b"), batches=(1, 16), seq_lens=(4096, 16384), budgets=((0.25, 0.25),))


@dataclass(frozen=True)
class BenchConfig:
    model: str
    B: int
    S: int
    k_f: float
    d_f: float
    dtype: str = "bfloat16"

    @property
    def shape(self):
        HQ, HKV, D = MODELS[self.model]
        return HQ, HKV, D

    @property
    def id(self) -> str:
        return f"{self.model}-B{self.B}-S{self.S}-k{self.k_f}-d{self.d_f}-{self.dtype}"


def configs(models=tuple(MODELS), batches=BATCHES, seq_lens=SEQ_LENS, budgets=BUDGETS, dtype="bfloat16"):
    return [BenchConfig(m, b, s, kf, df, dtype) for m in models for b in batches for s in seq_lens
            for kf, df in budgets]


def time_ms(fn, *, warmup: int = 10, rep: int = 40) -> float:
    """Median device time of ``fn()`` in ms (triton do_bench: events, L2 cleared before each run)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_ms_graph(fn, *, reps: int = 50, warmup: int = 5, flush_bytes: int = 256 << 20) -> float:
    """Median device time of one CUDA-graph replay of ``fn`` with the L2 flushed before each replay (as a
    decode loop under CUDA graphs runs it: no Python launch overhead).  Raises if ``fn`` cannot be captured
    (e.g. it synchronises with the host)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    cache = torch.empty(flush_bytes, dtype=torch.int8, device="cuda")
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i in range(warmup + reps):
        cache.zero_()
        if i >= warmup:
            ev[i - warmup][0].record()
        graph.replay()
        if i >= warmup:
            ev[i - warmup][1].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in ev)
    return float(times[len(times) // 2])


def do_bench_flushes_l2() -> bool:
    """Whether this triton's do_bench clears the L2 between repetitions (read from its source)."""
    import inspect

    import triton.testing

    src = inspect.getsource(triton.testing.do_bench)
    return "clear_cache" in src or "cache.zero_()" in src


def measure_copy_bandwidth(nbytes: int = 1 << 30, device="cuda") -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written over the median time)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (t * 1e-3) / 1e9


def make_bench_inputs(B, HQ, HKV, S, D, *, dtype=torch.bfloat16, device="cuda", seed=0, decay=0.9,
                      ragged=False, left_pad=False):
    """Decode inputs for benchmarks: the shared factory ``loki.testing.inputs.make_decode_inputs``
    (drawn directly on the device), with benchmark defaults (bf16, cuda)."""
    from loki.testing.inputs import make_decode_inputs

    return make_decode_inputs(B, HQ, HKV, S, D, dtype=dtype, device=device, seed=seed, decay=decay,
                              ragged=ragged, left_pad=left_pad)


def _sdpa_fn(q, k, v, gqa):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4 = q[:, :, None, :]

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa)

    try:
        flash()
        return flash, "flash"
    except RuntimeError:
        def default():
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa)
        return default, "default"


def _eager_fn(q, k, v):
    B, HQ, D = q.shape
    HKV = k.shape[1]
    qg = q.view(B, HKV, HQ // HKV, D)
    sc = 1.0 / math.sqrt(D)

    def eager():
        s = torch.matmul(qg, k.transpose(-1, -2)) * sc
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        return torch.matmul(p, v)

    return eager


def bench_config(cfg: BenchConfig, *, copy_gbps: float, providers=None, gqa_select=None, seed=0,
                 use_graphs: bool = True) -> dict:
    """Time every provider on one configuration; returns a dict of rows (ms, GB/s, % of copy, speed-up)."""
    from loki.kernels import make_key_prefix, select_topk, sparq_attention, sparq_prepare, sparse_attention
    from loki.kernels.approx_scores import launch_approx_scores
    from loki.kernels.decode import launch_decode_step, selection_bound
    from loki.kernels.plan import DecodeRun
    from loki.reference import loki_attention
    from loki.settings import LokiSettings

    dtype = getattr(torch, cfg.dtype)
    HQ, HKV, D = cfg.shape
    B, S = cfg.B, cfg.S
    es = torch.tensor([], dtype=dtype).element_size()
    x = make_bench_inputs(B, HQ, HKV, S, D, dtype=dtype, seed=seed)
    q, kc, vc = x.q, x.k_cache, x.v_cache
    d = max(1, math.ceil(cfg.d_f * D - 1e-9))
    K = selection_bound(cfg.k_f, S)
    counts = torch.full((B,), K, dtype=torch.int32, device=q.device)
    mode = gqa_select or ("kv" if HQ != HKV else "query")
    H = HQ if mode == "query" else HKV
    gqa = HQ != HKV
    dense_bytes = 2 * B * HKV * S * D * es
    loki_bytes = B * HKV * S * d * es + 2 * B * H * K * D * es
    # the cache-layout option: the first d rotated key dims kept contiguously beside K (built at append time)
    kp = make_key_prefix(kc, d)
    rows = {}

    def add(name, fn, nbytes, graph=True):
        try:
            ms = time_ms(fn)
        except Exception as e:  # noqa: BLE001 - a provider that cannot run this shape is reported, not fatal
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            return
        rows[name] = {"ms": ms, "bytes": nbytes, "gbps": nbytes / (ms * 1e-3) / 1e9 if nbytes else None}
        if graph and use_graphs:
            try:
                rows[name]["graph_ms"] = time_ms_graph(fn)
            except Exception as e:  # noqa: BLE001 - host syncs make a provider uncapturable
                rows[name]["graph_error"] = f"{type(e).__name__}: {str(e)[:120]}"

    want = set(providers or ["sdpa", "eager", "loki_torch", "sparq", "loki", "loki_noplan", "loki_noprefix",
                             "loki_topk",
                             "stages"])
    sdpa, backend = _sdpa_fn(q, kc, vc, gqa)
    add("sdpa", sdpa, dense_bytes)
    rows["sdpa"]["backend"] = backend
    if "eager" in want:
        add("eager", _eager_fn(q, kc, vc), dense_bytes)
    # the kernel benchmark times raw-sum shared selections (its recorded history is of that setting)
    common = dict(q_hat=q, k_hat=kc, v_cache=vc, lengths=x.lengths, starts=x.starts, counts=counts)
    step_kw = dict(common, d=d, width=K, gqa_select=mode, aggregate="sum", scale=None, uniform=True)
    settings = LokiSettings(k=cfg.k_f, d=d, gqa_select=mode, aggregate="sum", backend="triton",
                            score_format="native").resolve_shapes(
        num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    run = DecodeRun(settings, scale=1.0 / math.sqrt(D))  # the "loki" provider: recorded once, replayed after
    if "loki" in want:
        add("loki", lambda: run.step(k_prefix=kp, width=K, **common), loki_bytes)
    if "loki_noplan" in want:  # the same step through Triton's normal launch path (no recorded plan)
        add("loki_noplan", lambda: launch_decode_step(k_prefix=kp, select_method="triton", **step_kw), loki_bytes)
    if "loki_noprefix" in want:
        add("loki_noprefix", lambda: launch_decode_step(k_prefix=None, select_method="triton", **step_kw),
            loki_bytes)
    if "loki_topk" in want:
        add("loki_topk", lambda: launch_decode_step(k_prefix=kp, select_method="torch", **step_kw), loki_bytes)
    if "stages" in want:
        # the stages of the "loki" provider, one at a time
        scores = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        ho, ao = (scores, None) if mode == "query" else (None, scores)
        add("stage_scores", lambda: launch_approx_scores(q, kp, d, x.lengths, x.starts, ho, ao, "sum"),
            B * HKV * S * d * es)
        add("stage_scores_strided", lambda: launch_approx_scores(q, kc, d, x.lengths, x.starts, ho, ao, "sum"),
            B * HKV * S * d * es, graph=False)
        launch_approx_scores(q, kp, d, x.lengths, x.starts, ho, ao, "sum")
        add("stage_select_triton", lambda: select_topk(scores, counts, k_max=K, method="triton"), None)
        add("stage_select_topk", lambda: select_topk(scores, counts, k_max=K, method="torch", uniform=True), None,
            graph=False)
        idx = select_topk(scores, counts, k_max=K, method="triton")
        reuse = {"prefix_scores": scores, "prefix_dims": d} if mode == "query" and d < D else {}
        add("stage_attention", lambda: sparse_attention(q, kc, vc, idx, counts, **reuse), 2 * B * H * K * D * es)
    if "sparq" in want:
        k_t, v_mean = sparq_prepare(kc, vc)
        add("sparq", lambda: sparq_attention(q, kc, vc, r=d, k=K, k_cache_t=k_t, v_mean=v_mean, k_max=K,
                                             lengths=x.lengths, starts=x.starts),
            B * HQ * S * d * es + 2 * B * HQ * K * D * es, graph=False)
    if "loki_torch" in want:
        add("loki_torch", lambda: loki_attention(q, kc, vc, d=d, k=K, gqa_select=mode, aggregate="sum"), loki_bytes,
            graph=False)
    base = rows["sdpa"].get("ms")
    gbase = rows["sdpa"].get("graph_ms")
    for r in rows.values():
        if "ms" in r:
            r["speedup_vs_sdpa"] = base / r["ms"] if base else None
            r["pct_copy_bw"] = 100 * r["gbps"] / copy_gbps if r.get("gbps") else None
        if "graph_ms" in r and gbase:
            r["graph_speedup_vs_sdpa"] = gbase / r["graph_ms"]
            if r.get("bytes"):
                r["graph_pct_copy_bw"] = 100 * r["bytes"] / (r["graph_ms"] * 1e-3) / 1e9 / copy_gbps
    return {
        "config": asdict(cfg), "id": cfg.id, "HQ": HQ, "HKV": HKV, "D": D, "d": d, "K": K, "gqa_select": mode,
        "dense_floor_ms": dense_bytes / (copy_gbps * 1e9) * 1e3,
        "loki_floor_ms": loki_bytes / (copy_gbps * 1e9) * 1e3,
        "rows": rows,
    }


KEY_PROVIDERS = ("sdpa", "eager", "loki_torch", "sparq", "loki_topk", "loki_noprefix", "loki")


def _g(rows, name, key, nd=3):
    v = rows.get(name, {}).get(key)
    return "-" if v is None else f"{v:.{nd}f}"


def write_markdown(results: dict, path: str) -> str:
    lines = [
        f"# Decode attention benchmark ({results['device']}, {results['date']})",
        "",
        f"torch {results['torch']}, triton {results['triton']}; copy bandwidth {results['copy_gbps']:.0f} GB/s; "
        f"do_bench median, L2 flushed between runs: {results['l2_flush']}.",
        "`loki` = Loki kernels with the Triton threshold select and the contiguous key-prefix buffer (`k_prefix`,"
        " a cache-layout option); `loki_noprefix` = the same reading the first d dims in place from K;"
        " `loki_topk` = `loki` with torch.topk.",
        "Times in ms; x = speed-up vs torch SDPA (flash) in the same run; % = share of copy bandwidth;"
        " floor = bytes Loki must read (d/D of K + k rows of K and V) / copy bandwidth; x floor = loki / floor;"
        " stages = the `loki` stages timed alone (scores from `k_prefix`, Triton select, attention).",
        "",
        "Graph columns: the same call captured in a CUDA graph, L2 flushed before each replay (no Python launch"
        " overhead; SparQ and the PyTorch reference synchronise with the host and cannot be captured).",
        "",
        "| config | d | K | " + " | ".join(KEY_PROVIDERS) + " | loki x SDPA | loki % bw | loki floor | x floor | "
        "scores / select / attn | select share | graph: sdpa | graph: loki | graph: loki x SDPA | graph: loki % bw |",
        "|---" * (len(KEY_PROVIDERS) + 13) + "|",
    ]
    for res in results["results"]:
        r = res["rows"]

        def ms(n, r=r):
            return f"{r[n]['ms']:.3f}" if n in r and "ms" in r[n] else ("err" if n in r else "-")

        lk = r.get("loki", {})
        st = "/".join(ms(n) for n in ("stage_scores", "stage_select_triton", "stage_attention"))
        stage_ms = [r.get(n, {}).get("ms") for n in ("stage_scores", "stage_select_triton", "stage_attention")]
        share = (f"{100 * stage_ms[1] / sum(stage_ms):.0f}%" if all(v is not None for v in stage_ms) else "-")
        xfloor = f"{lk['ms'] / res['loki_floor_ms']:.2f}" if "ms" in lk else "-"
        lines.append(
            f"| {res['id']} | {res['d']} | {res['K']} | " + " | ".join(ms(n) for n in KEY_PROVIDERS)
            + f" | {lk.get('speedup_vs_sdpa', float('nan')):.2f} | {lk.get('pct_copy_bw') or float('nan'):.0f} | "
            f"{res['loki_floor_ms']:.3f} | {xfloor} | {st} | {share} | {_g(r, 'sdpa', 'graph_ms')} | "
            f"{_g(r, 'loki', 'graph_ms')} | {_g(r, 'loki', 'graph_speedup_vs_sdpa', 2)} | "
            f"{_g(r, 'loki', 'graph_pct_copy_bw', 0)} |"
        )
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def write_plot(results: dict, path: str) -> bool:
    """Speed-up of the Loki kernels vs SDPA against S, one line per (model, B, budget)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = {}
    for res in results["results"]:
        c = res["config"]
        lk = res["rows"].get("loki", {})
        if "speedup_vs_sdpa" in lk:
            series.setdefault((c["model"], c["B"], c["k_f"], c["d_f"]), []).append(
                (c["S"], lk["speedup_vs_sdpa"], lk.get("graph_speedup_vs_sdpa", float("nan"))))
    fig, ax = plt.subplots(figsize=(8, 5))
    for (m, b, kf, df), pts in sorted(series.items()):
        pts.sort()
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{m} B={b} k_f={kf} d_f={df}")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", ls="--", color=line.get_color())
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("S (cached tokens)")
    ax.set_ylabel("speed-up vs torch SDPA (solid: do_bench, dashed: CUDA graph)")
    ax.set_title(f"Loki decode kernels vs SDPA ({results['device']}, {results['dtype']})")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .e2e import E2E_MODELS
    from .e2e_report import add_arguments as add_e2e_arguments

    parser.add_argument("--quick", action="store_true", help="a small subset (kernels: B 1/16, S 4096/16384, "
                        "0.25/0.25; --e2e: the target settings)")
    parser.add_argument("--models", nargs="+", choices=sorted(set(MODELS) | set(E2E_MODELS)), default=None,
                        help=f"kernels: {', '.join(sorted(MODELS))} (attention shapes); --e2e: "
                        f"{', '.join(E2E_MODELS)} (whole models)")
    parser.add_argument("--batches", nargs="+", type=int, default=None,
                        help="batch sizes B to time (default: the grid's)")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=None,
                        help="cache lengths S to time (default: the grid's)")
    parser.add_argument("--budgets", nargs="+", default=None,
                        help="k_f:d_f pairs, e.g. 0.25:0.25 (--e2e: one; an integer k is a count of tokens, e.g. "
                        "2048:0.25)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the caches and queries (default: %(default)s)")
    parser.add_argument("--providers", nargs="+", default=None,
                        help="the implementations to time: sdpa, eager, loki_torch, sparq, loki, loki_noplan, "
                        "loki_noprefix, loki_topk, stages (default: all)")
    parser.add_argument("--out", default=".", help="folder for the JSON, markdown and PNG results")
    parser.add_argument("--tag", default=None, help="file name stem (default kernels-<device>-<date>, "
                        "e2e-<device>-<date> with --e2e)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings")
    add_e2e_arguments(parser)


def _kernel_budget(text: str) -> tuple[float, float]:
    """One ``--budgets`` pair of the kernel benchmark: fractions ``k_f:d_f`` in (0, 1]."""
    from loki.evaluation.commands import UsageError

    try:
        k_f, d_f = (float(v) for v in text.split(":"))
    except ValueError:
        raise UsageError(f"--budgets: expected fractions k_f:d_f like 0.25:0.25, got {text!r}") from None
    if not (0 < k_f <= 1 and 0 < d_f <= 1):
        raise UsageError(f"--budgets: the kernel benchmark takes fractions k_f:d_f in (0, 1], got {text!r} (a count "
                         "of tokens such as 2048:0.25 is --e2e's; here k_f = 2048 / S, e.g. 0.0625 at S = 32768)")
    return k_f, d_f


def run(args: argparse.Namespace) -> int:
    from loki._io import output_folder_problem

    err = output_folder_problem(args.out, "--out")  # before the timings: a bad folder must not cost them
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if getattr(args, "e2e", False):
        from .e2e_report import run as run_e2e

        return run_e2e(args, copy_bandwidth=measure_copy_bandwidth)
    import triton

    bad = [m for m in args.models or () if m not in MODELS]
    if bad:
        print(f"error: --models {' '.join(bad)}: the kernel benchmark takes {', '.join(sorted(MODELS))} "
              "(whole models need --e2e)", file=sys.stderr)
        return 2
    budgets = tuple(_kernel_budget(b) for b in args.budgets) if args.budgets else None  # user errors first
    if not torch.cuda.is_available():
        print("error: loki bench needs a CUDA device and none is visible (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    sel = dict(QUICK) if args.quick else dict(models=tuple(MODELS), batches=BATCHES, seq_lens=SEQ_LENS,
                                              budgets=BUDGETS)
    if args.models:
        sel["models"] = tuple(args.models)
    if args.batches:
        sel["batches"] = tuple(args.batches)
    if args.seq_lens:
        sel["seq_lens"] = tuple(args.seq_lens)
    if budgets:
        sel["budgets"] = budgets
    cfgs = configs(dtype=args.dtype, **sel)
    name = torch.cuda.get_device_name()
    copy_gbps = measure_copy_bandwidth()
    date = _dt.date.today().isoformat()
    results = {"device": name, "date": date, "torch": torch.__version__, "triton": triton.__version__,
               "copy_gbps": copy_gbps, "l2_flush": do_bench_flushes_l2(), "dtype": args.dtype, "results": []}
    print(f"# {name}: copy bandwidth {copy_gbps:.0f} GB/s; {len(cfgs)} configs", flush=True)
    for cfg in cfgs:
        res = bench_config(cfg, copy_gbps=copy_gbps, providers=args.providers, use_graphs=not args.no_graphs)
        results["results"].append(res)
        torch.cuda.empty_cache()
        r = res["rows"]
        msg = " ".join(f"{n}={r[n]['ms']:.3f}" for n in r if "ms" in r[n])
        print(f"{cfg.id}: {msg}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    dev = "h100" if "H100" in name else ("h200" if "H200" in name else "gpu")
    stem = args.tag or f"kernels-{dev}-{date}"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    text = write_markdown(results, os.path.join(args.out, stem + ".md"))
    write_plot(results, os.path.join(args.out, stem + ".png"))
    print(text)
    return 0


def main(argv=None) -> int:
    from loki.evaluation.commands import UsageError

    parser = argparse.ArgumentParser(prog="loki-bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
