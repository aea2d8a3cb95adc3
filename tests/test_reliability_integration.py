"""enable_loki on careless use: generate without a cache, the Triton backend where it cannot run or where a
gradient is wanted, a cache reused after disable_loki or across settings, right-padded batches."""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loki.basis import PCABasis  # noqa: E402
from loki.integrations.transformers import LokiError, disable_loki, enable_loki, loki_cache  # noqa: E402
from loki.testing.models import tiny_model  # noqa: E402

needs_triton = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1")


def _basis(model, seed=1) -> PCABasis:
    c = model.config
    return PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=seed)


def _score_basis(model, seed=3) -> PCABasis:
    """A score-aware pair: P_k = Q diag(s), P_q = Q diag(1/s), so P_q P_k^T = I."""
    b = _basis(model, seed)
    s = torch.linspace(2.0, 0.5, b.head_dim)
    b.query_components = b.components / s
    b.components = b.components * s
    b.kind = "score"
    return b


def _prompt(n, seed=0):
    return torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _kw(model, cache):
    params = inspect.signature(model.base_model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def _dynamic_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


# ------------------------------------------------------------------------------------------------ 1: use_cache
@pytest.mark.parametrize("method", ["loki", "exact_topk", "sparq", "h2o"])
def test_generate_without_a_cache_is_refused_naming_use_cache(method):
    model = tiny_model("llama")
    enable_loki(model, _basis(model), k=0.25, d=0.25, method=method)
    ids = _prompt(12)
    with pytest.raises(LokiError, match=r"use_cache=False.*dense"):
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, use_cache=False)
    with pytest.raises(LokiError, match=r"use_cache=False"):
        model(ids, use_cache=False)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)  # with the cache: fine
    assert out.shape == (1, 15)


def test_without_a_cache_decode_semantics_and_dense_still_run():
    ref, model = tiny_model("llama"), tiny_model("llama")
    ids = _prompt(12)
    enable_loki(model, None, method="dense")
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, use_cache=False),
                       ref.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0))
    enable_loki(model, _basis(model), k=0.25, d=0.25, semantics="decode")
    assert model(ids, use_cache=False).logits.shape == (1, 12, 256)


# ------------------------------------------------------------------------------------------------ 5: triton on CPU
def test_triton_backend_on_a_cpu_model_without_the_interpreter_is_refused(monkeypatch):
    model = tiny_model("llama", num_layers=1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"backend='triton'.*TRITON_INTERPRET.*backend='torch'.*model is on cpu"):
        enable_loki(model, _basis(model), backend="triton")
    assert getattr(model, "_loki", None) is None  # nothing was changed
    enable_loki(model, _basis(model), backend="auto")  # auto takes the PyTorch path on the CPU


@needs_triton
def test_triton_backend_that_cannot_run_any_more_fails_clearly(monkeypatch):
    model = tiny_model("llama", num_layers=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="triton")
    ids = _prompt(10).to(device)
    cache = loki_cache(model)
    with torch.no_grad():
        model(ids[:, :-1], **_kw(model, cache))
        if device == "cpu":  # the interpreter switched off after enable_loki: a clear error, not "0 active drivers"
            monkeypatch.delenv("TRITON_INTERPRET")
            with pytest.raises(LokiError, match="TRITON_INTERPRET"):
                model(ids[:, -1:], **_kw(model, cache))


