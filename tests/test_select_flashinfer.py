"""``select_topk(method="flashinfer")`` (``loki.kernels.select_flashinfer``): FlashInfer's top-k behind the project's
selection semantics.

CPU (and CUDA with ``-m gpu``): without the package the method names it; ``import loki`` never imports it and
"auto" never picks it; the wrapper's own work (canonicalised copy, row layout, int32, -1 padding, counts below and
above K, ``out``) against the reference, with a stand-in ``flashinfer`` module whose ``top_k`` ranks scores as
FlashInfer's source does (raw bit order: -0.0 below +0.0, -NaN below -inf; ties to the lowest index; ``sorted``
by value then index, unsorted in a scrambled order).
GPU (``-m gpu``, where flashinfer imports): the real kernels' sets against the reference at 8 x 131072 and 64 x 32768
(k = 2048) on random rows, heavy ties, -0.0/+0.0, -inf tails with counts below K, and in a CUDA graph; NaN last.
"""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import loki.kernels.select_flashinfer as sf
import loki.reference as R
from loki.kernels import decode_attention, select_topk
from loki.kernels.select_flashinfer import FLASHINFER_MAX_K, flashinfer_topk_available, select_topk_flashinfer
from loki.testing.inputs import score_rows
from loki.testing.invariants import assert_same_sets

interp = pytest.mark.interpreter
gpu = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("LOKI_POISON_OUTPUTS", "1")


@pytest.fixture
def fresh_import():
    """The import of flashinfer is tried anew in the test, and again after it (the result is cached)."""
    sf._load.cache_clear()
    yield
    sf._load.cache_clear()


class _TieBreak(enum.IntEnum):
    NONE = 0
    SMALL = 1
    LARGE = 2


def _fake_module(calls: list, *, with_tie_break: bool = True) -> types.ModuleType:
    """A stand-in ``flashinfer`` whose ``top_k`` follows FlashInfer 0.6.13's source (``topk.cuh``): order by the raw
    bits (negatives bit-flipped, non-negatives with the sign bit set), lowest index first among equal keys
    (``tie_break=SMALL``), ``sorted=True``: value descending then index ascending; unsorted: a scrambled order."""
    mod = types.ModuleType("flashinfer")
    mod.__version__ = "0.0+stand-in"

    def top_k(input, k, sorted=False, deterministic=False, tie_break=0, dsa_graph_safe=False):
        calls.append(dict(shape=tuple(input.shape), k=k, sorted=sorted, deterministic=deterministic,
                          tie_break=int(tie_break)))
        assert input.dim() == 2 and input.dtype == torch.float32
        assert input.is_contiguous() and input.data_ptr() % 16 == 0, "FlashInfer's vector loads need aligned rows"
        assert deterministic and tie_break == _TieBreak.SMALL
        S = input.shape[1]
        bits = input.view(torch.int32).long() & 0xFFFFFFFF
        ordered = torch.where(bits >= 2**31, 0xFFFFFFFF - bits, bits + 2**31)  # FlashInfer's ToOrdered
        rev = 0xFFFFFFFF - torch.arange(S, device=input.device)
        key = ((ordered - 2**31) << 32) | rev  # a lower index: a larger key
        pos = 0xFFFFFFFF - (torch.topk(key, k, dim=-1, sorted=True).values & 0xFFFFFFFF)
        if not sorted:
            g = torch.Generator(device=input.device).manual_seed(len(calls))
            perm = torch.argsort(torch.rand(pos.shape, generator=g, device=input.device), dim=-1)
            pos = pos.gather(-1, perm)
        return input.gather(-1, pos), pos

    mod.top_k = top_k
    mod.topk = types.SimpleNamespace(TopKTieBreak=_TieBreak) if with_tie_break else types.SimpleNamespace()
    return mod


@pytest.fixture
def fake_flashinfer(monkeypatch, fresh_import):
    calls: list = []
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_module(calls))
    return calls


def _counts(k, valid):
    return torch.clamp(torch.full_like(valid, k), max=valid).clamp(min=1)


def _check(device, scores, counts, K, **kw):
    idx = select_topk(scores.to(device), counts.to(device), k_max=K, method="flashinfer", **kw)
    assert idx.dtype == torch.int32 and idx.shape == (*scores.shape[:2], K) and idx.device.type == device.type
    assert_same_sets(idx, R.select_topk(scores, counts), counts)
    return idx


# ------------------------------------------------------------------------------------------------ without it
def test_without_the_package_the_method_names_it(monkeypatch, fresh_import):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # ``import flashinfer`` raises ImportError
    assert not flashinfer_topk_available()
    scores = torch.randn(1, 2, 64)
    named = r"select_topk\(method='flashinfer'\) needs the flashinfer-python package"
    for s in (scores, scores[:0]):  # an empty batch too: the package is named before anything else
        with pytest.raises(ImportError, match=named):
            select_topk(s, torch.full((s.shape[0],), 4), k_max=4, method="flashinfer")
    assert select_topk(scores, torch.tensor([4]), method="torch").shape == (1, 2, 4)  # the other methods unchanged


