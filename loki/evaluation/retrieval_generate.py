"""The retrieval suite through ``generate`` on the fast path, beside the evaluation engine's answers.

:func:`generate_retrieval` answers the suite's tasks (:mod:`loki.evaluation.retrieval_tasks`, the same seeded
samples) with ``model.generate`` over a :func:`~loki.integrations.transformers.loki_cache`, the path the
speed benchmarks time, following the engine's protocol (:mod:`loki.evaluation.retrieval`) step for step so that
the two accuracies compare sample by sample:

1. Loki is enabled with ``backend="auto"`` (the Triton kernels through ``torch.ops.loki.decode_step`` on CUDA,
   the PyTorch reference on the CPU) and ``semantics="generate"``.  **One static cache per batch size**, at the
   longest prompt plus the largest answer budget, serves every task and length; every batch starts with
   ``cache.reset()``.  One cache rather than one per length bucket: its shapes never change, so each compiled
   callable traces and records its CUDA graph once per setting (a cache per length would compile once per
   length); a decode step reads only the slots written so far, so the unused tail of the cache changes nothing.
2. The prompt minus its last ``question_tokens`` tokens is prefilled in chunks of ``prefill_chunk`` tokens
   (dense causal attention; the keys are rotated into the basis as they are written).  The engine prefills with
   the model's own attention and rotates a copy of that cache: the same attention up to rounding.
3. The question tail but its last token is fed one token per forward (sparse decode steps) through
   ``model.forward``, compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` on CUDA, with
   ``position_ids`` and ``cache_position`` of the new token and no mask (:mod:`loki.evaluation.fast_path`'s step).
4. ``model.generate(prompt, attention_mask=ones, <cache keyword>=cache, do_sample=False)`` finds every prompt
   token but the last in the cache, so its first forward is the decode step of the last question token, whose
   logits give the first answer token (as in the engine, a sparse decode step produces it); it then decodes
   greedily, its decode steps compiled by transformers (``CompileConfig(fullgraph=True,
   mode="reduce-overhead")``) on CUDA and eager elsewhere (``disable_compile``).
5. The answer is the generated text before the first stop token (EOS, or a token whose text holds a newline),
   scored with the suite's own :func:`~loki.evaluation.retrieval.score` (RULER's string match).

The engine also stops a batch once every row holds its answers; later tokens never change an exact match, so the
scores are the same and the engine's prediction is then a prefix of this one.

:func:`compare_with_engine` pairs the two runs' outcomes per sample: per (task, length), per task and over all,
both accuracies and the difference (generate - engine) with Newcombe's paired 95% interval
(:func:`~loki.evaluation.intervals.paired_difference`); the two **agree** when that interval contains 0 or the
difference is within ``tol`` (:data:`AGREEMENT_TOL`, 2 points; the gate reads ``retrieval_generate_tol`` from the
thresholds).  :func:`retrieval_generate_section` is ``loki check``'s section (the engine's retrieval result of
the same run, its default-basis Loki settings through ``generate``), skipped with a note off CUDA.
"""

from __future__ import annotations

import copy
import inspect
import time

import torch

from loki._hf import cache_keyword, decoder
from loki.evaluation.intervals import paired_difference
from loki.evaluation.perplexity import MethodSpec
from loki.evaluation.retrieval import MAX_NEW_TOKENS, _stop_ids, score
from loki.evaluation.retrieval_tasks import TASKS, make_samples

__all__ = ["AGREEMENT_TOL", "PREFILL_CHUNK", "agrees", "answer_tokens", "compare_with_engine", "generate_batch",
           "generate_retrieval", "retrieval_generate_section"]

#: The largest |generate - engine| accuracy difference that counts as agreement whatever its interval.
AGREEMENT_TOL = 0.02
#: Tokens per prefill forward (the dense prefill attends over the whole preallocated cache: chunks bound it).
PREFILL_CHUNK = 512


def answer_tokens(new_tokens, tokenizer, stops) -> list[int]:
    """The generated tokens before the first stop token: one in ``stops`` (EOS ids) or whose text holds a
    newline (the engine's rule, :mod:`loki.evaluation.retrieval` step 3)."""
    out = []
    for v in new_tokens:
        v = int(v)
        if v in stops or "\n" in tokenizer.decode([v]):
            break
        out.append(v)
    return out


def _generate_kwargs(model, tokenizer, stops, compile: bool | str) -> dict:
    """``generate``'s greedy settings: the compile config on CUDA (or a test backend), eager otherwise."""
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (min(stops) if stops else 0)
    kw = {"do_sample": False, "pad_token_id": int(pad), "eos_token_id": sorted(stops) or None,
          "temperature": None, "top_p": None, "top_k": None}
    if not compile:
        return kw | {"disable_compile": True}
    from transformers import CompileConfig

    if compile is True:
        return kw | {"compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead")}
    cc = CompileConfig(fullgraph=True, backend=compile, mode=None)  # a backend by name (tests on the CPU)
    cc._compile_all_devices = True
    return kw | {"compile_config": cc}


