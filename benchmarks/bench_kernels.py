"""Decode-attention kernel speed (CUDA only): Loki against torch SDPA, eager attention and SparQ.

Every number is a device-timed median from the benchmark harness (``loki.bench.harness.bench_config``:
``triton.testing.do_bench``, L2 cleared before each repetition, distinct K and V, inputs from the shared
factory ``loki.testing.inputs.make_decode_inputs`` drawn on the device, through ``harness.make_bench_inputs``),
reported by ``track_*`` functions because ASV's own timer is wall clock.  ``*_graph_*`` benchmarks are the
harness's CUDA-graph replays of the same calls (no launch overhead, as a serving loop would run them).

``setup_cache`` measures the whole grid of a class once, in one process, so a speed-up and the two times it
divides come from the same run; the ``track_*`` functions only read the values.  Without CUDA the cache
records why and every ``setup`` skips (``SkipNotImplemented``, reported by ASV as skipped, not failed).

Parameters (``config``): harness configuration ids, ``<model>-B<B>-S<S>-k<k_f>-d<d_f>-<dtype>``, from
``benchmarks/_shapes.py``; ``SplitSelect`` takes ``rows`` (``<rows>x<S>-k<k>``, ``SELECT_SHAPES`` there).
"""

from __future__ import annotations

from ._common import SkipNotImplemented, skip, unit, why_not_runnable_on_gpu  # noqa: F401 (re-exported)
from ._shapes import KERNEL_CONFIGS, SELECT_CONFIGS, SELECT_SHAPES, SPARQ_CONFIGS, UNAVAILABLE, config_by_id

MIB = 1 << 20


def _why_not_runnable() -> str | None:
    return why_not_runnable_on_gpu(("loki.bench.harness", "loki.kernels"), "the kernels or the harness")


def _peak_memory_mib(cfg) -> float:
    """Memory the Loki decode step allocates beyond its inputs (scores, selection, split partials), in MiB:
    the peak of ``torch.cuda.max_memory_allocated`` during one ``decode_attention`` call minus what was
    allocated before it."""
    import math

    import torch

    from loki.bench.harness import make_bench_inputs
    from loki.kernels import decode_attention

    HQ, HKV, D = cfg.shape
    inputs = make_bench_inputs(cfg.B, HQ, HKV, cfg.S, D, dtype=getattr(torch, cfg.dtype))
    d = max(1, math.ceil(cfg.d_f * D - 1e-9))
    mode = "kv" if HQ != HKV else "query"

    def step(x):
        return decode_attention(x.q, x.k_cache, x.v_cache, d=d, k=cfg.k_f, lengths=x.lengths, starts=x.starts,
                                backend="triton", gqa_select=mode, select_method="triton", aggregate="sum")

    step(inputs)  # compile outside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step(inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out, inputs
    torch.cuda.empty_cache()
    return peak / MIB


def _measure(config_ids, providers, *, peak_memory=False) -> dict:
    """One harness run over ``config_ids``: ``{"results": {id: bench_config result}, "copy_gbps": ...}``, or
    ``{"skip": reason}`` where the kernels cannot run.  Never raises (a failing config is recorded)."""
    why = _why_not_runnable()
    if why is None and config_ids == [UNAVAILABLE]:
        why = "the benchmark harness is unavailable"
    if why is not None:
        return {"skip": why}
    import torch

    from loki.bench.harness import bench_config, measure_copy_bandwidth

    copy_gbps = measure_copy_bandwidth()
    out = {"copy_gbps": copy_gbps, "device": torch.cuda.get_device_name(), "results": {}}
    for cid in config_ids:
        cfg = config_by_id(cid)
        try:
            res = bench_config(cfg, copy_gbps=copy_gbps, providers=providers)
            if peak_memory:
                res["peak_memory_mib"] = _peak_memory_mib(cfg)
        except Exception as exc:  # noqa: BLE001 - recorded; that config's benchmarks then fail
            res = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        torch.cuda.empty_cache()
        out["results"][cid] = res
    return out


class _HarnessBenchmark:
    """Shared plumbing: ``setup`` picks the config's result or skips; helpers read rows."""

    version = "1"  # bump when what a number means changes (ASV hides results of other versions)
    timeout = 1800

    def setup(self, cache, config):
        self._case = config
        if "skip" in cache:
            skip(self, cache["skip"], config)
        self.res = cache["results"][config]
        if "error" in self.res:
            raise RuntimeError(f"{config}: {self.res['error']}")

    def _row(self, provider) -> dict:
        row = self.res["rows"].get(provider)
        if row is None:
            skip(self, f"provider {provider} was not measured", self._case)
        if "ms" not in row:
            raise RuntimeError(f"{provider}: {row.get('error', 'no time')}")
        return row

    def _ms(self, provider) -> float:
        return float(self._row(provider)["ms"])

    def _graph_ms(self, provider) -> float:
        row = self._row(provider)
        if "graph_ms" in row:
            return float(row["graph_ms"])
        if "graph_error" in row:
            raise RuntimeError(f"{provider} under a CUDA graph: {row['graph_error']}")
        skip(self, f"{provider} was not timed under a CUDA graph", self._case)