def test_a_flashinfer_without_a_tie_rule_is_refused(monkeypatch, fresh_import):
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_module([], with_tie_break=False))
    assert not flashinfer_topk_available()
    with pytest.raises(ImportError, match="no top_k with a tie_break argument"):
        select_topk(torch.randn(1, 1, 64), torch.tensor([4]), method="flashinfer")


def test_import_loki_never_imports_flashinfer(tmp_path):
    """A ``flashinfer`` that fails on import lies on the path: loki, its kernels and the other select methods run."""
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise RuntimeError('flashinfer was imported')\n")
    code = ("import sys, torch, loki, loki.kernels\n"
            "from loki.kernels import select_topk\n"
            "idx = select_topk(torch.randn(1, 2, 50), torch.tensor([5]), method='auto')\n"
            "assert idx.shape == (1, 2, 5)\n"
            "assert 'flashinfer' not in sys.modules\n"
            "print(loki.kernels.flashinfer_topk_available())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == "False"  # tried only when asked, and refused with the import's error


def test_the_decode_step_does_not_take_the_method():
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match="select_method must be one of"):
        decode_attention(q, k, k, d=4, k=8, backend="torch", select_method="flashinfer")


# ------------------------------------------------------------------------------------------------ the wrapper
@interp
def test_auto_never_picks_flashinfer(triton_device, fake_flashinfer):
    scores, valid = score_rows(2, 2, 300, "randn", True)
    counts = _counts(40, valid)
    idx = select_topk(scores.to(triton_device), counts.to(triton_device), k_max=40, method="auto")
    assert_same_sets(idx, R.select_topk(scores, counts), counts)
    assert fake_flashinfer == []


@interp
@pytest.mark.parametrize("kind", ["randn", "halves", "equal", "narrow", "signed-zeros", "nan"])
@pytest.mark.parametrize("k", [1, 300, 1025])
def test_the_wrapper_selects_the_reference_set(triton_device, fake_flashinfer, kind, k):
    """Ragged rows (-inf tails, counts below K in the short batches), the sorted top-K cut at each count."""
    scores, valid = score_rows(3, 2, 1025, kind, True)
    counts = _counts(k, valid)
    _check(triton_device, scores, counts, k)
    assert fake_flashinfer[-1] == dict(shape=(6, 1025), k=k, sorted=True, deterministic=True, tie_break=1)


@interp
@pytest.mark.parametrize("kind", ["randn", "halves", "signed-zeros", "nan"])
def test_uniform_counts_take_the_unsorted_top_k(triton_device, fake_flashinfer, kind):
    scores, _ = score_rows(2, 3, 700, kind, False)
    counts = torch.full((2,), 250)
    _check(triton_device, scores, counts, 250, uniform=True)
    assert fake_flashinfer[-1]["sorted"] is False


@interp
def test_counts_below_and_above_the_width(triton_device, fake_flashinfer):
    scores, _ = score_rows(4, 2, 500, "halves", False)
    K = 120
    counts = torch.tensor([K, 40, 1, K + 7])  # a count above K keeps K (clamped, as the other methods)
    idx = select_topk(scores.to(triton_device), counts.to(triton_device), k_max=K, method="flashinfer")
    assert_same_sets(idx, R.select_topk(scores, counts.clamp(max=K)), counts.clamp(max=K))


@interp
@pytest.mark.parametrize("canonicalize", [True, False])
def test_strided_and_misaligned_scores(triton_device, fake_flashinfer, canonicalize):
    """Rows of a padded buffer (a row stride above S) and a contiguous view 4 bytes off a 16-byte boundary."""
    base, _ = score_rows(2, 2, 272, "randn", False)
    flat = torch.cat([torch.zeros(1), base.flatten()]).to(triton_device)
    views = [base.to(triton_device)[:, :, :250], flat[1:].view(2, 2, 272)]
    for scores in views:
        counts = torch.tensor([30, 9], device=triton_device)
        idx = select_topk_flashinfer(scores, counts, 30, canonicalize=canonicalize)
        assert_same_sets(idx, R.select_topk(scores.cpu(), counts.cpu()), counts.cpu())


@interp
def test_without_the_canonical_copy_flashinfer_orders_zeros_by_sign(triton_device, fake_flashinfer):
    """Why the copy: FlashInfer's bit order puts +0.0 above -0.0 (the project ties them, lowest position first)."""
    scores = torch.tensor([[[-0.0, 1.0, 0.0, -1.0]]], device=triton_device)
    counts = torch.tensor([2], device=triton_device)
    raw = select_topk_flashinfer(scores, counts, 2, canonicalize=False)
    exact = select_topk_flashinfer(scores, counts, 2)
    assert sorted(raw.flatten().tolist()) == [1, 2] and sorted(exact.flatten().tolist()) == [0, 1]


