"""``key_prefix=False``: Loki's caches keep K and V alone (a dense cache's memory), no second copy of the keys' first
d rotated dims, and the kernels' decode step reads those dims in place; the logits equal the default's (the same
scores read from another place) and the reference's.

CPU: tiny random models (fp32) and the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from loki import LokiSettings  # noqa: E402

PROMPT, STEPS = 24, 6


def test_settings_keep_no_prefix_when_asked_and_name_the_argument():
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
    assert LokiSettings(d=0.5, backend="triton").resolve_shapes(**kw).prefix_dims == 8
    s = LokiSettings(d=0.5, backend="triton", key_prefix=False).resolve_shapes(**kw)
    assert s.prefix_dims is None and not s.int8_prefix and s.use_kernels(cuda=True, needs_grad=False)
    for fmt in ("int8", "auto"):  # the int8 copy computed in place: the default's scores in a dense cache's memory
        s = LokiSettings(backend="triton", key_prefix=False, score_format=fmt).resolve_shapes(**kw)
        assert s.score_format.value == "int8" and s.d == 8 and s.prefix_dims is None and not s.int8_prefix
    for bad in (0, "no", None):
        with pytest.raises(TypeError, match="key_prefix must be True or False"):
            LokiSettings(key_prefix=bad)


def _decode(key_prefix: bool, backend: str, static: bool, fmt: str = "native"):
    """Logits of STEPS decode steps after a dense prefill of PROMPT tokens ([STEPS, V]) and, per layer, what the
    cache held: (keys, values, prefix, prefix scale), read before ``disable_loki`` restores the layers."""
    from loki._hf import cache_keyword
    from loki.basis import PCABasis
    from loki.integrations.transformers import disable_loki, enable_loki, loki_cache
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    c = model.config
    basis = PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=1)
    ids = torch.randint(0, c.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    enable_loki(model, basis, k=0.25, d=0.5, backend=backend, key_prefix=key_prefix, score_format=fmt)
    try:
        with torch.no_grad():
            cache = loki_cache(model, static=True, max_cache_len=PROMPT + STEPS + 2) if static else loki_cache(model)
            kw = {cache_keyword(model): cache, "use_cache": True}
            model(input_ids=ids[:, :PROMPT], **kw)  # dense prefill
            rows = [model(input_ids=ids[:, t:t + 1], **kw).logits[0, -1] for t in range(PROMPT, PROMPT + STEPS)]
            held = [(la.keys, la.values, la.loki.prefix, la.loki.prefix_scale) for la in cache.layers]
            return torch.stack(rows), held
    finally:
        disable_loki(model)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", ["native", "int8"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_model_decodes_on_the_kernels_without_the_prefix_like_with_it(triton_device, static, fmt, monkeypatch):
    """The kernels' step gets no prefix (``k_prefix=None``: the scores read k_hat's first d dims in place, rounded
    to the int8 copy as they are read for "int8"), the caches hold no tensor beyond K and V, and the logits equal
    those with the prefix (or int8 copy) and the reference's."""
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's test (a GPU run needs no change but the device)")
    from loki.kernels.plan import DecodeRun

    seen = []
    real = DecodeRun.step

    def spy(self, **kwargs):
        seen.append(kwargs["k_prefix"])
        return real(self, **kwargs)

    monkeypatch.setattr(DecodeRun, "step", spy)
    got, held = _decode(False, "triton", static, fmt)
    assert len(seen) == STEPS * 2 and all(p is None for p in seen)
    assert all(prefix is None and scale is None for _, _, prefix, scale in held)
    seen.clear()
    with_prefix, held = _decode(True, "triton", static, fmt)
    assert len(seen) == STEPS * 2 and all(p is not None and p.shape[-1] == 8 for p in seen)
    assert all(prefix is not None and (scale is not None) == (fmt == "int8") for _, _, prefix, scale in held)
    torch.testing.assert_close(got, with_prefix, rtol=1e-5, atol=1e-5)
    want, _ = _decode(False, "torch", static, fmt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if fmt == "int8":  # the rounding is what is computed in place: the native scores give other logits
        other, _ = _decode(False, "triton", static, "native")
        assert (other - got).abs().max() > 1e-3


@pytest.mark.interpreter
def test_a_static_cache_without_the_prefix_allocates_a_dense_caches_bytes(triton_device):
    """What the static cache allocates on the device: K and V and nothing else without the prefix; with it, d/D of
    K more."""
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's test")

    def cache_bytes(key_prefix):
        _, held = _decode(key_prefix, "triton", True)
        total = sum(t.numel() * t.element_size() for tensors in held for t in tensors if t is not None)
        return total, sum(keys.numel() * keys.element_size() for keys, *_ in held)

    plain, k_bytes = cache_bytes(False)
    assert plain == 2 * k_bytes
    with_prefix, _ = cache_bytes(True)
    assert with_prefix == plain + k_bytes // 2  # d = 8 of D = 16


def test_the_e2e_benchmark_passes_it_and_sizes_the_caches_without_it():
    from loki.bench import e2e, e2e_report

    cfg = e2e.llama_config(e2e.E2E_MODELS["llama3-8b"])
    with_prefix = e2e.memory_needed(cfg, 8, 32768, itemsize=2, d_f=0.25)
    without = e2e.memory_needed(cfg, 8, 32768, itemsize=2, d_f=0.25, key_prefix=False)
    assert with_prefix - without == 32 * 8 * 8 * 32768 * 32 * 2  # L B HKV S d bf16: 4 GiB
    int8 = e2e.memory_needed(cfg, 8, 32768, itemsize=2, d_f=0.5, score_format="int8")
    assert int8 - without == 32 * 8 * 8 * 32768 * (64 + 2)  # 64 int8 codes and a bf16 scale per token
    import argparse

    from loki.bench.harness import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert e2e_report.select(parser.parse_args(["--e2e", "--quick", "--no-key-prefix"]))["key_prefix"] is False
    assert e2e_report.select(parser.parse_args(["--e2e", "--quick"]))["key_prefix"] is True
    sel = e2e_report.select(parser.parse_args(["--e2e", "--quick", "--no-key-prefix"]))
    assert sel["key_prefix"] is False and sel["score_format"] == "int8"  # the default's scores, computed in place


def _tiny(fmt="native"):
    from loki.basis import PCABasis
    from loki.integrations.transformers import enable_loki
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    c = model.config
    enable_loki(model, PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=1), d=0.5,
                backend="triton", score_format=fmt)
    return model


