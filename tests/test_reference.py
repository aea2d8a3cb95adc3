"""Properties of the PyTorch references (loki.reference): the ground truth for kernels and integrations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loki.reference import (
    approx_scores,
    budget,
    dense_attention,
    exact_scores,
    h2o_attention,
    loki_attention,
    pcaattn_attention,
    rotate_keys,
    rotate_query,
    select_topk,
    sparq_attention,
    sparse_attention,
)
from loki.testing.inputs import make_decode_inputs, random_orthogonal
from loki.testing.invariants import check_selection
from loki.testing.strategies import decode_shapes
from loki.testing.tolerances import assert_close_to_reference


def _inputs(shape, dtype=torch.float64, seed=0, ragged=False, left_pad=False):
    return make_decode_inputs(shape.B, shape.HQ, shape.HKV, shape.S, shape.D, dtype=dtype, seed=seed,
                              ragged=ragged, left_pad=left_pad)


def _pca_basis(k_cache: torch.Tensor) -> torch.Tensor:
    """A basis calibrated on the keys themselves: eigenvectors of the centred covariance, per KV head."""
    B, HKV, S, D = k_cache.shape
    x = k_cache.double().transpose(0, 1).reshape(HKV, B * S, D)
    x = x - x.mean(1, keepdim=True)
    cov = x.transpose(1, 2) @ x / max(B * S - 1, 1)
    _, vecs = torch.linalg.eigh(cov)
    return vecs.flip(-1)


@given(shape=decode_shapes(), seed=st.integers(0, 2**16), kind=st.sampled_from(["qr", "pca", "identity"]))
def test_dense_attention_invariant_under_orthogonal_basis(shape, seed, kind):
    x = _inputs(shape, seed=seed, ragged=True)
    if kind == "qr":
        P = random_orthogonal(shape.HKV, shape.D, seed=seed, dtype=torch.float64)
    elif kind == "pca":
        P = _pca_basis(x.k_cache)
    else:
        P = torch.eye(shape.D, dtype=torch.float64).expand(shape.HKV, -1, -1).contiguous()
    ref = dense_attention(x.q, x.k_cache, x.v_cache, x.lengths, compute_dtype=torch.float64)
    rot = dense_attention(rotate_query(x.q, P), rotate_keys(x.k_cache, P), x.v_cache, x.lengths,
                          compute_dtype=torch.float64)
    torch.testing.assert_close(rot, ref, rtol=1e-9, atol=1e-9)


@given(shape=decode_shapes(), seed=st.integers(0, 2**16), mode=st.sampled_from(["query", "kv"]))
def test_loki_full_budget_equals_dense(shape, seed, mode):
    x = _inputs(shape, seed=seed, ragged=True, left_pad=True)
    P = random_orthogonal(shape.HKV, shape.D, seed=seed, dtype=torch.float64)
    qh, kh = rotate_query(x.q, P), rotate_keys(x.k_cache, P)
    ref = dense_attention(x.q, x.k_cache, x.v_cache, x.lengths, x.starts, compute_dtype=torch.float64)
    out = loki_attention(qh, kh, x.v_cache, d=shape.D, k=1.0, lengths=x.lengths, starts=x.starts,
                         gqa_select=mode, compute_dtype=torch.float64, aggregate="sum")
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@given(shape=decode_shapes(), seed=st.integers(0, 2**16), mode=st.sampled_from(["query", "kv"]))
def test_loki_with_full_dims_selects_exact_topk(shape, seed, mode):
    x = _inputs(shape, seed=seed, ragged=True)
    P = random_orthogonal(shape.HKV, shape.D, seed=seed, dtype=torch.float64)
    qh, kh = rotate_query(x.q, P), rotate_keys(x.k_cache, P)
    _, (idx, counts) = loki_attention(qh, kh, x.v_cache, d=shape.D, k=shape.k, lengths=x.lengths,
                                      gqa_select=mode, compute_dtype=torch.float64, return_indices=True,
                                      aggregate="sum")
    exact = exact_scores(x.q, x.k_cache, x.lengths, compute_dtype=torch.float64)
    if mode == "kv":
        exact = exact.view(shape.B, shape.HKV, -1, shape.S).sum(2)
    # ties allowed: a selected token may differ from exact top-k's only where the scores tie to rounding
    rows = check_selection(idx, exact, counts, slack=1e-9 * max(1.0, float(exact[torch.isfinite(exact)].abs().max())))
    assert rows == idx.shape[0] * idx.shape[1]


@given(shape=decode_shapes(), seed=st.integers(0, 2**16))
def test_select_topk_invariants(shape, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(shape.B, shape.HQ, shape.S, generator=g)
    scores[..., ::3] = scores[..., :1].clone()  # plenty of ties
    lengths = torch.randint(1, shape.S + 1, (shape.B,), generator=g, dtype=torch.int32)
    scores = scores.masked_fill(torch.arange(shape.S)[None, None, :] >= lengths[:, None, None], float("-inf"))
    counts = budget(shape.k, lengths, None, shape.B, shape.S)
    idx = select_topk(scores, counts)
    assert idx.shape == (shape.B, shape.HQ, int(counts.max()))
    assert check_selection(idx, scores, counts) == shape.B * shape.HQ


@given(shape=decode_shapes(groups=(1,)), seed=st.integers(0, 2**16))
def test_kv_selection_with_one_query_head_per_group_equals_query_selection(shape, seed):
    x = _inputs(shape, seed=seed, ragged=True)
    a, (ia, _) = loki_attention(x.q, x.k_cache, x.v_cache, d=shape.d, k=shape.k, lengths=x.lengths,
                                gqa_select="query", compute_dtype=torch.float64, return_indices=True, aggregate="sum")
    b, (ib, _) = loki_attention(x.q, x.k_cache, x.v_cache, d=shape.d, k=shape.k, lengths=x.lengths,
                                gqa_select="kv", compute_dtype=torch.float64, return_indices=True, aggregate="sum")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(ia, ib)


@given(shape=decode_shapes(max_batch=4), seed=st.integers(0, 2**16), pad=st.integers(1, 40))
def test_padding_does_not_change_results(shape, seed, pad):
    """A sequence padded on the left and right with garbage gives what it gives alone."""
    x = _inputs(shape, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    B, HKV, S, D = x.k_cache.shape
    left = pad // 2
    S2 = S + pad
    kp = torch.randn(B, HKV, S2, D, generator=g, dtype=torch.float64) * 100
    vp = torch.randn(B, HKV, S2, D, generator=g, dtype=torch.float64) * 100
    kp[:, :, left:left + S] = x.k_cache
    vp[:, :, left:left + S] = x.v_cache
    starts = torch.full((B,), left, dtype=torch.int32)
    lengths = torch.full((B,), left + S, dtype=torch.int32)
    kw = dict(compute_dtype=torch.float64)
    torch.testing.assert_close(
        dense_attention(x.q, kp, vp, lengths, starts, **kw), dense_attention(x.q, x.k_cache, x.v_cache, **kw))
    torch.testing.assert_close(
        loki_attention(x.q, kp, vp, d=shape.d, k=shape.k, lengths=lengths, starts=starts, gqa_select="query",
                       aggregate="sum", **kw),
        loki_attention(x.q, x.k_cache, x.v_cache, d=shape.d, k=shape.k, gqa_select="query", aggregate="sum", **kw))
    torch.testing.assert_close(
        sparq_attention(x.q, kp, vp, r=shape.d, k=shape.k, lengths=lengths, starts=starts, **kw),
        sparq_attention(x.q, x.k_cache, x.v_cache, r=shape.d, k=shape.k, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["query", "kv"])
@pytest.mark.parametrize(
    "B,HQ,HKV,S,D",
    [pytest.param(1, 4, 4, 97, 64, id="B1-S97-HQ4-HKV4-D64"),
     pytest.param(3, 12, 4, 1025, 96, id="B3-S1025-HQ12-HKV4-D96"),
     pytest.param(2, 8, 1, 333, 128, id="B2-S333-HQ8-HKV1-D128")],
)
def test_low_precision_within_reference_error(B, HQ, HKV, S, D, mode, dtype):
    """Loki on fp16/bf16 inputs with the given selection: the fp32-accumulating reference is within the
    tolerance table of the float64 result on the same selection."""
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=dtype, ragged=True)
    k = max(1, S // 4)
    _, (idx, counts) = loki_attention(x.q, x.k_cache, x.v_cache, d=D // 4, k=k, lengths=x.lengths,
                                      gqa_select=mode, return_indices=True, aggregate="sum")
    q64, k64, v64 = x.q.double(), x.k_cache.double(), x.v_cache.double()
    ref64 = sparse_attention(q64, k64, v64, idx, counts, compute_dtype=torch.float64)
    out = sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts)  # fp32 accumulation
    lowp = sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, compute_dtype=dtype)
    assert_close_to_reference(out, ref64, lowp, dtype)


def test_sparq_full_budget_equals_dense():
    x = make_decode_inputs(2, 8, 2, 200, 64, dtype=torch.float64, ragged=True)
    out = sparq_attention(x.q, x.k_cache, x.v_cache, r=64, k=1.0, lengths=x.lengths, compute_dtype=torch.float64)
    ref = dense_attention(x.q, x.k_cache, x.v_cache, x.lengths, compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref)


def test_sparq_mean_value_reallocation():
    """With k=1 SparQ mixes the single selected token with the mean value by the approximate mass."""
    x = make_decode_inputs(1, 2, 1, 50, 64, dtype=torch.float64)
    out, (idx, _) = sparq_attention(x.q, x.k_cache, x.v_cache, r=64, k=1, compute_dtype=torch.float64,
                                    return_indices=True)
    s = exact_scores(x.q, x.k_cache, compute_dtype=torch.float64) / math.sqrt(64)
    p = torch.softmax(s, -1)
    alpha = p.gather(-1, idx)  # [1, 2, 1]
    v = x.v_cache[0, 0]
    expect = alpha[..., 0, None] * v[idx[0, :, 0]][None] + (1 - alpha[..., 0, None]) * v.mean(0)
    torch.testing.assert_close(out, expect)


def test_pcaattn_full_dims_equals_dense_and_truncation_changes_it():
    x = make_decode_inputs(2, 4, 2, 128, 64, dtype=torch.float64)
    P = random_orthogonal(2, 64, dtype=torch.float64)
    qh, kh = rotate_query(x.q, P), rotate_keys(x.k_cache, P)
    ref = dense_attention(x.q, x.k_cache, x.v_cache, compute_dtype=torch.float64)
    torch.testing.assert_close(pcaattn_attention(qh, kh, x.v_cache, d=64, compute_dtype=torch.float64), ref)
    assert (pcaattn_attention(qh, kh, x.v_cache, d=8, compute_dtype=torch.float64) - ref).abs().max() > 1e-3


def test_h2o_budget_is_recent_window_plus_heavy_hitters():
    x = make_decode_inputs(2, 2, 2, 40, 64, dtype=torch.float64)
    acc = torch.zeros(2, 2, 40, dtype=torch.float64)
    acc[:, :, 3] = 5.0  # a heavy hitter far from the recent window
    acc[:, :, 7] = 4.0
    out, w = h2o_attention(x.q, x.k_cache, x.v_cache, acc, k=6, compute_dtype=torch.float64, return_weights=True)
    kept = w > 0
    assert (kept.sum(-1) == 6).all()  # k tokens: 3 recent + 3 heavy hitters
    assert kept[:, :, 37:].all() and kept[:, :, 3].all() and kept[:, :, 7].all()
    # the third heavy hitter is one of the tied zero-score tokens outside the recent window
    assert (kept[:, :, :37].sum(-1) == 3).all()
    torch.testing.assert_close(out, dense_attention(x.q, x.k_cache, x.v_cache, mask=kept, compute_dtype=torch.float64))


def test_approx_scores_use_only_the_first_d_dims():
    x = make_decode_inputs(2, 4, 2, 64, 64, dtype=torch.float64)
    s = approx_scores(x.q, x.k_cache, 16, gqa_select="query", aggregate="sum")
    k2 = x.k_cache.clone()
    k2[..., 16:] = torch.randn_like(k2[..., 16:])
    torch.testing.assert_close(approx_scores(x.q, k2, 16, gqa_select="query", aggregate="sum"), s)
    kv = approx_scores(x.q, x.k_cache, 16, gqa_select="kv", aggregate="sum")
    torch.testing.assert_close(kv, s.view(2, 2, 2, 64).sum(2))


@pytest.mark.parametrize("k,n,expect", [(0.25, 4, 1), (0.25, 5, 2), (0.01, 3, 1), (1.0, 7, 7), (3, 2, 2), (3, 9, 3)])
def test_budget_rounds_up_and_caps(k, n, expect):
    assert int(budget(k, torch.tensor([n], dtype=torch.int32), None, 1, 10)[0]) == expect
