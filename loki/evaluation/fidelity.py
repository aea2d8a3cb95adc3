"""The fidelity study: which basis, budget split and GQA mode select the right tokens at a fixed byte budget.

Every option is measured against the paper-faithful Loki (PCA of post-rotary keys, per-query-head selection,
k_f = d_f = 0.25) on the same text with decode-time semantics: WikiText-2 perplexity and the Jaccard index /
attention mass of the selection against exact top-k at the same k.  Budgets are matched in bytes per decode
step, ``d_f / 2 + k_f`` of dense attention (0.375 for the paper's 0.25 / 0.25).

``loki fidelity`` writes ``fidelity.md`` and ``fidelity.json``; docs/fidelity.md records a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Option", "default_options", "run_study", "add_arguments", "run"]


@dataclass(frozen=True)
class Option:
    """One setting of the study: ``method`` "loki" (with ``basis``) or "exact_topk"."""

    name: str
    method: str
    k: float
    d: float = 1.0
    basis: str | None = None
    gqa_select: str = "query"
    aggregate: str = "sum"

    @property
    def cost(self) -> float:
        """Bytes read per decode step as a fraction of dense attention (keys and values once)."""
        return self.k + (self.d / 2 if self.method == "loki" else 0.5)


def default_options() -> list[Option]:
    o = [Option("paper-faithful: PCA post, query", "loki", 0.25, 0.25, "post")]
    o += [Option("PCA pre, query", "loki", 0.25, 0.25, "pre")]
    o += [Option("PCA post, kv (sum)", "loki", 0.25, 0.25, "post", "kv")]
    o += [Option("score-aware, query", "loki", 0.25, 0.25, "score")]
    o += [Option("score-aware, kv (sum)", "loki", 0.25, 0.25, "score", "kv", "sum")]
    o += [Option("score-aware, kv (max)", "loki", 0.25, 0.25, "score", "kv", "max")]
    for d, k in ((0.125, 0.3125), (0.375, 0.1875), (0.5, 0.125)):
        o.append(Option(f"score-aware, query, d_f={d:g} k_f={k:g}", "loki", k, d, "score"))
    o.append(Option("PCA post, query, d_f=0.5 k_f=0.125", "loki", 0.125, 0.5, "post"))
    o += [Option(f"exact top-k, query, k_f={k:g} (oracle)", "exact_topk", k) for k in (0.25, 0.3125, 0.125)]
    return o


def run_study(model, tokenizer, *, calib_tokens: int = 8192, calib_seq_len: int = 1024, windows: int = 8,
              seq_len: int = 1024, options: list[Option] | None = None, progress: bool = True, log=None) -> dict:
    """The study on ``windows`` x ``seq_len`` WikiText-2 tokens (evaluation half) with bases calibrated on
    ``calib_tokens`` packaged Wikipedia tokens in sequences of ``calib_seq_len`` covering the evaluated
    positions."""
    from tqdm.auto import tqdm

    from loki.evaluation.agreement import topk_agreement
    from loki.evaluation.bases import CalibrationRecipe, get_bases
    from loki.evaluation.data import load_corpus, token_windows
    from loki.evaluation.perplexity import MethodSpec, perplexity

    log = log or (lambda m: None)
    recipe = CalibrationRecipe(num_tokens=calib_tokens, seq_len=min(calib_seq_len, seq_len), max_positions=seq_len)
    bases = get_bases(model, tokenizer, ("pre", "post", "score"), recipe, progress=progress, log=log)
    wt = load_corpus("wikitext", part="eval")
    ev = token_windows(tokenizer, wt, seq_len, windows)
    full = perplexity(model, ev, MethodSpec("full", "full")).ppl
    rows = []
    for opt in tqdm(options or default_options(), desc="fidelity study", unit="option", disable=not progress):
        spec = MethodSpec(opt.name, opt.method, k=opt.k, d=opt.d, basis=opt.basis, gqa_select=opt.gqa_select,
                          aggregate=opt.aggregate)
        t0 = time.perf_counter()
        ppl = perplexity(model, ev, spec, bases).ppl
        row = {**asdict(opt), "cost": opt.cost, "ppl": ppl, "ppl_rel": ppl / full - 1}
        if opt.method == "loki":
            a = topk_agreement(model, ev, {opt.basis: bases[opt.basis]}, k_f=opt.k, d=opt.d,
                               gqa_select=opt.gqa_select, aggregate=opt.aggregate, progress=False)[opt.basis]
            row.update(jaccard=a["jaccard_mean"], mass=a["mass_mean"], mass_exact=a["mass_exact_mean"])
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    return {"full_ppl": full, "eval_origin": wt.origin, "windows": [windows, seq_len],
            "calibration": {"corpus": bases["post"].corpus, "tokens": calib_tokens, "seq_len": calib_seq_len},
            "rows": rows}


def to_markdown(study: dict) -> str:
    lines = [
        f"Full attention perplexity: {study['full_ppl']:.3f} ({study['eval_origin']}, "
        f"{study['windows'][0]} x {study['windows'][1]} tokens, decode-time semantics).",
        "",
        "| option | k_f | d_f | bytes vs dense | perplexity | vs full | Jaccard vs exact top-k | attention mass "
        "(exact top-k's) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in study["rows"]:
        jac = f"{r['jaccard']:.3f}" if "jaccard" in r else "1 (oracle)"
        mass = f"{r['mass']:.3f} ({r['mass_exact']:.3f})" if "mass" in r else "-"
        d = f"{r['d']:g}" if r["method"] == "loki" else "-"
        lines.append(f"| {r['name']} | {r['k']:g} | {d} | {r['cost']:.3f} | {r['ppl']:.3f} | "
                     f"{r['ppl_rel']:+.1%} | {jac} | {mass} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Fidelity study on the embedded model: the paper-faithful Loki against score-aware bases, budget splits "
        "at equal bytes and GQA selection modes; perplexity (WikiText-2, decode-time semantics) and Jaccard / "
        "attention mass against exact top-k. Writes OUT/fidelity.md and OUT/fidelity.json."
    )
    from loki.evaluation.commands import add_device_arguments, positive_int, window_spec

    parser.add_argument("--out", default="loki-report",
                        help="output folder, created when missing; fidelity.md and fidelity.json in it are replaced "
                        "(default: %(default)s)")
    parser.add_argument("--calib-tokens", type=positive_int, default=8192,
                        help="calibration tokens (default: %(default)s)")
    parser.add_argument("--windows", type=window_spec, default=(1024, 8), metavar="TOKENSxCOUNT",
                        help="WikiText-2 evaluation windows, e.g. 1024x8: 8 windows of 1024 tokens (as in loki "
                        "check; default: 1024x8). A bare COUNT is the deprecated spelling (COUNT windows of "
                        "--seq-len tokens)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="deprecated: tokens per window for a bare --windows COUNT (default 1024)")
    add_device_arguments(parser)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: 1 on machines with <= 2 cores, else torch's choice)")
    parser.add_argument("--no-progress", action="store_true",
                        help="hide progress bars (the project's and those of transformers)")


def run(args: argparse.Namespace) -> int:
    from loki._io import atomic_write
    from loki.evaluation.commands import (
        UsageError,
        check_fits_context,
        check_output_folder,
        fail,
        quiet_progress,
        resolve_windows,
        set_threads,
    )
    from loki.evaluation.models import load_default_model

    seq_len, windows = resolve_windows(args)
    try:  # windows past the model's context are refused before it loads
        check_fits_context(args, seq_len, f"--windows {seq_len}x{windows}")
    except UsageError as exc:
        return fail(str(exc))
    err = check_output_folder(args.out, "--out")  # before the study: a bad folder must not cost it
    if err:
        return fail(err)
    set_threads(getattr(args, "threads", None))
    progress = not getattr(args, "no_progress", False)
    quiet_progress(progress)
    model, tok = load_default_model(device=args.device, dtype=args.dtype)
    study = run_study(model, tok, calib_tokens=args.calib_tokens, windows=windows, seq_len=seq_len,
                      progress=progress, log=lambda m: print(f"[loki fidelity] {m}", file=sys.stderr))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "fidelity.json", json.dumps(study, indent=2) + "\n")
    md = to_markdown(study)
    atomic_write(out / "fidelity.md", md)
    print(md)
    return 0