@torch.no_grad()
def generate_batch(model, tokenizer, input_ids: torch.Tensor, cache, *, question_tokens: int = 8,
                   max_new_tokens: int = 10, prefill_chunk: int = PREFILL_CHUNK, step=None,
                   generate_kwargs: dict | None = None, stops=None) -> dict:
    """One batch ``input_ids [B, T]`` (prompts of one length, Loki enabled) through the static ``cache`` (reset
    here) and ``generate`` (module docstring, steps 2-5).  ``step``: the callable of the tail's decode steps
    (default ``model.forward``; compiled on CUDA).  Returns ``{"predictions": [str] * B, "tokens": [[int]] * B}``
    (the tokens before the first stop token)."""
    dev = next(model.parameters()).device
    ids = input_ids.to(dev)
    B, T = ids.shape
    tq = max(1, min(int(question_tokens), T - 1))
    P = T - tq
    stops = _stop_ids(model, tokenizer) if stops is None else stops
    cache.reset()
    dec = decoder(model)
    kw_dec, kw = cache_keyword(dec), cache_keyword(model)
    chunk = max(1, int(prefill_chunk))
    for s in range(0, P, chunk):
        dec(input_ids=ids[:, s : min(s + chunk, P)], use_cache=True, **{kw_dec: cache})
    fn = step if step is not None else model.forward
    with_cache_position = "cache_position" in inspect.signature(model.forward).parameters
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None) if step is not None and ids.is_cuda else None
    for t in range(P, T - 1):
        call = {kw: cache, "use_cache": True, "position_ids": torch.full((B, 1), t, dtype=torch.long, device=dev)}
        if with_cache_position:
            call["cache_position"] = torch.tensor([t], dtype=torch.long, device=dev)
        if mark is not None:
            mark()
        fn(input_ids=ids[:, t : t + 1], **call)
    gk = generate_kwargs if generate_kwargs is not None else _generate_kwargs(model, tokenizer, stops, False)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max(1, max_new_tokens),
                         **gk, **{kw: cache})
    toks = [answer_tokens(row, tokenizer, stops) for row in out[:, T:].tolist()]
    return {"predictions": [tokenizer.decode(t) for t in toks], "tokens": toks}


def _spec_dict(spec: MethodSpec) -> dict:
    return {"name": spec.name, "method": spec.method, "k": spec.k, "d": spec.d, "basis": spec.basis,
            "gqa_select": spec.gqa_select, "aggregate": spec.aggregate}


