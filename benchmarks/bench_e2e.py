"""End-to-end decode speed of whole models (CUDA only): transformers Llama models with the dimensions of
Llama-2-7B and Llama-3-8B, random weights, bf16, one token per step over a long cache, four paths: eager SDPA
(DynamicCache), compiled static-cache SDPA, eager Loki and compiled static-cache Loki.  Loki runs in the default
configuration, the one the accuracy suite reports and gates: on Llama-3-8B's dims (GQA 32/8) one selection per KV
group with each head's scores softmax-normalised before the group's maximum ("softmax-max"), on Llama-2-7B's per
query head (``run_grid``'s defaults; each result records its ``gqa_select`` and ``aggregate``).

Numbers come from ``loki.bench.e2e.run_grid`` (the engine of ``loki bench --e2e``; docs/benchmarks.md): median ms
per decode step from CUDA events over 32 steps that reach the setting's cache length S, after an untimed pass over
the same steps (compilation, CUDA-graph recording, warm-up); then per path whole greedy ``model.generate`` calls on
the same cache (ms per token = (t(33 new tokens) - t(1)) / 32, each length warmed once, median of three timed
calls; the compiled paths through ``generate``'s own compilation of a static cache); the peak device memory of
each path's decode steps; and the byte ceiling of the speed-up (dense floor / Loki floor) with the fraction of it
reached.  ``setup_cache`` measures the whole grid once, in one process, so a speed-up and the times it divides come
from one run; the ``track_*`` functions only read the values.  Without CUDA every ``setup`` skips
(``SkipNotImplemented``).  A path that cannot run at a commit (no ``LokiStaticCache`` yet, a compile failure)
makes its own benchmarks fail or skip, not the others.

Parameters (``setting``): ``<model>-B<B>-S<S>[-k<k>]`` from ``benchmarks/_shapes.py`` (``E2E_SETTINGS``; without
``-k`` the budget is k_f = 0.25, ``-k2048`` a fixed 2048 tokens).

The whole grid takes about 15-20 minutes on an H100 (each compiled path compiles twice per setting: the timed
forward and ``generate``'s own decode step).  To record it in shorter runs, ``LOKI_ASV_E2E_SETTINGS`` (comma-separated
ids) restricts what ``setup_cache`` measures, together with ASV's parameter selection, which keeps the recorded
values of the other settings: ``LOKI_ASV_E2E_SETTINGS=llama3-8b-B1-S131072-k2048 asv run ... --bench
'bench_e2e.*llama3-8b-B1-S131072-k2048'`` (the regular expression is matched against
``name(parameters)``; docs/benchmarks.md).
"""

from __future__ import annotations

import os

from ._common import SkipNotImplemented, skip, unit, why_not_runnable_on_gpu  # noqa: F401 (re-exported)
from ._shapes import E2E_SETTINGS

STEPS = 32
#: Comma-separated setting ids: measure only these (the others' benchmarks skip as not measured).
SETTINGS_ENV = "LOKI_ASV_E2E_SETTINGS"


def _why_not_runnable() -> str | None:
    return why_not_runnable_on_gpu(("loki.bench.e2e", "loki.bench.harness"), "the end-to-end benchmark")


def parse_setting(setting_id: str):
    """The ``loki.bench.e2e.Setting`` of an id: ``<model>-B<B>-S<S>`` (the grid's k_f, 0.25) or
    ``<model>-B<B>-S<S>-k<k>`` (its own budget: an int count, or a fraction with a '.'); a checkout whose
    ``Setting`` has no budget field runs ids without ``-k`` only (ValueError for the others)."""
    from loki.bench.e2e import Setting

    if hasattr(Setting, "parse"):
        return Setting.parse(setting_id)
    model, b, s = setting_id.rsplit("-", 2)
    if not (b.startswith("B") and s.startswith("S")):
        raise ValueError(f"this checkout's end-to-end benchmark has no per-setting budget: {setting_id}")
    return Setting(model, int(b[1:]), int(s[1:]))


