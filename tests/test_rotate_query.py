"""The decode step's query rotation kernel (``loki.kernels.rotate``) against the reference ``rotate_query``."""

from __future__ import annotations

import pytest
import torch

from loki.kernels.rotate import rotate_query_fast, rotate_query_op, rotate_query_reference, rotate_query_triton
from loki.testing.inputs import random_orthogonal


def _inputs(B, HQ, HKV, D, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, D, generator=g).to(dev, dtype)
    P = random_orthogonal(HKV, D, seed=seed + 1).to(dev)
    # a non-orthogonal basis too: the kernel is a plain product, nothing may assume P^T P = I
    P = P + 0.1 * torch.randn(HKV, D, D, generator=g).to(dev)
    return q, P.contiguous()


@pytest.mark.interpreter
@pytest.mark.parametrize("B,HQ,HKV,D", [(1, 4, 4, 16), (2, 6, 2, 64), (3, 32, 8, 128), (1, 12, 4, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_query_kernel_equals_reference(B, HQ, HKV, D, dtype, triton_device):
    q, P = _inputs(B, HQ, HKV, D, dtype, triton_device)
    got = rotate_query_triton(q, P)
    want = rotate_query_reference(q, P)
    assert got.dtype == dtype and got.shape == (B, HQ, D) and got.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    # each query head uses its own KV head's basis: swapping two KV heads' bases changes exactly their groups
    G = HQ // HKV
    if HKV > 1:
        P2 = P.clone()
        P2[[0, 1]] = P[[1, 0]]
        got2 = rotate_query_triton(q, P2)
        torch.testing.assert_close(got2[:, 2 * G:], got[:, 2 * G:], rtol=0, atol=0)
        assert not torch.allclose(got2[:, :G].float(), got[:, :G].float())


@pytest.mark.interpreter
def test_rotate_query_strided_input(triton_device):
    """A query that is a slice of a larger tensor (the decode step passes query[:, :, 0])."""
    q4 = torch.randn(2, 8, 3, 32).to(triton_device)
    P = random_orthogonal(2, 32, seed=3).to(triton_device)
    torch.testing.assert_close(rotate_query_triton(q4[:, :, 1], P), rotate_query_reference(q4[:, :, 1], P),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_rotate_query_fast_falls_back_where_the_kernel_does_not_fit():
    q = torch.randn(1, 4, 80)
    P = random_orthogonal(2, 80, seed=0)
    torch.testing.assert_close(rotate_query_fast(q, P), rotate_query_reference(q, P))
    with pytest.raises(ValueError, match="power-of-two D"):
        rotate_query_triton(q, P)


def test_rotate_query_op_on_the_cpu_is_the_reference():
    q, P = _inputs(2, 8, 4, 32, torch.float32, "cpu")
    assert torch.equal(torch.ops.loki.rotate_query(q, P), rotate_query_reference(q, P).contiguous())
    assert torch.equal(rotate_query_op(q, P), rotate_query_reference(q, P).contiguous())


def test_rotate_query_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="HQ a multiple of HKV"):
        rotate_query_fast(torch.randn(1, 5, 16), torch.eye(16).expand(2, 16, 16).contiguous())
    with pytest.raises(ValueError, match="expected q"):
        rotate_query_fast(torch.randn(1, 4, 16), torch.eye(8).expand(2, 8, 8).contiguous())
