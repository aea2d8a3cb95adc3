"""Selection diagnostics: recall of the exact top-k set and captured attention mass, per layer and head, on cases
with known answers (loki.reference.accounting, loki.evaluation.diagnostics)."""

from __future__ import annotations

import math

import pytest
import torch

from loki.evaluation.diagnostics import layer_diagnostics, merge_sums, summarize_diagnostics
from loki.reference.accounting import selection_quality, tally_diagnostics
from loki.reference.teacher_forced import teacher_forced_rows


def _causal(B, L):
    return torch.zeros(B, L, dtype=torch.long), (1 + torch.arange(L))[None].repeat(B, 1)


def test_selection_quality_of_a_planted_selection():
    S = 10
    exact = -torch.arange(S, dtype=torch.float32).view(1, 1, 1, S)  # the exact top-4 set is tokens 0..3
    visible = torch.ones(1, 1, 1, S, dtype=torch.bool)
    sel = torch.zeros(1, 1, 1, S, dtype=torch.bool)
    sel[..., 2:6] = True
    q = selection_quality(sel, exact, visible, torch.tensor([[4]]), scale=0.5)
    p = torch.softmax(0.5 * exact[0, 0, 0].double(), -1)
    assert float(q["recall"]) == 0.5
    assert float(q["mass"]) == pytest.approx(float(p[2:6].sum()))
    assert float(q["oracle_mass"]) == pytest.approx(float(p[:4].sum()))
    # a shared selection [B, HKV, R, S] is read by every query head of its group
    q2 = selection_quality(sel, exact.expand(1, 3, 1, S), visible, torch.tensor([[4]]), scale=0.5)
    assert q2["recall"].shape == (1, 3, 1) and (q2["recall"] == 0.5).all()


@pytest.mark.parametrize("method,d", [("loki", 0.25), ("exact_topk", 1.0), ("sparq", 2), ("quest", 1.0)])
def test_every_token_recalls_everything_and_captures_all_mass(method, d):
    g = torch.Generator().manual_seed(0)
    B, HQ, HKV, L, D = 2, 4, 2, 20, 8
    q, k, v = torch.randn(B, HQ, L, D, generator=g), torch.randn(B, HKV, L, D, generator=g), torch.randn(
        B, HKV, L, D, generator=g)
    starts, lengths = _causal(B, L)
    for gqa in ("query", "kv"):
        if method == "sparq" and gqa == "kv":
            continue
        with tally_diagnostics() as t:
            teacher_forced_rows(q, k, v, starts, lengths, method=method, k_budget=1.0, d=d, gqa_select=gqa,
                                aggregate="softmax-max")
        s = summarize_diagnostics(t.cpu_sums(), HKV)
        assert s["rows"] == [0]  # k = all: no informative row
        assert s["all_rows"]["rows"] == B * L
        assert s["all_rows"]["recall_mean"] == pytest.approx(1.0)
        assert s["all_rows"]["mass_mean"] == pytest.approx(1.0)
        assert s["all_rows"]["oracle_mass_mean"] == pytest.approx(1.0)


def test_a_planted_reversed_order_has_a_known_recall():
    # D = 2, d = 1, q = (1, 1): the first dim of key s is s (Loki's approximate score prefers late tokens), the
    # exact score s - 3 s = -2 s prefers early ones; row i (i + 1 tokens, budget k_i) recalls max(0, 2 k_i - n)/k_i.
    L = 24
    q = torch.ones(1, 1, L, 2)
    pos = torch.arange(L, dtype=torch.float32)
    k = torch.stack([pos, -3 * pos], dim=-1)[None, None]
    v = torch.randn(1, 1, L, 2)
    starts, lengths = _causal(1, L)
    with tally_diagnostics() as t:
        teacher_forced_rows(q, k, v, starts, lengths, method="loki", k_budget=0.25, d=1, gqa_select="query",
                            aggregate="sum")
    s = summarize_diagnostics(t.cpu_sums(), 1)
    want, rows = 0.0, 0
    for i in range(L):
        n = i + 1
        kk = max(1, math.ceil(0.25 * n - 1e-9))
        if kk < n:
            want += max(0, 2 * kk - n) / kk
            rows += 1
    assert s["rows"] == [rows] and rows > 10
    assert s["recall_mean"] == pytest.approx(want / rows, abs=1e-5)
    assert s["recall"] == [[pytest.approx(want / rows, abs=1e-5)]]
    # exact top-k per query head recalls its own set: 1, and captures the oracle's mass
    with tally_diagnostics() as t:
        teacher_forced_rows(q, k, v, starts, lengths, method="exact_topk", k_budget=0.25, gqa_select="query",
                            aggregate="sum")
    s = summarize_diagnostics(t.cpu_sums(), 1)
    assert s["recall_mean"] == pytest.approx(1.0) and s["mass_mean"] == pytest.approx(s["oracle_mass_mean"])
    assert s["mass_mean"] < 1.0


