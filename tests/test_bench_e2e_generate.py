"""The end-to-end benchmark's whole-``generate`` timing, byte ceiling and per-setting budgets
(``loki.bench.e2e``, ``loki.bench.e2e_generate``, ``loki bench --e2e``) and the ASV side of them
(``benchmarks/bench_e2e.py``, ``benchmarks/bench_kernels.py``): on the CPU with a tiny Llama, eager."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from loki import cli
from loki._hf import cache_keyword
from loki.bench import e2e, e2e_generate, e2e_report
from loki.bench.harness import add_arguments

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=256, max_position_embeddings=512)


@pytest.fixture(scope="module")
def model():
    return e2e.build_model(e2e.llama_config(TINY), "cpu", torch.float32)


def _args(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_generate_per_token_is_the_difference_of_the_two_lengths_over_n(model, monkeypatch):
    """A clock that advances 500 ms per generate call plus 10 ms per new token: per token = (t(N+1) - t(1)) / N
    = 10 ms exactly, from the medians of the timed calls; the warm-up calls are not timed; every call is greedy
    with min_new_tokens = max_new_tokens on the path's own cache."""
    now = {"t": 0.0}
    calls = []
    real = model.generate

    def fake_generate(*args, **kw):
        calls.append(kw)
        now["t"] += 0.5 + 0.01 * kw["max_new_tokens"]
        return real(*args, **kw)

    monkeypatch.setattr(e2e_generate, "_now", lambda: now["t"])
    monkeypatch.setattr(model, "generate", fake_generate)
    r = e2e.run_path(model, "sdpa_eager", B=1, S=24, steps=2, device="cpu", dtype=torch.float32, generate=True,
                     generate_tokens=5, generate_reps=2)
    assert r["generate_times_ms"]["1"] == pytest.approx([510.0, 510.0])
    assert r["generate_times_ms"]["N+1"] == pytest.approx([560.0, 560.0])
    assert r["generate_t1_ms"] == pytest.approx(510.0) and r["generate_tn_ms"] == pytest.approx(560.0)
    assert r["generate_ms_per_token"] == pytest.approx(10.0)
    assert r["generate_tokens_per_s"] == pytest.approx(100.0)
    assert len(calls) == 2 + 2 * 2  # each length warmed once, then two timed calls of each
    assert [c["max_new_tokens"] for c in calls] == [1, 6, 1, 6, 1, 6]
    for c in calls:
        assert c["min_new_tokens"] == c["max_new_tokens"] and c["do_sample"] is False
        assert type(c[cache_keyword(model)]).__name__ == "DynamicCache"  # the path's cache, rewound per call
    assert r["generate_prompt_tokens"] == 24 - 5 - 1 and r["ms_median"] > 0  # the forward was timed as before


def test_generate_reports_each_repetition_and_their_spread(model, monkeypatch):
    """Host-side jitter in one timed call moves that repetition's (t(N+1) - t(1)) / N: every repetition's value
    and their range are reported beside the median-based per-token time."""
    now = {"t": 0.0, "calls": 0}
    real = model.generate

    def fake_generate(*args, **kw):
        now["calls"] += 1
        now["t"] += 0.5 + 0.01 * kw["max_new_tokens"] + (0.04 if now["calls"] == 6 else 0.0)  # rep 2's N+1 call
        return real(*args, **kw)

    monkeypatch.setattr(e2e_generate, "_now", lambda: now["t"])
    monkeypatch.setattr(model, "generate", fake_generate)
    r = e2e.run_path(model, "sdpa_eager", B=1, S=24, steps=2, device="cpu", dtype=torch.float32, generate=True,
                     generate_tokens=5, generate_reps=2)
    assert r["generate_ms_per_token_reps"] == pytest.approx([10.0, 18.0])
    assert r["generate_ms_per_token_spread"] == pytest.approx(8.0)
    assert r["generate_ms_per_token"] == pytest.approx((580.0 - 510.0) / 5)  # medians of two: the means


def test_generate_prefill_prompt_and_errors(model):
    """prompt="prefill": generate prefills the whole prompt from an empty cache; a generate that cannot run is
    reported beside the forward's numbers, which stay."""
    r = e2e.run_path(model, "sdpa_compiled", B=2, S=20, steps=2, device="cpu", dtype=torch.float32, generate=True,
                     generate_tokens=3, generate_reps=1, generate_prompt="prefill", compile_mode=None)
    assert r["generate_prompt"] == "prefill" and r["generate_ms_per_token"] > 0 and r["generate_same_tokens"]
    bad = e2e.run_path(model, "sdpa_eager", B=1, S=12, steps=2, device="cpu", dtype=torch.float32, generate=True,
                       generate_tokens=11)
    assert "ValueError" in bad["generate_error"] and "generate_ms_per_token" not in bad and bad["ms_median"] > 0
    with pytest.raises(ValueError, match="prompt"):
        e2e_generate.time_generate(model, None, B=1, S=12, new_tokens=2, key="cache", device="cpu", prompt="x")


