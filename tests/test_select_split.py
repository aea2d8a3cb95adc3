"""The split select (``loki.kernels.select_split``: every row over many programs) against the reference.

CPU: the Triton interpreter on awkward shapes (S = 1, 97, 1025, 4099, 40000; k = 1, S and between; B 1 and 3;
H 1 and 8), small forced chunks (many programs per row) and candidate tiles (the looped final select), every
option, heavy ties, -0.0/+0.0, NaN, ragged -inf padding, poisoned outputs and workspace, the same sets as the
one-program-per-row select, and recorded launches replayed (``DecodePlan``, alone and in the decode step).
GPU (``-m gpu``): the production sizes (8 x 131072 and 64 x 32768 rows), ties at that size, a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

import loki.kernels.select_split as split_mod
import loki.reference as R
from loki.kernels import select_topk, select_topk_split
from loki.kernels.launch import DecodePlan, recording
from loki.kernels.select_split import split_launch_config, use_split_select
from loki.testing.inputs import score_rows
from loki.testing.invariants import assert_same_sets, check_selection

interp = pytest.mark.interpreter
gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every output and the workspace are allocated filled with a sentinel: an element read before it is
    written, or an output slot never written, fails."""
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", "1")


def _counts(k, valid):
    return torch.clamp(torch.full_like(valid, k), max=valid).clamp(min=1)


def _run(device, B, H, S, k, kind="randn", ragged=True, **opts):
    scores, valid = score_rows(B, H, S, kind, ragged)
    counts = _counts(k, valid)
    K = min(k, S)
    idx = select_topk_split(scores.to(device), counts.to(device), k_max=K, **opts)
    assert idx.dtype == torch.int32 and idx.shape == (B, H, K)
    assert_same_sets(idx, R.select_topk(scores, counts), counts)
    return scores, counts, idx


SHAPES = [
    pytest.param(1, 1, 1, 1, {}, id="S1"),
    pytest.param(3, 8, 97, 97, dict(chunk=16), id="B3-H8-S97-kS-chunk16"),
    pytest.param(3, 1, 97, 30, dict(chunk=32, cand_block=16), id="B3-H1-S97-k30-chunk32-cand16"),
    pytest.param(1, 8, 1025, 1, dict(chunk=128), id="B1-H8-S1025-k1-chunk128"),
    pytest.param(3, 1, 1025, 400, dict(chunk=256), id="B3-H1-S1025-k400-chunk256"),
    pytest.param(1, 1, 4099, 4099, dict(chunk=512), id="B1-H1-S4099-kS-chunk512"),
    pytest.param(3, 8, 4099, 700, dict(chunk=1024), id="B3-H8-S4099-k700-chunk1024"),
    pytest.param(1, 1, 40000, 2048, {}, id="B1-H1-S40000-k2048-default"),
    pytest.param(3, 1, 40000, 5000, dict(chunk=4096), id="B3-H1-S40000-k5000-chunk4096"),
]


@interp
@pytest.mark.parametrize("B,H,S,k,opts", SHAPES)
def test_split_select_equals_the_reference(triton_device, B, H, S, k, opts):
    scores, counts, idx = _run(triton_device, B, H, S, k, **opts)
    assert check_selection(idx, scores, counts) == B * H


@interp
@pytest.mark.parametrize("kind", ["halves", "equal", "narrow", "signed-zeros", "nan"])
@pytest.mark.parametrize("cand_block", [None, 64], ids=["cand-registers", "cand-tiles64"])
def test_split_select_ties_and_special_values(triton_device, kind, cand_block):
    """Heavy ties (the lowest positions win), all-equal rows, a range narrower than the resolved key bits
    (every score a candidate), -0.0 == +0.0, NaN above +inf; the final select in registers and in tiles."""
    for k in (1, 300, 1025):
        _run(triton_device, 3, 2, 1025, k, kind=kind, chunk=256, cand_block=cand_block)


@interp
def test_split_select_ties_straddling_the_budget(triton_device):
    """Many scores equal to the k-th largest, on both sides of the budget: exactly the lowest tied positions."""
    g = torch.Generator().manual_seed(5)
    B, H, S, k = 2, 3, 4099, 1000
    s = torch.randn(B, H, S, generator=g)
    kth = torch.topk(s, k, dim=-1).values[..., -1:]
    tie = torch.rand(B, H, S, generator=g) < 0.1
    s = torch.where(tie, kth.expand(-1, -1, S), s)
    counts = torch.tensor([k, 640])
    for opts in (dict(chunk=512), dict(chunk=1024, cand_block=128), dict(chunk=2048, bits=8)):
        idx = select_topk_split(s.to(triton_device), counts.to(triton_device), k_max=k, **opts)
        assert_same_sets(idx, R.select_topk(s, counts), counts)


