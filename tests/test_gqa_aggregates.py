"""The shared (per KV group) selections: every aggregate of ``loki.reference.GQA_AGGREGATES`` in the decode
references, the teacher-forced engine and the evaluation; the kernels refuse the ones they do not implement
("union", "agreement"; the softmax aggregates on the kernels: tests/test_softmax_aggregates_kernels.py); the bytes
accounting of the selections."""

from __future__ import annotations

import math

import pytest
import torch

from loki.reference import (
    GQA_AGGREGATES,
    KERNEL_AGGREGATES,
    aggregate_group_scores,
    exact_topk_attention,
    loki_attention,
    token_ranks,
    topk_indices,
)
from loki.reference.accounting import record_indices, tally_selections
from loki.reference.teacher_forced import teacher_forced_rows

NEW = ("softmax-sum", "softmax-max", "union", "agreement")  # the aggregates beyond the raw sum and max
REFERENCE_ONLY = tuple(a for a in GQA_AGGREGATES if a not in KERNEL_AGGREGATES)


def _decode_inputs(B=2, HQ=6, HKV=2, S=37, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    lengths = torch.tensor([S, S - 5])[:B]
    starts = torch.tensor([0, 3])[:B]
    return q, k, v, lengths, starts


def _sets(idx: torch.Tensor) -> list:
    return [[sorted(x for x in row if x >= 0) for row in b] for b in idx.tolist()]


def test_new_aggregates_are_named():
    assert set(GQA_AGGREGATES) == {"sum", "max", *NEW}
    assert KERNEL_AGGREGATES == ("sum", "max", "softmax-sum", "softmax-max")
    assert REFERENCE_ONLY == ("union", "agreement")


@pytest.mark.parametrize("aggregate", GQA_AGGREGATES)
@pytest.mark.parametrize("k", [0.3, 5, 1])
def test_one_head_per_group_selects_as_per_query_head(aggregate, k):
    """G = 1: every aggregate selects what per-query-head selection selects (decode reference and engine)."""
    q, kc, v, lengths, starts = _decode_inputs(HQ=3, HKV=3)
    out_q, (idx_q, _) = loki_attention(q, kc, v, d=5, k=k, lengths=lengths, starts=starts, return_indices=True,
                                       gqa_select="query", aggregate="sum")
    out_kv, (idx_kv, _) = loki_attention(q, kc, v, d=5, k=k, lengths=lengths, starts=starts, gqa_select="kv",
                                         aggregate=aggregate, return_indices=True)
    assert _sets(idx_q) == _sets(idx_kv)
    torch.testing.assert_close(out_q, out_kv)
    g = torch.Generator().manual_seed(1)
    qr, kr, vr = (torch.randn(1, 3, 11, 8, generator=g), torch.randn(1, 3, 15, 8, generator=g),
                  torch.randn(1, 3, 15, 8, generator=g))
    lens = (5 + torch.arange(11))[None]
    st = torch.zeros_like(lens)
    a = teacher_forced_rows(qr, kr, vr, st, lens, method="loki", k_budget=k, d=3, gqa_select="query", aggregate="sum")
    b = teacher_forced_rows(qr, kr, vr, st, lens, method="loki", k_budget=k, d=3, gqa_select="kv",
                            aggregate=aggregate)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("aggregate", ["softmax-sum", "softmax-max", "union"])
def test_aggregates_ignore_a_constant_added_to_one_head(aggregate):
    """Softmax aggregates (and the rank-based union) are invariant to a per-head constant; the raw max is not."""
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 6, 4, 30, generator=g) * 3
    s[..., 25:] = float("-inf")  # tokens the rows do not see
    shift = torch.tensor([0.0, 40.0, -7.0, 3.0, -55.0, 12.0])[None, :, None, None]
    a = aggregate_group_scores(s, 2, aggregate, scale=0.25)
    b = aggregate_group_scores(s + shift, 2, aggregate, scale=0.25)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    assert torch.equal(topk_indices(a, 7), topk_indices(b, 7))
    raw_a = topk_indices(aggregate_group_scores(s, 2, "max"), 7)
    raw_b = topk_indices(aggregate_group_scores(s + shift, 2, "max"), 7)
    assert not torch.equal(raw_a.sort(-1).values, raw_b.sort(-1).values)