class DecodeAttention(_HarnessBenchmark):
    """One decode step of attention (one layer, one query token per sequence) at the speed-target shapes
    (``benchmarks._shapes.KERNEL_SHAPES``; targets in ci/thresholds.json).

    ``loki`` is the Triton pipeline (approximate scores, Triton threshold select, sparse attention);
    ``loki_topk`` the same with ``torch.topk``; ``loki_torch`` the pure-PyTorch reference; ``sdpa`` torch's
    scaled_dot_product_attention (flash backend where it runs, ``enable_gqa`` for GQA); ``eager`` matmul,
    fp32 softmax, matmul.
    """

    params = [KERNEL_CONFIGS]
    param_names = ["config"]

    def setup_cache(self):
        return _measure(KERNEL_CONFIGS, ["sdpa", "eager", "loki_torch", "loki", "loki_topk", "stages"],
                        peak_memory=True)

    setup_cache.timeout = 1800

    @unit("ms")
    def track_loki_ms(self, cache, config):
        return self._ms("loki")

    @unit("ms")
    def track_loki_topk_ms(self, cache, config):
        return self._ms("loki_topk")

    @unit("ms")
    def track_loki_torch_ms(self, cache, config):
        return self._ms("loki_torch")

    @unit("ms")
    def track_sdpa_ms(self, cache, config):
        return self._ms("sdpa")

    @unit("ms")
    def track_eager_ms(self, cache, config):
        return self._ms("eager")

    @unit("x")
    def track_speedup_vs_sdpa(self, cache, config):
        return self._ms("sdpa") / self._ms("loki")

    @unit("ms")
    def track_loki_graph_ms(self, cache, config):
        return self._graph_ms("loki")

    @unit("ms")
    def track_sdpa_graph_ms(self, cache, config):
        return self._graph_ms("sdpa")

    @unit("x")
    def track_speedup_vs_sdpa_graph(self, cache, config):
        """Both sides replayed from CUDA graphs (launch overhead removed)."""
        return self._graph_ms("sdpa") / self._graph_ms("loki")

    @unit("ratio")
    def track_time_ratio_vs_sdpa(self, cache, config):
        """Loki's step time over SDPA's, the inverse of ``track_speedup_vs_sdpa``: lower is better, the direction
        ASV's regressions page assumes (it lists increases)."""
        return self._ms("loki") / self._ms("sdpa")

    @unit("ratio")
    def track_time_ratio_vs_sdpa_graph(self, cache, config):
        """The same as CUDA-graph replays (device time): the inverse of ``track_speedup_vs_sdpa_graph``."""
        return self._graph_ms("loki") / self._graph_ms("sdpa")

    @unit("x")
    def track_speedup_vs_eager(self, cache, config):
        return self._ms("eager") / self._ms("loki")

    @unit("x")
    def track_speedup_topk_vs_sdpa(self, cache, config):
        return self._ms("sdpa") / self._ms("loki_topk")

    @unit("GB/s")
    def track_loki_gbps(self, cache, config):
        return float(self._row("loki")["gbps"])

    @unit("GB/s")
    def track_sdpa_gbps(self, cache, config):
        return float(self._row("sdpa")["gbps"])

    @unit("%")
    def track_loki_pct_copy_bandwidth(self, cache, config):
        return float(self._row("loki")["pct_copy_bw"])

    @unit("ms")
    def track_loki_floor_ms(self, cache, config):
        """The bandwidth floor: bytes Loki must move over the measured copy bandwidth (not a timing)."""
        return float(self.res["loki_floor_ms"])

    @unit("ms")
    def track_stage_scores_ms(self, cache, config):
        return self._ms("stage_scores")

    @unit("ms")
    def track_selection_ms(self, cache, config):
        return self._ms("stage_select_triton")

    @unit("ms")
    def track_selection_topk_ms(self, cache, config):
        return self._ms("stage_select_topk")

    @unit("ms")
    def track_stage_attention_ms(self, cache, config):
        return self._ms("stage_attention")

    @unit("fraction")
    def track_selection_share(self, cache, config):
        """Selection time over the whole Loki step (target: under a quarter), both as CUDA-graph replays:
        device time only.  (Version 1 divided plain do_bench times; a standalone select launch through
        Triton's normal launcher is host-bound at small shapes (~40 us of launch for ~20 us of work), while
        the step it is compared with replays its recorded launches, so the ratio measured the launcher.)"""
        return self._graph_ms("stage_select_triton") / self._graph_ms("loki")

    track_selection_share.version = "2"

    @unit("MiB")
    def track_peak_memory_mib(self, cache, config):
        """Device memory the Loki step allocates beyond its inputs."""
        return float(self.res["peak_memory_mib"])


