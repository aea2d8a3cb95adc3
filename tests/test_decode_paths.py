"""Every decode path against its reference, by logits.

The matrix: path (dynamic cache on the PyTorch reference and on the Triton kernels, static cache on both, the
compiled static cache on CUDA) x batch (one unpadded sequence passed without a mask, two unpadded, one row
left-padded, ragged left padding) x basis (an orthogonal PCA basis; a score-aware pair whose key transform is not
orthogonal) x budget (k = 1.0 and an int k above every valid length must equal dense attention; k = 0.5 and int
k in {1, P - 1, P} must equal the dynamic PyTorch path) x GQA mode ("kv" with the raw sum; a few cases,
``AGG_CASES``, of the shared selection with the softmax aggregates, written "kv:<aggregate>"; and a few,
``INT8_CASES``, with the int8 score copy, written "<mode>@int8", whose reference is the dynamic PyTorch path in the
same score format).  Logits of the
prefill's last position and of every decode step are compared (fp32, to 1e-5), never greedy tokens.

On the CPU the Triton kernels run in the interpreter: the PyTorch paths run the whole matrix, the Triton paths a
pairwise-covering subset (every pair of factor values at least once; the whole matrix with
``LOKI_FULL_MATRIX=1``).  On a
GPU (``-m gpu``) the same tests run on CUDA, plus the compiled static cache (CUDA graphs).
``test_planted_defects_are_caught`` plants one-line defects and requires the same comparison to fail.
"""

from __future__ import annotations

import functools
import itertools
import os

import pytest
import torch

pytest.importorskip("transformers")

from loki.basis import PCABasis  # noqa: E402
from loki.integrations.transformers import cache_keyword, enable_loki, loki_cache  # noqa: E402
from loki.testing.decode import BATCH_KINDS, batch_inputs, decode_logits, random_score_basis  # noqa: E402
from loki.testing.models import tiny_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
P, T = 12, 3  # prompt length, decode steps
MODEL = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
D_DIMS = 0.25
BUDGETS = (1.0, 0.5, 1, P - 1, P, 2 * P)
BASES = ("pca", "score")
GQA = ("query", "kv")
PATHS = ("dynamic-torch", "dynamic-triton", "static-torch", "static-triton")
TOL = dict(rtol=1e-5, atol=1e-5)


def _basis(kind: str):
    L, HKV, D = MODEL["num_layers"], MODEL["num_kv_heads"], MODEL["head_dim"]
    if kind == "pca":
        return PCABasis.random(L, HKV, D, seed=1)
    return random_score_basis(L, HKV, D, seed=1)


def run_path(path: str, batch_kind: str, basis: str, k, gqa: str, device: str) -> torch.Tensor:
    """Logits [T + 1, B, V] of one path on one case (a fresh model with the same weights every time)."""
    torch._dynamo.reset()
    model = tiny_model(**MODEL).to(device)
    backend = {"torch": "torch", "triton": "triton", "static": "auto"}[path.split("-")[-1]]
    gqa, _, variant = gqa.partition("@")  # "kv@int8": the int8 score copy; "kv@noprefix": key_prefix=False
    gqa, _, aggregate = gqa.partition(":")  # "kv:softmax-max": a shared selection with that aggregate
    enable_loki(model, _basis(basis), k=k, d=D_DIMS, backend=backend, gqa_select=gqa, aggregate=aggregate or "sum",
                score_format="int8" if variant == "int8" else "native", key_prefix=variant != "noprefix")
    batch = batch_inputs(batch_kind, prompt_len=P, steps=T).to(device)
    cache = loki_cache(model, static=True, max_cache_len=P + T + 2) if "static" in path else None
    step = None
    if path == "compiled-static":
        step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    return decode_logits(model, batch, cache=cache, step=step)


@functools.cache
def dense_logits(batch_kind: str, device: str) -> torch.Tensor:
    model = tiny_model(**MODEL).to(device)
    return decode_logits(model, batch_inputs(batch_kind, prompt_len=P, steps=T).to(device))


_REFERENCES: dict = {}


def reference_logits(batch_kind: str, basis: str, k, gqa: str, device: str) -> torch.Tensor:
    """The dynamic PyTorch path's logits, once per case (keyed by the budget's type too: 1 is not 1.0)."""
    key = (batch_kind, basis, type(k), k, gqa, device)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_path("dynamic-torch", batch_kind, basis, k, gqa, device)
    return _REFERENCES[key]


