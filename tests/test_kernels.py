"""Triton decode kernels against their PyTorch references.

CPU part: the kernels run under ``TRITON_INTERPRET=1`` (set by conftest) on small awkward shapes; every
kernel output is poisoned (NaN / sentinel) before launch so an unwritten element fails.  GPU part
(``-m gpu``): long caches, big batches, GQA 1/4/8, fp16/bf16/fp32, D 64/96/128.

Tolerances come from the reference's own error: the kernel's max error against the fp64 reference must be
at most twice that of the same PyTorch math at the input precision, plus a small absolute term per dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import loki.reference as R
from loki._checks import valid_token_mask
from loki.kernels import (
    approx_scores,
    approx_scores_reference,
    decode_attention,
    make_key_prefix,
    select_topk,
    sparq_attention,
    sparq_attention_reference,
    sparse_attention,
    sparse_attention_reference,
)
from loki.testing.inputs import make_decode_inputs, ragged_positions
from loki.testing.invariants import check_selection
from loki.testing.tolerances import ATOL, assert_close_to_reference

interp = pytest.mark.interpreter
gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every kernel output and intermediate is allocated NaN-filled (ints: an out-of-range sentinel)."""
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", "1")


def _inputs(B, HQ, HKV, S, D, dtype, device, *, ragged=False, left_pad=False, seed=0):
    return make_decode_inputs(B, HQ, HKV, S, D, dtype=dtype, device=device, ragged=ragged, left_pad=left_pad,
                              seed=seed)


# ----------------------------------------------------------------------------------------------------
# approximate scores
APPROX_CASES = [
    pytest.param(1, 4, 4, 1, 64, 16, False, False, id="B1-S1-HQ4-HKV4-D64-d16"),
    pytest.param(3, 6, 2, 97, 96, 24, True, True, id="B3-S97-HQ6-HKV2-D96-d24-ragged-leftpad"),
    pytest.param(2, 8, 2, 1025, 128, 32, True, False, id="B2-S1025-HQ8-HKV2-D128-d32-ragged"),
    pytest.param(1, 4, 1, 1100, 96, 96, False, True, id="B1-S1100-HQ4-HKV1-D96-d96-leftpad"),
    pytest.param(2, 3, 3, 300, 64, 5, True, True, id="B2-S300-HQ3-HKV3-D64-d5"),
]


