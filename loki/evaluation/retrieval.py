"""RULER-style synthetic retrieval under every sparse-attention method, scored by exact match with intervals.

Protocol (decode-time semantics, honest about the method).  For each batch of samples of one (task, length):

1. The prompt minus its last ``question_tokens`` tokens is prefilled **once** with the model's own dense
   attention into a ``DynamicCache`` (in chunks of ``prefill_chunk`` tokens; no logits are computed).
2. For every method the cache is copied, the method is enabled (``enable_loki(..., semantics="generate")``,
   whose first forward converts the copy, rotating its keys into the basis for Loki and PCAAttn), the question
   tail is fed **one token per forward** (sparse decode steps), and the answer is decoded greedily, one token
   per step.  The first answer token is therefore produced by a sparse decode step, never by a dense prefill
   row.  H2O gets its own prefill under ``enable_loki`` (its accumulated attention comes from the prefill;
   chunked so that the materialised attention stays within ``h2o_chunk_elements`` elements).  "full" runs the
   same steps with the model's own attention.
3. A row stops at its first stop token (EOS or a token containing a newline); its prediction is the text
   before it.  Decoding ends when every row has stopped or already contains its answers (later tokens cannot
   change an exact match) or after ``max_new_tokens`` (per task by default).
4. Score (RULER's string match): 1 when every expected answer occurs in the prediction (case-insensitive).

Statistics: accuracy with a 95% Wilson interval per (task, length, method); the paired difference against a
reference method (default exact top-k with the same k and GQA mode) with Newcombe's hybrid score interval for
paired proportions (method 10, Newcombe 1998); full attention's accuracy and the chance level beside.
Cells with ``task="all"`` pool, per length, the tasks on which full attention is above chance (the lower end of
its Wilson interval exceeds the chance level); every cell says whether its full attention is.

Shape letters: B batch, T context tokens, P prefilled tokens (T - question_tokens), V vocabulary.
"""

from __future__ import annotations

import copy
import time

import torch

from loki._hf import cache_keyword, decoder
from loki.evaluation.intervals import paired_difference, wilson_interval
from loki.evaluation.perplexity import MethodSpec, standard_methods
from loki.evaluation.retrieval_report import markdown_table, plot_retrieval, write_report
from loki.evaluation.retrieval_tasks import CHANCE, TASKS, make_samples
from loki.reference.selection import DEFAULT_KV_AGGREGATE, KERNEL_AGGREGATES

__all__ = [
    "CONTEXT_LENS",
    "MAX_NEW_TOKENS",
    "PRESETS",
    "evaluate_retrieval",
    "informative",
    "markdown_table",
    "paired_difference",
    "plot_retrieval",
    "reference_for",
    "retrieval_methods",
    "run_batch",
    "score",
    "wilson_interval",
    "write_report",
]

CONTEXT_LENS = (1024, 2048, 4096, 8192)
#: Greedy steps per task: the answer plus a couple of tokens (digits are single tokens for SmolLM2).
MAX_NEW_TOKENS = {"passkey": 8, "single_needle": 10, "multikey_needle": 10, "variable_tracking": 12}
#: Keyword arguments of :func:`evaluate_retrieval` for the two jobs (docs/retrieval.md): ``"gpu"`` the whole grid
#: on one H100 (B = 32 at 8k fits: the dense cache and one method's copy are ~11 GB each in fp32), ``"cpu"`` a
#: small version for the CPU job (one batch per task at 2k: ~5 min on one thread for full, exact top-k and one
#: Loki setting).
PRESETS = {
    "gpu": {"context_lens": CONTEXT_LENS, "samples": 32, "batch_size": 32},
    "cpu": {"context_lens": (2048,), "samples": 4, "batch_size": 4},
}


