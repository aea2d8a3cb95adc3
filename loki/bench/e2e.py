"""End-to-end decode benchmark: whole transformers Llama models (random weights) decoding one token per step
over a long KV cache, four ways:

* ``sdpa_eager``: torch SDPA (``attn_implementation="sdpa"``) with a ``DynamicCache``, eager;
* ``sdpa_compiled``: SDPA with a transformers ``StaticCache``, compiled (``mode="reduce-overhead"``: CUDA graphs);
* ``loki_eager``: Loki (``enable_loki``) on a ``DynamicCache`` whose layers rotate keys on write;
* ``loki_compiled``: Loki on a static ``loki_cache`` (preallocated, key prefix kept), compiled the same way.

Loki runs in the default configuration, the one the accuracy suite reports and gates: on a GQA model
(``llama3-8b``) one selection per KV group with each query head's approximate scores softmax-normalised before the
group's maximum (``gqa_select="kv"``, ``aggregate="softmax-max"``), on a model without GQA (``llama2-7b``) per
query head; ``aggregate="sum"`` (``loki bench --e2e --aggregate sum``) times raw sums instead.  Every result
records the ``gqa_select`` and ``aggregate`` it ran.

Method: the model is built once per model-dims, directly on the device, in the benchmark dtype.  The cache of every
path is filled with the same random keys and values (drawn per layer from one seed, std 1) for the first
``n0 = S - steps`` positions through ``cache.update`` (no prefill forward); then ``steps`` decode steps run once
untimed (compilation, CUDA-graph recording, SDPA plans, Triton specialisations), the cache is rewound to ``n0`` and
the same steps are timed (CUDA events around each step; ``time.perf_counter`` on the CPU); the last reaches S.
``compiled_here``: this process compiled the step.  On CUDA every timing first runs one small kernel on a second
stream (``e2e_cache.settle_launch_state``), so a step compiled here and one loaded from Inductor's cache are timed in
the same launch-gap state, the one any program with a second stream has (docs/benchmarks.md).
With ``generate=True`` each path then times whole greedy ``model.generate`` calls on the same cache
(:mod:`loki.bench.e2e_generate`: per token, (t(N + 1 new tokens) - t(1)) / N).  On CUDA each phase records its peak
of ``torch.cuda.max_memory_allocated`` (weights included).

Byte floor of a step: the weights a decode step reads (every parameter except the input embedding table, of which
only B rows are read) plus the KV bytes attention must read (dense: K and V of every cached token; Loki: the
score copy of every token plus the k selected rows of K and V per selecting head), averaged over the timed steps
and divided by the device-to-device copy bandwidth measured in the same run.  The byte ceiling of Loki's speed-up
is the dense floor over the Loki floor (bytes over bytes: the bandwidth cancels); ``fraction_of_ceiling`` = the
measured speed-up over that ceiling.

Shape letters: B batch, S cache length, L layers, HQ query heads, HKV key/value heads, D head dim.
"""

from __future__ import annotations

import inspect
import re
import statistics
import time
from dataclasses import dataclass

import torch

from loki._checks import budget_counts, check_budget, resolve_d
from loki._hf import cache_keyword
from loki.reference.score_formats import score_copy_bytes
from loki.settings import LokiSettings

from .e2e_cache import (
    PeakMemory,
    _Clock,
    _dims,
    _free,
    fill_cache,
    inductor_compiles,
    make_cache,
    rewind,
    sdpa_context,
    settle_launch_state,  # every timing starts in one launch-gap state
)
from .e2e_cache import _native_gqa as _native_gqa  # re-exported: scripts import it from here
from .e2e_cache import sdpa_backend_config as sdpa_backend_config  # re-exported: the report imports it from here
from .e2e_generate import PROMPTS, time_generate

__all__ = ["BATCHES", "CEILING_TARGET", "E2E_MODELS", "FLOOR_TARGET", "PATHS", "PROMPTS", "QUICK_SETTINGS", "SEQ_LENS",
           "TARGETS", "Setting", "build_model", "byte_floor", "fill_cache", "llama_config", "memory_needed", "rewind",
           "run_grid", "run_path", "settings", "summarize", "weight_bytes"]