class SparQComparison(_HarnessBenchmark):
    """Loki's kernels against the SparQ-style kernels (1-D grid over batch x heads, serial loop over chunks,
    ``torch.topk``) at r = d and the same k: the comparison of the paper's appendix figure."""

    params = [SPARQ_CONFIGS]
    param_names = ["config"]

    def setup_cache(self):
        return _measure(SPARQ_CONFIGS, ["sdpa", "loki", "sparq"])

    setup_cache.timeout = 1800

    @unit("ms")
    def track_sparq_ms(self, cache, config):
        return self._ms("sparq")

    @unit("ms")
    def track_loki_ms(self, cache, config):
        return self._ms("loki")

    @unit("x")
    def track_speedup_vs_sparq(self, cache, config):
        return self._ms("sparq") / self._ms("loki")

    @unit("ratio")
    def track_time_ratio_vs_sparq(self, cache, config):
        """Loki's time over the SparQ-style kernels' (lower is better): the inverse of ``track_speedup_vs_sparq``."""
        return self._ms("loki") / self._ms("sparq")

    @unit("x")
    def track_sparq_speedup_vs_sdpa(self, cache, config):
        return self._ms("sdpa") / self._ms("sparq")


def _measure_selects(names) -> dict:
    """The split select alone per shape of ``SELECT_SHAPES``: ``{"results": {name: {"us": ..., "ok": ...}}}`` (a
    failing shape records its error), or ``{"skip": reason}`` without CUDA."""
    why = why_not_runnable_on_gpu(("loki.bench.harness", "loki.kernels.select_split"), "the split select")
    if why is not None:
        return {"skip": why}
    import torch

    from loki.bench.harness import time_ms_graph
    from loki.kernels import select_topk_split

    out = {"device": torch.cuda.get_device_name(), "results": {}}
    for name in names:
        B, H, S, k = SELECT_SHAPES[name]
        try:
            g = torch.Generator(device="cuda").manual_seed(S + k)
            scores = torch.randn(B, H, S, generator=g, device="cuda")
            counts = torch.full((B,), k, dtype=torch.int32, device="cuda")
            idx = select_topk_split(scores, counts, k_max=k)
            want = torch.topk(scores, k, dim=-1).indices.sort(-1).values
            ok = bool(torch.equal(idx.long().sort(-1).values, want))  # the exact top-k (no ties in random fp32)
            us = time_ms_graph(lambda s=scores, c=counts, k=k: select_topk_split(s, c, k_max=k)) * 1e3
            out["results"][name] = {"us": us, "ok": ok}
            del scores, counts, idx, want
        except Exception as exc:  # noqa: BLE001 - recorded; that shape's benchmark then fails
            out["results"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        torch.cuda.empty_cache()
    return out


class SplitSelect:
    """The split select (``loki.kernels.select_topk_split``: every row split over many programs) alone, at the
    KV-dominated end-to-end shapes with one selection per KV head: 8 rows of 131072 scores (Llama-3-8B dims, B=1)
    and 64 rows of 32768 (B=8), k = 2048.  Device time of one CUDA-graph replay with the L2 flushed before each
    (``loki.bench.harness.time_ms_graph``, median), in microseconds; targets in ci/thresholds.json."""

    params = [SELECT_CONFIGS]
    param_names = ["rows"]
    version = "1"
    timeout = 600

    def setup_cache(self):
        return _measure_selects(SELECT_CONFIGS)

    setup_cache.timeout = 600

    def setup(self, cache, rows):
        if "skip" in cache:
            skip(self, cache["skip"], rows)
        self.res = cache["results"][rows]
        if "error" in self.res:
            raise RuntimeError(f"{rows}: {self.res['error']}")
        if not self.res["ok"]:
            raise RuntimeError(f"{rows}: the split select did not return the exact top-k")

    @unit("us")
    def track_select_us(self, cache, rows):
        return float(self.res["us"])


class Device:
    """The machine's measured device-to-device copy bandwidth: the yardstick of every GB/s above."""

    version = "1"
    timeout = 300

    def setup(self):
        why = _why_not_runnable()
        if why is not None:
            skip(self, why)

    @unit("GB/s")
    def track_copy_bandwidth_gbps(self):
        from loki.bench.harness import measure_copy_bandwidth

        return measure_copy_bandwidth()