def test_setting_ids_carry_their_budget():
    old = e2e.Setting("llama3-8b", 16, 8192)
    assert old.id == "llama3-8b-B16-S8192" and e2e.Setting.parse(old.id) == old and old.budget(0.25) == 0.25
    s = e2e.Setting.parse("llama3-8b-B1-S131072-k2048")
    assert (s.model, s.B, s.S, s.k) == ("llama3-8b", 1, 131072, 2048) and isinstance(s.k, int)
    assert s.id == "llama3-8b-B1-S131072-k2048" and s.budget(0.25) == 2048
    f = e2e.Setting.parse("llama2-7b-B8-S32768-k0.5")
    assert f.k == 0.5 and isinstance(f.k, float) and f.id == "llama2-7b-B8-S32768-k0.5"
    for bad in ("llama3-8b-B1", "llama3-8b-B1-S8-kx", "llama3-8b-B1-S8-k0", "llama3-8b-B1-S8-k1.5"):
        with pytest.raises(ValueError):
            e2e.Setting.parse(bad)


def test_per_setting_budget_reaches_the_floor_and_the_path(model, monkeypatch):
    seen = []
    monkeypatch.setattr(e2e, "run_path", lambda *a, **kw: seen.append(kw["k_f"]) or {"skipped": "not run"})
    res = e2e.run_grid([e2e.Setting("tiny", 1, 40, 8), e2e.Setting("tiny", 1, 40)], device="cpu",
                       dtype=torch.float32, models={"tiny": TINY}, steps=4, paths=("loki_eager",), log=lambda m: None)
    assert seen == [8, 0.25] and [r["k_f"] for r in res] == [8, 0.25]
    cfg = e2e.llama_config(TINY)
    for r in res:
        want = e2e.byte_floor(cfg, 1, range(37, 41), weights=r["bytes"]["weights"], itemsize=4, k_f=r["k_f"],
                              d_f=0.5, gqa_select="kv", score_format="int8")  # run_grid's default copy
        assert r["bytes"] == want
        assert r["ceiling_speedup"] == pytest.approx(want["dense"] / want["loki"])


def test_summarize_ceiling_and_generate_level_by_hand():
    res = {"bytes": {"dense": 12.0, "loki": 6.0}, "floor_ms": {"dense": 12.0, "loki": 6.0}, "paths": {
        "sdpa_eager": {"ms_median": 20.0, "generate_ms_per_token": 22.0},
        "sdpa_compiled": {"ms_median": 12.0, "generate_ms_per_token": 13.0},
        "loki_eager": {"ms_median": 30.0, "generate_ms_per_token": 31.0},
        "loki_compiled": {"ms_median": 8.0, "generate_ms_per_token": 10.4},
    }}
    e2e.summarize(res)
    assert res["ceiling_speedup"] == 2.0 and res["speedup"] == 1.5
    assert res["fraction_of_ceiling"] == 0.75 and res["fraction_of_ceiling_gain"] == 0.5
    assert (res["best_dense_generate"], res["best_loki_generate"]) == ("sdpa_compiled", "loki_compiled")
    assert res["generate_speedup"] == pytest.approx(1.25)
    assert res["generate_fraction_of_ceiling"] == pytest.approx(0.625)
    assert res["generate_fraction_of_ceiling_gain"] == pytest.approx(0.25)
    # a per-token time that is not positive (noise on a tiny model) is not a generate-level result
    res = {"bytes": {"dense": 1.0, "loki": 1.0},
           "paths": {"sdpa_eager": {"ms_median": 1.0, "generate_ms_per_token": -1}, "loki_eager": {"ms_median": 1.0}}}
    e2e.summarize(res)
    assert "generate_speedup" not in res and res["fraction_of_ceiling_gain"] is None


def test_cli_settings_budgets_and_generate_options():
    sel = e2e_report.select(_args("--e2e", "--settings", "llama3-8b-B1-S131072-k2048", "llama3-8b-B8-S32768",
                                  "--generate", "--generate-tokens", "16", "--budgets", "2048:0.25"))
    assert [s.id for s in sel["grid"]] == ["llama3-8b-B1-S131072-k2048", "llama3-8b-B8-S32768"]
    assert sel["k_f"] == 2048 and isinstance(sel["k_f"], int)
    assert sel["generate"] and sel["generate_tokens"] == 16 and sel["generate_reps"] == 3
    assert sel["generate_prompt"] == "cache"
    plain = e2e_report.select(_args("--e2e", "--quick"))
    assert not plain["generate"] and plain["generate_tokens"] is None and plain["k_f"] == 0.25


