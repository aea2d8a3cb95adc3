"""The fused score + select kernel (``loki.kernels.score_select``) against the references, and the decode
step with and without it.

CPU: the Triton interpreter on small awkward shapes (odd S, ragged and left-padded batches, GQA groups,
both aggregates, the key-prefix buffer, forced chunked compaction); GPU (``-m gpu``): the shapes where the
decode step picks the fused kernel by default, and programmatic dependent launch on/off.
"""

from __future__ import annotations

import pytest
import torch

import loki.reference as R
from loki.kernels import make_key_prefix, score_select
from loki.kernels.decode import DecodeTuning
from loki.kernels.score_select import FUSED_DEFAULTS, score_select_fusable
from loki.testing.decode import kernel_run, kernel_step
from loki.testing.inputs import make_decode_inputs
from loki.testing.invariants import check_selection

interp = pytest.mark.interpreter
gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", "1")


CASES = [
    # B, HQ, HKV, S, D, d, mode, aggregate, k, prefix, chunk
    pytest.param(1, 2, 2, 1, 64, 16, "query", "sum", 1, False, None, id="S1"),
    pytest.param(3, 6, 2, 97, 96, 24, "query", "sum", "S", True, None, id="S97-G3-query-kS-prefix"),
    pytest.param(2, 8, 2, 1100, 64, 16, "kv", "sum", 0.25, False, 256, id="S1100-G4-kv-sum-chunk256"),
    pytest.param(3, 6, 2, 517, 32, 8, "kv", "max", 0.3, True, None, id="S517-G3-kv-max-prefix"),
    pytest.param(2, 4, 4, 700, 128, 32, "query", "sum", 1, True, 64, id="S700-mha-k1-chunk64"),
]


@interp
@pytest.mark.parametrize("B,HQ,HKV,S,D,d,mode,aggregate,k,prefix,chunk", CASES)
def test_score_select_matches_references(triton_device, B, HQ, HKV, S, D, d, mode, aggregate, k, prefix, chunk):
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=torch.float32, device=triton_device, ragged=True,
                           left_pad=True, seed=S)
    k = S if k == "S" else k
    counts = R.budget(k, x.lengths, x.starts, B, S, triton_device)
    K = int(counts.max())
    src = make_key_prefix(x.k_cache, d) if prefix else x.k_cache
    scores, idx = score_select(x.q, src, d, x.lengths, x.starts, counts, K, gqa_select=mode, aggregate=aggregate,
                               chunk=chunk)
    ref = R.approx_scores(x.q.double(), x.k_cache.double(), d, x.lengths, x.starts, gqa_select=mode,
                          aggregate=aggregate, compute_dtype=torch.float64)
    assert scores.shape == ref.shape and idx.shape == (B, ref.shape[1], K) and idx.dtype == torch.int32
    assert torch.equal(torch.isneginf(scores), torch.isneginf(ref)), "-inf outside the valid tokens"
    fin = torch.isfinite(ref)
    err = (scores.double()[fin] - ref[fin]).abs().max().item()
    assert err <= 1e-5 * max(1.0, ref[fin].abs().max().item())
    slack = 1e-5 * max(1.0, ref[fin].abs().max().item())
    assert check_selection(idx, ref, counts, slack=slack) == B * ref.shape[1]


@interp
@pytest.mark.parametrize("mode", ["query", "kv"])
def test_decode_step_fused_equals_two_kernels(triton_device, mode):
    """The decode step gives the same selection and output with the fused kernel as with two kernels, and
    its recorded host path replays the fused launch."""
    B, HQ, HKV, S, D, d = 2, 8, 2, 333, 64, 16
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=torch.float32, device=triton_device, ragged=True,
                           left_pad=True, seed=7)
    counts = R.budget(0.25, x.lengths, x.starts, B, S, triton_device)
    K = int(counts.max())
    runs = [kernel_run(x.q, x.k_cache, d=d, gqa_select=mode, aggregate="sum", tuning=DecodeTuning(fuse_select=f))
            for f in (True, False)]
    kw = dict(k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=None, lengths=x.lengths, starts=x.starts, counts=counts,
              width=K, return_indices=True)
    for _step in range(3):  # the first call records a plan, the later ones replay it
        q = torch.randn_like(x.q)
        i1, o1 = runs[0].step(q_hat=q, **kw)
        i2, o2 = runs[1].step(q_hat=q, **kw)
        assert torch.equal(torch.sort(i1, -1).values, torch.sort(i2, -1).values)
        assert not torch.isnan(o1).any() and (o1 - o2).abs().max().item() < 1e-5


@interp
@pytest.mark.parametrize("change,name", [(dict(K=0), "K"), (dict(K=99), "K"), (dict(d=17), "d"),
                                         (dict(gqa_select="heads"), "gqa_select"),
                                         (dict(aggregate="mean"), "aggregate")])
