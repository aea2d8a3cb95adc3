"""End-to-end decode benchmark: whole transformers Llama models (random weights) decoding one token per step
over a long KV cache, four ways:

* ``sdpa_eager``: torch SDPA (``attn_implementation="sdpa"``) with a ``DynamicCache``, eager;
* ``sdpa_compiled``: SDPA with a transformers ``StaticCache``, the forward compiled with
  ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs);
* ``loki_eager``: Loki (``enable_loki``) on a ``DynamicCache`` whose layers rotate keys on write;
* ``loki_compiled``: Loki on a ``LokiStaticCache`` (preallocated, key prefix kept), compiled the same way.

Method: the model is built once per model-dims, directly on the device, in the benchmark dtype.  The cache of every
path is filled with the same random keys and values (drawn per layer from one seed, std 1) for the first
``n0 = S - steps`` positions through ``cache.update`` (no prefill forward); then ``steps`` decode steps run once
untimed (compilation, CUDA-graph recording, per-length SDPA plans and Triton specialisations), the cache is rewound
to ``n0`` and the same steps are timed (CUDA events around each step; ``time.perf_counter`` on the CPU).  The
cache length reached by the last timed step is S.

Byte floor of a step: the weights a decode step reads (every parameter except the input embedding table, of which
only B rows are read) plus the KV bytes attention must read (dense: K and V of every cached token; Loki: the d/D
key prefix of every token plus the k_f selected rows of K and V per selecting head), averaged over the timed steps
and divided by the device-to-device copy bandwidth measured in the same run.

Shape letters: B batch, S cache length, L layers, HQ query heads, HKV key/value heads, D head dim.
"""

from __future__ import annotations

import gc
import inspect
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from loki._checks import budget_counts, check_budget, resolve_d
from loki._hf import cache_keyword, config_head_dim
from loki.integrations.transformers.enable import default_gqa_mode

__all__ = [
    "BATCHES",
    "E2E_MODELS",
    "FLOOR_TARGET",
    "PATHS",
    "QUICK_SETTINGS",
    "SEQ_LENS",
    "TARGETS",
    "Setting",
    "build_model",
    "byte_floor",
    "fill_cache",
    "llama_config",
    "memory_needed",
    "rewind",
    "run_grid",
    "run_path",
    "settings",
    "weight_bytes",
]

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
#: Issue targets (H100): Loki's fastest path over the faster dense path, same run.
TARGETS = (("llama2-7b", 8, 4096, 1.35), ("llama3-8b", 16, 8192, 1.35), ("llama2-7b", 1, 16384, 1.2))
#: Compiled Loki's step time over its byte floor must stay within this.
FLOOR_TARGET = 1.25


@dataclass(frozen=True)
class Setting:
    model: str
    B: int
    S: int

    @property
    def id(self) -> str:
        return f"{self.model}-B{self.B}-S{self.S}"


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


def _dims(config) -> tuple[int, int, int, int]:
    """(L, HQ, HKV, D)."""
    HQ = int(config.num_attention_heads)
    return int(config.num_hidden_layers), HQ, int(getattr(config, "num_key_value_heads", None) or HQ), \
        config_head_dim(config)


def byte_floor(config, B: int, lengths, *, weights: int, itemsize: int, k_f: float, d_f, gqa_select: str) -> dict:
    """Bytes a decode step must read, averaged over steps attending ``lengths`` tokens each (the new token
    included): ``dense`` = weights + K and V of every token; ``loki`` = weights + the first d key dims of every
    token + K and V rows of the tokens selected per selecting head (every query head for ``gqa_select="query"``,
    every KV head for ``"kv"``): ``k_f`` is the budget, a fraction or an int count, counted by the one budget rule
    (``loki._checks.budget_counts``: ceil(k_f * length), or min(k, length))."""
    L, HQ, HKV, D = _dims(config)
    d = resolve_d(d_f, D)
    H = HQ if gqa_select == "query" else HKV
    lengths = list(lengths)
    counts = budget_counts(check_budget(k_f, name="k"), torch.tensor(lengths, dtype=torch.long)).tolist()
    dense = loki = 0
    for n, K in zip(lengths, counts):
        dense += L * B * HKV * n * D * itemsize * 2
        loki += L * B * (HKV * n * d + 2 * H * K * D) * itemsize
    return {"weights": weights, "d": d, "gqa_select": gqa_select,
            "dense_kv": dense / len(lengths), "loki_kv": loki / len(lengths),
            "dense": weights + dense / len(lengths), "loki": weights + loki / len(lengths)}


