"""The PyTorch references on the inputs a careless caller gives them: tied scores (one tie rule, lowest token
position first), garbage (NaN, inf) in cache rows outside the valid tokens, an empty batch, and bad scales."""

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
        _, (idx, _) = R.loki_attention(x.q, k_cache, x.v_cache, d=8, gqa_select="query", aggregate="sum", **kw)
    elif method == "exact_topk":
        _, (idx, _) = R.exact_topk_attention(x.q, k_cache, x.v_cache, gqa_select="query", aggregate="sum", **kw)
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


# ------------------------------------------------------------------------------------------------ garbage rows
def _run(method, q, kc, vc, lengths, starts):
    kw = dict(lengths=lengths, starts=starts)
    if method == "dense":
        return R.dense_attention(q, kc, vc, lengths, starts)
    if method == "loki":
        return R.loki_attention(q, kc, vc, d=8, k=0.5, gqa_select="query", aggregate="sum", **kw)
    if method == "exact_topk":
        return R.exact_topk_attention(q, kc, vc, k=0.5, gqa_select="query", aggregate="sum", **kw)
    if method == "pcaattn":
        return R.pcaattn_attention(q, kc, vc, d=8, **kw)
    if method == "sparq":
        return R.sparq_attention(q, kc, vc, r=8, k=0.5, **kw)
    acc = torch.rand(q.shape[0], q.shape[1], kc.shape[2], generator=torch.Generator().manual_seed(0))
    return R.h2o_attention(q, kc, vc, acc, k=0.5, **kw)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
@pytest.mark.parametrize("method", ["dense", "loki", "exact_topk", "pcaattn", "sparq", "h2o"])
def test_garbage_outside_the_valid_tokens_never_reaches_the_output(method, garbage):
    x = make_decode_inputs(3, 4, 2, 24, 16)
    lengths, starts = torch.tensor([24, 15, 9]), torch.tensor([0, 3, 6])
    clean = _run(method, x.q, x.k_cache, x.v_cache, lengths, starts)
    kc, vc = x.k_cache.clone(), x.v_cache.clone()
    outside = ~(torch.arange(24)[None] >= starts[:, None]) | ~(torch.arange(24)[None] < lengths[:, None])
    kc[outside[:, None, :, None].expand_as(kc)] = garbage
    vc[outside[:, None, :, None].expand_as(vc)] = garbage
    out = _run(method, x.q, kc, vc, lengths, starts)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------ empty batch
@pytest.mark.parametrize("method", ["dense", "loki", "exact_topk", "pcaattn", "sparq", "h2o"])
def test_empty_batch_gives_an_empty_output(method):
    x = make_decode_inputs(0, 4, 2, 16, 16)
    out = _run(method, x.q, x.k_cache, x.v_cache, None, None)
    assert out.shape == (0, 4, 16) and out.dtype == x.q.dtype


def test_empty_batch_selection():
    assert R.select_topk(torch.zeros(0, 3, 8), torch.zeros(0, dtype=torch.long)).shape == (0, 3, 0)
    _, (idx, counts) = R.loki_attention(*(torch.zeros(0, 2, 8), torch.zeros(0, 2, 5, 8), torch.zeros(0, 2, 5, 8)),
                                        d=2, k=2, return_indices=True, gqa_select="query", aggregate="sum")
    assert idx.shape[:2] == (0, 2) and counts.shape == (0,)


# ------------------------------------------------------------------------------------------------ scale
BAD_SCALES = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0, -1e-30]


