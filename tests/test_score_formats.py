"""Loki's score copy in fewer bits (``loki.reference.score_formats``): the rounding, the bytes it reads, the
reference's use of it on every route, and the settings that refuse fp8 and int4 where the kernels would run (int8 on
the kernels and the caches: tests/test_int8_cache.py)."""

from __future__ import annotations

import pytest
import torch

from loki import LokiSettings
from loki.reference import approx_scores, loki_attention
from loki.reference.accounting import score_fraction, step_bytes_fraction
from loki.reference.score_formats import SCORE_FORMATS, quantize_score_keys, score_elements
from loki.reference.teacher_forced import teacher_forced_rows
from loki.settings import Backend, ScoreFormat


def test_the_formats_round_known_values():
    # scales of exactly 1 (the largest magnitude equals the format's levels; 1 is exact in bf16)
    x = torch.tensor([[127.0, 63.4, -1.2, 0.49, 0.0]])
    assert quantize_score_keys(x, "int8").tolist() == [[127.0, 63.0, -1.0, 0.0, 0.0]]
    x = torch.tensor([[7.0, 3.4, -0.6, 2.5]])
    assert quantize_score_keys(x, "int4").tolist() == [[7.0, 3.0, -1.0, 2.0]]  # round half to even
    x = torch.tensor([[448.0, 3.3, -0.3, 1000.0 / 448]])
    got = quantize_score_keys(x / 448 * 448, "fp8")
    assert got[0, :3].tolist() == [448.0, 3.25, -0.3125]  # e4m3: 3 mantissa bits
    # per token: each row has its own scale; a row of zeros stays zero; "native" is the keys themselves
    y = torch.tensor([[127.0, -0.4], [0.0, 0.0], [-254.0, 127.0]])
    assert quantize_score_keys(y, "int8").tolist() == [[127.0, 0.0], [0.0, 0.0], [-254.0, 128.0]]
    assert quantize_score_keys(y, "native") is y
    with pytest.raises(ValueError, match="score_format must be one of"):
        quantize_score_keys(y, "int2")


@pytest.mark.parametrize("fmt,levels", [("int8", 127), ("int4", 7)])
def test_the_integer_formats_err_by_at_most_half_a_step(fmt, levels):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)) * torch.logspace(1, -2, 16)
    q = quantize_score_keys(x, fmt)
    step = x.abs().amax(-1, keepdim=True) / levels
    assert ((q - x).abs() <= step / 2 * 1.01 + 1e-7).all()
    assert ((q - x).abs() > 0).any()


def test_score_bytes_count_the_bits_and_the_scale():
    assert SCORE_FORMATS == tuple(f.value for f in ScoreFormat)
    assert score_elements("native", 16) == 16 and score_elements("int8", 32) == 17 and score_elements("fp8", 30) == 16
    assert score_elements("int4", 64) == 17
    D = 64
    assert score_fraction("loki", 16, D) == pytest.approx(16 / 128)
    assert score_fraction("loki", 0.5, D, score_format="int8") == pytest.approx(17 / 128)
    assert step_bytes_fraction("loki", 0.25, 1.0, D, score_format="int4") == pytest.approx(17 / 128 + 0.25)
    with pytest.raises(ValueError, match="applies to method 'loki' only"):
        score_fraction("sparq", 16, D, score_format="int8")


def _decode_inputs(B=2, HQ=4, HKV=2, S=37, D=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g) * torch.logspace(0.5, -1, D)
    v = torch.randn(B, HKV, S, D, generator=g)
    return q, k, v, torch.tensor([S, S - 5]), torch.tensor([0, 3])


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
def test_approximate_scores_read_the_rounded_copy_and_attention_the_keys(fmt):
    q, k, v, lengths, starts = _decode_inputs()
    d = 8
    got = approx_scores(q, k, d, lengths, starts, gqa_select="query", aggregate="sum", score_format=fmt)
    want = approx_scores(q, torch.cat([quantize_score_keys(k[..., :d], fmt), k[..., d:]], -1), d, lengths, starts,
                         gqa_select="query", aggregate="sum")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, approx_scores(q, k, d, lengths, starts, gqa_select="query", aggregate="sum"))
    # the selection follows the rounded copy, the attention over it reads the full keys
    kw = dict(d=d, k=9, lengths=lengths, starts=starts, gqa_select="kv", aggregate="softmax-max")
    out, (idx, counts) = loki_attention(q, k, v, score_format=fmt, return_indices=True, **kw)
    k_round = torch.cat([quantize_score_keys(k[..., :d], fmt), k[..., d:]], -1)
    _, (idx_round, _) = loki_attention(q, k_round, v, return_indices=True, **kw)
    assert torch.equal(idx, idx_round)
    from loki.reference import sparse_attention

    torch.testing.assert_close(out, sparse_attention(q, k, v, idx, counts))


@pytest.mark.parametrize("fmt,gqa,agg", [("int4", "kv", "softmax-max"), ("int4", "query", "sum"),
                                         ("int8", "kv", "sum")])