# ------------------------------------------------------------------------------------------------ 7: grad
@needs_triton
def test_triton_backend_refuses_a_forward_that_wants_gradients():
    model = tiny_model("llama", num_layers=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    enable_loki(model, _basis(model), k=0.5, d=0.5, backend="triton")
    ids = _prompt(10).to(device)
    cache = loki_cache(model)
    with torch.no_grad():
        model(ids[:, :-1], **_kw(model, cache))
    with pytest.raises(LokiError, match=r"requires grad.*no backward.*torch.no_grad\(\)"):
        model(ids[:, -1:], **_kw(model, cache))


def test_torch_backend_gives_gradients_through_decode_steps():
    model = tiny_model("llama", num_layers=1)
    enable_loki(model, _basis(model), k=0.5, d=0.5)  # auto: the differentiable PyTorch path here
    ids = _prompt(10)
    cache = loki_cache(model)
    model(ids[:, :-1], **_kw(model, cache))
    model(ids[:, -1:], **_kw(model, cache)).logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


# ------------------------------------------------------------------------------------------------ 8: cache reuse
def _continue(model, cache, ids, start, n=3):
    with torch.no_grad():
        return torch.cat([model(ids[:, t:t + 1], **_kw(model, cache)).logits for t in range(start, start + n)], 1)


@pytest.mark.parametrize("kind", ["pca", "score"])
def test_cache_filled_under_loki_is_restored_by_disable_loki(kind):
    ref, model = tiny_model("llama"), tiny_model("llama")
    basis = _basis(model) if kind == "pca" else _score_basis(model)
    ids = _prompt(20)
    enable_loki(model, basis, k=0.25, d=0.25)
    cache = _dynamic_cache(model)
    with torch.no_grad():
        model(ids[:, :16], **_kw(model, cache))  # dense prefill: the same keys as the reference, stored rotated
    disable_loki(model)
    assert type(cache.layers[0]).__name__ == "DynamicLayer"
    ref_cache = _dynamic_cache(ref)
    with torch.no_grad():
        ref(ids[:, :16], **_kw(ref, ref_cache))
    torch.testing.assert_close(cache.layers[0].keys, ref_cache.layers[0].keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_continue(model, cache, ids, 16), _continue(ref, ref_cache, ids, 16),
                               atol=1e-4, rtol=1e-4)


def test_generate_cache_is_restored_too():
    model = tiny_model("llama")
    ids = _prompt(12)
    enable_loki(model, _basis(model), k=0.25, d=0.25)
    cache = _dynamic_cache(model)
    model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **_kw(model, cache))
    disable_loki(model)
    assert all(not hasattr(layer, "loki_P") for layer in cache.layers)
    with torch.no_grad():
        model(_prompt(1, seed=5), **_kw(model, cache))  # grows with plain keys


def test_a_copy_of_a_loki_cache_refuses_to_grow_after_disable():
    model = tiny_model("llama")
    ids = _prompt(12)
    enable_loki(model, _basis(model), k=0.25, d=0.25)
    cache = _dynamic_cache(model)
    with torch.no_grad():
        model(ids, **_kw(model, cache))
    twin = copy.deepcopy(cache)
    disable_loki(model)
    with pytest.raises(LokiError, match=r"filled while Loki was enabled.*disabled"), torch.no_grad():
        model(_prompt(1), **_kw(model, twin))
    with torch.no_grad():
        model(_prompt(1), **_kw(model, cache))  # the cache the model used was restored


def test_cache_carried_across_settings_is_converted_to_the_new_basis():
    """enable_loki again with another basis: a cache filled under the first basis is rotated into the second."""
    model, fresh = tiny_model("llama"), tiny_model("llama")
    ids = _prompt(20)
    enable_loki(model, _basis(model, seed=1), k=0.25, d=0.25)
    cache = _dynamic_cache(model)
    with torch.no_grad():
        model(ids[:, :16], **_kw(model, cache))
    enable_loki(model, _basis(model, seed=2), k=0.25, d=0.25)
    enable_loki(fresh, _basis(fresh, seed=2), k=0.25, d=0.25)
    fresh_cache = _dynamic_cache(fresh)
    with torch.no_grad():
        fresh(ids[:, :16], **_kw(fresh, fresh_cache))
    torch.testing.assert_close(_continue(model, cache, ids, 16), _continue(fresh, fresh_cache, ids, 16),
                               atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ padding
def test_right_padding_error_says_to_pad_on_the_left():
    model = tiny_model("llama")
    enable_loki(model, _basis(model), k=0.25, d=0.25)
    ids = torch.cat([_prompt(10, 1), _prompt(10, 2)])
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding: the generated tokens come after the padding
    with pytest.raises(LokiError, match=r"padding_side='left'") as e:
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert "left or right" not in str(e.value)


def test_enable_loki_argument_types_are_named():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="basis must be a PCABasis or the path of a basis file, got int"):
        enable_loki(model, 42)
    with pytest.raises(TypeError, match="h2o_recent_fraction must be a number"):
        enable_loki(model, None, method="h2o", h2o_recent_fraction="half")