@torch.no_grad()
def generate_retrieval(model, tokenizer, specs: list[MethodSpec], bases: dict, *, tasks=TASKS,
                       context_lens=(1024,), samples: int = 16, seed: int = 0, batch_size: int = 16,
                       max_new_tokens: int | dict | None = None, question_tokens: int = 8,
                       prefill_chunk: int = PREFILL_CHUNK, compile: bool | str = True, backend: str = "auto",
                       dtype: torch.dtype | str | None = None, keep_predictions: bool = True,
                       progress: bool = True) -> dict:
    """The retrieval suite's samples answered through ``generate`` over the Loki static cache for every spec
    (method "loki" only: the static decode step of the fast path).  Arguments as
    :func:`~loki.evaluation.retrieval.evaluate_retrieval`; ``compile``: True compiles the decode steps with mode
    "reduce-overhead" (CUDA only: CUDA graphs), False runs them eagerly, a string names a ``torch.compile`` backend
    (e.g. "aot_eager", to trace the steps whole on the CPU in tests); ``dtype``: decode a copy of the model
    converted to it.  The model is left with Loki disabled.

    Returns a JSON-able dict: ``config`` (with ``max_cache_len`` per batch size), ``methods``, ``samples`` (per
    ``"{task}/{length}/{name}"`` the 0/1 scores, predictions and answers, the layout of ``evaluate_retrieval``)
    and ``timing``."""
    from tqdm.auto import tqdm

    from loki.integrations.transformers import disable_loki, enable_loki, loki_cache

    for s in specs:
        if s.method != "loki":
            raise ValueError(f"{s.name}: only method 'loki' has the fast path's static decode step, got {s.method!r}")
        if s.basis not in (bases or {}):
            raise KeyError(f"{s.name}: basis {s.basis!r} not given (have {sorted(bases or {})})")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {t!r}")
    dev = next(model.parameters()).device
    if compile is True and dev.type != "cuda":
        raise ValueError(f"compile=True records CUDA graphs and needs a model on CUDA (it is on {dev}); pass "
                         "compile=False")
    if compile:
        from loki.integrations.transformers.run import check_compiled_backend

        check_compiled_backend(backend, dev, f"generate_retrieval(compile={compile!r})")
    if dtype is not None:
        from loki.evaluation.models import resolve_dtype

        dtype = resolve_dtype(dtype)
        if dtype != next(model.parameters()).dtype:
            model = copy.deepcopy(model).to(dtype)
    budgets = max_new_tokens if isinstance(max_new_tokens, dict) else {
        t: max_new_tokens if isinstance(max_new_tokens, int) else MAX_NEW_TOKENS[t] for t in tasks}
    S = max(context_lens) + max(max(1, budgets[t]) for t in tasks)
    stops = _stop_ids(model, tokenizer)
    gk = _generate_kwargs(model, tokenizer, stops, compile)
    made = {(t, L): make_samples(t, tokenizer, L, samples, seed=seed) for t in tasks for L in context_lens}
    detail: dict = {}
    timing: list = []
    t_start = time.perf_counter()
    jobs = [(s, t, L, b) for s in specs for t in tasks for L in context_lens for b in range(0, samples, batch_size)]
    bar = tqdm(total=len(jobs), desc="retrieval (generate)", unit="batch", disable=not progress)
    for spec in specs:
        enable_loki(model, bases[spec.basis], k=spec.k, d=spec.d, gqa_select=spec.gqa_select,
                    aggregate=spec.aggregate, backend=backend, semantics="generate", score_format=spec.score_format)
        caches: dict = {}
        step = None
        try:
            if compile:
                step = torch.compile(model.forward, fullgraph=True, **(
                    {"mode": "reduce-overhead"} if compile is True else {"backend": compile}))
            for task in tasks:
                for L in context_lens:
                    for b0 in range(0, samples, batch_size):
                        bar.set_postfix_str(f"{spec.name} {task} {L}")
                        batch = made[(task, L)][b0 : b0 + batch_size]
                        ids = torch.tensor([x.input_ids for x in batch], dtype=torch.long)
                        B = len(batch)
                        if B not in caches:
                            caches[B] = loki_cache(model, static=True, max_cache_len=S, batch_size=B)
                        t0 = time.perf_counter()
                        res = generate_batch(model, tokenizer, ids, caches[B], question_tokens=question_tokens,
                                             max_new_tokens=budgets[task], prefill_chunk=prefill_chunk, step=step,
                                             generate_kwargs=gk, stops=stops)
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        timing.append({"name": spec.name, "task": task, "context_len": L, "batch": B,
                                       "seconds": time.perf_counter() - t0})
                        d = detail.setdefault(f"{task}/{L}/{spec.name}", {"correct": [], "predictions": [],
                                                                          "answers": []})
                        d["correct"].extend(int(score(p, x.answers)) for p, x in zip(res["predictions"], batch))
                        if keep_predictions:
                            d["predictions"].extend(res["predictions"])
                            d["answers"].extend(list(x.answers) for x in batch)
                        bar.update()
        finally:
            step = None
            caches.clear()
            disable_loki(model)
            if compile:
                torch._dynamo.reset()  # drops the compiled graphs and their CUDA-graph memory pool
    bar.close()
    return {
        "config": {"tasks": list(tasks), "context_lens": list(context_lens), "samples": samples, "seed": seed,
                   "batch_size": batch_size, "question_tokens": question_tokens, "max_new_tokens": budgets,
                   "max_cache_len": S, "prefill_chunk": prefill_chunk, "compiled": bool(compile),
                   "compile": compile if isinstance(compile, str) else ("reduce-overhead" if compile else None),
                   "backend": backend, "device": str(dev),
                   "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                   "seconds": time.perf_counter() - t_start},
        "methods": [_spec_dict(s) for s in specs],
        "samples": detail,
        "timing": timing,
    }


# ------------------------------------------------------------------------------------------ the comparison
def agrees(diff: dict, tol: float = AGREEMENT_TOL) -> bool:
    """Whether a paired difference (``{"diff", "lo", "hi"}``) shows agreement: its 95% interval contains 0 or
    the difference is within ``tol``."""
    return bool(diff["lo"] <= 0.0 <= diff["hi"] or abs(diff["diff"]) <= tol)


def _same_prediction(gen: str, eng: str, eng_correct: int) -> bool:
    """The same answer: equal text, or (the engine stopped its batch once every row was right) the engine's
    prediction a prefix of this one."""
    return gen == eng or bool(eng_correct) and gen.startswith(eng)


def _row(name, task, length, gen, eng, tol) -> dict:
    a = [x for x, _ in gen]
    b = [x for x, _ in eng]
    d = paired_difference(a, b)
    n = len(a)
    preds = [(g, e, ok) for (_, g), (ok, e) in zip(gen, eng) if g is not None and e is not None]
    return {"name": name, "task": task, "context_len": length, "n": n,
            "generate_accuracy": sum(a) / n if n else None, "engine_accuracy": sum(b) / n if n else None,
            "diff": d["diff"], "lo": d["lo"], "hi": d["hi"], "only_generate": d["only_a"], "only_engine": d["only_b"],
            "same_prediction": (sum(_same_prediction(g, e, ok) for g, e, ok in preds) / len(preds)) if preds else None,
            "agrees": agrees(d, tol)}


def compare_with_engine(gen: dict, engine: dict, *, names=None, tol: float = AGREEMENT_TOL) -> list[dict]:
    """Rows pairing the per-sample outcomes of :func:`generate_retrieval` (``gen``) and the engine's
    :func:`~loki.evaluation.retrieval.evaluate_retrieval` (``engine``) on the same samples: per setting (``names``,
    default every setting of ``gen``), one row per (task, length), per task (``context_len`` None) and over every
    task and length (``task="all"``), with both accuracies, the difference generate - engine and its paired 95%
    interval, the discordant counts, the fraction of identical answers and ``agrees``."""
    cfg = gen["config"]
    names = names or [m["name"] for m in gen["methods"]]
    rows = []
    for name in names:
        per: dict = {}
        for task in cfg["tasks"]:
            for L in cfg["context_lens"]:
                key = f"{task}/{L}/{name}"
                g, e = gen["samples"].get(key), engine.get("samples", {}).get(key)
                if g is None or e is None:
                    raise KeyError(f"{key}: missing from the {'generate' if g is None else 'engine'} run")
                if len(g["correct"]) != len(e["correct"]):
                    raise ValueError(f"{key}: {len(g['correct'])} samples through generate, {len(e['correct'])} "
                                     "through the engine")
                gp = g.get("predictions") or [None] * len(g["correct"])
                ep = e.get("predictions") or [None] * len(e["correct"])
                per[(task, L)] = (list(zip(g["correct"], gp)), list(zip(e["correct"], ep)))
                rows.append(_row(name, task, L, *per[(task, L)], tol))
        groups = [(t, [k for k in per if k[0] == t]) for t in cfg["tasks"]] + [("all", list(per))]
        for task, keys in groups:
            rows.append(_row(name, task, None, [x for k in keys for x in per[k][0]],
                             [x for k in keys for x in per[k][1]], tol))
    return rows


def retrieval_generate_section(model, tokenizer, bases: dict, engine: dict, *, default_basis: str = "score",
                               names=None, tol: float = AGREEMENT_TOL, compile: bool | str = True,
                               backend: str = "auto", progress: bool = False, log=None) -> dict:
    """``loki check``'s section: the settings of the engine's retrieval run ``engine`` that are Loki with the
    default basis (both GQA modes where the run has them; or ``names``) answered through ``generate`` on the
    compiled static cache (:func:`generate_retrieval` with the engine run's tasks, lengths, samples and seed),
    compared with the engine's answers (:func:`compare_with_engine`).  Off CUDA with ``compile=True``:
    ``{"skipped": reason}`` (the compiled static cache and the Triton kernels are what it checks; ``compile=False``
    runs the same comparison eagerly, e.g. on the CPU)."""
    dev = next(model.parameters()).device
    if compile is True and dev.type != "cuda":
        return {"skipped": f"retrieval through generate (compiled static cache, Triton kernels) needs CUDA; the "
                           f"model is on {dev}"}
    specs = [MethodSpec(**m) for m in engine["methods"] if m["method"] == "loki"
             and (m["name"] in names if names else m["basis"] == default_basis)]
    if not specs:
        return {"skipped": f"the engine's retrieval run has no Loki setting with the {default_basis!r} basis"}
    cfg = engine["config"]
    keys = ("tasks", "context_lens", "samples", "seed", "batch_size", "question_tokens", "max_new_tokens")
    if log:
        log(f"retrieval through generate: {', '.join(s.name for s in specs)}, {len(cfg['tasks'])} tasks x "
            f"{len(cfg['context_lens'])} lengths x {cfg['samples']} samples, static cache "
            f"({'compiled' if compile else 'eager'})")
    gen = generate_retrieval(model, tokenizer, specs, bases, compile=compile, backend=backend, progress=progress,
                             **{k: cfg[k] for k in keys})
    g = gen["config"]
    return {"setting": {"methods": gen["methods"], **{k: g[k] for k in keys if k != "max_new_tokens"},
                        "max_cache_len": g["max_cache_len"], "compiled": g["compiled"], "dtype": g["dtype"],
                        "engine_dtype": cfg.get("dtype"), "tolerance": tol},
            "rows": compare_with_engine(gen, engine, tol=tol), "seconds": g["seconds"],
            "samples": gen["samples"]}
