"""``loki check``: the main accuracy job on the embedded default model (or a model folder).

1. load the model (the embedded SmolLM2-135M-Instruct is converted from its GGUF file once and cached) on
   ``--device`` in ``--dtype``;
2. calibrate the profile's bases (pre- and post-rotary PCA, the score-aware default) in one streaming pass, or
   reuse cached ones (:mod:`loki.evaluation.bases`);
3. run the profile's suite (:mod:`loki.evaluation.suite`): perplexity with decode-time semantics of every
   method at matched budgets, with paired 95% intervals, top-k agreement, Rank@90, retrieval, and, per profile,
   the paper's protocol, generalisation and downstream accuracy;
4. decide the gates on the intervals (:mod:`loki.evaluation.gates`) and write ``report.md``, ``results.json``
   (with ``provenance``: the commit, package versions and device, :func:`loki.provenance.provenance`) and the
   plots into ``--out``.  The exit status is 1 when a gate fails, when a part of the run left nothing to check (unless
   ``--allow-missing``), when a known miss of the targets (:mod:`loki.evaluation.targets`) is reported (unless
   ``--allow-known-misses``) or when no gate ran at all; 2 on a bad argument.

``--update-thresholds`` runs the suite on the evaluation text and the perplexity part on the other evaluation
texts (WikiText-2 and the held-out packaged Wikipedia and book passages), and records the profile's regression
limits so that they hold on each.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

from loki.evaluation.commands import unit_fraction
from loki.evaluation.gates import (
    DEFAULT_THRESHOLDS,
    EXIT_RULE,
    check_thresholds,
    evaluate_gates,
    load_thresholds,
    update_thresholds,
    verdict,
)
from loki.evaluation.suite import PROFILES, SuiteOptions, profile_options, run_suite
from loki.provenance import provenance
from loki.settings import LokiSettings

__all__ = ["add_arguments", "run"]

_TEXTS = ("wikitext", "wikipedia", "book")

#: The measured time of the check profile (stated in --help; the README quotes it).
CHECK_TIME = ("5.4 min for loki check; 7.0 min wall and 543 s of CPU for bash scripts/check.sh from a fresh clone, "
              "the install included (a 2-core CPU shared with other jobs, 2 torch threads)")


def _profiles_text() -> str:
    """The profiles in --help, one indented entry each."""
    import textwrap

    entries = [
        ("check", "(the default; for the CPU) 8 x 1024 WikiText-2 tokens, bases of 8,192 tokens covering those "
                  "positions, the default GQA mode only, retrieval at 512 tokens; --all-methods adds every setting "
                  f"per query head, H2O and SparQ. Measured: {CHECK_TIME}."),
        ("tests", "what CI gates: 4 x 512 tokens, bases of 4,096 tokens."),
        ("long", "(--long; for a GPU) windows of 1024/4096/8192 tokens, k_f 0.25/0.125/0.0625, every method in both "
                 "GQA modes, the paper's protocol, the fixed counts 512/1024/2048 at 8192 tokens, retrieval at 1k-8k "
                 "and the fast path's own accuracy; about 25 minutes on an H100, splittable with --k-counts none, "
                 "--no-retrieval, --no-fast-path and --retrieval-only."),
    ]
    return "Profiles:\n" + "\n".join(textwrap.fill(text, width=110, initial_indent=f"  {name:7s}",
                                                   subsequent_indent=" " * 9, break_on_hyphens=False)
                                     for name, text in entries)



def _log(msg: str) -> None:
    """A progress line on stderr, written through tqdm so that an active progress bar is redrawn below it."""
    from tqdm.auto import tqdm

    tqdm.write(f"[loki check] {msg}", file=sys.stderr)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` while the suite runs: one line through tqdm (no garbled progress bar)."""
    from tqdm.auto import tqdm

    tqdm.write(f"[loki check] warning: {category.__name__}: {message} ({Path(filename).name}:{lineno})",
               file=sys.stderr)


