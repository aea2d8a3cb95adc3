"""enable_loki / disable_loki on tiny random HF models (fp32, CPU): exactness at d = D, k = S, the rotated
cache, left padding, GQA selection modes, errors, and the decode step against the PyTorch reference."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loki.basis import BasisError, PCABasis  # noqa: E402
from loki.integrations import transformers as lt  # noqa: E402
from loki.integrations.transformers import (  # noqa: E402
    disable_loki,
    enable_loki,
    loki_attention_forward,
    loki_cache,
    teacher_forced_attention,
)
from loki.integrations.transformers import layers as lt_layers  # noqa: E402
from loki.integrations.transformers.step import build_step_plan  # noqa: E402
from loki.reference import loki_attention, rotate_keys, rotate_query  # noqa: E402
from loki.testing.models import tiny_config, tiny_model  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2"]
NEW_TOKENS = 8


def _basis(model, seed=1, **meta) -> PCABasis:
    c = model.config
    return PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=seed, **meta)


def _generate(model, ids, attention_mask=None, n=NEW_TOKENS):
    kw = {} if attention_mask is None else {"attention_mask": attention_mask}
    return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.base_model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def _prompt(n, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (1, n), generator=g)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gqa_select", ["query", "kv"])
def test_full_budget_generation_equals_unpatched(arch, gqa_select):
    ref = tiny_model(arch, num_heads=4, num_kv_heads=2)
    model = tiny_model(arch, num_heads=4, num_kv_heads=2)
    ids = _prompt(11)
    expected = _generate(ref, ids)
    enable_loki(model, _basis(model), k=1.0, d=model.config.head_dim, gqa_select=gqa_select)
    assert model.config._attn_implementation == "loki"
    assert torch.equal(_generate(model, ids), expected)


def test_full_budget_decode_semantics_logits_equal_unpatched():
    ref, model = tiny_model("llama"), tiny_model("llama")
    ids = _prompt(13)
    expected = ref(ids).logits
    enable_loki(model, _basis(model), k=1.0, d=1.0, semantics="decode")
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(ids, use_cache=False).logits, expected, atol=1e-5, rtol=1e-5)


def test_sparse_decode_semantics_changes_logits():
    ref, model = tiny_model("llama"), tiny_model("llama")
    ids = _prompt(16)
    enable_loki(model, _basis(model), k=0.25, d=0.25, semantics="decode")
    assert not torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cache_holds_rotated_keys(arch):
    ref, model = tiny_model(arch), tiny_model(arch)
    basis = _basis(model)
    enable_loki(model, basis, k=0.5, d=0.5)
    ids = _prompt(9)
    ref_cache = _output_cache(ref(ids, use_cache=True))
    cache = _output_cache(model(ids, use_cache=True))
    for l in range(model.config.num_hidden_layers):
        assert isinstance(cache.layers[l], lt.LokiDynamicLayer)
        want = rotate_keys(ref_cache.layers[l].keys, basis.layer(l))
        torch.testing.assert_close(cache.layers[l].keys, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.layers[l].values, ref_cache.layers[l].values)  # values not rotated


def test_keys_rotated_once_per_token(monkeypatch):
    model = tiny_model("llama")
    enable_loki(model, _basis(model), k=0.5, d=0.5)
    rotated_tokens = []
    real = lt_layers.write_tokens

    def counting(store, keys, values, prefix, k_new, *a, **kw):
        rotated_tokens.append(k_new.shape[-2])
        return real(store, keys, values, prefix, k_new, *a, **kw)

    monkeypatch.setattr(lt_layers, "write_tokens", counting)
    ids = _prompt(10)
    out = _generate(model, ids, n=5)
    L = model.config.num_hidden_layers
    assert sum(rotated_tokens) == L * (out.shape[1] - 1)  # every token once per layer, the last one never fed


def test_explicit_loki_cache_passed_to_generate():
    ref, model = tiny_model("llama"), tiny_model("llama")
    ids = _prompt(7)
    enable_loki(model, _basis(model), k=1.0, d=1.0)
    cache = loki_cache(model)
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **{_cache_kwarg(model): cache})
    assert torch.equal(out, _generate(ref, ids))
    assert cache.get_seq_length() == out.shape[1] - 1


@pytest.mark.parametrize(
    "method,kw",
    [
        pytest.param("loki", dict(k=0.5, d=0.5), id="loki-query"),
        pytest.param("loki", dict(k=3, d=4, gqa_select="kv"), id="loki-kv"),
        pytest.param("exact_topk", dict(k=0.5), id="exact_topk"),
        pytest.param("pcaattn", dict(d=4), id="pcaattn"),
        pytest.param("sparq", dict(k=0.5, d=4), id="sparq"),
        pytest.param("h2o", dict(k=0.5), id="h2o"),
    ],
)
def test_left_padded_batch_equals_one_by_one(method, kw):
    model = tiny_model("llama", num_heads=6, num_kv_heads=2)
    enable_loki(model, _basis(model), method=method, **kw)
    prompts = [_prompt(n, seed=n)[0] for n in (5, 12, 9)]
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = p
        mask[i, P - len(p):] = 1
    batched = _generate(model, ids, attention_mask=mask)[:, P:]
    for i, p in enumerate(prompts):
        single = _generate(model, p[None])[0, len(p):]
        assert torch.equal(batched[i], single), f"sequence {i} differs"


def test_sparse_generation_differs_from_dense():
    ref, model = tiny_model("llama"), tiny_model("llama")
    ids = _prompt(24)
    enable_loki(model, _basis(model), k=0.1, d=0.25)
    lp_ref = torch.log_softmax(ref(ids).logits[:, -1], -1)
    # decode one token sparsely: feed the prompt minus its last token, then the last token as a decode step
    cache = loki_cache(model)
    model(ids[:, :-1], **{_cache_kwarg(model): cache})
    lp = torch.log_softmax(model(ids[:, -1:], **{_cache_kwarg(model): cache}).logits[:, -1], -1)
    assert not torch.allclose(lp, lp_ref, atol=1e-4)


def test_disable_restores_original_behaviour():
    ref, model = tiny_model("llama"), tiny_model("llama")
    ids = _prompt(10)
    expected = _generate(ref, ids)
    before = model.config._attn_implementation
    enable_loki(model, _basis(model), k=0.25, d=0.25)
    disable_loki(model)
    assert model.config._attn_implementation == before
    assert not lt.is_loki_enabled(model)
    assert torch.equal(_generate(model, ids), expected)
    assert all(not hasattr(m, "_loki") for m in model.modules())


@pytest.mark.parametrize("explicit", [{}, {"gqa_select": "auto", "aggregate": "auto"}, {"gqa_select": "query"}],
                         ids=["defaults", "auto", "query"])
def test_decode_step_matches_reference_at_sparse_setting(explicit):
    """The defaults on a GQA model are one selection per KV group with softmax-normalised scores (kv, softmax-max),
    as "auto" resolves them; an explicit "query" keeps per-query-head selection.  Each decode step equals the
    reference in the resolved mode."""
    model = tiny_model("llama", num_heads=6, num_kv_heads=2)
    basis = _basis(model)
    enable_loki(model, basis, k=0.25, d=0.25, **explicit)
    cache = loki_cache(model)
    model(_prompt(23), **{_cache_kwarg(model): cache})
    cache.crop(-1)  # the query below is the 23rd token, attending over the 23 keys in the cache
    layer_idx = 1
    attn = model.model.layers[layer_idx].self_attn
    k_hat, v = cache.layers[layer_idx].keys, cache.layers[layer_idx].values
    k_hat, v = torch.cat([k_hat, torch.randn_like(k_hat[:, :, :1])], 2), torch.cat([v, torch.randn_like(v[:, :, :1])],
                                                                                   2)
    B, HKV, S, D = k_hat.shape
    q = torch.randn(B, model.config.num_attention_heads, 1, D)
    state = lt.state_of(model)
    state.plan = build_step_plan(settings=state.settings, B=B, L=1, device="cpu", cache=cache, attention_mask=None,
                                 windows=[None] * model.config.num_hidden_layers,
                                 num_layers=model.config.num_hidden_layers, needs_grad=False)
    try:
        out, weights = loki_attention_forward(attn, q, k_hat, v, None, scaling=attn.scaling)
    finally:
        state.plan = None
    assert weights is None and out.shape == (B, 1, q.shape[1], D)
    cfg = state.settings
    mode = ("query", "sum") if explicit.get("gqa_select") == "query" else ("kv", "softmax-max")
    assert (cfg.gqa_select, cfg.aggregate) == mode  # what enable_loki resolved and runs
    want = loki_attention(rotate_query(q[:, :, 0], basis.layer(layer_idx)), k_hat, v, d=0.25, k=0.25,
                          gqa_select=mode[0], aggregate=mode[1], scale=attn.scaling)
    torch.testing.assert_close(out[:, 0], want, atol=1e-5, rtol=1e-5)


def test_default_selection_follows_the_model():
    """enable_loki's defaults: kv + softmax-max on a GQA model, per query head (aggregate "sum") on a model with as
    many KV heads as query heads, per query head for the other methods; explicit settings are kept."""
    gqa, mha = tiny_model("llama", num_heads=4, num_kv_heads=2), tiny_model("llama", num_heads=4, num_kv_heads=4)
    resolved = lambda m: (lt.state_of(m).settings.gqa_select, lt.state_of(m).settings.aggregate)  # noqa: E731
    enable_loki(gqa, _basis(gqa), k=0.25, d=0.25)
    assert resolved(gqa) == ("kv", "softmax-max")
    enable_loki(mha, PCABasis.random(2, 4, 16, seed=1), k=0.25, d=0.25)
    assert resolved(mha) == ("query", "sum")
    enable_loki(gqa, None, k=0.25, method="exact_topk")
    assert resolved(gqa) == ("query", "sum")
    enable_loki(gqa, _basis(gqa), k=0.25, d=0.25, gqa_select="kv", aggregate="sum")
    assert resolved(gqa) == ("kv", "sum")
    enable_loki(gqa, _basis(gqa), k=0.25, d=0.25, gqa_select="query")
    assert resolved(gqa) == ("query", "sum")
    enable_loki(gqa, None, k=0.25, method="exact_topk", gqa_select="kv")
    assert resolved(gqa) == ("kv", "sum")  # "auto" aggregate: softmax-max for method "loki" only
    with pytest.raises(ValueError, match=r"gqa_select must be one of \('auto', 'query', 'kv'\)"):
        enable_loki(gqa, _basis(gqa), gqa_select="group")


def test_teacher_forced_rows_match_decode_reference():
    g = torch.Generator().manual_seed(3)
    B, HQ, HKV, L, D = 2, 4, 2, 6, 16
    S = L
    q = torch.randn(B, HQ, L, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    P = PCABasis.random(1, HKV, D, seed=5).layer(0)
    for mode in (("query", "sum"), ("kv", "softmax-max")):
        out = teacher_forced_attention(q, k, v, method="loki", k=0.5, d=0.5, P=P, chunk_elements=HKV * S * D * 3,
                                       gqa_select=mode[0], aggregate=mode[1])
        q_hat, k_hat = rotate_query(q.transpose(1, 2).reshape(B * L, HQ, D), P), rotate_keys(k, P)
        for i in range(L):
            want = loki_attention(q_hat.view(B, L, HQ, D)[:, i], k_hat[:, :, : i + 1], v[:, :, : i + 1], d=0.5,
                                  k=0.5, gqa_select=mode[0], aggregate=mode[1])
            torch.testing.assert_close(out[:, :, i], want, atol=1e-5, rtol=1e-5)
    # "auto" on a GQA shape is the shared softmax-max selection, as enable_loki resolves it
    torch.testing.assert_close(teacher_forced_attention(q, k, v, method="loki", k=0.5, d=0.5, P=P), out)


def test_wrong_basis_is_refused():
    model = tiny_model("llama")
    other = tiny_config("llama", rope_theta=5e5)
    basis = _basis(model, config_hash=None)
    from loki.basis import config_fields, config_fingerprint

    basis.config_hash, basis.config_fields, basis.model_name = (
        config_fingerprint(other), config_fields(other), "another-model")
    with pytest.raises(BasisError, match="calibrated for another model"):
        enable_loki(model, basis, k=0.25, d=0.25)
    wrong_shape = PCABasis.random(3, 2, 16)
    with pytest.raises(BasisError, match="num_hidden_layers"):
        enable_loki(model, wrong_shape, k=0.25, d=0.25)
    assert model.config._attn_implementation != "loki"


def test_unsupported_architecture_is_refused():
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64)
    model = transformers.GPT2LMHeadModel(copy.deepcopy(config))
    with pytest.raises(lt.UnsupportedModelError, match="llama") as err:
        enable_loki(model, None, method="dense")
    assert "gpt2" in str(err.value) and "mistral" in str(err.value) and "qwen2" in str(err.value)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(k=0), "k"),
        (dict(k=1.5), "k"),
        (dict(k=-0.5), "k"),
        (dict(k="half"), "k"),
        (dict(d=0), "d"),
        (dict(d=17), "d"),
        (dict(d=0.0), "d"),
        (dict(method="magic"), "method"),
        (dict(gqa_select="head"), "gqa_select"),
        (dict(semantics="later"), "semantics"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    model = tiny_model("llama")
    args = dict(k=0.25, d=0.25)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=name):
        enable_loki(model, _basis(model), **args)


def test_basis_required_for_loki():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="basis"):
        enable_loki(model, None, k=0.25, d=0.25)


def test_basis_from_file(tmp_path):
    ref, model = tiny_model("llama"), tiny_model("llama")
    basis = _basis(model)
    path = tmp_path / "basis.safetensors"
    basis.save(path)
    ids = _prompt(6)
    enable_loki(model, str(path), k=1.0, d=1.0)
    assert torch.equal(_generate(model, ids, n=4), _generate(ref, ids, n=4))


@pytest.mark.interpreter
@torch.no_grad()  # the Triton backend refuses inputs that require grad
def test_triton_backend_decode_step_matches_torch_backend(triton_device):
    pytest.importorskip("triton")
    try:
        import loki.kernels.decode  # noqa: F401
    except ModuleNotFoundError:
        pytest.skip("loki.kernels.decode is not available")

    device = triton_device
    logits = {}
    for backend in ("torch", "triton"):
        model = tiny_model("llama", num_layers=1).to(device)
        enable_loki(model, _basis(model), k=0.5, d=0.5, backend=backend)
        ids = _prompt(20).to(device)
        cache = loki_cache(model)
        model(ids[:, :-1], **{_cache_kwarg(model): cache})
        logits[backend] = model(ids[:, -1:], **{_cache_kwarg(model): cache}).logits
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


@torch.no_grad()  # the Triton backend refuses inputs that require grad
def test_triton_path_keeps_and_uses_a_contiguous_key_prefix(monkeypatch, triton_device):
    """With the Triton backend the cache keeps K_hat[..., :d] contiguous beside the keys (appended per
    token) and the decode step hands it to the kernels; results equal the torch backend."""

    from loki.kernels.plan import DecodeRun

    device = triton_device
    seen = []
    original = DecodeRun.step

    def spy(self, **kwargs):
        seen.append(kwargs.get("k_prefix"))
        return original(self, **kwargs)

    monkeypatch.setattr(DecodeRun, "step", spy)  # the kernels' route runs the model's DecodeRun
    model = tiny_model("llama", num_layers=1).to(device)
    enable_loki(model, _basis(model), k=0.5, d=0.25, backend="triton", score_format="native")
    ids = _prompt(20).to(device)
    cache = loki_cache(model)
    model(ids[:, :-1], **{_cache_kwarg(model): cache})
    layer = cache.layers[0]
    dp = 4  # d = 0.25 of head_dim 16
    assert layer.loki.prefix.shape[-2:] == (19, dp)
    assert layer.loki.prefix.stride()[-2:] == (dp, 1)  # rows of dp contiguous values (a buffer with capacity)
    logits = model(ids[:, -1:], **{_cache_kwarg(model): cache}).logits
    torch.testing.assert_close(layer.loki.prefix, layer.keys[..., :dp])
    assert seen and seen[-1] is not None and seen[-1].shape[-2] == 20
    disable_loki(model)
    enable_loki(model, _basis(model), k=0.5, d=0.25, backend="torch", score_format="native")
    cache2 = loki_cache(model)
    model(ids[:, :-1], **{_cache_kwarg(model): cache2})
    assert cache2.layers[0].loki.prefix is None  # the torch path keeps no prefix
    ref = model(ids[:, -1:], **{_cache_kwarg(model): cache2}).logits
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@torch.no_grad()  # the Triton backend refuses inputs that require grad
def test_key_prefix_is_appended_in_place(triton_device):
    """Keys, values and the key prefix grow inside buffers with spare capacity (no copy of the whole cache per
    decode step) and the prefix stays equal to the rotated keys' first dims through decode steps, crop and beam
    reordering."""

    device = triton_device
    model = tiny_model("llama", num_layers=1).to(device)
    enable_loki(model, _basis(model), k=0.5, d=0.25, backend="triton", score_format="native")
    kw = _cache_kwarg(model)
    ids = _prompt(30).to(device)
    cache = loki_cache(model)
    model(ids[:, :20], **{kw: cache})
    layer = cache.layers[0]
    dp = 4  # d = 0.25 of head_dim 16
    buf = layer._buffers
    assert buf[0].shape[-2] >= 20 + 10
    for t in range(20, 30):
        model(ids[:, t:t + 1], **{kw: cache})
        assert all(a is b for a, b in zip(layer._buffers, buf))  # written in place, no reallocation
        assert layer.keys.data_ptr() == buf[0].data_ptr() and layer.loki.prefix.data_ptr() == buf[2].data_ptr()
        torch.testing.assert_close(layer.loki.prefix, layer.keys[..., :dp])
    cache.crop(-5)  # drop the last 5 tokens (a negative count works on every transformers 5.x)
    assert layer.keys.shape[-2] == 25
    model(ids[:, 25:26], **{kw: cache})
    torch.testing.assert_close(layer.loki.prefix, layer.keys[..., :dp])
    cache.reorder_cache(torch.zeros(1, dtype=torch.long, device=device))
    model(ids[:, 26:27], **{kw: cache})
    assert layer.loki.prefix.shape[-2] == layer.keys.shape[-2] == 27
    torch.testing.assert_close(layer.loki.prefix, layer.keys[..., :dp])


@pytest.mark.parametrize("gqa_select", ["query", "kv"])
@torch.no_grad()  # the Triton backend refuses inputs that require grad
def test_triton_decode_fast_path_with_padding_equals_torch_backend(gqa_select, triton_device):
    """The Triton decode path (visible ranges, budgets and bound computed once per forward, the kernels'
    step called directly) gives what the torch backend gives on a left-padded batch, over several steps."""

    device = triton_device
    ids = torch.cat([_prompt(24, seed=1), _prompt(24, seed=2)]).to(device)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding of the second sequence
    logits = {}
    for backend in ("torch", "triton"):
        model = tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2).to(device)
        enable_loki(model, _basis(model), k=0.5, d=0.5, backend=backend, gqa_select=gqa_select)
        kw = _cache_kwarg(model)
        cache = loki_cache(model)
        model(ids[:, :20], attention_mask=mask[:, :20], **{kw: cache})
        steps = []
        for t in range(20, 24):  # decode steps: the third and later layers replay the recorded launches
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], **{kw: cache}).logits)
        logits[backend] = torch.cat(steps, dim=1)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_dynamic_layer_regrows_its_buffers_without_losing_a_token():
    """A dynamic Loki layer writes into buffers with spare capacity and regrows them when a write does not fit:
    every key, rotated once, and every value stays where it was, across several regrowths."""
    model = tiny_model("llama")
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="torch")
    layer = loki_cache(model).layers[0]
    P = lt.state_of(model).transforms.layer(0).key
    g = torch.Generator().manual_seed(3)
    HKV, D = P.shape[0], P.shape[-1]
    chunks = [torch.randn(2, HKV, n, D, generator=g) for n in (10, 600, 1, 1, 700)]
    caps = []
    for c in chunks:
        layer.update(c, 2 * c)
        caps.append(layer._buffers[0].shape[2])
    assert caps[0] < caps[1] < caps[4]  # regrown twice (the first capacity holds 10 + 256 tokens)
    keys = torch.cat(chunks, 2)
    torch.testing.assert_close(layer.keys, rotate_keys(keys, P), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.values, 2 * keys)
    assert layer.keys.data_ptr() == layer._buffers[0].data_ptr()  # the filled part of the buffer, not a copy
