"""The softmax aggregates of a shared GQA selection ("softmax-max", "softmax-sum") on the Triton kernels, against
the PyTorch reference (``loki.reference.loki_attention(..., gqa_select="kv", aggregate=...)``).

The kernels' group scores are probabilities, the ``exp`` of the reference's log values (``group_softmax.py``):
they are compared with the reference through ``log`` (``-inf`` stays the marker of invalid tokens), and a row of
crowded log-probabilities shows what the change buys the radix select (distinct 12-bit key prefixes).
Selections are checked by their invariants against the fp64 group scores, with a slack taken from the reference's
own rounding (its fp32 group scores against fp64), and compared with the reference's: they may differ only at
such near-ties.  The decode step runs unfused (four launches before the attention) and fused
(``score_select_softmax``: one launch; forced with ``DecodeTuning(fuse_select=True)`` on these small shapes).
Outputs: exact attention over the kernel's own selection, and the reference's output wherever the selections
agree.  Under ``TRITON_INTERPRET=1`` on small awkward shapes (S = 1, 97, 300, 1025; G = 1, 3, 4; B = 1 and 3;
ragged and left-padded rows; k = 1 and every valid token; exact ties), every kernel output poisoned; the long rows
and big batches of the fast path under ``-m gpu``.
"""

from __future__ import annotations

import math

import pytest
import torch

from loki.kernels import approx_scores, decode_attention, make_key_prefix, plan_decode, score_select_softmax
from loki.kernels.decode import DecodeTuning, selection_bound
from loki.kernels.group_softmax import group_softmax_scores, lse_chunking
from loki.kernels.launch import recording
from loki.kernels.score_select import score_select_fusable
from loki.kernels.score_select_softmax import _score_select_softmax_kernel
from loki.reference import aggregate_group_scores, loki_attention, sparse_attention
from loki.reference.selection import approx_scores as approx_scores_reference
from loki.reference.selection import budget, topk_indices
from loki.testing.decode import kernel_run, kernel_step
from loki.testing.inputs import make_decode_inputs
from loki.testing.invariants import check_selection
from loki.testing.tolerances import assert_close_to_reference

interp = pytest.mark.interpreter
gpu = pytest.mark.gpu
AGGS = ("softmax-max", "softmax-sum")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", "1")


def _quantized(x, device, step=0.5):
    """Inputs on a coarse grid (exact scores, many exact ties), moved to ``device``."""
    x.q = torch.round(x.q / step) * step
    x.k_cache = torch.round(x.k_cache / step) * step
    for name in ("q", "k_cache", "v_cache", "lengths", "starts"):
        setattr(x, name, getattr(x, name).to(device))
    return x


def _sets(idx, counts):
    return [[sorted(t for t in row[: int(c)]) for row in rows] for rows, c in zip(idx.long().tolist(), counts.tolist())]


def _group_scores(x, d, aggregate, dtype):
    """The reference's group scores in ``dtype`` from the first d rotated dims (scale 1/sqrt(D) of the full D)."""
    D = x.q.shape[-1]
    return approx_scores_reference(x.q[..., :d].to(dtype), x.k_cache[..., :d].to(dtype), d, x.lengths, x.starts,
                                   gqa_select="kv", aggregate=aggregate, scale=1 / math.sqrt(D), compute_dtype=dtype)


def _fused_launches(launches) -> int:
    return sum(fn is _score_select_softmax_kernel for fn, *_ in launches)


def _reference_scores(x, d, aggregate):
    """The reference's fp64 group scores (log space) and the slack of its own rounding (fp32 against fp64)."""
    s64 = _group_scores(x, d, aggregate, torch.float64).cpu()
    s32 = _group_scores(x, d, aggregate, torch.float32).cpu()
    fin = torch.isfinite(s64)
    assert torch.equal(fin, torch.isfinite(s32))
    return s64, 4 * (s32.double()[fin] - s64[fin]).abs().max().item() + 1e-6


