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
from loki.reference.selection import KERNEL_AGGREGATES
from loki.settings import LokiSettings

from .e2e import (
    BATCHES,
    CEILING_TARGET,
    E2E_MODELS,
    FLOOR_TARGET,
    PATHS,
    PROMPTS,
    QUICK_SETTINGS,
    SEQ_LENS,
    TARGETS,
    Setting,
    settings,
)

__all__ = ["add_arguments", "select", "run", "target_rows", "short_table", "write_markdown", "write_plot"]

SHORT = {"sdpa_eager": "sdpa", "sdpa_compiled": "sdpa+compile", "loki_eager": "loki", "loki_compiled": "loki+compile"}
DENSE_FLOOR_LIMIT = 2.0  # a dense baseline slower than this times its byte floor carries no speed-up target
REPEAT_KV_NOTE = ("the dense paths ran transformers' own SDPA call (--sdpa-backend default), which copies K/V to every "
                  "query head on each static-cache step of a GQA model: the speed-ups over dense read high; "
                  "--sdpa-backend native-gqa is the fair baseline.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "end-to-end decode (--e2e)",
        "Whole Llama models with random weights (llama2-7b: 32 layers, hidden 4096, 32/32 heads, MLP 11008, "
        "vocab 32000; llama3-8b: 32/8 heads, MLP 14336, vocab 128256), bf16, decoding one token per step over a "
        "cache filled with random keys and values. Four paths: sdpa_eager (SDPA, DynamicCache), sdpa_compiled "
        "(StaticCache, torch.compile mode=reduce-overhead fullgraph), loki_eager (enable_loki, DynamicCache), "
        "loki_compiled (LokiStaticCache, compiled). Per setting: ms per step (CUDA events, median of --steps "
        "steps after an untimed pass over the same steps), tokens/s = B / step time, the first pass's time "
        "(compilation), the peak memory (CUDA), the byte floor (weights + KV bytes to read, over the measured copy "
        "bandwidth), Loki's best path over the faster dense path, the byte ceiling of that speed-up (dense floor / "
        "Loki floor) and the fraction of it reached (speed-up / ceiling), and the issue's targets. Loki runs in the "
        "default configuration, the one the accuracy suite reports and gates: on the GQA model (llama3-8b) one "
        "selection per KV group with each head's scores softmax-normalised before the group's maximum (kv, "
        "softmax-max), on llama2-7b per query head (--gqa-select, --aggregate change it). --generate adds "
        "whole greedy model.generate calls per path: ms per token = (t(N+1 new tokens) - t(1)) / N, the generate-"
        "level speed-up and its fraction of the ceiling. Grid: --models (llama2-7b, llama3-8b), "
        f"--batches (default {' '.join(map(str, BATCHES))}), --seq-lens (S = the cache length the last timed "
        f"step reaches; default {' '.join(map(str, SEQ_LENS))}); --quick = the target settings "
        + ", ".join(f"{m} B={b} S={s}" for m, b, s in QUICK_SETTINGS)
        + " (filtered by --models/--batches/--seq-lens when given); --settings names setting ids instead "
        "(<model>-B<B>-S<S>[-k<k>], e.g. llama3-8b-B1-S131072-k2048: a setting with -k<k> has its own budget). "
        "Settings whose caches do not fit the GPU are reported as skipped. --budgets takes one k[:d_f] pair "
        "(default 0.25, d_f auto: 0.5 with the int8 score copy, 0.25 with a native one; k with a '.' is a fraction "
        "k_f, an integer a count of tokens, e.g. 2048 or 2048:0.25), --dtype the model dtype.")
    g.add_argument("--e2e", action="store_true", help="run the end-to-end decode benchmark instead of the kernels")
    g.add_argument("--steps", type=int, default=32, help="timed decode steps per path and setting (default 32)")
    g.add_argument("--paths", nargs="+", choices=PATHS, default=None, help="paths to run (default: all four)")
    g.add_argument("--sdpa-backend", choices=("native-gqa", "default", "flash"), default="native-gqa",
                   help="SDPA backend of the dense paths: native-gqa (the default, the fair dense baseline): torch's "
                   "choice with grouped K/V passed to SDPA as they are even under a mask; default: transformers' own "
                   "call, which copies K/V to every query head whenever a mask is given, as on every static-cache "
                   "decode step (5.7x slower at Llama-3-8B dims B=1 S=131072 on an H200, so every speed-up reads too "
                   "high); flash: flash only (a path whose attention mask flash cannot take reports the error)")
    g.add_argument("--gqa-select", choices=("auto", "query", "kv"), default="auto",
                   help="Loki's selection: per query head or one per KV group (default: auto, kv for a GQA model and "
                   "query otherwise, enable_loki's default)")
    g.add_argument("--aggregate", choices=("auto", *KERNEL_AGGREGATES), default="auto",
                   help="how a shared (kv) selection combines the group's scores (default: auto = softmax-max, "
                   "enable_loki's default and the configuration the accuracy suite gates; sum: raw sums, the timing "
                   "before softmax-max became the default)")
    g.add_argument("--score-format", choices=("auto", "native", "int8"), default="auto",
                   help="Loki's score copy: auto (the default, enable_loki's: int8 codes of the first d dims and a "
                   "bf16 scale per token, d_f 0.5 unless --budgets names it), int8, "
                   "or native (the first d dims in the cache's dtype, d_f 0.25 unless --budgets names it: the same "
                   "bytes)")
    g.add_argument("--no-key-prefix", dest="key_prefix", action="store_false",
                   help="Loki's caches keep no second copy of the keys' first d dims (enable_loki(key_prefix=False): "
                   "a dense cache's memory, the approximate scores read those dims in place, rounded to the int8 copy "
                   "as they are read for int8: slower, the same results)")
    g.add_argument("--settings", nargs="+", default=None, metavar="ID",
                   help="setting ids to run, e.g. llama3-8b-B1-S131072-k2048 llama3-8b-B8-S32768 (instead of the "
                   "grid of --models/--batches/--seq-lens/--quick)")
    g.add_argument("--generate", action="store_true",
                   help="also time whole greedy model.generate calls per path (per token: (t(N+1) - t(1)) / N, "
                   "each length warmed once; compiled paths: generate's own compilation on the static cache)")
    g.add_argument("--generate-tokens", type=int, default=None, metavar="N",
                   help="N of --generate (default: --steps)")
    g.add_argument("--generate-reps", type=int, default=3, help="timed calls per length (median; default 3)")
    g.add_argument("--generate-prompt", choices=PROMPTS, default="cache",
                   help="cache (default): the cache already holds the prompt but its last token, generate runs that "
                   "token first; prefill: generate prefills the whole S - N - 1 token prompt (seconds per call at "
                   "S = 131072; it cancels in the per-token time)")
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
    aggregate = args.aggregate
    if args.gqa_select == "query" and aggregate != "auto":
        raise UsageError(f"--aggregate {aggregate} combines the scores of a shared selection: it needs --gqa-select "
                         "kv or auto (per query head there is nothing to combine)")
    if args.time_budget is not None and args.time_budget <= 0:
        raise UsageError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
    budgets = args.budgets or ["0.25"]
    if len(budgets) != 1:
        raise UsageError(f"--e2e takes one --budgets pair k_f[:d_f], got {len(budgets)}")
    try:
        k_text, _, d_text = budgets[0].partition(":")
        k_f = int(k_text) if k_text.strip().isdigit() else float(k_text)
        d_f = "auto" if d_text in ("", "auto") else float(d_text)
    except ValueError:
        raise UsageError(f"--budgets: expected k_f[:d_f] like 0.25, 0.25:0.5 or 2048:0.25 (k a count of tokens), "
                         f"got {budgets[0]!r}") from None
    if not ((k_f >= 1 if isinstance(k_f, int) else 0 < k_f <= 1) and (d_f == "auto" or 0 < d_f <= 1)):
        raise UsageError(f"--budgets: k_f and d_f must lie in (0, 1] (k an integer >= 1), got {budgets[0]}")
    try:  # the score format and its dims as enable_loki decides them, checked before anything is built
        loki = LokiSettings(d=d_f, score_format=args.score_format, key_prefix=args.key_prefix)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    d_f, score_format = float(loki.d), loki.score_format.value
    if args.settings:
        if args.quick or args.models or args.batches or args.seq_lens:
            raise UsageError("--settings names the settings: leave out --quick, --models, --batches and --seq-lens")
        grid = []
        for text in args.settings:
            try:
                grid.append(Setting.parse(text))
            except (ValueError, TypeError) as exc:
                raise UsageError(f"--settings: {exc}") from None
            if grid[-1].model not in E2E_MODELS:
                raise UsageError(f"--settings {text}: unknown model {grid[-1].model}; choose from "
                                 f"{', '.join(E2E_MODELS)}")
    elif args.quick:
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
    n_gen = args.steps if args.generate_tokens is None else args.generate_tokens
    if args.generate_tokens is not None and not args.generate:
        raise UsageError("--generate-tokens sets the new tokens of each generate call: pass --generate with it")
    if args.generate:
        if n_gen < 1 or args.generate_reps < 1:
            raise UsageError(f"--generate-tokens and --generate-reps must be >= 1, got {n_gen} and "
                             f"{args.generate_reps}")
        short = [s.id for s in grid if s.S - n_gen - 1 < 2]
        if short:
            raise UsageError(f"--generate-tokens {n_gen} must leave a prompt of at least 2 tokens (S - N - 1): "
                             f"{', '.join(short)}")
    return {"grid": grid, "k_f": k_f, "d_f": d_f, "paths": tuple(args.paths or PATHS), "steps": args.steps,
            "gqa_select": args.gqa_select, "aggregate": aggregate, "sdpa_backend": args.sdpa_backend,
            "score_format": score_format, "key_prefix": args.key_prefix,
            "time_budget_s": args.time_budget,
            "generate": args.generate, "generate_tokens": n_gen if args.generate else None,
            "generate_reps": args.generate_reps, "generate_prompt": args.generate_prompt}


