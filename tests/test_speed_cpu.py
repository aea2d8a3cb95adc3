"""CPU speed of the PyTorch references and of the evaluation engine, with pytest-benchmark.

ASV (``benchmarks/``) keeps the per-commit history of what the project promises on its GPU machine: kernel and
end-to-end decode speed against torch's SDPA, and accuracy.  These are the CPU timings a change to the
references (``loki.reference``) or to the evaluation engine (``loki.reference.teacher_forced`` behind
``loki.evaluation.perplexity``) is checked against on any machine, before and after, with pytest-benchmark's
statistics (many rounds, min / median / IQR) and its saved runs::

    pytest tests/test_speed_cpu.py --benchmark-only --benchmark-autosave             # save a run (.benchmarks/)
    pytest tests/test_speed_cpu.py --benchmark-only --benchmark-compare \\
        --benchmark-compare-fail=median:25%                                            # compare with the last one

(docs/benchmarks.md, "CPU benchmarks").  In the test suite (``pytest -n 2``, xdist) pytest-benchmark turns
timing off and each function runs once, as a test of the code path: the shapes are small.
"""

from __future__ import annotations

import pytest
import torch

from loki import reference
from loki.testing.inputs import make_decode_inputs

pytest.importorskip("pytest_benchmark")

B, HQ, HKV, S, D = 4, 8, 2, 4096, 64
K_F, D_F = 0.25, 0.25


@pytest.fixture(scope="module")
def decode_inputs():
    torch.manual_seed(0)
    x = make_decode_inputs(B, HQ, HKV, S, D, dtype=torch.float32, ragged=True, seed=1)
    return x


def _threads():
    """One thread: timings comparable between runs on a shared machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    return old


@pytest.fixture(autouse=True)
def one_thread():
    old = _threads()
    yield
    torch.set_num_threads(old)


REFERENCE_METHODS = {
    "dense": lambda x: reference.dense_attention(x.q, x.k_cache, x.v_cache, x.lengths, x.starts),
    "exact_topk": lambda x: reference.exact_topk_attention(x.q, x.k_cache, x.v_cache, k=K_F, lengths=x.lengths,
                                                           starts=x.starts, gqa_select="query", aggregate="sum"),
    "loki[query]": lambda x: reference.loki_attention(x.q, x.k_cache, x.v_cache, d=D_F, k=K_F, lengths=x.lengths,
                                                      starts=x.starts, gqa_select="query", aggregate="sum"),
    "loki[kv]": lambda x: reference.loki_attention(x.q, x.k_cache, x.v_cache, d=D_F, k=K_F, lengths=x.lengths,
                                                   starts=x.starts, gqa_select="kv", aggregate="sum"),
    "sparq": lambda x: reference.sparq_attention(x.q, x.k_cache, x.v_cache, r=int(D_F * D), k=K_F,
                                                 lengths=x.lengths, starts=x.starts),
}


@pytest.mark.benchmark(group="reference decode step, B=4 HQ=8 HKV=2 S=4096 D=64, fp32")
@pytest.mark.parametrize("method", list(REFERENCE_METHODS))
def test_reference_decode_step(benchmark, decode_inputs, method):
    out = benchmark(REFERENCE_METHODS[method], decode_inputs)
    assert out.shape == (B, HQ, D) and torch.isfinite(out).all()


@pytest.mark.benchmark(group="evaluation engine: teacher-forced rows, HQ=8 HKV=2 L=512 D=64")
@pytest.mark.parametrize("method", ["exact_topk", "loki"])
def test_teacher_forced_rows(benchmark, method):
    from loki.reference.teacher_forced import teacher_forced_rows

    L = 512
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, HQ, L, D, generator=g)
    k = torch.randn(1, HKV, L, D, generator=g)
    v = torch.randn(1, HKV, L, D, generator=g)
    starts = torch.zeros(1, L, dtype=torch.long)
    lengths = torch.arange(1, L + 1).unsqueeze(0)
    out = benchmark(teacher_forced_rows, q, k, v, starts, lengths, method=method, k_budget=K_F, d=D_F,
                    gqa_select="query", aggregate="sum")
    assert out.shape == (1, HQ, L, D)


@pytest.mark.benchmark(group="evaluation engine: perplexity of a tiny model, 2 x 256 tokens")
@pytest.mark.parametrize("method", ["full", "exact_topk", "loki"])
def test_perplexity_engine(benchmark, method):
    from loki.basis import PCABasis
    from loki.evaluation.perplexity import MethodSpec, perplexity
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, seed=3)
    bases = {"b": PCABasis.random(2, 2, 16, seed=1, rotary="post")}
    windows = torch.randint(0, 128, (2, 256), generator=torch.Generator().manual_seed(5))
    spec = {"full": MethodSpec("full", "full"), "exact_topk": MethodSpec("exact", "exact_topk", k=K_F),
            "loki": MethodSpec("loki", "loki", k=K_F, d=D_F, basis="b")}[method]
    res = benchmark(perplexity, model, windows, spec, bases)
    assert res.ppl > 1.0 and res.tokens == 2 * 255
