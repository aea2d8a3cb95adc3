"""Quest (loki.reference.quest): page bounds, page selection, the decode reference, its teacher-forced rows and its
bytes."""

from __future__ import annotations

import math

import pytest
import torch

from loki.reference import dense_attention, quest_attention
from loki.reference.accounting import score_fraction, step_bytes_fraction, tally_selections
from loki.reference.quest import page_bounds, page_metadata, select_pages
from loki.reference.teacher_forced import teacher_forced_rows


def _cache(B=2, HQ=4, HKV=2, S=53, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, D, generator=g), torch.randn(B, HKV, S, D, generator=g),
            torch.randn(B, HKV, S, D, generator=g))


def test_page_bounds_are_the_quest_formula_and_bound_every_score_of_the_page():
    q, k, _ = _cache(S=40)
    starts, lengths = torch.tensor([0, 3]), torch.tensor([40, 37])
    k_min, k_max = page_metadata(k, starts, lengths, page_size=8)
    u = page_bounds(q[:, :, None], k_min, k_max)[:, :, 0]  # [B, HQ, P]
    G = 2
    checked = 0
    for b in range(2):
        for h in range(4):
            qh = q[b, h]
            for p in range(u.shape[-1]):
                lo, hi = int(starts[b]) + 8 * p, min(int(starts[b]) + 8 * (p + 1), int(lengths[b]))
                if lo >= hi:
                    continue
                kp = k[b, h // G, lo:hi]
                literal = torch.maximum(qh * kp.amax(0), qh * kp.amin(0)).sum()
                torch.testing.assert_close(u[b, h, p], literal, rtol=1e-5, atol=1e-5)
                assert float((kp @ qh).max()) <= float(u[b, h, p]) + 1e-5
                checked += 1
    assert checked == 2 * 4 * 5  # P = 5 pages; sequence 1 (34 tokens) fills them too, its last one with 2


def test_page_metadata_ignores_tokens_outside_the_valid_range():
    _, k, _ = _cache(B=1, S=20)
    k[:, :, 17:] = float("nan")  # stale cache rows past the sequence's length
    k[:, :, :2] = float("inf")  # left padding
    k_min, k_max = page_metadata(k, torch.tensor([2]), torch.tensor([17]), page_size=4)
    assert torch.isfinite(k_min[:, :, :4]).all() and torch.isfinite(k_max[:, :, :4]).all()
    torch.testing.assert_close(k_max[0, :, 0], k[0, :, 2:6].amax(1))
    torch.testing.assert_close(k_min[0, :, 3], k[0, :, 14:17].amin(1))


def test_a_planted_case_selects_the_pages_with_the_largest_bound():
    # D = 1, q = 1: a page's bound is its largest key. 6 pages of 4 tokens; k = 12 -> 3 pages: the current one
    # (page 5) and the two of largest maximum among pages 0..4.
    maxima = [0.0, 5.0, 1.0, 4.0, 2.0, -9.0]
    k = torch.zeros(1, 1, 24, 1)
    for p, m in enumerate(maxima):
        k[0, 0, 4 * p] = m
        k[0, 0, 4 * p + 1 : 4 * p + 4] = m - 10
    q = torch.ones(1, 1, 1)
    v = torch.randn(1, 1, 24, 1)
    _, (idx, counts) = quest_attention(q, k, v, k=12, page_size=4, return_indices=True, gqa_select="query",
                                       aggregate="sum")
    assert counts.tolist() == [[12]]
    assert idx[0, 0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


CASES = [
    pytest.param(0.25, 16, "query", "sum", id="kf0.25-ps16-query"),
    pytest.param(0.3, 4, "query", "sum", id="kf0.3-ps4-query"),
    pytest.param(7, 3, "kv", "softmax-max", id="k7-ps3-kv-softmax-max"),
    pytest.param(0.5, 5, "kv", "sum", id="kf0.5-ps5-kv-sum"),
    pytest.param(0.2, 1, "query", "sum", id="kf0.2-ps1-query"),
]


@pytest.mark.parametrize("kb,ps,gqa,agg", CASES)
def test_selection_invariants(kb, ps, gqa, agg):
    q, k, v = _cache(S=97)
    starts, lengths = torch.tensor([0, 11]), torch.tensor([97, 80])
    _, (idx, counts) = quest_attention(q, k, v, k=kb, lengths=lengths, starts=starts, page_size=ps, gqa_select=gqa,
                                       aggregate=agg, return_indices=True)
    H = 4 if gqa == "query" else 2
    assert idx.shape[:2] == (2, H) and counts.shape == (2, H)
    k_min, k_max = page_metadata(k, starts, lengths, page_size=ps)
    u = page_bounds(q[:, :, None], k_min, k_max)[:, :, 0]
    rows = 0
    for b in range(2):
        n = int(lengths[b] - starts[b])
        kk = min(kb, n) if isinstance(kb, int) else math.ceil(kb * n - 1e-9)
        n_pages, want = -(-n // ps), -(-kk // ps)
        current = n_pages - 1
        for h in range(H):
            sel = idx[b, h, : int(counts[b, h])]
            assert (sel >= int(starts[b])).all() and (sel < int(lengths[b])).all()
            assert len(set(sel.tolist())) == len(sel)
            pages = sorted({(int(s) - int(starts[b])) // ps for s in sel})
            assert current in pages and len(pages) == min(want, n_pages)
            # whole pages: every valid token of a selected page is selected
            full = {s for p in pages for s in range(int(starts[b]) + p * ps, min(int(starts[b]) + (p + 1) * ps,
                                                                                  int(lengths[b])))}
            assert full == set(sel.tolist())
            if gqa == "query":  # every other selected page bounds at least as high as every unselected one
                others = [p for p in range(current) if p not in pages]
                chosen = [p for p in pages if p != current]
                if others and chosen:
                    assert float(u[b, h, chosen].min()) >= float(u[b, h, others].max())
            rows += 1
    assert rows == 2 * H


def test_every_token_is_dense_attention():
    q, k, v = _cache(S=61)
    lengths, starts = torch.tensor([61, 50]), torch.tensor([0, 7])
    for gqa in ("query", "kv"):
        out = quest_attention(q, k, v, k=1.0, lengths=lengths, starts=starts, gqa_select=gqa, aggregate="max")
        torch.testing.assert_close(out, dense_attention(q, k, v, lengths, starts), rtol=1e-5, atol=1e-6)


def test_shared_selection_is_one_per_kv_head_and_equals_query_mode_without_gqa():
    q, k, v = _cache(HQ=2, HKV=2, S=70)
    a = quest_attention(q, k, v, k=0.2, page_size=8, gqa_select="query", return_indices=True, aggregate="sum")
    b = quest_attention(q, k, v, k=0.2, page_size=8, gqa_select="kv", aggregate="softmax-max", return_indices=True)
    torch.testing.assert_close(a[0], b[0])
    assert torch.equal(a[1][0], b[1][0])


def _rows_reference(q, keys, v, starts, lengths, **kw):
    """Row by row through quest_attention; rows that see nothing give zeros."""
    B, HQ, L, D = q.shape
    out = torch.zeros(B, HQ, L, D, dtype=torch.float64)
    for b in range(B):
        for i in range(L):
            st, ln = int(starts[b, i]), int(lengths[b, i])
            if ln > st:
                out[b, :, i] = quest_attention(q[b : b + 1, :, i], keys[b : b + 1], v[b : b + 1],
                                               lengths=torch.tensor([ln]), starts=torch.tensor([st]), **kw)[0].double()
    return out


@pytest.mark.parametrize("kb,ps,gqa,agg", CASES)
@pytest.mark.parametrize("layout", ["causal-padded", "sliding"])
def test_teacher_forced_rows_equal_per_row_decode_steps(kb, ps, gqa, agg, layout):
    g = torch.Generator().manual_seed(3)
    B, HQ, HKV, L, S, D = 2, 4, 2, 37, 45, 8
    q, k, v = (torch.randn(B, HQ, L, D, generator=g), torch.randn(B, HKV, S, D, generator=g),
               torch.randn(B, HKV, S, D, generator=g))
    lengths = (S - L + 1 + torch.arange(L))[None].repeat(B, 1)
    starts = torch.zeros(B, L, dtype=torch.long)
    if layout == "causal-padded":
        starts[1] = 10
        starts[1, :2], lengths[1, :2] = 0, 0  # rows that see no token (the integration gives them 0, 0)
    else:  # a sliding window of 29 tokens: the rows' first tokens move
        starts = (lengths - 29).clamp(min=0)
    kw = dict(k=kb, page_size=ps, gqa_select=gqa, aggregate=agg)
    got = teacher_forced_rows(q, k, v, starts, lengths, method="quest", k_budget=kb, page_size=ps, gqa_select=gqa,
                              aggregate=agg, block_elements=2000)
    torch.testing.assert_close(got.double(), _rows_reference(q, k, v, starts, lengths, **kw), rtol=1e-5, atol=1e-5)


def test_selected_bytes_are_measured_and_whole_pages():
    q, k, v = _cache(S=64)
    with tally_selections() as t:
        quest_attention(q, k, v, k=1.0, page_size=16, gqa_select="query", aggregate="sum")
    assert t.count == 2 * 2 and t.selected_fraction == pytest.approx(1.0)
    with tally_selections() as t:  # k = 20 of 64 -> 2 pages of 16: the current one and one more
        quest_attention(q, k, v, k=20, page_size=16, gqa_select="kv", aggregate="max")
    assert t.selected_fraction == pytest.approx(32 / 64)
    assert score_fraction("quest") == 1 / 16 and score_fraction("quest", page_size=8) == 1 / 8
    assert step_bytes_fraction("quest", 0.5) == pytest.approx(0.5 + 1 / 16)


def test_byte_model_of_every_method():
    D = 64
    assert step_bytes_fraction("loki", 0.25, 0.25, D) == pytest.approx(0.375)
    assert step_bytes_fraction("loki", 0.25, 16, D) == pytest.approx(0.375)
    assert step_bytes_fraction("sparq", 0.25, 16, D) == pytest.approx(0.375)
    assert step_bytes_fraction("exact_topk", 0.25) == pytest.approx(0.625)
    assert step_bytes_fraction("h2o", 0.25) == pytest.approx(0.25)
    assert step_bytes_fraction("pcaattn", None, 0.25, D) == pytest.approx(0.625)
    assert step_bytes_fraction("dense", None) == step_bytes_fraction("full", 0.3) == 1.0
    assert step_bytes_fraction("loki", None, 0.25, D) is None
    with pytest.raises(ValueError, match="method"):
        score_fraction("other")
    with pytest.raises(ValueError, match="needs d and D"):
        score_fraction("loki")


def test_bad_page_size_and_aggregate_are_refused():
    q, k, v = _cache(S=10)
    with pytest.raises(ValueError, match="page_size"):
        quest_attention(q, k, v, k=0.5, page_size=0, gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="agreement"):
        quest_attention(q, k, v, k=0.5, gqa_select="kv", aggregate="agreement")
    with pytest.raises(ValueError, match="gqa_select"):
        select_pages(torch.zeros(1, 4, 1, 2), torch.ones(1, 1), torch.ones(1, 1), HKV=2, gqa_select="x", scale=1.0,
                     aggregate="sum")


@pytest.mark.parametrize("gqa,agg", [("query", "sum"), ("kv", "softmax-max")])
def test_the_engine_equals_token_by_token_decoding_with_the_cache(gqa, agg):
    from loki.evaluation.perplexity import MethodSpec, method_logits
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=1)
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    spec = MethodSpec("quest", "quest", k=0.6, gqa_select=gqa, aggregate=agg)  # up to 3 pages of 16 per row
    rows = method_logits(model, ids, spec)
    loop = method_logits(model, ids, spec, decode_loop=True)
    torch.testing.assert_close(rows, loop, rtol=1e-4, atol=1e-4)
    dense = method_logits(model, ids, MethodSpec("dense", "dense"))
    assert (rows - dense).abs().max() > 1e-3  # the selection does drop tokens
