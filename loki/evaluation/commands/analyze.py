"""``loki analyze``: Rank@v of keys per layer and head, with plots, from basis files or by calibrating."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from loki._io import atomic_write

from . import (
    add_model_arguments,
    check_corpus,
    check_fits_context,
    check_model_folder,
    check_output_folder,
    fail,
    load_basis_arg,
    load_model_from_args,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Rank@v analysis (the fewest principal components holding v%% of the keys' variance) per layer and KV "
        "head. Give one or more basis files (--basis NAME=PATH or PATH), or none to calibrate pre- and "
        "post-rotary bases of the model first. Writes rank_summary.json and PNG plots (Rank@v per layer, a "
        "layer x head heatmap, explained-variance curves) into --out."
    )
    parser.add_argument("--basis", action="append", default=[], metavar="[NAME=]PATH",
                        help="a basis file (repeatable); NAME defaults to its rotary kind")
    add_model_arguments(parser)
    parser.add_argument("--corpus", default="wikipedia", choices=("wikipedia", "book", "wikitext"),
                        help="calibration corpus when no --basis is given (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="calibration sequence length; sequences are spread over the model's context "
                        "(default: %(default)s)")
    parser.add_argument("--v", type=float, action="append", default=None,
                        help="variance percentage(s) for Rank@v (default: 90 and 95)")
    parser.add_argument("--out", default="loki-analysis",
                        help="output folder, created when missing; rank_summary.json and the plots in it are "
                        "replaced (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    vs = tuple(args.v or (90.0, 95.0))
    for v in vs:
        if not 0 < v <= 100:
            return fail(f"--v must be a percentage in (0, 100], got {v}")
    err = check_output_folder(args.out, "--out")  # before any calibration: a bad folder must not cost it
    if err:
        return fail(err)
    bases = {}
    for item in args.basis:
        name, _, path = item.rpartition("=")
        b = load_basis_arg(path, "--basis")
        key = name or (b.rotary if b.rotary not in bases else Path(path).stem)
        bases[key] = b
    if not bases:
        from loki.evaluation.bases import DEFAULT_RECIPE, get_bases

        if args.tokens < 1 or args.seq_len < 2:
            return fail("--tokens must be >= 1 and --seq-len >= 2")
        err = check_model_folder(args.model)
        if err:
            return fail(err)
        check_fits_context(args, args.seq_len, f"--seq-len {args.seq_len}")
        check_corpus(args.corpus, "--corpus")
        model, tokenizer = load_model_from_args(args)
        recipe = replace(DEFAULT_RECIPE, corpus=args.corpus, num_tokens=args.tokens, seq_len=args.seq_len)
        bases = get_bases(model, tokenizer, ("pre", "post"), recipe, progress=not args.no_progress, log=print)
    from loki.evaluation.rank import rank_summary, write_rank_plots

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = rank_summary(bases, vs)
    atomic_write(out / "rank_summary.json", json.dumps(summary, indent=2))
    plots = write_rank_plots(bases, out, vs[0])
    for name, s in summary.items():
        line = ", ".join(f"Rank@{v:g} {s[f'v{v:g}']['mean']:.1f}" for v in vs)
        print(f"{name}: {line} (of D={s['D']})")
    print(f"wrote {out / 'rank_summary.json'} and {', '.join(plots.values())} in {out}")
    return 0