def measure(setting_ids=tuple(E2E_SETTINGS), steps: int = STEPS, generate: bool = True) -> dict:
    """One run of every setting: ``{"results": {id: run_grid result}, "copy_gbps": ..., "device": ...}``, or
    ``{"skip": reason}`` without a GPU.  Never raises for a failing path (recorded in its result); a setting a
    checkout cannot run (no per-setting budget yet) is recorded as skipped."""
    why = _why_not_runnable()
    if why is not None:
        return {"skip": why}
    import inspect

    import torch

    from loki.bench.e2e import run_grid
    from loki.bench.harness import measure_copy_bandwidth

    wanted = [s.strip() for s in os.environ.get(SETTINGS_ENV, "").split(",") if s.strip()]
    if wanted:
        setting_ids = [s for s in setting_ids if s in wanted]
    grid, results = [], {}
    for sid in setting_ids:
        try:
            grid.append(parse_setting(sid))
        except ValueError as exc:
            results[sid] = {"id": sid, "skipped": str(exc)}
    copy_gbps = measure_copy_bandwidth()
    extra = {}
    if generate and "generate" in inspect.signature(run_grid).parameters:  # commits before it: the forward only
        extra["generate"] = True
    # the dense compiled path with grouped K/V passed to SDPA under the mask (transformers would copy them per query
    # head on every static-cache step: not a fair baseline, docs/fast-decode.md)
    for r in run_grid(grid, device="cuda", dtype=torch.bfloat16, steps=steps, copy_gbps=copy_gbps,
                      sdpa_backend="native-gqa", **extra):
        results[r["id"]] = r
    return {"copy_gbps": copy_gbps, "device": torch.cuda.get_device_name(), "results": results}