#: Model dimensions (transformers ``LlamaConfig`` fields); weights are random.
E2E_MODELS = {
    "llama2-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                      head_dim=128, intermediate_size=11008, vocab_size=32000, rope_theta=10000.0,
                      max_position_embeddings=32768),
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=32768),
}
PATHS = ("sdpa_eager", "sdpa_compiled", "loki_eager", "loki_compiled")
BATCHES = (1, 8, 16)
SEQ_LENS = (4096, 16384)
#: ``--quick``: the three settings with speed targets, plus the GQA model at B=1 and a long cache.
QUICK_SETTINGS = (("llama2-7b", 8, 4096), ("llama3-8b", 16, 8192), ("llama2-7b", 1, 16384), ("llama3-8b", 1, 16384))
#: Compiled Loki's step time over its byte floor must stay within this.
FLOOR_TARGET = 1.25
#: Every setting's measured speed-up over its byte ceiling's (dense floor / Loki floor) must reach this.
CEILING_TARGET = 0.85
_ID = re.compile(r"^(?P<model>.+)-B(?P<B>\d+)-S(?P<S>\d+)(?:-k(?P<k>\d+(?:\.\d*)?(?:e-?\d+)?))?$")


@dataclass(frozen=True)
class Setting:
    """One end-to-end setting: model dims, batch, cache length and optionally its own budget ``k`` (an int count
    of tokens or a fraction in (0, 1]; None: the grid's ``k_f``).  Ids: ``<model>-B<B>-S<S>`` without a budget
    (the grid's, 0.25 by default), ``<model>-B<B>-S<S>-k<k>`` with one (``llama3-8b-B1-S131072-k2048``,
    ``llama3-8b-B8-S32768-k0.5``)."""

    model: str
    B: int
    S: int
    k: int | float | None = None

    @property
    def id(self) -> str:
        return f"{self.model}-B{self.B}-S{self.S}" + ("" if self.k is None else f"-k{self.k}")

    @classmethod
    def parse(cls, text: str) -> Setting:
        """The setting of an id (ValueError for another string); a budget with a '.' or an exponent is a
        fraction, else a count."""
        m = _ID.match(text)
        if m is None:
            raise ValueError(f"not a setting id <model>-B<B>-S<S>[-k<k>]: {text!r}")
        k = m["k"]
        if k is not None:
            k = float(k) if any(c in k for c in ".e") else int(k)
            check_budget(k, name="k")
        return cls(m["model"], int(m["B"]), int(m["S"]), k)

    def budget(self, k_f):
        """This setting's budget: its own, else the grid's ``k_f``."""
        return k_f if self.k is None else self.k


#: Issue targets (H100): Loki's fastest path over the faster dense path, same run.
TARGETS = ((Setting("llama2-7b", 8, 4096), 1.35), (Setting("llama3-8b", 16, 8192), 1.35),
           (Setting("llama2-7b", 1, 16384), 1.2), (Setting("llama3-8b", 1, 131072, 2048), 1.5))


def settings(models=tuple(E2E_MODELS), batches=BATCHES, seq_lens=SEQ_LENS) -> list[Setting]:
    return [Setting(m, b, s) for m in models for b in batches for s in seq_lens]


def llama_config(dims: dict):
    from transformers import LlamaConfig

    cfg = LlamaConfig(tie_word_embeddings=False, use_cache=True, **dims)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(config, device, dtype=torch.bfloat16):
    """A ``LlamaForCausalLM`` with random weights (transformers' own init), built directly on ``device`` in
    ``dtype`` (no float32 copy, no CPU init), in eval mode without gradients, on SDPA attention."""
    from transformers import LlamaForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    for p in model.parameters():  # float32 buffers (the rotary inv_freq) stay so, as in a bf16 checkpoint load
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    model.eval().requires_grad_(False)
    model.set_attn_implementation("sdpa")
    return model


