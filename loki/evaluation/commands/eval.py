"""``loki eval``: evaluate the Loki model (:class:`loki.integrations.lm_eval.LokiLM`) on the local, offline lm-eval
tasks and print (and optionally save) the metrics.  Needs lm-eval (the ``eval`` extra)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate

from loki.evaluation.commands import set_threads
from loki.integrations.lm_eval import TASKS, LokiLM, task_manager

__all__ = ["add_arguments", "run"]


def _count_or_fraction(text: str) -> int | float:
    """'64' -> 64 (a count); '0.25' or '1.0' -> a fraction."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int count or a float fraction, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``loki eval``."""
    parser.add_argument("--model", default=None,
                        help="local transformers model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--basis", default=None, help="PCA basis file (required for --method loki / pcaattn)")
    parser.add_argument("--k", type=_count_or_fraction, default=0.25,
                        help="tokens attended: an int count or a float fraction of each sequence (default 0.25)")
    parser.add_argument("--d", "--dims", type=_count_or_fraction, default=0.25,
                        help="principal dims for approximate scores: int count or fraction of D (default 0.25)")
    parser.add_argument("--method", default="loki", choices=("loki", "exact_topk", "pcaattn", "dense", "sparq", "h2o"))
    parser.add_argument("--gqa-select", default="query", choices=("query", "kv"))
    parser.add_argument("--semantics", default="decode", choices=("decode", "generate"),
                        help="decode (default): every query row sparse, so loglikelihoods measure the method; "
                        "generate: dense prefill")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--tasks", default="loki_arc_easy",
                        help=f"comma-separated lm-eval task names, e.g. {','.join(TASKS)},loki_mmlu")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (an int count, or a fraction < 1)")
    parser.add_argument("--num-fewshot", type=int, default=0,
                        help="few-shot examples per prompt, always explicit (default 0)")
    parser.add_argument("--batch-size", default="1")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="model dtype, e.g. float32, bfloat16 (default float32 on CPU)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 on machines with <= 2 cores, where two threads sharing "
                        "the cores with anything else run many times slower)")
    parser.add_argument("--output", default=None, help="write the results (metrics and settings) to this JSON file")


def run(args: argparse.Namespace) -> int:
    """``loki eval``: evaluate the Loki model on local lm-eval tasks and print (and optionally save) the metrics."""
    set_threads(getattr(args, "threads", None))
    limit = args.limit
    if limit is not None and float(limit).is_integer() and limit >= 1:
        limit = int(limit)
    model_args: dict[str, Any] = dict(
        basis=args.basis, k=args.k, d=args.d, method=args.method, gqa_select=args.gqa_select,
        semantics=args.semantics, backend=args.backend, batch_size=args.batch_size,
    )
    if args.model is not None:
        model_args["pretrained"] = args.model
    if args.device is not None:
        model_args["device"] = args.device
    if args.dtype is not None:
        model_args["dtype"] = args.dtype
    lm = LokiLM(**model_args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    results = simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=limit, task_manager=task_manager(),
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
            "settings": {"k": args.k, "d": args.d, "method": args.method, "gqa_select": args.gqa_select,
                         "semantics": args.semantics, "num_fewshot": args.num_fewshot, "limit": limit},
            "tasks": tasks,
            "results": metrics,
            "n_samples": results.get("n-samples") if results else None,
        }
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(payload, indent=2, default=str))
    return 0