@interp
@pytest.mark.parametrize("B,HQ,HKV,S,D,d,ragged,left_pad", APPROX_CASES)
def test_approx_scores(triton_device, B, HQ, HKV, S, D, d, ragged, left_pad):
    x = _inputs(B, HQ, HKV, S, D, torch.float32, triton_device, ragged=ragged, left_pad=left_pad)
    heads, agg = approx_scores(x.q, x.k_cache, d, x.lengths, x.starts, return_both=True, gqa_select="query",
                               aggregate="sum")
    agg_max = approx_scores(x.q, x.k_cache, d, x.lengths, x.starts, gqa_select="kv", aggregate="max")
    for got, mode, aggr in ((heads, "query", "sum"), (agg, "kv", "sum"), (agg_max, "kv", "max")):
        ref = approx_scores_reference(x.q.double(), x.k_cache.double(), d, x.lengths, x.starts, gqa_select=mode,
                                      aggregate=aggr, compute_dtype=torch.float64)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{mode}/{aggr}: -inf mask differs"
        assert not torch.isnan(got).any()
        fin = torch.isfinite(ref)
        err = (got.double()[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
        scale = ref[fin].abs().max().item() if fin.any() else 1.0
        assert err <= 1e-5 * max(1.0, scale), f"{mode}/{aggr}: error {err:.3g}"


@interp
@pytest.mark.parametrize("dp", [24, 40], ids=["dp=d", "dp>d"])
def test_approx_scores_from_key_prefix(triton_device, dp):
    """A contiguous prefix buffer (dp >= d dims) gives the same scores as reading K in place."""
    x = _inputs(2, 6, 2, 300, 96, torch.float32, triton_device, ragged=True, left_pad=True)
    kp = x.k_cache[..., :dp].contiguous()
    assert torch.equal(make_key_prefix(x.k_cache, dp), kp)
    for mode in ("query", "kv"):
        ref = approx_scores(x.q, x.k_cache, 24, x.lengths, x.starts, gqa_select=mode, aggregate="sum")
        got = approx_scores(x.q, x.k_cache, 24, x.lengths, x.starts, gqa_select=mode, k_prefix=kp, aggregate="sum")
        assert torch.equal(torch.isneginf(got), torch.isneginf(ref)) and not torch.isnan(got).any()
        fin = torch.isfinite(ref)
        assert (got[fin] - ref[fin]).abs().max().item() <= 1e-5 * max(1.0, ref[fin].abs().max().item())


def test_approx_scores_key_prefix_errors():
    x = make_decode_inputs(1, 2, 2, 16, 64)
    with pytest.raises(ValueError, match="k_prefix"):
        approx_scores(x.q, x.k_cache, 16, k_prefix=x.k_cache[..., :8].contiguous(), gqa_select="query",
                      aggregate="sum")  # dp < d
    with pytest.raises(ValueError, match="k_prefix"):
        approx_scores(x.q, x.k_cache, 8, k_prefix=x.k_cache[:, :, :8, :8].contiguous(), gqa_select="query",
                      aggregate="sum")  # wrong S


@interp
def test_approx_scores_out_argument_poisoned(triton_device):
    x = _inputs(2, 4, 2, 130, 64, torch.float32, triton_device, ragged=True)
    out = torch.full((2, 4, 130), float("nan"), device=triton_device)
    res = approx_scores(x.q, x.k_cache, 16, x.lengths, x.starts, out=out, gqa_select="query", aggregate="sum")
    assert res.data_ptr() == out.data_ptr() and not torch.isnan(out).any()


# ----------------------------------------------------------------------------------------------------
# selection
SELECT_CASES = [
    pytest.param(1, 2, 1, "1", False, id="B1-H2-S1-k1"),
    pytest.param(3, 4, 97, "S", True, id="B3-H4-S97-kS-ragged"),
    pytest.param(2, 3, 1025, "1", True, id="B2-H3-S1025-k1-ragged"),
    pytest.param(2, 5, 1100, 0.25, True, id="B2-H5-S1100-k0.25-ragged-ties"),
    pytest.param(1, 8, 2048, 0.5, False, id="B1-H8-S2048-k0.5"),
]


def _select_case(B, H, S, kspec, ragged):
    """Scores (ties, -0.0 and invalid tokens where asked), counts and the bound K of one selection case."""
    g = torch.Generator().manual_seed(S)
    scores = torch.randn(B, H, S, generator=g)
    if kspec == 0.25:
        scores = torch.round(scores * 2) / 2  # many exact ties, negative values, zeros and -0.0
        scores[:, :, ::7] = -0.0
    lengths, starts = ragged_positions(B, S, g, "cpu", ragged, ragged)
    scores = scores.masked_fill(~valid_token_mask(lengths, starts, S)[:, None, :], float("-inf"))
    k = {"1": 1, "S": S}.get(kspec, kspec)
    counts = R.budget(k, lengths, starts, B, S)
    return scores, counts, int(R.budget(k, None, None, B, S).max())


@interp
@pytest.mark.parametrize("method", ["triton", "torch", "auto"])
@pytest.mark.parametrize("B,H,S,kspec,ragged", SELECT_CASES)
def test_select_topk_invariants(triton_device, method, B, H, S, kspec, ragged):
    scores, counts, K = _select_case(B, H, S, kspec, ragged)
    sc, cn = scores.to(triton_device), counts.to(triton_device)
    idx = select_topk(sc, cn, method=method, k_max=K)
    assert idx.shape == (B, H, K)
    assert check_selection(idx, scores, counts) == B * H


@interp
@pytest.mark.parametrize("radix_bits,chunk,early_exit", [(1, None, False), (2, None, False), (1, 64, False),
                                                         (2, 256, False), (1, None, True), (1, 64, True)],
                         ids=["1bit", "2bit", "1bit-chunk64", "2bit-chunk256", "early-exit", "early-exit-chunk64"])
@pytest.mark.parametrize("B,H,S,kspec,ragged", SELECT_CASES)
def test_select_topk_triton_radix_and_chunked_compaction(triton_device, radix_bits, chunk, early_exit, B, H, S,
                                                         kspec, ragged):
    """Both search widths, the early-exit search, and the chunked compaction of long rows (forced here with
    a small chunk)."""
    scores, counts, K = _select_case(B, H, S, kspec, ragged)
    idx = select_topk(scores.to(triton_device), counts.to(triton_device), method="triton", k_max=K,
                      radix_bits=radix_bits, chunk=chunk, early_exit=early_exit)
    assert idx.dtype == torch.int32 and idx.shape == (B, H, K)
    assert check_selection(idx, scores, counts) == B * H


# ----------------------------------------------------------------------------------------------------
# sparse attention over a selection
SPARSE_CASES = [
    # B, HQ, HKV, S, D, k, gqa_select, dtype, ragged
    pytest.param(1, 2, 2, 1, 64, 1, "query", torch.float32, False, id="B1-S1-HQ2-HKV2-D64-k1"),
    pytest.param(3, 6, 2, 97, 96, "S", "query", torch.float32, True, id="B3-S97-HQ6-HKV2-D96-kS-query"),
    pytest.param(3, 6, 2, 97, 96, "S", "kv", torch.float32, True, id="B3-S97-HQ6-HKV2-D96-kS-kv"),
    pytest.param(2, 8, 2, 1025, 128, 0.25, "kv", torch.float32, True, id="B2-S1025-HQ8-HKV2-D128-kv"),
    pytest.param(2, 8, 2, 1025, 128, 1, "query", torch.float32, False, id="B2-S1025-HQ8-HKV2-D128-k1"),
    pytest.param(1, 4, 1, 700, 64, 0.5, "kv", torch.float16, True, id="B1-S700-HQ4-HKV1-D64-kv-fp16"),
    pytest.param(2, 4, 4, 500, 128, 0.3, "query", torch.bfloat16, True, id="B2-S500-HQ4-HKV4-D128-bf16"),
    pytest.param(2, 6, 2, 300, 96, 0.3, "kv", torch.bfloat16, True, id="B2-S300-HQ6-HKV2-D96-kv-bf16"),
]


@interp
@pytest.mark.parametrize("B,HQ,HKV,S,D,k,mode,dtype,ragged", SPARSE_CASES)
def test_sparse_attention(triton_device, B, HQ, HKV, S, D, k, mode, dtype, ragged):
    _run_sparse_case(triton_device, B, HQ, HKV, S, D, k, mode, dtype, ragged)


def _run_sparse_case(device, B, HQ, HKV, S, D, k, mode, dtype, ragged, num_splits=None):
    x = _inputs(B, HQ, HKV, S, D, dtype, device, ragged=ragged, left_pad=ragged, seed=B + S)
    k = S if k == "S" else k
    s = approx_scores_reference(x.q, x.k_cache, 0.25, x.lengths, x.starts, gqa_select=mode, aggregate="sum")
    counts = R.budget(k, x.lengths, x.starts, B, S, device)
    idx = R.select_topk(s, counts)
    out = torch.full((B, HQ, D), float("nan"), dtype=dtype, device=device)
    res = sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, out=out, num_splits=num_splits)
    assert res.data_ptr() == out.data_ptr()
    ref64 = sparse_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), idx, counts,
                                       compute_dtype=torch.float64)
    lowp = sparse_attention_reference(x.q, x.k_cache, x.v_cache, idx, counts, compute_dtype=dtype)
    assert_close_to_reference(out, ref64, lowp, dtype, "sparse_attention")


