"""Bad input raises a clear error that names the argument at fault."""

from __future__ import annotations

import pytest
import torch

from loki.reference import (
    approx_scores,
    dense_attention,
    h2o_attention,
    loki_attention,
    rotate_query,
    select_topk,
    sparq_attention,
)
from loki.testing.inputs import make_decode_inputs


@pytest.fixture
def x():
    return make_decode_inputs(2, 4, 2, 16, 64)


def _loki(x, **kw):
    args = dict(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, d=8, k=4, gqa_select="query", aggregate="sum")
    args.update(kw)
    return loki_attention(args.pop("q_hat"), args.pop("k_hat"), args.pop("v_cache"), **args)


@pytest.mark.parametrize(
    "kw,match",
    [
        pytest.param(dict(k=0), r"k=0 is out of range", id="k-zero"),
        pytest.param(dict(k=-3), r"k=-3 is out of range", id="k-negative"),
        pytest.param(dict(k=1.5), r"k=1.5 as a fraction", id="k-fraction-above-one"),
        pytest.param(dict(k=0.0), r"k=0.0 as a fraction", id="k-fraction-zero"),
        pytest.param(dict(k="all"), r"k must be an int count or a float fraction", id="k-string"),
        pytest.param(dict(d=0), r"d=0 is out of range.*D=64", id="d-zero"),
        pytest.param(dict(d=65), r"d=65 is out of range.*D=64", id="d-too-big"),
        pytest.param(dict(d=2.0), r"d=2.0 as a fraction of D", id="d-fraction"),
        pytest.param(dict(gqa_select="group"), r"gqa_select must be one of", id="gqa-mode"),
        pytest.param(dict(aggregate="mean"), r"aggregate must be one of", id="aggregate"),
    ],
)
def test_budget_arguments(x, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _loki(x, **kw)


def test_int_budget_above_the_cache_is_not_an_error(x):
    """One budget rule: an int k above the valid tokens keeps them all (k = S and k = 4 S agree)."""
    torch.testing.assert_close(_loki(x, k=17), _loki(x, k=16))
    torch.testing.assert_close(_loki(x, k=64), _loki(x, k=1.0))


def test_wrong_ranks(x):
    with pytest.raises(ValueError, match=r"q must have rank 3 \[B, HQ, D\], got shape \[2, 4, 1, 64\]"):
        _loki(x, q_hat=x.q[:, :, None])
    with pytest.raises(ValueError, match=r"k_cache must have rank 4"):
        dense_attention(x.q, x.k_cache[0], x.v_cache)
    with pytest.raises(ValueError, match=r"v_cache shape \[2, 2, 15, 64\] must equal k_cache shape"):
        dense_attention(x.q, x.k_cache, x.v_cache[:, :, :15])


def test_shape_mismatches(x):
    with pytest.raises(ValueError, match=r"query heads HQ=3 \(q\) must be a multiple of key/value heads HKV=2"):
        dense_attention(x.q[:, :3], x.k_cache, x.v_cache)
    with pytest.raises(ValueError, match=r"k_cache batch size 2 does not match q batch size 1"):
        dense_attention(x.q[:1], x.k_cache, x.v_cache)
    with pytest.raises(ValueError, match=r"k_cache head dim 32 does not match q head dim 64"):
        dense_attention(x.q, x.k_cache[..., :32], x.v_cache[..., :32])


def test_dtype_and_device_mismatch(x):
    with pytest.raises(TypeError, match=r"dtype mismatch: q torch.float16"):
        dense_attention(x.q.half(), x.k_cache, x.v_cache)
    with pytest.raises(TypeError, match=r"q must be a floating tensor"):
        dense_attention(x.q.long(), x.k_cache, x.v_cache)
    with pytest.raises(ValueError, match=r"device mismatch: q on cpu, k_cache on meta"):
        dense_attention(x.q, x.k_cache.to("meta"), x.v_cache.to("meta"))
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor"):
        dense_attention(x.q.tolist(), x.k_cache, x.v_cache)


def test_lengths_and_starts(x):
    with pytest.raises(ValueError, match=r"lengths must have shape \[B\]=\[2\]"):
        dense_attention(x.q, x.k_cache, x.v_cache, torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"lengths values must lie in \[1, 16\]"):
        dense_attention(x.q, x.k_cache, x.v_cache, torch.tensor([3, 17], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"lengths must be an integer tensor"):
        dense_attention(x.q, x.k_cache, x.v_cache, torch.tensor([3.0, 4.0]))
    with pytest.raises(ValueError, match=r"starts\[1\]=5 >= lengths\[1\]=5"):
        dense_attention(x.q, x.k_cache, x.v_cache, torch.tensor([3, 5]), torch.tensor([0, 5]))


def test_rotation_basis_shape(x):
    with pytest.raises(ValueError, match=r"P must have shape \[HKV, D, D\]=\[2, 64, 64\]"):
        rotate_query(x.q, torch.zeros(2, 64, 32))
    with pytest.raises(ValueError, match=r"HQ=4 must be a multiple of the basis' KV heads HKV=3"):
        rotate_query(x.q, torch.eye(64)[None].expand(3, 64, 64))


def test_other_methods(x):
    with pytest.raises(ValueError, match=r"r=0 is out of range"):
        sparq_attention(x.q, x.k_cache, x.v_cache, r=0, k=2)
    with pytest.raises(ValueError, match=r"acc_scores must have shape"):
        h2o_attention(x.q, x.k_cache, x.v_cache, torch.zeros(2, 4, 15), k=4)
    with pytest.raises(ValueError, match=r"recent_fraction=1.5"):
        h2o_attention(x.q, x.k_cache, x.v_cache, torch.zeros(2, 4, 16), k=4, recent_fraction=1.5)
    with pytest.raises(ValueError, match=r"counts must lie in \[1, S=16\]"):
        select_topk(torch.zeros(2, 4, 16), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"scores must have shape \[B, H, S\]"):
        select_topk(torch.zeros(2, 16), torch.tensor([1, 3]))
    with pytest.raises(ValueError, match=r"mask must have shape"):
        dense_attention(x.q, x.k_cache, x.v_cache, mask=torch.ones(2, 3, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"d=100 is out of range"):
        approx_scores(x.q, x.k_cache, 100, gqa_select="query", aggregate="sum")