def _windows(text: str) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple(tuple(int(x) for x in w.lower().split("x")) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKENSxCOUNT[,...] such as 1024x8,4096x4, got {text!r}") from None
    if not out or any(len(w) != 2 or w[0] < 2 or w[1] < 1 for w in out):
        raise argparse.ArgumentTypeError(f"expected TOKENSxCOUNT[,...] with TOKENS >= 2 and COUNT >= 1, got {text!r}")
    return out


def _budget(text: str) -> int | float:
    """A budget: ``512`` is a count of tokens, ``0.25`` a fraction k_f in (0, 1] (as ``loki ppl --k``)."""
    from loki.evaluation.commands import fraction_or_count

    return fraction_or_count(text.strip())


def _counts(text: str) -> tuple[int, ...]:
    from loki.evaluation.commands import int_list

    if text.strip().lower() == "none":
        return ()
    return int_list(text, minimum=1, what="counts of tokens (or none)", example="512,1024")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from loki.evaluation.commands import add_device_arguments

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "The main accuracy job on the embedded SmolLM2-135M-Instruct (or --model): does Loki work on this model, at\n"
        "what cost, how fast. It calibrates the profile's bases (PCA post-rotary and the score-aware default;\n"
        "cached under $LOKI_CACHE or ~/.cache/loki), measures the perplexity increase over full attention of the\n"
        "default Loki configuration, the paper's PCA basis and exact top-k at the same budget with decode-time\n"
        "semantics (row i selects ceil(k_f (i+1)) of the i+1 tokens it sees), each with its paired 95% interval,\n"
        "top-k agreement, Rank@90 and the synthetic retrieval suite, and writes OUT/report.md (opening with a\n"
        "three-line verdict), OUT/results.json and PNG plots.\n\n"
        "The default Loki configuration (the row the targets and gates read): the score-aware basis, k_f = d_f =\n"
        "0.25, in the model's default GQA mode as enable_loki resolves it: on a GQA model such as the embedded\n"
        "SmolLM2 (9 query / 3 KV heads) one selection per KV group from softmax-normalised scores (rows [kv],\n"
        "aggregate softmax-max, the configuration the speed benchmarks time); per query head otherwise.\n\n"
        + _profiles_text() + "\n\n"
        + EXIT_RULE
    )
    parser.add_argument("--profile", default="check", choices=tuple(PROFILES), help="suite profile (default: check)")
    parser.add_argument("--long", action="store_true", help="the long-context profile (same as --profile long)")
    parser.add_argument("--out", default="loki-report",
                        help="report folder, created when missing; the report files in it are replaced "
                        "(default: %(default)s)")
    parser.add_argument("--model", default=None, help="a local transformers model folder (default: the embedded model)")
    add_device_arguments(parser)
    parser.add_argument("--k", type=_budget, default=None,
                        help="primary token budget: a fraction k_f (0.25, the default) or a count of tokens (512)")
    parser.add_argument("--k-counts", type=_counts, default=None,
                        help="fixed budgets in tokens measured beside the fractions at the longest window, N[,N...] "
                        "or none (default: the profile's; long: 512,1024,2048)")
    parser.add_argument("--retrieval-k", type=_budget, default=None,
                        help="budget of the retrieval suite: a fraction or a count of tokens (default: 0.125)")
    parser.add_argument("--d", "--dims", type=unit_fraction, default=None,
                        help="principal-dims fraction d_f (default: the score format's, 0.5 for the int8 copy, 0.25 "
                        "for a native one)")
    parser.add_argument("--score-format", default=None, choices=("native", "fp8", "int8", "int4"),
                        help="how every Loki row's approximate scores read the keys' d leading dims: int8 (the "
                        "default: an int8 copy with a 16-bit scale per token, at d_f 0.5), native (the cache's "
                        "elements; --d defaults to 0.25 then, the same bytes), fp8 or int4 (the PyTorch reference "
                        "only; int8 runs on the kernels too). A profile's regression limits apply to its own "
                        "settings only (the default ones)")
    parser.add_argument("--windows", type=_windows, default=None,
                        help="evaluation windows TOKENSxCOUNT[,...], the first is the primary one (default: the "
                        "profile's)")
    parser.add_argument("--eval-corpus", default="wikitext", choices=_TEXTS,
                        help="evaluation text (held-out half for the packaged passages; default: %(default)s)")
    parser.add_argument("--calib-tokens", type=int, default=None, help="calibration tokens (default: the profile's)")
    parser.add_argument("--thresholds", default=str(DEFAULT_THRESHOLDS),
                        help="thresholds file (default: the one shipped with the package)")
    parser.add_argument("--update-thresholds", action="store_true",
                        help="run the profile on the evaluation texts of --record-texts and record its regression "
                        "limits into --thresholds (the worst text plus a margin)")
    parser.add_argument("--record-texts", default=",".join(_TEXTS),
                        help="texts --update-thresholds measures (default: %(default)s); the others run the "
                        "perplexity part only, at the gated window length")
    parser.add_argument("--gqa-select", default="auto", choices=("auto", "query", "kv"),
                        help="the default configuration's GQA mode (default: auto = kv with softmax-max on a GQA "
                        "model, else query; query: per query head on any model)")
    parser.add_argument("--no-cache", action="store_true", help="recalibrate even if a cached basis exists")
    parser.add_argument("--no-retrieval", action="store_true", help="skip the synthetic retrieval suite")
    parser.add_argument("--no-fast-path", action="store_true",
                        help="skip the fast path's own accuracy (long profile: the primary windows decoded token by "
                        "token through the compiled static cache and the Triton kernels, fp32 and bf16, and the "
                        "retrieval suite answered through generate on that cache; CUDA only)")
    parser.add_argument("--retrieval-generate", action="store_true",
                        help="also answer the retrieval suite's samples with generate over the compiled Loki static "
                        "cache (Triton kernels) for the default basis' Loki settings, compare each answer with the "
                        "engine's (paired 95%% interval of the accuracy difference) and gate their agreement "
                        "(default in the long profile; CUDA only, skipped with a note elsewhere; e.g. with "
                        "--retrieval-only)")
    parser.add_argument("--retrieval-only", action="store_true",
                        help="run the synthetic retrieval suite only (with --update-thresholds: record its limits, "
                        "keeping the profile's perplexity limits)")
    parser.add_argument("--all-methods", action="store_true",
                        help="check profile: also every setting per query head, H2O (token by token) and SparQ, "
                        "beside the default GQA mode's rows (slower; the profile's regression limits still apply "
                        "to the rows it records)")
    parser.add_argument("--downstream", action="store_true",
                        help="also the downstream-accuracy gates (local lm-eval tasks COPA and ARC-Easy)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on machines with <= 2 cores, else torch's choice)")
    parser.add_argument("--allow-missing", action="store_true",
                        help="do not fail gates whose rows the run lacks (a part that left no rows, a gated setting "
                        "the run did not measure)")
    parser.add_argument("--allow-known-misses", action="store_true",
                        help="do not fail on targets listed as known misses of the profile (still reported; a run "
                        "significantly worse than the recorded miss still fails)")
    parser.add_argument("--no-progress", action="store_true",
                        help="hide progress bars (the project's and those of transformers while loading a model)")


