"""The static Loki cache (``loki_static_cache``, ``generate(cache_implementation="static")``), the
``loki::decode_step`` custom op under ``torch.compile(fullgraph=True)``, and the planned decode step
(``plan_decode``): against the dynamic cache, dense attention, ``decode_attention`` and the reference.

CPU: tiny random models (fp32), the PyTorch backend and the Triton interpreter; compile with the "aot_eager"
backend (traces the whole step, no C++ build). GPU (``-m gpu``): inductor with CUDA graphs, bf16/fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loki.basis import PCABasis  # noqa: E402
from loki.integrations.transformers import (  # noqa: E402
    LokiError,
    LokiStaticCacheLayer,
    disable_loki,
    enable_loki,
    loki_static_cache,
)
from loki.integrations.transformers import static as lt_static  # noqa: E402
from loki.kernels import decode_attention, plan_decode  # noqa: E402
from loki.kernels.ops import decode_step_op  # noqa: E402
from loki.testing.inputs import make_decode_inputs  # noqa: E402
from loki.testing.models import tiny_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PROMPT, NEW = 12, 6


def _basis(model, seed=1) -> PCABasis:
    c = model.config
    return PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=seed)


def _prompt(B=2, n=PROMPT, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (B, n), generator=g)
    mask = torch.ones_like(ids)
    mask[1:, :3] = 0  # the second sequence is left-padded
    return ids, mask


def _generate(model, ids, mask, **kw):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:]


def _cache_kw(model) -> str:
    from loki._hf import cache_keyword

    return cache_keyword(model)


def _spy_static(monkeypatch):
    calls = []
    real = lt_static.static_decode

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr("loki.integrations.transformers.attention.static_decode", spy)
    return calls


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("gqa_select", ["query", "kv"])
def test_static_cache_generate_equals_dynamic(backend, gqa_select, monkeypatch):
    if backend == "triton" and not (INTERPRET or HAS_CUDA):
        pytest.skip("the Triton backend needs a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if backend == "triton" and HAS_CUDA and not INTERPRET else "cpu"
    model = tiny_model(num_heads=4, num_kv_heads=2).to(dev)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend=backend, gqa_select=gqa_select)
    ids, mask = (t.to(dev) for t in _prompt())
    dynamic = _generate(model, ids, mask)
    calls = _spy_static(monkeypatch)
    cache = loki_static_cache(model, max_cache_len=PROMPT + NEW + 3)
    static = _generate(model, ids, mask, **{_cache_kw(model): cache})
    assert len(calls) == model.config.num_hidden_layers * (NEW - 1)  # every decode step took the static path
    assert isinstance(cache.layers[0], LokiStaticCacheLayer)
    assert torch.equal(static, dynamic)
    calls.clear()
    assert torch.equal(_generate(model, ids, mask, cache_implementation="static"), dynamic)
    assert len(calls) == model.config.num_hidden_layers * (NEW - 1)


def test_static_cache_stores_rotated_keys_and_prefix():
    model = tiny_model(num_heads=4, num_kv_heads=2)
    basis = _basis(model)
    enable_loki(model, basis, k=0.5, d=0.25, backend="torch")
    cache = loki_static_cache(model, max_cache_len=20, batch_size=1)
    layer = cache.layers[0]
    assert layer.keys.shape == (1, 2, 20, 16)
    k = torch.randn(1, 2, 5, 16)
    v = torch.randn(1, 2, 5, 16)
    layer.update(k, v, 0, {"cache_position": torch.arange(5)})
    expected = torch.einsum("bhsd,hde->bhse", k, basis.components[0].float())
    torch.testing.assert_close(layer.keys[:, :, :5], expected, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(layer.keys[:, :, 5:]) == 0
    torch.testing.assert_close(layer.values[:, :, :5], v)
    # the same cache after disable_loki: keys back in their own coordinates, writes refused until re-enabled
    disable_loki(model)
    restored = cache.layers[0]
    assert not isinstance(restored, LokiStaticCacheLayer)
    torch.testing.assert_close(restored.keys[:, :, :5], k, rtol=1e-4, atol=1e-4)


def test_full_budget_static_generation_equals_dense():
    ref = tiny_model(num_heads=4, num_kv_heads=2)
    model = tiny_model(num_heads=4, num_kv_heads=2)
    ids, mask = _prompt()
    expected = _generate(ref, ids, mask)
    enable_loki(model, _basis(model), k=1.0, d=model.config.head_dim, backend="torch")
    cache = loki_static_cache(model, max_cache_len=PROMPT + NEW)
    assert torch.equal(_generate(model, ids, mask, **{_cache_kw(model): cache}), expected)


def _decode_loop(model, step, ids, mask, max_len, n=NEW):
    """Prefill eagerly, then n decode steps through ``step`` (the forward, compiled or not)."""
    B, P = ids.shape
    cache = loki_static_cache(model, max_cache_len=max_len, batch_size=B)
    full = torch.cat([mask, torch.ones(B, max_len - P, dtype=mask.dtype, device=mask.device)], 1)
    kw = _cache_kw(model)
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(ids, attention_mask=mask, position_ids=pos, cache_position=torch.arange(P, device=ids.device),
                    use_cache=True, **{kw: cache})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        toks = [tok]
        for i in range(n):
            p = P + i
            o = step(input_ids=tok, attention_mask=full[:, : p + 1], position_ids=pos[:, -1:] + i + 1,
                     cache_position=torch.tensor([p], device=ids.device), use_cache=True, **{kw: cache})
            tok = o.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(tok)
    return torch.cat(toks, 1)


def test_compiled_fullgraph_static_decode_equals_eager():
    torch._dynamo.reset()
    model = tiny_model(num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    ids, mask = _prompt()
    eager = _decode_loop(model, model.forward, ids, mask, PROMPT + NEW + 1)
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    assert torch.equal(_decode_loop(model, compiled, ids, mask, PROMPT + NEW + 1), eager)


def test_custom_op_registered_and_traceable():
    assert hasattr(torch.ops.loki, "decode_step")
    x = make_decode_inputs(2, 4, 2, 40, 16, ragged=True, left_pad=True, seed=3)
    counts = torch.ceil((x.lengths - x.starts).double() * 0.25 - 1e-9).long()
    args = (x.q, x.k_cache, x.v_cache, None, x.lengths, x.starts, counts, 4, -1, 0.25, 16, "query", "sum", 0.25,
            False)
    out = decode_step_op(*args)
    ref = decode_attention(x.q, x.k_cache, x.v_cache, d=4, k=0.25, lengths=x.lengths, starts=x.starts,
                           backend="torch", scale=0.25)
    torch.testing.assert_close(out, ref)
    torch.library.opcheck(torch.ops.loki.decode_step.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


def test_static_mask_with_holes_is_refused():
    mask = torch.ones(1, 1, 1, 10, dtype=torch.bool)
    mask[..., 4] = False
    with pytest.raises(LokiError, match="contiguous"):
        lt_static.static_intervals(mask, 1, 10, "cpu", check=True)
    starts, lengths = lt_static.static_intervals(torch.arange(10)[None, None, None] >= 3, 1, 10, "cpu", True)
    assert starts.tolist() == [3] and lengths.tolist() == [10]
    with pytest.raises(LokiError, match="attention mask"):
        lt_static.static_intervals(None, 1, 10, "cpu", check=True)


def test_static_cache_arguments_and_h2o_refused():
    model = tiny_model(num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    with pytest.raises(ValueError, match="max_cache_len"):
        loki_static_cache(model, max_cache_len=0)
    with pytest.raises(ValueError, match="batch_size"):
        loki_static_cache(model, max_cache_len=8, batch_size=-1)
    enable_loki(model, None, k=0.5, d=0.5, method="h2o")
    with pytest.raises(LokiError, match="h2o"):
        loki_static_cache(model, max_cache_len=8)
    disable_loki(model)
    with pytest.raises(LokiError, match="not enabled"):
        loki_static_cache(model, max_cache_len=8)


@pytest.mark.interpreter
@pytest.mark.parametrize("gqa_select,k", [("query", 0.25), ("kv", 9)])
def test_plan_decode_equals_decode_attention(gqa_select, k):
    if not (INTERPRET or HAS_CUDA):
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if HAS_CUDA else "cpu"
    x = make_decode_inputs(3, 4, 2, 120, 32, ragged=True, left_pad=True, seed=5, device=dev)
    prefix = x.k_cache[..., :8].contiguous()
    plan = plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=8, k=k, k_prefix=prefix, gqa_select=gqa_select)
    for it in range(4):  # the first run records, later ones replay
        q = x.q + 0.05 * it
        ref = decode_attention(q, x.k_cache, x.v_cache, d=8, k=k, lengths=x.lengths, starts=x.starts,
                               backend="triton", gqa_select=gqa_select, k_prefix=prefix)
        out = plan.run(q, x.lengths, x.starts)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert plan._plan, "the plan should replay its recorded launches"
    # the cache may be written in place between runs: the plan reads the new values
    x.v_cache.mul_(2.0)
    torch.testing.assert_close(plan.run(x.q, x.lengths, x.starts),
                               decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=k, lengths=x.lengths,
                                                starts=x.starts, backend="triton", gqa_select=gqa_select,
                                                k_prefix=prefix), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_plan_decode_errors_name_the_argument():
    if not (INTERPRET or HAS_CUDA):
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if HAS_CUDA else "cpu"
    x = make_decode_inputs(2, 4, 2, 64, 16, seed=1, device=dev)
    with pytest.raises(ValueError, match="num_q_heads"):
        plan_decode(x.k_cache, x.v_cache, num_q_heads=3, d=4, k=8)
    with pytest.raises(ValueError, match="k="):
        plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=4, k=1000)
    with pytest.raises(ValueError, match="gqa_select"):
        plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=4, k=8, gqa_select="heads")
    plan = plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=4, k=8)
    with pytest.raises(ValueError, match="q_hat"):
        plan.run(x.q[:1], x.lengths[:1])
    with pytest.raises(ValueError, match="lengths"):
        plan.run(x.q, x.lengths.float())
    plan.run(x.q, x.lengths)
    plan.run(x.q, x.lengths)
    with pytest.raises(ValueError, match="q_hat"):
        plan.run(x.q.double(), x.lengths)


# -- GPU: inductor + CUDA graphs ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_compiled_static_generate_equals_eager():
    torch._dynamo.reset()
    model = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64).to("cuda")
    enable_loki(model, _basis(model), k=0.5, d=0.25, gqa_select="query")
    ids, mask = _prompt(B=2, n=40)
    ids, mask = ids.cuda(), mask.cuda()
    eager = _decode_loop(model, model.forward, ids, mask, 64, n=8)
    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    assert torch.equal(_decode_loop(model, compiled, ids, mask, 64, n=8), eager)
    # transformers' own compiled generate on the static cache gives the same tokens as the eager dynamic cache
    dyn = _generate(model, ids, mask)
    cache = loki_static_cache(model, max_cache_len=40 + NEW)
    assert torch.equal(_generate(model, ids, mask, **{_cache_kw(model): cache}), dyn)


@pytest.mark.gpu
def test_gpu_full_budget_compiled_static_equals_dense():
    torch._dynamo.reset()
    ref = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64).cuda()
    model = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64).cuda()
    ids, mask = _prompt(B=2, n=40)
    ids, mask = ids.cuda(), mask.cuda()
    expected = _generate(ref, ids, mask)
    enable_loki(model, _basis(model), k=1.0, d=64)
    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    got = _decode_loop(model, compiled, ids, mask, 40 + NEW, n=NEW - 1)
    assert torch.equal(got, expected)


@pytest.mark.gpu
def test_gpu_compiled_static_bf16_logits_match_eager():
    """bf16: inductor fuses the model's own ops (norms, rotary) with other roundings than eager, so tokens may
    differ after a near tie; the compiled Loki step's logits must stay as close to eager Loki's as the compiled
    dense step's stay to eager dense."""
    torch._dynamo.reset()
    ids, mask = _prompt(B=2, n=40)
    ids, mask = ids.cuda(), mask.cuda()
    diffs = {}
    for name in ("dense", "loki"):
        model = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64).to("cuda", torch.bfloat16)
        if name == "loki":
            enable_loki(model, _basis(model), k=0.5, d=0.25)
            make = lambda m=model: loki_static_cache(m, max_cache_len=48, batch_size=2)  # noqa: E731
        else:
            make = lambda m=model: transformers.StaticCache(config=m.config, max_cache_len=48)  # noqa: E731
        compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        logits = []
        for step in (model.forward, compiled, compiled, compiled):
            cache = make()
            kw = {_cache_kw(model): cache}
            with torch.no_grad():
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                model(ids, attention_mask=mask, position_ids=pos, cache_position=torch.arange(40, device="cuda"),
                      use_cache=True, **kw)
                full = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device="cuda")], 1)
                o = step(input_ids=ids[:, -1:], attention_mask=full, position_ids=pos[:, -1:] + 1,
                         cache_position=torch.tensor([40], device="cuda"), use_cache=True, **kw)
                logits.append(o.logits[:, -1].float().clone())
        diffs[name] = max((logits[i] - logits[0]).abs().max().item() for i in (1, 2, 3))
    assert diffs["loki"] <= 2 * diffs["dense"] + 0.05, diffs