@interp
@pytest.mark.parametrize("bits,levels", [(4, 2), (4, 3), (6, 1), (6, 3), (8, 2), (8, 4), (11, 2), (1, 5)])
def test_split_select_every_digit_layout(triton_device, bits, levels):
    """Any bits per level and number of level launches (levels * bits up to 32) select the same set."""
    _run(triton_device, 3, 2, 4099, 777, kind="halves", chunk=1024, bits=bits, levels=levels)
    _run(triton_device, 2, 1, 1025, 900, kind="randn", chunk=128, bits=bits, levels=levels, cand_block=32)


@interp
def test_split_select_matches_the_one_program_per_row_select(triton_device):
    """Where both apply (rows up to TRITON_SELECT_MAX_S): the same sets as method="triton"'s register select,
    and select_topk(method="split") is this select."""
    for kind in ("randn", "halves"):
        scores, valid = score_rows(3, 4, 4099, kind, True)
        counts = _counts(1500, valid)
        sc, cn = scores.to(triton_device), counts.to(triton_device)
        assert not use_split_select(4099, 12)  # so "triton" below is the register select
        reg = select_topk(sc, cn, k_max=1500, method="triton")
        spl = select_topk(sc, cn, k_max=1500, method="split", chunk=1024)
        assert reg.dtype == spl.dtype == torch.int32
        assert_same_sets(spl, reg.long(), counts)