@interp
def test_sparse_attention_int32_idx_and_splits(triton_device):
    """int32 indices (the Triton select's output) and a forced split count exercise the merge kernel."""
    x = _inputs(2, 4, 2, 600, 64, torch.float32, triton_device, ragged=True, seed=3)
    s = approx_scores_reference(x.q, x.k_cache, 16, x.lengths, x.starts, gqa_select="kv", aggregate="sum")
    counts = R.budget(0.5, x.lengths, x.starts, 2, 600, triton_device)
    idx = R.select_topk(s, counts)
    ref = sparse_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), idx, counts,
                                     compute_dtype=torch.float64)
    out = sparse_attention(x.q, x.k_cache, x.v_cache, idx.to(torch.int32), counts, num_splits=3, block_k=64)
    assert (out.double() - ref).abs().max().item() < 1e-5


@interp
@pytest.mark.parametrize("prefetch,slots", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["prefetch", "no-prefetch", "prefetch-slots", "slots"])
@pytest.mark.parametrize("mode,reuse", [("query", False), ("query", True), ("kv", False)],
                         ids=["query", "query-reuse-scores", "kv"])
def test_sparse_attention_many_tiles_per_split(triton_device, prefetch, slots, mode, reuse):
    """Small tiles and few splits: the (software-pipelined) loop runs over several tiles per split, with a
    ragged last tile; with ``prefix_scores`` the first d dims come from the approximate scores."""
    B, HQ, HKV, S, D, d = 2, 6, 2, 700, 96, 24
    x = _inputs(B, HQ, HKV, S, D, torch.float32, triton_device, ragged=True, left_pad=True, seed=5)
    s = approx_scores(x.q, x.k_cache, d, x.lengths, x.starts, gqa_select=mode, aggregate="sum")
    counts = R.budget(0.4, x.lengths, x.starts, B, S, triton_device)
    idx = select_topk(s, counts, method="triton", k_max=R.budget(0.4, None, None, B, S).max().item())
    extra = {"prefix_scores": s, "prefix_dims": d} if reuse else {}
    out = sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, block_k=16, num_splits=3, prefetch=prefetch,
                           slots=slots, **extra)
    ref = sparse_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), idx.long(), counts,
                                     compute_dtype=torch.float64)
    assert not torch.isnan(out).any()
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_sparse_attention_prefix_scores_errors():
    x = make_decode_inputs(1, 4, 2, 16, 64)
    idx = torch.zeros(1, 2, 4, dtype=torch.int32)
    counts = torch.tensor([4])
    with pytest.raises(ValueError, match="per-query-head"):
        sparse_attention(x.q, x.k_cache, x.v_cache, idx, counts, prefix_scores=torch.zeros(1, 4, 16),
                         prefix_dims=8)
    with pytest.raises(ValueError, match="prefix_scores"):
        sparse_attention(x.q, x.k_cache, x.v_cache, torch.zeros(1, 4, 4, dtype=torch.int32), counts,
                         prefix_scores=torch.zeros(1, 4, 15), prefix_dims=8)


