"""Downstream accuracy of sparse-attention methods: local lm-eval tasks (offline) through the Loki model.

Every method runs through :class:`loki.integrations.lm_eval.LokiLM` on the already loaded model with
decode-time semantics (each query row of a prompt selects ``ceil(k_f (i+1))`` of the tokens it sees), so the
log-likelihoods measure the method; "full" is the model's own dense attention.  Needs lm-eval (the ``eval``
extra): import this module only when the downstream gates run.  Used by ``loki check`` for the
downstream-accuracy gates (``loki/evaluation/accuracy_thresholds.json``, "downstream").
"""

from __future__ import annotations

from lm_eval import simple_evaluate
from tqdm.auto import tqdm

from loki.integrations.lm_eval import LokiLM, task_manager
from loki.integrations.transformers import disable_loki

__all__ = ["DEFAULT_TASKS", "downstream_accuracy"]

DEFAULT_TASKS = ("loki_copa", "loki_arc_easy")


def downstream_accuracy(model, tokenizer, specs, bases: dict, *, tasks=DEFAULT_TASKS, limit: int = 30,
                        num_fewshot: int = 0, progress: bool = True) -> dict:
    """``{"tasks", "limit", "num_fewshot", "accuracy": {spec name: {task: acc, "mean": acc}}, "stderr": {spec
    name: {task: lm-eval's standard error of acc}}}`` for :class:`~loki.evaluation.perplexity.MethodSpec` s
    ("full", "loki", "exact_topk", ...)."""
    tm = task_manager()
    acc: dict[str, dict[str, float]] = {}
    stderr: dict[str, dict[str, float]] = {}
    for spec in tqdm(specs, desc="downstream tasks", unit="method", disable=not progress):
        if spec.method == "full":
            kw = dict(method="dense", k=1.0, d=1.0, semantics="generate")
        else:
            kw = dict(method=spec.method, k=spec.k, d=spec.d, gqa_select=spec.gqa_select,
                      aggregate=spec.aggregate, basis=bases.get(spec.basis) if spec.basis else None)
        lm = LokiLM(pretrained=model, tokenizer=tokenizer, batch_size=1, **kw)
        try:
            res = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                  task_manager=tm, log_samples=False, random_seed=1234, numpy_random_seed=1234,
                                  torch_random_seed=1234, fewshot_random_seed=1234)
        finally:
            disable_loki(model)
        per = {t: float(res["results"][t]["acc,none"]) for t in tasks}
        per["mean"] = sum(per.values()) / len(tasks)
        acc[spec.name] = per
        stderr[spec.name] = {t: float(res["results"][t].get("acc_stderr,none", float("nan"))) for t in tasks}
    return {"tasks": list(tasks), "limit": limit, "num_fewshot": num_fewshot, "accuracy": acc, "stderr": stderr}