def _options(args) -> SuiteOptions:
    profile = "long" if args.long else args.profile
    opts = profile_options(profile, use_cache=not args.no_cache, progress=not args.no_progress, log=_log,
                           eval_corpus=args.eval_corpus, gqa_select=args.gqa_select)
    if args.k is not None:
        opts = replace(opts, k=args.k, k_values=tuple(k for k in opts.k_values if k != args.k))
    if args.score_format is not None or args.d is not None:  # decided as enable_loki decides them
        s = LokiSettings(d="auto" if args.d is None else args.d, score_format=args.score_format or "auto",
                         backend="torch")
        opts = replace(opts, d=s.d, score_format=s.score_format.value)
    if args.k_counts is not None:
        opts = replace(opts, k_counts=args.k_counts)
    if args.retrieval_k is not None:
        opts = replace(opts, retrieval_k=args.retrieval_k)
    if args.windows is not None:
        opts = replace(opts, windows=args.windows)
    if args.calib_tokens is not None:
        opts = replace(opts, recipe=replace(opts.recipe, num_tokens=args.calib_tokens))
    if args.no_retrieval:
        opts = replace(opts, retrieval=None)
    if args.no_fast_path:
        opts = replace(opts, fast_path=False, retrieval_generate=False)
    if args.retrieval_generate:
        opts = replace(opts, retrieval_generate=True)
    if args.retrieval_only:
        opts = replace(opts, perplexity=False, rank=False, generalization=False, downstream=False)
    if args.downstream:
        opts = replace(opts, downstream=True)
    if args.all_methods:
        opts = replace(opts, all_methods=True)
    return opts


