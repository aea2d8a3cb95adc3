"""PCABasis: save/load, validation against a model config, refusals, Rank@v and explained variance."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from loki.basis import BasisError, PCABasis, config_fingerprint, expected_shape
from loki.calibration.pca import explained_variance_ratio, fix_signs, mean_rank_per_layer, pca, rank_at
from loki.calibration.stats import KeyStatistics
from loki.testing.models import tiny_config

L, HKV, D = 2, 2, 16


def _basis(**metadata) -> PCABasis:
    """A basis fit on random anisotropic keys, with config metadata of the default tiny Llama."""
    gen = torch.Generator().manual_seed(1)
    stats = KeyStatistics(L, HKV, D)
    scales = torch.logspace(0, -2, D, dtype=torch.float64)
    for layer in range(L):
        stats.update(layer, torch.randn(500, HKV, D, generator=gen, dtype=torch.float64) * scales + 0.3)
    meta = dict(rotary="post", config=tiny_config("llama"), corpus="random", seq_len=32, model_dtype=torch.float32)
    meta.update(metadata)
    return PCABasis.from_statistics(stats, **meta)


# ---------------------------------------------------------------------------------------------- save / load


def test_save_load_round_trip_is_bit_exact(tmp_path):
    basis = _basis()
    path = tmp_path / "basis.safetensors"
    basis.save(path)
    loaded = PCABasis.load(path, config=tiny_config("llama"))
    for name in ("components", "eigenvalues", "means"):
        a, b = getattr(basis, name), getattr(loaded, name)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), name
    assert loaded.components.dtype == torch.float32
    assert loaded.metadata() == basis.metadata()
    assert loaded.model_name == "loki-tiny-llama"
    assert loaded.config_hash == config_fingerprint(tiny_config("llama"))
    assert (loaded.corpus, loaded.num_tokens, loaded.seq_len, loaded.rotary) == ("random", 500, 32, "post")
    assert loaded.model_dtype == "float32" and loaded.centered is True


def test_saved_file_has_plain_metadata_keys(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "basis.safetensors"
    _basis().save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["rotary"] == "post" and meta["model_name"] == "loki-tiny-llama"
    assert json.loads(meta["loki.basis"])["config_hash"] == meta["config_hash"]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b[:5], id="truncated-header"),
        pytest.param(lambda b: b"\xff" * 16 + b[16:], id="corrupt-header"),
        pytest.param(lambda b: b"not a safetensors file", id="garbage"),
    ],
)
def test_corrupt_file_raises_basis_error_naming_path(tmp_path, damage):
    path = tmp_path / "basis.safetensors"
    _basis().save(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BasisError, match="basis.safetensors"):
        PCABasis.load(path)


def test_missing_tensor_raises(tmp_path):
    from safetensors.torch import save_file

    basis = _basis()
    path = tmp_path / "partial.safetensors"
    save_file({"components": basis.components}, str(path), metadata={"loki.basis": "{}"})
    with pytest.raises(BasisError, match="partial.safetensors.*lacks tensor.*eigenvalues, means"):
        PCABasis.load(path)


def test_missing_metadata_raises(tmp_path):
    from safetensors.torch import save_file

    basis = _basis()
    path = tmp_path / "nometa.safetensors"
    save_file({"components": basis.components, "eigenvalues": basis.eigenvalues, "means": basis.means}, str(path))
    with pytest.raises(BasisError, match="nometa.safetensors.*metadata"):
        PCABasis.load(path)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        PCABasis.load(tmp_path / "nowhere.safetensors")


# ---------------------------------------------------------------------------------------------- validation


def test_basis_for_more_layers_is_refused():
    basis = _basis()
    config = tiny_config("llama", num_layers=4)
    msg = r"shape \[2, 2, 16, 16\] but config expects \[4, 2, 16, 16\] \(num_hidden_layers=4\)"
    with pytest.raises(BasisError, match=msg):
        basis.validate(config)


def test_basis_for_other_rope_theta_is_refused_by_fingerprint(tmp_path):
    basis = _basis()
    other = tiny_config("llama", rope_theta=5e5)
    other.name_or_path = "other-model"
    assert expected_shape(other) == (L, HKV, D)
    assert config_fingerprint(other) != basis.config_hash
    with pytest.raises(BasisError, match="calibrated for another model: 'loki-tiny-llama'.*'other-model'.*rope"):
        basis.validate(other)
    path = tmp_path / "b.safetensors"
    basis.save(path)
    with pytest.raises(BasisError, match="b.safetensors.*another model"):
        PCABasis.load(path, config=other)


def test_fingerprint_ignores_non_architecture_fields():
    a = tiny_config("llama")
    b = copy.deepcopy(a)
    b.name_or_path = "renamed"
    b.rms_norm_eps = 1e-3
    assert config_fingerprint(a) == config_fingerprint(b)
    assert config_fingerprint(a) != config_fingerprint(tiny_config("mistral"))
    assert config_fingerprint(a) == config_fingerprint(tiny_config("llama", rope_theta=10000))


def test_other_model_name_with_same_config_warns():
    with pytest.warns(UserWarning, match="calibrated on 'loki-tiny-llama'"):
        _basis().validate(tiny_config("llama"), model_name="a-fine-tune")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("field", ["components", "eigenvalues", "means"])
def test_non_finite_basis_is_refused(field, value):
    basis = _basis()
    getattr(basis, field).view(-1)[3] = value
    with pytest.raises(BasisError, match=f"{field} contain 1 non-finite"):
        basis.validate()


def test_non_orthogonal_basis_is_refused():
    basis = _basis()
    basis.components[1, 0] *= 1.01
    with pytest.raises(BasisError, match=r"not orthonormal.*layer 1, KV head 0"):
        basis.validate()
    basis.validate(atol=0.05)  # within a loose tolerance


def test_unsorted_eigenvalues_are_refused():
    basis = _basis()
    basis.eigenvalues[0, 1] = basis.eigenvalues[0, 1].flip(-1)
    with pytest.raises(BasisError, match="layer 0, KV head 1 are not in decreasing order"):
        basis.validate()


@pytest.mark.parametrize(
    "components, match",
    [
        pytest.param(torch.eye(D).expand(L, HKV, D, D), None, id="ok"),
        pytest.param(torch.eye(D).expand(L, HKV, 1, D, D), r"\[L, HKV, D, D\]", id="5d"),
        pytest.param(torch.zeros(L, HKV, D, D - 1), r"\[L, HKV, D, D\]", id="not-square"),
        pytest.param(torch.eye(D - 2).expand(L, HKV, D - 2, D - 2), r"eigenvalues have shape", id="D-mismatch"),
    ],
)
def test_wrong_shape_is_refused(components, match):
    basis = PCABasis.identity(L, HKV, D)
    basis.components = components.clone()
    if match is None:
        basis.validate(tiny_config("llama"))
    else:
        with pytest.raises(BasisError, match=match):
            basis.validate()


def test_wrong_head_dim_for_config_is_refused():
    with pytest.raises(BasisError, match=r"config expects \[2, 2, 32, 32\] \(head_dim=32\)"):
        PCABasis.identity(L, HKV, D).validate(tiny_config("llama", head_dim=32))
    with pytest.raises(BasisError, match=r"num_key_value_heads=4"):
        PCABasis.identity(L, HKV, D).validate(tiny_config("llama", num_kv_heads=4))


# ---------------------------------------------------------------------------------------------- helpers


def test_identity_and_random_are_valid_and_reproducible():
    PCABasis.identity(3, 2, 8).validate()
    a, b = PCABasis.random(3, 2, 8, seed=5), PCABasis.random(3, 2, 8, seed=5)
    a.validate(atol=1e-5)
    assert torch.equal(a.components, b.components)
    assert not torch.equal(a.components, PCABasis.random(3, 2, 8, seed=6).components)
    assert (a.num_layers, a.num_kv_heads, a.head_dim) == (3, 2, 8)
    assert a.layer(2).shape == (2, 8, 8)


def test_to_casts_components_and_keeps_eigenvalues():
    basis = _basis()
    half = basis.to(dtype=torch.float16)
    assert half.components.dtype == torch.float16 and half.means.dtype == torch.float16
    assert half.eigenvalues.dtype == torch.float64
    assert basis.components.dtype == torch.float32  # the original is untouched
    assert half.model_name == basis.model_name


def test_pca_orders_eigenvalues_and_fixes_signs():
    basis = _basis()
    assert (basis.eigenvalues[..., :-1] >= basis.eigenvalues[..., 1:]).all()
    p = basis.components.to(torch.float64)
    torch.testing.assert_close(p.transpose(-1, -2) @ p, torch.eye(D, dtype=torch.float64).expand_as(p))
    pivots = p.gather(-2, p.abs().argmax(dim=-2, keepdim=True))
    assert (pivots > 0).all()
    assert torch.equal(fix_signs(-basis.components), basis.components)


def test_pca_recovers_known_spectrum():
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen, dtype=torch.float64))
    spectrum = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    eig, comps = pca(q @ torch.diag(spectrum) @ q.T)
    torch.testing.assert_close(eig, spectrum, rtol=0, atol=1e-12)
    torch.testing.assert_close((comps.T @ q).abs(), torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-10)


def test_rank_at_follows_the_paper_definition():
    eig = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    # cumulative ratios: [0.4, 0.7, 0.9, 1.0] and [1, 1, 1, 1]
    assert rank_at(eig, 40).tolist() == [1, 1]
    assert rank_at(eig, 41).tolist() == [2, 1]
    assert rank_at(eig, 90).tolist() == [3, 1]
    assert rank_at(eig, 90.0001).tolist() == [4, 1]
    assert rank_at(eig, 100).tolist() == [4, 1]
    torch.testing.assert_close(
        explained_variance_ratio(eig)[0], torch.tensor([0.4, 0.7, 0.9, 1.0], dtype=torch.float64)
    )
    assert mean_rank_per_layer(eig[None], 90).tolist() == [2.0]


@pytest.mark.parametrize("v", [0, -5, 100.5], ids=["zero", "negative", "above-100"])
def test_rank_at_rejects_bad_percentages(v):
    with pytest.raises(ValueError, match="v must be a percentage"):
        rank_at(torch.ones(3), v)


def test_basis_rank_at_is_monotone():
    basis = _basis()
    ranks = torch.stack([basis.rank_at(v) for v in (10, 50, 80, 90, 95, 99, 100)])
    assert ranks.shape == (7, L, HKV) and ranks.dtype == torch.int64
    assert (ranks[1:] >= ranks[:-1]).all() and (ranks >= 1).all() and (ranks <= D).all()
    ev = basis.explained_variance()
    assert ev.shape == (L, HKV, D) and (ev[..., 1:] >= ev[..., :-1]).all()
    assert torch.equal(ev[..., -1], torch.ones(L, HKV, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_basis_is_refused_naming_its_dtype(tmp_path, dtype):
    """A basis rounded to 16 bits is no longer orthonormal to the tolerance (bf16: ~4e-3 at D=64) and gains nothing
    (scores are computed in float32): refused with its dtype named and float32 recommended, whether built in
    memory or read from a file another tool wrote."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = str(dtype).replace("torch.", "")
    basis = PCABasis.random(2, 3, 64)
    with pytest.raises(BasisError, match=rf"components are {name}; a basis must be float32 or float64"):
        basis.to(dtype=dtype).validate()
    score = PCABasis.random(2, 3, 64, kind="score")
    score.query_components = score.components.to(dtype)
    with pytest.raises(BasisError, match=rf"query_components are {name}"):
        score.validate()
    path = tmp_path / "basis.safetensors"
    basis.save(path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["components"] = tensors["components"].to(dtype)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(BasisError, match=rf"{path}: basis components are {name}.*float32"):
        PCABasis.load(path)
    for ok in (torch.float32, torch.float64):  # full precision keeps working, and saves as float32
        basis.to(dtype=ok).validate(atol=1e-5)
        basis.to(dtype=ok).save(path)
        assert PCABasis.load(path).components.dtype == torch.float32