def keeps_everything(k) -> bool:
    """k = 1.0, or an int count above every valid length of the case (prompt + decode steps)."""
    return k == 1.0 if isinstance(k, float) else k >= P + T


def check_case(path, batch_kind, basis, k, gqa, device) -> None:
    """The comparison every case makes: dense at full budgets, the dynamic PyTorch path at any budget."""
    got = run_path(path, batch_kind, basis, k, gqa, device)
    assert torch.isfinite(got).all()
    if keeps_everything(k):
        torch.testing.assert_close(got, dense_logits(batch_kind, device), **TOL)
    if path != "dynamic-torch":
        torch.testing.assert_close(got, reference_logits(batch_kind, basis, k, gqa, device), **TOL)


def _case_id(case) -> str:
    path, kind, basis, k, gqa = case
    return f"{path}-{kind}-{basis}-k{k!r}-{gqa}"


def pairwise(factors: list[tuple]) -> list[tuple]:
    """A deterministic pairwise-covering subset of the product of ``factors``: every pair of values of any two
    factors appears in at least one case (greedy, in the order of the product)."""
    need = {(i, a, j, b) for i, j in itertools.combinations(range(len(factors)), 2)
            for a in factors[i] for b in factors[j]}
    chosen = []
    while need:
        best, gain = None, 0
        for case in itertools.product(*factors):
            g = sum((i, case[i], j, case[j]) in need for i, j in itertools.combinations(range(len(case)), 2))
            if g > gain:
                best, gain = case, g
        chosen.append(best)
        need -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(best)), 2)}
    return chosen


KINDS = tuple(BATCH_KINDS)
TORCH_CASES = list(itertools.product(("dynamic-torch", "static-torch"), KINDS, BASES, BUDGETS, GQA))
TRITON_ALL = list(itertools.product(("dynamic-triton", "static-triton"), KINDS, BASES, BUDGETS, GQA))
TRITON_PAIRS = pairwise([("dynamic-triton", "static-triton"), KINDS, BASES, BUDGETS, GQA])
TRITON_REST = [c for c in TRITON_ALL if c not in TRITON_PAIRS]
#: The softmax aggregates of a shared selection: a few cases on each Triton path (every batch kind, both bases,
#: fractional and int budgets; k = 1.0 compares with dense attention too).
SOFTMAX_AGGS = ("kv:softmax-max", "kv:softmax-sum")
AGG_CASES = [
    ("dynamic-triton", "B3-ragged", "pca", 0.5, SOFTMAX_AGGS[0]),
    ("dynamic-triton", "B1-unpadded", "score", P - 1, SOFTMAX_AGGS[1]),
    ("static-triton", "B2-left-padded", "score", 0.5, SOFTMAX_AGGS[1]),
    ("static-triton", "B2-unpadded", "pca", 1.0, SOFTMAX_AGGS[0]),
]

#: The int8 score copy (the caches write int8 codes of the d scored dims, the kernels read them): a few cases on
#: every path, each batch kind and GQA mode, both bases, fractional and int budgets (k = 1.0: dense too).
INT8_CASES = [
    ("dynamic-triton", "B3-ragged", "score", 0.5, "kv:softmax-max@int8"),
    ("static-triton", "B2-left-padded", "pca", P - 1, "query@int8"),
    ("dynamic-triton", "B1-unpadded", "pca", 1.0, "kv@int8"),
    ("static-triton", "B2-unpadded", "score", 1, "kv:softmax-max@int8"),
]
TORCH_INT8_CASES = [("static-torch", "B3-ragged", "score", 0.5, "kv:softmax-max@int8"),
                    ("static-torch", "B2-left-padded", "pca", 1.0, "query@int8")]
#: Caches without the key prefix (``key_prefix=False``: the kernels read the keys' first d dims in place): a few
#: cases on each Triton path, each GQA mode, both bases, fractional and int budgets (k = 1.0: dense too).
NOPREFIX_CASES = [
    ("dynamic-triton", "B2-left-padded", "score", 0.5, "kv:softmax-max@noprefix"),
    ("static-triton", "B3-ragged", "pca", P - 1, "query@noprefix"),
    ("static-triton", "B1-unpadded", "score", 1.0, "kv@noprefix"),
]