def check_near_reference(idx, ref_idx, counts, s64, slack, exact_sets=False):
    """Both selections satisfy the top-k invariants on the fp64 scores (with ``slack``) and differ only at
    near-ties of the k-th largest score (nowhere with ``exact_sets``); returns the kernel's sets."""
    B, HKV = s64.shape[:2]
    assert check_selection(idx, s64, counts, slack=slack) == B * HKV
    assert check_selection(ref_idx, s64, counts, slack=slack) == B * HKV
    got, want = _sets(idx.cpu(), counts.cpu()), _sets(ref_idx.cpu(), counts.cpu())
    for b in range(B):
        kth = torch.topk(s64[b], int(counts[b]), dim=-1).values[:, -1]
        for h in range(HKV):
            diff = sorted(set(got[b][h]) ^ set(want[b][h]))
            assert not (exact_sets and diff), f"row ({b},{h}): {diff} differ from the reference"
            assert all(abs(s64[b, h, t].item() - kth[h].item()) <= slack for t in diff), \
                f"row ({b},{h}): tokens {diff} differ from the reference away from a near-tie"
    return got, want


def check_step(x, d, k, aggregate, *, k_prefix=None, select_method="triton", exact_sets=False, fuse=None):
    """One Triton decode step with a softmax aggregate against the reference; returns the selected sets.
    ``fuse`` None: ``decode_attention`` (the default rule, ``score_select_fusable``: unfused at the interpreter's
    sizes); True / False: ``launch_decode_step`` with ``DecodeTuning(fuse_select=fuse)``.  The fused kernel must run
    exactly when it is forced or the rule asks for it (with the Triton select)."""
    B, HQ, D = x.q.shape
    HKV, S = x.k_cache.shape[1:3]
    dtype = x.q.dtype
    fused = score_select_fusable(B * HKV, S, x.q.device) if fuse is None else fuse
    with recording() as rec:
        if fuse is None:
            out, (idx, counts) = decode_attention(x.q, x.k_cache, x.v_cache, d=d, k=k, lengths=x.lengths,
                                                  starts=x.starts, backend="triton", gqa_select="kv",
                                                  aggregate=aggregate, select_method=select_method,
                                                  k_prefix=k_prefix, return_indices=True)
        else:
            counts = budget(k, x.lengths, x.starts, B, S, x.q.device)
            idx, out = kernel_step(x.q, x.k_cache, x.v_cache, x.lengths, x.starts, counts, d=d,
                                   k_max=selection_bound(k, S), gqa_select="kv", aggregate=aggregate,
                                   select_method=select_method, k_prefix=k_prefix,
                                   tuning=DecodeTuning(fuse_select=fuse))
    assert _fused_launches(rec.launches) == int(fused and select_method == "triton")
    ref, (ref_idx, ref_counts) = loki_attention(x.q.float(), x.k_cache.float(), x.v_cache.float(), d=d, k=k,
                                                lengths=x.lengths, starts=x.starts, gqa_select="kv",
                                                aggregate=aggregate, return_indices=True)
    assert idx.shape[:2] == (B, HKV) and torch.equal(counts.cpu(), ref_counts.cpu())
    s64, slack = _reference_scores(x, d, aggregate)
    got, want = check_near_reference(idx, ref_idx, counts, s64, slack, exact_sets)
    q64, k64, v64 = (t.double() for t in (x.q, x.k_cache, x.v_cache))
    own64 = sparse_attention(q64, k64, v64, idx.long(), counts, compute_dtype=torch.float64)
    lowp = sparse_attention(x.q, x.k_cache, x.v_cache, idx.long(), counts, compute_dtype=dtype)
    assert_close_to_reference(out, own64, lowp, dtype, f"decode step ({aggregate})")
    if got == want and dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    return got