def target_rows(results: list[dict]) -> list[dict]:
    """The issue's targets against ``results``: Loki's best path over the faster dense path at the target
    settings, compiled Loki's time over its byte floor at every setting where it ran, and at every setting the
    speed-up as a fraction of its byte ceiling (forward-level; generate-level too where ``generate`` ran).  A
    speed-up target is not judged (``pass`` None, the note says why) where the dense baseline is not fair
    (:func:`unfair_dense`)."""
    by_id = {r["id"]: r for r in results}
    rows = []
    for setting, want in TARGETS:
        r = by_id.get(setting.id)
        got = None if r is None else r.get("speedup")
        budget = "" if setting.k is None else f" k={setting.k}"
        unfair = r is not None and unfair_dense(r)
        rows.append({"target": f"{setting.model} B={setting.B} S={setting.S}{budget}: Loki best / dense best >= "
                               f"{want}", "value": got, "pass": None if got is None or unfair else got >= want,
                     "note": "not run" if r is None else (unfair or ("" if got is not None else "a path is missing"))})
    for r in results:
        x = r.get("x_floor", {}).get("loki_compiled")
        if x is not None:
            rows.append({"target": f"{r['id']}: compiled Loki / byte floor <= {FLOOR_TARGET}", "value": x,
                         "pass": x <= FLOOR_TARGET, "note": ""})
    for r in results:
        for key, level in (("fraction_of_ceiling", "speed-up"), ("generate_fraction_of_ceiling", "generate speed-up")):
            x = r.get(key)
            if x is not None:
                unfair = unfair_dense(r)
                rows.append({"target": f"{r['id']}: {level} / byte ceiling ({_f(r.get('ceiling_speedup'))}x) >= "
                                       f"{CEILING_TARGET}", "value": x, "pass": None if unfair else x >= CEILING_TARGET,
                             "note": unfair})
    return rows