def memory_needed(config, B: int, S: int, *, itemsize: int, d_f) -> int:
    """Device bytes a setting needs beyond the weights: the largest cache of the four paths (K, V and a d/D key
    prefix at S tokens), transients of a few layers' keys (a float32 rotation on write, a concatenation step, K and V
    repeated to the query heads where SDPA does so for GQA) and 1.5 GiB of workspace."""
    L, HQ, HKV, D = _dims(config)
    d = resolve_d(d_f, D)
    layer_k = B * HKV * S * D * itemsize
    return L * (2 * layer_k + layer_k * d // D) + (5 + 2 * HQ // HKV) * layer_k + (3 << 29)


def fill_cache(cache, config, B: int, n0: int, *, device, dtype, seed: int = 0) -> None:
    """Write random keys and values (std 1, the same for every cache from the same seed) for positions
    ``0 .. n0-1`` of every layer through ``cache.update`` (``cache_position`` passed for the transformers versions
    whose static layers write at it)."""
    L, _, HKV, D = _dims(config)
    pos = torch.arange(n0, device=device)
    for layer in range(L):
        g = torch.Generator(device=device).manual_seed(seed + 1000 * layer)
        k = torch.randn(B, HKV, n0, D, generator=g, device=device, dtype=dtype)
        v = torch.randn(B, HKV, n0, D, generator=g, device=device, dtype=dtype)
        cache.update(k, v, layer, {"cache_position": pos})
        del k, v


def rewind(cache, n0: int) -> None:
    """Take ``cache`` back to its first ``n0`` tokens without re-filling it: static layers with a write counter
    (``cumulative_length``, transformers 5.2x) get the counter set to n0 (the stale entries beyond are masked,
    then overwritten); static layers that write at ``cache_position`` need nothing; dynamic layers are cropped."""
    for layer in cache.layers:
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(n0)
            if hasattr(layer, "cumulative_length_int"):
                layer.cumulative_length_int = n0
            continue
        if getattr(layer, "max_cache_len", None) is not None:
            continue
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4 and keys.shape[-2] > n0:
            layer.crop(n0 - keys.shape[-2])  # a negative count: tokens to remove (every 5.x version)


def _make_cache(model, path: str, B: int, S: int):
    if path == "sdpa_eager":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if path == "loki_eager":
        from loki.integrations.transformers import loki_cache

        return loki_cache(model)
    if path == "sdpa_compiled":
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=S)
    from loki.integrations.transformers import LokiStaticCache

    return LokiStaticCache(model, max_cache_len=S, batch_size=B)


def _sdpa_context(backend: str):
    if backend == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    if backend == "native-gqa":
        return _native_gqa()
    return nullcontext()


@contextmanager
def _native_gqa():
    """transformers' SDPA function hands grouped keys and values to SDPA as they are (``enable_gqa=True``) even
    with an attention mask; by default it copies them to every query head first (``repeat_kv``) whenever a mask is
    given, as a static cache's decode steps always do (``use_gqa_in_sdpa``)."""
    from transformers.integrations import sdpa_attention

    old = sdpa_attention.use_gqa_in_sdpa
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: True
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = old


def sdpa_backend_config() -> dict:
    """Which SDPA backends torch may pick (the global switches, as the dense paths ran under them)."""
    b = torch.backends.cuda
    out = {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled()}
    if hasattr(b, "cudnn_sdp_enabled"):
        out["cudnn"] = b.cudnn_sdp_enabled()
    return out