def _print_summary(results: dict, gates: list[dict], report: Path, summary: str, thresholds: dict) -> None:
    """The rows, the gates and, last, the verdict (the report's opening lines) on stdout."""
    from loki.evaluation.report import budget_cell, bytes_cell, verdict_lines

    print(f"{'setting':28s} {'T':>5s} {'k':>8s} {'ppl':>9s} {'vs full':>9s} {'95% interval':>20s} {'bytes':>6s}")
    for r in results["perplexity"]:
        if r["method"] == "full":
            print(f"{'full':28s} {r['seq_len']:5d} {'':8s} {r['ppl']:9.3f}")
            continue
        print(f"{r['name']:28s} {r['seq_len']:5d} {budget_cell(r['k']):>8s} {r['ppl']:9.3f} "
              f"{100 * r['increase']:+8.2f}% [{100 * r['increase_lo']:+7.2f}, {100 * r['increase_hi']:+7.2f}] "
              f"{bytes_cell(r):>6s}")
    for name, a in results.get("agreement", {}).items():
        print(f"agreement {name:8s} jaccard {a['jaccard_mean']:.4f}  mass {a['mass_mean']:.4f} "
              f"(exact top-k {a['mass_exact_mean']:.4f})")
    for g in gates:
        bound = g.get("bound_text", g.get("bound"))
        note = f" {g['note']}" if g.get("note") else ""
        known = f" [known miss: {g['known']}]" if g.get("known") else ""
        status = "PASS" if g["passed"] else ("KNOWN" if g.get("known") else "FAIL")
        print(f"[{status}] {g['name']}: {g.get('value')} ({bound}){note}{known}")
    print(f"report: {report} ({results['seconds']:.0f} s); {summary}")
    for line in verdict_lines(results, thresholds):
        print(line.replace("**", "").replace("`", ""))