def test_pairwise_subset_covers_every_pair():
    factors = [("dynamic-triton", "static-triton"), KINDS, BASES, BUDGETS, GQA]
    for i, j in itertools.combinations(range(len(factors)), 2):
        seen = {(c[i], c[j]) for c in TRITON_PAIRS}
        assert seen == set(itertools.product(factors[i], factors[j]))
    assert len(TRITON_PAIRS) < len(TRITON_ALL) // 3


@pytest.mark.parametrize("case", TORCH_CASES + TORCH_INT8_CASES, ids=_case_id)
def test_torch_paths(case):
    check_case(*case, "cpu")


def _triton_cpu():
    if not INTERPRET:
        pytest.skip("the Triton kernels on the CPU need TRITON_INTERPRET=1")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", TRITON_PAIRS + AGG_CASES + INT8_CASES + NOPREFIX_CASES, ids=_case_id)
def test_triton_paths(case):
    _triton_cpu()
    check_case(*case, "cpu")


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("LOKI_FULL_MATRIX") != "1",
                    reason="the whole Triton matrix under the interpreter takes ~10 minutes: LOKI_FULL_MATRIX=1")
@pytest.mark.parametrize("case", TRITON_REST, ids=_case_id)
def test_triton_paths_rest_of_matrix(case):
    _triton_cpu()
    check_case(*case, "cpu")


# -- the same on a GPU ------------------------------------------------------------------------------------------

GPU_AGG_CASES = [(path, kind, "pca", k, agg) for path in ("dynamic-triton", "static-triton")
                 for kind, k in (("B1-unpadded", 1.0), ("B2-left-padded", 0.5), ("B3-ragged", P - 1))
                 for agg in SOFTMAX_AGGS]