# ------------------------------------------------------------------------------------------ statistics
def score(prediction: str, answers) -> bool:
    """RULER's string match: every expected answer occurs in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return all(str(a).lower() in pred for a in answers)


def reference_for(spec: MethodSpec, specs: list[MethodSpec], reference: str | None = "exact_topk"):
    """The spec a setting is compared with: ``reference="exact_topk"`` picks exact top-k with the same k (and
    GQA mode when there is one, and for a shared selection the same aggregate when there is one); any other string
    names a spec; None: no comparison.  A spec is never its own reference, and "full" has none."""
    if reference is None or spec.method == "full":
        return None
    if reference != "exact_topk":
        ref = next((s for s in specs if s.name == reference), None)
        return None if ref is None or ref is spec else ref
    cands = [s for s in specs if s.method == "exact_topk" and s.k == spec.k and s is not spec]
    if spec.method == "exact_topk":
        return None
    same = [s for s in cands if s.gqa_select == spec.gqa_select]
    if spec.gqa_select == "kv":  # the oracle of the same shared selection: the same aggregate where there is one
        same = [s for s in same if s.aggregate == spec.aggregate] or same
    return (same or cands or [None])[0]


# ------------------------------------------------------------------------------------------ decoding
@torch.no_grad()
def _prefill(model, ids: torch.Tensor, cache, chunk: int):
    """Run ``ids [B, P]`` through the decoder (no logits) into ``cache``, ``chunk`` tokens per forward."""
    dec = decoder(model)
    kw = cache_keyword(dec)
    for s in range(0, ids.shape[1], max(1, chunk)):
        dec(input_ids=ids[:, s : s + chunk], use_cache=True, **{kw: cache})
    return cache


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config.get_text_config(decoder=True))


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _stop_ids(model, tokenizer) -> set[int]:
    ids = set()
    gen = getattr(model, "generation_config", None)
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(gen, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src is not None:
            ids.update(int(x) for x in src)
    return ids


@torch.no_grad()
def run_batch(model, tokenizer, input_ids: torch.Tensor, specs: list[MethodSpec], bases: dict | None = None, *,
              answers=None, question_tokens: int = 8, max_new_tokens: int = 10, prefill_chunk: int = 2048,
              h2o_chunk_elements: int = 1 << 28, keep_logits: bool = False) -> dict:
    """Every spec on one batch ``input_ids [B, T]`` (see the module docstring).  ``answers``: per row, the
    expected strings (lets decoding stop once every row has them; None: decode until the stop tokens).

    Returns ``{spec.name: {"predictions": [str] * B, "tokens": [[int]] * B, "seconds": float,
    "first_logits": [B, V] fp32 (with keep_logits)}}`` plus ``"_prefill_seconds"``.
    """
    from loki.integrations.transformers import disable_loki, enable_loki

    dev = model.device
    ids = input_ids.to(dev)
    B, T = ids.shape
    tq = max(1, min(int(question_tokens), T - 1))
    prefix, tail = ids[:, : T - tq], ids[:, T - tq :]
    kw = cache_keyword(model)
    stops = _stop_ids(model, tokenizer)
    disable_loki(model)
    t0 = time.perf_counter()
    dense = _prefill(model, prefix, _new_cache(model), prefill_chunk) if any(s.method != "h2o" for s in specs) else None
    _sync(ids)
    out: dict = {"_prefill_seconds": time.perf_counter() - t0}
    for spec in specs:
        t0 = time.perf_counter()
        basis = None
        if spec.basis is not None:
            if not bases or spec.basis not in bases:
                raise KeyError(f"{spec.name}: basis {spec.basis!r} not given (have {sorted(bases or {})})")
            basis = bases[spec.basis]
        if spec.method != "full":  # aggregates the Triton kernels lack run on the PyTorch reference
            enable_loki(model, basis, k=spec.k, d=spec.d, method=spec.method, gqa_select=spec.gqa_select,
                        aggregate=spec.aggregate, semantics="generate", score_format=spec.score_format,
                        backend="auto" if spec.aggregate in KERNEL_AGGREGATES else "torch")
        try:
            if spec.method == "h2o":
                nh = model.config.get_text_config(decoder=True).num_attention_heads
                chunk = max(1, min(prefill_chunk, h2o_chunk_elements // max(1, B * nh * (T - tq))))
                cache = _prefill(model, prefix, _new_cache(model), chunk)
            else:
                cache = copy.deepcopy(dense)
            res = _decode(model, tokenizer, cache, tail, kw, stops, answers, max_new_tokens, keep_logits)
        finally:
            disable_loki(model)
        del cache
        _sync(ids)
        res["seconds"] = time.perf_counter() - t0
        out[spec.name] = res
    return out


def _decode(model, tokenizer, cache, tail, kw, stops, answers, max_new_tokens, keep_logits) -> dict:
    """Feed the question tail one token per forward, then decode greedily (module docstring, step 3)."""
    B = tail.shape[0]
    for t in range(tail.shape[1]):
        logits = model(input_ids=tail[:, t : t + 1], use_cache=True, **{kw: cache}).logits[:, -1].float()
    first = logits.detach().clone() if keep_logits else None
    toks: list[list[int]] = [[] for _ in range(B)]
    stopped = [False] * B
    for step in range(max(1, max_new_tokens)):
        nxt = logits.argmax(-1)
        for b, v in enumerate(nxt.tolist()):
            if stopped[b]:
                continue
            if v in stops or "\n" in tokenizer.decode([v]):
                stopped[b] = True
            else:
                toks[b].append(v)
        done = [stopped[b] or (answers is not None and score(tokenizer.decode(toks[b]), answers[b]))
                for b in range(B)]
        if all(done) or step == max_new_tokens - 1:
            break
        logits = model(input_ids=nxt[:, None], use_cache=True, **{kw: cache}).logits[:, -1].float()
    res = {"predictions": [tokenizer.decode(t) for t in toks], "tokens": toks}
    if keep_logits:
        res["first_logits"] = first
    return res


# ------------------------------------------------------------------------------------------ the suite
def _spec_dict(spec: MethodSpec) -> dict:
    return {"name": spec.name, "method": spec.method, "k": spec.k, "d": spec.d, "basis": spec.basis,
            "gqa_select": spec.gqa_select, "aggregate": spec.aggregate}


def informative(full_correct, chance: float) -> bool:
    """Whether full attention scores above chance: the lower end of its 95% Wilson interval exceeds the chance
    level (a (task, length) where it does not says nothing about a sparse method)."""
    return bool(full_correct) and wilson_interval(sum(full_correct), len(full_correct))[0] > chance


def _cell(task, length, spec, correct, full, ref_spec, ref_correct, chance, pooled=None) -> dict:
    n, s = len(correct), sum(correct)
    lo, hi = wilson_interval(s, n)
    cell = {"task": task, "context_len": length, **_spec_dict(spec), "n": n, "correct": s,
            "accuracy": s / n if n else None, "ci": [lo, hi], "chance": chance,
            "full_accuracy": (sum(full) / len(full)) if full else None,
            "full_above_chance": informative(full, chance) if full else None, "reference": None, "diff": None}
    if pooled is not None:
        cell["pooled_tasks"] = list(pooled)
    if ref_spec is not None and ref_correct is not None:
        cell["reference"] = ref_spec.name
        cell["diff"] = paired_difference(correct, ref_correct)
    return cell


def evaluate_retrieval(model, tokenizer, specs: list[MethodSpec], bases: dict | None = None, *,
                       tasks=TASKS, context_lens=CONTEXT_LENS, samples: int = 16, seed: int = 0,
                       batch_size: int = 16, max_new_tokens: int | dict | None = None, question_tokens: int = 8,
                       reference: str | None = "exact_topk", prefill_chunk: int = 2048,
                       h2o_chunk_elements: int = 1 << 28, keep_predictions: bool = True,
                       progress: bool = True) -> dict:
    """The retrieval suite: ``samples`` prompts per (task, length) for every spec (module docstring).

    ``max_new_tokens``: an int for every task, a dict by task, or None for :data:`MAX_NEW_TOKENS`.
    Returns a JSON-able dict: ``config``, ``methods``, ``chance``, ``cells`` (one per task, length and method,
    plus the pooled ``task="all"`` cells over the tasks whose full attention is above chance at that length,
    :func:`informative`), ``samples`` (per cell key, the 0/1 scores, predictions and answers)
    and ``timing`` (seconds of the dense prefill and of every method per (task, length)).
    """
    from tqdm.auto import tqdm

    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"spec names must be unique, got {names}")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {t!r}")
    full_spec = next((s for s in specs if s.method == "full"), None)
    refs = {s.name: reference_for(s, specs, reference) for s in specs}
    per: dict = {}  # (task, length, name) -> list of 0/1
    detail: dict = {}
    timing: list = []
    jobs = [(t, L, b) for t in tasks for L in context_lens for b in range(0, samples, batch_size)]
    bar = tqdm(jobs, desc="retrieval", unit="batch", disable=not progress)
    t_start = time.perf_counter()
    made: dict = {}
    for task, L, b0 in bar:
        bar.set_postfix_str(f"{task} {L}")
        if (task, L) not in made:
            made = {(task, L): make_samples(task, tokenizer, L, samples, seed=seed)}
        batch = made[(task, L)][b0 : b0 + batch_size]
        ids = torch.tensor([s.input_ids for s in batch], dtype=torch.long)
        answers = [s.answers for s in batch]
        mnt = max_new_tokens if isinstance(max_new_tokens, int) else (max_new_tokens or MAX_NEW_TOKENS)[task]
        res = run_batch(model, tokenizer, ids, specs, bases, answers=answers, question_tokens=question_tokens,
                        max_new_tokens=mnt, prefill_chunk=prefill_chunk, h2o_chunk_elements=h2o_chunk_elements)
        timing.append({"task": task, "context_len": L, "batch": len(batch), "prefill_s": res["_prefill_seconds"],
                       "methods_s": {s.name: res[s.name]["seconds"] for s in specs}})
        for s in specs:
            ok = [int(score(p, a)) for p, a in zip(res[s.name]["predictions"], answers)]
            per.setdefault((task, L, s.name), []).extend(ok)
            d = detail.setdefault(f"{task}/{L}/{s.name}", {"correct": [], "predictions": [], "answers": []})
            d["correct"].extend(ok)
            if keep_predictions:
                d["predictions"].extend(res[s.name]["predictions"])
                d["answers"].extend(list(a) for a in answers)
    cells = []
    for task in list(tasks) + (["all"] if len(tasks) > 1 else []):
        for L in context_lens:
            pool = [task]
            if task == "all":  # the tasks on which full attention is above chance at this length (all without it)
                pool = [t for t in tasks if full_spec is None or informative(per[(t, L, full_spec.name)], CHANCE[t])]
            get = lambda name, pool=pool, L=L: [x for t in pool for x in per.get((t, L, name), [])]
            full = get(full_spec.name) if full_spec is not None else None
            chance = sum(CHANCE[t] for t in pool) / len(pool) if pool else 0.0
            for s in specs:
                ref = refs[s.name]
                cells.append(_cell(task, L, s, get(s.name), full, ref, get(ref.name) if ref else None, chance,
                                   pool if task == "all" else None))
    return {
        "config": {"tasks": list(tasks), "context_lens": list(context_lens), "samples": samples, "seed": seed,
                   "batch_size": batch_size, "question_tokens": question_tokens,
                   "max_new_tokens": max_new_tokens if max_new_tokens is not None else dict(MAX_NEW_TOKENS),
                   "reference": reference, "device": str(model.device), "dtype": str(model.dtype).replace("torch.", ""),
                   "model": getattr(model.config, "name_or_path", None), "seconds": time.perf_counter() - t_start},
        "methods": [_spec_dict(s) for s in specs],
        "chance": {t: CHANCE[t] for t in tasks},
        "cells": cells,
        "samples": detail,
        "timing": timing,
    }


def retrieval_methods(k_f: int | float = 0.125, d_f: float = 0.25, head_dim: int = 64, *,
                      bases=("pre", "post", "score"), gqa_modes=("query", "kv"),
                      kv_aggregate: str = DEFAULT_KV_AGGREGATE) -> list[MethodSpec]:
    """The suite's settings (11 with the default bases): full, exact top-k and Loki with every basis in both GQA
    modes (the shared ones combining a group's scores by ``kv_aggregate``, "softmax-max" by default), H2O and
    SparQ (r = d), all at the budget ``k_f`` (a fraction, or an int count of tokens); ``bases`` name the entries
    of the bases dict to pass."""
    return standard_methods(k_f, d_f, head_dim, rotary=tuple(bases), gqa_modes=tuple(gqa_modes), pcaattn=False,
                            exactness=False, kv_aggregate=kv_aggregate)
