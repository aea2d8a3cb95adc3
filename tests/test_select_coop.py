"""The row-barrier select (``loki.kernels.select_coop``: a row's programs meet at barriers in one launch) against
the reference.

CPU: the Triton interpreter runs the phased form (one launch per level, every program replaying the earlier
levels' reductions from the stored histograms): awkward shapes, many programs per row (small forced chunks),
every digit width, heavy ties straddling the budget, -0.0/+0.0, NaN, ragged -inf padding, poisoned outputs and
workspace, ``select_topk(method="triton")`` taking it where it fits, recorded launches replayed.
GPU (``-m gpu``): the one-launch form with its barriers at the production sizes (8 x 131072 and 64 x 32768 rows),
equal to the phased form and the split select, in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

import loki.kernels.select as select_mod
import loki.reference as R
from loki.kernels import select_topk, select_topk_coop, select_topk_split
from loki.kernels.launch import DecodePlan, recording
from loki.kernels.select_coop import coop_launch_config, use_coop_select
from loki.testing.inputs import score_rows
from loki.testing.invariants import assert_same_sets, check_selection

interp = pytest.mark.interpreter
gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", "1")


def _counts(k, valid):
    return torch.clamp(torch.full_like(valid, k), max=valid).clamp(min=1)


def _run(device, B, H, S, k, kind="randn", ragged=True, **opts):
    scores, valid = score_rows(B, H, S, kind, ragged)
    counts = _counts(k, valid)
    K = min(k, S)
    idx = select_topk_coop(scores.to(device), counts.to(device), k_max=K, **opts)
    assert idx.dtype == torch.int32 and idx.shape == (B, H, K)
    assert_same_sets(idx, R.select_topk(scores, counts), counts)
    return scores, counts, idx


SHAPES = [
    pytest.param(1, 1, 1, 1, {}, id="S1"),
    pytest.param(3, 8, 97, 97, dict(chunk=32), id="B3-H8-S97-kS-chunk32"),
    pytest.param(1, 2, 97, 50, dict(chunk=16), id="B1-H2-S97-k50-chunk16"),
    pytest.param(3, 1, 97, 30, dict(chunk=32), id="B3-H1-S97-k30-chunk32"),
    pytest.param(1, 8, 1025, 1, dict(chunk=128), id="B1-H8-S1025-k1-chunk128"),
    pytest.param(3, 1, 1025, 400, dict(chunk=64), id="B3-H1-S1025-k400-chunk64-17programs"),
    pytest.param(1, 1, 4099, 4099, dict(chunk=512), id="B1-H1-S4099-kS-chunk512"),
    pytest.param(3, 8, 4099, 700, dict(chunk=1024), id="B3-H8-S4099-k700-chunk1024"),
    pytest.param(1, 1, 40000, 2048, {}, id="B1-H1-S40000-k2048-default"),
    pytest.param(2, 1, 40000, 5000, dict(chunk=2048), id="B2-H1-S40000-k5000-chunk2048-20programs"),
]


@interp
@pytest.mark.parametrize("B,H,S,k,opts", SHAPES)
def test_coop_select_equals_the_reference(triton_device, B, H, S, k, opts):
    scores, counts, idx = _run(triton_device, B, H, S, k, **opts)
    assert check_selection(idx, scores, counts) == B * H


@interp
@pytest.mark.parametrize("kind", ["halves", "equal", "narrow", "signed-zeros", "nan"])
def test_coop_select_ties_and_special_values(triton_device, kind):
    """Heavy ties (the lowest positions win), all-equal rows (ties at the full key), a range narrower than
    a level's bits, -0.0 == +0.0, NaN above +inf."""
    for k in (1, 300, 1025):
        _run(triton_device, 3, 2, 1025, k, kind=kind, chunk=256)


@interp
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_coop_select_every_digit_width(triton_device, bits):
    _run(triton_device, 2, 2, 1025, 333, kind="halves", chunk=256, bits=bits)
    _run(triton_device, 2, 1, 1025, 900, kind="randn", chunk=128, bits=bits)


@interp
def test_coop_select_ties_straddling_the_budget(triton_device):
    """Many scores equal to the k-th largest, on both sides of the budget and of the programs' chunks."""
    g = torch.Generator().manual_seed(5)
    B, H, S, k = 2, 3, 4099, 1000
    s = torch.randn(B, H, S, generator=g)
    kth = torch.topk(s, k, dim=-1).values[..., -1:]
    s = torch.where(torch.rand(B, H, S, generator=g) < 0.1, kth.expand(-1, -1, S), s)
    counts = torch.tensor([k, 640])
    for chunk in (256, 1024, 8192):
        idx = select_topk_coop(s.to(triton_device), counts.to(triton_device), k_max=k, chunk=chunk)
        assert_same_sets(idx, R.select_topk(s, counts), counts)