def _no_memory_for(layers: set):
    """A ``LayerStore.new_prefix`` that runs out of memory on the n-th call for every n in ``layers`` (0-based: the
    layers in order of allocation)."""
    from loki.integrations.transformers.layers import LayerStore

    real, calls = LayerStore.new_prefix, []

    def new_prefix(self, keys):
        calls.append(len(calls))
        if calls[-1] in layers:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real(self, keys)
    return new_prefix


def _first_write_out_of_memory(model, cache) -> str:
    """The message of the out-of-memory error that a 4-token forward writing into ``cache`` raises."""
    from loki._hf import cache_keyword

    with pytest.raises(torch.OutOfMemoryError) as info:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), **{cache_keyword(model): cache, "use_cache": True})
    return str(info.value)


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", ["native", "int8"])
@pytest.mark.parametrize("eager", [False, True], ids=["at-first-write", "batch_size"])
def test_a_prefix_that_does_not_fit_is_left_out_with_a_warning_and_the_same_logits(triton_device, eager, fmt,
                                                                                   monkeypatch):
    """A static cache whose keys and values fit but whose second layer's key prefix (a native one, or the int8
    score copy) does not: that layer keeps none (its kernels read the keys' first dims in place, rounded to the int8
    copy as they read them), a warning names key_prefix=False, the first layer keeps its prefix, and the logits equal
    those of a cache with every prefix."""
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's test")
    from loki._hf import cache_keyword
    from loki.integrations.transformers import disable_loki, loki_cache
    from loki.integrations.transformers.layers import LayerStore

    ids = torch.randint(0, 97, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))

    def run(fail: set):
        monkeypatch.setattr(LayerStore, "new_prefix", _no_memory_for(fail))
        model = _tiny(fmt)
        ids_ = ids % model.config.vocab_size
        try:
            with torch.no_grad():
                cache = loki_cache(model, static=True, max_cache_len=PROMPT + STEPS + 2,
                                   batch_size=1 if eager else None)
                kw = {cache_keyword(model): cache, "use_cache": True}
                model(input_ids=ids_[:, :PROMPT], **kw)
                rows = [model(input_ids=ids_[:, t:t + 1], **kw).logits[0, -1] for t in range(PROMPT, PROMPT + STEPS)]
                return torch.stack(rows), [la.loki.prefix for la in cache.layers], [la.loki.prefix_scale
                                                                                     for la in cache.layers]
        finally:
            disable_loki(model)

    want, prefixes, scales = run(set())
    assert all(p is not None for p in prefixes) and all((c is not None) == (fmt == "int8") for c in scales)
    what = "int8 score copy" if fmt == "int8" else "key prefix"
    with pytest.warns(RuntimeWarning, match=f"{what} .* did not fit .* enable_loki\\(..., key_prefix=False\\)"):
        got, prefixes, scales = run({1})
    assert prefixes[0] is not None and prefixes[1] is None and scales[1] is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_an_eager_static_cache_allocates_every_layers_keys_and_values_before_any_prefix(triton_device, monkeypatch):
    """``loki_cache(..., batch_size=B)``: all keys and values first, then the prefixes, so a prefix that does not
    fit is the one left out, not a later layer's keys; a layer's keys and values out of memory at the first write
    say how to fit."""
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's test")
    from transformers.cache_utils import StaticLayer

    from loki.integrations.transformers import disable_loki, loki_cache
    from loki.integrations.transformers.layers import LayerStore

    order = []
    real_kv, real_prefix = StaticLayer.lazy_initialization, LayerStore.new_prefix
    monkeypatch.setattr(StaticLayer, "lazy_initialization",
                        lambda self, k, v: (order.append("kv"), real_kv(self, k, v))[1])
    monkeypatch.setattr(LayerStore, "new_prefix",
                        lambda self, keys: (order.append("prefix"), real_prefix(self, keys))[1])
    model = _tiny()
    try:
        loki_cache(model, static=True, max_cache_len=16, batch_size=1)
        assert order == ["kv", "kv", "prefix", "prefix"]

        def no_memory(self, k, v):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

        monkeypatch.setattr(StaticLayer, "lazy_initialization", no_memory)
        with pytest.raises(torch.OutOfMemoryError) as eager:  # no prefix allocated yet: torch's error alone
            loki_cache(model, static=True, max_cache_len=16, batch_size=1)
        assert str(eager.value) == "CUDA out of memory. Tried to allocate 8.00 GiB"
        msg = _first_write_out_of_memory(model, loki_cache(model, static=True, max_cache_len=16))
    finally:
        disable_loki(model)
    assert msg.startswith("CUDA out of memory. Tried to allocate 8.00 GiB")
    assert "batch_size=B" in msg and "key_prefix=False" in msg