# ----------------------------------------------------------------------------------------------------
# SparQ-style baseline
SPARQ_CASES = [
    pytest.param(1, 2, 2, 1, 64, 8, 1, False, id="B1-S1-HQ2-HKV2-D64-r8-k1"),
    pytest.param(3, 6, 2, 97, 96, 12, "S", True, id="B3-S97-HQ6-HKV2-D96-r12-kS"),
    pytest.param(2, 8, 2, 1025, 128, 16, 0.25, True, id="B2-S1025-HQ8-HKV2-D128-r16"),
]


@interp
@pytest.mark.parametrize("B,HQ,HKV,S,D,r,k,ragged", SPARQ_CASES)
def test_sparq_attention(triton_device, B, HQ, HKV, S, D, r, k, ragged):
    x = _inputs(B, HQ, HKV, S, D, torch.float32, triton_device, ragged=ragged, left_pad=ragged, seed=S)
    k = S if k == "S" else k
    out = sparq_attention(x.q, x.k_cache, x.v_cache, r=r, k=k, lengths=x.lengths, starts=x.starts)
    ref64 = sparq_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), r=r, k=k,
                                      lengths=x.lengths, starts=x.starts, compute_dtype=torch.float64)
    lowp = sparq_attention_reference(x.q, x.k_cache, x.v_cache, r=r, k=k, lengths=x.lengths, starts=x.starts)
    assert_close_to_reference(out, ref64, lowp, torch.float32, "sparq_attention")


@interp
def test_sparq_attention_chunked_with_left_padding(triton_device):
    """Small chunks: whole chunks of left padding must not poison the running softmax sum."""
    x = _inputs(2, 4, 2, 300, 64, torch.float32, triton_device, ragged=True, left_pad=True, seed=11)
    x.starts[0] = 200
    out = sparq_attention(x.q, x.k_cache, x.v_cache, r=8, k=0.3, lengths=x.lengths, starts=x.starts,
                          block_s=64, block_k=16)
    ref = sparq_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), r=8, k=0.3,
                                    lengths=x.lengths, starts=x.starts, compute_dtype=torch.float64)
    assert (out.double() - ref).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------------------------------
# end to end
DECODE_CASES = [
    pytest.param(1, 4, 4, 1, 64, 16, 1, "query", "torch", id="B1-S1-HQ4-HKV4-D64-torchsel"),
    pytest.param(3, 6, 2, 97, 96, 0.25, "S", "kv", "triton", id="B3-S97-HQ6-HKV2-D96-kS-kv-tritonsel"),
    pytest.param(2, 8, 2, 1025, 128, 0.25, 0.25, "query", "triton", id="B2-S1025-HQ8-HKV2-D128-tritonsel"),
    pytest.param(2, 8, 2, 1025, 128, 32, 100, "kv", "torch", id="B2-S1025-HQ8-HKV2-D128-kv-torchsel"),
]


@interp
@pytest.mark.parametrize("B,HQ,HKV,S,D,d,k,mode,select_method", DECODE_CASES)
def test_decode_attention_triton_vs_torch(triton_device, B, HQ, HKV, S, D, d, k, mode, select_method):
    _run_decode_case(triton_device, B, HQ, HKV, S, D, d, k, mode, select_method, torch.float32)