def unfair_dense(r: dict) -> str:
    """Why a setting's dense baseline cannot carry a speed-up target ("" when it can): its best path's time over its
    byte floor above :data:`DENSE_FLOOR_LIMIT` (compiled SDPA with grouped K/V runs within 1.1-1.3x of it; the
    repeat-kv call of ``--sdpa-backend default`` ran at 6.9x on an H200 at B=1 S=131072)."""
    best = r.get("best_dense")
    x = r.get("x_floor", {}).get(best) if best else None
    if x is None or x <= DENSE_FLOOR_LIMIT:
        return ""
    return f"not judged: dense at {x:.1f}x its byte floor is not a fair baseline"


def _cell(r: dict | None, key: str, fmt: str) -> str:
    if r is None:
        return "-"
    if key in r:
        return format(r[key], fmt)
    return "skip" if "skipped" in r else ("err" if "error" in r else "-")


def _gen_cell(r: dict | None) -> str:
    """generate ms per token, with ± half the range of the repetitions' own values where they were recorded."""
    cell = _cell(r, "generate_ms_per_token", ".2f")
    spread = (r or {}).get("generate_ms_per_token_spread")
    return cell if spread is None else f"{cell} ± {spread / 2:.2f}"


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _ceiling_table(doc: dict) -> list[str]:
    """The second table: per setting the budget, the byte ceiling and the fraction of it reached, and where they
    were measured the generate-level times and speed-up and each path's peak memory."""
    paths = doc["paths"]
    res = [r for r in doc["results"] if "skipped" not in r]
    gen = any("generate" in r for r in res)
    mem = any((r["paths"].get(p) or {}).get("peak_memory_gib") is not None for r in res for p in paths)
    head = "| setting | k | ceiling | speed-up | / ceiling | gain / ceiling gain |"
    if gen:
        head += " " + " | ".join(f"{SHORT[p]} gen ms/token" for p in paths) + " | gen speed-up | gen / ceiling |"
    if mem:
        head += " peak GiB (" + " / ".join(SHORT[p] for p in paths) + ") |"
    lines = ["", "## Byte ceiling, generate and memory", "",
             "ceiling = dense floor / Loki floor (bytes over bytes), the speed-up Loki would reach if both ran at "
             "their floors; / ceiling = speed-up / ceiling (the headline); gain / ceiling gain = (speed-up - 1) / "
             "(ceiling - 1)."
             + (" gen ms/token = whole greedy generate calls, (t(N+1 new tokens) - t(1)) / N (median of the timed "
                "calls, each length warmed once; ± half the range of the repetitions' own values, the host-side "
                "jitter of generate); gen speed-up = the faster Loki path over the faster dense path "
                "at that level." if gen else "")
             + (" peak GiB = torch.cuda.max_memory_allocated over the path's decode steps, weights included "
                "(generate's own peak in the JSON)." if mem else ""),
             "", head, "|---" * head.count(" | ") + "|---|"]
    for r in res:
        cells = [r["id"], str(r.get("k_f")), _f(r.get("ceiling_speedup")), _f(r.get("speedup")),
                 _f(r.get("fraction_of_ceiling")), _f(r.get("fraction_of_ceiling_gain"))]
        if gen:
            cells += [_gen_cell(r["paths"].get(p)) for p in paths]
            cells += [_f(r.get("generate_speedup")), _f(r.get("generate_fraction_of_ceiling"))]
        if mem:
            cells.append(" / ".join(_f((r["paths"].get(p) or {}).get("peak_memory_gib"), ".1f") for p in paths))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _selection(doc: dict) -> str:
    """Loki's GQA selection per model of the run, as the results record it (``gqa_select``, ``aggregate``)."""
    seen = {}
    for r in doc["results"]:
        if "gqa_select" in r:
            seen.setdefault(r["model"], (r["gqa_select"], r.get("aggregate", "sum")))
    if not seen:
        return "-"
    return "; ".join(f"{m} " + (f"one per KV group, aggregate {a}" if g == "kv" else "per query head")
                     for m, (g, a) in seen.items())