@interp
def test_coop_select_order_and_determinism(triton_device):
    """The selected keys above the final prefix in ascending position, then the equal ones ascending; two calls
    write the same indices."""
    scores, valid = score_rows(2, 2, 1025, "halves", True)
    counts = _counts(333, valid).to(triton_device)
    a = select_topk_coop(scores.to(triton_device), counts, k_max=333, chunk=128)
    b = select_topk_coop(scores.to(triton_device), counts, k_max=333, chunk=128)
    assert torch.equal(a, b)
    row = a[0, 0, : int(counts[0])].long().cpu()
    vals = scores[0, 0, row]
    kth = vals.min()
    above, tied = row[vals > kth], row[vals == kth]
    assert torch.equal(row, torch.cat([above, tied])) and bool((above.diff() > 0).all())
    assert bool((tied.diff() > 0).all())


@interp
def test_coop_select_into_out_and_clamped_counts(triton_device):
    B, H, S, K = 2, 3, 300, 40
    scores = torch.randn(B, H, S, generator=torch.Generator().manual_seed(3)).to(triton_device)
    buf = torch.full((B * H * K + 64,), 7777, dtype=torch.int32, device=triton_device)
    out = buf[: B * H * K].view(B, H, K)
    got = select_topk_coop(scores, torch.tensor([100, 7]).to(triton_device), k_max=K, out=out, chunk=64)
    assert got is out and bool((buf[B * H * K:] == 7777).all())
    assert_same_sets(out, R.select_topk(scores.cpu(), torch.tensor([K, 7])), torch.tensor([K, 7]))


@interp
def test_coop_select_converts_other_dtypes_and_strides(triton_device):
    scores, valid = score_rows(2, 3, 517, "halves", True)
    counts = _counts(100, valid)
    for s in (scores.half(), scores.bfloat16(), scores.transpose(1, 2).contiguous().transpose(1, 2)):
        idx = select_topk_coop(s.to(triton_device), counts.to(triton_device), k_max=100, chunk=128)
        assert_same_sets(idx, R.select_topk(s.float(), counts), counts)


@interp
def test_triton_method_takes_the_coop_select_where_it_fits(triton_device, monkeypatch):
    """Few long rows: method="triton" runs this select (not the multi-launch split select); rows that cannot
    be resident at once, or COOP_DEFAULTS["enabled"] False, take the split select."""
    calls = []
    real_coop, real_split = select_mod.select_topk_coop, select_mod.select_topk_split
    monkeypatch.setattr(select_mod, "select_topk_coop", lambda *a, **kw: calls.append("coop") or real_coop(*a, **kw))
    monkeypatch.setattr(select_mod, "select_topk_split",
                        lambda *a, **kw: calls.append("split") or real_split(*a, **kw))
    scores, valid = score_rows(1, 2, 40000, "randn", False)
    counts = _counts(2048, valid)
    sc, cn = scores.to(triton_device), counts.to(triton_device)
    assert use_coop_select(40000, 2)
    assert_same_sets(select_topk(sc, cn, k_max=2048, method="triton"), R.select_topk(scores, counts), counts)
    assert calls == ["coop"]
    calls.clear()
    assert_same_sets(select_topk(sc, cn, k_max=2048, method="coop"), R.select_topk(scores, counts), counts)
    assert calls == ["coop"]
    calls.clear()
    monkeypatch.setitem(select_mod.COOP_DEFAULTS, "enabled", False)
    assert_same_sets(select_topk(sc, cn, k_max=2048, method="triton"), R.select_topk(scores, counts), counts)
    assert calls == ["split"]


@interp
@pytest.mark.parametrize("poison", ["1", "0"])
def test_coop_select_recorded_launches_replay(triton_device, poison, monkeypatch):
    """Recorded launches replay through ``DecodePlan`` on new scores and counts with fresh buffers."""
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", poison)
    B, H, S, K = 2, 3, 1025, 300
    scores, valid = score_rows(B, H, S, "halves", True, seed=1)
    counts = _counts(K, valid).to(triton_device)
    sc = scores.to(triton_device)
    with recording() as rec:
        idx = select_topk_coop(sc, counts, k_max=K, chunk=256)
    plan = DecodePlan(rec.launches, (sc, counts), rec.buffers)
    launches = 5 if triton_device.type == "cpu" else 2  # phased: 4 levels + compaction; else init + select
    assert plan.ok and len(plan.launches) == launches and len(plan.buffers) == 2
    ret = [id(b) for b in rec.buffers].index(id(idx))
    for seed in (2, 3):
        s2, v2 = score_rows(B, H, S, "randn" if seed == 2 else "narrow", True, seed=seed)
        c2 = torch.minimum(_counts(K, v2), torch.tensor([K, 17]))
        got = plan((s2.to(triton_device), c2.to(triton_device)))[ret]
        assert_same_sets(got, R.select_topk(s2, c2), c2)