@interp
def test_out_and_argument_errors(triton_device, fake_flashinfer):
    scores, _ = score_rows(2, 2, 3000, "randn", False)
    scores = scores.to(triton_device)
    counts = torch.tensor([64, 20], device=triton_device)
    out = torch.empty(2, 2, 64, dtype=torch.int32, device=triton_device)
    assert select_topk(scores, counts, k_max=64, method="flashinfer", out=out) is out
    assert_same_sets(out, R.select_topk(scores.cpu(), counts.cpu()), counts.cpu())
    with pytest.raises(ValueError, match="out must be a contiguous int32"):
        select_topk(scores, counts, k_max=64, method="flashinfer", out=out.long())
    with pytest.raises(ValueError, match=f"k_max={FLASHINFER_MAX_K + 1} must lie in"):
        select_topk(scores, counts, k_max=FLASHINFER_MAX_K + 1, method="flashinfer")
    with pytest.raises(TypeError, match="fp32 scores"):
        select_topk(scores.half(), counts, k_max=64, method="flashinfer")
    with pytest.raises(ValueError, match="counts is on"):
        select_topk(scores, counts.cpu() if triton_device.type == "cuda" else counts.to("meta"), k_max=64,
                    method="flashinfer")
    assert select_topk(scores[:0], counts[:0], k_max=64, method="flashinfer").shape == (0, 2, 64)
    assert len(fake_flashinfer) == 1  # only the first call reached top_k


# ------------------------------------------------------------------------------------------------ GPU, real kernels
@pytest.fixture
def real_flashinfer(fresh_import):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    fi, why = sf._load()
    if fi is None:
        pytest.skip(f"flashinfer is not usable: {why}")
    return fi


GPU_SIZES = [
    pytest.param(2, 4, 131072, 2048, id="8rows-S131072-k2048"),
    pytest.param(8, 8, 32768, 2048, id="64rows-S32768-k2048"),
]


@gpu
@pytest.mark.parametrize("B,H,S,k", GPU_SIZES)
@pytest.mark.parametrize("kind", ["randn", "halves", "signed-zeros", "equal", "narrow"])
def test_gpu_flashinfer_equals_the_reference(real_flashinfer, B, H, S, k, kind):
    """Ragged batches: -inf tails, left padding, counts below K where a batch has fewer valid tokens."""
    dev = torch.device("cuda")
    scores, valid = score_rows(B, H, S, kind, True)
    counts = _counts(k, valid)
    _check(dev, scores.to(dev), counts, k)


@gpu
@pytest.mark.parametrize("B,H,S,k", GPU_SIZES)
@pytest.mark.parametrize("kind", ["randn", "halves", "signed-zeros"])
def test_gpu_flashinfer_uniform_counts(real_flashinfer, B, H, S, k, kind):
    dev = torch.device("cuda")
    scores, _ = score_rows(B, H, S, kind, False)
    counts = torch.full((B,), k)
    _check(dev, scores.to(dev), counts, k, uniform=True)
    _check(dev, scores.to(dev), counts - torch.arange(B), k)  # counts below K: the sorted top-K cut at each


@gpu
def test_gpu_flashinfer_in_a_cuda_graph(real_flashinfer):
    """Captured once (after a first call: compilation and FlashInfer's cached scratch), replayed on new scores and
    counts written into the captured inputs; the uniform path captured too."""
    dev = torch.device("cuda")
    B, H, S, k = 2, 4, 131072, 2048
    scores, _ = score_rows(B, H, S, "randn", False)
    sc, cn = scores.to(dev), torch.full((B,), k, device=dev)
    for uniform in (False, True):
        select_topk(sc, cn, k_max=k, method="flashinfer", uniform=uniform)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            idx = select_topk(sc, cn, k_max=k, method="flashinfer", uniform=uniform)
        for seed, kind in ((1, "randn"), (2, "halves"), (3, "narrow"), (4, "signed-zeros")):
            s2, _ = score_rows(B, H, S, kind, False, seed=seed)
            sc.copy_(s2.to(dev))
            cn.copy_(torch.tensor([k, k - 100 * seed]) if not uniform else torch.full((B,), k))
            graph.replay()
            torch.cuda.synchronize()
            assert_same_sets(idx, R.select_topk(sc, cn), cn.cpu())


@gpu
@pytest.mark.parametrize("B,H,S,k", GPU_SIZES)
def test_gpu_flashinfer_nan_ranks_above_inf(real_flashinfer, B, H, S, k):
    """NaN, -NaN and +inf among the scores (last: the canonical copy makes every NaN one +NaN)."""
    dev = torch.device("cuda")
    scores, valid = score_rows(B, H, S, "nan", True)
    counts = _counts(k, valid)
    _check(dev, scores.to(dev), counts, k)
