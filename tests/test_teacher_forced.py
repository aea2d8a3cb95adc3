"""The row-batched (teacher-forced) forms of the decode methods against the per-row decode references."""

from __future__ import annotations

import pytest
import torch

from loki.reference import (
    dense_attention,
    exact_topk_attention,
    loki_attention,
    pcaattn_attention,
    select_topk,
    sparq_attention,
)
from loki.reference.teacher_forced import teacher_forced_rows, topk_mask


def _rows_reference(method, q, k, v, starts, lengths, *, kb, d, gqa_select="query", aggregate="sum"):
    """Row by row through the decode references; rows that see no token give zeros."""
    B, HQ, L, D = q.shape
    if isinstance(kb, int):
        kb = min(kb, k.shape[2])  # as the integration does: a count above the cache keeps every token
    out = torch.zeros(B, HQ, L, D, dtype=torch.float64)
    for b in range(B):
        for i in range(L):
            st, ln = int(starts[b, i]), int(lengths[b, i])
            if ln <= st:
                continue
            args = (q[b : b + 1, :, i], k[b : b + 1], v[b : b + 1])
            kw = dict(lengths=torch.tensor([ln]), starts=torch.tensor([st]))
            if method == "loki":
                o = loki_attention(*args, d=d, k=kb, gqa_select=gqa_select, aggregate=aggregate, **kw)
            elif method == "exact_topk":
                o = exact_topk_attention(*args, k=kb, gqa_select=gqa_select, aggregate=aggregate, **kw)
            elif method == "pcaattn":
                o = pcaattn_attention(*args, d=d, **kw)
            elif method == "sparq":
                o = sparq_attention(*args, r=d, k=kb, **kw)
            else:
                o = dense_attention(*args, **kw)
            out[b, :, i] = o[0].double()
    return out


def _inputs(B=2, HQ=4, HKV=2, L=23, S=29, D=16, seed=0, padded=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, L, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    # causal rows at the end of the cache (row i sees S - L + i + 1 tokens); sequence 1 left-padded by 9
    lengths = (S - L + 1 + torch.arange(L))[None].repeat(B, 1)
    starts = torch.zeros(B, L, dtype=torch.long)
    if padded:
        starts[1] = 9
    return q, k, v, starts, lengths


CASES = [
    ("loki", 0.25, 0.25, "query", "sum"),
    ("loki", 5, 4, "kv", "sum"),
    ("loki", 0.3, 0.5, "kv", "max"),
    ("exact_topk", 0.25, 1.0, "query", "sum"),
    ("exact_topk", 3, 1.0, "kv", "sum"),
    ("exact_topk", 100, 1.0, "query", "sum"),  # a count above the cache keeps everything
    ("pcaattn", 1.0, 0.25, "query", "sum"),
    ("dense", 1.0, 1.0, "query", "sum"),
    ("sparq", 0.25, 4, "query", "sum"),
    ("sparq", 0.5, 0.5, "query", "sum"),
]


@pytest.mark.parametrize("method,kb,d,gqa,agg", CASES)
def test_rows_equal_per_row_decode_references(method, kb, d, gqa, agg):
    q, k, v, starts, lengths = _inputs()
    got = teacher_forced_rows(q, k, v, starts, lengths, method=method, k_budget=kb, d=d, gqa_select=gqa,
                              aggregate=agg)
    want = _rows_reference(method, q, k, v, starts, lengths, kb=kb, d=d, gqa_select=gqa, aggregate=agg)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_elements", [1, 300, 1 << 24])
def test_blocks_of_rows_do_not_change_the_result(block_elements):
    q, k, v, starts, lengths = _inputs(L=29, S=29)
    ref = teacher_forced_rows(q, k, v, starts, lengths, method="loki", k_budget=0.25, d=0.5, gqa_select="query",
                              aggregate="sum")
    got = teacher_forced_rows(q, k, v, starts, lengths, method="loki", k_budget=0.25, d=0.5,
                              block_elements=block_elements, gqa_select="query", aggregate="sum")
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_rows_that_see_nothing_give_zeros():
    q, k, v, starts, lengths = _inputs(B=1, L=4, S=6, padded=False)
    starts[0, :2] = lengths[0, :2]  # rows 0 and 1 see no token (fully padded)
    for method in ("loki", "exact_topk", "dense", "sparq", "pcaattn"):
        out = teacher_forced_rows(q, k, v, starts, lengths, method=method, k_budget=0.5, d=0.5, gqa_select="query",
                                  aggregate="sum")
        assert torch.isfinite(out).all()
        assert out[:, :, :2].abs().max() == 0 and out[:, :, 2:].abs().max() > 0


def test_fp64_inputs_keep_their_dtype_and_bf16_runs():
    q, k, v, starts, lengths = _inputs()
    out = teacher_forced_rows(q.double(), k.double(), v.double(), starts, lengths, method="loki", k_budget=0.25,
                              d=0.25, gqa_select="query", aggregate="sum")
    assert out.dtype == torch.float64
    out = teacher_forced_rows(q.bfloat16(), k.bfloat16(), v.bfloat16(), starts, lengths, method="exact_topk",
                              k_budget=0.25, gqa_select="query", aggregate="sum")
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_topk_mask_counts_and_ties_go_to_the_lowest_index():
    s = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, float("-inf")],
                      [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                      [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    m = topk_mask(s, torch.tensor([2, 3, 0]))
    assert m.tolist() == [[False, True, True, False, False, False],
                          [True, True, True, False, False, False],
                          [False] * 6]
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 5, 40, generator=g).round(decimals=1)  # many ties
    counts = torch.randint(0, 41, (3, 5), generator=g)
    m = topk_mask(s, counts)
    assert torch.equal(m.sum(-1), counts)
    for r in range(3):  # the kept set is the top of a stable descending order
        for h in range(5):
            order = torch.sort(s[r, h], descending=True, stable=True).indices
            assert set(order[: int(counts[r, h])].tolist()) == set(m[r, h].nonzero().flatten().tolist())


def test_topk_mask_agrees_with_select_topk_without_ties():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 3, 50, generator=g)
    counts = torch.tensor([7, 50])
    idx = select_topk(s, counts)
    m = topk_mask(s, counts[:, None])
    for b in range(2):
        for h in range(3):
            want = set(idx[b, h, : int(counts[b])].tolist())
            assert want == set(m[b, h].nonzero().flatten().tolist())
