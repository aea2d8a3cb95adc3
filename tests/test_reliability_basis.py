"""The basis file on careless use: saving an invalid basis never replaces a good file, an interrupted save
leaves the previous file intact, and metadata of the wrong JSON type is a BasisError that names the field."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loki.basis import BasisError, PCABasis

L, HKV, D = 2, 2, 8


def _good(tmp_path):
    path = tmp_path / "basis.safetensors"
    PCABasis.random(L, HKV, D, seed=0, rotary="post", num_tokens=100).save(path)
    return path, path.read_bytes()


def _broken(change: str) -> PCABasis:
    b = PCABasis.random(L, HKV, D, seed=1)
    if change == "non-orthonormal":
        b.components = b.components * 1.5
    elif change == "nan":
        b.components[0, 0, 0, 0] = float("nan")
    elif change == "unsorted-eigenvalues":
        b.eigenvalues = b.eigenvalues.flip(-1)
    elif change == "wrong-shape":
        b.means = b.means[..., :-1]
    elif change == "rotary":
        b.rotary = "middle"
    elif change == "num-tokens-type":
        b.num_tokens = "many"
    elif change == "score-without-query-components":
        b.kind = "score"
    return b


CHANGES = ["non-orthonormal", "nan", "unsorted-eigenvalues", "wrong-shape", "rotary", "num-tokens-type",
           "score-without-query-components"]


@pytest.mark.parametrize("change", CHANGES)
def test_saving_an_invalid_basis_leaves_the_good_file_untouched(tmp_path, change):
    path, before = _good(tmp_path)
    with pytest.raises(BasisError):
        _broken(change).save(path)
    assert path.read_bytes() == before
    PCABasis.load(path)  # still loads
    assert sorted(os.listdir(tmp_path)) == ["basis.safetensors"]  # no temporary file left behind


@given(eps=st.floats(2e-3, 10.0), layer=st.integers(0, L - 1), head=st.integers(0, HKV - 1))
def test_no_perturbation_beyond_the_tolerance_is_saved(tmp_path_factory, eps, layer, head):
    path, before = _good(tmp_path_factory.mktemp("b"))
    b = PCABasis.random(L, HKV, D, seed=2)
    b.components[layer, head] += eps * torch.eye(D)
    with pytest.raises(BasisError, match="not orthonormal"):
        b.save(path)
    assert path.read_bytes() == before


def test_an_interrupted_save_keeps_the_previous_file(tmp_path, monkeypatch):
    import safetensors.torch

    path, before = _good(tmp_path)

    def dies_half_way(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        PCABasis.random(L, HKV, D, seed=3).save(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["basis.safetensors"]


def test_saving_to_a_directory_is_named(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory"):
        PCABasis.random(L, HKV, D).save(tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_valid_save_replaces_the_file(tmp_path):
    path, _ = _good(tmp_path)
    other = PCABasis.random(L, HKV, D, seed=5, rotary="pre")
    other.save(path)
    assert PCABasis.load(path).rotary == "pre"
    assert torch.equal(PCABasis.load(path).components, other.components)


# ------------------------------------------------------------------------------------------------ metadata types
def _with_metadata(tmp_path, blob: str):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path, _ = _good(tmp_path)
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    meta["loki.basis"] = blob
    out = tmp_path / "edited.safetensors"
    save_file(tensors, str(out), metadata=meta)
    return out


@pytest.mark.parametrize("blob,match", [
    ("[1, 2]", r"'loki.basis' metadata must be a JSON object, got list"),
    ('"post"', r"'loki.basis' metadata must be a JSON object, got str"),
    ("null", r"'loki.basis' metadata must be a JSON object"),
    ('{"num_tokens": "abc"}', r"'num_tokens' must be an integer, got str"),
    ('{"num_tokens": true}', r"'num_tokens' must be an integer, got bool"),
    ('{"num_tokens": -1}', r"'num_tokens' must be >= 0"),
    ('{"seq_len": 2.5}', r"'seq_len' must be an integer or null"),
    ('{"rotary": 3}', r"'rotary' must be a string, got int"),
    ('{"kind": ["pca"]}', r"'kind' must be a string, got list"),
    ('{"config_fields": 5}', r"'config_fields' must be a JSON object or null"),
    ('{"config_hash": 5}', r"'config_hash' must be a string or null"),
    ('{"centered": "no"}', r"'centered' must be true or false"),
    ('{"model_name": {}}', r"'model_name' must be a string or null"),
    ('{"extra": 3}', r"'extra' must be a JSON object, got int"),
])
def test_metadata_of_the_wrong_json_type_is_named(tmp_path, blob, match):
    path = _with_metadata(tmp_path, blob)
    with pytest.raises(BasisError, match=match) as e:
        PCABasis.load(path)
    assert "edited.safetensors" in str(e.value)


def test_metadata_naming_a_tensor_is_kept_as_extra(tmp_path):
    path = _with_metadata(tmp_path, json.dumps({"components": 3, "rotary": "pre"}))
    b = PCABasis.load(path)
    assert b.rotary == "pre" and b.extra["components"] == 3 and b.components.shape == (L, HKV, D, D)


@given(value=st.one_of(st.integers(), st.text(max_size=3), st.lists(st.integers(), max_size=2), st.none(),
                       st.booleans(), st.floats(allow_nan=False)),
       field=st.sampled_from(["num_tokens", "seq_len", "rotary", "centered", "config_fields", "kind"]))
def test_any_metadata_value_loads_or_raises_a_basis_error(tmp_path_factory, value, field):
    path = _with_metadata(tmp_path_factory.mktemp("m"), json.dumps({field: value}))
    try:
        PCABasis.load(path)
    except BasisError:
        pass


def test_saving_into_a_missing_folder_and_loading_a_directory_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"folder .*missing does not exist"):
        PCABasis.random(L, HKV, D).save(tmp_path / "missing" / "b.safetensors")
    with pytest.raises(BasisError, match="is a directory"):
        PCABasis.load(tmp_path)
