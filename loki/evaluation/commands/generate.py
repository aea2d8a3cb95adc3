"""``loki generate``: a demo, prompt -> text with Loki attention enabled, with the decode speed."""

from __future__ import annotations

import argparse
import time

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
    load_tokenizer_and_config,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Generate text with Loki attention (dense prefill, sparse decode steps over the KV cache stored in the "
        "PCA basis) and print tokens/s. --method dense gives the baseline."
    )
    parser.add_argument("prompt", nargs="?", default="The history of the city begins",
                        help="the prompt (default: %(default)r)")
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help="tokens to generate (default: %(default)s)")
    parser.add_argument("--method", default="loki", choices=("loki", "exact_topk", "dense", "sparq", "h2o", "pcaattn"),
                        help="attention of the decode steps; dense is the baseline (default: %(default)s)")
    parser.add_argument("--k", type=fraction_or_count, default=0.5,
                        help="token budget (default: %(default)s; at k=d=0.25 this 135M model's text degenerates "
                        "on short prompts, see docs/accuracy.md)")
    add_score_arguments(parser, "principal dims")
    parser.add_argument("--basis", default=None,
                        help="basis file; default: the cached/calibrated default (score-aware) basis")
    parser.add_argument("--gqa-select", default="auto", choices=("auto", "query", "kv"),
                        help="GQA selection of the decode steps: auto (default: for --method loki on a GQA model "
                        "such as the embedded SmolLM2, 9 query / 3 KV heads, one selection per KV group with each "
                        "head's scores softmax-normalised before the group's maximum, as enable_loki; otherwise per "
                        "query head), query (each query head selects its own tokens) or kv (one per KV group)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    # every argument, the basis file and the prompt's length are checked before the model loads
    if args.max_new_tokens < 1:
        return fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        return fail("prompt: the prompt is empty; give some text to continue")
    err = check_model_folder(args.model)
    if err:
        return fail(err)
    basis = load_basis_arg(args.basis) if args.basis else None  # format and values
    check_fits_context(args, args.max_new_tokens, f"--max-new-tokens {args.max_new_tokens}")
    wants_basis = args.method in ("loki", "pcaattn")
    if wants_basis and basis is None:
        from loki.evaluation.bases import DEFAULT_RECIPE

        check_corpus(DEFAULT_RECIPE.corpus, "the default basis' calibration corpus")
    tokenizer, config = load_tokenizer_and_config(args, log=print)
    prompt = args.prompt
    if args.chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt")
    n_prompt = int(ids["input_ids"].shape[1])
    if n_prompt == 0:
        return fail(f"prompt: {args.prompt!r} gives no tokens")
    check_fits_context(args, n_prompt + args.max_new_tokens,
                       f"prompt ({n_prompt} tokens) + --max-new-tokens {args.max_new_tokens}")
    import torch

    from loki.integrations.transformers import disable_loki, enable_loki, state_of

    check_basis_for(basis, config, "--basis", args.basis)
    model, tokenizer = load_model_from_args(args)
    if wants_basis and basis is None:
        from loki.evaluation.bases import DEFAULT_RECIPE, get_bases

        basis = get_bases(model, tokenizer, ("score",), DEFAULT_RECIPE, progress=not args.no_progress,
                          log=print)["score"]
    try:
        enable_loki(model, basis, k=args.k, d=args.d, method=args.method, gqa_select=args.gqa_select,
                    score_format=args.score_format)
        args.d = state_of(model).settings.requested.d  # "auto" as enable_loki decided it
    except (ValueError, TypeError) as exc:  # e.g. a count --d larger than the model's head dim
        return fail(str(exc))
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        dt = time.perf_counter() - t0
    finally:
        disable_loki(model)
    new = out[0, ids["input_ids"].shape[1]:]
    print(prompt + tokenizer.decode(new, skip_special_tokens=True))
    print(f"\n[{args.method} k={args.k} d={args.d}] {new.numel()} tokens in {dt:.2f} s "
          f"({new.numel() / dt:.1f} tokens/s, prompt {ids['input_ids'].shape[1]} tokens)")
    return 0