def _settled(doc: dict) -> bool:
    """Whether every timed path of the run started in the settled launch-gap state (``settle_launch_state``)."""
    runs = [r for res in doc["results"] for r in res.get("paths", {}).values()
            if isinstance(r, dict) and "ms_median" in r]
    return bool(runs) and all(r.get("launch_state_settled") for r in runs)


def write_markdown(doc: dict, path: str) -> str:
    paths = doc["paths"]
    compiled = [p for p in paths if p.endswith("_compiled")]
    lines = [
        f"# End-to-end decode benchmark ({doc['device']}, {doc['date']})",
        "",
        f"torch {doc['torch']}, transformers {doc['transformers']}, triton {doc.get('triton') or '-'}; {doc['dtype']}; "
        f"copy bandwidth {_f(doc.get('copy_gbps'), '.0f')} GB/s; SDPA backend {doc['sdpa_backend']} "
        f"(enabled: {', '.join(k for k, v in doc.get('sdpa_backends', {}).items() if v) or '-'}); Loki k_f = "
        f"{doc['k_f']} (a setting id ending in -k<k> carries its own budget), d_f = {doc['d_f']}, random orthogonal "
        f"basis; {doc['steps']} timed steps per path ending at cache length S. Loki's selection: {_selection(doc)}."
        + (f" Score copy: {doc['score_format']}." if doc.get("score_format", "native") != "native" else "")
        + (f" Note: {REPEAT_KV_NOTE}" if doc["sdpa_backend"] == "default" else "")
        + (" No key prefix (key_prefix=False): the scores read K in place." if doc.get("key_prefix") is False
           else "")
        + (" Each timing started after one small kernel on a second stream (the launch-gap state of any program "
           "with one; docs/benchmarks.md)." if _settled(doc) else ""),
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
    lines += _ceiling_table(doc)
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
    out = [f"{'setting':<28}" + "".join(f"{SHORT[p]:>14}" for p in paths)
           + f"{'speed-up':>10}{'x floor':>9}{'/ceiling':>9}{'gen x':>7}"]
    for r in doc["results"]:
        if "skipped" in r:
            out.append(f"{r['id']:<28}skipped: {r['skipped']}")
            continue
        out.append(f"{r['id']:<28}" + "".join(f"{_cell(r['paths'].get(p), 'tokens_per_s', '.0f'):>14}" for p in paths)
                   + f"{_f(r.get('speedup')):>10}{_f(r.get('x_floor', {}).get('loki_compiled')):>9}"
                   + f"{_f(r.get('fraction_of_ceiling')):>9}{_f(r.get('generate_speedup')):>7}")
    out.append("(tokens/s per path; /ceiling = speed-up over its byte ceiling; gen x = the generate-level speed-up)")
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
           "gqa_select": sel["gqa_select"], "aggregate": sel["aggregate"], "score_format": sel["score_format"],
           "key_prefix": sel["key_prefix"],
           "generate": {k: sel[k] for k in ("generate_tokens", "generate_reps", "generate_prompt")}
           if sel["generate"] else None,
           "grid": [s.id for s in sel["grid"]], "results": []}
    os.makedirs(args.out, exist_ok=True)
    dev = "h100" if "H100" in name else ("h200" if "H200" in name else "gpu")
    stem = os.path.join(args.out, args.tag or f"e2e-{dev}-{date}")
    print(f"# {name}: copy bandwidth {_f(copy_gbps, '.0f')} GB/s; {len(sel['grid'])} settings", flush=True)
    if sel["sdpa_backend"] == "default":
        print(f"# note: {REPEAT_KV_NOTE}", flush=True)

    def save(res):
        doc["results"].append(res)
        with open(stem + ".json", "w") as f:
            json.dump(doc, f, indent=1)

    run_grid(sel["grid"], device="cuda", dtype=dtype, paths=sel["paths"], steps=sel["steps"], k_f=sel["k_f"],
             d_f=sel["d_f"], gqa_select=sel["gqa_select"], aggregate=sel["aggregate"], sdpa_backend=sel["sdpa_backend"],
             copy_gbps=copy_gbps,
             time_budget_s=sel["time_budget_s"], on_setting=save, log=lambda m: print(m, flush=True),
             generate=sel["generate"], generate_tokens=sel["generate_tokens"], generate_reps=sel["generate_reps"],
             generate_prompt=sel["generate_prompt"], score_format=sel["score_format"], key_prefix=sel["key_prefix"])
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    write_markdown(doc, stem + ".md")
    write_plot(doc, stem + ".png")
    print(f"# wrote {stem}.json, .md, .png")
    print(short_table(doc))
    return 0
