"""End-to-end decode speed of whole models (CUDA only): transformers Llama models with the dimensions of
Llama-2-7B and Llama-3-8B, random weights, bf16, one token per step over a long cache, four paths: eager SDPA
(DynamicCache), compiled static-cache SDPA, eager Loki and compiled static-cache Loki.

Numbers come from ``loki.bench.e2e.run_grid`` (the engine of ``loki bench --e2e``; docs/benchmarks.md): median ms
per decode step from CUDA events over 32 steps that reach the setting's cache length S, after an untimed pass over
the same steps (compilation, CUDA-graph recording, warm-up).  ``setup_cache`` measures the whole grid once, in
one process, so a speed-up and the times it divides come from one run; the ``track_*`` functions only read the
values.  Without CUDA every ``setup`` skips (``SkipNotImplemented``).  A path that cannot run at a commit (no
``LokiStaticCache`` yet, a compile failure) makes its own benchmarks fail or skip, not the others.

Parameters (``setting``): ``<model>-B<B>-S<S>`` from ``benchmarks/_shapes.py`` (``E2E_SETTINGS``).
"""

from __future__ import annotations

from ._common import SkipNotImplemented, unit, why_not_runnable_on_gpu
from ._shapes import E2E_SETTINGS

STEPS = 32


def _why_not_runnable() -> str | None:
    return why_not_runnable_on_gpu(("loki.bench.e2e", "loki.bench.harness"), "the end-to-end benchmark")


def measure(setting_ids=tuple(E2E_SETTINGS), steps: int = STEPS) -> dict:
    """One run of every setting: ``{"results": {id: run_grid result}, "copy_gbps": ..., "device": ...}``, or
    ``{"skip": reason}`` without a GPU.  Never raises for a failing path (recorded in its result)."""
    why = _why_not_runnable()
    if why is not None:
        return {"skip": why}
    import torch

    from loki.bench.e2e import Setting, run_grid
    from loki.bench.harness import measure_copy_bandwidth

    grid = []
    for sid in setting_ids:
        model, b, s = sid.rsplit("-", 2)
        grid.append(Setting(model, int(b[1:]), int(s[1:])))
    copy_gbps = measure_copy_bandwidth()
    # the dense compiled path with grouped K/V passed to SDPA under the mask (transformers would copy them per query
    # head on every static-cache step: not a fair baseline, docs/fast-decode.md)
    results = run_grid(grid, device="cuda", dtype=torch.bfloat16, steps=steps, copy_gbps=copy_gbps,
                       sdpa_backend="native-gqa")
    return {"copy_gbps": copy_gbps, "device": torch.cuda.get_device_name(), "results": {r["id"]: r for r in results}}


class EndToEndDecode:
    """ms per decode step of each path, Loki's best path over the faster dense path, and compiled Loki over its
    byte floor (weights + the KV bytes Loki must read, over the copy bandwidth measured in the same run)."""

    params = [E2E_SETTINGS]
    param_names = ["setting"]
    version = "2"  # bump when what a number means changes (ASV hides results of other versions)
    timeout = 1800

    def setup_cache(self):
        return measure()

    setup_cache.timeout = 1800

    def setup(self, cache, setting):
        if "skip" in cache:
            raise SkipNotImplemented(cache["skip"])
        self.res = cache["results"].get(setting)
        if self.res is None:
            raise SkipNotImplemented(f"{setting} was not measured")
        if "skipped" in self.res:
            raise SkipNotImplemented(f"{setting}: {self.res['skipped']}")

    def _ms(self, path) -> float:
        row = self.res["paths"].get(path, {})
        if "skipped" in row:
            raise SkipNotImplemented(f"{path}: {row['skipped']}")
        if "ms_median" not in row:
            raise RuntimeError(f"{path}: {row.get('error', 'not measured')}")
        return float(row["ms_median"])

    def _value(self, key, *sub):
        v = self.res.get(key)
        for k in sub:
            v = None if v is None else v.get(k)
        if v is None:
            missing = [f"{p}: {r.get('skipped') or r.get('error')}" for p, r in self.res["paths"].items()
                       if "ms_median" not in r]
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