def test_teacher_forced_rows_equal_the_decode_reference_with_a_rounded_copy(fmt, gqa, agg):
    g = torch.Generator().manual_seed(2)
    B, HQ, HKV, L, S, D = 2, 4, 2, 11, 19, 16
    q = torch.randn(B, HQ, L, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g) * torch.logspace(0.5, -1, D)
    v = torch.randn(B, HKV, S, D, generator=g)
    lengths = (S - L + 1 + torch.arange(L))[None].repeat(B, 1)
    starts = torch.zeros(B, L, dtype=torch.long)
    starts[1] = 4
    got = teacher_forced_rows(q, k, v, starts, lengths, method="loki", k_budget=0.3, d=0.5, gqa_select=gqa,
                              aggregate=agg, score_format=fmt)
    for b in range(B):
        for i in range(L):
            want = loki_attention(q[b : b + 1, :, i], k[b : b + 1], v[b : b + 1], d=0.5, k=0.3,
                                  lengths=lengths[b, i : i + 1], starts=starts[b, i : i + 1], gqa_select=gqa,
                                  aggregate=agg, score_format=fmt)
            torch.testing.assert_close(got[b, :, i], want[0], rtol=1e-5, atol=1e-5)
    native = teacher_forced_rows(q, k, v, starts, lengths, method="loki", k_budget=0.3, d=0.5, gqa_select=gqa,
                                 aggregate=agg)
    if fmt == "int4":  # the coarsest format changes some selections of these rows: it reaches them
        assert not torch.allclose(got, native)


def test_settings_run_fp8_and_int4_on_the_reference_only():
    s = LokiSettings(score_format="int4").resolve_shapes(num_q_heads=4, num_kv_heads=2, head_dim=16, device="cuda")
    assert s.backend is Backend.TORCH and s.prefix_dims is None and s.reference_args() == {"score_format": "int4"}
    s = LokiSettings(score_format="int8").resolve_shapes(num_q_heads=4, num_kv_heads=2, head_dim=16, device="cuda")
    assert s.backend is Backend.AUTO and s.int8_prefix  # int8 runs on the kernels too (tests/test_int8_cache.py)
    assert LokiSettings().resolve_shapes(num_q_heads=4, num_kv_heads=2, head_dim=16).reference_args() == {
        "score_format": "int8"}  # the default: Loki's int8 score copy
    native = LokiSettings(score_format="native").resolve_shapes(num_q_heads=4, num_kv_heads=2, head_dim=16)
    assert native.reference_args() == {"score_format": "native"}
    assert LokiSettings(key_prefix=False).score_format is ScoreFormat.INT8  # the copy then computed in place
    assert LokiSettings(method="sparq").resolve_shapes(num_q_heads=4, num_kv_heads=2, head_dim=16).reference_args() \
        == {}
    with pytest.raises(ValueError, match="score_format must be one of"):
        LokiSettings(score_format="int2")
    with pytest.raises(ValueError, match="score_format='int8' applies to method='loki' only"):
        LokiSettings(method="sparq", score_format="int8")
    for fmt in ("fp8", "int4"):
        with pytest.raises(ValueError, match="runs on the PyTorch reference only"):
            LokiSettings(score_format=fmt, backend="triton")
    assert LokiSettings(score_format="int8", backend="triton").backend is Backend.TRITON