@pytest.mark.parametrize("scale", BAD_SCALES)
@pytest.mark.parametrize("method", ["dense", "loki", "exact_topk", "pcaattn", "sparq", "h2o", "sparse"])
def test_bad_scale_is_refused_naming_it(method, scale):
    x = make_decode_inputs(1, 2, 2, 8, 16)
    with pytest.raises(ValueError, match=r"scale=.* must be a finite number > 0"):
        if method == "dense":
            R.dense_attention(x.q, x.k_cache, x.v_cache, scale=scale)
        elif method == "loki":
            R.loki_attention(x.q, x.k_cache, x.v_cache, d=4, k=2, scale=scale, gqa_select="query", aggregate="sum")
        elif method == "exact_topk":
            R.exact_topk_attention(x.q, x.k_cache, x.v_cache, k=2, scale=scale, gqa_select="query", aggregate="sum")
        elif method == "pcaattn":
            R.pcaattn_attention(x.q, x.k_cache, x.v_cache, d=4, scale=scale)
        elif method == "sparq":
            R.sparq_attention(x.q, x.k_cache, x.v_cache, r=4, k=2, scale=scale)
        elif method == "h2o":
            R.h2o_attention(x.q, x.k_cache, x.v_cache, torch.zeros(1, 2, 8), k=2, scale=scale)
        else:
            R.sparse_attention(x.q, x.k_cache, x.v_cache, torch.zeros(1, 2, 1, dtype=torch.long),
                               torch.ones(1, dtype=torch.long), scale=scale)


@given(scale=st.one_of(st.floats(max_value=0.0), st.just(float("nan")), st.just(float("inf"))))
def test_no_non_positive_or_non_finite_scale_is_accepted(scale):
    x = make_decode_inputs(1, 2, 2, 8, 16)
    with pytest.raises(ValueError, match="scale"):
        R.dense_attention(x.q, x.k_cache, x.v_cache, scale=scale)


@given(scale=st.floats(1e-3, 1e3))
def test_a_positive_scale_is_used_as_given(scale):
    x = make_decode_inputs(1, 2, 2, 8, 16)
    out = R.dense_attention(x.q, x.k_cache, x.v_cache, scale=scale, compute_dtype=torch.float64)
    s = torch.einsum("bhd,bhsd->bhs", x.q.double(), x.k_cache.double()) * scale
    ref = torch.einsum("bhs,bhsd->bhd", torch.softmax(s, -1), x.v_cache.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)


def test_scale_of_the_wrong_type_is_named():
    x = make_decode_inputs(1, 2, 2, 8, 16)
    with pytest.raises(TypeError, match="scale must be a real number"):
        R.dense_attention(x.q, x.k_cache, x.v_cache, scale="0.1")


# ------------------------------------------------------------------------------------------------ degenerate shapes
def test_empty_head_dim_or_heads_are_named():
    x = make_decode_inputs(2, 4, 2, 8, 16)
    with pytest.raises(ValueError, match=r"head dim D >= 1"):
        R.dense_attention(x.q[..., :0], x.k_cache[..., :0], x.v_cache[..., :0])
    with pytest.raises(ValueError, match=r"at least one head \(HQ=0, HKV=0\)"):
        R.dense_attention(x.q[:, :0], x.k_cache[:, :0], x.v_cache[:, :0])
    with pytest.raises(ValueError, match=r"at least one head \(HQ=0, HKV=2\)"):
        R.loki_attention(x.q[:, :0], x.k_cache, x.v_cache, d=4, k=2, gqa_select="query", aggregate="sum")


@pytest.mark.parametrize("counts,error,match", [
    ([1, 2], TypeError, r"counts must be an integer torch.Tensor of shape \[B\]=\[2\], got list"),
    (torch.tensor([1.0, 2.0]), TypeError, r"counts must be an integer tensor, got torch.float32"),
    (torch.tensor([1, 2, 3]), ValueError, r"counts must have shape \[B\]=\[2\]"),
])
def test_selection_counts_of_the_wrong_kind_are_named(counts, error, match):
    with pytest.raises(error, match=match):
        R.select_topk(torch.zeros(2, 2, 8), counts)


def test_sparse_attention_counts_outside_the_selection_are_named():
    x = make_decode_inputs(2, 4, 2, 8, 16)
    idx = torch.zeros(2, 4, 2, dtype=torch.long)
    for bad in ([0, 1], [1, 3]):
        with pytest.raises(ValueError, match=r"counts must lie in \[1, K=2\]"):
            R.sparse_attention(x.q, x.k_cache, x.v_cache, idx, torch.tensor(bad))
