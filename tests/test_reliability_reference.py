"""The PyTorch references on tied scores: one tie rule, the lowest token position first."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import loki.reference as R
from loki.testing.inputs import make_decode_inputs


def _expected_topk(row: list[float], k: int) -> list[int]:
    """The k largest of a row by (score descending, position ascending), -0.0 == +0.0, NaN above all."""
    def key(i):
        v = row[i]
        return (0 if math.isnan(v) else 1, -v if not math.isnan(v) else 0.0, i)
    return sorted(range(len(row)), key=key)[:k]


# ------------------------------------------------------------------------------------------------ ties
@given(
    values=st.lists(st.sampled_from([-1.5, -0.0, 0.0, 0.5, 2.0, float("-inf")]), min_size=1, max_size=40),
    frac=st.floats(0.01, 1.0),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
)
def test_topk_indices_breaks_ties_by_lowest_position(values, frac, dtype):
    k = max(1, math.ceil(frac * len(values)))
    scores = torch.tensor(values, dtype=dtype)
    got = R.topk_indices(scores[None], k)[0].tolist()
    assert got == _expected_topk([float(v) for v in scores.double()], k)


@given(n=st.integers(1, 64), k=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_select_topk_on_bf16_rounded_scores_takes_the_lowest_tied_positions(n, k, seed):
    k = min(k, n)
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(2, 3, n, generator=g) * 0.05).bfloat16().float()  # few distinct values: many ties
    counts = torch.tensor([k, max(1, k // 2)])
    idx = R.select_topk(scores, counts)
    for b in range(2):
        for h in range(3):
            c = int(counts[b])
            assert idx[b, h, :c].tolist() == _expected_topk(scores[b, h].tolist(), c)
            assert (idx[b, h, c:] == -1).all()


def test_nan_scores_rank_first_and_negative_zero_ties_with_zero():
    scores = torch.tensor([[[-0.0, 0.0, float("nan"), -0.0, 1.0, -float("nan")]]])
    assert R.select_topk(scores, torch.tensor([4]))[0, 0].tolist() == [2, 5, 4, 0]
    assert R.topk_indices(scores.double(), 4)[0, 0].tolist() == [2, 5, 4, 0]


@pytest.mark.parametrize("method", ["loki", "exact_topk", "sparq"])
def test_all_zero_keys_select_the_first_tokens(method):
    """Every score ties: each method attends to the first k valid tokens, so its output is their mean value."""
    x = make_decode_inputs(2, 4, 2, 32, 16)
    k_cache = torch.zeros_like(x.k_cache)
    lengths, starts = torch.tensor([32, 20]), torch.tensor([0, 5])
    kw = dict(k=6, lengths=lengths, starts=starts, return_indices=True)
    if method == "loki":
        _, (idx, _) = R.loki_attention(x.q, k_cache, x.v_cache, d=8, **kw)
    elif method == "exact_topk":
        _, (idx, _) = R.exact_topk_attention(x.q, k_cache, x.v_cache, **kw)
    else:
        _, (idx, _) = R.sparq_attention(x.q, k_cache, x.v_cache, r=4, **kw)
    assert idx[0].tolist() == [list(range(6))] * 4
    assert idx[1].tolist() == [list(range(5, 11))] * 4


def test_h2o_heavy_hitter_ties_go_to_the_earliest_tokens():
    x = make_decode_inputs(1, 2, 2, 16, 16)
    acc = torch.zeros(1, 2, 16)  # no token has received attention yet: all heavy-hitter scores tie
    _, w = R.h2o_attention(x.q, x.k_cache, x.v_cache, acc, k=8, return_weights=True)
    kept = (w[0] > 0).nonzero()[:, 1].view(2, -1)
    assert kept.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] * 2  # 4 heavy hitters (earliest), 4 recent