def test_a_model_decodes_with_the_rounded_copy_on_both_routes():
    """enable_loki(settings=LokiSettings(score_format=...)): the decode steps of a cache and the teacher-forced rows
    of one forward give the same logits, and they differ from the native copy's (one layer, so that the dense
    prefill of the cache and the sparse rows of the forward leave the same keys and values)."""
    from loki.basis import PCABasis
    from loki.integrations.transformers import disable_loki, enable_loki, loki_cache
    from loki.testing.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    c = model.config
    basis = PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, seed=1)

    def logits(fmt, semantics):
        enable_loki(model, basis, settings=LokiSettings(k=0.25, d=0.5, score_format=fmt, semantics=semantics))
        try:
            with torch.no_grad():
                if semantics == "decode":
                    return model(input_ids=ids).logits[0, 24:]
                cache = loki_cache(model)
                from loki._hf import cache_keyword

                model(input_ids=ids[:, :24], **{cache_keyword(model): cache}, use_cache=True)  # dense prefill
                rows = []
                for t in range(24, 40):
                    out = model(input_ids=ids[:, t : t + 1], **{cache_keyword(model): cache}, use_cache=True)
                    rows.append(out.logits[0, -1])
                return torch.stack(rows)
        finally:
            disable_loki(model)

    tf, steps = logits("int4", "decode"), logits("int4", "generate")
    torch.testing.assert_close(tf, steps, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(tf, logits("native", "decode"), atol=1e-4)


@pytest.mark.interpreter
@pytest.mark.parametrize("d", [32, 8], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("mode,agg", [("query", "sum"), ("kv", "sum"), ("kv", "max"), ("kv", "softmax-max")])
def test_the_scores_kernel_reads_an_int8_copy_like_the_reference(triton_device, mode, agg, d):
    """The Triton scores over the int8 codes and per-token bf16 scales of ``encode_int8_score_keys`` equal the
    reference's ``score_format="int8"`` (the codes times the scale): per-head scores of 16 dims or more on the
    tensor cores (the query split into two fp16 halves), of fewer, and the group's sum and max, on the CUDA cores."""
    from loki.kernels import approx_scores as kernel_scores
    from loki.reference.score_formats import encode_int8_score_keys
    from loki.testing.inputs import make_decode_inputs

    x = make_decode_inputs(2, 6, 2, 300, 64, dtype=torch.bfloat16, device=triton_device, ragged=True, left_pad=True,
                           seed=3)
    codes, scale = encode_int8_score_keys(x.k_cache[..., :d])
    assert codes.dtype == torch.int8 and scale.dtype == torch.bfloat16 and tuple(scale.shape) == (2, 2, 300)
    torch.testing.assert_close(codes.float() * scale.float()[..., None],
                               quantize_score_keys(x.k_cache[..., :d], "int8").float(), rtol=0, atol=0)
    want = approx_scores(x.q, x.k_cache, d, x.lengths, x.starts, gqa_select=mode, aggregate=agg, score_format="int8")
    got = kernel_scores(x.q, x.k_cache, d, x.lengths, x.starts, gqa_select=mode, aggregate=agg, k_prefix=codes,
                        prefix_scale=scale)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not torch.isnan(got).any()
    fin = torch.isfinite(want)
    assert (got[fin] - want[fin]).abs().max().item() <= 1e-4 * max(1.0, want[fin].abs().max().item())
    native = approx_scores(x.q, x.k_cache, d, x.lengths, x.starts, gqa_select=mode, aggregate=agg)
    assert (native[fin] - want[fin]).abs().max().item() > 1e-3  # the rounding is visible: the test can tell


def test_the_scores_kernel_checks_the_int8_copy():
    from loki.kernels import approx_scores as kernel_scores
    from loki.reference.score_formats import encode_int8_score_keys
    from loki.testing.inputs import make_decode_inputs

    x = make_decode_inputs(1, 2, 2, 16, 64)
    codes, scale = encode_int8_score_keys(x.k_cache[..., :16])
    with pytest.raises(ValueError, match="pass the copy's codes as k_prefix"):
        kernel_scores(x.q, x.k_cache, 16, gqa_select="query", aggregate="sum", prefix_scale=scale)
    with pytest.raises(ValueError, match="k_prefix must be a torch.int8"):
        kernel_scores(x.q, x.k_cache, 16, gqa_select="query", aggregate="sum", k_prefix=codes.float(),
                      prefix_scale=scale)
    with pytest.raises(ValueError, match="prefix_scale must be a contiguous bfloat16"):
        kernel_scores(x.q, x.k_cache, 16, gqa_select="query", aggregate="sum", k_prefix=codes,
                      prefix_scale=scale.float())


@pytest.mark.interpreter
def test_the_score_format_benchmark_checks_before_it_times(triton_device, capsys):
    """``benchmarks.tuning.score_formats --smoke``: every int8 row checked against the reference (exit 0)."""
    if triton_device.type != "cpu":
        pytest.skip("the smoke run is the interpreter's")
    from benchmarks.tuning import score_formats

    assert score_formats.main(["--smoke"]) == 0
    assert "| smoke | group sum | int8 copy, d=32 |" in capsys.readouterr().out


def test_the_default_score_copy_is_int8_at_the_native_copys_bytes():
    """score_format and d "auto" are decided once, by the settings: the int8 copy of d_f 0.5 for Loki with a key
    prefix or without (the bytes of the native copy at d_f 0.25; without a prefix the kernels round the keys in
    place), the native copy at 0.25 for the other methods; explicit values stay."""
    s = LokiSettings()
    assert (s.score_format, s.d) == (ScoreFormat.INT8, 0.5)
    assert (LokiSettings(score_format="native").d, LokiSettings(score_format="int4", backend="torch").d) == (0.25, 1.0)
    assert (LokiSettings(score_format="fp8").d, LokiSettings(d=0.25).score_format, LokiSettings(d=0.25).d) == (
        0.5, ScoreFormat.INT8, 0.25)
    for other in (dict(method="sparq"), dict(method="exact_topk"), dict(method="pcaattn")):
        s = LokiSettings(**other)
        assert (s.score_format, s.d) == (ScoreFormat.NATIVE, 0.25), other
    for no_prefix in (LokiSettings(key_prefix=False), LokiSettings(score_format="int8", key_prefix=False)):
        assert (no_prefix.score_format, no_prefix.d) == (ScoreFormat.INT8, 0.5)  # the default's scores
    with pytest.raises(ValueError, match="d must be an int count, a float fraction of D or 'auto'"):
        LokiSettings(d="half")
    # the integration and the evaluation take the settings' defaults, not their own
    import inspect

    from loki.evaluation.suite import SuiteOptions
    from loki.integrations.transformers import enable_loki

    sig = inspect.signature(enable_loki).parameters
    assert sig["d"].default == "auto" and sig["score_format"].default == "auto"
    assert (SuiteOptions().d, SuiteOptions().score_format) == (0.5, "int8")
