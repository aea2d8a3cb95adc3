"""Loki's own kernel launches per decoder layer in one decode step through the transformers integration, counted by
``loki.kernels.launch.counting`` (CPU interpreter, static cache): the launch budget of the step (issue: at most 4 per
layer; the count of the GPU's long-row route, 10, is in results/launches-h100-2026-11-27/).  A change that adds a
launch to the step, or a replay that skips one, fails here."""

from __future__ import annotations

import collections
import os

import pytest
import torch

pytest.importorskip("transformers")

from loki.basis import PCABasis  # noqa: E402
from loki.integrations.transformers import cache_keyword, enable_loki, loki_cache  # noqa: E402
from loki.kernels.launch import counting  # noqa: E402
from loki.testing.models import tiny_model  # noqa: E402

L, P = 2, 24

#: The step's kernels on the interpreter's route (a register select: rows of 25 keys), per layer.
SHARED_SOFTMAX = {"_write_rotated_kernel": 1, "_approx_scores_kernel": 1, "_lse_partial_kernel": 1,
                  "_group_aggregate_kernel": 1, "_threshold_select_kernel": 1, "_sparse_attn_split_kernel": 1,
                  "_merge_splits_kernel": 1}
RAW_SUM = {k: v for k, v in SHARED_SOFTMAX.items() if k not in ("_lse_partial_kernel", "_group_aggregate_kernel")}


def _per_layer(launches: collections.Counter) -> dict:
    assert all(n % L == 0 for n in launches.values()), launches
    return {name: n // L for name, n in launches.items()}


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("aggregate, want", [("auto", SHARED_SOFTMAX), ("sum", RAW_SUM)])
def test_launches_per_layer_of_a_decode_step(aggregate, want):
    """The default (one selection per KV group, softmax-max) and the raw sum; the first decode step records the
    layer's plan and later steps replay it: both count the same launches."""
    torch.manual_seed(0)
    model = tiny_model(num_layers=L, num_heads=4, num_kv_heads=2, head_dim=16)
    enable_loki(model, PCABasis.random(L, 2, 16, seed=1), k=0.5, d=0.25, backend="triton", aggregate=aggregate)
    kw = {cache_keyword(model): loki_cache(model, static=True, max_cache_len=P + 4)}
    ids = torch.randint(0, model.config.vocab_size, (1, P + 2))
    with torch.no_grad():
        model(input_ids=ids[:, :P], use_cache=True, cache_position=torch.arange(P), **kw)
        steps = []
        for t in (P, P + 1):
            with counting() as launches:
                model(input_ids=ids[:, t:t + 1], use_cache=True, cache_position=torch.tensor([t]), **kw)
            steps.append(_per_layer(launches))
    assert steps[0] == steps[1] == want
    assert sum(want.values()) == len(want)  # one launch of each kernel per layer


def test_counting_nests_and_stops_at_exit():
    from loki.kernels import launch as launch_mod

    with counting() as outer:
        with counting() as inner:
            launch_mod._count(test_counting_nests_and_stops_at_exit)
        launch_mod._count(test_counting_nests_and_stops_at_exit)
    launch_mod._count(test_counting_nests_and_stops_at_exit)
    name = test_counting_nests_and_stops_at_exit.__name__
    assert (inner[name], outer[name]) == (1, 2) and not launch_mod._COUNTERS
