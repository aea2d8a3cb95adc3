"""What the end-to-end decode benchmark (:mod:`loki.bench.e2e`) does to caches and clocks: each path's cache,
filling it with random keys and values, rewinding it, the SDPA backend contexts of the dense paths, the step
clock, the launch-gap state every timing starts in and freeing device memory between paths.

Shape letters: B batch, L layers, HQ query heads, HKV key/value heads, D head dim.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager, nullcontext

import torch

from loki._hf import config_head_dim

__all__ = ["fill_cache", "make_cache", "rewind", "sdpa_backend_config", "sdpa_context", "settle_launch_state"]


def _dims(config) -> tuple[int, int, int, int]:
    """(L, HQ, HKV, D)."""
    HQ = int(config.num_attention_heads)
    return int(config.num_hidden_layers), HQ, int(getattr(config, "num_key_value_heads", None) or HQ), \
        config_head_dim(config)


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


def make_cache(model, path: str, B: int, S: int):
    """The cache of ``path``: a ``DynamicCache`` (``sdpa_eager``), Loki's dynamic cache (``loki_eager``), a
    transformers ``StaticCache`` of S tokens (``sdpa_compiled``) or a Loki static cache (``loki_cache(static=True)``)
    of S tokens allocated for batch B (``loki_compiled``)."""
    if path == "sdpa_eager":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if path == "loki_eager":
        from loki.integrations.transformers import loki_cache

        return loki_cache(model)
    if path == "sdpa_compiled":
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=S)
    from loki.integrations.transformers import loki_cache

    return loki_cache(model, static=True, max_cache_len=S, batch_size=B)


def sdpa_context(backend: str):
    """The context the dense paths run under: ``default`` (torch's choice), ``flash`` (flash attention only) or
    ``native-gqa`` (:func:`_native_gqa`)."""
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


def settle_launch_state(device) -> bool:
    """Put the process in the launch-gap state of any program with a second stream, before a timing: one small
    kernel on a new stream, then a device sync.  Returns whether it ran (CUDA only).

    A compiled step's CUDA graph runs with short gaps between its kernels in a process that loaded its graphs from
    Inductor's cache and ran nothing on another stream, and with gaps about 0.3 us longer per kernel (4-5% of a Loki
    step at Llama-3-8B dims) once any kernel ran on a second stream, which a compile does and a serving stack does
    (results/launch-streams-h200-2026-12-01/NOTES.md).  Settling first makes a timing independent of whether this
    process compiled or loaded the step, and of the paths built before it: the state users with a second stream get.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    side, here = torch.cuda.Stream(device=dev), torch.cuda.current_stream(dev)
    x = torch.zeros(1, device=dev)
    side.wait_stream(here)
    with torch.cuda.stream(side):
        x.add_(1.0)
    here.wait_stream(side)
    torch.cuda.synchronize(dev)
    return True


def inductor_compiles() -> int:
    """Graphs Inductor has compiled in this process so far (FX graph cache misses and bypasses), as opposed to loaded
    from its on-disk cache: a step compiled in its own process reads 3-5% slower on Hopper cards, in every gap between
    its CUDA graph's kernels (docs/benchmarks.md), so a timing says which it had."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"])


def _free(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class PeakMemory:
    """``torch.cuda.max_memory_allocated`` over a span of one path on CUDA (the counter reset at the start):
    ``peak_gib`` (everything allocated at the peak, the weights included) and ``base_gib`` (allocated at the
    start); both None elsewhere."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.base_gib = self.peak_gib = None

    def start(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_gib = torch.cuda.memory_allocated(self.device) / 2**30
        return self

    def stop(self) -> float | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
        return self.peak_gib