def run(args: argparse.Namespace) -> int:
    from loki.evaluation.commands import (
        UsageError,
        check_fits_context,
        check_model_folder,
        check_output_file,
        check_output_folder,
        fail,
        quiet_progress,
        set_threads,
    )
    from loki.evaluation.models import resolve_device

    out = Path(args.out)
    err = check_output_folder(out, "--out")  # a folder that cannot be written must not cost the whole run
    if err:
        return fail(err)
    if args.retrieval_only and args.no_retrieval:
        return fail("--retrieval-only and --no-retrieval exclude each other")
    if args.retrieval_generate and (args.no_retrieval or args.no_fast_path):
        return fail("--retrieval-generate needs the retrieval suite and the fast path: it excludes --no-retrieval "
                    "and --no-fast-path")
    if args.calib_tokens is not None and args.calib_tokens < 1:
        return fail(f"--calib-tokens must be >= 1, got {args.calib_tokens}")
    if args.threads is not None and args.threads < 1:
        return fail(f"--threads must be >= 1, got {args.threads}")
    try:
        # every gate of the profile must be in the file (a recording run writes the profile's limits)
        profile = None if args.update_thresholds else "long" if args.long else args.profile
        thresholds = load_thresholds(args.thresholds, profile=profile)
    except FileNotFoundError as exc:
        if not args.update_thresholds:
            return fail(f"--thresholds: {exc}")
        thresholds = {}
    except ValueError as exc:
        return fail(f"--thresholds {args.thresholds}: {exc}")
    profile = "long" if args.long else args.profile
    # the gates fail closed: a file that lacks the targets or the profile's limits is refused, never gates less
    problem = check_thresholds(thresholds, None if args.update_thresholds else profile)
    if problem:
        return fail(f"--thresholds {args.thresholds}: {problem}")
    texts = [t.strip() for t in args.record_texts.split(",") if t.strip()]
    if args.update_thresholds:  # the recorded limits are the run's result: their file is checked first too
        if any(t not in _TEXTS for t in texts) or not texts:
            return fail(f"--record-texts must name some of {', '.join(_TEXTS)}, got {args.record_texts!r}")
        err = check_output_file(args.thresholds, "--thresholds")
        if err:
            return fail(err)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        return fail(f"--device: {exc}")
    err = check_model_folder(args.model)
    if err:
        return fail(err)
    opts = _options(args)
    if args.windows is not None:  # windows past the model's context are refused before it loads
        try:
            check_fits_context(args, max(w[0] for w in opts.windows),
                               "--windows " + ",".join(f"{t}x{n}" for t, n in opts.windows))
        except UsageError as exc:
            return fail(str(exc))
    set_threads(args.threads)
    quiet_progress(not args.no_progress)
    t0 = time.perf_counter()
    show_warning, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        return _run(args, opts, out, device, texts, thresholds, t0)
    finally:
        warnings.showwarning = show_warning


def _run(args, opts: SuiteOptions, out: Path, device, texts: list[str], thresholds: dict, t0: float) -> int:
    from loki.evaluation.models import load_default_model, load_model
    from loki.evaluation.report import write_report

    _log(f"loading the model on {device} ({args.dtype}); profile {opts.profile!r}")
    kw = dict(device=device, dtype=args.dtype)
    model, tokenizer = load_model(args.model, **kw) if args.model else load_default_model(progress=_log, **kw)
    if args.update_thresholds:
        long_len = max(w[0] for w in opts.windows) if opts.profile == "long" else None
        runs = {args.eval_corpus: run_suite(model, tokenizer, opts, out_dir=out)}
        for text in texts if opts.perplexity else ():
            if text != args.eval_corpus:
                _log(f"recording thresholds: evaluation text {text} (perplexity only)")
                gated = tuple(w for w in opts.windows if w[0] == (long_len or opts.windows[0][0]))
                runs[text] = run_suite(model, tokenizer, replace(
                    opts, eval_corpus=text, windows=gated, agreement=False, rank=False, retrieval=None,
                    generalization=False, paper_protocol=False, downstream=False, fast_path=False))
        update_thresholds(runs, args.thresholds, opts.profile, long_length=long_len)
        thresholds = load_thresholds(args.thresholds)
        _log(f"thresholds of profile {opts.profile!r} written to {args.thresholds}")
        results = runs[args.eval_corpus]
    else:
        results = run_suite(model, tokenizer, opts, out_dir=out)
    gates = evaluate_gates(results, thresholds, opts.profile, allow_missing=args.allow_missing)
    ok, summary = verdict(gates, allow_known_misses=args.allow_known_misses)
    results["gates"] = gates
    results["exit"] = {"status": 0 if ok else 1, "summary": summary, "allow_known_misses": args.allow_known_misses,
                       "allow_missing": args.allow_missing}
    results["seconds"] = time.perf_counter() - t0
    results["provenance"] = provenance(getattr(model, "device", device))
    files = write_report(results, out, thresholds=thresholds)
    _print_summary(results, gates, files["markdown"], summary, thresholds)
    return 0 if ok else 1