# ----------------------------------------------------------------------------------------------------
# the group scores alone
GROUP_CASES = [
    pytest.param(1, 4, 4, 1, id="B1-G1-S1"),
    pytest.param(3, 6, 2, 97, id="B3-G3-S97"),
    pytest.param(3, 12, 3, 1025, id="B3-G4-S1025"),
    pytest.param(1, 4, 1, 1025, id="B1-G4-S1025"),
]


@interp
@pytest.mark.parametrize("aggregate", AGGS)
@pytest.mark.parametrize("B,HQ,HKV,S", GROUP_CASES)
def test_group_scores_equal_the_reference(triton_device, B, HQ, HKV, S, aggregate):
    """Default launch rule and forced small tiles, chunks and token blocks (every partial combined)."""
    x = make_decode_inputs(B, HQ, HKV, S, 16, ragged=True, left_pad=True, seed=S + HQ)
    heads = approx_scores_reference(x.q, x.k_cache, 8, x.lengths, x.starts, gqa_select="query",
                                    aggregate="sum").contiguous()  # [B, HQ, S] fp32
    valid = torch.isfinite(heads[:, :1])
    want = aggregate_group_scores(heads.double(), HKV, aggregate, scale=0.3).masked_fill(~valid, -math.inf)
    lengths, starts = x.lengths.to(triton_device), x.starts.to(triton_device)
    G = HQ // HKV
    for kw in ({}, dict(block=16, num_chunks=5, block_t=16), dict(block=32, num_chunks=2)):
        got = group_softmax_scores(heads.to(triton_device), HKV, aggregate, lengths, starts, scale=0.3, **kw).cpu()
        assert got.shape == (B, HKV, S) and not torch.isnan(got).any()
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf marks exactly the invalid tokens"
        fin = torch.isfinite(want)
        p = got.double()[fin]
        assert (p > 0).all() and (p <= (G if aggregate == "softmax-sum" else 1) * (1 + 1e-6)).all()
        # probabilities: exp of the reference's log values
        assert (p.log() - want[fin]).abs().max().item() <= 1e-5 * max(1.0, want[fin].abs().max().item())
        # every head's softmax sums to 1 over the valid tokens: the group's sum to G, its max to [1, G]
        mass = got.double().clamp(min=0).sum(-1)
        if aggregate == "softmax-sum":
            torch.testing.assert_close(mass, torch.full_like(mass, G), rtol=1e-5, atol=0)
        else:
            assert (mass >= 1 - 1e-5).all() and (mass <= G + 1e-5).all()


def test_lse_chunking_rule():
    """Chunks are whole tiles; few long rows get several chunks each, many rows one (132 SMs assumed)."""
    from loki.kernels import group_softmax as gs

    for rows, S in ((32, 131072), (512, 8192), (6, 1025), (1, 1), (3, 97)):
        block, chunk, nc = lse_chunking(rows, S, "cpu")
        assert chunk % block == 0 and (nc - 1) * chunk < S <= nc * chunk
    assert lse_chunking(6, 1025, "cpu", block=16, num_chunks=5) == (16, 208, 5)
    if not gs.interpreting():
        assert lse_chunking(32, 131072, "cpu") == (1024, 8192, 16)
        assert lse_chunking(512, 8192, "cpu")[2] == 2


@interp
@pytest.mark.parametrize("aggregate", AGGS)
def test_approx_scores_with_a_softmax_aggregate(triton_device, aggregate):
    x = make_decode_inputs(2, 6, 2, 300, 32, ragged=True, left_pad=True, seed=3)
    q, kc = x.q.to(triton_device), x.k_cache.to(triton_device)
    ln, st = x.lengths.to(triton_device), x.starts.to(triton_device)
    heads, agg = approx_scores(q, kc, 8, ln, st, gqa_select="kv", aggregate=aggregate, return_both=True)
    alone = approx_scores(q, kc, 8, ln, st, gqa_select="kv", aggregate=aggregate, scale=0.2,
                          k_prefix=make_key_prefix(kc, 8))
    for got, scale in ((agg, None), (alone, 0.2)):
        want = approx_scores_reference(x.q.double(), x.k_cache.double(), 8, x.lengths, x.starts, gqa_select="kv",
                                       aggregate=aggregate, scale=scale, compute_dtype=torch.float64)
        assert torch.equal(torch.isneginf(got.cpu()), torch.isneginf(want))
        fin = torch.isfinite(want)
        assert (got.cpu().double()[fin] - want[fin]).abs().max().item() < 1e-5 * max(1.0, want[fin].abs().max())
    assert heads.shape == (2, 6, 300)