def test_summary_per_kv_head_is_the_group_mean_and_sums_merge():
    sums = torch.zeros(2, 4, 4, dtype=torch.float64)
    sums[0, 0] = torch.tensor([2.0, 2.0, 4.0, 4.0])  # informative rows per query head
    sums[0, 1] = torch.tensor([2.0, 1.0, 4.0, 0.0])  # recall sums -> 1, 0.5, 1, 0
    sums[1, 0] = 5.0
    s = summarize_diagnostics(merge_sums([{3: sums}, None, {3: sums}]), 2)
    assert s["layers"] == [3] and s["rows"] == [4]
    assert s["recall"] == [[1.0, 0.5, 1.0, 0.0]]
    assert s["recall_kv"] == [[0.75, 0.5]]
    assert s["recall_mean"] == pytest.approx(14 / 24)  # rows-weighted: (2 + 1 + 4 + 0) / (2 + 2 + 4 + 4)
    assert s["all_rows"]["rows"] == 10
    assert summarize_diagnostics({}, 2)["recall_mean"] is None


def test_nothing_is_recorded_outside_a_tally():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 6, 4, generator=g), torch.randn(1, 1, 6, 4, generator=g)
    starts, lengths = _causal(1, 6)
    with tally_diagnostics() as t:
        pass
    teacher_forced_rows(q, k, k, starts, lengths, method="loki", k_budget=0.5, d=2, gqa_select="query", aggregate="sum")
    assert t.sums == {}


def test_the_engine_measures_every_layer_of_a_model():
    from loki.evaluation.perplexity import MethodSpec, perplexity
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    windows = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    informative = sum(1 for i in range(24) if math.ceil(0.25 * (i + 1) - 1e-9) < i + 1)
    r = perplexity(model, windows, MethodSpec("exact", "exact_topk", k=0.25), batch_size=1, diagnostics=True)
    dg = r.diagnostics
    assert dg["layers"] == [0, 1, 2] and dg["rows"] == [2 * informative] * 3
    assert dg["recall_mean"] == pytest.approx(1.0) and dg["mass_mean"] == pytest.approx(dg["oracle_mass_mean"])
    assert "diagnostics" in r.to_dict()
    shared = perplexity(model, windows, MethodSpec("exact-kv", "exact_topk", k=0.25, gqa_select="kv",
                                                   aggregate="softmax-max"), diagnostics=True).diagnostics
    assert shared["recall_mean"] < 1.0 and len(shared["recall_kv"][0]) == 2 and len(shared["recall"][0]) == 4
    h2o = perplexity(model, windows, MethodSpec("h2o", "h2o", k=0.25), batch_size=2, diagnostics=True).diagnostics
    assert h2o["layers"] == [0, 1, 2] and h2o["rows"] == [2 * informative] * 3
    assert 0 < h2o["recall_mean"] < 1 and 0 < h2o["mass_mean"] <= h2o["oracle_mass_mean"] + 1e-9
    plain = perplexity(model, windows, MethodSpec("exact", "exact_topk", k=0.25))
    assert plain.diagnostics is None and "diagnostics" not in plain.to_dict()
    assert plain.ppl == pytest.approx(r.ppl, rel=1e-6)


def test_layer_hooks_are_removed():
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8)
    before = [len(m._forward_pre_hooks) for m in model.modules()]
    with layer_diagnostics(model) as t:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert t.layer == 1
    assert [len(m._forward_pre_hooks) for m in model.modules()] == before