class _Clock:
    """Per-step times in ms: CUDA events on a GPU, perf_counter elsewhere."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, steps, fn) -> list[float]:
        if self.cuda:
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
            for i in range(steps):
                ev[i][0].record()
                fn(i)
                ev[i][1].record()
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in ev]
        out = []
        for i in range(steps):
            t = time.perf_counter()
            fn(i)
            out.append((time.perf_counter() - t) * 1e3)
        return out


def _free(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_path(model, path: str, *, B: int, S: int, steps: int, device, dtype, basis=None, k_f: float = 0.25,
             d_f=0.25, gqa_select: str = "query", sdpa_backend: str = "default", seed: int = 0,
             compile_mode: str | None = "reduce-overhead", aggregate: str = "sum") -> dict:
    """Time ``steps`` decode steps of ``path`` reaching cache length S (after an untimed pass over the same
    steps); returns ms per step (median, mean, min), tokens/s (B / median), the first pass's wall time (compilation
    and warm-up), what ran (cache and layer classes, attention implementation, finite logits) and the largest
    difference between the last step's logits in the two passes (``rewind_diff``: 0 up to rounding when the
    rewound cache holds what the first pass saw).  ``compile_mode=None`` runs a ``*_compiled`` path's static
    cache without compiling (tests on the CPU)."""
    from loki.integrations.transformers import disable_loki, enable_loki

    dev = torch.device(device)
    static = path.endswith("_compiled")
    compiled = static and compile_mode is not None
    if compiled and dev.type != "cuda":
        return {"skipped": "compiled paths need CUDA (mode='reduce-overhead' records CUDA graphs)"}
    n0 = S - steps
    cfg = model.config
    if path.startswith("loki"):
        enable_loki(model, basis, k=k_f, d=d_f, gqa_select=gqa_select, aggregate=aggregate)
    else:
        disable_loki(model)
    cache = fn = out = None
    try:
        cache = _make_cache(model, path, B, S)
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
        with torch.no_grad(), _sdpa_context(sdpa_backend):
            t0 = time.perf_counter()
            for i in range(steps):
                step(i)
            clock.sync()
            first_pass_s = time.perf_counter() - t0
            ref = last.pop("out").logits[:, -1].float().clone()
            rewind(cache, n0)
            t0 = time.perf_counter()
            times = clock.run(steps, step)
            wall = (time.perf_counter() - t0) * 1e3 / steps
            out = last.pop("out")
            logits = out.logits[:, -1].float()
            finite = bool(torch.isfinite(logits).all().item())
            rewind_diff = float((logits - ref).abs().max().item())
        layer0 = cache.layers[0] if getattr(cache, "layers", None) else None
        srt = sorted(times)
        med = srt[len(srt) // 2] if len(srt) % 2 else 0.5 * (srt[len(srt) // 2 - 1] + srt[len(srt) // 2])
        return {
            "ms_median": med, "ms_mean": sum(times) / len(times), "ms_min": srt[0], "wall_ms_per_step": wall,
            "tokens_per_s": B / (med * 1e-3), "first_pass_s": first_pass_s, "steps": steps, "finite": finite,
            "rewind_diff": rewind_diff, "compiled": compiled,
            # compilation and recording: the first pass beyond what its steps take once warm
            "compile_s": max(0.0, first_pass_s - sum(times) * 1e-3) if compiled else None,
            "cache": type(cache).__name__, "cache_layer": type(layer0).__name__ if layer0 is not None else None,
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
        }
    finally:
        cache = fn = out = None  # the closure above sees these cells: the cache and the graphs are released
        if path.startswith("loki"):
            disable_loki(model)
        if compiled:
            torch._dynamo.reset()  # drops the compiled graphs and their CUDA-graph memory pool
        _free(dev)


def _loki_import_error() -> str | None:
    try:
        from loki.integrations.transformers import LokiStaticCache  # noqa: F401
    except ImportError as exc:
        return f"LokiStaticCache is not available in this checkout ({exc})"
    return None


def run_grid(grid, *, device="cuda", dtype=torch.bfloat16, models=None, paths=PATHS, steps: int = 32,
             k_f: float = 0.25, d_f=0.25, gqa_select: str = "auto", sdpa_backend: str = "default",
             copy_gbps: float | None = None, time_budget_s: float | None = None, seed: int = 0,
             compile_mode: str | None = "reduce-overhead", free_bytes: int | None = None, on_setting=None,
             log=print, aggregate: str = "sum") -> list[dict]:
    """Run ``paths`` on every :class:`Setting` of ``grid`` (one model built per model name, settings that do not
    fit the device memory or the time budget reported as skipped: a path is not started when the time spent plus
    its last duration would pass ``time_budget_s``).  ``models`` maps names to ``LlamaConfig``
    fields (default :data:`E2E_MODELS`); ``gqa_select="auto"`` is "kv" for GQA models, else "query";
    ``aggregate``: how a shared selection combines the group's scores ("sum", the timed default; "auto" as
    ``enable_loki`` resolves it).
    ``free_bytes`` overrides the device memory free beside the model (measured on CUDA, unchecked elsewhere).
    ``on_setting(result)`` is called after each setting (for incremental output).  Returns one dict per setting."""
    from loki.basis import PCABasis

    models = models or E2E_MODELS
    dev = torch.device(device)
    start = time.perf_counter()
    itemsize = torch.tensor([], dtype=dtype).element_size()
    results, cost = [], {}
    for name in dict.fromkeys(s.model for s in grid):
        config = llama_config(models[name])
        L, HQ, HKV, D = _dims(config)
        mode = gqa_select if gqa_select != "auto" else ("kv" if HQ != HKV else "query")
        agg = default_gqa_mode(config, "loki", mode, aggregate)[1]
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
            res = {"id": s.id, "model": name, "B": s.B, "S": s.S, "steps": steps, "n0": s.S - steps,
                   "k_f": k_f, "d_f": d_f, "gqa_select": mode, "aggregate": agg, "model_build_s": build_s,
                   "paths": {}}
            wb = weight_bytes(model, s.B)
            res["bytes"] = byte_floor(config, s.B, range(s.S - steps + 1, s.S + 1), weights=wb, itemsize=itemsize,
                                      k_f=k_f, d_f=d_f, gqa_select=mode)
            if copy_gbps:
                res["floor_ms"] = {p: res["bytes"][p] / (copy_gbps * 1e9) * 1e3 for p in ("dense", "loki")}
            need = memory_needed(config, s.B, s.S, itemsize=itemsize, d_f=d_f)
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
                                               basis=basis, k_f=k_f, d_f=d_f, gqa_select=mode,
                                               sdpa_backend=sdpa_backend, seed=seed, compile_mode=compile_mode,
                                               aggregate=agg)
                except torch.cuda.OutOfMemoryError as exc:
                    res["paths"][p] = {"skipped": f"out of memory: {str(exc).splitlines()[0][:200]}"}
                except Exception as exc:  # noqa: BLE001 - one failing path is reported, the others still run
                    res["paths"][p] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                _free(dev)
                cost[p] = time.perf_counter() - t0  # a path's last duration predicts its next one
                r = res["paths"][p]
                log(f"{s.id} {p}: " + (f"{r['ms_median']:.2f} ms/step, {r['tokens_per_s']:.0f} tok/s, first pass "
                                       f"{r['first_pass_s']:.1f} s" if "ms_median" in r else
                                       r.get("skipped") or r.get("error")))
            summarize(res)
            results.append(res)
            if on_setting is not None:
                on_setting(res)
        del model, basis
        _free(dev)
    return results


def summarize(res: dict) -> dict:
    """Add the comparisons to a setting's result: the best dense and best Loki paths (by median ms), Loki's
    speed-up over the faster dense path, and each Loki path's time over the Loki byte floor."""
    ms = {p: r["ms_median"] for p, r in res["paths"].items() if "ms_median" in r}
    dense = {p: v for p, v in ms.items() if p.startswith("sdpa")}
    loki = {p: v for p, v in ms.items() if p.startswith("loki")}
    if dense:
        res["best_dense"] = min(dense, key=dense.get)
    if loki:
        res["best_loki"] = min(loki, key=loki.get)
    if dense and loki:
        res["speedup"] = dense[res["best_dense"]] / loki[res["best_loki"]]
    floor = res.get("floor_ms")
    if floor:
        res["x_floor"] = {p: v / floor["loki" if p.startswith("loki") else "dense"] for p, v in ms.items()}
    return res