# ----------------------------------------------------------------------------------------------------
# the decode step
STEP_CASES = [
    # B, HQ, HKV, S, D, d, k
    pytest.param(1, 4, 4, 1, 32, 8, 1, id="B1-G1-S1"),
    pytest.param(3, 6, 2, 97, 32, 8, 0.3, id="B3-G3-S97"),
    pytest.param(3, 12, 3, 1025, 32, 8, 0.25, id="B3-G4-S1025"),
    pytest.param(1, 4, 1, 1025, 32, 32, 64, id="B1-G4-S1025-d=D"),
]


@interp
@pytest.mark.parametrize("aggregate", AGGS)
@pytest.mark.parametrize("B,HQ,HKV,S,D,d,k", STEP_CASES)
def test_decode_step_equals_the_reference(triton_device, B, HQ, HKV, S, D, d, k, aggregate):
    x = make_decode_inputs(B, HQ, HKV, S, D, ragged=True, left_pad=True, seed=S + B, device=triton_device)
    check_step(x, d, k, aggregate)


@interp
@pytest.mark.parametrize("aggregate", AGGS)
def test_decode_step_key_prefix_and_torch_select(triton_device, aggregate):
    x = make_decode_inputs(3, 6, 2, 200, 32, ragged=True, left_pad=True, seed=5, device=triton_device)
    a = check_step(x, 8, 0.25, aggregate, k_prefix=make_key_prefix(x.k_cache, 8))
    b = check_step(x, 8, 0.25, aggregate, select_method="torch")
    c = check_step(x, 8, 0.25, aggregate, k_prefix=make_key_prefix(x.k_cache, 8), fuse=True)
    assert a == b == c


@interp
@pytest.mark.parametrize("aggregate", AGGS)
def test_ties_go_to_the_lowest_position(triton_device, aggregate):
    """Quantized inputs and duplicated keys: identical group scores tie exactly and the earlier token is taken
    first, as in the reference (same sets)."""
    x = make_decode_inputs(3, 6, 2, 97, 16, ragged=True, left_pad=True, seed=8)
    x.k_cache[:, :, 50:80] = x.k_cache[:, :, 10:40]
    x.lengths[1:] = torch.clamp(x.lengths[1:], min=85)
    x.starts = torch.minimum(x.starts, torch.full_like(x.starts, 5))
    x = _quantized(x, triton_device)
    sets = check_step(x, 4, 0.3, aggregate, exact_sets=True)
    assert check_step(x, 4, 0.3, aggregate, exact_sets=True, fuse=True) == sets
    for rows in sets:
        for row in rows:
            assert all(t - 40 in row for t in row if 50 <= t < 80), "a later duplicate was taken before its twin"


