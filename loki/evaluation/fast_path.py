"""The fast path's own accuracy: perplexity decoded token by token through the Loki static cache, as the
end-to-end benchmark runs it, beside the evaluation engine's on the same windows.

:func:`fast_path_perplexity` enables Loki with ``backend="auto"`` (the Triton kernels on CUDA, the PyTorch
reference on the CPU), preallocates a :func:`~loki.integrations.transformers.loki_cache` for the windows,
prefills the first token of every window alone, then feeds the true next token one step at a time (teacher
forcing) through ``model.forward``, compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` on
CUDA (CUDA graphs), and accumulates the NLL of every next token from each step's logits.  Row ``t`` of a window
then sees its first ``t + 1`` tokens and keeps ``budget_counts(k, t + 1)`` of them, as the engine's row ``t``
(``semantics="decode"``): the two perplexities count the same ``N x (T - 1)`` predictions and compare directly.

The loop follows the benchmark's conventions (``loki.bench.e2e``): ``position_ids`` (and ``cache_position`` where
the forward takes it) of the new token and no attention mask, so every step has the same input shapes and one
recorded CUDA graph serves all of them (without a mask the step metadata takes every token written so far; a mask
that grows by one each step, ``attention_mask="grow"``, the convention of ``loki.testing.decode``, changes the
input shape every step and suits uncompiled loops only).

:func:`fast_path_section` is ``loki check --long``'s section: fp32 and bf16 against the engine (fp32), with the
gate ``fast_path_rel_tol`` (0.3% in fp32) decided in :mod:`loki.evaluation.gates`; skipped with a note off CUDA.

Shape letters: N windows, T tokens per window, V vocabulary.
"""

from __future__ import annotations

import copy
import inspect
import math
import time

import torch

from loki._hf import cache_keyword
from loki.evaluation.perplexity import MethodSpec, perplexity
from loki.evaluation.retrieval_report import setting_label

__all__ = ["FAST_PATH_DTYPES", "fast_path_perplexity", "fast_path_section"]

#: The dtypes the check decodes in (the engine runs in the model's own, fp32).
FAST_PATH_DTYPES = ("float32", "bfloat16")


@torch.no_grad()
def fast_path_perplexity(model, windows: torch.Tensor, basis, *, k: int | float = 0.25, d: int | float | str = "auto",
                         gqa_select: str = "auto", aggregate: str = "auto", dtype: torch.dtype | str | None = None,
                         compile: bool = True, backend: str = "auto", attention_mask: str = "none",
                         progress: bool = False, score_format: str = "auto") -> dict:
    """Perplexity of ``model`` on ``windows`` [N, T] (token ids) decoded token by token through the Loki static
    cache (module docstring): ``{"ppl", "nll", "tokens", "window_nll", "token_nll" ([N, T - 1] fp64, CPU),
    "seconds", "steps", "dtype", "compiled", "device", "gqa_select", "aggregate"}``.

    ``gqa_select`` / ``aggregate``: ``enable_loki``'s; "auto" (the default) resolves as it does (one selection per
    KV group with "softmax-max" on a GQA model, else per query head), and the result states the resolved ones.

    ``dtype``: decode a copy of the model converted to it (None: the model as it is); ``compile``: compile the
    decode steps with ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` (CUDA only: it
    records CUDA graphs); ``backend``, ``d``, ``score_format``: ``enable_loki``'s ("auto": its defaults, the int8
    copy of d_f 0.5); ``attention_mask``: ``"none"`` or
    ``"grow"``.  The model is left with Loki disabled."""
    from tqdm.auto import tqdm

    from loki.integrations.transformers import disable_loki, enable_loki, loki_cache

    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [N, T] token ids with T >= 2, got {getattr(windows, 'shape', windows)}")
    gqa_select, aggregate = _resolve(model, gqa_select, aggregate)
    if attention_mask not in ("none", "grow"):
        raise ValueError(f"attention_mask must be 'none' or 'grow', got {attention_mask!r}")
    dev = next(model.parameters()).device
    if compile and dev.type != "cuda":
        raise ValueError(f"compile=True records CUDA graphs and needs a model on CUDA (it is on {dev}); pass "
                         "compile=False")
    if compile:
        from loki.integrations.transformers.run import check_compiled_backend

        check_compiled_backend(backend, dev, "fast_path_perplexity(compile=True)")
    if compile and attention_mask == "grow":
        raise ValueError("attention_mask='grow' changes the input shape every step: a compiled step would record "
                         "a CUDA graph per length; use attention_mask='none' with compile=True")
    if dtype is not None:
        from loki.evaluation.models import resolve_dtype

        dtype = resolve_dtype(dtype)
        if dtype != next(model.parameters()).dtype:
            model = copy.deepcopy(model).to(dtype)
    run_dtype = next(model.parameters()).dtype
    ids = windows.to(dev)
    N, T = ids.shape
    t0 = time.perf_counter()
    enable_loki(model, basis, k=k, d=d, gqa_select=gqa_select, aggregate=aggregate, backend=backend,
                score_format=score_format)
    step = fn = cache = None
    try:
        cache = loki_cache(model, static=True, max_cache_len=T, batch_size=N)
        kw_cache = cache_keyword(model)
        with_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        fn = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compile else model.forward
        mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None) if compile else None
        nll = torch.empty(N, T - 1, dtype=torch.float32, device=dev)

        def step(t: int, call):
            kw = {kw_cache: cache, "use_cache": True,
                  "position_ids": torch.full((N, 1), t, dtype=torch.long, device=dev)}
            if with_cache_position:
                kw["cache_position"] = torch.tensor([t], dtype=torch.long, device=dev)
            if attention_mask == "grow":
                kw["attention_mask"] = torch.ones(N, t + 1, dtype=torch.long, device=dev)
            if mark is not None and call is fn:
                mark()
            logits = call(input_ids=ids[:, t : t + 1], **kw).logits[:, -1].float()
            nll[:, t] = -torch.log_softmax(logits, dim=-1).gather(-1, ids[:, t + 1 : t + 2]).squeeze(-1)

        step(0, model)  # the prefill: the first token alone, eagerly
        for t in tqdm(range(1, T - 1), desc=f"fast path ({str(run_dtype).replace('torch.', '')})", unit="tok",
                      disable=not progress, leave=False):
            step(t, fn)
        token_nll = nll.double().cpu()
    finally:
        step = fn = cache = None  # the closure holds the graphs and the cache: released before the reset
        disable_loki(model)
        if compile:
            torch._dynamo.reset()  # drops the compiled graphs and their CUDA-graph memory pool
    mean = float(token_nll.mean())
    return {"ppl": math.exp(mean), "nll": mean, "tokens": int(token_nll.numel()),
            "window_nll": [float(x) for x in token_nll.mean(1)], "token_nll": token_nll,
            "seconds": time.perf_counter() - t0, "steps": T - 1, "dtype": str(run_dtype).replace("torch.", ""),
            "compiled": bool(compile), "device": str(dev), "gqa_select": gqa_select, "aggregate": aggregate}