def _run_decode_case(device, B, HQ, HKV, S, D, d, k, mode, select_method, dtype, ragged=True):
    x = _inputs(B, HQ, HKV, S, D, dtype, device, ragged=ragged, left_pad=ragged, seed=7)
    k = S if k == "S" else k
    out, (idx, counts) = decode_attention(x.q, x.k_cache, x.v_cache, d=d, k=k, lengths=x.lengths,
                                          starts=x.starts, backend="triton", gqa_select=mode,
                                          select_method=select_method, return_indices=True, aggregate="sum")
    assert out.shape == (B, HQ, D) and out.dtype == dtype
    # the selection is a valid top-k of the fp64 approximate scores (slack: fp32 summation order)
    s64 = approx_scores_reference(x.q.double(), x.k_cache.double(), d, x.lengths, x.starts, gqa_select=mode,
                                  compute_dtype=torch.float64, aggregate="sum")
    slack = 1e-5 * s64[torch.isfinite(s64)].abs().max().item()
    if dtype != torch.float32:
        slack *= 10
    assert check_selection(idx, s64, counts, slack=slack) == B * idx.shape[1]
    # the attention over that selection is exact
    ref64 = sparse_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), idx.long(), counts,
                                       compute_dtype=torch.float64)
    lowp = sparse_attention_reference(x.q, x.k_cache, x.v_cache, idx.long(), counts, compute_dtype=dtype)
    assert_close_to_reference(out, ref64, lowp, dtype, "decode_attention")
    # and the whole step agrees with the torch backend (selections may differ only at near-ties)
    ref = decode_attention(x.q, x.k_cache, x.v_cache, d=d, k=k, lengths=x.lengths, starts=x.starts,
                           backend="torch", gqa_select=mode, aggregate="sum")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref.float()).abs().max().item() <= tol


@interp
@pytest.mark.parametrize("mode", ["query", "kv"])
def test_decode_attention_key_prefix_and_auto_select(triton_device, mode):
    """k_prefix (a cache-layout option) and the default select method give the same step as the plain path."""
    B, HQ, HKV, S, D = 2, 8, 2, 500, 64
    x = _inputs(B, HQ, HKV, S, D, torch.float32, triton_device, ragged=True, left_pad=True, seed=9)
    kw = dict(d=16, k=0.25, lengths=x.lengths, starts=x.starts, backend="triton", gqa_select=mode, aggregate="sum",
              return_indices=True)
    base, (idx0, counts) = decode_attention(x.q, x.k_cache, x.v_cache, select_method="triton", **kw)
    out, (idx1, _) = decode_attention(x.q, x.k_cache, x.v_cache, k_prefix=make_key_prefix(x.k_cache, 16), **kw)
    s64 = approx_scores_reference(x.q.double(), x.k_cache.double(), 16, x.lengths, x.starts, gqa_select=mode,
                                  compute_dtype=torch.float64, aggregate="sum")
    slack = 1e-5 * s64[torch.isfinite(s64)].abs().max().item()
    assert check_selection(idx1, s64, counts, slack=slack) == B * idx1.shape[1]
    ref = sparse_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), idx1.long(), counts,
                                     compute_dtype=torch.float64)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (out - base).abs().max().item() < 1e-4


@interp
def test_decode_attention_full_budget_is_dense(triton_device):
    """d = D and k = S: Loki equals dense attention."""
    x = _inputs(2, 6, 3, 200, 64, torch.float32, triton_device)
    out = decode_attention(x.q, x.k_cache, x.v_cache, d=64, k=200, backend="triton", gqa_select="kv", aggregate="sum")
    ref = R.dense_attention(x.q.double(), x.k_cache.double(), x.v_cache.double(), compute_dtype=torch.float64)
    assert (out.double() - ref).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------------------------------
# errors and hygiene (no kernel launches)
def test_decode_attention_errors_name_the_argument():
    x = make_decode_inputs(1, 2, 2, 16, 64)
    with pytest.raises(ValueError, match="d=65"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=65, k=4, backend="triton", gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="k=1.5"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=1.5, backend="triton", gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="k=0"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=0, backend="triton", gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="backend"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=4, backend="cuda", gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="gqa_select"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=4, gqa_select="group", aggregate="sum")
    with pytest.raises(ValueError, match="select_method"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=4, select_method="radix", gqa_select="query",
                         aggregate="sum")
    with pytest.raises(ValueError, match="k_prefix"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=4, backend="triton",
                         k_prefix=x.k_cache[..., :4].contiguous(), gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=4, lengths=torch.tensor([17]), backend="triton",
                         gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="k_cache batch"):
        decode_attention(x.q, x.k_cache[:0], x.v_cache[:0], d=8, k=4, backend="triton", gqa_select="query",
                         aggregate="sum")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    x = make_decode_inputs(1, 2, 2, 16, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=4, backend="triton", gqa_select="query", aggregate="sum")
    out = decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=4, gqa_select="query",
                           aggregate="sum")  # auto -> torch on CPU tensors
    assert out.shape == (1, 2, 64)


def test_import_needs_no_device():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    code = "import loki, loki.kernels, loki.bench.harness; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