@interp
def test_triton_method_follows_the_rule_unless_given_register_options(triton_device, monkeypatch):
    """method="triton" takes the split select where the rule says so, and the register select when one of its
    own options is given (for rows it can take)."""
    import loki.kernels.select as select_mod

    calls = []
    real = select_mod.select_topk_split
    monkeypatch.setattr(select_mod, "select_topk_split", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setitem(split_mod.SPLIT_RULE, "min_s", 64)
    scores, valid = score_rows(2, 2, 300, "halves", True)
    counts = _counts(50, valid)
    sc, cn = scores.to(triton_device), counts.to(triton_device)
    for opts, split in (({}, True), (dict(radix_bits=2), False), (dict(early_exit=False), False),
                        (dict(chunk=64), False), (dict(num_warps=4), False)):
        calls.clear()
        assert_same_sets(select_topk(sc, cn, k_max=50, method="triton", **opts), R.select_topk(scores, counts), counts)
        assert bool(calls) == split, opts


@interp
def test_triton_method_takes_the_split_select_for_long_rows(triton_device):
    """Rows longer than TRITON_SELECT_MAX_S: method="triton" no longer falls back to torch.topk (int32 output)."""
    scores, valid = score_rows(1, 2, 40000, "randn", False)
    counts = _counts(2048, valid)
    idx = select_topk(scores.to(triton_device), counts.to(triton_device), k_max=2048, method="triton")
    assert idx.dtype == torch.int32
    assert_same_sets(idx, R.select_topk(scores, counts), counts)


@interp
def test_split_select_into_out_and_clamped_counts(triton_device):
    """``out`` is filled in place; counts above k_max are clamped on the device, nothing written past a row."""
    B, H, S, K = 2, 3, 300, 40
    scores = torch.randn(B, H, S, generator=torch.Generator().manual_seed(3)).to(triton_device)
    buf = torch.full((B * H * K + 64,), 7777, dtype=torch.int32, device=triton_device)
    out = buf[: B * H * K].view(B, H, K)
    got = select_topk_split(scores, torch.tensor([100, 7]).to(triton_device), k_max=K, out=out, chunk=64)
    assert got is out and bool((buf[B * H * K:] == 7777).all())
    assert_same_sets(out, R.select_topk(scores.cpu(), torch.tensor([K, 7])), torch.tensor([K, 7]))


@interp
def test_split_select_converts_other_dtypes_and_strides(triton_device):
    """fp16/bf16 scores are selected as their fp32 values; a row stride other than 1 is made contiguous."""
    scores, valid = score_rows(2, 3, 517, "halves", True)
    counts = _counts(100, valid)
    for s in (scores.half(), scores.bfloat16(), scores.transpose(1, 2).contiguous().transpose(1, 2),
              scores.repeat_interleave(2, dim=-1)[..., ::2]):
        idx = select_topk_split(s.to(triton_device), counts.to(triton_device), k_max=100, chunk=128)
        assert_same_sets(idx, R.select_topk(s.float(), counts), counts)


@interp
def test_split_select_is_deterministic(triton_device):
    scores, valid = score_rows(2, 2, 1025, "halves", True)
    counts = _counts(333, valid).to(triton_device)
    a = select_topk_split(scores.to(triton_device), counts, k_max=333, chunk=128, cand_block=64)
    b = select_topk_split(scores.to(triton_device), counts, k_max=333, chunk=128, cand_block=64)
    assert torch.equal(a, b)


@interp
@pytest.mark.parametrize("poison", ["1", "0"])
def test_split_select_recorded_launches_replay(triton_device, poison, monkeypatch):
    """The launches recorded by ``launch.recording`` replay through ``DecodePlan`` on new scores and counts with
    fresh (poisoned or not) buffers, workspace included: no memset, no buffer outside the plan."""
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", poison)
    B, H, S, K = 2, 3, 1025, 300
    scores, valid = score_rows(B, H, S, "halves", True, seed=1)
    counts = _counts(K, valid).to(triton_device)
    sc = scores.to(triton_device)  # one tensor: a plan finds its inputs by identity
    with recording() as rec:
        idx = select_topk_split(sc, counts, k_max=K, chunk=256, cand_block=64)
    plan = DecodePlan(rec.launches, (sc, counts), rec.buffers)
    assert plan.ok and len(plan.launches) == 3 and len(plan.buffers) == 2
    ret = [id(b) for b in rec.buffers].index(id(idx))
    for seed in (2, 3):
        s2, v2 = score_rows(B, H, S, "randn" if seed == 2 else "narrow", True, seed=seed)
        c2 = torch.minimum(_counts(K, v2), torch.tensor([K, 17]))
        got = plan((s2.to(triton_device), c2.to(triton_device)))[ret]
        assert_same_sets(got, R.select_topk(s2, c2), c2)


@interp
def test_decode_step_records_and_replays_the_split_select(triton_device, monkeypatch):
    """With the rule forced to the split select, the decode step's recorded plan holds its launches and every
    replay equals the reference attention of its own inputs."""
    from loki.reference.methods import loki_attention
    from loki.testing.decode import kernel_run
    from loki.testing.inputs import make_decode_inputs

    monkeypatch.setitem(split_mod.SPLIT_RULE, "min_s", 1)
    B, HQ, HKV, S, D, d, K = 1, 4, 2, 300, 32, 8, 75
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=torch.float32, device=triton_device, seed=4)
    counts = torch.full((B,), K, dtype=torch.int32, device=triton_device)
    run = kernel_run(x.q, x.k_cache, d=d, gqa_select="query", aggregate="sum")
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        q = torch.randn(x.q.shape, generator=g).to(triton_device)
        idx, res = run.step(q_hat=q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=None, lengths=x.lengths,
                            starts=x.starts, counts=counts, width=K, return_indices=True)
        want = loki_attention(q, x.k_cache, x.v_cache, d=d, counts=counts.long(), lengths=x.lengths,
                              starts=x.starts, gqa_select="query", aggregate="sum")
        torch.testing.assert_close(res, want, rtol=1e-4, atol=1e-4)
        assert bool(((idx >= 0).sum(-1) == K).all())
    plans = [p for p in run._plans.values() if p]
    assert len(plans) == 1
    assert "_split_compact_kernel" in [launch[0].__name__ for launch in plans[0].launches]


def test_split_rule():
    """Few rows (fewer than the multiprocessors) of 8K keys or more, or rows longer than the register select."""
    assert use_split_select(131072, 8, 132) and use_split_select(131072, 4096, 132)
    assert use_split_select(32768, 64, 132) and use_split_select(16384, 40, 132)
    assert use_split_select(8192, 131, 132) and not use_split_select(8192, 132, 132)
    assert not use_split_select(32768, 640, 132) and not use_split_select(4096, 8, 132)
    assert use_split_select(40000, 1, 132, max_register_s=32768)