def test_score_select_bad_arguments_are_named(triton_device, change, name):
    x = make_decode_inputs(1, 4, 2, 64, 16, dtype=torch.float32, device=triton_device)
    counts = torch.full((1,), 8, dtype=torch.int32, device=triton_device)
    kw = dict(d=4, K=8, gqa_select="query", aggregate="sum") | change
    with pytest.raises(ValueError, match=name):
        score_select(x.q, x.k_cache, kw["d"], x.lengths, x.starts, counts, kw["K"], gqa_select=kw["gqa_select"],
                     aggregate=kw["aggregate"])


def test_fused_rule():
    """Fused when the rows fill the GPU and rows are not too long (one program per row)."""
    dev = torch.device("cpu")  # 132 multiprocessors assumed off the GPU
    assert score_select_fusable(640, 4096, dev)
    assert score_select_fusable(128, 8192, dev)
    assert not score_select_fusable(40, 16384, dev)  # B=1: one SM per row would be too slow
    assert not score_select_fusable(640, FUSED_DEFAULTS["max_s"] * 2, dev)


def _gpu_case(B, HQ, HKV, S, mode, seed=0):
    dev = torch.device("cuda")
    x = make_decode_inputs(B, HQ, HKV, S, 128, dtype=torch.bfloat16, device=dev, ragged=True, left_pad=True,
                           seed=seed)
    counts = R.budget(0.25, x.lengths, x.starts, B, S, dev)
    return x, counts, int(counts.max()), make_key_prefix(x.k_cache, 32)


@gpu
@pytest.mark.parametrize("B,HQ,HKV,S,mode", [(16, 40, 40, 4096, "query"), (16, 32, 8, 8192, "kv"),
                                             (8, 32, 8, 4099, "query")])
def test_gpu_fused_decode_step(B, HQ, HKV, S, mode):
    x, counts, K, kp = _gpu_case(B, HQ, HKV, S, mode, seed=S)
    s64 = R.approx_scores(x.q.double(), x.k_cache.double(), 32, x.lengths, x.starts, gqa_select=mode,
                          compute_dtype=torch.float64, aggregate="sum")
    slack = 1e-4 * s64[torch.isfinite(s64)].abs().max().item()
    for fuse in (True, False):
        idx, out = kernel_step(x.q, x.k_cache, x.v_cache, x.lengths, x.starts, counts, d=32, k_max=K,
                               gqa_select=mode, aggregate="sum", k_prefix=kp, tuning=DecodeTuning(fuse_select=fuse))
        torch.cuda.synchronize()
        assert check_selection(idx, s64, counts, slack=slack) == idx.shape[0] * idx.shape[1]
        assert not torch.isnan(out).any()
        if fuse:
            first = out
        else:
            assert (first.float() - out.float()).abs().max().item() < 2e-2


@gpu
@pytest.mark.parametrize("mode,HQ,HKV", [("query", 40, 40), ("kv", 32, 8)])
def test_gpu_programmatic_dependent_launch(mode, HQ, HKV):
    """LOKI_PDL=1 (griddepcontrol waits in every decode kernel) gives the same results as without."""
    import loki.kernels.launch as L

    x, counts, K, kp = _gpu_case(4, HQ, HKV, 4096, mode, seed=1)
    kw = dict(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, k_prefix=kp, lengths=x.lengths, starts=x.starts,
              counts=counts, width=K, return_indices=True)
    results = []
    old = L.PDL
    try:
        for flag in (False, True):
            L.PDL = flag
            run = kernel_run(x.q, x.k_cache, d=32, gqa_select=mode, aggregate="sum")
            for _step in range(3):
                results.append((flag, run.step(**kw)))
            torch.cuda.synchronize()
    finally:
        L.PDL = old
    ref_idx, ref_out = results[0][1]
    for _flag, (idx, out) in results[1:]:
        assert torch.equal(idx, ref_idx) and torch.equal(out, ref_out)


def test_attention_split_rule():
    """Splits of the one-head attention path (measured on an H100, docs/kernels.md): 3 when the rows alone
    give every SM at least 4 programs, otherwise at least 4 and enough for 2 programs per SM."""
    from loki.kernels.sparse_attention import ATTN_DEFAULTS, choose_num_splits

    sp = ATTN_DEFAULTS["head"]["splits"]
    assert choose_num_splits(640, 1024, 32, num_sms=132, **sp) == 3  # B=16, 40 heads
    assert choose_num_splits(160, 4096, 32, num_sms=132, **sp) == 4  # B=4
    assert choose_num_splits(40, 4096, 32, num_sms=132, **sp) == 7  # B=1
    assert choose_num_splits(40, 64, 32, num_sms=132, **sp) == 1  # too little work to split