# ----------------------------------------------------------------------------------------------------
# GPU: long caches, big batches, all dtypes and head dims
GPU_SPARSE = [
    pytest.param(16, 40, 40, 4096, 128, 0.25, "query", torch.bfloat16, False, id="B16-S4096-HQ40-HKV40-D128-bf16"),
    pytest.param(1, 32, 8, 32768, 128, 0.125, "kv", torch.bfloat16, True, id="B1-S32768-HQ32-HKV8-D128-kv-bf16"),
    pytest.param(4, 32, 8, 8192, 128, 0.25, "query", torch.float16, True, id="B4-S8192-HQ32-HKV8-D128-fp16"),
    pytest.param(3, 32, 4, 5000, 64, 0.25, "kv", torch.float32, True, id="B3-S5000-HQ32-HKV4-D64-kv-G8-fp32"),
    pytest.param(2, 12, 12, 4099, 96, 1, "query", torch.bfloat16, True, id="B2-S4099-HQ12-D96-k1-bf16"),
    pytest.param(2, 24, 3, 1025, 96, "S", "kv", torch.float16, True, id="B2-S1025-HQ24-HKV3-D96-kS-kv-fp16"),
]


@gpu
@pytest.mark.parametrize("B,HQ,HKV,S,D,k,mode,dtype,ragged", GPU_SPARSE)
def test_gpu_sparse_attention(B, HQ, HKV, S, D, k, mode, dtype, ragged):
    _run_sparse_case(torch.device("cuda"), B, HQ, HKV, S, D, k, mode, dtype, ragged)


GPU_APPROX = [
    pytest.param(16, 40, 40, 4096, 128, 32, id="B16-S4096-HQ40-HKV40-D128-d32"),
    pytest.param(2, 32, 4, 32768, 96, 24, id="B2-S32768-HQ32-HKV4-D96-d24"),
    pytest.param(3, 8, 2, 4099, 64, 7, id="B3-S4099-HQ8-HKV2-D64-d7"),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,HQ,HKV,S,D,d", GPU_APPROX)
def test_gpu_approx_scores_and_select(B, HQ, HKV, S, D, d, dtype):
    dev = torch.device("cuda")
    x = _inputs(B, HQ, HKV, S, D, dtype, dev, ragged=True, left_pad=True)
    heads, agg = approx_scores(x.q, x.k_cache, d, x.lengths, x.starts, return_both=True, gqa_select="query",
                               aggregate="sum")
    for got, mode in ((heads, "query"), (agg, "kv")):
        ref = approx_scores_reference(x.q, x.k_cache, d, x.lengths, x.starts, gqa_select=mode,
                                      compute_dtype=torch.float64, aggregate="sum")
        assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
        fin = torch.isfinite(ref)
        assert (got.double()[fin] - ref[fin]).abs().max().item() <= 1e-5 * max(1.0, ref[fin].abs().max().item())
    counts = R.budget(0.25, x.lengths, x.starts, B, S, dev)
    for s in (heads, agg):
        idx = select_topk(s, counts, method="triton", k_max=(S + 3) // 4)
        assert check_selection(idx, s, counts) == B * s.shape[1]


GPU_DECODE = [
    pytest.param(16, 40, 40, 4096, 128, "query", torch.bfloat16, id="B16-S4096-HQ40-D128-bf16"),
    pytest.param(16, 32, 8, 8192, 128, "kv", torch.bfloat16, id="B16-S8192-HQ32-HKV8-kv-bf16"),
    pytest.param(1, 32, 8, 32768, 128, "query", torch.float16, id="B1-S32768-HQ32-HKV8-fp16"),
    pytest.param(4, 32, 4, 2048, 96, "kv", torch.float32, id="B4-S2048-HQ32-HKV4-D96-kv-fp32"),
]


@gpu
@pytest.mark.parametrize("select_method", ["torch", "triton"])
@pytest.mark.parametrize("B,HQ,HKV,S,D,mode,dtype", GPU_DECODE)
def test_gpu_decode_attention_triton_vs_torch(B, HQ, HKV, S, D, mode, dtype, select_method):
    _run_decode_case(torch.device("cuda"), B, HQ, HKV, S, D, 0.25, 0.25, mode, select_method, dtype)


@gpu
@pytest.mark.parametrize("B,HQ,HKV,S,D,mode,dtype", GPU_DECODE[:3])
def test_gpu_decode_attention_key_prefix(B, HQ, HKV, S, D, mode, dtype):
    """The fast path (k_prefix, default select, score reuse) against the fp64 reference of its selection."""
    dev = torch.device("cuda")
    x = _inputs(B, HQ, HKV, S, D, dtype, dev, ragged=True, left_pad=True, seed=3)
    d = D // 4
    out, (idx, counts) = decode_attention(x.q, x.k_cache, x.v_cache, d=d, k=0.25, lengths=x.lengths,
                                          starts=x.starts, backend="triton", gqa_select=mode,
                                          k_prefix=make_key_prefix(x.k_cache, d), return_indices=True, aggregate="sum")
    assert idx.dtype == torch.int32  # "auto" picked the Triton select on CUDA
    s64 = approx_scores_reference(x.q.double(), x.k_cache.double(), d, x.lengths, x.starts, gqa_select=mode,
                                  compute_dtype=torch.float64, aggregate="sum")
    slack = 1e-4 * s64[torch.isfinite(s64)].abs().max().item()
    assert check_selection(idx, s64, counts, slack=slack) == B * idx.shape[1]
    ref64 = sparse_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), idx.long(), counts,
                                       compute_dtype=torch.float64)
    lowp = sparse_attention_reference(x.q, x.k_cache, x.v_cache, idx.long(), counts, compute_dtype=dtype)
    assert_close_to_reference(out, ref64, lowp, dtype, "decode_attention(k_prefix)")


