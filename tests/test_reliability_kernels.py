"""The Triton kernels against the references on tied scores (one tie rule everywhere: the lowest token position
first)."""

from __future__ import annotations

import pytest
import torch

import loki.reference as R
from loki._checks import valid_token_mask
from loki.kernels import decode_attention, score_select, select_topk

interp = pytest.mark.interpreter


def _same_sets(idx, ref, counts):
    B, H, _ = ref.shape
    for b in range(B):
        c = int(counts[b])
        for h in range(H):
            got = sorted(int(i) for i in idx[b, h, :c])
            want = sorted(int(i) for i in ref[b, h, :c])
            assert got == want, f"row ({b},{h}): {got} != {want}"
            assert (idx[b, h, c:] == -1).all()


def _tied_scores(kind: str, B=2, H=3, S=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        s = torch.zeros(B, H, S)
        s[:, :, ::3] = -0.0  # -0.0 and +0.0 are the same score
    elif kind == "bf16":
        s = (torch.randn(B, H, S, generator=g) * 0.05).bfloat16().float()
    elif kind == "duplicated":
        s = torch.randn(B, H, S // 10, generator=g).repeat_interleave(10, dim=-1)
    else:  # "halves": few values, negative, zero and -0.0
        s = torch.round(torch.randn(B, H, S, generator=g) * 2) / 2
    lengths = torch.tensor([S, S - 37][:B], dtype=torch.int32)
    starts = torch.tensor([0, 11][:B], dtype=torch.int32)
    return s.masked_fill(~valid_token_mask(lengths, starts, S)[:, None], float("-inf")), lengths, starts


# ------------------------------------------------------------------------------------------------ ties
@interp
@pytest.mark.parametrize("kind", ["zeros", "bf16", "duplicated", "halves"])
@pytest.mark.parametrize("radix_bits,chunk,early_exit", [(1, None, True), (2, None, False), (1, 128, False)],
                         ids=["early-exit", "2bit", "1bit-chunk128"])
def test_triton_select_takes_the_same_tied_tokens_as_the_reference(triton_device, kind, radix_bits, chunk,
                                                                   early_exit):
    scores, lengths, starts = _tied_scores(kind)
    for k in (7, 0.5, 1.0):
        counts = R.budget(k, lengths, starts, 2, scores.shape[-1])
        ref = R.select_topk(scores, counts)
        idx = select_topk(scores.to(triton_device), counts.to(triton_device), method="triton", radix_bits=radix_bits,
                          chunk=chunk, early_exit=early_exit)
        _same_sets(idx.cpu(), ref, counts)
        torch_idx = select_topk(scores, counts, method="torch")
        assert torch.equal(torch_idx, ref)


@interp
def test_triton_select_negative_zero_and_nan():
    s = torch.full((1, 1, 40), -0.0)
    s[0, 0, 30] = 0.0
    s[0, 0, 20] = float("nan")
    s[0, 0, 25] = -float("nan")
    counts = torch.tensor([5])
    idx = select_topk(s, counts, method="triton")
    assert sorted(idx[0, 0].tolist()) == [0, 1, 2, 20, 25]
    _same_sets(idx, R.select_topk(s, counts), counts)


def _integer_inputs(B, HQ, HKV, S, D, *, zero_keys=False, dup=4, seed=0):
    """Small integers: every score is exact in fp32 (the kernels and the reference agree bit for bit), and
    keys repeat in runs of ``dup`` tokens, so scores tie."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (B, HQ, D), generator=g).float()
    k = torch.randint(-2, 3, (B, HKV, -(-S // dup), D), generator=g).float().repeat_interleave(dup, dim=2)[:, :, :S]
    if zero_keys:
        k = torch.zeros_like(k)
    v = torch.randn(B, HKV, S, D, generator=g)
    return q, k.contiguous(), v


@interp
@pytest.mark.parametrize("zero_keys", [True, False], ids=["zero-keys", "duplicated-keys"])
@pytest.mark.parametrize("mode,aggregate", [("query", "sum"), ("kv", "sum"), ("kv", "max")])
def test_fused_score_select_takes_the_same_tied_tokens_as_the_reference(triton_device, zero_keys, mode, aggregate):
    q, k, _ = _integer_inputs(2, 4, 2, 96, 16, zero_keys=zero_keys)
    lengths = torch.tensor([96, 50], dtype=torch.int32)
    starts = torch.tensor([0, 9], dtype=torch.int32)
    counts = R.budget(0.25, lengths, starts, 2, 96)
    d = 8
    ref_scores = R.approx_scores(q, k, d, lengths, starts, gqa_select=mode, aggregate=aggregate)
    ref = R.select_topk(ref_scores, counts)
    dev = triton_device
    scores, idx = score_select(q.to(dev), k.to(dev), d, lengths.to(dev), starts.to(dev), counts.to(dev),
                               int(counts.max()), gqa_select=mode, aggregate=aggregate)
    torch.testing.assert_close(scores.cpu(), ref_scores, atol=0, rtol=0)
    _same_sets(idx.cpu(), ref, counts)


@interp
@pytest.mark.parametrize("mode", ["query", "kv"])
@pytest.mark.parametrize("select_method", ["triton", "torch"])
def test_decode_attention_on_all_zero_keys_equals_the_torch_backend(triton_device, mode, select_method):
    """The issue's case: all-zero keys (every score ties) gave outputs 1.56 apart between the backends."""
    q, k, v = _integer_inputs(2, 4, 2, 64, 16, zero_keys=True)
    lengths = torch.tensor([64, 40], dtype=torch.int32)
    starts = torch.tensor([0, 3], dtype=torch.int32)
    ref, (ridx, counts) = decode_attention(q, k, v, d=8, k=8, lengths=lengths, starts=starts, backend="torch",
                                           gqa_select=mode, return_indices=True)
    dev = triton_device
    out, (idx, _) = decode_attention(q.to(dev), k.to(dev), v.to(dev), d=8, k=8, lengths=lengths.to(dev),
                                     starts=starts.to(dev), backend="triton", gqa_select=mode,
                                     select_method=select_method, return_indices=True)
    _same_sets(idx.cpu(), ridx, counts)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


@interp
def test_decode_attention_on_duplicated_keys_equals_the_torch_backend(triton_device):
    q, k, v = _integer_inputs(1, 4, 4, 200, 16, dup=8, seed=3)
    ref = decode_attention(q, k, v, d=4, k=0.1, backend="torch")
    dev = triton_device
    out = decode_attention(q.to(dev), k.to(dev), v.to(dev), d=4, k=0.1, backend="triton", select_method="triton")
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
