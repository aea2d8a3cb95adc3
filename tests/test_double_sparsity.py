"""Double Sparsity as a Loki basis: calibrate(kind="channels") gives orthogonal permutations ordered by the
calibrated |q_j k_j| contribution, and Loki with d = r on it selects exactly what the direct channel-subset form
(loki.reference.double_sparsity_attention) selects."""

from __future__ import annotations

import pytest
import torch

from loki.basis import PCABasis
from loki.calibration import calibrate, label_channels
from loki.evaluation.agreement import capture_qk
from loki.reference import double_sparsity_attention, loki_attention, rotate_keys, rotate_query
from loki.testing.models import tiny_model

T = 24


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 256, (4, T), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def basis(model, tokens):
    return calibrate(model, tokens, kind="channels", num_tokens=4 * T, seq_len=T, max_positions=T, batch_size=2,
                     corpus_name="random-ids", progress=False)


def test_the_basis_is_an_orthogonal_permutation_recorded_as_channels(model, basis, tmp_path):
    L, HKV, D = 2, 2, 16
    P = basis.components
    assert basis.kind == "channels" and basis.rotary == "post" and basis.query_components is None
    assert P.shape == (L, HKV, D, D)
    assert set(P.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(P.sum(-1), torch.ones(L, HKV, D)) and torch.equal(P.sum(-2), torch.ones(L, HKV, D))
    assert torch.equal(P.transpose(-1, -2) @ P, torch.eye(D).expand(L, HKV, D, D))
    assert (basis.eigenvalues[..., :-1] >= basis.eigenvalues[..., 1:]).all()
    basis.validate(model.config)
    path = tmp_path / "ds.safetensors"
    basis.save(path)
    loaded = PCABasis.load(path, config=model.config)
    assert loaded.kind == "channels" and torch.equal(loaded.components, P)
    assert loaded.extra["method"] == "double_sparsity"


def test_the_order_is_the_calibrated_contribution(model, tokens, basis):
    """mean over tokens of |q_j k_j| (same token, the group's query heads averaged), from the queries and keys
    captured on the same forward passes."""
    qk = capture_qk(model, tokens)
    for layer, (q, k) in qk.items():  # q [B, HQ, T, D], k [B, HKV, T, D]
        B, HQ, _, D = q.shape
        HKV = k.shape[1]
        contrib = (q.view(B, HKV, HQ // HKV, T, D) * k[:, :, None]).abs().double().mean(dim=(0, 2, 3))  # [HKV, D]
        want = torch.sort(contrib, dim=-1, descending=True, stable=True)
        torch.testing.assert_close(basis.eigenvalues[layer], want.values, rtol=1e-5, atol=1e-7)
        assert torch.equal(label_channels(basis.components[layer]), want.indices)


@pytest.mark.parametrize("gqa,agg", [("query", "sum"), ("kv", "softmax-max"), ("kv", "sum")])
@pytest.mark.parametrize("r", [1, 4, 16])
def test_loki_on_the_basis_is_the_channel_subset_method(model, tokens, basis, gqa, agg, r):
    qk = capture_qk(model, tokens[:2])
    checked = 0
    for layer, (q, k) in qk.items():
        P = basis.layer(layer)
        channels = label_channels(P)[:, :r]
        v = torch.randn_like(k[:, :, 0:1]).expand_as(k).contiguous() + k  # any values
        for t in (5, 17, T - 1):  # decode steps: query row t over the t + 1 tokens it sees
            qt, kt, vt = q[:, :, t], k[:, :, : t + 1], v[:, :, : t + 1]
            want, (wi, wc) = double_sparsity_attention(qt, kt, vt, channels=channels, k=0.3, gqa_select=gqa,
                                                       aggregate=agg, return_indices=True)
            got, (gi, gc) = loki_attention(rotate_query(qt, P), rotate_keys(kt, P), vt, d=r, k=0.3, gqa_select=gqa,
                                           aggregate=agg, return_indices=True)
            assert torch.equal(gc, wc) and torch.equal(gi, wi)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == 6


def test_the_engine_runs_it_as_loki_with_loki_bytes(model, tokens, basis):
    from loki.evaluation.perplexity import MethodSpec, perplexity

    r = perplexity(model, tokens[:2], MethodSpec("double_sparsity", "loki", k=0.25, d=4, basis="ds"),
                   {"ds": basis})
    assert r.score_fraction == pytest.approx(4 / 32)
    assert r.bytes_fraction == pytest.approx(4 / 32 + r.selected_fraction)
    full = perplexity(model, tokens[:2], MethodSpec("full", "full"))
    assert r.ppl != pytest.approx(full.ppl, rel=1e-9)


def test_bad_arguments_are_refused(model, tokens):
    with pytest.raises(ValueError, match="rotary must be 'post'"):
        calibrate(model, tokens, kind="channels", rotary="pre", num_tokens=T, seq_len=T, progress=False)
    with pytest.raises(ValueError, match="kind must be one of"):
        calibrate(model, tokens, kind="other", num_tokens=T, seq_len=T, progress=False)
    q, k = torch.randn(1, 4, 16), torch.randn(1, 2, 9, 16)
    with pytest.raises(ValueError, match="channels must"):
        double_sparsity_attention(q, k, k, channels=torch.tensor([[0, 16], [1, 2]]), k=2, gqa_select="query",
                                  aggregate="sum")