def test_softmax_aggregates_are_the_log_of_summed_or_maxed_probabilities():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(1, 4, 3, 9, generator=g)
    p = torch.softmax(s * 0.5, dim=-1).view(1, 2, 2, 3, 9)
    torch.testing.assert_close(aggregate_group_scores(s, 2, "softmax-sum", scale=0.5).exp(), p.sum(2))
    torch.testing.assert_close(aggregate_group_scores(s, 2, "softmax-max", scale=0.5).exp(), p.amax(2))
    with pytest.raises(ValueError, match="scale"):
        aggregate_group_scores(s, 2, "softmax-sum")
    with pytest.raises(ValueError, match="aggregate must be one of"):
        aggregate_group_scores(s, 2, "mean")
    row = torch.full((1, 2, 5), -math.inf)  # a row that sees nothing stays -inf (no NaN)
    assert torch.isneginf(aggregate_group_scores(row, 1, "softmax-sum", scale=1.0)).all()


def test_token_ranks_follow_the_selection_order():
    g = torch.Generator().manual_seed(4)
    s = torch.randn(3, 5, 40, generator=g).round(decimals=1)  # ties
    r = token_ranks(s)
    order = topk_indices(s, 40)
    assert torch.equal(r.gather(-1, order), torch.arange(40).expand(3, 5, 40))
    r64 = token_ranks(s.double())
    assert torch.equal(r64, r)


def _union_brute(scores: torch.Tensor, G: int, k: int) -> set:
    """Round-robin over the G heads' rankings (rank 0 first, heads in order of the token position at equal rank is
    what lowest-position tie breaking gives), until k distinct tokens."""
    ranks = [topk_indices(scores[h], scores.shape[-1]).tolist() for h in range(G)]
    chosen: list = []
    for r in range(scores.shape[-1]):
        tier = sorted({ranks[h][r] for h in range(G)} - set(chosen))
        for t in tier:
            if len(chosen) < k:
                chosen.append(t)
    return set(chosen)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 4, 7, 12, 30])
