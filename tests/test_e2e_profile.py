"""benchmarks/tuning/e2e_profile.py: the generate profile's arithmetic, and its code path on a tiny model on the CPU
(the GPU command profiles the compiled paths with CUDA activities too)."""

from __future__ import annotations

import torch

from benchmarks.tuning import e2e_profile
from loki.bench import e2e
from loki.integrations.transformers import is_loki_enabled

TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=256)


def test_busy_time_is_the_union_of_the_intervals():
    assert e2e_profile._busy_us([]) == 0.0
    assert e2e_profile._busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 12 + 5
    assert e2e_profile._busy_us([(3, 4), (0, 10)]) == 10


def test_idle_gaps_are_charged_to_the_kernel_that_waited():
    """Span, busy and idle per step, and each idle stretch charged to the kernel that starts after it (overlapping
    kernels: the idle time starts when every earlier kernel has ended)."""
    evs = [(0, 10, "a"), (12, 20, "b"), (15, 30, "c"), (31, 35, "b"), (40, 41, "d")]
    r = e2e_profile.idle_gaps(evs, calls=2)
    assert r["span_us"] == 41 / 2 and r["busy_us"] == (10 + 18 + 4 + 1) / 2 and r["idle_us"] == (41 - 33) / 2
    assert {t["name"]: t["us"] for t in r["idle_before"]} == {"b": (2 + 1) / 2, "d": 5 / 2}
    assert [t["name"] for t in r["idle_before"]] == ["d", "b"]
    assert e2e_profile.idle_gaps([], calls=1) == {}


def test_launch_gaps_measure_each_start_from_the_latest_end_before_it():
    """A start before the latest earlier end is an early start (negative gap); waits above max_gap_us (the host,
    step boundaries) are left out; pairs are named by the kernel before and the one after."""
    evs = [(0, 10, "a"), (10.5, 20, "b"), (19.5, 30, "c"), (30.5, 31, "a"), (200, 201, "b"), (201.3, 202, "c")]
    r = e2e_profile.launch_gaps(evs, max_gap_us=50)
    assert r["n"] == 4 and r["early_starts"] == 1  # the wait of 169 us before the second "b" is left out
    assert abs(r["sum_us"] - 1.3) < 1e-9 and r["median_us"] == 0.5 and r["p10_us"] == -0.5
    pairs = {(p["from"], p["to"]): (p["count"], round(p["median_us"], 6)) for p in r["pairs"]}
    assert pairs == {("a", "b"): (1, 0.5), ("b", "c"): (2, 0.3), ("c", "a"): (1, 0.5)}  # b->c: -0.5 and 0.3
    assert e2e_profile.launch_gaps([]) == {"n": 0}
    # A kernel that overlaps a long one: the gap of the next counts from the long one's end, not the short one's.
    r = e2e_profile.launch_gaps([(0, 100, "long"), (1, 2, "short"), (101, 102, "next")])
    assert r["n"] == 2 and r["early_starts"] == 1 and r["median_us"] == 1.0


def test_generate_profile_per_token_on_the_cpu():
    """Per generated token: the differences of the N + 1 and the 1 token calls, CPU operators included; Loki is
    disabled again afterwards."""
    model = e2e.build_model(e2e.llama_config(TINY), "cpu", torch.float32)
    for path in ("sdpa_eager", "loki_eager"):
        r = e2e_profile.profile_generate(model, path, B=1, S=40, new_tokens=4, k=0.5, device="cpu")
        p = r["per_token"]
        assert r["new_tokens"] == 4 and p["wall_us"] > 0 and p["busy_us"] == 0 and p["launches"] == 0
        assert p["host_only_us"] == p["wall_us"]
        assert r["cpu_ops"] and all({"name", "us"} <= set(op) for op in r["cpu_ops"])
        assert r["calls"]["N+1"]["wall_us"] > 0 and "kernels" not in r["calls"]["1"]
        assert not is_loki_enabled(model)
