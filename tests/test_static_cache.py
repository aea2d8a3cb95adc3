"""The static Loki cache (``loki_cache(static=True)``, ``generate(cache_implementation="static")``), the
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
    LokiStaticLayer,
    disable_loki,
    enable_loki,
    loki_cache,
    state_of,
)
from loki.integrations.transformers import run as lt_run  # noqa: E402
from loki.kernels import decode_attention, plan_decode  # noqa: E402
from loki.kernels.ops import decode_step_op  # noqa: E402
from loki.testing.decode import batch_inputs, decode_logits  # noqa: E402
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
    """Count the decode steps that run over a Loki static cache."""
    calls = []
    real = lt_run.run_decode

    def spy(state, plan, *a, **k):
        if plan.static:
            calls.append(1)
        return real(state, plan, *a, **k)

    monkeypatch.setattr("loki.integrations.transformers.attention.run_decode", spy)
    return calls


def _generate_logits(model, ids, mask, **kw):
    """Greedy ``generate``; returns the tokens and the logits of every step ([NEW, B, V] fp32)."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack([x.float() for x in out.logits])


@pytest.mark.parametrize("backend,dev", [("torch", "cpu"), pytest.param("triton", "cpu", marks=pytest.mark.interpreter),
                                         pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("gqa_select", ["query", "kv"])
@pytest.mark.parametrize("padded", [False, True], ids=["B1-unpadded", "B2-left-padded"])
def test_static_cache_generate_equals_dynamic(backend, dev, gqa_select, padded, monkeypatch):
    if backend == "triton" and (dev == "cpu") != INTERPRET:
        pytest.skip("the Triton backend runs on CUDA, or on the CPU under TRITON_INTERPRET=1")
    model = tiny_model(num_heads=4, num_kv_heads=2).to(dev)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend=backend, gqa_select=gqa_select)
    ids, mask = (t.to(dev) for t in _prompt())
    if not padded:
        ids, mask = ids[:1], None
    dyn_tokens, dynamic = _generate_logits(model, ids, mask)
    calls = _spy_static(monkeypatch)
    cache = loki_cache(model, static=True, max_cache_len=PROMPT + NEW + 3)
    tokens, static = _generate_logits(model, ids, mask, **{_cache_kw(model): cache})
    assert len(calls) == model.config.num_hidden_layers * (NEW - 1)  # every decode step took the static path
    assert isinstance(cache.layers[0], LokiStaticLayer)
    torch.testing.assert_close(static, dynamic, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, dyn_tokens)
    calls.clear()
    tokens, converted = _generate_logits(model, ids, mask, cache_implementation="static")
    torch.testing.assert_close(converted, dynamic, rtol=1e-5, atol=1e-5)
    assert len(calls) == model.config.num_hidden_layers * (NEW - 1)


def _doc_decode_loop():
    """The ``greedy_decode`` of docs/fast-decode.md's decode-loop block, executed as written."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "fast-decode.md").read_text()
    m = re.search(r"<!-- doc-snippet: decode-loop -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/fast-decode.md has no decode-loop block"
    ns: dict = {}
    exec(compile(m.group(1), "docs/fast-decode.md:decode-loop", "exec"), ns)  # noqa: S102 - the doc's own code
    return ns["greedy_decode"]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced-whole"])
def test_the_documented_decode_loop_gives_generates_logits(traced):
    """docs/fast-decode.md's loop over the (compiled) forward on a static Loki cache: generate's greedy tokens and
    the logits of every generated token, eager and with the step traced whole (aot_eager)."""
    torch._dynamo.reset()
    greedy_decode = _doc_decode_loop()
    model = tiny_model(num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    ids = _prompt(B=2)[0]  # unpadded
    want_tokens, want = _generate_logits(model, ids, None)
    cache = loki_cache(model, static=True, max_cache_len=PROMPT + NEW)
    step = torch.compile(model.forward, fullgraph=True, backend="aot_eager") if traced else None
    got_ids, got = greedy_decode(model, ids, cache, NEW, step=step, return_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_ids[:, :PROMPT], ids) and torch.equal(got_ids[:, PROMPT:], want_tokens)


@pytest.mark.gpu
def test_gpu_the_documented_decode_loop_with_cuda_graphs_gives_generates_logits():
    """The same loop with its default step on CUDA (inductor, CUDA graphs; the Triton kernels) against
    ``generate`` on the same kind of cache (transformers compiles its own steps), fp32."""
    torch._dynamo.reset()
    greedy_decode = _doc_decode_loop()
    model = tiny_model(num_heads=4, num_kv_heads=2).cuda()
    enable_loki(model, _basis(model), k=0.5, d=0.5)
    ids = _prompt(B=2)[0].cuda()
    cache = loki_cache(model, static=True, max_cache_len=PROMPT + NEW)
    want_tokens, want = _generate_logits(model, ids, None, **{_cache_kw(model): cache})
    cache = loki_cache(model, static=True, max_cache_len=PROMPT + NEW)
    got_ids, got = greedy_decode(model, ids, cache, NEW, return_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_ids[:, PROMPT:], want_tokens)


def test_generate_on_a_static_cache_passes_one_mask_shape_to_every_step(monkeypatch):
    """The mask ``generate`` prepares for a static cache keeps its width (the cache's allocation) at every step, so a
    compiled decode step sees inputs of one shape (a growing mask recompiles it with a dynamic length and records a
    CUDA graph per length); the left padding it carries still reaches the step plan (logits equal the dynamic
    cache's)."""
    import loki.integrations.transformers.enable as en

    model = tiny_model(num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    ids, mask = _prompt()
    _, dynamic = _generate_logits(model, ids, mask)
    widths, real = [], en.build_step_plan

    def spy(**kw):
        m = kw["attention_mask"]
        widths.append(None if m is None else tuple(m.shape))
        return real(**kw)

    monkeypatch.setattr(en, "build_step_plan", spy)
    n = PROMPT + NEW + 3
    _, static = _generate_logits(model, ids, mask, **{_cache_kw(model): loki_cache(model, static=True,
                                                                                     max_cache_len=n)})
    assert len(widths) == NEW and set(widths) == {(ids.shape[0], n)}
    torch.testing.assert_close(static, dynamic, rtol=1e-5, atol=1e-5)
    # the builder pads only a 2-D mask shorter than the keys, with False, and passes the rest through
    short = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert en._padding_mask(attention_mask=short, kv_length=5, kv_offset=0).tolist() == [
        [False, True, True, False, False], [True, True, True, False, False]]
    assert en._padding_mask(attention_mask=short, kv_length=3, kv_offset=0) is short
    assert en._padding_mask(attention_mask=None, kv_length=5) is None


def test_static_cache_stores_rotated_keys_and_prefix():
    model = tiny_model(num_heads=4, num_kv_heads=2)
    basis = _basis(model)
    enable_loki(model, basis, k=0.5, d=0.25, backend="torch")
    cache = loki_cache(model, static=True, max_cache_len=20, batch_size=1)
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
    assert not isinstance(restored, LokiStaticLayer)
    torch.testing.assert_close(restored.keys[:, :, :5], k, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padded", [False, True], ids=["B1-unpadded", "B2-left-padded"])
def test_full_budget_static_generation_equals_dense(padded):
    ref = tiny_model(num_heads=4, num_kv_heads=2)
    model = tiny_model(num_heads=4, num_kv_heads=2)
    ids, mask = _prompt()
    if not padded:
        ids, mask = ids[:1], None
    tokens, expected = _generate_logits(ref, ids, mask)
    enable_loki(model, _basis(model), k=1.0, d=model.config.head_dim, backend="torch")
    cache = loki_cache(model, static=True, max_cache_len=PROMPT + NEW)
    got_tokens, got = _generate_logits(model, ids, mask, **{_cache_kw(model): cache})
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_tokens, tokens)


@pytest.mark.parametrize("kind", ["B1-unpadded", "B3-ragged"])
def test_compiled_fullgraph_static_decode_equals_eager(kind):
    """The decode steps traced whole (``fullgraph=True``, aot_eager: no C++ build) give eager's logits."""
    torch._dynamo.reset()
    batch = batch_inputs(kind, prompt_len=PROMPT, steps=4)
    logits = []
    for compiled in (False, True):
        model = tiny_model(num_heads=4, num_kv_heads=2)
        enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
        cache = loki_cache(model, static=True, max_cache_len=PROMPT + 6)
        step = torch.compile(model.forward, fullgraph=True, backend="aot_eager") if compiled else None
        logits.append(decode_logits(model, batch, cache=cache, step=step))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_reference_step_runs_eagerly_inside_a_compiled_step_and_warns_once(monkeypatch):
    """The reference route on CUDA (backend="torch", or "auto" while autograd records) is not traced under
    torch.compile (Inductor does not compile it, and a refusal raised while tracing never reaches the user: Dynamo
    breaks the graph on the raise and reruns the frame eagerly): it runs eagerly (``run.reference_outside_graph``),
    gives eager's result, and warns once per model."""
    import loki.reference.dispatch as dispatch
    from loki.integrations.transformers.run import reference_outside_graph

    torch._dynamo.reset()
    model = tiny_model(num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    state = state_of(model)
    x = make_decode_inputs(2, 4, 2, 24, 16, ragged=True, left_pad=True, seed=5)
    counts = torch.ceil((x.lengths - x.starts).double() * 0.5 - 1e-9).long()
    kw = dict(k=0.5, d=8, lengths=x.lengths, starts=x.starts, gqa_select="kv", aggregate="softmax-max", scale=0.25,
              counts=counts)
    traced = []
    real = dispatch.loki_attention

    def spy(*a, **k):
        traced.append(torch.compiler.is_compiling())
        return real(*a, **k)

    monkeypatch.setattr(dispatch, "loki_attention", spy)
    expected = dispatch.decode_rows("loki", x.q, x.k_cache, x.v_cache, **kw)

    def step(q, k, v):
        return reference_outside_graph(state, torch.compiler.is_compiling(), dispatch.decode_rows, "loki", q, k, v,
                                       **kw) * 1.0

    compiled = torch.compile(step, backend="eager")
    with pytest.warns(RuntimeWarning, match="runs the PyTorch reference .backend='torch'.*eagerly"):
        got = compiled(x.q, x.k_cache, x.v_cache)
    torch.testing.assert_close(got, expected)
    assert traced == [False, False], traced  # called eagerly both times, never traced
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(compiled(x.q, x.k_cache, x.v_cache), expected)  # once per model


def test_custom_op_registered_per_device_and_traceable():
    """loki::decode_step: one budget input (counts); the CPU registration is the reference."""
    assert hasattr(torch.ops.loki, "decode_step")
    x = make_decode_inputs(2, 4, 2, 40, 16, ragged=True, left_pad=True, seed=3)
    counts = torch.ceil((x.lengths - x.starts).double() * 0.25 - 1e-9).long()
    args = (x.q, x.k_cache, x.v_cache, None, x.lengths, x.starts, counts, 4, 16, "query", "sum", 0.25)
    out = decode_step_op(*args)
    ref = decode_attention(x.q, x.k_cache, x.v_cache, d=4, k=0.25, lengths=x.lengths, starts=x.starts,
                           backend="torch", scale=0.25, gqa_select="query", aggregate="sum")
    torch.testing.assert_close(out, ref)
    torch.library.opcheck(torch.ops.loki.decode_step.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    # other budgets through the same input: every token kept (counts = valid lengths) is dense attention
    full = (x.lengths - x.starts).long()
    dense = decode_attention(x.q, x.k_cache, x.v_cache, d=16, k=10_000, lengths=x.lengths, starts=x.starts,
                             backend="torch", gqa_select="query", aggregate="sum")
    torch.testing.assert_close(decode_step_op(x.q, x.k_cache, x.v_cache, None, x.lengths, x.starts, full, 16, 48,
                                              "kv", "max", 0.25), dense)


def test_step_plan_from_the_2d_mask_and_the_cache():
    """Ranges are built once per forward from the 2-D mask and the cache's write counter; holes are refused; a
    missing mask with a static cache sees only the written slots."""
    from loki.integrations.transformers.step import build_step_plan
    from loki.settings import LokiSettings

    def plan(k, **kw):
        s = LokiSettings(k=k, backend="torch").resolve_shapes(num_q_heads=4, num_kv_heads=2, head_dim=16)
        return build_step_plan(settings=s, device="cpu", needs_grad=False, **kw)

    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    meta = plan(k=0.5, B=2, L=1, cache=None, attention_mask=mask, windows=[None], num_layers=1)
    g = meta.layer(0, 1)  # no cache: one key, the new token
    assert g.S == 1
    model = tiny_model(num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    cache = loki_cache(model, static=True, max_cache_len=16, batch_size=1)
    with torch.no_grad():
        model(torch.randint(1, 256, (1, 5)), use_cache=True, **{_cache_kw(model): cache})
    meta = plan(k=3, B=1, L=1, cache=cache, attention_mask=None,
                                  windows=[None, None], num_layers=2)
    g = meta.layer(1, 16)
    assert g.dec_starts.tolist() == [0] and g.dec_lengths.tolist() == [6] and g.counts.tolist() == [3]
    assert g.width == 16
    holes = torch.tensor([[1, 1, 0, 1, 1, 1]])
    with pytest.raises(LokiError, match="contiguous"):
        plan(k=3, B=1, L=1, cache=cache, attention_mask=holes, windows=[None, None],
                               num_layers=2)
    left = torch.tensor([[0, 0, 1, 1, 1, 1]])
    g = plan(k=0.5, B=1, L=1, cache=cache, attention_mask=left,
                               windows=[None, None], num_layers=2).layer(0, 16)
    assert g.dec_starts.tolist() == [2] and g.dec_lengths.tolist() == [6] and g.counts.tolist() == [2]
    with pytest.raises(LokiError, match="mask covers 4 tokens"):
        plan(k=3, B=1, L=1, cache=cache, attention_mask=left[:, :4],
                               windows=[None, None], num_layers=2)


def test_static_cache_arguments_and_h2o_refused():
    model = tiny_model(num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    with pytest.raises(ValueError, match="max_cache_len"):
        loki_cache(model, static=True, max_cache_len=0)
    with pytest.raises(ValueError, match="batch_size"):
        loki_cache(model, static=True, max_cache_len=8, batch_size=-1)
    enable_loki(model, None, k=0.5, d=0.5, method="h2o")
    with pytest.raises(LokiError, match="h2o"):
        loki_cache(model, static=True, max_cache_len=8)
    disable_loki(model)
    with pytest.raises(LokiError, match="not enabled"):
        loki_cache(model, static=True, max_cache_len=8)


@pytest.mark.interpreter
@pytest.mark.parametrize("gqa_select,k", [("query", 0.25), ("kv", 9)])
def test_plan_decode_equals_decode_attention(gqa_select, k, triton_device):
    dev = triton_device
    x = make_decode_inputs(3, 4, 2, 120, 32, ragged=True, left_pad=True, seed=5, device=dev)
    prefix = x.k_cache[..., :8].contiguous()
    plan = plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=8, k=k, k_prefix=prefix, gqa_select=gqa_select,
                       aggregate="sum")
    for it in range(4):  # the first run records, later ones replay
        q = x.q + 0.05 * it
        ref = decode_attention(q, x.k_cache, x.v_cache, d=8, k=k, lengths=x.lengths, starts=x.starts,
                               backend="triton", gqa_select=gqa_select, k_prefix=prefix, aggregate="sum")
        out = plan.run(q, x.lengths, x.starts)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert plan.replays == 1, "the plan should replay its recorded launches"
    # the cache may be written in place between runs: the plan reads the new values
    x.v_cache.mul_(2.0)
    torch.testing.assert_close(plan.run(x.q, x.lengths, x.starts),
                               decode_attention(x.q, x.k_cache, x.v_cache, d=8, k=k, lengths=x.lengths,
                                                starts=x.starts, backend="triton", gqa_select=gqa_select,
                                                k_prefix=prefix, aggregate="sum"), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_plan_decode_errors_name_the_argument(triton_device):
    dev = triton_device
    x = make_decode_inputs(2, 4, 2, 64, 16, seed=1, device=dev)
    with pytest.raises(ValueError, match="num_q_heads"):
        plan_decode(x.k_cache, x.v_cache, num_q_heads=3, d=4, k=8, gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="k="):
        plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=4, k=0, gqa_select="query", aggregate="sum")
    with pytest.raises(ValueError, match="gqa_select"):
        plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=4, k=8, gqa_select="heads", aggregate="sum")
    plan = plan_decode(x.k_cache, x.v_cache, num_q_heads=4, d=4, k=8, gqa_select="query", aggregate="sum")
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
@pytest.mark.parametrize("padded", [False, True], ids=["B1-unpadded", "B2-left-padded"])
def test_gpu_compiled_generate_on_static_cache_equals_dynamic(padded):
    """transformers' own compiled generate on the Loki static cache: the logits of the eager dynamic cache."""
    torch._dynamo.reset()
    model = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64).to("cuda")
    enable_loki(model, _basis(model), k=0.5, d=0.25, gqa_select="query")
    ids, mask = _prompt(B=2, n=40)
    ids, mask = ids.cuda(), mask.cuda()
    if not padded:
        ids, mask = ids[:1], None
    tokens, dyn = _generate_logits(model, ids, mask)
    cache = loki_cache(model, static=True, max_cache_len=40 + NEW)
    got_tokens, got = _generate_logits(model, ids, mask, **{_cache_kw(model): cache})
    torch.testing.assert_close(got, dyn, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_tokens, tokens)


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
            make = lambda m=model: loki_cache(m, static=True, max_cache_len=48, batch_size=2)  # noqa: E731
        else:
            make = lambda m=model: transformers.StaticCache(config=m.config, max_cache_len=48)  # noqa: E731
        compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        logits = []
        for step in (model.forward, compiled, compiled, compiled):
            cache = make()
            kw = {_cache_kw(model): cache}
            with torch.no_grad():
                pos = (mask.cumsum(-1) - 1).clamp(min=0)
                model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
                full = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device="cuda")], 1)
                o = step(input_ids=ids[:, -1:], attention_mask=full, position_ids=pos[:, -1:] + 1, use_cache=True,
                         **kw)
                logits.append(o.logits[:, -1].float().clone())
        diffs[name] = max((logits[i] - logits[0]).abs().max().item() for i in (1, 2, 3))
    assert diffs["loki"] <= 2 * diffs["dense"] + 0.05, diffs


@pytest.mark.gpu
def test_gpu_compiled_static_step_with_autograd_on_runs_the_reference_eagerly():
    """torch.compile (inductor) of a static-cache decode step with autograd recording: "auto" takes the PyTorch
    reference (the kernels have no backward), which runs eagerly outside the graph with one warning, and the
    logits are those of the kernels' step under no_grad (fp32)."""
    torch._dynamo.reset()
    model = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64).to("cuda")
    enable_loki(model, _basis(model), k=0.5, d=0.25)
    ids, mask = _prompt(B=2, n=40)
    ids, mask = ids.cuda(), mask.cuda()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    full = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device="cuda")], 1)
    step_kw = dict(input_ids=ids[:, -1:], attention_mask=full, position_ids=pos[:, -1:] + 1, use_cache=True)
    logits = []
    for grad in (False, True):
        cache = loki_cache(model, static=True, max_cache_len=48, batch_size=2)
        kw = {_cache_kw(model): cache}
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **kw)
        if grad:
            compiled = torch.compile(model.forward)
            with pytest.warns(RuntimeWarning, match="runs the PyTorch reference .backend='auto' with autograd"):
                out = compiled(**step_kw, **kw)
        else:
            with torch.no_grad():
                out = model(**step_kw, **kw)
        logits.append(out.logits[:, -1].detach().float())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_gpu_compiled_dynamic_step_on_the_reference_runs_it_eagerly(backend):
    """torch.compile (inductor) of a DynamicCache decode step whose attention is the PyTorch reference
    (backend="torch", or "auto" with autograd recording): the reference runs eagerly outside the graph with one
    warning (before, Inductor failed to compile it), and the logits are eager's."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    model = tiny_model(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64).to("cuda")
    enable_loki(model, _basis(model), k=0.5, d=0.25, backend=backend)
    ids = torch.randint(1, 256, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    logits = []
    for compiled in (False, True):
        cache = DynamicCache(config=model.config)
        kw = {_cache_kw(model): cache}
        with torch.no_grad():
            model(ids, use_cache=True, **kw)
        with torch.set_grad_enabled(backend == "auto"):
            if compiled:
                with pytest.warns(RuntimeWarning, match="runs the PyTorch reference"):
                    out = torch.compile(model.forward)(input_ids=ids[:, -1:], use_cache=True, **kw)
            else:
                out = model(input_ids=ids[:, -1:], use_cache=True, **kw)
        logits.append(out.logits[:, -1].detach().float())
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_whole_graph_compilation_refuses_the_reference_on_cuda_by_name():
    """fast_path_perplexity / generate_retrieval compile whole graphs: backend='torch' on CUDA is refused before
    anything runs, naming the argument (its reference would run outside the graph); the CPU, where the reference
    is the custom op's registration, and the kernels' backends pass."""
    from loki.integrations.transformers.run import check_compiled_backend

    with pytest.raises(ValueError, match=r"fast_path_perplexity\(compile=True\): backend='torch'.*compile=False"):
        check_compiled_backend("torch", "cuda", "fast_path_perplexity(compile=True)")
    check_compiled_backend("torch", "cpu", "x")
    check_compiled_backend("auto", "cuda", "x")
    check_compiled_backend("triton", torch.device("cuda", 0), "x")


def test_compiled_graph_computes_ranges_once_for_all_layers():
    """The traced decode step holds one Loki op per layer and one computation of the mask's span (two argmax)
    shared by every layer: the step metadata is built once per forward, before the layers."""
    torch._dynamo.reset()
    model = tiny_model(num_layers=3, num_heads=4, num_kv_heads=2)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    cache = loki_cache(model, static=True, max_cache_len=20, batch_size=1)
    ids = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    kw = {_cache_kw(model): cache}
    with torch.no_grad():
        model(ids, use_cache=True, **kw)
        step = torch.compile(model.forward, fullgraph=True, backend=backend)
        step(input_ids=ids[:, :1], attention_mask=torch.ones(1, 9, dtype=torch.long),
             position_ids=torch.tensor([[8]]), use_cache=True, **kw)
    targets = [str(n.target) for n in graphs[0].graph.nodes]
    assert sum("decode_step" in t for t in targets) == 3
    assert sum("argmax" in t for t in targets) == 2


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_prefix", [True, False])
@pytest.mark.parametrize("D", [32, 64])
def test_write_rotated_equals_reference(dtype, with_prefix, D, triton_device):
    """The fused cache write (rotate, store key, value and prefix at the positions) equals rotate_keys +
    index_copy_, and leaves every other position untouched (D = 64: two programs per token and head, each
    writing 32 of the dims)."""
    from loki.kernels import cache_write
    from loki.kernels.cache_write import write_rotated, write_rotated_reference
    from loki.testing.inputs import random_orthogonal

    dev = triton_device
    g = torch.Generator().manual_seed(7)
    B, HKV, S, L, dp = 2, 3, 20, 3, 8
    P = random_orthogonal(HKV, D, seed=2).to(dev)
    k = torch.randn(B, HKV, L, D, generator=g).to(dev, dtype)
    v = torch.randn(B, HKV, L, D, generator=g).to(dev, dtype)
    pos = torch.tensor([4, 9, 17], device=dev)
    assert not P.is_contiguous()  # the basis as random_orthogonal gives it: the kernel must still take it
    assert cache_write._kernel_fits(torch.empty(B, HKV, S, D, dtype=dtype, device=dev),
                                    torch.empty(B, HKV, S, D, dtype=dtype, device=dev), None, k, v, P)
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