def test_union_reads_exactly_k_tokens_and_holds_the_heads_tops(seed, k):
    G, S = 3, 30
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, G, S, generator=g)
    if seed % 2:
        s[:, 1] = s[:, 0] + 0.01 * torch.randn(S, generator=g)  # two heads that nearly agree
    agg = aggregate_group_scores(s, 1, "union")
    sel = set(topk_indices(agg[0, 0], k).tolist())
    assert len(sel) == k
    assert sel == _union_brute(s[0], G, k)
    tops = [set(topk_indices(s[0, h], r).tolist()) for h in range(G) for r in (k // G, -(-k // G))]
    floor_union = set().union(*tops[0::2])
    ceil_union = set().union(*tops[1::2])
    assert floor_union <= sel  # the union of every head's top-floor(k/G) always fits
    assert (sel <= ceil_union) if len(ceil_union) >= k else (ceil_union <= sel)


def _largest_remainder(weights: list, total: int) -> list:
    """Brute force: ``total`` shared in proportion to ``weights`` by Fractions, the leftovers to the largest
    fractional parts (ties to the lower index)."""
    from fractions import Fraction

    w = sum(weights)
    raw = [Fraction(total * x, w) for x in weights]
    base = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


@pytest.mark.parametrize("seed", range(8))
def test_agreement_counts_share_the_steps_tokens_by_union_size(seed):
    from loki.reference.selection import agreement_counts

    g = torch.Generator().manual_seed(seed)
    B, HKV, R = 3, 4, 5
    counts = torch.randint(1, 40, (B, R), generator=g)
    u = counts[:, None] * (1 + torch.randint(0, 3, (B, HKV, R), generator=g))  # between k and G k (G = 3)
    if seed % 2:
        u[0, :, 0] = u[0, 0, 0]  # every head the same: ties in the fractional parts
    n = torch.full((B, R), 10_000)
    got = agreement_counts(u, counts, n)
    for b in range(B):
        for r in range(R):
            want = _largest_remainder(u[b, :, r].tolist(), HKV * int(counts[b, r]))
            assert got[b, :, r].tolist() == want
    assert torch.equal(got.sum(1), HKV * counts)  # the bytes of one shared selection of `counts` per KV head
    capped = agreement_counts(u, counts, torch.full((B, R), 3))
    assert torch.equal(capped, got.clamp(max=3))
    assert torch.equal(agreement_counts(torch.zeros_like(u), counts, n), counts[:, None].expand(B, HKV, R))


def test_agreement_gives_the_disagreeing_group_more_tokens_in_the_decode_reference():
    """Group 0's heads have the same queries (they agree), group 1's differ: group 1 reads more tokens; the two
    read 2 k together, and each head's selection is the top of its group's softmax-max scores."""
    q, kc, v, _, _ = _decode_inputs(B=1, HQ=6, HKV=2, S=40)
    q[:, 1] = q[:, 2] = q[:, 0]
    lengths, starts = torch.tensor([40]), torch.tensor([0])
    out, (idx, counts) = loki_attention(q, kc, v, d=16, k=8, lengths=lengths, starts=starts, gqa_select="kv",
                                        aggregate="agreement", return_indices=True)
    assert counts.shape == (1, 2) and int(counts.sum()) == 16 and int(counts[0, 0]) < 8 < int(counts[0, 1])
    unions = [len(set(topk_indices(torch.einsum("hd,sd->hs", q[0, 3 * h:3 * h + 3], kc[0, h]), 8).flatten()
                      .tolist())) for h in range(2)]
    assert counts[0].tolist() == _largest_remainder(unions, 16)
    s = aggregate_group_scores(torch.einsum("bhd,bsd->bhs", q[0].view(2, 3, 16), kc[0])[None].reshape(1, 6, 40), 2,
                               "softmax-max", scale=0.25)
    for h in range(2):
        assert sorted(x for x in idx[0, h].tolist() if x >= 0) == sorted(topk_indices(s[0, h], int(counts[0, h]))
                                                                         .tolist())
    ref = exact_topk_attention(q, kc, v, k=8, lengths=lengths, starts=starts, gqa_select="kv", aggregate="agreement",
                               return_indices=True)[1][1]
    assert torch.equal(ref, counts)  # d = D: Loki's scores are the exact ones


@pytest.mark.parametrize("aggregate", NEW)
def test_union_and_softmax_aggregates_in_the_decode_references(aggregate):
    q, kc, v, lengths, starts = _decode_inputs()
    out, (idx, counts) = loki_attention(q, kc, v, d=6, k=0.3, lengths=lengths, starts=starts, gqa_select="kv",
                                        aggregate=aggregate, return_indices=True)
    assert idx.shape[1] == 2 and torch.isfinite(out).all()
    for b in range(2):
        for h in range(2):
            chosen = [x for x in idx[b, h].tolist() if x >= 0]
            want = int(counts[b, h]) if counts.dim() == 2 else int(counts[b])  # "agreement": a count per KV head
            assert len(set(chosen)) == len(chosen) == want
            assert all(int(starts[b]) <= x < int(lengths[b]) for x in chosen)
    ex = exact_topk_attention(q, kc, v, k=0.3, lengths=lengths, starts=starts, gqa_select="kv", aggregate=aggregate)
    assert torch.isfinite(ex).all()


def _rows_reference(method, q, k, v, starts, lengths, *, kb, d, aggregate):
    B, HQ, L, D = q.shape
    out = torch.zeros(B, HQ, L, D, dtype=torch.float64)
    for b in range(B):
        for i in range(L):
            st, ln = int(starts[b, i]), int(lengths[b, i])
            args = (q[b:b + 1, :, i], k[b:b + 1], v[b:b + 1])
            kw = dict(lengths=torch.tensor([ln]), starts=torch.tensor([st]), gqa_select="kv", aggregate=aggregate)
            if method == "loki":
                o = loki_attention(*args, d=d, k=kb, **kw)
            else:
                o = exact_topk_attention(*args, k=kb, **kw)
            out[b, :, i] = o[0].double()
    return out


@pytest.mark.parametrize("aggregate", NEW)
@pytest.mark.parametrize("method,kb,d", [("loki", 0.3, 5), ("exact_topk", 4, 1.0)])
def test_engine_rows_equal_the_decode_references(aggregate, method, kb, d):
    g = torch.Generator().manual_seed(5)
    B, HQ, HKV, L, S, D = 2, 4, 2, 13, 19, 16
    q = torch.randn(B, HQ, L, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    lengths = (S - L + 1 + torch.arange(L))[None].repeat(B, 1)
    starts = torch.zeros(B, L, dtype=torch.long)
    starts[1] = 4
    got = teacher_forced_rows(q, k, v, starts, lengths, method=method, k_budget=kb, d=d, gqa_select="kv",
                              aggregate=aggregate)
    want = _rows_reference(method, q, k, v, starts, lengths, kb=kb, d=d, aggregate=aggregate)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ kernels refuse
@pytest.mark.parametrize("aggregate", REFERENCE_ONLY)
def test_kernel_entry_points_refuse_the_reference_only_aggregates(aggregate):
    from loki.kernels import approx_scores, decode_attention, plan_decode, score_select

    q, kc, v, lengths, starts = _decode_inputs()
    with pytest.raises(ValueError, match=rf"aggregate='{aggregate}' is not implemented by decode_attention"):
        decode_attention(q, kc, v, d=4, k=0.25, lengths=lengths, starts=starts, backend="triton", gqa_select="kv",
                         aggregate=aggregate)
    with pytest.raises(ValueError, match=rf"aggregate='{aggregate}' is not implemented by plan_decode"):
        plan_decode(kc, v, num_q_heads=6, d=4, k=0.25, gqa_select="kv", aggregate=aggregate)
    with pytest.raises(ValueError, match=rf"aggregate='{aggregate}' is not implemented by approx_scores"):
        approx_scores(q, kc, 4, lengths, starts, gqa_select="kv", aggregate=aggregate)
    counts = torch.tensor([4, 4])
    for agg in NEW:  # the fused score-select kernel takes the raw sum and max only
        with pytest.raises(ValueError, match="aggregate"):
            score_select(q, kc, 4, lengths.int(), starts.int(), counts, 8, gqa_select="kv", aggregate=agg)
    # the reference runs them (backend="torch", and "auto" on the CPU)
    ref = decode_attention(q, kc, v, d=4, k=0.25, lengths=lengths, starts=starts, backend="torch", gqa_select="kv",
                           aggregate=aggregate)
    auto = decode_attention(q, kc, v, d=4, k=0.25, lengths=lengths, starts=starts, gqa_select="kv",
                            aggregate=aggregate)
    torch.testing.assert_close(ref, auto)


@pytest.mark.parametrize("aggregate", REFERENCE_ONLY)
def test_enable_loki_refuses_the_reference_only_aggregates_on_the_kernels(aggregate, triton_device):
    from loki.basis import PCABasis
    from loki.integrations.transformers import disable_loki, enable_loki
    from loki.testing.models import tiny_model

    model = tiny_model(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16).to(triton_device)
    basis = PCABasis.random(1, 2, 16, seed=0)
    with pytest.raises(ValueError, match=rf"aggregate='{aggregate}' is not implemented by the Triton kernels"):
        enable_loki(model, basis, gqa_select="kv", aggregate=aggregate, backend="triton")
    if triton_device.type == "cuda":
        with pytest.raises(ValueError, match="aggregate"):
            enable_loki(model, basis, gqa_select="kv", aggregate=aggregate)  # auto: the kernels on CUDA
    enable_loki(model, basis, gqa_select="kv", aggregate=aggregate, backend="torch")
    enable_loki(model, None, method="exact_topk", gqa_select="kv", aggregate=aggregate)  # always the reference
    for agg in ("softmax-sum", "softmax-max"):  # on the kernels
        enable_loki(model, basis, gqa_select="kv", aggregate=agg, backend="triton")
        enable_loki(model, basis, gqa_select="kv", aggregate=agg)
    disable_loki(model)
    with pytest.raises(ValueError, match="aggregate must be one of"):
        enable_loki(model, basis, gqa_select="kv", aggregate="mean", backend="torch")


# ------------------------------------------------------------------------------------------ bytes accounting
def test_tally_counts_distinct_tokens_per_kv_head():
    g = torch.Generator().manual_seed(6)
    B, HQ, HKV, L, S, D = 1, 4, 2, 9, 9, 8
    q, k, v = torch.randn(B, HQ, L, D, generator=g), torch.randn(B, HKV, S, D, generator=g), torch.randn(
        B, HKV, S, D, generator=g)
    lengths = (1 + torch.arange(L))[None]
    starts = torch.zeros_like(lengths)
    n = lengths[0].double()
    want_kv = float((torch.ceil(0.25 * n) / n).mean())
    with tally_selections() as t:
        teacher_forced_rows(q, k, v, starts, lengths, method="loki", k_budget=0.25, d=4, gqa_select="kv",
                            aggregate="union")
    assert t.count == HKV * L and t.selected_fraction == pytest.approx(want_kv)
    with tally_selections() as t:
        teacher_forced_rows(q, k, v, starts, lengths, method="exact_topk", k_budget=0.25, gqa_select="query",
                            aggregate="sum")
    assert want_kv <= t.selected_fraction <= min(1.0, 2 * want_kv) + 1e-12
    # the decode reference records the same selection (one row per step)
    with tally_selections() as t2:
        for i in range(L):
            exact_topk_attention(q[:, :, i], k, v, k=0.25, lengths=lengths[:, i], starts=starts[:, i],
                                 gqa_select="query", aggregate="sum")
    assert t2.selected_fraction == pytest.approx(t.selected_fraction)
    with tally_selections() as t3:
        record_indices(torch.tensor([[[0, 2, -1], [2, 3, -1]]]), torch.tensor([5]), 1, 6)
    assert t3.selected_fraction == pytest.approx(3 / 5) and t3.count == 1


# ------------------------------------------------------------------------------------------ the evaluation
@pytest.fixture(scope="module")
def tiny():
    from loki.basis import PCABasis
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, seed=3)
    basis = PCABasis.random(2, 2, 16, seed=1, rotary="post")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
    return model, {"b": basis}, ids


@pytest.mark.parametrize("aggregate", NEW)
def test_engine_equals_token_by_token_decoding_for_every_aggregate(tiny, aggregate):
    from loki.evaluation.perplexity import MethodSpec, method_logits

    model, bases, ids = tiny
    spec = MethodSpec("l", "loki", k=0.3, d=5, basis="b", gqa_select="kv", aggregate=aggregate)
    tf = method_logits(model, ids, spec, bases)
    loop = method_logits(model, ids, spec, bases, decode_loop=True)
    torch.testing.assert_close(tf, loop, rtol=1e-4, atol=1e-4)


def test_perplexity_rows_state_the_bytes_they_read(tiny):
    from loki.evaluation.perplexity import MethodSpec, bytes_fractions, perplexity

    model, bases, ids = tiny
    T, D = ids.shape[1], 16
    n = torch.arange(1, T + 1).double()  # the rows that predict a token see 1 .. T tokens
    shared = float((torch.ceil(0.25 * n) / n).mean())
    full = perplexity(model, ids, MethodSpec("full", "full"))
    assert (full.bytes_fraction, full.selected_fraction) == (1.0, 1.0)
    rows = {}
    for g in ("query", "kv"):
        for agg in (("sum", "union", "agreement") if g == "kv" else ("sum",)):
            r = perplexity(model, ids, MethodSpec(f"l-{g}-{agg}", "loki", k=0.25, d=4, basis="b", gqa_select=g,
                                                  aggregate=agg), bases)
            rows[g, agg] = r
            assert r.score_fraction == 4 / (2 * D) and r.aggregate == agg
            assert r.bytes_fraction == pytest.approx(r.score_fraction + r.selected_fraction)
    assert rows["kv", "sum"].selected_fraction == pytest.approx(shared)
    assert rows["kv", "union"].selected_fraction == pytest.approx(shared)
    # agreement moves tokens between KV heads at the same total, less where a share passes a row's visible tokens
    assert 0.9 * shared <= rows["kv", "agreement"].selected_fraction <= shared + 1e-12
    assert shared < rows["query", "sum"].selected_fraction <= 2 * shared
    count = perplexity(model, ids, MethodSpec("l8", "loki", k=8, d=4, basis="b", gqa_select="kv"), bases)
    assert count.selected_fraction == pytest.approx(float((torch.clamp(n, max=8) / n).mean()))
    assert count.to_dict()["k"] == 8 and isinstance(count.to_dict()["k"], int)
    ex = perplexity(model, ids, MethodSpec("e", "exact_topk", k=0.25, gqa_select="kv"))
    assert ex.score_fraction == 0.5 and ex.selected_fraction == pytest.approx(shared)
    assert ex.bytes_fraction == pytest.approx(0.5 + shared / 2)  # every key to score, then the selected values
    assert bytes_fractions("pcaattn", 0.25, 64, None) == {"score_fraction": 0.125, "selected_fraction": None,
                                                          "bytes_fraction": 0.625}
    assert bytes_fractions("loki", 16, 64, None)["bytes_fraction"] is None
    with pytest.raises(ValueError, match="aggregate"):
        MethodSpec("x", "loki", basis="b", aggregate="mean")
    with pytest.raises(ValueError, match="k"):
        MethodSpec("x", "loki", basis="b", k=0)


def test_per_row_counts_are_checked_by_name():
    from loki.reference import select_topk, sparse_attention

    s = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match=r"counts must have shape \[B\]=\[1\] or \[B, H\]=\[1, 2\], got \[1, 3\]"):
        select_topk(s, torch.tensor([[1, 2, 3]]))
    with pytest.raises(TypeError, match="counts must be an integer tensor"):
        select_topk(s, torch.tensor([[1.0, 2.0]]))
    idx = select_topk(s, torch.tensor([[1, 3]]))
    assert (idx[0, 0] >= 0).sum() == 1 and (idx[0, 1] >= 0).sum() == 3
    q, kc, v = torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"\[B, H\]=\[1, 2\], got \[1, 4\]"):
        sparse_attention(q, kc, v, idx, torch.tensor([[1, 3, 1, 3]]))
