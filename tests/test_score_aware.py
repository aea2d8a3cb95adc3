"""Score-aware bases (kind "score"): the dual pair keeps Lemma 1, beats the keys' PCA at ranking scores, and
works through calibration, the basis file format and the transformers integration."""

from __future__ import annotations

import pytest
import torch

from loki.basis import BasisError, PCABasis
from loki.calibration import KeyStatistics, calibrate, pca
from loki.calibration.score_aware import score_aware_pair
from loki.reference import dense_attention, exact_scores, loki_attention, rotate_keys, rotate_query
from loki.testing.inputs import random_orthogonal
from loki.testing.models import tiny_model


def _anisotropic(n, D, seed, decay):
    g = torch.Generator().manual_seed(seed)
    frame = random_orthogonal(1, D, seed=seed, dtype=torch.float64)[0]
    return (torch.randn(n, D, generator=g, dtype=torch.float64) * decay ** torch.arange(D)) @ frame.T


def _score_error(q, k, Pq, Pk, d):
    """Mean over queries of the variance over keys of the rank-d score error (what ranking cares about)."""
    err = q @ k.T - (q @ Pq[:, :d]) @ (k @ Pk[:, :d]).T
    return float(err.var(dim=1).mean())


def test_dual_pair_preserves_scores_and_beats_key_pca():
    D = 32
    q = _anisotropic(4000, D, seed=1, decay=0.8)  # queries live in other directions than the keys' variance
    k = _anisotropic(4000, D, seed=2, decay=0.9)
    mq = q.T @ q / len(q)
    kc = k - k.mean(0)
    ck = kc.T @ kc / len(k)
    pq, pk, s = score_aware_pair(mq, ck, eps=1e-12)
    torch.testing.assert_close(pq @ pk.T, torch.eye(D, dtype=torch.float64), atol=1e-8, rtol=0)
    assert (s[1:] <= s[:-1] + 1e-12).all()
    _, P = pca(ck)
    for d in (2, 4, 8, 16):
        assert _score_error(q, k, pq, pk, d) < _score_error(q, k, P, P, d)
    assert _score_error(q, k, pq, pk, D) < 1e-12


def _stats(x, L=1):
    st = KeyStatistics(L, 1, x.shape[-1])
    st.update(0, x[:, None, :])
    return st


def test_score_basis_file_round_trip_and_validation(tmp_path):
    from loki.calibration.score_aware import score_aware_basis

    q, k = _anisotropic(500, 16, 3, 0.8), _anisotropic(500, 16, 4, 0.9)
    b = score_aware_basis(_stats(k), _stats(q))
    assert b.kind == "score" and b.query_components is not None
    b.validate()
    path = tmp_path / "score.safetensors"
    b.save(path)
    loaded = PCABasis.load(path)
    assert loaded.kind == "score"
    assert torch.equal(loaded.query_components, b.query_components)
    assert torch.equal(loaded.query_layer(0), b.query_components[0])
    bad = PCABasis(**{**b.__dict__, "query_components": b.query_components * 1.5})
    with pytest.raises(BasisError, match="not a dual pair"):
        bad.validate()
    with pytest.raises(BasisError, match="needs query_components"):
        PCABasis(**{**b.__dict__, "query_components": None}).validate()
    with pytest.raises(BasisError, match="must not have query_components"):
        PCABasis(**{**b.__dict__, "kind": "pca"}).validate()


def test_loki_with_a_score_basis_is_exact_at_full_dims():
    """Lemma 1 with a dual pair: q_hat = q P_q, K_hat = K P_k give exact attention at d = D, k = S."""
    from loki.testing.inputs import make_decode_inputs

    x = make_decode_inputs(2, 4, 2, 50, 64, dtype=torch.float64, ragged=True)
    q = x.q.transpose(0, 1).reshape(2, -1, 64)  # [HKV, ., D] samples for the statistics
    k = x.k_cache.transpose(0, 1).reshape(2, -1, 64)
    st_k, st_q = KeyStatistics(1, 2, 64), KeyStatistics(1, 2, 64)
    st_k.update(0, k.transpose(0, 1))
    st_q.update(0, (q.repeat(1, 40, 1) + 0.1 * torch.randn(2, 4 * 40, 64, dtype=torch.float64)).transpose(0, 1))
    pq, pk, _ = score_aware_pair(st_q.second_moment()[0], st_k.covariance()[0])
    qh, kh = rotate_query(x.q, pq), rotate_keys(x.k_cache, pk)
    torch.testing.assert_close(exact_scores(qh, kh, x.lengths), exact_scores(x.q, x.k_cache, x.lengths))
    out = loki_attention(qh, kh, x.v_cache, d=64, k=1.0, lengths=x.lengths, compute_dtype=torch.float64,
                         gqa_select="query", aggregate="sum")
    torch.testing.assert_close(out, dense_attention(x.q, x.k_cache, x.v_cache, x.lengths,
                                                    compute_dtype=torch.float64))