@interp
@pytest.mark.parametrize("aggregate", AGGS)
def test_one_head_per_group_selects_as_per_query_head(triton_device, aggregate):
    x = _quantized(make_decode_inputs(3, 3, 3, 97, 16, ragged=True, left_pad=True, seed=9), triton_device)
    kw = dict(d=4, k=0.3, lengths=x.lengths, starts=x.starts, backend="triton", return_indices=True)
    per_head, (idx_q, counts) = decode_attention(x.q, x.k_cache, x.v_cache, gqa_select="query", **kw)
    shared, (idx_kv, _) = decode_attention(x.q, x.k_cache, x.v_cache, gqa_select="kv", aggregate=aggregate, **kw)
    assert _sets(idx_q, counts) == _sets(idx_kv, counts) == check_step(x, 4, 0.3, aggregate, exact_sets=True)
    torch.testing.assert_close(per_head, shared, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# the fused kernel: scores, group softmax and select in one launch
FUSED_CASES = [
    # B, HQ, HKV, S, D, d, k, block_s, block_t, chunk
    pytest.param(1, 2, 2, 1, 32, 8, 1, None, None, None, id="B1-G1-S1"),
    pytest.param(3, 6, 2, 97, 32, 8, 1, 16, 16, None, id="B3-G3-S97-k1-tiles16"),
    pytest.param(3, 12, 3, 300, 32, 8, 1.0, 32, 64, 64, id="B3-G4-S300-kall-tiles32-chunk64"),
    pytest.param(2, 4, 4, 150, 16, 16, 0.3, None, 16, None, id="B2-G1-S150-d=D"),
]


@interp
@pytest.mark.parametrize("aggregate", AGGS)
@pytest.mark.parametrize("B,HQ,HKV,S,D,d,k,block_s,block_t,chunk", FUSED_CASES)
def test_fused_kernel_equals_the_reference(triton_device, B, HQ, HKV, S, D, d, k, block_s, block_t, chunk,
                                           aggregate):
    """``score_select_softmax`` alone, ragged and left-padded rows: its scores are exp of the reference's group
    scores (-inf exactly outside the valid tokens), its selection the exact top-k of its own scores (lowest
    position first) and the reference's up to near-ties.  Small forced tiles: many steps of the online softmax,
    a first tile cut by ``starts`` and a last one by ``lengths``; chunked compaction; k = 1 and every valid token."""
    x = make_decode_inputs(B, HQ, HKV, S, D, ragged=True, left_pad=True, seed=S + HQ, device=triton_device)
    counts = budget(k, x.lengths, x.starts, B, S, triton_device)
    K = selection_bound(k, S)
    scores, idx = score_select_softmax(x.q, x.k_cache, d, x.lengths, x.starts, counts, K, aggregate=aggregate,
                                       block_s=block_s, block_t=block_t, chunk=chunk)
    scores, idx, counts = scores.cpu(), idx.cpu(), counts.cpu()
    s64, slack = _reference_scores(x, d, aggregate)
    assert scores.shape == s64.shape and idx.shape == (B, HKV, K) and idx.dtype == torch.int32
    assert torch.equal(torch.isneginf(scores), torch.isneginf(s64)) and not torch.isnan(scores).any()
    fin = torch.isfinite(s64)
    assert (scores.double()[fin].log() - s64[fin]).abs().max().item() <= 1e-5 * max(1.0, s64[fin].abs().max())
    ref_idx = loki_attention(x.q, x.k_cache, x.v_cache, d=d, k=k, lengths=x.lengths, starts=x.starts,
                             gqa_select="kv", aggregate=aggregate, return_indices=True)[1][0]
    got, _ = check_near_reference(idx, ref_idx, counts, s64, slack)
    own = topk_indices(scores, K)  # the tie rule on the kernel's own scores, sorted: the first counts[b] win
    assert got == _sets(own, counts)
    if isinstance(k, float) and k == 1.0:  # every valid token
        assert got == [[list(range(int(st), int(n)))] * HKV for st, n in zip(x.starts.tolist(), x.lengths.tolist())]


STEP_CASES_FUSED = STEP_CASES + [
    pytest.param(3, 6, 2, 97, 32, 8, 1, id="B3-G3-S97-k1"),
    pytest.param(3, 12, 3, 300, 32, 8, 1.0, id="B3-G4-S300-kall"),
]


@interp
@pytest.mark.parametrize("aggregate", AGGS)
@pytest.mark.parametrize("B,HQ,HKV,S,D,d,k", STEP_CASES_FUSED)
def test_fused_decode_step_equals_the_reference(triton_device, B, HQ, HKV, S, D, d, k, aggregate):
    """The decode step forced to fuse (one launch before the attention) and forced not to: each the reference's
    selection up to near-ties and its output over its own selection; the same sets."""
    x = make_decode_inputs(B, HQ, HKV, S, D, ragged=True, left_pad=True, seed=S + B, device=triton_device)
    assert check_step(x, d, k, aggregate, fuse=True) == check_step(x, d, k, aggregate, fuse=False)


@interp
def test_default_rule_fuses_a_softmax_aggregate(triton_device, monkeypatch):
    """``fuse_select=None`` decides by ``score_select_fusable`` for the softmax aggregates too (fused here once the
    rule's rows-per-multiprocessor floor is lowered to these few rows); more than 16 query heads per KV head never
    take the fused kernel, even when it is forced."""
    from loki.kernels.score_select import FUSED_DEFAULTS

    x = make_decode_inputs(2, 6, 2, 97, 32, ragged=True, left_pad=True, seed=4, device=triton_device)
    assert not score_select_fusable(4, 97, triton_device)
    unfused = check_step(x, 8, 0.3, "softmax-max")  # and the fused kernel did not run
    monkeypatch.setitem(FUSED_DEFAULTS, "min_rows_per_sm", 0.0)
    assert score_select_fusable(4, 97, triton_device)
    assert check_step(x, 8, 0.3, "softmax-max") == unfused  # and the fused kernel ran
    assert check_step(x, 8, 0.3, "softmax-max", fuse=False) == unfused
    wide = make_decode_inputs(1, 17, 1, 40, 16, ragged=True, left_pad=True, seed=5, device=triton_device)
    with recording() as rec:
        counts = budget(0.5, wide.lengths, wide.starts, 1, 40, triton_device)
        kernel_step(wide.q, wide.k_cache, wide.v_cache, wide.lengths, wide.starts, counts, d=4, k_max=20,
                    gqa_select="kv", aggregate="softmax-sum", select_method="triton",
                    tuning=DecodeTuning(fuse_select=True))
    assert _fused_launches(rec.launches) == 0
    with pytest.raises(ValueError, match="16 query heads"):
        score_select_softmax(wide.q, wide.k_cache, 4, wide.lengths, wide.starts, counts, 20, aggregate="softmax-max")


@interp
@pytest.mark.parametrize("change,name", [(dict(aggregate="sum"), "aggregate"), (dict(K=0), "K"), (dict(K=99), "K"),
                                         (dict(d=17), "d"), (dict(scale=0.0), "scale")])
def test_fused_kernel_bad_arguments_are_named(triton_device, change, name):
    x = make_decode_inputs(1, 4, 2, 64, 16, device=triton_device)
    counts = torch.full((1,), 8, dtype=torch.int32, device=triton_device)
    kw = dict(d=4, K=8, aggregate="softmax-max", scale=None) | change
    with pytest.raises(ValueError, match=name):
        score_select_softmax(x.q, x.k_cache, kw["d"], x.lengths, x.starts, counts, kw["K"],
                             aggregate=kw["aggregate"], scale=kw["scale"])


def _key_prefixes(x: torch.Tensor) -> torch.Tensor:
    """The top 12 bits of the order-preserving uint32 key of fp32 scores (``loki.kernels.tl_helpers.ordered_key``):
    sign, exponent and 3 mantissa bits, what the split select resolves before its final select."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(bits >= 2**31, ~bits & 0xFFFFFFFF, bits | 2**31)
    return key >> 20


@interp
@pytest.mark.parametrize("aggregate", AGGS)
def test_probabilities_spread_the_keys_of_crowded_log_probabilities(triton_device, aggregate):
    """One row of 8192 tokens whose log-probabilities crowd within about 1.5 of each other: in log space (the
    reference) their fp32 keys fall into 3 12-bit prefixes and more than the split select's register tile of
    candidates (``cand_block``) share the prefix of the k-th largest, which made its final select loop over
    tiles; the kernels' probabilities spread over 4x as many prefixes and the threshold's prefix holds fewer than
    ``cand_block``.  The split select on them takes the reference's tokens."""
    from loki.kernels import select_topk
    from loki.kernels.select_split import SPLIT_DEFAULTS

    S, HQ, k = 8192, 4, 2048
    heads = torch.randn(1, HQ, S, generator=torch.Generator().manual_seed(0)) * 0.3
    logp = aggregate_group_scores(heads, 1, aggregate, scale=1.0)  # the reference: ~ -log(S) +- 0.3
    dev = triton_device
    one, zero = torch.tensor([S], device=dev), torch.tensor([0], device=dev)
    p = group_softmax_scores(heads.to(dev), 1, aggregate, one, zero, scale=1.0)

    def crowd(x):
        pre = _key_prefixes(x.cpu().flatten())
        return pre.unique().numel(), int((pre == _key_prefixes(torch.topk(x.cpu().flatten(), k).values[-1:])).sum())

    (n_log, at_log), (n_p, at_p) = crowd(logp), crowd(p)
    cand = SPLIT_DEFAULTS["cand_block"]
    assert at_log > cand > at_p and n_p >= 4 * n_log, (n_log, at_log, n_p, at_p)
    counts = torch.tensor([k], device=dev)
    idx = select_topk(p, counts, k_max=k, method="split")
    want = topk_indices(logp.double(), k)
    diff = set(_sets(idx.cpu(), counts.cpu())[0][0]) ^ set(want[0, 0].tolist())
    kth = torch.topk(logp.double().flatten(), k).values[-1]
    assert all(abs(logp[0, 0, t].item() - kth.item()) <= 1e-5 for t in diff), diff  # near-ties at most
    assert _sets(idx.cpu(), counts.cpu()) == _sets(topk_indices(p.cpu(), k), counts.cpu())  # exact on its scores


# ----------------------------------------------------------------------------------------------------
# recorded launches: DecodeRun.step and plan_decode
def _new_positions(g, B, S):
    lengths = torch.randint(S // 2, S + 1, (B,), generator=g, dtype=torch.int32)
    starts = torch.stack([torch.randint(0, int(n) // 3 + 1, (1,), generator=g)[0] for n in lengths]).int()
    return lengths, starts


@interp
@pytest.mark.parametrize("fuse", [None, True], ids=["rule", "fused"])
@pytest.mark.parametrize("aggregate", AGGS)
def test_step_replay_and_plan_change_every_input(triton_device, aggregate, fuse):
    """Recorded then replayed launches with a new query, lengths, starts and counts every call; every output
    equals the reference of its own inputs and stays as it was.  ``fuse``: the step's default rule (unfused at
    this size) or the fused kernel forced, which the recorded plan must then replay."""
    B, HQ, HKV, S, D, d, K = 2, 8, 2, 150, 32, 8, 40
    dev = triton_device
    x = make_decode_inputs(B, HQ, HKV, S, D, ragged=True, left_pad=True, seed=11, device=dev)
    g = torch.Generator().manual_seed(12)
    run = kernel_run(x.q, x.k_cache, d=d, gqa_select="kv", aggregate=aggregate, tuning=DecodeTuning(fuse_select=fuse))
    plan = plan_decode(x.k_cache, x.v_cache, num_q_heads=HQ, d=d, k=0.3, gqa_select="kv", aggregate=aggregate)
    kept = []
    for _call in range(4):
        q = torch.randn(B, HQ, D, generator=g).to(dev)
        lengths, starts = _new_positions(g, B, S)
        counts = torch.minimum(lengths - starts, torch.randint(1, K + 1, (B,), generator=g, dtype=torch.int32))
        lengths, starts, counts = lengths.to(dev), starts.to(dev), counts.to(dev)
        res = run.step(q_hat=q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=None, lengths=lengths, starts=starts,
                       counts=counts, width=K)
        kept.append((q, lengths, starts, dict(counts=counts.long()), res))
        kept.append((q, lengths, starts, dict(k=0.3), plan.run(q, lengths, starts)))
    plans = [p for p in run._plans.values() if p]
    assert len(plans) == 1 and plan.replays == 1
    assert _fused_launches(plans[0].launches) == int(fuse is True)
    assert len({r.data_ptr() for *_, r in kept}) == len(kept)
    for q, lengths, starts, how_many, res in kept:
        want = loki_attention(q, x.k_cache, x.v_cache, d=d, lengths=lengths, starts=starts, gqa_select="kv",
                              aggregate=aggregate, **how_many)
        torch.testing.assert_close(res, want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------
# GPU: the fast path's shapes
GPU_STEP = [
    pytest.param(1, 32, 8, 131072, id="B1-HQ32-HKV8-S131072"),
    pytest.param(16, 32, 8, 8192, id="B16-HQ32-HKV8-S8192"),
    pytest.param(3, 24, 8, 4099, id="B3-HQ24-HKV8-S4099-G3"),
]


@gpu
@pytest.mark.parametrize("fuse", [None, False], ids=["rule", "unfused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("aggregate", AGGS)
@pytest.mark.parametrize("B,HQ,HKV,S", GPU_STEP)
def test_gpu_decode_step(B, HQ, HKV, S, aggregate, dtype, fuse):
    """The default rule fuses B=16 S=8192 (128 rows) and not the others; ``fuse=False`` runs the unfused path
    (the split select on the probabilities at B=16 S=8192)."""
    D, d = 128, 32
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=dtype, device="cuda", ragged=True, left_pad=True, seed=S)
    check_step(x, d, 0.25, aggregate, k_prefix=make_key_prefix(x.k_cache, d), fuse=fuse)


@gpu
@pytest.mark.parametrize("aggregate", AGGS)
def test_gpu_op_replay_and_cuda_graph(aggregate):
    """torch.ops.loki.decode_step on CUDA (the kernels) against its CPU registration (the reference), a
    a DecodeRun's replays and a captured CUDA graph replayed with new inputs."""
    from loki.kernels.decode import selection_width

    B, HQ, HKV, S, D, d = 4, 32, 8, 4099, 128, 32
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=torch.bfloat16, device="cuda", ragged=True, left_pad=True)
    kp = make_key_prefix(x.k_cache, d)
    counts = torch.clamp((x.lengths - x.starts) // 4, min=1).long()
    W = selection_width(0.25, S)
    args = (x.lengths, x.starts, counts, d, W, "kv", aggregate, 1 / math.sqrt(D))
    got = torch.ops.loki.decode_step(x.q, x.k_cache, x.v_cache, kp, *args)
    want = torch.ops.loki.decode_step(*(t.cpu().float() for t in (x.q, x.k_cache, x.v_cache)), None,
                                      *(t.cpu() for t in args[:3]), *args[3:])
    torch.testing.assert_close(got.float().cpu(), want, rtol=3e-2, atol=3e-2)
    kw = dict(d=d, k_max=W, gqa_select="kv", aggregate=aggregate, select_method="triton", k_prefix=kp,
              scale=1 / math.sqrt(D))
    run = kernel_run(x.q, x.k_cache, d=d, gqa_select="kv", aggregate=aggregate)
    for _ in range(3):
        res = run.step(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=kp, lengths=x.lengths,
                       starts=x.starts, counts=counts, width=W)
        torch.testing.assert_close(res, got, rtol=0, atol=0)
    q = x.q.clone()
    kernel_step(q, x.k_cache, x.v_cache, x.lengths, x.starts, counts, **kw)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, static_out = kernel_step(q, x.k_cache, x.v_cache, x.lengths, x.starts, counts, **kw)
    q.copy_(torch.randn_like(q))
    graph.replay()
    _, eager = kernel_step(q, x.k_cache, x.v_cache, x.lengths, x.starts, counts, **kw)
    torch.testing.assert_close(static_out, eager, rtol=0, atol=0)