class EndToEndDecode:
    """ms per decode step of each path, Loki's best path over the faster dense path, compiled Loki over its
    byte floor (weights + the KV bytes Loki must read, over the copy bandwidth measured in the same run), the
    speed-up's fraction of its byte ceiling, and per path the ms per token of whole ``generate`` calls and the
    peak memory, with the generate-level speed-up."""

    params = [E2E_SETTINGS]
    param_names = ["setting"]
    # bump when what a number means changes (ASV hides results of other versions); "3": the GQA model's Loki paths
    # time "softmax-max" (the default configuration), no longer raw sums
    version = "3"
    timeout = 3600

    def setup_cache(self):
        return measure()

    setup_cache.timeout = 3600

    def setup(self, cache, setting):
        self._case = setting
        if "skip" in cache:
            skip(self, cache["skip"], setting)
        self.res = cache["results"].get(setting)
        if self.res is None:
            skip(self, f"{setting} was not measured" + (
                f" ({SETTINGS_ENV} names others)" if os.environ.get(SETTINGS_ENV) else ""), setting)
        if "skipped" in self.res:
            skip(self, f"{setting}: {self.res['skipped']}", setting)

    def _ms(self, path) -> float:
        row = self.res["paths"].get(path, {})
        if "skipped" in row:
            skip(self, f"{path}: {row['skipped']}", self._case)
        if "ms_median" not in row:
            raise RuntimeError(f"{path}: {row.get('error', 'not measured')}")
        return float(row["ms_median"])

    def _path_value(self, path, key) -> float:
        row = self.res["paths"].get(path, {})
        if "skipped" in row:
            skip(self, f"{path}: {row['skipped']}", self._case)
        value = row.get(key)
        if value is None:
            why = row.get("generate_error") if key.startswith("generate") else None
            raise RuntimeError(f"{path}: {key} is missing ({why or row.get('error') or 'not measured'})")
        return float(value)

    def _value(self, key, *sub):
        v = self.res.get(key)
        for k in sub:
            v = None if v is None else v.get(k)
        if v is None:
            missing = [f"{p}: {r.get('skipped') or r.get('error')}" for p, r in self.res["paths"].items()
                       if "ms_median" not in r]
            if key.startswith("generate"):
                missing += [f"{p}: generate {r['generate_error']}" for p, r in self.res["paths"].items()
                            if "generate_error" in r]
            raise RuntimeError(f"{key} is missing ({'; '.join(missing) or 'no path ran'})")
        return float(v)

    @unit("ms")
    def track_sdpa_eager_ms(self, cache, setting):
        return self._ms("sdpa_eager")

    @unit("ms")
    def track_sdpa_compiled_ms(self, cache, setting):
        return self._ms("sdpa_compiled")

    @unit("ms")
    def track_loki_eager_ms(self, cache, setting):
        return self._ms("loki_eager")

    @unit("ms")
    def track_loki_compiled_ms(self, cache, setting):
        return self._ms("loki_compiled")

    @unit("x")
    def track_speedup_vs_best_dense(self, cache, setting):
        """The faster Loki path over the faster dense path (target on an H100: 1.35x at both settings)."""
        return self._value("speedup")

    @unit("ratio")
    def track_time_ratio_vs_best_dense(self, cache, setting):
        """The faster Loki path's step time over the faster dense path's, the inverse of
        ``track_speedup_vs_best_dense``: lower is better, the direction ASV's regressions page assumes."""
        return 1.0 / self._value("speedup")

    @unit("x")
    def track_loki_compiled_x_floor(self, cache, setting):
        """Compiled Loki's step time over its byte floor (target: at most 1.25)."""
        return self._value("x_floor", "loki_compiled")

    @unit("ms")
    def track_loki_floor_ms(self, cache, setting):
        """The byte floor itself (a bound, not a timing)."""
        return self._value("floor_ms", "loki")

    @unit("fraction")
    def track_fraction_of_ceiling(self, cache, setting):
        """The speed-up (``track_speedup_vs_best_dense``) over its byte ceiling, the dense floor over the Loki floor
        (bytes over bytes): 1 = Loki gains what the bytes it skips allow (target on an H100: at least 0.85)."""
        return self._value("fraction_of_ceiling")

    @unit("x")
    def track_ceiling_speedup(self, cache, setting):
        """The byte ceiling itself: dense bytes per step over Loki's (a bound, not a timing)."""
        return self._value("ceiling_speedup")

    @unit("ms")
    def track_sdpa_eager_generate_ms(self, cache, setting):
        """ms per new token of whole greedy ``generate`` calls: (t(33 new tokens) - t(1)) / 32."""
        return self._path_value("sdpa_eager", "generate_ms_per_token")

    @unit("ms")
    def track_sdpa_compiled_generate_ms(self, cache, setting):
        return self._path_value("sdpa_compiled", "generate_ms_per_token")

    @unit("ms")
    def track_loki_eager_generate_ms(self, cache, setting):
        return self._path_value("loki_eager", "generate_ms_per_token")

    @unit("ms")
    def track_loki_compiled_generate_ms(self, cache, setting):
        return self._path_value("loki_compiled", "generate_ms_per_token")

    @unit("x")
    def track_generate_speedup_vs_best_dense(self, cache, setting):
        """The faster Loki path over the faster dense path, per token of whole ``generate`` calls."""
        return self._value("generate_speedup")

    @unit("ratio")
    def track_time_ratio_generate_vs_best_dense(self, cache, setting):
        """The inverse of ``track_generate_speedup_vs_best_dense`` (lower is better)."""
        return 1.0 / self._value("generate_speedup")

    @unit("GiB")
    def track_sdpa_eager_peak_memory_gib(self, cache, setting):
        """Peak of ``torch.cuda.max_memory_allocated`` over the path's decode steps (weights included)."""
        return self._path_value("sdpa_eager", "peak_memory_gib")

    @unit("GiB")
    def track_sdpa_compiled_peak_memory_gib(self, cache, setting):
        return self._path_value("sdpa_compiled", "peak_memory_gib")

    @unit("GiB")
    def track_loki_eager_peak_memory_gib(self, cache, setting):
        return self._path_value("loki_eager", "peak_memory_gib")

    @unit("GiB")
    def track_loki_compiled_peak_memory_gib(self, cache, setting):
        return self._path_value("loki_compiled", "peak_memory_gib")