GPU_CASES = TORCH_CASES + TORCH_INT8_CASES + TRITON_ALL + GPU_AGG_CASES + INT8_CASES + NOPREFIX_CASES
COMPILED_CASES = [("compiled-static", kind, basis, k, gqa) for kind, basis, k, gqa in
                  pairwise([KINDS, BASES, (1.0, 0.5, 1, 2 * P), GQA])] + [
                  ("compiled-static", kind, "score", k, agg) for kind, k in (("B2-left-padded", 0.5), ("B3-ragged", 1))
                  for agg in SOFTMAX_AGGS] + [
                  ("compiled-static", "B3-ragged", "score", 0.5, "kv:softmax-max@int8"),
                  ("compiled-static", "B2-left-padded", "pca", 1, "query@int8"),
                  ("compiled-static", "B1-unpadded", "score", 1.0, "kv@int8"),
                  ("compiled-static", "B2-left-padded", "score", 0.5, "kv:softmax-max@noprefix"),
                  ("compiled-static", "B3-ragged", "pca", 1, "query@noprefix")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_paths(case):
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set")
    check_case(*case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", COMPILED_CASES, ids=_case_id)
def test_gpu_compiled_static(case):
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set")
    check_case(*case, "cuda")


# -- the comparison fails when the code is wrong ------------------------------------------------------------------

def _plant(monkeypatch, defect: str):
    """One-line defects of the decode paths, each planted for one test."""
    import loki.integrations.transformers.attention as attention
    import loki.integrations.transformers.run as run
    import loki.integrations.transformers.step as step

    if defect == "static-scale-5%":
        real = run.run_decode

        def scaled(state, plan, ranges, q, k, v, *, scale, **kw):
            return real(state, plan, ranges, q, k, v, scale=scale * 1.05 if plan.static else scale, **kw)

        monkeypatch.setattr(attention, "run_decode", scaled)
    elif defect == "static-query-rotated-with-key-transform":
        real = run.rotate_query
        for name in ("rotate_query", "rotate_query_op"):  # every rotation of the decode step
            monkeypatch.setattr(run, name, lambda q, P_q: real(q, P_q.transpose(-1, -2).inverse()))
    elif defect == "dynamic-query-rotated-with-key-transform":
        from loki.integrations.transformers.state import LayerTransforms, Transforms

        real = Transforms.layer
        monkeypatch.setattr(Transforms, "layer",
                            lambda self, i, dev=None: LayerTransforms(real(self, i, dev).key, real(self, i, dev).key,
                                                                      real(self, i, dev).inverse))
    elif defect == "static-prefill-sees-unwritten-slots":
        real = step._group

        def every_slot(key, *a):
            g = real(key, *a)
            g.lengths = torch.where(g.any_, torch.full_like(g.lengths, key[0]), g.lengths)
            return g

        monkeypatch.setattr(step, "_group", every_slot)
    elif defect == "budget-off-by-one":
        real = step.budget_counts
        monkeypatch.setattr(step, "budget_counts", lambda k, n: (real(k, n) - 1).clamp(min=1))
    else:
        raise ValueError(defect)


@pytest.mark.parametrize("defect,case", [
    ("static-scale-5%", ("static-torch", "B2-left-padded", "pca", 0.5, "query")),
    ("static-query-rotated-with-key-transform", ("static-torch", "B1-unpadded", "score", 1.0, "kv")),
    ("dynamic-query-rotated-with-key-transform", ("dynamic-torch", "B1-unpadded", "score", 1.0, "query")),
    ("static-prefill-sees-unwritten-slots", ("static-torch", "B1-unpadded", "pca", 1.0, "query")),
    ("budget-off-by-one", ("static-torch", "B3-ragged", "pca", 0.5, "kv")),
])
def test_planted_defects_are_caught(monkeypatch, defect, case):
    reference_logits(*case[1:], "cpu")  # computed before the defect is planted
    dense_logits(case[1], "cpu")
    _plant(monkeypatch, defect)
    with pytest.raises(AssertionError):
        check_case(*case, "cpu")


# -- bounds: no write outside the cache, clear errors before anything is written -----------------------------------

def _static_model(backend="torch"):
    model = tiny_model(**MODEL)
    enable_loki(model, _basis("pca"), k=0.5, d=D_DIMS, backend=backend)
    return model


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_prompt_longer_than_the_static_cache_is_refused_before_writing(backend):
    from loki._checks import CacheOverflowError

    if backend == "triton" and not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    model = _static_model(backend)
    cache = loki_cache(model, static=True, max_cache_len=8, batch_size=1)
    with pytest.raises(CacheOverflowError, match="max_cache_len=8"):
        decode_logits(model, batch_inputs("B1-unpadded", prompt_len=10, steps=0), cache=cache)
    assert all(bool((layer.keys == 0).all()) and bool((layer.values == 0).all()) for layer in cache.layers)
    assert isinstance(CacheOverflowError("x"), IndexError)  # as transformers' own static cache raises


def test_generating_past_the_static_cache_raises_at_that_step():
    from loki._checks import CacheOverflowError

    model = _static_model()
    batch = batch_inputs("B2-left-padded", prompt_len=6, steps=4)
    cache = loki_cache(model, static=True, max_cache_len=8)
    with pytest.raises(CacheOverflowError, match="max_cache_len=8"):
        decode_logits(model, batch, cache=cache)  # positions 6, 7 fit; 8 does not
    ids, mask = batch.ids, batch.mask
    with pytest.raises(CacheOverflowError, match="max_cache_len"), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                       **{cache_keyword(model): loki_cache(model, static=True, max_cache_len=8)})


def test_batch_other_than_the_allocated_one_is_refused():
    from loki._checks import CacheOverflowError

    model = _static_model()
    cache = loki_cache(model, static=True, max_cache_len=20, batch_size=1)
    with pytest.raises(CacheOverflowError, match="batch_size=1"):
        decode_logits(model, batch_inputs("B2-unpadded", prompt_len=6, steps=1), cache=cache)


@pytest.mark.interpreter
def test_write_kernel_never_writes_outside_the_cache():
    """Whatever positions it is given, the fused write stores only into the cache's own rows; the op refuses
    positions past max_cache_len and another batch size before writing anything."""
    from loki._checks import CacheOverflowError
    from loki.kernels.cache_write import write_rotated
    from loki.testing.inputs import random_orthogonal

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (the GPU runs the same check in test_gpu_write_kernel_bounds)")
    _write_bounds("cpu", write_rotated, random_orthogonal, CacheOverflowError)


@pytest.mark.gpu
def test_gpu_write_kernel_bounds():
    from loki._checks import CacheOverflowError
    from loki.kernels.cache_write import write_rotated
    from loki.testing.inputs import random_orthogonal

    _write_bounds("cuda", write_rotated, random_orthogonal, CacheOverflowError)


def _write_bounds(dev, write_rotated, random_orthogonal, CacheOverflowError):
    B, HKV, S, D, dp = 2, 2, 10, 16, 4
    g = torch.Generator().manual_seed(0)
    big_k = torch.full((B + 1, HKV, S + 6, D), 3.0).to(dev)
    big_v = torch.full_like(big_k, 5.0)
    big_p = torch.full((B + 1, HKV, S + 6, dp), 7.0).to(dev)
    keys, values, prefix = big_k[:B, :, :S], big_v[:B, :, :S], big_p[:B, :, :S]
    P = random_orthogonal(HKV, D, seed=1).to(dev, torch.float32).contiguous()
    k = torch.randn(B, HKV, 3, D, generator=g).to(dev)
    v = torch.randn(B, HKV, 3, D, generator=g).to(dev)
    bad = torch.tensor([S - 1, S, S + 3], device=dev)
    with pytest.raises(CacheOverflowError, match=f"max_cache_len={S}"):
        write_rotated(keys, values, prefix, k, v, P, bad)
    with pytest.raises(CacheOverflowError, match=f"positions {S - 2}..{S} into a static cache of max_cache_len={S}"):
        write_rotated(keys, values, prefix, k, v, P, torch.tensor([S - 2, S - 1, S], device=dev))  # one past
    assert bool((big_k == 3.0).all()) and bool((big_v == 5.0).all()) and bool((big_p == 7.0).all())
    with pytest.raises(CacheOverflowError, match=f"batch_size={B}"):
        write_rotated(keys, values, prefix, torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), P, bad[:1] - 1)
    # unchecked (as inside a captured graph): the kernel's masked stores keep the out-of-range rows unwritten
    write_rotated(keys, values, prefix, k, v, P, torch.tensor([S - 1, S, -1], device=dev), check_positions=False)
    assert bool((big_k[:, :, S:] == 3.0).all()) and bool((big_k[B:] == 3.0).all())
    assert bool((big_v[:, :, S:] == 5.0).all()) and bool((big_p[:, :, S:] == 7.0).all())
    assert bool((big_k[:B, :, S - 1] != 3.0).all()) and bool((big_k[:B, :, : S - 1] == 3.0).all())


