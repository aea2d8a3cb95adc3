"""The "int8" score copy on the kernels: ``LokiSettings(score_format="int8")`` with the Triton backend, the caches
writing the copy (int8 codes of the stored keys' d scored dims, a bf16 scale per token), the decode step reading it
(``launch_decode_step(prefix_scale=...)``, ``DecodeRun.step``, the ``loki::decode_step`` op), against the PyTorch
reference's ``score_format="int8"``.

CPU: tiny random models (fp32) and the Triton interpreter; compiled steps with the "aot_eager" backend.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from loki import LokiSettings  # noqa: E402
from loki.reference.score_formats import encode_int8_score_keys  # noqa: E402
from loki.settings import Backend  # noqa: E402

PROMPT, STEPS = 24, 6


def test_settings_run_int8_on_the_kernels_and_the_other_formats_on_the_reference():
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
    s = LokiSettings(d=0.5, score_format="int8", backend="triton").resolve_shapes(**kw)
    assert s.backend is Backend.TRITON and s.prefix_dims == 8 and s.int8_prefix
    assert s.reference_args() == {"score_format": "int8"}
    s = LokiSettings(score_format="int8").resolve_shapes(**kw, device="cuda")  # d "auto": 0.5 with the int8 copy
    assert s.backend is Backend.AUTO and s.prefix_dims == 8 and s.int8_prefix
    assert LokiSettings().resolve_shapes(**kw, device="cuda") == s  # the default: the int8 copy of d_f 0.5
    s = LokiSettings(score_format="int8", d=0.25).resolve_shapes(**kw, device="cuda")
    assert s.prefix_dims == 4 and s.int8_prefix
    s = LokiSettings(score_format="int8").resolve_shapes(**kw, device="cpu")  # auto on a CPU: the reference
    assert s.backend is Backend.TORCH and s.prefix_dims is None and not s.int8_prefix
    native = LokiSettings(backend="triton", score_format="native").resolve_shapes(**kw)
    assert not native.int8_prefix and native.prefix_dims == 4  # native: the keys' own elements, d "auto" 0.25
    for fmt in ("fp8", "int4"):
        with pytest.raises(ValueError, match="runs on the PyTorch reference only"):
            LokiSettings(score_format=fmt, backend="triton")
        s = LokiSettings(score_format=fmt).resolve_shapes(**kw, device="cuda")
        assert s.backend is Backend.TORCH and s.prefix_dims is None and not s.int8_prefix


@pytest.mark.interpreter
@pytest.mark.parametrize("fuse", [None, True], ids=["default", "fuse-asked"])
@pytest.mark.parametrize("mode,agg,d,seed", [("query", "sum", 16, 0), ("kv", "sum", 8, 4), ("kv", "max", 16, 5),
                                             ("kv", "softmax-max", 8, 0), ("kv", "softmax-max", 16, 4)])
@torch.no_grad()
def test_the_decode_step_reads_the_int8_copy_like_the_reference(triton_device, mode, agg, d, seed, fuse):
    """``launch_decode_step(k_prefix=codes, prefix_scale=scale)`` equals the reference's ``score_format="int8"``
    (the fused score-select kernels exactly when asked for, ``fuse_select=True``; never the rounded scores reused as
    exact ones), and differs from the native step (inputs where the rounding changes a selection; 16 dims: the
    tensor-core scores of the unfused path)."""
    from loki.kernels.decode import DecodeTuning, launch_decode_step, selection_bound
    from loki.kernels.launch import recording
    from loki.kernels.score_select import _score_select_kernel
    from loki.kernels.score_select_softmax import _score_select_softmax_kernel
    from loki.reference import loki_attention
    from loki.reference.selection import budget
    from loki.testing.inputs import make_decode_inputs

    k = 32
    # drawn on the CPU and moved: the same inputs on every device (the seeds are chosen so that the rounding changes
    # a selection, which a device-side draw would not keep)
    x = make_decode_inputs(2, 4, 2, 128, 32, ragged=True, left_pad=True, seed=seed)
    x = type(x)(**{f: getattr(x, f).to(triton_device) for f in ("q", "k_cache", "v_cache", "lengths", "starts")})
    B, _, S, _ = x.k_cache.shape
    codes, scale = encode_int8_score_keys(x.k_cache[..., :d])
    counts = budget(k, x.lengths, x.starts, B, S, x.q.device)
    common = dict(q_hat=x.q, k_hat=x.k_cache, v_cache=x.v_cache, lengths=x.lengths, starts=x.starts, counts=counts,
                  d=d, width=selection_bound(k, S), gqa_select=mode, aggregate=agg, scale=None,
                  tuning=DecodeTuning(fuse_select=fuse))
    with recording() as rec:
        _, got = launch_decode_step(k_prefix=codes, prefix_scale=scale, **common)
    fused = sum(fn in (_score_select_kernel, _score_select_softmax_kernel) for fn, *_ in rec.launches)
    assert fused == (1 if fuse else 0), f"fused launches: {fused} (fuse_select={fuse})"
    want = loki_attention(x.q, x.k_cache, x.v_cache, d=d, counts=counts, lengths=x.lengths, starts=x.starts,
                          gqa_select=mode, aggregate=agg, score_format="int8")
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)
    _, native = launch_decode_step(k_prefix=None, **common)
    assert (native.float() - want.float()).abs().max().item() > 1e-3  # the rounding changes selections here
    with pytest.raises(ValueError, match="pass the copy's codes as k_prefix"):
        launch_decode_step(k_prefix=None, prefix_scale=scale, **common)
    # no copy: the scores kernel rounds the keys as it reads them (unfused), the copy's selection and output exactly
    with recording() as rec:
        _, in_place = launch_decode_step(k_prefix=None, score_format="int8", **common)
    assert not any(fn in (_score_select_kernel, _score_select_softmax_kernel) for fn, *_ in rec.launches)
    torch.testing.assert_close(in_place.float(), want.float(), rtol=1e-4, atol=1e-4)
    if not fuse:
        assert torch.equal(in_place, got)


@pytest.mark.interpreter
@pytest.mark.parametrize("d", [16, 12], ids=["d-fills-the-tile", "d-masked"])
@torch.no_grad()
def test_the_scores_kernel_reads_every_int8_code_exactly(triton_device, d):
    """Each of the 256 codes, scored against a one-hot query with a unit scale, comes back as itself: the kernel's
    integer-add conversions (``int8_to_f16`` on the tensor-core per-head path, ``int8_to_f32`` on the group's sum)
    are exact, whether d fills the tile (vector loads) or not (a masked tile)."""
    from loki.kernels import approx_scores

    B, HQ, HKV, S, D = 1, 4, 2, 256, 32
    code = torch.arange(-128, 128, dtype=torch.int8)  # token t holds the code t - 128 in every dim
    codes = code[None, None, :, None].expand(B, HKV, S, d).contiguous().to(triton_device)
    scale = torch.ones(B, HKV, S, dtype=torch.bfloat16, device=triton_device)
    q = torch.zeros(B, HQ, D, device=triton_device)
    q[0, torch.arange(HQ), torch.arange(HQ) % d] = 1.0  # each head reads one dim
    k_hat = torch.zeros(B, HKV, S, D, device=triton_device)
    want = code.float().to(triton_device)
    heads = approx_scores(q, k_hat, d, gqa_select="query", aggregate="sum", k_prefix=codes, prefix_scale=scale)
    torch.testing.assert_close(heads, want.expand(B, HQ, S), rtol=0, atol=0)
    summed = approx_scores(q, k_hat, d, gqa_select="kv", aggregate="sum", k_prefix=codes, prefix_scale=scale)
    torch.testing.assert_close(summed, (2 * want).expand(B, HKV, S), rtol=0, atol=0)


@pytest.mark.interpreter
@pytest.mark.parametrize("d", [32, 24], ids=["d-fills-the-tile", "d-masked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@torch.no_grad()
def test_the_scores_kernel_rounds_keys_in_place_as_the_copy_holds_them(triton_device, d, dtype):
    """``quantize=True``: the kernel reads the 16-bit keys and rounds each token's first d dims to the int8 copy as
    it reads them; every output (per query head on the tensor cores as int8 or fp16 products and in fp32, the
    group's sum and max) equals the same launch on the stored copy (``encode_int8_score_keys``), including a zero
    key, rounding ties and the invalid tokens of ragged rows: bit for bit on the interpreter and for the int8
    products (the same codes and scales), to fp32 rounding on a GPU's other paths, whose sums follow the loaded
    tile's layout (16-bit keys, not int8 codes). A copy passed with it is refused."""
    from loki.kernels.approx_scores import launch_approx_scores

    B, HQ, HKV, S, D = 2, 6, 2, 77, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, D, generator=g)
    k = (torch.randn(B, HKV, S, D, generator=g) * torch.logspace(-3, 3, S)[None, None, :, None]).to(dtype)
    k[0, 0, 5] = 0
    k[1, 1, 7, :d] = torch.tensor([0.5, -1.5] * (d // 2)) * 127 / 63.5  # codes x.5 before rounding: ties to even
    q, k = q.to(triton_device), k.to(triton_device)
    codes, scale = encode_int8_score_keys(k[..., :d])
    lengths = torch.tensor([S, 60], dtype=torch.int32, device=triton_device)
    starts = torch.tensor([0, 3], dtype=torch.int32, device=triton_device)
    for heads in (True, False):
        for agg in ("sum", "max"):
            for dot in (False, "f16", "int8"):
                outs = []
                for kw in ({"prefix_scale": scale}, {"quantize": True}):
                    o = torch.full((B, HQ if heads else HKV, S), 7.0, device=triton_device)
                    launch_approx_scores(q, codes if "prefix_scale" in kw else k, d, lengths, starts,
                                         o if heads else None, None if heads else o, agg, dot=dot, **kw)
                    outs.append(o)
                if triton_device.type == "cpu" or (heads and dot == "int8" and d >= 32):
                    assert torch.equal(outs[0], outs[1]), (heads, agg, dot)  # integer products: exact
                else:  # the same codes and scales; a GPU's fp32 sums follow the loaded tile's layout
                    top = outs[0][outs[0].isfinite()].abs().max().item()
                    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5 * top)
    with pytest.raises(ValueError, match="quantize rounds 16-bit keys"):
        launch_approx_scores(q, codes, d, lengths, starts, None, torch.empty(B, HKV, S, device=triton_device),
                             "sum", prefix_scale=scale, quantize=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("d", [32, 40], ids=["d-fills-the-tile", "d-masked"])
@torch.no_grad()
def test_int8_products_read_every_code_exactly(triton_device, d):
    """The int8 tensor-core products (``dot="int8"``): each of the 256 codes against one-hot queries of several
    magnitudes comes back as the code times the query's entry, per query head, exactly (the entries have few
    significant bits, so every partial sum of the pieces' products is exact in fp32)."""
    from loki.kernels.approx_scores import launch_approx_scores

    B, HQ, HKV, S = 1, 4, 2, 256
    code = torch.arange(-128, 128, dtype=torch.int8)
    codes = code[None, None, :, None].expand(B, HKV, S, d).contiguous().to(triton_device)
    scale = torch.ones(B, HKV, S, dtype=torch.bfloat16, device=triton_device)
    q = torch.zeros(B, HQ, d, device=triton_device)
    mag = torch.tensor([1.0, 0.75, 5 * 2.0**-11, 96.0], device=triton_device)
    q[0, torch.arange(HQ), torch.arange(HQ) % d] = mag  # each head reads one dim
    lengths = torch.full((B,), S, dtype=torch.int32, device=triton_device)
    starts = torch.zeros(B, dtype=torch.int32, device=triton_device)
    heads = torch.full((B, HQ, S), 7.0, device=triton_device)
    launch_approx_scores(q, codes, d, lengths, starts, heads, None, "sum", block_s=64, prefix_scale=scale, dot="int8")
    want = code.float().to(triton_device)[None, None, :] * mag[None, :, None]
    torch.testing.assert_close(heads, want, rtol=0, atol=0)


@pytest.mark.interpreter
@pytest.mark.parametrize("spread", [1.0, 1e-3, 1e3], ids=["unit", "small", "large"])
@torch.no_grad()
def test_int8_products_equal_the_fp32_scores_of_the_copy(triton_device, spread):
    """Per query head, ``dot="int8"`` (the query in four int8 pieces, exact int32 products) equals the reference's
    ``score_format="int8"`` scores to fp32 rounding (2e-6 of the row's largest), at queries of any magnitude, on
    ragged and left-padded rows; -inf outside them."""
    from loki.kernels.approx_scores import launch_approx_scores
    from loki.reference import approx_scores
    from loki.testing.inputs import make_decode_inputs

    x = make_decode_inputs(2, 8, 2, 200, 64, ragged=True, left_pad=True, seed=3)
    q = (x.q * spread * torch.linspace(0.1, 3.0, 64)).to(triton_device)  # dims of unequal magnitude
    k = x.k_cache.to(triton_device)
    lengths, starts = x.lengths.to(triton_device), x.starts.to(triton_device)
    d = 32
    codes, scale = encode_int8_score_keys(k[..., :d])
    heads = torch.full((2, 8, 200), 7.0, device=triton_device)
    launch_approx_scores(q, codes, d, lengths, starts, heads, None, "sum", block_s=32, prefix_scale=scale, dot="int8",
                         tiles=2, num_stages=2)
    want = approx_scores(q, k, d, lengths, starts, score_format="int8", gqa_select="query", aggregate="sum")
    assert torch.equal(torch.isneginf(heads), torch.isneginf(want))
    fin = torch.isfinite(want)
    err = (heads[fin] - want[fin]).abs().max() / want[fin].abs().max()
    assert err <= 2e-6, f"relative error {err:.2e}"


@pytest.mark.interpreter
@pytest.mark.parametrize("keys", ["bf16-prefix", "int8-tensor-cores", "int8-products", "int8-cuda-cores"])
@torch.no_grad()
def test_programs_of_several_pipelined_tiles_score_as_one_tile_each(triton_device, keys):
    """``tiles`` blocks of keys per program (the int8 copy's per-head fp16 products take 4 on a GPU) give every score of
    one block per program, per query head and summed, on ragged and left-padded rows whose length is no multiple of
    the tiles' span."""
    from loki.kernels.approx_scores import launch_approx_scores
    from loki.testing.inputs import make_decode_inputs

    x = make_decode_inputs(2, 8, 2, 300, 32, ragged=True, left_pad=True, seed=1)
    x = type(x)(**{f: getattr(x, f).to(triton_device) for f in ("q", "k_cache", "v_cache", "lengths", "starts")})
    d = 32 if keys == "int8-products" else 16  # int8 products take d >= 32
    if keys == "bf16-prefix":
        src, kw = x.k_cache[..., :d].contiguous(), {}
    else:
        codes, scale = encode_int8_score_keys(x.k_cache[..., :d])
        dot = {"int8-tensor-cores": "f16", "int8-products": "int8", "int8-cuda-cores": False}[keys]
        src, kw = codes, dict(prefix_scale=scale, dot=dot)
    for heads in (True, False):
        outs = []
        for tiles in (1, 3):
            out = torch.full((2, 8 if heads else 2, 300), 7.0, device=triton_device)
            ho, ao = (out, None) if heads else (None, out)
            launch_approx_scores(x.q, src, d, x.lengths, x.starts, ho, ao, "sum", block_s=16, tiles=tiles,
                                 num_stages=2, **kw)
            outs.append(out)
        assert not (outs[1] == 7.0).any(), "every score written"
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def _model_and_basis():
    from loki.basis import PCABasis
    from loki.testing.models import tiny_model

    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    c = model.config
    return model, PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=1)


def _decode(model, basis, *, fmt, backend, static, compiled=False, check_store=False, gqa_select="auto",
            key_prefix=True):
    """Logits of STEPS decode steps after a dense prefill of PROMPT tokens ([STEPS, V]); ``check_store``: the cache's
    int8 copy equals ``encode_int8_score_keys`` of its stored keys after every forward."""
    from loki._hf import cache_keyword
    from loki.integrations.transformers import disable_loki, enable_loki, loki_cache

    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    enable_loki(model, basis, settings=LokiSettings(k=0.25, d=0.5, score_format=fmt, backend=backend,
                                                    gqa_select=gqa_select, key_prefix=key_prefix))
    try:
        with torch.no_grad():
            cache = loki_cache(model, static=True, max_cache_len=PROMPT + STEPS + 2) if static else loki_cache(model)
            kw = {cache_keyword(model): cache, "use_cache": True}
            model(input_ids=ids[:, :PROMPT], **kw)  # dense prefill
            step = torch.compile(model.forward, fullgraph=True, backend="aot_eager") if compiled else model
            rows = []
            for t in range(PROMPT, PROMPT + STEPS):
                pos = torch.tensor([t], device=dev)
                rows.append(step(input_ids=ids[:, t : t + 1], cache_position=pos, position_ids=pos[None],
                                 **kw).logits[0, -1])
                if check_store:
                    _check_int8_copy(cache, t + 1, static)
            return torch.stack(rows)
    finally:
        disable_loki(model)


def _check_int8_copy(cache, n: int, static: bool) -> None:
    for layer in cache.layers:
        store = layer.loki
        assert store.prefix.dtype == torch.int8 and store.prefix_scale.dtype == torch.bfloat16
        keys = layer.keys
        if static:
            assert store.prefix.shape[-2] == store.prefix_scale.shape[-1] == keys.shape[-2]
            keys, prefix, scale = keys[:, :, :n], store.prefix[:, :, :n], store.prefix_scale[:, :, :n]
        else:
            assert store.prefix.shape[-2] == store.prefix_scale.shape[-1] == keys.shape[-2] == n
            prefix, scale = store.prefix, store.prefix_scale
        codes, want_scale = encode_int8_score_keys(keys[..., : store.prefix_dims])
        assert torch.equal(prefix, codes) and torch.equal(scale, want_scale)


@pytest.mark.interpreter
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_model_decodes_on_the_int8_copy_like_the_reference(triton_device, static, monkeypatch):
    """``enable_loki(score_format="int8", backend="triton")``: the caches keep the int8 copy of the stored keys, the
    kernels' step reads it, and the decode steps' logits equal the reference's with the same format and differ from
    the native copy's."""
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's test (a GPU run needs no change but the device)")
    from loki.kernels.plan import DecodeRun

    seen = []
    real = DecodeRun.step

    def spy(self, **kwargs):
        seen.append((kwargs["k_prefix"], kwargs.get("prefix_scale")))
        return real(self, **kwargs)

    monkeypatch.setattr(DecodeRun, "step", spy)
    model, basis = _model_and_basis()
    got = _decode(model, basis, fmt="int8", backend="triton", static=static, check_store=True)
    assert len(seen) == STEPS * model.config.num_hidden_layers
    assert all(p.dtype == torch.int8 and sc is not None and sc.dtype == torch.bfloat16 for p, sc in seen)
    seen.clear()
    want = _decode(model, basis, fmt="int8", backend="torch", static=static)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    native = _decode(model, basis, fmt="native", backend="triton", static=static)
    assert seen and all(sc is None and p.dtype == torch.float32 for p, sc in seen)  # the native prefix as before
    assert not torch.allclose(got, native, atol=1e-4)


def _spy_on_the_op(monkeypatch) -> list:
    """Record (k_prefix, prefix_scale, score_format) of every ``loki::decode_step`` call the integration makes, with
    dynamo reset so that the next compilation traces it."""
    from loki.integrations.transformers import run as lt_run

    seen, real = [], lt_run.decode_step_op

    def spy(*args):
        seen.append((args[3], args[12], args[13]))
        return real(*args)

    monkeypatch.setattr(lt_run, "decode_step_op", spy)
    torch._dynamo.reset()
    return seen


@pytest.mark.interpreter
def test_a_compiled_static_step_passes_the_int8_copy_to_the_op(triton_device, monkeypatch):
    """Traced whole (``fullgraph=True``, aot_eager), the kernels' route calls ``loki::decode_step`` with the copy's
    codes and scales (the CPU registration: the reference's int8 scores) and gives the eager kernels' logits."""
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's test")
    seen = _spy_on_the_op(monkeypatch)
    model, basis = _model_and_basis()
    got = _decode(model, basis, fmt="int8", backend="triton", static=True, compiled=True)
    assert seen and all(p is not None and p.dtype == torch.int8 and sc is not None and sc.dtype == torch.bfloat16
                        and fmt == "int8" for p, sc, fmt in seen)
    want = _decode(model, basis, fmt="int8", backend="triton", static=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.interpreter
def test_a_compiled_static_step_without_the_copy_rounds_the_keys_in_place(triton_device, monkeypatch):
    """``key_prefix=False`` with the int8 default, traced whole (``fullgraph=True``): ``loki::decode_step`` gets no
    copy and the int8 format (on CUDA the scores kernel rounds the keys in place; on the CPU the reference rounds
    them), and the logits equal the eager step's on a cache that keeps the copy."""
    seen = _spy_on_the_op(monkeypatch)
    model, basis = _model_and_basis()
    model = model.to(triton_device)
    got = _decode(model, basis, fmt="int8", backend="triton", static=True, compiled=True, key_prefix=False)
    assert seen and all(p is None and sc is None and fmt == "int8" for p, sc, fmt in seen)
    want = _decode(model, basis, fmt="int8", backend="triton", static=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.interpreter
@torch.no_grad()
def test_an_int8_step_without_its_copy_rounds_the_keys_in_place_on_the_kernels(triton_device, monkeypatch):
    """A cache whose int8 copy is missing (here: dropped) never has its keys read as native scores: the kernels'
    step gets no copy and rounds the keys as it reads them (the same logits as the reference with
    score_format="int8")."""
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's test")
    from loki.integrations.transformers.layers import LokiDynamicLayer
    from loki.kernels.plan import DecodeRun

    real, real_step, seen = LokiDynamicLayer.update, DecodeRun.step, []

    def update_then_drop(self, *a, **k):
        out = real(self, *a, **k)
        self.loki.prefix_scale = None  # the copy is gone (as after an edit outside Loki)
        return out

    def spy(self, **kwargs):
        seen.append((kwargs["k_prefix"], kwargs["prefix_scale"]))
        return real_step(self, **kwargs)

    want = _decode(*_model_and_basis(), fmt="int8", backend="torch", static=False)
    monkeypatch.setattr(LokiDynamicLayer, "update", update_then_drop)
    monkeypatch.setattr(DecodeRun, "step", spy)
    got = _decode(*_model_and_basis(), fmt="int8", backend="triton", static=False)
    assert seen and all(p is None and sc is None for p, sc in seen)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.interpreter
@torch.no_grad()
def test_the_int8_copy_follows_crop_reorder_and_reset(triton_device):
    """The copy is rebuilt from the stored keys after transformers edits a dynamic layer (crop, beam reorder) and
    is reordered and zeroed with a static layer's keys."""
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's test")
    from loki._hf import cache_keyword
    from loki.integrations.transformers import disable_loki, enable_loki, loki_cache

    model, basis = _model_and_basis()
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    enable_loki(model, basis, settings=LokiSettings(k=0.25, d=0.5, score_format="int8", backend="triton"))
    try:
        cache = loki_cache(model)
        kw = {cache_keyword(model): cache, "use_cache": True}
        model(input_ids=ids[:, :16], **kw)
        cache.crop(-4)
        model(input_ids=ids[:, 12:13], **kw)  # the buffers are made again from the 12 tokens kept
        _check_int8_copy(cache, 13, static=False)
        cache.reorder_cache(torch.tensor([1, 0]))
        model(input_ids=ids[:, 13:14], **kw)
        _check_int8_copy(cache, 14, static=False)
        static = loki_cache(model, static=True, max_cache_len=24)
        model(input_ids=ids[:, :16], **{cache_keyword(model): static, "use_cache": True})
        layer = static.layers[0]
        before = layer.loki.prefix.clone(), layer.loki.prefix_scale.clone()
        static.reorder_cache(torch.tensor([1, 0]))
        assert torch.equal(layer.loki.prefix, before[0][[1, 0]])
        assert torch.equal(layer.loki.prefix_scale, before[1][[1, 0]])
        _check_int8_copy(static, 16, static=True)
        static.reset()
        assert not layer.loki.prefix.any() and not layer.loki.prefix_scale.any()
    finally:
        disable_loki(model)

@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dp", [32, 40], ids=["dp-of-whole-blocks", "dp-masked"])
@torch.no_grad()
def test_the_cache_write_kernel_encodes_the_int8_copy_of_the_keys_it_stores(triton_device, dtype, dp):
    """``write_rotated(..., prefix_scale=...)`` writes the int8 score copy in the rotation's kernel: its codes and
    scales equal ``encode_int8_score_keys`` of the keys it stored, exactly (ties to even: a token whose keys are
    halves under a unit scale), at the written positions only."""
    from loki.kernels.cache_write import write_rotated

    B, HKV, S, D, L = 2, 2, 16, 64, 3
    P = torch.linalg.qr(torch.randn(HKV, D, D, generator=torch.Generator().manual_seed(0)))[0].contiguous()
    P[1] = torch.eye(D)  # head 1 keeps its keys: token 0's are exact ties
    g = torch.Generator().manual_seed(1)
    k = torch.randn(B, HKV, L, D, generator=g)
    k[:, 1, 0, :] = torch.arange(D) % 9 - 3.5  # halves: codes by ties to even
    k[:, 1, 0, 0] = 127.0  # the largest magnitude: a scale of exactly 1
    k, v = k.to(dtype), torch.randn(B, HKV, L, D, generator=g).to(dtype)
    keys, values = torch.zeros(B, HKV, S, D, dtype=dtype), torch.zeros(B, HKV, S, D, dtype=dtype)
    prefix = torch.full((B, HKV, S, dp), 99, dtype=torch.int8)
    scale = torch.full((B, HKV, S), 5.0, dtype=torch.bfloat16)
    dev = [t.to(triton_device) for t in (keys, values, prefix, scale, k, v, P)]
    pos = torch.tensor([3, 7, 9], device=triton_device)
    write_rotated(*dev[:3], dev[4], dev[5], dev[6], pos, prefix_scale=dev[3])
    keys, values, prefix, scale = (t.cpu() for t in dev[:4])
    codes, want_scale = encode_int8_score_keys(keys[:, :, pos.cpu(), :dp])
    assert torch.equal(prefix[:, :, pos.cpu()], codes) and torch.equal(scale[:, :, pos.cpu()], want_scale)
    assert prefix[1, 1, 3, :8].tolist() == [127, -2, -2, 0, 0, 2, 2, 4]  # -2.5, -1.5, ... to even
    others = torch.ones(S, dtype=torch.bool)
    others[pos.cpu()] = False
    assert (prefix[:, :, others] == 99).all() and (scale[:, :, others] == 5.0).all()
