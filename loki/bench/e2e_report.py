"""``loki bench --e2e``: the command-line side of the end-to-end decode benchmark (:mod:`loki.bench.e2e`):
arguments, the grid they select, the JSON / markdown / PNG outputs and the comparison with the issue's targets.

``loki.bench.harness`` adds these arguments to ``loki bench`` and hands ``--e2e`` runs to :func:`run` with its
copy-bandwidth probe (this module does not import the harness).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os

from loki.evaluation.commands import UsageError

from .e2e import BATCHES, E2E_MODELS, FLOOR_TARGET, PATHS, QUICK_SETTINGS, SEQ_LENS, TARGETS, Setting, settings

__all__ = ["add_arguments", "select", "run", "target_rows", "short_table", "write_markdown", "write_plot"]

SHORT = {"sdpa_eager": "sdpa", "sdpa_compiled": "sdpa+compile", "loki_eager": "loki", "loki_compiled": "loki+compile"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "end-to-end decode (--e2e)",
        "Whole Llama models with random weights (llama2-7b: 32 layers, hidden 4096, 32/32 heads, MLP 11008, "
        "vocab 32000; llama3-8b: 32/8 heads, MLP 14336, vocab 128256), bf16, decoding one token per step over a "
        "cache filled with random keys and values. Four paths: sdpa_eager (SDPA, DynamicCache), sdpa_compiled "
        "(StaticCache, torch.compile mode=reduce-overhead fullgraph), loki_eager (enable_loki, DynamicCache), "
        "loki_compiled (LokiStaticCache, compiled). Per setting: ms per step (CUDA events, median of --steps "
        "steps after an untimed pass over the same steps), tokens/s = B / step time, the first pass's time "
        "(compilation), the byte floor (weights + KV bytes to read, over the measured copy bandwidth), Loki's "
        "best path over the faster dense path, and the issue's targets. Grid: --models (llama2-7b, llama3-8b), "
        f"--batches (default {' '.join(map(str, BATCHES))}), --seq-lens (S = the cache length the last timed "
        f"step reaches; default {' '.join(map(str, SEQ_LENS))}); --quick = the target settings "
        + ", ".join(f"{m} B={b} S={s}" for m, b, s in QUICK_SETTINGS)
        + " (filtered by --models/--batches/--seq-lens when given). Settings whose caches do not fit the GPU are "
        "reported as skipped. --budgets takes one k_f:d_f pair (default 0.25:0.25), --dtype the model dtype.")
    g.add_argument("--e2e", action="store_true", help="run the end-to-end decode benchmark instead of the kernels")
    g.add_argument("--steps", type=int, default=32, help="timed decode steps per path and setting (default 32)")
    g.add_argument("--paths", nargs="+", choices=PATHS, default=None, help="paths to run (default: all four)")
    g.add_argument("--sdpa-backend", choices=("default", "flash", "native-gqa"), default="default",
                   help="SDPA backend of the dense paths: torch's choice (default), flash only (a path whose "
                   "attention mask flash cannot take reports the error), or native-gqa: torch's choice with grouped "
                   "K/V passed to SDPA as they are even under a mask (transformers otherwise copies them to every "
                   "query head whenever a mask is given, as on every static-cache decode step)")
    g.add_argument("--gqa-select", choices=("auto", "query", "kv"), default="auto",
                   help="Loki's selection for GQA models: per query head or per KV head (auto: kv for GQA)")
    g.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds after which paths not started yet are skipped (default 540; results so far are "
                   "written after every setting)")


def select(args) -> dict:
    """The e2e run's settings and options from ``args``; a :class:`UsageError` for bad values."""
    models = list(args.models or E2E_MODELS)
    bad = [m for m in models if m not in E2E_MODELS]
    if bad:
        raise UsageError(f"--e2e --models: unknown {', '.join(bad)}; choose from {', '.join(E2E_MODELS)}")
    for flag, vals in (("--batches", args.batches), ("--seq-lens", args.seq_lens)):
        if vals is not None and any(v < 1 for v in vals):
            raise UsageError(f"{flag} must be positive integers, got {' '.join(map(str, vals))}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise UsageError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    budgets = args.budgets or ["0.25:0.25"]
    if len(budgets) != 1:
        raise UsageError(f"--e2e takes one --budgets pair k_f:d_f, got {len(budgets)}")
    try:
        k_f, d_f = (float(v) for v in budgets[0].split(":"))
    except ValueError:
        raise UsageError(f"--budgets: expected k_f:d_f like 0.25:0.25, got {budgets[0]!r}") from None
    if not (0 < k_f <= 1 and 0 < d_f <= 1):
        raise UsageError(f"--budgets: k_f and d_f must lie in (0, 1], got {budgets[0]}")
    if args.quick:
        grid = [Setting(m, b, s) for m, b, s in QUICK_SETTINGS if m in models
                and (args.batches is None or b in args.batches) and (args.seq_lens is None or s in args.seq_lens)]
    else:
        grid = settings(models, tuple(args.batches or BATCHES), tuple(args.seq_lens or SEQ_LENS))
    if not grid:
        raise UsageError("--e2e: the arguments select no setting (--quick keeps only its own settings)")
    short = [s.id for s in grid if s.S <= args.steps]
    if short:
        raise UsageError(f"--steps {args.steps} must be below every S (the cache holds S - steps tokens before "
                         f"the timed steps): {', '.join(short)}")
    return {"grid": grid, "k_f": k_f, "d_f": d_f, "paths": tuple(args.paths or PATHS), "steps": args.steps,
            "gqa_select": args.gqa_select, "sdpa_backend": args.sdpa_backend, "time_budget_s": args.time_budget}


def target_rows(results: list[dict]) -> list[dict]:
    """The issue's targets against ``results``: Loki's best path over the faster dense path at the target
    settings, and compiled Loki's time over its byte floor at every setting where it ran."""
    by_id = {r["id"]: r for r in results}
    rows = []
    for m, b, s, want in TARGETS:
        r = by_id.get(Setting(m, b, s).id)
        got = None if r is None else r.get("speedup")
        rows.append({"target": f"{m} B={b} S={s}: Loki best / dense best >= {want}", "value": got,
                     "pass": None if got is None else got >= want,
                     "note": "not run" if r is None else ("" if got is not None else "a path is missing")})
    for r in results:
        x = r.get("x_floor", {}).get("loki_compiled")
        if x is not None:
            rows.append({"target": f"{r['id']}: compiled Loki / byte floor <= {FLOOR_TARGET}", "value": x,
                         "pass": x <= FLOOR_TARGET, "note": ""})
    return rows


def _cell(r: dict | None, key: str, fmt: str) -> str:
    if r is None:
        return "-"
    if key in r:
        return format(r[key], fmt)
    return "skip" if "skipped" in r else ("err" if "error" in r else "-")


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def write_markdown(doc: dict, path: str) -> str:
    paths = doc["paths"]
    compiled = [p for p in paths if p.endswith("_compiled")]
    lines = [
        f"# End-to-end decode benchmark ({doc['device']}, {doc['date']})",
        "",
        f"torch {doc['torch']}, transformers {doc['transformers']}, triton {doc.get('triton') or '-'}; {doc['dtype']}; "
        f"copy bandwidth {_f(doc.get('copy_gbps'), '.0f')} GB/s; SDPA backend {doc['sdpa_backend']} "
        f"(enabled: {', '.join(k for k, v in doc.get('sdpa_backends', {}).items() if v) or '-'}); Loki k_f = "
        f"{doc['k_f']}, d_f = {doc['d_f']}, random orthogonal basis; {doc['steps']} timed steps per path "
        "ending at cache length S.",
        "",
        "ms = median ms per decode step (CUDA events), tok/s = B / median step time. Floors: bytes one step must "
        "read (weights without the input embedding table + dense K and V, or Loki's d/D key prefix and k_f rows of "
        "K and V) over the copy bandwidth. speed-up = the faster Loki path over the faster dense path; x floor = "
        "compiled Loki over its floor. First pass = wall time of the untimed steps (compilation, CUDA-graph "
        "recording, warm-up); compile = the first pass less the timed steps' time.",
        "",
        "| setting | " + " | ".join(f"{SHORT[p]} ms | {SHORT[p]} tok/s" for p in paths)
        + " | dense floor ms | Loki floor ms | speed-up | x floor | first pass s ("
        + " / ".join(SHORT[p] for p in paths) + ") | compile s (" + " / ".join(SHORT[p] for p in compiled) + ") |",
        "|---" * (2 * len(paths) + 7) + "|",
    ]
    notes = []
    for r in doc["results"]:
        if "skipped" in r:
            lines.append(f"| {r['id']} | " + " | ".join("skip" for _ in range(2 * len(paths) + 6)) + " |")
            notes.append(f"- {r['id']}: skipped, {r['skipped']}")
            continue
        cells = []
        for p in paths:
            pr = r["paths"].get(p)
            cells += [_cell(pr, "ms_median", ".2f"), _cell(pr, "tokens_per_s", ".0f")]
            if pr and ("skipped" in pr or "error" in pr):
                notes.append(f"- {r['id']} {p}: {pr.get('skipped') or 'error: ' + pr['error']}")
        fl = r.get("floor_ms", {})
        first = " / ".join(_cell(r["paths"].get(p), "first_pass_s", ".1f") for p in paths)
        comp = " / ".join(_f((r["paths"].get(p) or {}).get("compile_s"), ".1f") for p in compiled)
        lines.append(f"| {r['id']} | " + " | ".join(cells) + f" | {_f(fl.get('dense'))} | {_f(fl.get('loki'))} | "
                     f"{_f(r.get('speedup'))} | {_f(r.get('x_floor', {}).get('loki_compiled'))} | {first} | {comp} |")
    lines += ["", "## Targets (H100)", "", "| target | value | met |", "|---|---|---|"]
    for t in target_rows(doc["results"]):
        met = {True: "yes", False: "no", None: t["note"] or "-"}[t["pass"]]
        lines.append(f"| {t['target']} | {_f(t['value'])} | {met} |")
    if notes:
        lines += ["", "## Skipped and failed paths", ""] + notes
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def short_table(doc: dict) -> str:
    """The few lines printed last: tokens/s per path, speed-up and floor ratio per setting, then the targets."""
    paths = doc["paths"]
    out = [f"{'setting':<22}" + "".join(f"{SHORT[p]:>14}" for p in paths) + f"{'speed-up':>10}{'x floor':>9}"]
    for r in doc["results"]:
        if "skipped" in r:
            out.append(f"{r['id']:<22}skipped: {r['skipped']}")
            continue
        out.append(f"{r['id']:<22}" + "".join(f"{_cell(r['paths'].get(p), 'tokens_per_s', '.0f'):>14}" for p in paths)
                   + f"{_f(r.get('speedup')):>10}{_f(r.get('x_floor', {}).get('loki_compiled')):>9}")
    out.append("(tokens/s per path)")
    for t in target_rows(doc["results"]):
        met = {True: "met", False: "NOT met", None: t["note"] or "-"}[t["pass"]]
        out.append(f"target {t['target']}: {_f(t['value'])} ({met})")
    return "\n".join(out)


def write_plot(doc: dict, path: str) -> bool:
    """Tokens/s of every path per setting (grouped bars, log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    res = [r for r in doc["results"] if "skipped" not in r]
    if not res:
        return False
    paths = doc["paths"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(res) + 2), 4.5))
    width = 0.8 / len(paths)
    for j, p in enumerate(paths):
        xs = [i + (j - (len(paths) - 1) / 2) * width for i in range(len(res))]
        ys = [r["paths"].get(p, {}).get("tokens_per_s", 0.0) for r in res]
        ax.bar(xs, ys, width, label=SHORT[p])
    ax.set_xticks(range(len(res)))
    ax.set_xticklabels([r["id"] for r in res], rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"End-to-end decode ({doc['device']}, {doc['dtype']}, k_f={doc['k_f']}, d_f={doc['d_f']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args, copy_bandwidth=None) -> int:
    """Run the benchmark selected by ``args`` on the CUDA device; ``copy_bandwidth()`` returns the
    device-to-device copy bandwidth in GB/s (``loki.bench.harness.measure_copy_bandwidth``)."""
    import torch

    sel = select(args)
    if not torch.cuda.is_available():
        raise UsageError("loki bench --e2e needs a CUDA GPU and none is visible (torch.cuda.is_available() is False)")
    import transformers

    from .e2e import run_grid, sdpa_backend_config

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth() if copy_bandwidth is not None else None
    date = _dt.date.today().isoformat()
    doc = {"kind": "e2e", "device": name, "date": date, "torch": torch.__version__,
           "transformers": transformers.__version__, "triton": triton_version, "dtype": args.dtype,
           "copy_gbps": copy_gbps, "sdpa_backend": sel["sdpa_backend"], "sdpa_backends": sdpa_backend_config(),
           "k_f": sel["k_f"], "d_f": sel["d_f"], "steps": sel["steps"], "paths": list(sel["paths"]),
           "grid": [s.id for s in sel["grid"]], "results": []}
    os.makedirs(args.out, exist_ok=True)
    dev = "h100" if "H100" in name else ("h200" if "H200" in name else "gpu")
    stem = os.path.join(args.out, args.tag or f"e2e-{dev}-{date}")
    print(f"# {name}: copy bandwidth {_f(copy_gbps, '.0f')} GB/s; {len(sel['grid'])} settings", flush=True)

    def save(res):
        doc["results"].append(res)
        with open(stem + ".json", "w") as f:
            json.dump(doc, f, indent=1)

    run_grid(sel["grid"], device="cuda", dtype=dtype, paths=sel["paths"], steps=sel["steps"], k_f=sel["k_f"],
             d_f=sel["d_f"], gqa_select=sel["gqa_select"], sdpa_backend=sel["sdpa_backend"], copy_gbps=copy_gbps,
             time_budget_s=sel["time_budget_s"], on_setting=save, log=lambda m: print(m, flush=True))
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    write_markdown(doc, stem + ".md")
    write_plot(doc, stem + ".png")
    print(f"# wrote {stem}.json, .md, .png")
    print(short_table(doc))
    return 0