def test_the_prefix_hint_counts_one_layers_bytes():
    """Llama-3-8B dims at B=8 S=32768, d = 32: 128 MiB of bf16 prefix per layer; an int8 copy of 64 dims: codes
    and a 2-byte scale per row."""
    from loki.integrations.transformers.layers import LayerStore, _prefix_dropped_warning

    keys = torch.empty(8, 8, 32768, 128, dtype=torch.bfloat16, device="meta")
    store = LayerStore.__new__(LayerStore)
    store.prefix_dims, store.int8 = 32, False
    assert "key prefix (32 dims of every key, 128.0 MiB for this layer)" in _prefix_dropped_warning(store, keys)
    store.prefix_dims, store.int8 = 64, True
    assert "int8 score copy (64 dims of every key, 132.0 MiB for this layer)" in _prefix_dropped_warning(store, keys)


def test_the_e2e_report_says_when_the_caches_kept_no_prefix(tmp_path):
    from loki.bench import e2e_report

    doc = {"device": "cpu", "date": "today", "torch": torch.__version__, "transformers": "5", "triton": None,
           "dtype": "float32", "copy_gbps": None, "sdpa_backend": "default", "sdpa_backends": {}, "k_f": 0.25,
           "d_f": 0.25, "steps": 3, "paths": ["loki_compiled"], "results": []}
    assert "No key prefix" not in e2e_report.write_markdown(doc, str(tmp_path / "a.md"))
    text = e2e_report.write_markdown({**doc, "key_prefix": False, "score_format": "native"}, str(tmp_path / "b.md"))
    assert "No key prefix (key_prefix=False)" in text and "Score copy" not in text
    assert "Score copy: int8." in e2e_report.write_markdown({**doc, "score_format": "int8"}, str(tmp_path / "c.md"))