def test_compiled_graph_computes_ranges_once_for_all_layers():
    """The traced decode step holds one Loki op per layer and one computation of the mask ranges (two argmax)
    shared by every layer."""
    torch._dynamo.reset()
    model = tiny_model(num_layers=3, num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    cache = loki_static_cache(model, max_cache_len=20, batch_size=1)
    ids = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    kw = {_cache_kw(model): cache}
    with torch.no_grad():
        model(ids, cache_position=torch.arange(8), use_cache=True, **kw)
        step = torch.compile(model.forward, fullgraph=True, backend=backend)
        step(input_ids=ids[:, :1], cache_position=torch.tensor([8]), position_ids=torch.tensor([[8]]),
             use_cache=True, **kw)
    targets = [str(n.target) for n in graphs[0].graph.nodes]
    assert sum("decode_step" in t for t in targets) == 3
    assert sum("argmax" in t for t in targets) == 2


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_prefix", [True, False])
def test_write_rotated_equals_reference(dtype, with_prefix):
    """The fused cache write (rotate, store key, value and prefix at the positions) equals rotate_keys +
    index_copy_, and leaves every other position untouched."""
    from loki.kernels.cache_write import write_rotated, write_rotated_reference
    from loki.testing.inputs import random_orthogonal

    if not (INTERPRET or HAS_CUDA):
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1")
    dev = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(7)
    B, HKV, S, D, L, dp = 2, 3, 20, 32, 3, 8
    P = random_orthogonal(HKV, D, seed=2).to(dev)
    k = torch.randn(B, HKV, L, D, generator=g).to(dev, dtype)
    v = torch.randn(B, HKV, L, D, generator=g).to(dev, dtype)
    pos = torch.tensor([4, 9, 17], device=dev)
    caches = []
    for fn in (write_rotated, write_rotated_reference):
        keys = torch.full((B, HKV, S, D), 3.0, dtype=dtype, device=dev)
        values = torch.full_like(keys, 5.0)
        prefix = torch.full((B, HKV, S, dp), 7.0, dtype=dtype, device=dev) if with_prefix else None
        fn(keys, values, prefix, k, v, P, pos)
        caches.append((keys, values, prefix))
    (k1, v1, p1), (k2, v2, p2) = caches
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(k1, k2, **tol)
    assert torch.equal(v1, v2)
    others = [i for i in range(S) if i not in pos.tolist()]
    assert bool((k1[:, :, others] == 3.0).all()) and bool((v1[:, :, others] == 5.0).all())
    if with_prefix:
        torch.testing.assert_close(p1, p2, **tol)
        torch.testing.assert_close(p1[:, :, pos.tolist()], k1[:, :, pos.tolist(), :dp])