def test_split_launch_config(monkeypatch):
    """On a GPU (132 SMs): about 4 programs per SM within the chunk range, a warp per 512 chunk elements, the
    per-chunk histograms within one tile."""
    monkeypatch.setattr(split_mod, "interpreting", lambda: False)
    assert split_launch_config(131072, 8, 132)["chunk"] == 2048
    assert split_launch_config(32768, 64, 132)["chunk"] == 4096
    for S, rows in ((1, 1), (97, 3), (131072, 8), (131072, 32), (32768, 64), (1 << 21, 1), (4096, 640)):
        cfg = split_launch_config(S, rows, 132)
        chunk = cfg["chunk"]
        assert chunk & (chunk - 1) == 0 and 16 <= chunk <= max(16, triton_p2(S))
        assert max(16, triton_p2(-(-S // chunk))) << cfg["bits"] <= split_mod._MAX_HIST_TILE
        assert 4 <= cfg["num_warps"] <= cfg["compact_warps"] <= 16 and cfg["levels"] * cfg["bits"] <= 32


def triton_p2(n):
    return 1 << max(0, int(n) - 1).bit_length()


@interp
def test_split_select_refuses_bad_options(triton_device):
    s = torch.randn(1, 1, 64, device=triton_device)
    c = torch.tensor([4], device=triton_device)
    for opts, match in ((dict(bits=0), "bits"), (dict(bits=12), "bits"), (dict(bits=8, levels=5), "levels"),
                        (dict(chunk=48), "chunk"), (dict(cand_block=8), "cand_block"),
                        (dict(k_max=65), "k_max"), (dict(k_max=0), "k_max")):
        with pytest.raises(ValueError, match=match):
            select_topk_split(s, c, **opts)
    with pytest.raises(ValueError, match="shape"):
        select_topk_split(s[0], c)
    with pytest.raises(ValueError, match="out must be"):
        select_topk_split(s, c, out=torch.empty(1, 1, 4, dtype=torch.int64, device=triton_device))
    with pytest.raises(ValueError, match="too many chunks"):
        select_topk_split(torch.zeros(1, 1, 20000, device=triton_device), c, chunk=16)
    assert select_topk_split(s[:0], c[:0]).shape == (0, 1, 0)


# ------------------------------------------------------------------------------------------------ GPU
GPU_SIZES = [
    pytest.param(1, 8, 131072, 2048, id="B1-H8-S131072-k2048"),
    pytest.param(1, 32, 131072, 2048, id="B1-H32-S131072-k2048"),
    pytest.param(1, 64, 32768, 2048, id="64rows-S32768-k2048"),
    pytest.param(1, 64, 32768, 8192, id="64rows-S32768-k8192"),
    pytest.param(3, 5, 65537, 3000, id="B3-H5-S65537-k3000-ragged"),
]


@gpu
@pytest.mark.parametrize("B,H,S,k", GPU_SIZES)
@pytest.mark.parametrize("kind", ["randn", "halves", "narrow"])
def test_gpu_split_select_at_production_sizes(B, H, S, k, kind):
    scores, valid = score_rows(B, H, S, kind, True)
    counts = _counts(k, valid)
    dev = torch.device("cuda")
    idx = select_topk(scores.to(dev), counts.to(dev), k_max=k, method="triton")  # the rule picks the split
    assert_same_sets(idx, R.select_topk(scores.to(dev), counts.to(dev)), counts)
    for opts in (dict(chunk=1024), dict(chunk=8192, bits=8), dict(bits=4, levels=3), dict(cand_block=256),
                 dict(cand_block=2048)):
        assert_same_sets(select_topk_split(scores.to(dev), counts.to(dev), k_max=k, **opts),
                   R.select_topk(scores.to(dev), counts.to(dev)), counts)


@gpu
def test_gpu_split_select_equals_the_register_select():
    from loki.kernels.select import _select_triton

    dev = torch.device("cuda")
    for B, H, S, k in ((1, 8, 32768, 2048), (2, 20, 16384, 4096), (1, 8, 8192, 8192)):
        scores, valid = score_rows(B, H, S, "halves", True)
        counts = _counts(k, valid).to(dev)
        reg = _select_triton(scores.to(dev), counts, k, None)
        assert_same_sets(select_topk_split(scores.to(dev), counts, k_max=k), reg.long(), counts)


@gpu
def test_gpu_split_select_in_a_cuda_graph():
    """Captured once, replayed on new scores and counts written into the captured inputs."""
    dev = torch.device("cuda")
    B, H, S, k = 1, 8, 131072, 2048
    scores, valid = score_rows(B, H, S, "randn", False)
    sc, cn = scores.to(dev), _counts(k, valid).to(dev)
    select_topk_split(sc, cn, k_max=k)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx = select_topk_split(sc, cn, k_max=k)
    for seed, kind in ((1, "randn"), (2, "halves"), (3, "narrow")):
        s2, _ = score_rows(B, H, S, kind, False, seed=seed)
        sc.copy_(s2.to(dev))
        cn.fill_(k - seed)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_sets(idx, R.select_topk(sc, cn), cn.cpu())
