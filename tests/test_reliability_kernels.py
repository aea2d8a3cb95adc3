"""The Triton kernels against the references on tied scores (one tie rule everywhere: the lowest token position
first), and on the inputs a careless caller gives them: an empty batch, garbage outside the valid tokens, bad
scales and split counts, inputs that require grad."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import loki.reference as R
from loki._checks import valid_token_mask
from loki.kernels import decode_attention, score_select, select_topk, sparq_attention, sparse_attention
from loki.kernels.approx_scores import approx_scores
from loki.testing.inputs import make_decode_inputs

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
                                           gqa_select=mode, return_indices=True, aggregate="sum")
    dev = triton_device
    out, (idx, _) = decode_attention(q.to(dev), k.to(dev), v.to(dev), d=8, k=8, lengths=lengths.to(dev),
                                     starts=starts.to(dev), backend="triton", gqa_select=mode,
                                     select_method=select_method, return_indices=True, aggregate="sum")
    _same_sets(idx.cpu(), ridx, counts)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


@interp
def test_decode_attention_on_duplicated_keys_equals_the_torch_backend(triton_device):
    q, k, v = _integer_inputs(1, 4, 4, 200, 16, dup=8, seed=3)
    ref = decode_attention(q, k, v, d=4, k=0.1, backend="torch", gqa_select="query", aggregate="sum")
    dev = triton_device
    out = decode_attention(q.to(dev), k.to(dev), v.to(dev), d=4, k=0.1, backend="triton", select_method="triton",
                           gqa_select="query", aggregate="sum")
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ empty batch
@interp
@pytest.mark.parametrize("select_method", ["triton", "torch"])
def test_empty_batch_behaves_the_same_on_both_backends(triton_device, select_method):
    x = make_decode_inputs(0, 4, 2, 16, 16)
    outs = {}
    for backend in ("torch", "triton"):
        dev = triton_device if backend == "triton" else "cpu"
        outs[backend] = decode_attention(x.q.to(dev), x.k_cache.to(dev), x.v_cache.to(dev), d=4, k=4,
                                         backend=backend, select_method=select_method, gqa_select="query",
                                         aggregate="sum")
    assert outs["torch"].shape == outs["triton"].shape == (0, 4, 16)
    assert outs["torch"].dtype == outs["triton"].dtype
    q, k, v = (t.to(triton_device) for t in (x.q, x.k_cache, x.v_cache))
    assert sparq_attention(q, k, v, r=4, k=4).shape == (0, 4, 16)
    assert select_topk(torch.zeros(0, 2, 8), torch.zeros(0, dtype=torch.long)).shape == (0, 2, 0)


# ------------------------------------------------------------------------------------------------ garbage rows
@interp
@pytest.mark.parametrize("garbage", [float("nan"), float("inf")])
def test_garbage_outside_the_valid_tokens_never_reaches_the_kernels_output(triton_device, garbage):
    x = make_decode_inputs(2, 4, 2, 40, 16)
    lengths = torch.tensor([30, 40], dtype=torch.int32)
    starts = torch.tensor([4, 0], dtype=torch.int32)
    kc, vc = x.k_cache.clone(), x.v_cache.clone()
    for t in (kc, vc):
        t[0, :, :4] = garbage
        t[0, :, 30:] = garbage
    dev = triton_device
    args = [t.to(dev) for t in (x.q, kc, vc)]
    pos = dict(lengths=lengths.to(dev), starts=starts.to(dev))
    for select_method in ("triton", "torch"):
        out = decode_attention(*args, d=8, k=0.5, backend="triton", select_method=select_method, gqa_select="query",
                               **pos)
        ref = R.loki_attention(x.q, x.k_cache, x.v_cache, d=8, k=0.5, lengths=lengths, starts=starts,
                               gqa_select="query", aggregate="sum")
        torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    out = sparq_attention(*args, r=8, k=0.5, **pos)
    ref = R.sparq_attention(x.q, x.k_cache, x.v_cache, r=8, k=0.5, lengths=lengths, starts=starts)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ bad options
@interp
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -0.5])
def test_bad_scale_is_refused_by_the_kernels(triton_device, scale):
    x = make_decode_inputs(1, 2, 2, 16, 16, device=triton_device)
    with pytest.raises(ValueError, match="scale=.* must be a finite number > 0"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=4, k=4, backend="triton", scale=scale, gqa_select="query",
                         aggregate="sum")
    with pytest.raises(ValueError, match="scale=.* must be a finite number > 0"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=4, k=4, backend="torch", scale=scale, gqa_select="query",
                         aggregate="sum")
    with pytest.raises(ValueError, match="scale=.* must be a finite number > 0"):
        sparq_attention(x.q, x.k_cache, x.v_cache, r=4, k=4, scale=scale)
    idx = torch.zeros(1, 2, 1, dtype=torch.int32, device=triton_device)
    with pytest.raises(ValueError, match="scale=.* must be a finite number > 0"):
        sparse_attention(x.q, x.k_cache, x.v_cache, idx, torch.ones(1, dtype=torch.int32, device=triton_device),
                         scale=scale)


@interp
@given(num_splits=st.one_of(st.integers(max_value=0), st.floats(0.5, 4.5), st.just("2")))
def test_bad_num_splits_is_refused_naming_it(num_splits):
    x = make_decode_inputs(1, 2, 2, 16, 16)
    idx = torch.zeros(1, 2, 1, dtype=torch.int32)
    with pytest.raises((ValueError, TypeError), match="num_splits"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=4, k=4, backend="triton", num_splits=num_splits,
                         gqa_select="query", aggregate="sum")
    with pytest.raises((ValueError, TypeError), match="num_splits"):
        sparse_attention(x.q, x.k_cache, x.v_cache, idx, torch.ones(1, dtype=torch.int32), num_splits=num_splits)


@interp
def test_bad_tile_sizes_and_empty_selection_are_named():
    x = make_decode_inputs(1, 2, 2, 16, 16)
    idx = torch.zeros(1, 2, 1, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_k"):
        sparse_attention(x.q, x.k_cache, x.v_cache, idx, one, block_k=24)
    with pytest.raises(ValueError, match="block_k"):
        sparse_attention(x.q, x.k_cache, x.v_cache, idx, one, block_k=0)
    with pytest.raises(ValueError, match="block_s"):
        sparq_attention(x.q, x.k_cache, x.v_cache, r=4, k=4, block_s=100)
    with pytest.raises(ValueError, match=r"K >= 1"):
        sparse_attention(x.q, x.k_cache, x.v_cache, idx[..., :0], one)


@interp
def test_split_counts_give_the_same_result(triton_device):
    x = make_decode_inputs(2, 4, 2, 64, 16, device=triton_device)
    base = decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=32, backend="triton", num_splits=1, gqa_select="query",
                            aggregate="sum")
    for n in (2, 3, 64):
        out = decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=32, backend="triton", num_splits=n,
                               gqa_select="query", aggregate="sum")
        torch.testing.assert_close(out, base, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ autograd
@interp
def test_triton_kernels_refuse_inputs_that_require_grad(triton_device):
    x = make_decode_inputs(1, 2, 2, 16, 16, device=triton_device)
    q = x.q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"q_hat requires grad.*no backward.*backend='torch'"):
        decode_attention(q, x.k_cache, x.v_cache, d=4, k=4, backend="triton", gqa_select="query", aggregate="sum")
    v = x.v_cache.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"v_cache requires grad"):
        decode_attention(x.q, x.k_cache, v, d=4, k=4, backend="triton", gqa_select="query", aggregate="sum")
    with pytest.raises(RuntimeError, match=r"q requires grad"):
        sparq_attention(q, x.k_cache, x.v_cache, r=4, k=4)
    with pytest.raises(RuntimeError, match=r"q_hat requires grad"):
        approx_scores(q, x.k_cache, 4, gqa_select="query", aggregate="sum")
    with pytest.raises(RuntimeError, match=r"q_hat requires grad"):
        sparse_attention(q, x.k_cache, x.v_cache, torch.zeros(1, 2, 1, dtype=torch.int32, device=triton_device),
                         torch.ones(1, dtype=torch.int32, device=triton_device))
    with torch.no_grad():  # no gradient wanted: fine
        out = decode_attention(q, x.k_cache, x.v_cache, d=4, k=4, backend="triton", gqa_select="query", aggregate="sum")
    ref = decode_attention(q, x.k_cache, x.v_cache, d=4, k=4, backend="torch", gqa_select="query", aggregate="sum")
    assert ref.requires_grad
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_auto_backend_takes_the_differentiable_path_for_grad():
    x = make_decode_inputs(1, 4, 2, 256, 64, device="cuda")
    q = x.q.clone().requires_grad_()
    out = decode_attention(q, x.k_cache, x.v_cache, d=16, k=32, gqa_select="query", aggregate="sum")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        fast = decode_attention(q, x.k_cache, x.v_cache, d=16, k=32, gqa_select="query", aggregate="sum")
    torch.testing.assert_close(fast, out.detach(), atol=1e-4, rtol=1e-4)


def test_check_values_false_states_its_preconditions():
    doc = " ".join(decode_attention.__doc__.split())
    assert "check_values=False" in doc and "0 <= starts[b] < lengths[b] <= S" in doc
    assert "reads outside the cache" in doc
    from loki._checks import check_decode_inputs

    assert "0 <= starts[b] < lengths[b]" in " ".join(check_decode_inputs.__doc__.split())


@interp
@pytest.mark.parametrize("method", ["triton", "torch"])
def test_select_counts_above_k_max_are_clamped_not_written_past_the_row(triton_device, method):
    """k_max below a count (a broken promise of the caller) must not write outside the output."""
    dev = triton_device if method == "triton" else "cpu"
    B, H, S, K = 2, 3, 64, 4
    scores = torch.randn(B, H, S, generator=torch.Generator().manual_seed(0)).to(dev)
    counts = torch.tensor([10, 2]).to(dev)
    dtype = torch.int32 if method == "triton" else torch.long
    buf = torch.full((B * H * K + 64,), 7777, dtype=dtype, device=dev)
    out = buf[: B * H * K].view(B, H, K)
    select_topk(scores, counts, k_max=K, method=method, out=out)
    assert (buf[B * H * K:] == 7777).all()
    ref = R.select_topk(scores.cpu(), torch.tensor([4, 2]))
    _same_sets(out.cpu(), ref, torch.tensor([4, 2]))


@interp
def test_fused_score_select_clamps_counts_above_k(triton_device):
    q, k, _ = _integer_inputs(1, 2, 2, 32, 16)
    dev = triton_device
    lengths = torch.tensor([32], dtype=torch.int32, device=dev)
    starts = torch.zeros(1, dtype=torch.int32, device=dev)
    buf = torch.full((2 * 4 + 32,), 7777, dtype=torch.int32, device=dev)
    idx = buf[:8].view(1, 2, 4)
    scores, _ = score_select(q.to(dev), k.to(dev), 8, lengths, starts, torch.tensor([12], device=dev), 4, idx=idx,
                             gqa_select="query", aggregate="sum")
    assert (buf[8:] == 7777).all()
    _same_sets(idx.cpu(), R.select_topk(scores.cpu(), torch.tensor([4])), torch.tensor([4]))


@interp
def test_triton_select_counts_of_the_wrong_kind_are_named(triton_device):
    scores = torch.zeros(2, 2, 8, device=triton_device)
    with pytest.raises(TypeError, match="counts must be an integer tensor"):
        select_topk(scores, torch.tensor([1.0, 2.0], device=triton_device), method="triton")
    with pytest.raises(TypeError, match="counts must be an integer torch.Tensor"):
        select_topk(scores, [1, 2], method="triton")