def test_calibrate_score_basis_on_a_tiny_model_and_generate_exactly():
    from loki.integrations.transformers import disable_loki, enable_loki

    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    ref = tiny_model("llama", num_heads=4, num_kv_heads=2)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(1, 256, (8, 64), generator=g)
    basis = calibrate(model, data, kind="score", num_tokens=512, seq_len=64, progress=False)
    assert basis.kind == "score" and basis.rotary == "post"
    basis.validate(model.config)
    with pytest.raises(ValueError, match="rotary must be 'post'"):
        calibrate(model, data, kind="score", rotary="pre", num_tokens=64, seq_len=64, progress=False)
    with pytest.raises(ValueError, match="kind must be"):
        calibrate(model, data, kind="svd", num_tokens=64, seq_len=64, progress=False)
    ids = data[:1, :12]
    expected = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    enable_loki(model, basis, k=1.0, d=1.0)
    got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    disable_loki(model)
    assert torch.equal(got, expected)


# ------------------------------------------------------------------- the group-normalised pair ("score-group")
def test_group_query_moment_weighs_every_head_by_its_own_score_spread():
    from loki.calibration.score_aware import group_query_moment

    D, G = 8, 3
    k = _anisotropic(800, D, seed=5, decay=0.8)
    heads = [_anisotropic(600, D, seed=10 + h, decay=0.7) * (1.0, 30.0, 0.2)[h] for h in range(G)]
    qh = KeyStatistics(1, G, D)
    qh.update(0, torch.stack(heads, dim=1))  # [N, HQ, D]
    keys = _stats(k)
    cov = keys.covariance(centered=True)
    got = group_query_moment(qh, cov)
    want = sum((q.T @ q / len(q)) / float(((q @ cov[0, 0]) * q).sum(1).mean()) for q in heads) / G
    torch.testing.assert_close(got[0, 0], want, rtol=1e-10, atol=1e-12)
    # scaling one head's queries leaves it unchanged (the pooled moment is dominated by the loud head)
    qh2 = KeyStatistics(1, G, D)
    qh2.update(0, torch.stack([heads[0], heads[1] / 30.0, heads[2]], dim=1))
    torch.testing.assert_close(group_query_moment(qh2, cov), got, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="not a multiple"):
        group_query_moment(KeyStatistics(1, 2, D), cov.expand(1, 3, D, D))


def test_group_normalised_pair_keeps_lemma_1_and_equals_the_pooled_one_for_alike_heads():
    from loki.calibration.score_aware import score_aware_basis

    D = 16
    k = _anisotropic(700, D, seed=6, decay=0.85)
    q = _anisotropic(700, D, seed=7, decay=0.8)
    qh = KeyStatistics(1, 2, D)
    qh.update(0, torch.stack([q, q], dim=1))  # two alike heads of one KV group
    pooled = KeyStatistics(1, 1, D)
    pooled.update(0, torch.cat([q, q])[:, None])
    a = score_aware_basis(_stats(k), qh, group_normalised=True)
    b = score_aware_basis(_stats(k), pooled)
    assert a.extra["query_moment"] == "group-normalised" and "query_moment" not in b.extra
    eye = torch.eye(D)
    torch.testing.assert_close(a.query_components[0, 0] @ a.components[0, 0].T, eye, atol=1e-4, rtol=0)
    # the same directions: only the overall scale of the query moment differs (P_k by a constant factor)
    ratio = a.components[0, 0] / b.components[0, 0]
    torch.testing.assert_close(ratio, ratio[0, 0].expand_as(ratio), rtol=1e-3, atol=1e-3)


def test_score_group_basis_from_a_tiny_model_pools_the_per_head_statistics():
    from loki.calibration import fit_bases
    from loki.calibration.collect import collect_statistics

    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    st = collect_statistics(model, [ids], kinds=("query", "query-heads"), progress=False)
    L, HQ, D = st["query-heads"].shape
    per_head = st["query-heads"].outer.view(L, 2, HQ // 2, D, D).sum(2)
    torch.testing.assert_close(per_head, st["query"].outer)  # the same queries, pooled or per head
    bases = fit_bases(model, [ids], ("score", "score-group"), max_positions=64, progress=False)
    g = bases["score-group"]
    assert g.kind == "score" and g.extra["query_moment"] == "group-normalised"
    assert not torch.allclose(g.components, bases["score"].components)
    prod = g.query_components.double() @ g.components.double().transpose(-1, -2)
    torch.testing.assert_close(prod, torch.eye(D, dtype=torch.float64).expand_as(prod), atol=1e-3, rtol=0)
