"""``loki compare``: the field's decode-time sparse-attention methods at matched bytes per decode step, with
perplexity intervals, top-k recall and attention-mass diagnostics, a report and a plot
(:mod:`loki.evaluation.compare`)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from . import (
    add_model_arguments,
    check_input_file,
    check_output_folder,
    fail,
    int_list,
    load_model_from_args,
    positive_int,
    unit_fraction,
)

#: loki.evaluation.compare.COMPARE_METHODS / DEFAULT_METHODS, written out so that --help imports no torch
_METHODS = ("loki", "loki[native]", "loki[query]", "loki-pca[query]", "loki-pca[kv]", "exact_topk[query]",
            "exact_topk[kv]", "sparq", "quest", "quest[kv]", "double_sparsity", "double_sparsity[kv]", "h2o", "pcaattn",
            "loki[fp8]", "loki[int4]")
_DEFAULT_METHODS = ("loki", "loki[native]", "loki[query]", "loki-pca[query]", "exact_topk[query]", "exact_topk[kv]",
                    "sparq", "quest", "double_sparsity", "h2o")
#: suite.PROFILES["long"].windows
_LONG_WINDOWS = ((8192, 2), (4096, 4), (1024, 8))


def _windows(text: str) -> tuple[int, int]:
    t = text.strip().lower()
    try:
        tokens, count = (int(x) for x in t.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKENSxCOUNT such as 1024x8, got {text!r}") from None
    if tokens < 2 or count < 1:
        raise argparse.ArgumentTypeError(f"expected TOKENSxCOUNT with TOKENS >= 2 and COUNT >= 1, got {text!r}")
    return tokens, count


def _lengths(text: str) -> tuple[int, ...]:
    return int_list(text, minimum=128, what="context lengths (tokens)", example="8192")


def _method_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in _METHODS and n != "full"]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(bad) or '(none)'}; choose from "
                                         f"{', '.join(_METHODS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Compare the decode-time sparse-attention methods at matched bytes per decode step: Loki's default "
        "(score-aware basis, shared softmax-max selection) and the same with an int8 score copy of twice the dims, "
        "Loki per query head and with the paper's PCA, exact top-k per head and shared (oracles), SparQ, Quest, "
        "Double Sparsity and H2O. Each method's budget k_f is chosen so "
        "that it reads the bytes of the default at --k/--d (0.375 of dense at 0.25/0.25), measured on a probe "
        "window. Reports the perplexity increase over full attention with its paired 95%% interval, the bytes read, "
        "the recall of the exact top-k set and the attention mass captured (per layer and head in the JSON), and "
        "plots accuracy against bytes; with --retrieval also the retrieval suite's accuracy per method at its "
        "matched budget. Writes OUT/compare.md, OUT/compare.json, OUT/compare.png."
    )
    parser.add_argument("--windows", type=_windows, nargs="+", default=None, metavar="TOKENSxCOUNT",
                        help="evaluation window sets, e.g. 256x2 or 8192x2 1024x8 (default: the long profile's "
                        "8192x2 4096x4 1024x8, meant for a GPU)")
    parser.add_argument("--methods", type=_method_list, default=_DEFAULT_METHODS, metavar="A,B,...",
                        help="comma-separated methods (full attention is always measured); default: "
                        f"{','.join(_DEFAULT_METHODS)}; also: loki-pca[kv], quest[kv], double_sparsity[kv], pcaattn, "
                        "and the default with its score copy in other formats at the same bytes: loki[fp8] (2d dims), "
                        "loki[int4] (4d dims); loki (the default) and loki[query] read an int8 copy of 2d dims, "
                        "loki[native] the keys' own d dims")
    parser.add_argument("--k", type=unit_fraction, default=0.25,
                        help="the default configuration's budget fraction k_f, which sets the target bytes; also the "
                        "oracles' budget (default: %(default)s)")
    parser.add_argument("--d", type=unit_fraction, default=0.25,
                        help="the dims of a native score copy (Loki's d_f with loki[native]; an int8 copy holds 2d "
                        "dims in its bytes), and SparQ's and Double Sparsity's r as a fraction of D "
                        "(default: %(default)s)")
    parser.add_argument("--bytes", type=unit_fraction, default=None, dest="target_bytes",
                        help="the target bytes per decode step as a fraction of dense (default: the default "
                        "configuration's at --k/--d, measured)")
    parser.add_argument("--corpus", default="wikitext", choices=("wikitext", "wikipedia", "book"),
                        help="evaluation text, its held-out part (default: %(default)s)")
    parser.add_argument("--text-file", default=None, help="evaluate on this text file instead of --corpus")
    parser.add_argument("--calib-corpus", default="wikipedia", choices=("wikipedia", "book", "wikitext"),
                        help="calibration text of the bases, its calibration part (default: %(default)s)")
    parser.add_argument("--calib-tokens", type=positive_int, default=None,
                        help="calibration tokens (default: the evaluation's recipe, 32768)")
    parser.add_argument("--calib-positions", type=positive_int, default=None,
                        help="positions the bases cover, [0, N), at least the longest window (default: the longest "
                        "window; at 8192 tokens that is the default recipe, the model's whole context)")
    parser.add_argument("--probe-windows", type=positive_int, default=1,
                        help="windows of each set the budgets are matched on (default: %(default)s)")
    parser.add_argument("--probe-rows", type=positive_int, default=1024,
                        help="query rows per probe window, evenly spaced (default: %(default)s; all rows of shorter "
                        "windows)")
    parser.add_argument("--h2o-max-len", type=positive_int, default=1024,
                        help="H2O decodes token by token: it runs on windows up to this length (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=2, help="windows per forward (default: 2)")
    parser.add_argument("--retrieval", type=_lengths, default=None, metavar="N[,N...]",
                        help="also run the synthetic retrieval suite (passkey, needles, variable tracking) at these "
                        "context lengths, every method at the budget matched on the window set nearest in length, "
                        "with accuracy intervals and paired differences against exact top-k and the default (e.g. "
                        "8192; default: off)")
    parser.add_argument("--retrieval-samples", type=positive_int, default=32,
                        help="retrieval samples per task and length (default: %(default)s)")
    parser.add_argument("--retrieval-batch", type=positive_int, default=None,
                        help="retrieval samples decoded together (default: all of a task's samples, at most 32)")
    parser.add_argument("--out", default="loki-compare",
                        help="output folder, created when missing; compare.md/.json/.png in it are replaced "
                        "(default: %(default)s)")
    parser.add_argument("--no-cache", action="store_true", help="recalibrate the bases instead of reusing the cache")
    add_model_arguments(parser)


_NUMBER_LIST = re.compile(r"\[(?:\s*(?:-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|null|true|false)\s*,?)+\s*\]")


def _dumps(results: dict) -> str:
    """JSON with one level of indentation per object, lists of numbers on one line (the per-head diagnostics)."""
    return _NUMBER_LIST.sub(lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "),
                            json.dumps(results, indent=1)) + "\n"


def run(args: argparse.Namespace) -> int:
    err = check_output_folder(args.out, "--out") or check_input_file(args.text_file, "--text-file")
    if err:
        return fail(err)
    windows = tuple(args.windows) if args.windows else _LONG_WINDOWS
    longest = max(t for t, _ in windows + tuple((L, 1) for L in args.retrieval or ()))  # the bases cover them all
    if args.calib_positions is not None and args.calib_positions < longest:
        return fail(f"--calib-positions {args.calib_positions} is below the longest window or retrieval context "
                    f"({longest} tokens): the bases must cover every position evaluated")
    from dataclasses import replace

    from loki._io import atomic_write
    from loki.evaluation.bases import DEFAULT_RECIPE
    from loki.evaluation.compare import CompareOptions, default_log, run_compare
    from loki.evaluation.compare_report import compare_markdown, write_compare_plot

    recipe = replace(DEFAULT_RECIPE, corpus=args.calib_corpus)
    if args.calib_tokens is not None:
        recipe = replace(recipe, num_tokens=args.calib_tokens)
    recipe = replace(recipe, max_positions=args.calib_positions or longest)
    retrieval = None
    if args.retrieval:
        retrieval = {"context_lens": tuple(args.retrieval), "samples": args.retrieval_samples,
                     "batch_size": args.retrieval_batch or min(args.retrieval_samples, 32)}
    model, tokenizer = load_model_from_args(args)
    opts = CompareOptions(windows=windows, methods=args.methods, k=args.k, d=args.d, target_bytes=args.target_bytes,
                          probe_windows=args.probe_windows, probe_rows=args.probe_rows, h2o_max_len=args.h2o_max_len,
                          corpus=args.corpus,
                          text_file=args.text_file, recipe=recipe, batch_size=args.batch_size, retrieval=retrieval,
                          use_cache=not args.no_cache, progress=not args.no_progress, log=default_log)
    try:
        results = run_compare(model, tokenizer, opts)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "compare.json", _dumps(results))
    md = compare_markdown(results)
    plot = write_compare_plot(results, out / "compare.png")
    if plot is not None:
        md += f"\n![accuracy against bytes]({plot.name})\n"
    atomic_write(out / "compare.md", md)
    print(md)
    print(f"wrote {out / 'compare.md'}, {out / 'compare.json'}" + (f", {plot}" if plot else ""), file=sys.stderr)
    return 0