# -- one budget rule: an int k above the valid tokens keeps them all, everywhere ----------------------------------

@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("gqa_select", ["query", "kv"])
def test_int_budget_above_the_cache_keeps_every_token(backend, gqa_select):
    from loki.kernels import decode_attention, plan_decode
    from loki.reference import dense_attention
    from loki.testing.inputs import make_decode_inputs

    if backend == "triton" and not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    x = make_decode_inputs(3, 4, 2, 37, 16, ragged=True, left_pad=True, seed=2)
    want = dense_attention(x.q, x.k_cache, x.v_cache, x.lengths, x.starts)
    for k in (37, 38, 4096):
        got = decode_attention(x.q, x.k_cache, x.v_cache, d=16, k=k, lengths=x.lengths, starts=x.starts,
                               backend=backend, gqa_select=gqa_select, aggregate="sum")
        torch.testing.assert_close(got, want, **TOL)
    if backend == "triton":
        plan = plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=16, k=4096, gqa_select=gqa_select, aggregate="sum")
        torch.testing.assert_close(plan.run(x.q, x.lengths, x.starts), want, **TOL)
    with pytest.raises(ValueError, match="k=0"):
        decode_attention(x.q, x.k_cache, x.v_cache, d=16, k=0, backend=backend, gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="k=1.5"):
        enable_loki(tiny_model(**MODEL), _basis("pca"), k=1.5)


# -- more paths and states the matrix does not reach ----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["B1-unpadded", "B3-ragged"])
def test_sliding_window_model_at_full_budget_equals_dense(kind):
    """A Mistral model whose window (6) is shorter than the context: every row sees only its window."""
    cfg = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=6)
    batch = batch_inputs(kind, prompt_len=P, steps=T)
    dense = decode_logits(tiny_model("mistral", **cfg), batch)
    model = tiny_model("mistral", **cfg)
    enable_loki(model, _basis("score"), k=1.0, d=D_DIMS, backend="torch")
    torch.testing.assert_close(decode_logits(model, batch), dense, **TOL)
    model = tiny_model("mistral", **cfg)
    enable_loki(model, _basis("pca"), k=0.5, d=D_DIMS, backend="torch")
    sparse = decode_logits(model, batch)
    assert (sparse - dense).abs().max() > 1e-3  # the budget binds inside the window


