"""Calibration never returns a NaN basis: a KV head whose keys are constant (or come from one token) gets the
identity basis with a warning naming it, statistics with NaN or inf and a calibration without variance in any head
are refused naming the layer and KV head, and a basis file holding NaN is refused on load with its layer and head."""

from __future__ import annotations

import json

import pytest
import torch

from loki.basis import BasisError, PCABasis
from loki.calibration import KeyStatistics, calibrate
from loki.calibration.score_aware import score_aware_basis, score_aware_pair
from loki.testing.models import tiny_model

L, HKV, D = 2, 2, 8


def _stats(keys_by_layer):
    st = KeyStatistics(L, HKV, D)
    for layer, keys in enumerate(keys_by_layer):
        st.update(layer, keys)
    return st


def _random(n, seed):
    return torch.randn(n, HKV, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _with_constant_head(n=64, layer=1, head=0, seed=0):
    keys = [_random(n, seed + i) for i in range(L)]
    keys[layer][:, head] = torch.linspace(-1, 1, D, dtype=torch.float64)  # the same key for every token
    return _stats(keys)


def _finite(b: PCABasis) -> bool:
    return all(torch.isfinite(t).all() for t in (b.components, b.eigenvalues, b.queries))


def test_score_aware_constant_head_gets_the_identity_pair():
    keys, queries = _with_constant_head(), _stats([_random(64, 10 + i) for i in range(L)])
    with pytest.warns(RuntimeWarning, match="layer 1 KV head 0"):
        b = score_aware_basis(keys, queries)
    assert _finite(b)
    b.validate()
    eye = torch.eye(D)
    assert torch.equal(b.components[1, 0], eye) and torch.equal(b.query_components[1, 0], eye)
    assert (b.eigenvalues[1, 0] == 0).all()
    assert not torch.equal(b.components[0, 0], eye)  # the other heads are fitted as before


def test_score_aware_pair_of_zero_matrices_is_the_identity():
    zero = torch.zeros(3, D, D, dtype=torch.float64)
    mq = torch.eye(D, dtype=torch.float64).expand(3, D, D).clone()
    pq, pk, s = score_aware_pair(mq, zero)
    assert torch.isfinite(pq).all() and torch.isfinite(pk).all()
    assert torch.equal(pk, torch.eye(D, dtype=torch.float64).expand(3, D, D)) and (s == 0).all()
    pq, pk, s = score_aware_pair(zero, mq)  # no query energy: every score is 0
    assert torch.equal(pq @ pk.transpose(-1, -2), torch.eye(D, dtype=torch.float64).expand(3, D, D))


def test_pca_constant_head_gets_the_identity():
    with pytest.warns(RuntimeWarning, match="layer 1 KV head 0"):
        b = PCABasis.from_statistics(_with_constant_head())
    assert _finite(b) and torch.equal(b.components[1, 0], torch.eye(D)) and (b.eigenvalues[1, 0] == 0).all()
    b.validate()


@pytest.mark.parametrize("kind", ["pca", "score"])
def test_one_token_is_refused(kind):
    keys = _stats([_random(1, i) for i in range(L)])
    with pytest.raises(BasisError, match=r"no layer or KV head has any variance.*1 token"):
        if kind == "score":
            score_aware_basis(keys, _stats([_random(1, 5 + i) for i in range(L)]))
        else:
            PCABasis.from_statistics(keys)


@pytest.mark.parametrize("kind", ["pca", "score"])
def test_nan_keys_are_refused_with_layer_and_head(kind):
    keys = [_random(32, i) for i in range(L)]
    keys[1][3, 1, 2] = float("nan")
    st = _stats(keys)
    with pytest.raises(BasisError, match=r"keys of layer 1, KV head 1 contain NaN or inf"):
        if kind == "score":
            score_aware_basis(st, _stats([_random(32, 7 + i) for i in range(L)]))
        else:
            PCABasis.from_statistics(st)


def test_nan_queries_are_refused_with_layer_and_head():
    queries = [_random(32, 3 + i) for i in range(L)]
    queries[0][0, 1, 0] = float("inf")
    with pytest.raises(BasisError, match=r"queries of layer 0, KV head 1"):
        score_aware_basis(_stats([_random(32, i) for i in range(L)]), _stats(queries))


def test_calibrate_a_model_with_a_dead_kv_head():
    """A KV head whose key projection is zero (constant, all-zero keys): the score-aware and PCA bases are
    finite, identity for that head, and the file round-trips."""
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=64)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[16:32] = 0  # layer 1, KV head 1
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    for kind in ("score", "pca"):
        with pytest.warns(RuntimeWarning, match="layer 1 KV head 1"):
            b = calibrate(model, ids, kind=kind, num_tokens=128, seq_len=32, max_positions=32, progress=False)
        assert _finite(b) and torch.equal(b.components[1, 1], torch.eye(16))
        assert not torch.equal(b.components[1, 0], torch.eye(16))


def test_loading_a_nan_basis_names_the_layer_and_head(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    PCABasis.random(L, HKV, D, seed=0).save(good)
    with safe_open(str(good), framework="pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors["components"][1, 0, 2, 3] = float("nan")
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    assert json.loads(meta["loki.basis"])["rotary"] == "post"
    with pytest.raises(BasisError, match=r"non-finite values.*layer 1, KV head 0"):
        PCABasis.load(bad)