def _resolve(model, gqa_select: str, aggregate: str) -> tuple[str, str]:
    """(gqa_select, aggregate) checked, with "auto" resolved for ``model`` as ``enable_loki`` resolves it."""
    from loki.settings import LokiSettings

    r = LokiSettings(gqa_select=gqa_select, aggregate=aggregate, backend="torch").resolve(model.config)
    return r.gqa_select.value, r.aggregate.value


def fast_path_section(model, windows: torch.Tensor, basis, *, basis_name: str, k: int | float, d: int | float,
                      gqa_select: str = "auto", aggregate: str = "auto", dtypes=FAST_PATH_DTYPES,
                      progress: bool = False, log=None, score_format: str = "native") -> dict:
    """``loki check``'s fast-path section: the engine's perplexity (``semantics="decode"``, the model's dtype)
    and the fast path's in each of ``dtypes`` on the same windows, with the relative difference and the paired
    95% interval of the increase over the engine, in the GQA mode ``gqa_select`` / ``aggregate`` ("auto": the
    model's default configuration, as ``enable_loki`` resolves it).  Off CUDA: ``{"skipped": reason}`` (compiled
    CUDA graphs and the Triton kernels are what it checks).  ``score_format``: the Loki setting's score copy."""
    from loki.evaluation.intervals import paired_increase

    gqa_select, aggregate = _resolve(model, gqa_select, aggregate)
    dev = next(model.parameters()).device
    if dev.type != "cuda":
        return {"skipped": f"the fast path (compiled static cache, Triton kernels) needs CUDA; the model is on {dev}"}
    N, T = windows.shape
    name = f"loki-{basis_name}[{gqa_select}]"
    spec = MethodSpec(name, "loki", k=k, d=d, basis=basis_name, gqa_select=gqa_select, aggregate=aggregate,
                      score_format=score_format)
    if log:
        log(f"fast path: {setting_label(name, gqa_select, aggregate)} k={k} d={d}, {N} x {T} tokens, engine then "
            f"{', '.join(dtypes)} token by token")
    engine = perplexity(model, windows, spec, {basis_name: basis}, batch_size=max(1, N))
    rows = []
    for dt in dtypes:
        r = fast_path_perplexity(model, windows, basis, k=k, d=d, gqa_select=gqa_select, aggregate=aggregate,
                                 dtype=dt, compile=True, progress=progress, score_format=score_format)
        inc = paired_increase(r["token_nll"], engine.token_nll)
        rows.append({"dtype": r["dtype"], "ppl": r["ppl"], "rel_diff": r["ppl"] / engine.ppl - 1,
                     "increase": inc["increase"], "increase_lo": inc["lo"], "increase_hi": inc["hi"],
                     "seconds": r["seconds"], "steps": r["steps"], "compiled": r["compiled"]})
    return {"setting": {"name": name, "method": "loki", "basis": basis_name, "k": k, "d": d,
                        "gqa_select": gqa_select, "aggregate": aggregate, "score_format": score_format,
                        "seq_len": T, "windows": N},
            "engine": {"ppl": engine.ppl, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                       "seconds": engine.seconds, "bytes_fraction": engine.bytes_fraction},
            "rows": rows}