def test_coop_launch_config():
    """One program per multiprocessor: 8 rows of 131072 on 132 SMs -> 16 programs of 8192; 64 rows of 32768 ->
    2 of 16384; rows that cannot all be resident (or would need chunks over max_chunk) -> None."""
    import loki.kernels.select_coop as coop

    if coop.interpreting():
        pytest.skip("the interpreter raises the chunk")
    c = coop_launch_config(131072, 8, 132)
    assert (c["programs"], c["chunk"], c["levels"]) == (16, 8192, 4)
    c = coop_launch_config(32768, 64, 132)
    assert (c["programs"], c["chunk"]) == (2, 16384)
    assert coop_launch_config(32768, 133, 132) is None
    assert coop_launch_config(1 << 20, 8, 132) is None
    assert coop_launch_config(131072, 8, 132, chunk=1024) is None  # 128 programs > 16 per row


@interp
def test_coop_select_refuses_bad_options(triton_device):
    s = torch.randn(1, 1, 64, device=triton_device)
    c = torch.tensor([4], device=triton_device)
    for opts, match in ((dict(bits=3), "bits"), (dict(chunk=48), "chunk"), (dict(max_sms=0), "max_sms"),
                        (dict(k_max=65), "k_max"), (dict(k_max=0), "k_max")):
        with pytest.raises(ValueError, match=match):
            select_topk_coop(s, c, **opts)
    with pytest.raises(ValueError, match="shape"):
        select_topk_coop(s[0], c)
    with pytest.raises(ValueError, match="out must be"):
        select_topk_coop(s, c, out=torch.empty(1, 1, 4, dtype=torch.int64, device=triton_device))
    with pytest.raises(ValueError, match="resident"):
        select_topk_coop(torch.zeros(1, 1, 20000, device=triton_device), c, chunk=16)
    assert select_topk_coop(s[:0], c[:0]).shape == (0, 1, 0)


# ------------------------------------------------------------------------------------------------ GPU
GPU_SIZES = [
    pytest.param(1, 8, 131072, 2048, id="B1-H8-S131072-k2048"),
    pytest.param(1, 32, 131072, 2048, id="B1-H32-S131072-k2048"),
    pytest.param(1, 64, 32768, 2048, id="64rows-S32768-k2048"),
    pytest.param(1, 64, 32768, 8192, id="64rows-S32768-k8192"),
    pytest.param(3, 5, 65537, 3000, id="B3-H5-S65537-k3000-ragged"),
    pytest.param(1, 1, 1000, 999, id="B1-H1-S1000"),
]


@gpu
@pytest.mark.parametrize("B,H,S,k", GPU_SIZES)
@pytest.mark.parametrize("kind", ["randn", "halves", "narrow", "equal"])
def test_gpu_coop_select_at_production_sizes(B, H, S, k, kind):
    """The one-launch form equals the reference, the phased form (same indices, same order) and the split
    select's set, for every digit width and two programs per SM."""
    scores, valid = score_rows(B, H, S, kind, True)
    counts = _counts(k, valid)
    dev = torch.device("cuda")
    sc, cn = scores.to(dev), counts.to(dev)
    ref = R.select_topk(sc, cn)
    idx = select_topk(sc, cn, k_max=k, method="triton")
    assert_same_sets(idx, ref, counts)
    if not use_coop_select(S, B * H, torch.cuda.get_device_properties(0).multi_processor_count):
        pytest.skip(f"{B * H} rows of {S} do not fit one resident grid (the split select ran above)")
    one = select_topk_coop(sc, cn, k_max=k)
    assert torch.equal(one, select_topk_coop(sc, cn, k_max=k, phased=True))
    assert_same_sets(select_topk_split(sc, cn, k_max=k), one.long(), counts)
    for opts in (dict(bits=4), dict(bits=2), dict(max_sms=64)):
        assert_same_sets(select_topk_coop(sc, cn, k_max=k, **opts), ref, counts)


@gpu
def test_gpu_coop_select_in_a_cuda_graph_many_replays():
    """Captured once, replayed many times on new scores and counts (the barrier counters are zeroed per call)."""
    dev = torch.device("cuda")
    B, H, S, k = 1, 8, 131072, 2048
    scores, valid = score_rows(B, H, S, "randn", False)
    sc, cn = scores.to(dev), _counts(k, valid).to(dev)
    select_topk_coop(sc, cn, k_max=k)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx = select_topk_coop(sc, cn, k_max=k)
    for seed, kind in ((1, "randn"), (2, "halves"), (3, "narrow"), (4, "equal")):
        s2, _ = score_rows(B, H, S, kind, False, seed=seed)
        sc.copy_(s2.to(dev))
        cn.fill_(k - seed)
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        assert_same_sets(idx, R.select_topk(sc, cn), cn.cpu())