@gpu
@pytest.mark.parametrize("radix_bits", [1, 2])
@pytest.mark.parametrize("B,H,S", [(16, 40, 4096), (2, 8, 16384), (3, 5, 32768)], ids=lambda v: str(v))
def test_gpu_select_radix_bits(B, H, S, radix_bits):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(S)
    scores = torch.randn(B, H, S, device=dev, generator=g)
    scores[:, :, ::5] = torch.round(scores[:, :, ::5])  # exact ties
    counts = torch.randint(1, S + 1, (B,), device=dev, generator=g)
    idx = select_topk(scores, counts, method="triton", k_max=S, radix_bits=radix_bits)
    assert check_selection(idx, scores, counts) == B * H


GPU_SPARQ = [
    pytest.param(1, 32, 32, 4096, 128, 32, 0.125, torch.float16, id="B1-S4096-HQ32-D128-fp16"),
    pytest.param(4, 32, 8, 8192, 128, 16, 0.25, torch.bfloat16, id="B4-S8192-HQ32-HKV8-bf16"),
    pytest.param(2, 8, 2, 4099, 64, 8, 0.25, torch.float32, id="B2-S4099-HQ8-HKV2-D64-fp32"),
]


@gpu
@pytest.mark.parametrize("B,HQ,HKV,S,D,r,k,dtype", GPU_SPARQ)
def test_gpu_sparq_attention(B, HQ, HKV, S, D, r, k, dtype):
    x = _inputs(B, HQ, HKV, S, D, dtype, torch.device("cuda"), ragged=True, left_pad=True)
    out = sparq_attention(x.q, x.k_cache, x.v_cache, r=r, k=k, lengths=x.lengths, starts=x.starts)
    ref64 = sparq_attention_reference(x.q.double(), x.k_cache.double(), x.v_cache.double(), r=r, k=k,
                                      lengths=x.lengths, starts=x.starts, compute_dtype=torch.float64)
    # the fp32 reference on the input-precision tensors: the same selection problem the kernels solve
    lowp = sparq_attention_reference(x.q, x.k_cache, x.v_cache, r=r, k=k, lengths=x.lengths, starts=x.starts)
    err = (out.double() - ref64).abs().max().item()
    base = (lowp.double() - ref64).abs().max().item()
    assert err <= 2 * base + ATOL[dtype], (err, base)