@pytest.mark.parametrize("argv, words", [
    (["--settings", "llama3-8b-B1"], "--settings"),
    (["--settings", "llama2-13b-B1-S4096"], "unknown model"),
    (["--settings", "llama3-8b-B1-S4096", "--quick"], "leave out"),
    (["--budgets", "0:0.25"], "integer >= 1"),
    (["--generate", "--generate-reps", "0"], "--generate-reps"),
    (["--generate", "--seq-lens", "40", "--steps", "8", "--generate-tokens", "38"], "prompt of at least 2"),
])
def test_bad_generate_and_settings_arguments(argv, words, capsys):
    assert cli.main(["bench", "--e2e", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and words in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------------------ the ASV side
@pytest.fixture
def benchmarks_modules():
    sys.path.insert(0, str(ROOT))
    try:
        import benchmarks.bench_e2e as bench_e2e
        import benchmarks.bench_kernels as bench_kernels
        from benchmarks import _shapes

        yield bench_e2e, bench_kernels, _shapes
    finally:
        sys.path.remove(str(ROOT))


def test_asv_settings_parse_and_measure_runs_them_with_generate(benchmarks_modules, monkeypatch):
    bench_e2e, _, shapes = benchmarks_modules
    grid = [bench_e2e.parse_setting(sid) for sid in shapes.E2E_SETTINGS]
    assert [s.id for s in grid] == shapes.E2E_SETTINGS
    assert [s.k for s in grid] == [None, None, 2048, None, 2048]  # ids without -k: k_f 0.25, as recorded before
    assert {(s.model, s.B, s.S) for s in grid} >= {("llama3-8b", 1, 131072), ("llama3-8b", 8, 32768)}
    seen = {}

    def fake_grid(grid, *, generate=False, **kw):  # a run_grid with the generate option (older ones lack it)
        seen.update(kw, grid=[s.id for s in grid], generate=generate)
        return [{"id": s.id, "paths": {}} for s in grid]

    import loki.bench.harness

    monkeypatch.setattr(bench_e2e, "_why_not_runnable", lambda: None)
    monkeypatch.setattr(e2e, "run_grid", fake_grid)
    monkeypatch.setattr(loki.bench.harness, "measure_copy_bandwidth", lambda: 3000.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    out = bench_e2e.measure(shapes.E2E_SETTINGS)
    assert seen["grid"] == shapes.E2E_SETTINGS and seen["generate"] is True and seen["sdpa_backend"] == "native-gqa"
    assert list(out["results"]) == shapes.E2E_SETTINGS
    monkeypatch.setenv(bench_e2e.SETTINGS_ENV, "llama3-8b-B8-S32768-k2048, llama3-8b-B1-S131072-k2048")
    out = bench_e2e.measure(shapes.E2E_SETTINGS)
    assert seen["grid"] == ["llama3-8b-B1-S131072-k2048", "llama3-8b-B8-S32768-k2048"]
    bench = bench_e2e.EndToEndDecode()
    with pytest.raises(bench_e2e.SkipNotImplemented, match="not measured"):
        bench.setup(out, "llama2-7b-B8-S4096")


def test_asv_track_functions_read_the_new_numbers(benchmarks_modules):
    bench_e2e, _, _ = benchmarks_modules
    paths = {p: {"ms_median": ms, "generate_ms_per_token": g, "peak_memory_gib": m}
             for p, ms, g, m in (("sdpa_eager", 30.0, 31.0, 40.0), ("sdpa_compiled", 12.0, 13.0, 41.0),
                                 ("loki_eager", 20.0, 21.0, 42.0), ("loki_compiled", 8.0, 10.0, 43.0))}
    res = e2e.summarize({"id": "x", "bytes": {"dense": 2.0, "loki": 1.0}, "floor_ms": {"dense": 6, "loki": 3},
                         "paths": paths})
    bench = bench_e2e.EndToEndDecode()
    bench.setup({"results": {"x": res}}, "x")
    assert bench.track_fraction_of_ceiling(None, "x") == pytest.approx(0.75)
    assert bench.track_ceiling_speedup(None, "x") == 2.0
    assert bench.track_loki_compiled_generate_ms(None, "x") == 10.0
    assert bench.track_sdpa_compiled_generate_ms(None, "x") == 13.0
    assert bench.track_generate_speedup_vs_best_dense(None, "x") == pytest.approx(1.3)
    assert bench.track_time_ratio_generate_vs_best_dense(None, "x") == pytest.approx(1 / 1.3)
    assert bench.track_loki_compiled_peak_memory_gib(None, "x") == 43.0
    assert bench.track_sdpa_eager_peak_memory_gib(None, "x") == 40.0
    res["paths"]["loki_eager"] = {"ms_median": 20.0, "generate_error": "RuntimeError: boom"}
    with pytest.raises(RuntimeError, match="boom"):
        bench.track_loki_eager_generate_ms(None, "x")


def test_asv_split_select_skips_without_cuda(benchmarks_modules, monkeypatch):
    _, bench_kernels, shapes = benchmarks_modules
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert shapes.SELECT_SHAPES == {"8x131072-k2048": (1, 8, 131072, 2048), "64x32768-k2048": (8, 8, 32768, 2048)}
    bench = bench_kernels.SplitSelect()
    cache = bench.setup_cache()
    with pytest.raises(bench_kernels.SkipNotImplemented, match="CUDA"):
        bench.setup(cache, "8x131072-k2048")
