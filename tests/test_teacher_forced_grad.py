"""Decode-semantics attention (:func:`loki.reference.teacher_forced.teacher_forced_rows`) is differentiable: a
backward pass gives finite gradients for every method and GQA aggregate, recording the graph does not change the
forward result, and dense attention's gradients equal those of torch's own SDPA."""

from __future__ import annotations

import pytest
import torch

from loki.reference.selection import GQA_AGGREGATES
from loki.reference.teacher_forced import ROW_METHODS, teacher_forced_rows

CASES = [pytest.param(m, "query", "sum", id=f"{m}-query") for m in ROW_METHODS] + [
    pytest.param(m, "kv", a, id=f"{m}-kv-{a}") for m in ("loki", "exact_topk") for a in GQA_AGGREGATES
]


def _inputs(B=2, HQ=4, HKV=2, L=23, S=29, D=16, seed=0, empty_rows=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, L, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    lengths = (S - L + 1 + torch.arange(L))[None].repeat(B, 1)  # causal rows at the end of the cache
    starts = torch.zeros(B, L, dtype=torch.long)
    starts[1] = 9  # sequence 1 left-padded
    if empty_rows:
        lengths[0, :3] = 0  # rows that see no token (their softmax is all NaN before it is zeroed)
    return q, k, v, starts, lengths


@pytest.mark.parametrize("method,gqa,aggregate", CASES)
def test_backward_gives_finite_gradients_and_the_same_forward(method, gqa, aggregate):
    q, k, v, starts, lengths = _inputs()
    kw = dict(method=method, k_budget=0.3, d=0.5, gqa_select=gqa, aggregate=aggregate)
    with torch.no_grad():
        want = teacher_forced_rows(q, k, v, starts, lengths, **kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = teacher_forced_rows(*leaves, starts, lengths, **kw)
    assert torch.equal(out.detach(), want)  # recording the graph changes nothing in the forward
    out.square().sum().backward()
    for name, t in zip("qkv", leaves):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        assert t.grad.abs().sum() > 0, name
    assert torch.equal(leaves[0].grad[0, :, :3], torch.zeros_like(leaves[0].grad[0, :, :3]))  # rows seeing nothing


def test_dense_gradients_equal_torch_sdpa():
    q, k, v, starts, lengths = _inputs(empty_rows=False)
    B, HQ, L, D = q.shape
    S, G = k.shape[2], HQ // k.shape[1]
    pos = torch.arange(S)
    mask = ((pos >= starts[..., None]) & (pos < lengths[..., None]))[:, None]  # [B, 1, L, S]
    grads = []
    for fn in ("rows", "sdpa"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if fn == "rows":
            out = teacher_forced_rows(*leaves, starts, lengths, method="dense", gqa_select="query", aggregate="sum")
        else:
            kk, vv = (t.repeat_interleave(G, dim=1) for t in leaves[1:])
            out = torch.nn.functional.scaled_dot_product_attention(leaves[0], kk, vv, attn_mask=mask)
        out.square().sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