def test_static_layer_write_outside_a_forward_is_checked():
    """A static cache layer written directly (no model forward, so no step metadata) checks its own bounds."""
    from loki._checks import CacheOverflowError

    model = _static_model()
    cache = loki_cache(model, static=True, max_cache_len=6, batch_size=1)
    layer = cache.layers[0]
    kv = torch.randn(1, MODEL["num_kv_heads"], 4, MODEL["head_dim"])
    layer.update(kv, kv)
    before = layer.keys.clone()
    with pytest.raises(CacheOverflowError, match="max_cache_len=6"):
        layer.update(kv, kv)  # positions 4..7 of 6
    assert torch.equal(layer.keys, before)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_disable_restores_plain_keys_with_a_score_basis(static):
    """disable_loki rotates the cached keys back with the layer's inverse (P_q^T for a score-aware pair)."""
    from loki.integrations.transformers import disable_loki

    batch = batch_inputs("B2-left-padded", prompt_len=P, steps=0)
    plain = tiny_model(**MODEL)
    from transformers import DynamicCache

    ref_cache = DynamicCache(config=plain.config)
    decode_logits(plain, batch, cache=ref_cache)
    model = tiny_model(**MODEL)
    enable_loki(model, _basis("score"), k=0.5, d=D_DIMS, backend="torch")
    cache = loki_cache(model, static=True, max_cache_len=P + 2) if static else loki_cache(model)
    decode_logits(model, batch, cache=cache)
    disable_loki(model)
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(layer.keys[:, :, :P], ref_cache.layers[i].keys, rtol=1e-4, atol=1e-4)


@pytest.mark.interpreter
@pytest.mark.parametrize("with_out", [False, True])
def test_planned_runs_change_every_input_and_keep_every_output(with_out):
    """DecodeRun: every run takes the new query, lengths and starts; without ``out`` every run returns a new
    tensor that later runs leave alone, with ``out`` every run writes the caller's buffer."""
    from loki.kernels import plan_decode
    from loki.reference.methods import loki_attention
    from loki.testing.inputs import make_decode_inputs

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    B, HQ, HKV, S, D = 3, 4, 2, 90, 32
    x = make_decode_inputs(B, HQ, HKV, S, D, ragged=True, left_pad=True, seed=4)
    out = torch.empty(B, HQ, D) if with_out else None
    plan = plan_decode(x.k_cache, x.v_cache, num_q_heads=HQ, d=8, k=0.3, gqa_select="kv", out=out, aggregate="sum")
    g = torch.Generator().manual_seed(5)
    kept = []
    for _run in range(5):
        q = torch.randn(B, HQ, D, generator=g)
        lengths = torch.randint(S // 2, S + 1, (B,), generator=g, dtype=torch.int32)
        starts = torch.randint(0, S // 4, (B,), generator=g, dtype=torch.int32)
        res = plan.run(q, lengths, starts)
        if with_out:
            assert res is out
            res = res.clone()
        kept.append((q, lengths, starts, res))
    assert plan.replays == 1, "the plan should replay its recorded launches"
    for q, lengths, starts, res in kept:
        want = loki_attention(q, x.k_cache, x.v_cache, d=8, k=0.3, lengths=lengths, starts=starts,
                              gqa_select="kv", aggregate="sum")
        torch.testing.assert_close(res, want, **TOL)


@pytest.mark.gpu
def test_gpu_write_kernel_takes_a_prefill_longer_than_a_grid_axis():
    """A prefill of more than 65535 tokens written in one call (tokens on the grid's first axis): the same
    cache as the reference writes (a 131072-token cache failed to launch when tokens were on the second axis)."""
    from loki.kernels.cache_write import write_rotated, write_rotated_reference

    L, S = 70000, 70010
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, 2, L, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    P = PCABasis.random(1, 2, 64, seed=2).components[0].cuda().contiguous()
    pos = torch.arange(L, device="cuda")
    caches = [[torch.zeros(1, 2, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    write_rotated(*caches[0][:2], caches[0][2][..., :16], k, v, P, pos)
    write_rotated_reference(*caches[1][:2], caches[1][2][..., :16], k, v, P, pos)
    torch.testing.assert_close(caches[0][0], caches[1][0], rtol=1e-2, atol=2e-2)
    assert torch.equal(caches[0][1], caches[1][1])
    assert bool((caches[0][0][:, :, L:] == 0).all())
