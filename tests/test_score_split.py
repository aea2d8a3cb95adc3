"""Scores and the split select's first level in one kernel (``loki.kernels.score_split``): the same scores as
``approx_scores`` and the same indices, element for element, as the split select run on those scores.

CPU: the Triton interpreter (odd S, ragged and left-padded batches, GQA groups, both aggregates, the key-prefix
buffer, small chunks so that rows span several programs); GPU (``-m gpu``): Llama-3-8B attention shapes.
"""

from __future__ import annotations

import pytest
import torch

import loki.reference as R
from loki.kernels import approx_scores, make_key_prefix, select_topk_split
from loki.kernels.score_split import score_select_split
from loki.testing.inputs import make_decode_inputs


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", "1")


CASES = [
    # B, HQ, HKV, S, D, d, mode, aggregate, k, prefix, chunk
    pytest.param(1, 2, 2, 1, 64, 16, "query", "sum", 1, False, None, id="S1"),
    pytest.param(3, 6, 2, 97, 96, 24, "query", "sum", "S", True, 32, id="S97-G3-query-kS-prefix-chunk32"),
    pytest.param(2, 8, 2, 1100, 64, 16, "kv", "sum", 0.25, False, 256, id="S1100-G4-kv-sum-chunk256"),
    pytest.param(3, 6, 2, 517, 32, 8, "kv", "max", 0.3, True, 128, id="S517-G3-kv-max-prefix-chunk128"),
    pytest.param(2, 4, 4, 700, 128, 32, "query", "sum", 1, True, 64, id="S700-mha-k1-chunk64"),
]


def _check(x, d, mode, aggregate, k, prefix, chunk, block_s=None):
    B, S = x.q.shape[0], x.k_cache.shape[2]
    counts = R.budget(S if k == "S" else k, x.lengths, x.starts, B, S, x.q.device)
    K = int(counts.max())
    src = make_key_prefix(x.k_cache, d) if prefix else x.k_cache
    scores, idx = score_select_split(x.q, src, d, x.lengths, x.starts, counts, K, gqa_select=mode,
                                     aggregate=aggregate, chunk=chunk, block_s=block_s)
    want_scores = approx_scores(x.q, x.k_cache, d, x.lengths, x.starts, gqa_select=mode, aggregate=aggregate)
    torch.testing.assert_close(scores, want_scores, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(scores), torch.isneginf(want_scores))
    want_idx = select_topk_split(scores, counts, k_max=K, chunk=chunk)
    assert torch.equal(idx, want_idx), "the split select's output, element for element"
    ref = R.select_topk(scores, counts)  # the reference's set (ties to the lowest position)
    assert _sets(idx) == _sets(ref)


def _sets(idx):
    return [sorted(v for v in row if v >= 0) for row in idx.reshape(-1, idx.shape[-1]).tolist()]


@pytest.mark.interpreter
@pytest.mark.parametrize("B,HQ,HKV,S,D,d,mode,aggregate,k,prefix,chunk", CASES)
def test_score_select_split_matches_scores_then_split_select(triton_device, B, HQ, HKV, S, D, d, mode, aggregate,
                                                             k, prefix, chunk):
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=torch.float32, device=triton_device, ragged=True,
                           left_pad=True, seed=S)
    _check(x, d, mode, aggregate, k, prefix, chunk, block_s=16 if chunk else None)


@pytest.mark.interpreter
def test_score_select_split_refuses_bad_arguments():
    x = make_decode_inputs(1, 4, 2, 64, 32, dtype=torch.float32)
    counts = torch.full((1,), 8)
    with pytest.raises(ValueError, match="aggregate"):
        score_select_split(x.q, x.k_cache, 8, x.lengths, x.starts, counts, 8, gqa_select="kv", aggregate="union")
    with pytest.raises(ValueError, match="K=65"):
        score_select_split(x.q, x.k_cache, 8, x.lengths, x.starts, counts, 65)
    with pytest.raises(ValueError, match="d=33"):
        score_select_split(x.q, x.k_cache, 33, x.lengths, x.starts, counts, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,k", [(1, 131072, 2048), (8, 32768, 2048), (1, 70001, 777)])
def test_gpu_score_select_split_llama3_shapes(B, S, k):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = make_decode_inputs(B, 32, 8, S, 128, dtype=torch.bfloat16, device="cuda", ragged=B > 1, left_pad=B > 1)
    _check(x, 32, "kv", "sum", k, True, None)