def weight_bytes(model, B: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the input embedding table, of which
    only the B rows of the new tokens are read (a table tied to the LM head is read whole, as the head)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not emb:
        total -= emb.numel() * emb.element_size()
        total += B * emb.shape[1] * emb.element_size()
    return total


def byte_floor(config, B: int, lengths, *, weights: int, itemsize: int, k_f: float, d_f, gqa_select: str,
               score_format: str = "native") -> dict:
    """Bytes a decode step must read, averaged over steps attending ``lengths`` tokens each (the new token
    included): ``dense`` = weights + K and V of every token; ``loki`` = weights + the first d key dims of every
    token + K and V rows of the tokens selected per selecting head (every query head for ``gqa_select="query"``,
    every KV head for ``"kv"``): ``k_f`` is the budget, a fraction or an int count, counted by the one budget rule
    (``loki._checks.budget_counts``: ceil(k_f * length), or min(k, length)).  ``score_format``: the score copy's
    format; "int8" reads d one-byte codes and a 2-byte scale per token instead of d cache elements."""
    L, HQ, HKV, D = _dims(config)
    d = resolve_d(d_f, D)
    score_bytes = score_copy_bytes(score_format, d, itemsize)
    H = HQ if gqa_select == "query" else HKV
    lengths = list(lengths)
    counts = budget_counts(check_budget(k_f, name="k"), torch.tensor(lengths, dtype=torch.long)).tolist()
    dense = loki = 0
    for n, K in zip(lengths, counts):
        dense += L * B * HKV * n * D * itemsize * 2
        loki += L * B * (HKV * n * score_bytes + 2 * H * K * D * itemsize)
    return {"weights": weights, "d": d, "gqa_select": gqa_select, "score_format": score_format,
            "dense_kv": dense / len(lengths), "loki_kv": loki / len(lengths),
            "dense": weights + dense / len(lengths), "loki": weights + loki / len(lengths)}


def memory_needed(config, B: int, S: int, *, itemsize: int, d_f, key_prefix: bool = True,
                  score_format: str = "native") -> int:
    """Device bytes a setting needs beyond the weights: the largest cache of the four paths (K, V and, unless
    ``key_prefix`` is False, the score copy of d dims in ``score_format`` at S tokens), transients of a few layers'
    keys (a float32 rotation on write, a concatenation step, K and V repeated to the query heads where SDPA does so
    for GQA) and 1.5 GiB of workspace."""
    L, HQ, HKV, D = _dims(config)
    layer_k = B * HKV * S * D * itemsize
    prefix = B * HKV * S * score_copy_bytes(score_format, resolve_d(d_f, D), itemsize) if key_prefix else 0
    return int(L * (2 * layer_k + prefix)) + (5 + 2 * HQ // HKV) * layer_k + (3 << 29)


def run_path(model, path: str, *, B: int, S: int, steps: int, device, dtype, basis=None, k_f: float = 0.25,
             d_f=0.25, gqa_select: str = "auto", sdpa_backend: str = "native-gqa", seed: int = 0,
             compile_mode: str | None = "reduce-overhead", aggregate: str = "auto", generate: bool = False,
             generate_tokens: int | None = None, generate_reps: int = 3, generate_prompt: str = "cache",
             score_format: str = "native", key_prefix: bool = True) -> dict:
    """Time ``steps`` decode steps of ``path`` reaching cache length S (after an untimed pass over the same
    steps); returns ms per step (median, mean, min), tokens/s (B / median), the first pass's wall time (compilation
    and warm-up), what ran (cache and layer classes, attention implementation, finite logits), the largest
    difference between the last step's logits in the two passes (``rewind_diff``: 0 up to rounding when the
    rewound cache holds what the first pass saw), for a Loki path the ``gqa_select`` and ``aggregate`` it ran, and
    on CUDA the peak memory of these steps (``peak_memory_gib``, weights included; ``base_memory_gib`` allocated
    before the path; None elsewhere).  ``k_f``: the budget, a fraction or an int count of tokens; ``gqa_select``,
    ``aggregate``, ``score_format``, ``key_prefix``: ``enable_loki``'s ("auto": the default configuration).
    ``compile_mode=None`` runs a ``*_compiled`` path's static cache without compiling (tests on the CPU).

    ``generate=True``: then whole greedy ``model.generate`` calls on the same cache
    (:func:`loki.bench.e2e_generate.time_generate`; ``generate_tokens`` = N, default ``steps``; the compiled
    paths let ``generate`` compile its decode step as it does for a static cache, after the forward's compiled
    graphs are dropped): ``generate_ms_per_token`` and the fields beside it, ``generate_peak_memory_gib``, or
    ``generate_error`` when the calls fail (the forward's numbers stay)."""
    from loki.integrations.transformers import disable_loki, enable_loki, state_of

    dev = torch.device(device)
    static = path.endswith("_compiled")
    compiled = static and compile_mode is not None
    if compiled and dev.type != "cuda":
        return {"skipped": "compiled paths need CUDA (mode='reduce-overhead' records CUDA graphs)"}
    n0 = S - steps
    cfg = model.config
    ran = {}
    if path.startswith("loki"):
        enable_loki(model, basis, k=k_f, d=d_f, gqa_select=gqa_select, aggregate=aggregate, score_format=score_format,
                    key_prefix=key_prefix)
        c = state_of(model).settings  # the settings enable_loki resolved: what runs
        ran = {"gqa_select": c.gqa_select.value, "aggregate": c.aggregate.value, "score_format": c.score_format.value,
               "backend": c.backend.value, "key_prefix": c.prefix_dims is not None}
    else:
        disable_loki(model)
    cache = fn = None
    memory = PeakMemory(dev)
    try:
        memory.start()
        cache = make_cache(model, path, B, S)
        fill_cache(cache, cfg, B, n0, device=dev, dtype=dtype, seed=seed)
        g = torch.Generator(device="cpu").manual_seed(seed + 7)
        ids = torch.randint(0, int(cfg.vocab_size), (steps, B, 1), generator=g).to(dev)
        pos_ids = [torch.full((B, 1), n0 + i, dtype=torch.long, device=dev) for i in range(steps)]
        cache_pos = [torch.tensor([n0 + i], dtype=torch.long, device=dev) for i in range(steps)]
        fn = torch.compile(model.forward, mode=compile_mode, fullgraph=True) if compiled else model.forward
        key = cache_keyword(model)
        with_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None) if compiled else None
        last = {}

        def step(i):
            kw = {key: cache, "position_ids": pos_ids[i], "use_cache": True}
            if with_cache_position:
                kw["cache_position"] = cache_pos[i]
            if mark is not None:
                mark()
            last["out"] = fn(input_ids=ids[i], **kw)

        clock = _Clock(dev)
        with torch.no_grad(), sdpa_context(sdpa_backend):
            t0, n_compiles = time.perf_counter(), inductor_compiles()
            for i in range(steps):
                step(i)
            clock.sync()
            first_pass_s, compiled_here = time.perf_counter() - t0, inductor_compiles() > n_compiles
            ref = last.pop("out").logits[:, -1].float().clone()
            rewind(cache, n0)
            settled = settle_launch_state(dev)  # the same launch-gap state whether compiled here or loaded
            t0 = time.perf_counter()
            times = clock.run(steps, step)
            wall = (time.perf_counter() - t0) * 1e3 / steps
            logits = last.pop("out").logits[:, -1].float()
            finite = bool(torch.isfinite(logits).all().item())
            rewind_diff = float((logits - ref).abs().max().item())
            rewind(cache, n0)  # timed once more: is it the process or the moment after compiling (benchmarks.md)
            times_again = clock.run(steps, step)
        logits = ref = last["out"] = None
        memory.stop()
        layer0 = cache.layers[0] if getattr(cache, "layers", None) else None
        med = statistics.median(times)
        res = {
            "ms_median": med, "ms_mean": sum(times) / len(times), "ms_min": min(times), "wall_ms_per_step": wall,
            "ms_median_again": statistics.median(times_again),
            "tokens_per_s": B / (med * 1e-3), "first_pass_s": first_pass_s, "steps": steps, "finite": finite,
            "rewind_diff": rewind_diff, "compiled": compiled, "compiled_here": compiled_here,
            "launch_state_settled": settled,
            # compilation and recording: the first pass beyond what its steps take once warm
            "compile_s": max(0.0, first_pass_s - sum(times) * 1e-3) if compiled else None,
            "cache": type(cache).__name__, "cache_layer": type(layer0).__name__ if layer0 is not None else None,
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
            "peak_memory_gib": memory.peak_gib, "base_memory_gib": memory.base_gib, **ran,
        }
        if generate:
            fn = step = None
            if compiled:
                torch._dynamo.reset()  # the forward's graphs and their memory pool: generate compiles its own
            _free(dev)
            gen_memory = PeakMemory(dev).start()
            try:
                with sdpa_context(sdpa_backend):
                    res.update(time_generate(model, cache, B=B, S=S, new_tokens=generate_tokens or steps, key=key,
                                             device=dev, reps=generate_reps, prompt=generate_prompt,
                                             compile=compile_mode is not None, seed=seed))
                res["generate_compiled"] = compiled
            except torch.cuda.OutOfMemoryError as exc:
                res["generate_error"] = f"out of memory: {str(exc).splitlines()[0][:200]}"
            except Exception as exc:  # noqa: BLE001 - the forward's numbers are kept, the failure reported
                res["generate_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            res["generate_peak_memory_gib"] = gen_memory.stop()
        return res
    finally:
        cache = fn = None  # the closure above sees these cells: the cache and the graphs are released
        if path.startswith("loki"):
            disable_loki(model)
        if compiled:
            torch._dynamo.reset()  # drops the compiled graphs and their CUDA-graph memory pool
            if generate and hasattr(model, "_compiled_call"):
                del model._compiled_call  # generate's compiled forward (transformers keeps it on the model)
        _free(dev)


def _loki_import_error() -> str | None:
    try:
        from loki.integrations.transformers import loki_cache  # noqa: F401
    except ImportError as exc:
        return f"loki_cache is not available in this checkout ({exc})"
    return None


def run_grid(grid, *, device="cuda", dtype=torch.bfloat16, models=None, paths=PATHS, steps: int = 32,
             k_f: float = 0.25, d_f="auto", gqa_select: str = "auto", sdpa_backend: str = "native-gqa",
             copy_gbps: float | None = None, time_budget_s: float | None = None, seed: int = 0,
             compile_mode: str | None = "reduce-overhead", free_bytes: int | None = None, on_setting=None,
             log=print, aggregate: str = "auto", generate: bool = False, generate_tokens: int | None = None,
             generate_reps: int = 3, generate_prompt: str = "cache", score_format: str = "auto",
             key_prefix: bool = True) -> list[dict]:
    """Run ``paths`` on every :class:`Setting` of ``grid`` (one model built per model name, settings that do not
    fit the device memory or the time budget reported as skipped: a path is not started when the time spent plus
    its last duration would pass ``time_budget_s``).  ``models`` maps names to ``LlamaConfig``
    fields (default :data:`E2E_MODELS`); ``gqa_select="auto"`` is "kv" for GQA models, else "query";
    ``aggregate``: how a shared selection combines the group's scores ("auto", the default: "softmax-max" as
    ``enable_loki`` resolves it, the configuration the accuracy suite gates; "sum": raw sums).  Each result records
    the ``gqa_select`` and ``aggregate`` it ran (``aggregate`` "sum" for per-query-head selection, which has none).
    ``k_f``: the budget of settings without their own (``Setting.k``), a fraction or an int count of tokens;
    ``score_format``, ``d_f``, ``key_prefix``: ``enable_loki``'s score copy, its dims and whether the caches keep it
    ("auto": enable_loki's, the int8 copy of d_f 0.5).  ``generate`` and ``generate_*``: whole ``generate`` calls per
    path (:func:`run_path`).
    ``free_bytes`` overrides the device memory free beside the model (measured on CUDA, unchecked elsewhere).
    ``on_setting(result)`` is called after each setting (for incremental output).  Returns one dict per setting."""
    from loki.basis import PCABasis

    models = models or E2E_MODELS
    loki = LokiSettings(d=d_f, score_format=score_format, key_prefix=key_prefix)  # "auto" as enable_loki decides it
    d_f, score_format = loki.d, loki.score_format.value
    dev = torch.device(device)
    start = time.perf_counter()
    itemsize = torch.tensor([], dtype=dtype).element_size()
    results, cost = [], {}
    for name in dict.fromkeys(s.model for s in grid):
        config = llama_config(models[name])
        L, HQ, HKV, D = _dims(config)
        resolved = LokiSettings(gqa_select=gqa_select, aggregate=aggregate, backend="torch").resolve(config)
        mode, agg = resolved.gqa_select.value, resolved.aggregate.value  # as enable_loki resolves "auto"
        t0 = time.perf_counter()
        model = build_model(config, dev, dtype)
        build_s = time.perf_counter() - t0
        basis = PCABasis.random(L, HKV, D, seed=seed)
        free = free_bytes
        if free is None and dev.type == "cuda":
            torch.cuda.synchronize()
            free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        log(f"# {name}: built in {build_s:.1f} s; gqa_select={mode}" + (f", aggregate={agg}" if mode == "kv" else ""))
        for s in (s for s in grid if s.model == name):
            k = s.budget(k_f)
            res = {"id": s.id, "model": name, "B": s.B, "S": s.S, "steps": steps, "n0": s.S - steps,
                   "k_f": k, "d_f": d_f, "gqa_select": mode, "aggregate": agg, "score_format": score_format,
                   "key_prefix": key_prefix, "model_build_s": build_s, "paths": {}}
            if generate:
                res["generate"] = {"new_tokens": generate_tokens or steps, "reps": generate_reps,
                                   "prompt": generate_prompt}
            wb = weight_bytes(model, s.B)
            res["bytes"] = byte_floor(config, s.B, range(s.S - steps + 1, s.S + 1), weights=wb, itemsize=itemsize,
                                      k_f=k, d_f=d_f, gqa_select=mode, score_format=score_format)
            if copy_gbps:
                res["floor_ms"] = {p: res["bytes"][p] / (copy_gbps * 1e9) * 1e3 for p in ("dense", "loki")}
            need = memory_needed(config, s.B, s.S, itemsize=itemsize, d_f=d_f, key_prefix=key_prefix,
                                 score_format=score_format)
            if free is not None and need > free:
                res["skipped"] = (f"does not fit: the caches need about {need / 2**30:.1f} GiB beside the weights, "
                                  f"{free / 2**30:.1f} GiB are free")
            for p in paths:
                if "skipped" in res:
                    break
                spent = time.perf_counter() - start
                if time_budget_s is not None and spent + cost.get(p, 0.0) > time_budget_s:
                    res["paths"][p] = {"skipped": f"time budget: {spent:.0f} s spent, this path took "
                                                  f"{cost.get(p, 0.0):.0f} s last time, budget {time_budget_s:.0f} s"}
                    continue
                t0 = time.perf_counter()
                why = _loki_import_error() if p == "loki_compiled" else None
                if why:
                    res["paths"][p] = {"skipped": why}
                    continue
                try:
                    res["paths"][p] = run_path(model, p, B=s.B, S=s.S, steps=steps, device=dev, dtype=dtype,
                                               basis=basis, k_f=k, d_f=d_f, gqa_select=mode,
                                               sdpa_backend=sdpa_backend, seed=seed, compile_mode=compile_mode,
                                               aggregate=agg, generate=generate, generate_tokens=generate_tokens,
                                               generate_reps=generate_reps, generate_prompt=generate_prompt,
                                               score_format=score_format, key_prefix=key_prefix)
                except torch.cuda.OutOfMemoryError as exc:
                    res["paths"][p] = {"skipped": f"out of memory: {str(exc).splitlines()[0][:200]}"}
                except Exception as exc:  # noqa: BLE001 - one failing path is reported, the others still run
                    res["paths"][p] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                _free(dev)
                cost[p] = time.perf_counter() - t0  # a path's last duration predicts its next one
                log(f"{s.id} {p}: {_path_line(res['paths'][p])}")
            summarize(res)
            results.append(res)
            if on_setting is not None:
                on_setting(res)
        del model, basis
        _free(dev)
    return results


def _path_line(r: dict) -> str:
    if "ms_median" not in r:
        return r.get("skipped") or r.get("error")
    again = f" ({r['ms_median_again']:.2f} timed again)" if "ms_median_again" in r else ""
    line = (f"{r['ms_median']:.2f} ms/step{again}, {r['tokens_per_s']:.0f} tok/s, first pass {r['first_pass_s']:.1f} s"
            + (" (compiled in this process)" if r.get("compiled_here") else ""))
    if r.get("peak_memory_gib") is not None:
        line += f", peak {r['peak_memory_gib']:.1f} GiB"
    if "generate_ms_per_token" in r:
        line += f"; generate {r['generate_ms_per_token']:.2f} ms/token"
    elif "generate_error" in r:
        line += f"; generate failed: {r['generate_error']}"
    return line


def _best(times: dict, prefix: str):
    side = {p: v for p, v in times.items() if p.startswith(prefix)}
    return min(side, key=side.get) if side else None


def _ceiling_fields(res: dict, speedup_key: str, prefix: str) -> None:
    c, x = res.get("ceiling_speedup"), res.get(speedup_key)
    if c is None or x is None:
        return
    res[prefix + "fraction_of_ceiling"] = x / c
    res[prefix + "fraction_of_ceiling_gain"] = (x - 1.0) / (c - 1.0) if c > 1.0 else None


def summarize(res: dict) -> dict:
    """Add the comparisons to a setting's result: the best dense and best Loki paths (by median ms), Loki's
    speed-up over the faster dense path, each path's time over its byte floor (``x_floor``), the byte ceiling of
    the speed-up (``ceiling_speedup`` = dense bytes / Loki bytes = dense floor / Loki floor), the speed-up as a
    fraction of it (``fraction_of_ceiling`` = speed-up / ceiling, the headline; ``fraction_of_ceiling_gain`` =
    (speed-up - 1) / (ceiling - 1), the share of the possible gain reached), and where ``generate`` ran the same
    at the level of whole ``generate`` calls (``best_dense_generate``, ``best_loki_generate``,
    ``generate_speedup``, ``generate_fraction_of_ceiling``, ``generate_fraction_of_ceiling_gain``)."""
    ms = {p: r["ms_median"] for p, r in res["paths"].items() if "ms_median" in r}
    for key, times, prefix in (("speedup", ms, ""), ("generate_speedup", {
            p: r["generate_ms_per_token"] for p, r in res["paths"].items()
            if (r.get("generate_ms_per_token") or 0) > 0}, "_generate")):
        dense, loki = _best(times, "sdpa"), _best(times, "loki")
        if dense:
            res["best_dense" + prefix] = dense
        if loki:
            res["best_loki" + prefix] = loki
        if dense and loki:
            res[key] = times[dense] / times[loki]
    b = res.get("bytes")
    if b and b.get("loki"):
        res["ceiling_speedup"] = b["dense"] / b["loki"]
    _ceiling_fields(res, "speedup", "")
    _ceiling_fields(res, "generate_speedup", "generate_")
    floor = res.get("floor_ms")
    if floor:
        res["x_floor"] = {p: v / floor["loki" if p.startswith("loki") else "dense"] for p, v in ms.items()}
    return res
