"""Calibration on tiny random Hugging Face models: key capture, streamed statistics, PCA bases, refusals."""

from __future__ import annotations

import importlib

import pytest
import torch

from loki.basis import BasisError, PCABasis
from loki.calibration import (
    KeyStatistics,
    batch_keys,
    calibrate,
    collect_key_statistics,
    iter_token_batches,
    key_layout,
    rank_at,
)
from loki.testing.models import tiny_config, tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
SEQ_LEN = 24


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _tokens(n_seq: int, seq_len: int = SEQ_LEN, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n_seq, seq_len), generator=torch.Generator().manual_seed(seed))


def _reference_stats(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """count, sum [HKV, D], sum of outer products [HKV, D, D] of ``keys: [N, HKV, D]`` computed at once."""
    k = keys.to(torch.float64).transpose(0, 1)  # [HKV, N, D]
    return torch.tensor(keys.shape[0]), k.sum(dim=1), k.transpose(-1, -2) @ k


class CharTokenizer:
    """Stand-in for a Hugging Face tokenizer: one token per byte (no downloads)."""

    def __call__(self, text: str, add_special_tokens: bool = True):
        return {"input_ids": list(text.encode("utf-8"))}


# ---------------------------------------------------------------------------------------------- key capture


@pytest.mark.parametrize("arch", ARCHS)
def test_keys_match_rotary_input_and_output_and_cache(arch, monkeypatch):
    """Pre-rotary keys are what enters apply_rotary_pos_emb; post-rotary keys are what it returns and what the
    model's own cache stores."""
    model = tiny_model(arch)
    module = importlib.import_module(type(model).__module__)
    seen = []
    original = module.apply_rotary_pos_emb

    def spy(q, k, cos, sin, *args, **kwargs):
        q_embed, k_embed = original(q, k, cos, sin, *args, **kwargs)
        seen.append((k.detach().clone(), k_embed.detach().clone()))  # [B, HKV, S, D]
        return q_embed, k_embed

    ids = _tokens(2)
    monkeypatch.setattr(module, "apply_rotary_pos_emb", spy)
    keys = batch_keys(model, ids, rotary="both")
    monkeypatch.undo()
    assert len(seen) == model.config.num_hidden_layers
    for l, (k_in, k_out) in enumerate(seen):
        assert keys["pre"][l].shape == (2, SEQ_LEN, 2, 16)
        torch.testing.assert_close(keys["pre"][l], k_in.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(keys["post"][l], k_out.transpose(1, 2), rtol=0, atol=0)

    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    for l in range(model.config.num_hidden_layers):
        torch.testing.assert_close(keys["post"][l], cache.layers[l].keys.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_sliding_window_model_keeps_every_key():
    model = tiny_model("mistral", sliding_window=8)
    keys = batch_keys(model, _tokens(1), rotary="post")
    assert all(k.shape[1] == SEQ_LEN for k in keys["post"])


# ---------------------------------------------------------------------------------------------- statistics


def test_key_statistics_streamed_equal_all_at_once():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1000, 3, 8, generator=gen) * 3 + 1
    whole, parts = KeyStatistics(1, 3, 8), KeyStatistics(1, 3, 8)
    whole.update(0, keys)
    for chunk in keys.split([1, 7, 300, 0, 692]):
        parts.update(0, chunk)
    assert torch.equal(whole.count, parts.count)
    torch.testing.assert_close(parts.sum, whole.sum, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(parts.outer, whole.outer, rtol=1e-12, atol=1e-10)
    k = keys.to(torch.float64)
    mu = k.mean(0)
    cov = torch.einsum("nhd,nhe->hde", k - mu, k - mu) / k.shape[0]
    torch.testing.assert_close(parts.covariance()[0], cov, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(parts.mean[0], mu, rtol=1e-12, atol=1e-12)

    a, b = KeyStatistics(1, 3, 8), KeyStatistics(1, 3, 8)
    a.update(0, keys[:400])
    b.update(0, keys[400:])
    a += b
    torch.testing.assert_close(a.outer, whole.outer, rtol=1e-12, atol=1e-10)
    assert a.num_tokens == 1000


def test_key_statistics_reject_bad_updates():
    stats = KeyStatistics(2, 2, 4)
    with pytest.raises(ValueError, match=r"keys must have shape \[N, 2, 4\]"):
        stats.update(0, torch.zeros(3, 4, 2))
    with pytest.raises(ValueError, match="layer must be in"):
        stats.update(2, torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="no keys were recorded for layer 0"):
        stats.mean  # noqa: B018


@pytest.mark.parametrize("budget", [3 * SEQ_LEN, 3 * SEQ_LEN + 5, 1], ids=["whole-seqs", "truncated", "one-token"])
def test_streamed_model_stats_equal_stats_of_all_keys(llama, budget):
    """Statistics streamed over batches (budget truncating the last one) equal those of all keys at once."""
    batches = [_tokens(2, seed=s) for s in range(3)]
    stats = collect_key_statistics(llama, batches, rotary="both", num_tokens=budget, progress=False)
    for kind in ("pre", "post"):
        assert stats[kind].num_tokens == budget
        for l in range(llama.config.num_hidden_layers):
            keys = torch.cat([batch_keys(llama, b, rotary=kind)[kind][l].flatten(0, 1) for b in batches])[:budget]
            count, total, outer = _reference_stats(keys)
            assert int(stats[kind].count[l, 0]) == int(count)
            torch.testing.assert_close(stats[kind].sum[l], total, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(stats[kind].outer[l], outer, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_tokens_are_ignored(llama, side):
    """A padded batch gives the statistics of the same sequences run one by one without padding."""
    lengths = [SEQ_LEN, SEQ_LEN - 7, 5]
    seqs = [_tokens(1, n, seed=i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(len(seqs), SEQ_LEN, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        sl = slice(SEQ_LEN - len(s), SEQ_LEN) if side == "left" else slice(0, len(s))
        ids[i, sl], mask[i, sl] = s, 1
    padded = collect_key_statistics(llama, [(ids, mask)], rotary="both", progress=False)
    single = collect_key_statistics(llama, [s[None] for s in seqs], rotary="both", progress=False)
    for kind in ("pre", "post"):
        assert padded[kind].num_tokens == sum(lengths)
        assert torch.equal(padded[kind].count, single[kind].count)
        torch.testing.assert_close(padded[kind].sum, single[kind].sum, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(padded[kind].outer, single[kind].outer, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- calibrate


def test_calibrated_basis_is_a_valid_pca_basis(llama, tmp_path):
    basis = calibrate(
        llama, _tokens(6), num_tokens=100, seq_len=16, batch_size=2, corpus_name="random-ids", progress=False
    )
    assert isinstance(basis, PCABasis)
    L, HKV, D = 2, 2, 16
    assert basis.components.shape == (L, HKV, D, D) and basis.components.dtype == torch.float32
    p = basis.components.to(torch.float64)
    torch.testing.assert_close(
        p.transpose(-1, -2) @ p, torch.eye(D, dtype=torch.float64).expand_as(p), rtol=0, atol=1e-5
    )
    assert (basis.eigenvalues[..., :-1] >= basis.eigenvalues[..., 1:]).all()
    ranks = torch.stack([rank_at(basis.eigenvalues, v) for v in range(5, 101, 5)])
    assert (ranks[1:] >= ranks[:-1]).all() and (ranks[-1] <= D).all() and (ranks[0] >= 1).all()
    assert torch.equal(basis.rank_at(90), ranks[17])
    assert (basis.num_tokens, basis.seq_len, basis.rotary, basis.corpus) == (100, 16, "post", "random-ids")
    assert basis.model_name == "loki-tiny-llama" and basis.model_dtype == "float32" and basis.centered
    basis.validate(llama.config)
    path = tmp_path / "llama.safetensors"
    basis.save(path)
    loaded = PCABasis.load(path, config=llama.config)
    assert torch.equal(loaded.components, basis.components)
    with pytest.raises(BasisError, match="another model"):
        PCABasis.load(path, config=tiny_config("llama", rope_theta=1e6))
    with pytest.raises(BasisError, match=r"num_hidden_layers=3"):
        PCABasis.load(path, config=tiny_config("llama", num_layers=3))


def test_calibration_is_deterministic(llama):
    kwargs = dict(rotary="both", num_tokens=90, seq_len=SEQ_LEN, batch_size=2, progress=False)
    a = calibrate(llama, _tokens(5), **kwargs)
    b = calibrate(llama, _tokens(5), **kwargs)
    for kind in ("pre", "post"):
        assert torch.equal(a[kind].components, b[kind].components)
        assert torch.equal(a[kind].eigenvalues, b[kind].eigenvalues)


def test_both_equals_separate_runs(llama):
    kwargs = dict(num_tokens=60, seq_len=SEQ_LEN, batch_size=2, progress=False)
    both = calibrate(llama, _tokens(4), rotary="both", **kwargs)
    for kind in ("pre", "post"):
        alone = calibrate(llama, _tokens(4), rotary=kind, **kwargs)
        assert alone.rotary == both[kind].rotary == kind
        assert torch.equal(alone.components, both[kind].components)
    assert not torch.equal(both["pre"].components, both["post"].components)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_other_architectures_calibrate(arch):
    model = tiny_model(arch, num_heads=6, num_kv_heads=3, head_dim=8)
    bases = calibrate(model, _tokens(3), rotary="both", num_tokens=64, seq_len=16, batch_size=2, progress=False)
    for kind, basis in bases.items():
        assert basis.components.shape == (2, 3, 8, 8)
        assert basis.rotary == kind and basis.num_tokens == 64
        basis.validate(model.config, atol=1e-5)
    with pytest.raises(BasisError, match="another model"):
        bases["post"].validate(tiny_config("llama", num_heads=6, num_kv_heads=3, head_dim=8))


def test_calibrate_from_texts_with_tokenizer(llama):
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "", "  ", "Pack my box with five dozen jugs."]
    basis = calibrate(
        llama,
        texts,
        tokenizer=CharTokenizer(),
        num_tokens=150,
        seq_len=32,
        batch_size=2,
        corpus_name="pangrams",
        progress=True,
    )
    assert basis.num_tokens == 150 and basis.corpus == "pangrams"
    batches = list(iter_token_batches(texts, tokenizer=CharTokenizer(), seq_len=32, batch_size=2))
    # 168 bytes -> five sequences of 32 and one of 8 (right-padded, masked)
    assert [tuple(ids.shape) for ids, _ in batches] == [(2, 32), (2, 32), (2, 32)]
    assert batches[-1][1].sum(dim=1).tolist() == [32, 8]
    assert sum(int(m.sum()) for _, m in batches) == len("".join(t for t in texts if t.strip()).encode())


def test_short_data_warns_and_uses_what_there_is(llama):
    with pytest.warns(RuntimeWarning, match="data ran out after 48 tokens"):
        basis = calibrate(llama, _tokens(2), num_tokens=1000, seq_len=SEQ_LEN, progress=False)
    assert basis.num_tokens == 48


def test_model_training_flag_is_restored():
    model = tiny_model("llama").train()
    calibrate(model, _tokens(1), num_tokens=8, seq_len=8, progress=False)
    assert model.training


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(num_tokens=0), "num_tokens must be an integer >= 1", id="num_tokens-0"),
        pytest.param(dict(seq_len=1), "seq_len must be an integer >= 2", id="seq_len-1"),
        pytest.param(dict(batch_size=0), "batch_size must be an integer >= 1", id="batch_size-0"),
        pytest.param(dict(rotary="mid"), "rotary must be one of pre, post, both", id="rotary-mid"),
    ],
)
def test_bad_arguments_are_refused(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        calibrate(llama, _tokens(1), progress=False, **kwargs)


def test_texts_without_tokenizer_are_refused(llama):
    with pytest.raises(ValueError, match="tokenizer is required"):
        calibrate(llama, ["some text"], num_tokens=8, seq_len=4, progress=False)


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32)).eval()
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        calibrate(gpt2, _tokens(1), num_tokens=8, seq_len=8, progress=False)
    with pytest.raises(ValueError, match="not supported"):
        key_layout(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------- positions
def test_position_offsets_spread_over_the_covered_range():
    from loki.calibration.collect import position_offset

    assert [position_offset(i, 64, None) for i in range(3)] == [0, 0, 0]
    assert [position_offset(i, 64, 64) for i in range(3)] == [0, 0, 0]
    offs = [position_offset(i, 64, 1024) for i in range(200)]
    assert min(offs) >= 0 and max(offs) <= 1024 - 64
    counts = torch.histc(torch.tensor(offs, dtype=torch.float), bins=8, min=0, max=960)
    assert counts.min() >= 20  # every eighth of the range is used about equally
    # a range of 5 offsets: every one of them is used and none past it (the last sequence ends at position 63)
    assert sorted(set(position_offset(i, 60, 64) for i in range(100))) == [0, 1, 2, 3, 4]


def test_shifted_sequences_have_the_keys_of_the_later_positions(llama):
    """Rotary attention depends on relative positions only: a sequence placed at an offset gives the same
    pre-rotary keys, and its post-rotary keys are those of a forward at the shifted positions."""
    from loki.calibration import collect_statistics
    from loki.calibration.collect import position_offset
    from loki.calibration.hooks import AttentionRecorder

    ids = _tokens(1, seed=4)
    P = 200
    offsets = [position_offset(i, SEQ_LEN, P) for i in range(2)]
    assert offsets[0] == 0 and offsets[1] > 0
    plain = collect_statistics(llama, [ids, ids], kinds=("pre", "post"), progress=False)
    shifted = collect_statistics(llama, [ids, ids], kinds=("pre", "post"), max_positions=P, progress=False)
    torch.testing.assert_close(shifted["pre"].outer, plain["pre"].outer, rtol=1e-4, atol=1e-5)
    keys = {}

    def grab(layer, query, key):
        keys.setdefault(layer, []).append(key.transpose(1, 2)[0])

    with AttentionRecorder(llama, grab), torch.no_grad():
        for off in offsets:
            key_layout(llama).base(input_ids=ids, position_ids=torch.arange(off, off + SEQ_LEN)[None],
                                   use_cache=False)
    for layer, ks in keys.items():
        _, total, outer = _reference_stats(torch.cat(ks))
        torch.testing.assert_close(shifted["post"].outer[layer], outer, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(shifted["post"].outer, plain["post"].outer, rtol=1e-3, atol=1e-3)


def test_calibrate_records_the_covered_positions(llama, tmp_path):
    ctx = llama.config.max_position_embeddings
    b = calibrate(llama, _tokens(3), num_tokens=3 * SEQ_LEN, seq_len=SEQ_LEN, progress=False)
    assert b.max_positions == ctx and b.seq_len == SEQ_LEN and b.covered_positions == ctx
    b = calibrate(llama, _tokens(3), num_tokens=3 * SEQ_LEN, max_positions=SEQ_LEN, progress=False)
    assert b.max_positions == SEQ_LEN and b.seq_len == SEQ_LEN
    b.save(tmp_path / "b.safetensors")
    assert PCABasis.load(tmp_path / "b.safetensors").max_positions == SEQ_LEN
    with pytest.raises(ValueError, match="seq_len=48 exceeds max_positions=24"):
        calibrate(llama, _tokens(3), seq_len=48, max_positions=24, progress=False)


def test_one_pass_gives_the_bases_of_separate_calibrations(llama):
    from loki.calibration import fit_bases

    batches = [_tokens(2, seed=s) for s in range(2)]
    n = 4 * SEQ_LEN
    together = fit_bases(llama, batches, ("pre", "post", "score"), max_positions=64, progress=False)
    alone = {"score": calibrate(llama, batches, kind="score", num_tokens=n, max_positions=64, progress=False),
             **calibrate(llama, batches, rotary="both", num_tokens=n, max_positions=64, progress=False)}
    for name in ("pre", "post", "score"):
        torch.testing.assert_close(together[name].components, alone[name].components, rtol=1e-5, atol=1e-5)
        assert together[name].max_positions == 64


def test_enable_loki_warns_once_past_the_covered_positions(llama):
    import warnings

    from loki.integrations.transformers import disable_loki, enable_loki

    b = calibrate(llama, _tokens(3), num_tokens=3 * SEQ_LEN, max_positions=SEQ_LEN, progress=False)
    enable_loki(llama, b, k=0.5, d=0.5, semantics="decode")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                llama(input_ids=_tokens(1, SEQ_LEN), use_cache=False)
            assert not [w for w in caught if "calibrated on positions" in str(w.message)]
            with torch.no_grad():
                llama(input_ids=_tokens(1, SEQ_LEN + 4), use_cache=False)
                llama(input_ids=_tokens(1, SEQ_LEN + 4), use_cache=False)
        msgs = [w for w in caught if "calibrated on positions below 24" in str(w.message)]
        assert len(msgs) == 1 and "holds 28 tokens" in str(msgs[0].message)
    finally:
        disable_loki(llama)