def _replay_inputs(x, g, dev, S, K):
    """New lengths, starts and counts of the planned shapes and dtypes (every input changes between calls)."""
    B = x.lengths.shape[0]
    lengths = torch.randint(S // 2, S + 1, (B,), generator=g, dtype=torch.int32).to(dev)
    starts = torch.stack([torch.randint(0, int(n) // 3 + 1, (1,), generator=g)[0] for n in lengths.cpu()])
    starts = starts.to(torch.int32).to(dev)
    counts = torch.minimum(lengths - starts, torch.randint(1, K + 1, (B,), generator=g,
                                                          dtype=torch.int32).to(dev)).to(torch.int32)
    return lengths, starts, counts


def _check_replays(dev, B, HQ, HKV, S, D, d, K, mode, prefix, with_out, dtype, calls=5):
    """Calls of one signature through a DecodeRun (recorded, then replayed), every input new each call, every
    output kept: each equals the reference for its own inputs and nothing overwrote an earlier one."""
    from loki.reference.methods import loki_attention
    from loki.testing.decode import kernel_run

    g = torch.Generator().manual_seed(11)
    x = _inputs(B, HQ, HKV, S, D, dtype, dev, ragged=True, left_pad=True, seed=11)
    kp = make_key_prefix(x.k_cache, d) if prefix else None
    run = kernel_run(x.q, x.k_cache, d=d, gqa_select=mode, aggregate="sum")
    kept = []
    for _call in range(calls):
        q = torch.randn(x.q.shape, generator=g).to(dev, dtype)
        lengths, starts, counts = _replay_inputs(x, g, dev, S, K)
        out = torch.empty_like(q) if with_out else None
        idx, res = run.step(q_hat=q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=kp, lengths=lengths,
                            starts=starts, counts=counts, width=K, out=out, return_indices=True)
        if with_out:
            assert res is out
            res = res.clone()  # the caller's buffer is the caller's to reuse
        kept.append((q, lengths, starts, counts, idx, res))
    plans = [p for p in run._plans.values() if p]
    assert len(plans) == 1, "the signature should be recorded at its first call and replayed after"
    ptrs = {r.data_ptr() for *_, r in kept}
    assert with_out or len(ptrs) == len(kept), "replays must return fresh outputs"
    for q, lengths, starts, counts, idx, res in kept:
        want = loki_attention(q.float(), x.k_cache.float(), x.v_cache.float(), d=d, counts=counts.long(),
                              lengths=lengths, starts=starts, gqa_select=mode, aggregate="sum")
        assert not torch.isnan(res).any()
        torch.testing.assert_close(res.float(), want, rtol=2e-2 if dtype != torch.float32 else 1e-4,
                                   atol=2e-2 if dtype != torch.float32 else 1e-4)
        rows = idx.shape[0] * idx.shape[1]
        assert rows and bool(((idx >= 0).sum(-1) == counts.long()[:, None]).all())
    return plans[0], x, kp


@interp
@pytest.mark.parametrize("mode,prefix,with_out", [("query", True, False), ("kv", False, True)])
def test_decode_step_replay_changes_every_input_and_keeps_every_output(triton_device, mode, prefix, with_out):
    """DecodeRun: later calls of a signature replay the compiled kernels with the new query, lengths, starts
    and counts and fresh buffers; every output equals the reference of its own inputs."""
    plan, x, kp = _check_replays(triton_device, 2, 8, 2, 300, 64, 16, 75, mode, prefix, with_out, torch.float32)
    q = x.q
    counts = torch.ones(2, dtype=torch.int32, device=triton_device)
    inputs = (q, x.k_cache, x.v_cache, kp, x.lengths, x.starts, counts, torch.empty_like(q) if with_out else None,
              None)
    assert [len(a) for a in plan.bind(inputs, plan.new_buffers(), True)] == [len(t[2]) for t in plan.launches]
    # raw addresses (the direct launch) equal the tensor views' addresses
    bufs = plan.new_buffers()
    for views, ptrs in zip(plan.bind(inputs, bufs, True), plan.bind(inputs, bufs, False)):
        for v, p in zip(views, ptrs):
            if isinstance(v, torch.Tensor):
                assert v.data_ptr() == p


@interp
def test_decode_run_records_each_signature_once_and_keeps_the_newest(triton_device):
    """A signature is recorded at its first call and replayed after; a cache that grows every step (new shapes
    each call) records each length once and keeps only the ``max_plans`` newest signatures."""
    from loki.testing.decode import kernel_run

    B, HQ, HKV, D, d = 1, 4, 2, 64, 16
    x = _inputs(B, HQ, HKV, 100, D, torch.float32, triton_device, seed=1)
    run = kernel_run(x.q, x.k_cache, d=d, gqa_select="query", aggregate="sum")
    run.max_plans = 3
    for S in (100, 101, 102, 103):  # growing cache: each signature once
        x = _inputs(B, HQ, HKV, S, D, torch.float32, triton_device, seed=S)
        counts = torch.full((B,), S // 4, dtype=torch.int32, device=triton_device)
        run.step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=None, lengths=x.lengths, starts=x.starts,
                 counts=counts, width=S // 4)
    assert run.replays == 3 and [k[4][0][2] for k in run._plans] == [101, 102, 103]  # the oldest (100) went
    S = 110
    x = _inputs(B, HQ, HKV, S, D, torch.float32, triton_device, seed=S)
    counts = torch.full((B,), S // 4, dtype=torch.int32, device=triton_device)
    outs = [run.step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=None, lengths=x.lengths,
                     starts=x.starts, counts=counts, width=S // 4) for _ in range(3)]
    assert run.replays == 3 and [k[4][0][2] for k in run._plans][-1] == 110
    assert all(torch.equal(o, outs[0]) for o in outs) and len({o.data_ptr() for o in outs}) == 3


@gpu
@pytest.mark.parametrize("mode,HQ,HKV", [("query", 40, 40), ("kv", 32, 8)])
@pytest.mark.parametrize("poison", ["1", "0"])
def test_gpu_decode_step_replay(mode, HQ, HKV, poison, monkeypatch):
    """The direct-launch replay on the GPU: every input new each call, every output kept and right."""
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", poison)
    B, S, D, d = 3, 4099, 128, 32
    _check_replays(torch.device("cuda"), B, HQ, HKV, S, D, d, S // 4, mode, True, False, torch.bfloat16)
