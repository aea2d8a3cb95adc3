"""Evaluation machinery on tiny random models: decode-time perplexity semantics, densities, agreement, Rank@v
plots, reports, gates and the CLI's argument handling (no real model here; see test_accuracy_gates.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loki.basis import PCABasis
from loki.evaluation import gates, perplexity, rank, report
from loki.evaluation.agreement import capture_qk, selection_agreement, topk_agreement
from loki.evaluation.perplexity import MethodSpec, effective_density, method_logits
from loki.testing.models import tiny_model


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, seed=3)
    basis = PCABasis.random(2, 2, 16, seed=1, rotary="post")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    return model, basis, ids


# ------------------------------------------------------------------------------------------ decode semantics
@pytest.mark.parametrize(
    "spec",
    [
        pytest.param(MethodSpec("loki", "loki", k=0.3, d=0.25, basis="b"), id="loki-k0.3-d0.25"),
        pytest.param(MethodSpec("loki-kv", "loki", k=0.2, d=5, basis="b", gqa_select="kv"), id="loki-kv-d5"),
        pytest.param(MethodSpec("exact", "exact_topk", k=0.25), id="exact_topk"),
        pytest.param(MethodSpec("sparq", "sparq", k=0.25, d=4), id="sparq-r4"),
    ],
)
@pytest.mark.parametrize("protocol", ["decode", "paper"])
def test_teacher_forcing_equals_token_by_token_decoding(tiny, spec, protocol):
    """The perplexity path (one forward, every row a decode step) gives the logits of an actual decode loop
    (enable_loki + single-token forwards with the KV cache) on the same text."""
    model, basis, ids = tiny
    tf = method_logits(model, ids, spec, {"b": basis}, protocol=protocol)
    loop = method_logits(model, ids, spec, {"b": basis}, protocol=protocol, decode_loop=True)
    assert tf.shape == loop.shape == (1, 40, 128)
    torch.testing.assert_close(tf, loop, rtol=1e-4, atol=1e-4)
    dense = method_logits(model, ids, MethodSpec("full", "full"))
    assert (tf - dense).abs().max() > 1e-3  # the sparse setting really differs from dense attention


def test_sparse_budget_one_matches_full(tiny):
    model, basis, ids = tiny
    full = method_logits(model, ids, MethodSpec("full", "full"))
    for spec in (MethodSpec("l", "loki", k=1.0, d=1.0, basis="b"), MethodSpec("e", "exact_topk", k=1.0),
                 MethodSpec("x", "dense")):
        torch.testing.assert_close(method_logits(model, ids, spec, {"b": basis}), full, rtol=1e-4, atol=1e-4)


def test_model_left_unchanged(tiny):
    model, basis, ids = tiny
    impl = model.config._attn_implementation
    method_logits(model, ids, MethodSpec("l", "loki", k=0.25, d=0.5, basis="b"), {"b": basis})
    assert model.config._attn_implementation == impl and not hasattr(model, "_loki")


def test_perplexity_full_equals_hf_loss(tiny):
    model, _, ids = tiny
    windows = torch.cat([ids, ids.flip(1)])
    r = perplexity.perplexity(model, windows, MethodSpec("full", "full"))
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss
    assert r.ppl == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert r.tokens == 2 * 39 and r.density == 1.0 and len(r.window_nll) == 2


def test_h2o_perplexity_runs_by_decode_loop(tiny):
    model, _, ids = tiny
    r = perplexity.perplexity(model, ids, MethodSpec("h2o", "h2o", k=0.25))
    full = perplexity.perplexity(model, ids, MethodSpec("full", "full"))
    assert math.isfinite(r.ppl) and r.ppl != pytest.approx(full.ppl, rel=1e-6)


def test_method_spec_validation():
    with pytest.raises(ValueError, match="method"):
        MethodSpec("x", "magic")
    with pytest.raises(ValueError, match="basis"):
        MethodSpec("x", "loki")
    with pytest.raises(ValueError, match="protocol"):
        effective_density(0.25, 10, "other")


def test_missing_basis_is_named(tiny):
    model, _, ids = tiny
    with pytest.raises(KeyError, match="pre"):
        method_logits(model, ids, MethodSpec("x", "loki", k=0.5, d=0.5, basis="pre"), {"post": None})


# ------------------------------------------------------------------------------------------ densities
@pytest.mark.parametrize("T", [1, 2, 97, 256])
def test_effective_density(T):
    n = torch.arange(1, T + 1)
    assert effective_density(1.0, T) == 1.0 == effective_density(1.0, T, "paper")
    dec = effective_density(0.25, T)
    assert dec == pytest.approx(float(torch.ceil(0.25 * n).clamp(min=1).sum() / n.sum()))
    K = math.ceil(0.25 * T)
    assert effective_density(0.25, T, "paper") == pytest.approx(float(n.clamp(max=K).sum() / n.sum()))
    if T == 256:
        assert 0.25 <= dec < 0.26
        assert effective_density(0.25, T, "paper") == pytest.approx(2 * 0.25 - 0.25**2, abs=0.01)


# ------------------------------------------------------------------------------------------ agreement
def test_capture_qk_shapes_and_restore(tiny):
    model, _, ids = tiny
    impl = model.config._attn_implementation
    qk = capture_qk(model, ids)
    assert sorted(qk) == [0, 1]
    q, k = qk[0]
    assert q.shape == (1, 4, 40, 16) and k.shape == (1, 2, 40, 16)
    assert model.config._attn_implementation == impl


@pytest.mark.parametrize("gqa", ["query", "kv"])
def test_selection_agreement_full_dims_is_perfect(gqa):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 33, 16, generator=g), torch.randn(2, 33, 16, generator=g)
    P = PCABasis.random(1, 2, 16, seed=2).layer(0)
    r = selection_agreement(q, k, P, k_f=0.25, d=1.0, gqa_select=gqa, aggregate="sum")
    assert r["rows"] == 32  # row 0 selects its only token: not informative
    torch.testing.assert_close(r["jaccard"], torch.ones_like(r["jaccard"]), atol=1e-6, rtol=0)
    torch.testing.assert_close(r["mass"], r["mass_exact"])
    low = selection_agreement(q, k, P, k_f=0.25, d=2, gqa_select=gqa, aggregate="sum")
    assert (low["jaccard"] <= 1).all() and (low["mass"] <= low["mass_exact"] + 1e-9).all()
    assert float(low["jaccard"].mean()) < 1


def test_topk_agreement_tiny(tiny):
    model, basis, ids = tiny
    out = topk_agreement(model, torch.cat([ids, ids]), {"post": basis}, k_f=0.25, d=0.5, progress=False,
                         gqa_select="query", aggregate="sum")
    a = out["post"]
    assert len(a["jaccard"]) == 2 and len(a["jaccard"][0]) == 4 and len(a["mass"][0]) == 4
    assert 0 < a["jaccard_mean"] <= 1 and 0 < a["mass_mean"] <= a["mass_exact_mean"] + 1e-9 <= 1 + 1e-9


# ------------------------------------------------------------------------------------------ rank
def test_rank_summary_and_plots(tmp_path):
    pre = PCABasis.random(3, 2, 8, seed=0, rotary="pre")
    post = PCABasis.random(3, 2, 8, seed=1, rotary="post")
    s = rank.rank_summary({"pre": pre, "post": post}, (90.0, 50.0))
    assert s["pre"]["v90"]["per_head"] == pre.rank_at(90).tolist()
    assert len(s["post"]["v50"]["per_layer"]) == 3 and s["post"]["D"] == 8
    files = rank.write_rank_plots({"pre": pre, "post": post}, tmp_path)
    assert set(files) == {"rank_per_layer", "rank_heatmap", "explained_variance"}
    for f in files.values():
        assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ gates, report
def _row(name, method, ppl, k=0.25, d=0.25, gqa="query", basis=None, T=512, full=20.0, width=0.02):
    inc = ppl / full - 1
    return {"name": name, "method": method, "ppl": ppl, "k": k, "d": d, "gqa_select": gqa, "basis": basis,
            "density": 0.25, "seconds": 1.0, "protocol": "decode", "seq_len": T, "windows": 4,
            "increase": inc, "increase_lo": inc - width, "increase_hi": inc + width}


def _cmp(a, b, inc, width=0.02, T=512, k=0.25):
    return {"a": a, "b": b, "seq_len": T, "k": k, "protocol": "decode", "increase": inc, "lo": inc - width,
            "hi": inc + width}


def _results(**over):
    rows = {
        "full": _row("full", "full", 20.0, k=1.0, d=1.0),
        "exact_topk[query]": _row("exact_topk[query]", "exact_topk", 21.0),
        "loki-pre[query]": _row("loki-pre[query]", "loki", 25.0, basis="pre"),
        "loki-post[query]": _row("loki-post[query]", "loki", 24.0, basis="post"),
        "loki-score[query]": _row("loki-score[query]", "loki", 22.0, basis="score"),
        "h2o": _row("h2o", "h2o", 23.0),
    }
    for name, ppl in over.items():
        r = rows[name]
        rows[name] = _row(name, r["method"], ppl, k=r["k"], d=r["d"], basis=r["basis"])
    comps = [_cmp("exact_topk[query]", "full", 0.05), _cmp("loki-pre[query]", "exact_topk[query]", 0.19),
             _cmp("loki-post[query]", "exact_topk[query]", 0.14), _cmp("loki-score[query]", "exact_topk[query]", 0.05),
             _cmp("loki-score[query]", "h2o", -0.04), _cmp("loki-score[query]", "loki-post[query]", -0.08),
             _cmp("loki-score[query]", "loki-pre[query]", -0.12)]
    exactness = [_row("full", "full", 20.0, k=1.0, d=1.0, T=256), _row("exact_topk[query]", "exact_topk", 21.0, T=256),
                 _row("loki-post(d=D,k=all)", "loki", 20.0, k=1.0, d=1.0, basis="post", T=256),
                 _row("loki-post(d=D)[query]", "loki", 21.0, d=1.0, basis="post", T=256)]
    settings = dict(check_profile_settings(), torch="x", eval_origin="test", default_basis="score")
    return {"settings": settings, "perplexity": list(rows.values()), "comparisons": comps, "exactness": exactness,
            "agreement": {"post": {"jaccard_mean": 0.6, "mass_mean": 0.8, "mass_exact_mean": 0.9}}}


def check_profile_settings():
    from loki.evaluation.suite import profile_options

    return profile_options("tests").profile_settings()


THRESH = {"exactness_rel_tol": 1e-4, "ordering_rel_tol": 1e-6, "fidelity": {"ppl_rel_max": 0.15}}


def _failed(results, thr=THRESH, profile="tests"):
    return {g["name"] for g in gates.evaluate_gates(results, thr, profile) if not g["passed"]}


def test_gates_pass_and_fail_on_intervals():
    res = _results()
    names = [g["name"] for g in gates.evaluate_gates(res, THRESH, "tests")]
    assert not _failed(res), gates.evaluate_gates(res, THRESH, "tests")
    assert any("exactness" in n for n in names) and any("H2O" in n for n in names)
    assert any(n.startswith("fidelity: loki-score[query] within 15%") for n in names)
    bad = _results()
    bad["exactness"][2]["ppl"] = 20.1  # d = D, k = all no longer reproduces full attention
    bad["comparisons"][1] = _cmp("loki-pre[query]", "exact_topk[query]", -0.05)  # Loki better than the oracle
    bad["comparisons"][4] = _cmp("loki-score[query]", "h2o", 0.05)  # significantly worse than H2O
    failed = _failed(bad)
    assert "exactness: Loki d=D, k=all == full (loki-post(d=D,k=all))" in failed
    assert "ordering: exact_topk[query] <= loki-pre[query]" in failed
    assert any("not worse than H2O" in n for n in failed)
    # an interval that reaches across the bound is not evidence: no failure
    unsure = _results()
    unsure["comparisons"][4] = _cmp("loki-score[query]", "h2o", 0.01)
    unsure["perplexity"][4].update(increase=0.16, increase_lo=0.14, increase_hi=0.18)
    assert not _failed(unsure)
    unsure["perplexity"][4].update(increase=0.18, increase_lo=0.16, increase_hi=0.20)
    assert _failed(unsure) == {"fidelity: loki-score[query] within 15% of full at T=512"}


def test_update_thresholds_from_three_texts_and_regression_gates(tmp_path):
    path = tmp_path / "thr.json"
    path.write_text(json.dumps(THRESH))
    runs = {t: _results(**{"loki-post[query]": p}) for t, p in (("wikitext", 24.0), ("wikipedia", 25.0),
                                                                 ("book", 23.0))}
    for t, r in runs.items():
        r["agreement"]["post"]["jaccard_mean"] = {"wikitext": 0.6, "wikipedia": 0.55, "book": 0.7}[t]
    data = gates.update_thresholds(runs, path, "tests")
    prof = data["profiles"]["tests"]
    post = prof["ppl_delta_max"]["loki-post[query]"]
    assert post["measured"] == {"wikitext": pytest.approx(0.2), "wikipedia": pytest.approx(0.25),
                                "book": pytest.approx(0.15)}
    assert post["max"] == pytest.approx(0.25 * 1.1 + 0.02)  # the worst text plus the margin
    assert prof["jaccard_min"]["post"]["min"] == pytest.approx(0.53)
    assert set(prof["measured_on"]) == {"wikitext", "wikipedia", "book"}
    thr = gates.load_thresholds(path)
    for r in runs.values():  # the limits hold on each text
        assert not _failed(r, thr), r
    worse = _results(**{"loki-post[query]": 26.5})  # +32.5%, interval [+30.5%, +34.5%] above 29.5%
    assert _failed(worse, thr) == {"regression: loki-post[query] ppl increase"}
    edge = _results()
    edge["perplexity"][3].update(increase=0.30, increase_lo=0.28, increase_hi=0.32)  # reaches below the limit
    assert not _failed(edge, thr)
    other = _results()
    other["settings"]["windows"] = [[256, 7]]
    skipped = [g for g in gates.evaluate_gates(other, thr, "tests") if "skipped" in g.get("bound_text", "")]
    assert len(skipped) == 1 and skipped[0]["passed"]
    low = _results()
    low["agreement"]["post"]["jaccard_mean"] = 0.5  # below the recorded minimum (0.53)
    assert _failed(low, thr) == {"regression: jaccard (post basis)"}


def test_long_thresholds_and_retrieval_gates(tmp_path):
    path = tmp_path / "thr.json"
    res = _results()
    res["perplexity"].append(_row("loki-score[query]", "loki", 21.0, k=0.125, T=8192, full=20.0))
    res["retrieval"] = {"cells": [
        {"task": "all", "context_len": 8192, "name": "loki-score[query]", "method": "loki", "n": 64,
         "accuracy": 0.9, "ci": [0.8, 0.96]},
        {"task": "all", "context_len": 8192, "name": "full", "method": "full", "n": 64, "accuracy": 1.0,
         "ci": [0.94, 1.0]},
        {"task": "passkey", "context_len": 8192, "name": "loki-score[query]", "method": "loki", "n": 32,
         "accuracy": 0.9, "ci": [0.75, 0.97]}]}
    data = gates.update_thresholds({"wikitext": res}, path, "long", long_length=8192)
    prof = data["profiles"]["long"]
    assert set(prof["ppl_delta_max"]) == {"loki-score[query]@T8192,k0.125"}
    assert prof["retrieval_min"] == {"all@8192:loki-score[query]": {"measured": {"wikitext": 0.9}, "min": 0.8}}
    thr = gates.load_thresholds(path)
    assert not _failed(res, thr, "long")
    res["retrieval"]["cells"][0].update(accuracy=0.5, ci=[0.4, 0.6])
    assert _failed(res, thr, "long") == {"regression: retrieval all@8192:loki-score[query]"}
    # a later retrieval-only run records its limits and keeps the perplexity limits
    res["retrieval"]["cells"][0].update(accuracy=0.7, ci=[0.6, 0.8])
    only = {"settings": res["settings"], "perplexity": [], "retrieval": res["retrieval"]}
    data = gates.update_thresholds({"wikitext": only}, path, "long", long_length=8192)
    assert set(data["profiles"]["long"]["ppl_delta_max"]) == {"loki-score[query]@T8192,k0.125"}
    assert data["profiles"]["long"]["retrieval_min"]["all@8192:loki-score[query]"]["min"] == pytest.approx(0.6)
    # a retrieval-only run says so (settings["parts"]): its perplexity and agreement limits are not run ...
    only["settings"] = dict(res["settings"], parts={"perplexity": False, "agreement": False, "retrieval": True})
    assert not _failed(only, gates.load_thresholds(path), "long")
    # ... while results that should hold perplexity and agreement rows but hold none fail, unless allow_missing
    bare = dict(only, settings=dict(res["settings"]))
    assert {"results: perplexity rows", "exactness: d = D rows", "regression: jaccard (post basis)"} <= _failed(
        bare, gates.load_thresholds(path), "long")
    assert not [g for g in gates.evaluate_gates(bare, gates.load_thresholds(path), "long", allow_missing=True)
                if not g["passed"]]


def test_downstream_thresholds_recorded_and_gated(tmp_path):
    path = tmp_path / "thr.json"
    path.write_text(json.dumps(THRESH))
    res = _results()
    res["downstream"] = {"tasks": ["loki_copa"], "limit": 30, "num_fewshot": 0,
                         "accuracy": {"full": {"loki_copa": 0.6, "mean": 0.6},
                                      "loki-score[query]": {"loki_copa": 0.55, "mean": 0.55}}}
    data = gates.update_thresholds({"wikitext": res}, path, "tests")
    assert data["downstream"]["delta_max"]["loki-score[query]"] == {"measured": 0.05, "max": 0.1}
    thr = gates.load_thresholds(path)
    ok = [g for g in gates.evaluate_gates(res, thr, "tests") if g["name"].startswith("downstream")]
    assert len(ok) == 1 and ok[0]["passed"]
    worse = json.loads(json.dumps(res))
    worse["downstream"]["accuracy"]["loki-score[query]"]["mean"] = 0.45
    bad = [g for g in gates.evaluate_gates(worse, thr, "tests") if g["name"].startswith("downstream")]
    assert len(bad) == 1 and not bad[0]["passed"] and bad[0]["value"] == pytest.approx(0.15)
    other = json.loads(json.dumps(res))
    other["downstream"]["limit"] = 10
    skipped = [g for g in gates.evaluate_gates(other, thr, "tests") if g["name"].startswith("downstream")]
    assert skipped[0]["passed"] and "skipped" in skipped[0]["bound_text"]


def test_markdown_report(tmp_path):
    res = _results()
    res["gates"] = gates.evaluate_gates(res, THRESH, "tests")
    res["paper_protocol"] = [_row("loki-post[query]", "loki", 21.5)]
    res["generalization"] = {"setting": "s", "texts": ["a", "b"], "full": {"a": 10.0, "b": 20.0},
                             "table": {"wikipedia": {"a": 11.0, "b": 24.0}, "book": {"a": 12.0, "b": 22.0}},
                             "intervals": {"wikipedia": {"a": {"increase": 0.1, "lo": 0.05, "hi": 0.15}}}}
    files = report.write_report(res, tmp_path)
    md = files["markdown"].read_text()
    assert "## Gates: PASS" in md
    assert "| loki-post[query] | 4 x 512 | 0.25 | 0.25 | query | 24.000 | +20.00% [+18.00, +22.00] | - |" in md
    assert "## Generalisation" in md and "11.000 (+10.0% [+5.0, +15.0])" in md and "24.000 (+20.0%)" in md
    assert json.loads(files["json"].read_text())["perplexity"][0]["name"] == "full"
    res["perplexity"] += [_row("loki-post[query]", "loki", 21.0, T=4096)]
    assert report.write_length_plot(res, tmp_path) == {"ppl_vs_length": "ppl_vs_length.png"}
    assert (tmp_path / "ppl_vs_length.png").read_bytes()[:4] == b"\x89PNG"


def _renamed(res: dict) -> dict:
    """The same run with every setting renamed (new-format rows: role, reproduces, comparison kinds)."""
    res = json.loads(json.dumps(res))
    new = {}

    def rename(name):
        return new.setdefault(name, f"setting {len(new)}")

    roles = {"full": "baseline", "exact_topk": "oracle", "loki": "loki", "h2o": "competitor"}
    for r in res["perplexity"] + res["exactness"]:
        r["role"] = roles[r["method"]]
        r["name"] = rename(r["name"])
    res["exactness"][2]["reproduces"], res["exactness"][3]["reproduces"] = "baseline", "oracle"
    kinds = ["oracle_vs_baseline", "loki_vs_oracle", "loki_vs_oracle", "loki_vs_oracle", "loki_vs_h2o",
             "default_vs_basis", "default_vs_basis"]
    for c, kind in zip(res["comparisons"], kinds):
        c.update(a=rename(c["a"]), b=rename(c["b"]), kind=kind)
    return res


def test_gates_choose_rows_by_role_not_by_display_name():
    """Renaming every setting keeps every gate (and its verdict): rows are chosen by role, basis, GQA mode and
    the exactness row's ``reproduces``, comparisons by ``kind``."""
    res = _results()
    before = gates.evaluate_gates(res, THRESH, "tests")
    after = gates.evaluate_gates(_renamed(res), THRESH, "tests")
    prefix = lambda gs: sorted(g["name"].split(":")[0].split(" (")[0] for g in gs)  # noqa: E731
    assert prefix(after) == prefix(before)
    assert [g["passed"] for g in after] == [g["passed"] for g in before]
    for kind in ("exactness", "ordering", "fidelity", "Loki best basis"):
        assert any(g["name"].startswith(kind) for g in after), kind
    bad = _renamed(res)
    bad["exactness"][2]["ppl"] = 20.1  # the renamed d = D, k = all row no longer reproduces full attention
    assert [g["name"] for g in gates.evaluate_gates(bad, THRESH, "tests") if not g["passed"]] == [
        "exactness: Loki d=D, k=all == full (setting 6)"]


def test_a_run_with_nothing_to_check_fails():
    settings = _results()["settings"]
    empty = {"settings": settings, "perplexity": [], "comparisons": []}
    gs = gates.evaluate_gates(empty, THRESH, "tests")
    assert {g["name"] for g in gs if not g["passed"]} >= {"results: perplexity rows", "exactness: d = D rows"}
    assert gates.verdict(gs) == (False, gates.verdict(gs)[1]) and "FAILED" in gates.verdict(gs)[1]
    assert gates.verdict([]) == (False, "FAILED: no gates ran (the results hold nothing to check)")
    assert gates.verdict(gates.evaluate_gates(empty, THRESH, "tests", allow_missing=True))[0]
    assert gates.verdict(gates.evaluate_gates({}, THRESH, "tests"))[0] is False  # no settings at all


def _with_native_known_misses(thr: dict) -> dict:
    """``thr`` with the known misses the native copy of d_f 0.25 had in the long profile (1024-token windows and 8k
    retrieval, per query head and shared): the int8 default meets those targets and ships none, so the tests of
    the known-miss mechanism carry their own."""
    thr = json.loads(json.dumps(thr))
    ppl = {(t["window"], t["k"]): t for t in thr["targets"]["ppl"]}
    ppl[(1024, 0.25)]["known_misses"] = {"long": [
        {"measured": 0.146372, "interval": [0.104164, 0.197935], "gqa_select": "kv", "aggregate": "softmax-max",
         "recorded": "H100, tree of dc4fbfa", "reason": "the native copy at 1024-token windows"},
        {"measured": 0.139789, "interval": [0.101095, 0.184206], "recorded": "H200, commit 25fc83c",
         "reason": "the native copy at 1024-token windows, per query head"}]}
    thr["targets"]["retrieval"][0]["known_misses"] = {"long": [
        {"measured": -0.0625, "interval": [-0.121419, -0.002734], "gqa_select": "kv", "aggregate": "softmax-max",
         "recorded": "H100, tree of 0efc1ac", "reason": "the native copy at 8k"},
        {"measured": -0.020833, "interval": [-0.065922, 0.024395], "recorded": "H200, commit 25fc83c",
         "reason": "the native copy at 8k, per query head"}]}
    return thr


def _long_run(increase, lo, hi, diff=None):
    """A long-profile run holding the default Loki row at 1024-token windows (and a retrieval cell at 8k), with the
    thresholds of the shipped file plus the native copy's known misses."""
    thr = _with_native_known_misses(gates.load_thresholds())
    settings = dict(thr["profiles"]["long"]["settings"], default_basis="score",
                    parts={"perplexity": False, "agreement": False, "retrieval": diff is not None})
    row = _row("loki-score[query]", "loki", 20.0 * (1 + increase), basis="score", T=1024)
    row.update(increase=increase, increase_lo=lo, increase_hi=hi)
    res = {"settings": settings, "perplexity": [row], "comparisons": []}
    if diff is not None:
        res["retrieval"] = {"cells": [{"task": "all", "context_len": 8192, "name": "loki-score[query]",
                                       "method": "loki", "basis": "score", "gqa_select": "query", "k": 0.125, "n": 96,
                                       "accuracy": 0.58, "ci": [0.48, 0.68], "reference": "exact_topk[query]",
                                       "diff": {"diff": diff[0], "lo": diff[1], "hi": diff[2]}}]}
    return res, thr


def test_target_at_1024_tokens_is_the_readme_target_with_a_recorded_known_miss():
    """The shipped 1024-token target is +8% (the README's), not +15%, and the default meets it (no known miss
    shipped); a miss recorded as a known miss with its measured value (the native copy's): reported, failing
    unless allowed, failing when worse."""
    from loki.evaluation.targets import load_targets

    ppl, ret = load_targets(gates.load_thresholds())
    t1024 = next(t for t in ppl if (t.window, t.k) == (1024, 0.25))
    assert t1024.max == 0.08 and not t1024.known_misses and not any(t.known_misses for t in (*ppl, *ret))
    ppl, _ = load_targets(_with_native_known_misses(gates.load_thresholds()))
    t1024 = next(t for t in ppl if (t.window, t.k) == (1024, 0.25))
    assert {m.gqa: m.measured for m in t1024.known_misses["long"]} == pytest.approx(
        {("query", "sum"): 0.1398, ("kv", "softmax-max"): 0.1464}, abs=1e-4)
    res, thr = _long_run(0.14, 0.10, 0.18)  # as recorded
    (g,) = [g for g in gates.evaluate_gates(res, thr, "long") if g["name"].startswith("fidelity")]
    assert g["name"] == "fidelity: loki-score[query] within 8% of full at T=1024" and not g["passed"] and g["known"]
    assert gates.verdict([g]) == (False, "FAILED: only known misses (1); --allow-known-misses accepts them")
    assert gates.verdict([g], allow_known_misses=True)[0]
    res, thr = _long_run(0.20, 0.16, 0.24)  # significantly worse than recorded: not excused
    (g,) = [g for g in gates.evaluate_gates(res, thr, "long") if g["name"].startswith("fidelity")]
    assert not g["passed"] and not g.get("known") and "does not excuse it" in g["note"]
    assert not gates.verdict([g], allow_known_misses=True)[0]
    res, thr = _long_run(0.10, 0.07, 0.13)  # the interval reaches the target: no evidence of a miss
    assert all(g["passed"] for g in gates.evaluate_gates(res, thr, "long") if g["name"].startswith("fidelity"))
    # the retrieval target: -2 points; the recorded miss excuses -2.1 points, not a significantly worse run
    res, thr = _long_run(0.02, 0.01, 0.03, diff=(-0.021, -0.066, 0.024))
    (r,) = [g for g in gates.evaluate_gates(res, thr, "long") if g["name"].startswith("target: retrieval")]
    assert r["passed"]  # the interval reaches -2 points
    res, thr = _long_run(0.02, 0.01, 0.03, diff=(-0.12, -0.18, -0.06))
    (r,) = [g for g in gates.evaluate_gates(res, thr, "long") if g["name"].startswith("target: retrieval")]
    assert not r["passed"] and not r.get("known")


def test_readme_report_and_gates_read_one_set_of_targets(tmp_path):
    from loki.evaluation.targets import targets_markdown

    thr = gates.load_thresholds()
    doc = (Path(__file__).resolve().parents[1] / "docs" / "accuracy.md").read_text()
    assert targets_markdown(thr) in doc, "docs/accuracy.md's targets table differs from accuracy_thresholds.json"
    assert "fidelity" not in thr and "ppl_rel_max" not in json.dumps(thr), "a second set of target numbers"
    thr = _with_native_known_misses(thr)
    res, _ = _long_run(0.14, 0.10, 0.18)
    res["gates"] = gates.evaluate_gates(res, thr, "long")
    md = report.markdown_report(res, thr)
    assert "## Targets" in md
    # one verdict per target: the point estimate (met / missed) and whether the miss is significant (the gate)
    assert ("| default Loki, 1024-token windows, k_f = 0.25: perplexity within +8.0% | +8.0% | +14.0% [+10.0%, +18.0%] "
            "| missed, significant: known miss (fails unless --allow-known-misses) |") in md
    assert "Not measured in this run (other window lengths or budgets): 8192-token windows, k_f = 0.25" in md
    res, _ = _long_run(0.10, 0.07, 0.13)
    res["gates"] = gates.evaluate_gates(res, thr, "long")
    md = report.markdown_report(res, thr)
    assert ("| +10.0% [+7.0%, +13.0%] | missed, not significant (the interval reaches the target): passes |") in md
    res, _ = _long_run(0.20, 0.16, 0.24)  # significantly worse than the recorded known miss
    res["gates"] = gates.evaluate_gates(res, thr, "long")
    assert "| +20.0% [+16.0%, +24.0%] | missed, significant: fails |" in report.markdown_report(res, thr)


def test_report_opens_with_the_verdict_and_the_exit_rule():
    """The report's first section answers: does Loki work, at what cost, how fast; then the exit status and the
    rule that gave it.  A point estimate that misses a target whose interval reaches it is not a failure."""
    thr = gates.load_thresholds()
    res, _ = _long_run(0.10, 0.07, 0.13)
    res["settings"]["d"] = 0.25
    res["perplexity"][0].update(default=True, bytes_fraction=0.38)
    res["gates"] = gates.evaluate_gates(res, thr, "long")
    ok, summary = gates.verdict(res["gates"])
    res["exit"] = {"status": 0 if ok else 1, "summary": summary}
    md = report.markdown_report(res, thr)
    head = md.split("\n## ")[1]
    assert head.startswith("Verdict")
    lines = [line for line in head.splitlines() if line.startswith("- **")]
    assert [line.split("**")[1] for line in lines] == ["Does Loki work on this model?", "At what cost?", "How fast?"]
    assert "**yes**: every gate passed" in lines[0] and ok
    assert "+10.0% [95% interval +7.0%, +13.0%] perplexity" in lines[1]
    assert "target +8%: missed, not significant (the interval reaches the target): passes" in lines[1]
    assert "reads 0.38 of the bytes of dense attention" in lines[2] and "at most 2.6x faster" in lines[2]
    assert "Exit status **0** (all gates passed). The rule: 0 when no gate fails; 1 when a gate fails" in head
    res, _ = _long_run(0.20, 0.16, 0.24)
    res["gates"] = gates.evaluate_gates(res, thr, "long")
    ok, summary = gates.verdict(res["gates"])
    res["exit"] = {"status": 0 if ok else 1, "summary": summary}
    md = report.markdown_report(res, thr)
    assert not ok and "**no**: 1 of" in md and "Exit status **1**" in md


def test_committed_results_without_role_fields_keep_their_gates():
    """Results written before the role fields (results/accuracy-long-h200-2026-11-26) are read through their
    method, k and d fields: every gate they were decided with is still there but the regression limits (recorded
    since with the default's softmax-max shared rows, which those raw-sum results do not measure: skipped with the
    reason), and the one failure is the 1024-token target, which a known miss recorded for the profile's settings
    does not excuse: those results measured the native copy, the profile's settings are the int8 copy's."""
    folder = Path(__file__).resolve().parents[1] / "results" / "accuracy-long-h200-2026-11-26"
    res = json.loads((folder / "results.json").read_text())
    assert "role" not in res["perplexity"][0]
    res["retrieval"] = json.loads((folder / "retrieval.json").read_text())
    gs = gates.evaluate_gates(res, _with_native_known_misses(gates.load_thresholds()), "long")
    kept = {g["name"] for g in res["gates"] if not g["name"].startswith("regression:")}
    assert kept and kept <= {g["name"] for g in gs}
    (skip,) = [g for g in gs if g["name"] == "regression thresholds apply"]
    assert skip["passed"] and "kv_aggregate" in skip["note"] and "score_format" in skip["note"]
    failed = [g for g in gs if not g["passed"]]
    assert [g["name"] for g in failed] == ["fidelity: loki-score[query] within 8% of full at T=1024"]
    assert not failed[0].get("known") and not gates.verdict(gs, allow_known_misses=True)[0]


def test_suite_rows_and_comparisons_carry_roles():
    from types import SimpleNamespace

    from loki.evaluation import suite

    def res(method, basis=None, gqa="query", shift=0.0):
        return SimpleNamespace(method=method, basis=basis, gqa_select=gqa,
                               token_nll=torch.full((2, 255), 3.0 + shift, dtype=torch.float64))

    measured = {"A": res("full"), "B": res("exact_topk", shift=0.1), "C": res("loki", "score", shift=0.2),
                "D": res("loki", "post", shift=0.3), "E": res("h2o", shift=0.4)}
    opts = replace(suite.profile_options("tests"), gqa_select="query")  # a model without GQA
    kinds = {(c["a"], c["b"]): c["kind"] for c in suite._comparisons(measured, 512, 0.25, "decode", opts)}
    assert kinds == {("B", "A"): "oracle_vs_baseline", ("C", "B"): "loki_vs_oracle", ("D", "B"): "loki_vs_oracle",
                     ("C", "E"): "loki_vs_h2o", ("D", "E"): "loki_vs_h2o", ("C", "D"): "default_vs_basis"}
    # a GQA model: the shared rows are the default mode, compared with their own oracle and with H2O; the
    # per-query-head rows with theirs and with each other, not with H2O
    measured.update(F=res("exact_topk", gqa="kv", shift=0.15), G=res("loki", "score", gqa="kv", shift=0.25),
                    H=res("loki", "post", gqa="kv", shift=0.35))
    opts = replace(opts, gqa_select="kv")
    kinds = {(c["a"], c["b"]): c["kind"] for c in suite._comparisons(measured, 512, 0.25, "decode", opts)}
    assert kinds == {("B", "A"): "oracle_vs_baseline", ("C", "B"): "loki_vs_oracle", ("D", "B"): "loki_vs_oracle",
                     ("G", "F"): "loki_vs_oracle", ("H", "F"): "loki_vs_oracle", ("G", "E"): "loki_vs_h2o",
                     ("H", "E"): "loki_vs_h2o", ("C", "D"): "default_vs_basis", ("G", "H"): "default_vs_basis"}
    with pytest.raises(ValueError, match="not resolved"):
        suite.profile_options("tests").gqa_modes  # noqa: B018 - "auto" is resolved against a model first
    assert perplexity.method_role("exact_topk") == "oracle" and perplexity.method_role("sparq") == "competitor"


def test_basis_cache_path_keys(tiny, tmp_path):
    from loki.evaluation.bases import CalibrationRecipe, basis_cache_path

    model = tiny[0]
    r = CalibrationRecipe(num_tokens=4096, seq_len=512, max_positions=1024)
    a = basis_cache_path(model, "packaged:wikipedia/calib", r, "post", tmp_path)
    assert a.parent == tmp_path / "bases" and a.name.endswith("-4096t-512s-1024p-post.safetensors")
    assert a != basis_cache_path(model, "packaged:book/calib", r, "post", tmp_path)
    assert a != basis_cache_path(model, "packaged:wikipedia/calib", replace(r, num_tokens=2048), "post", tmp_path)
    assert a != basis_cache_path(model, "packaged:wikipedia/calib", replace(r, max_positions=2048), "post", tmp_path)
    assert a != basis_cache_path(model, "packaged:wikipedia/calib", r, "score", tmp_path)
    other = tiny_model("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128)
    assert a != basis_cache_path(other, "packaged:wikipedia/calib", r, "post", tmp_path)


def test_basis_cache_key_follows_the_calibration_code(tiny, monkeypatch, tmp_path):
    """A changed calibration (any source file of loki/calibration, loki/basis.py, the evaluation's bases module)
    gives another cache path: a persistent runner never reads back bases fitted by older code."""
    from loki.evaluation import bases as bases_mod
    from loki.evaluation.bases import CalibrationRecipe, basis_cache_path

    root = Path(bases_mod.__file__).resolve().parents[1]
    assert set(bases_mod.CALIBRATION_SOURCES) == {root / "calibration", root / "basis.py",
                                                  root / "evaluation" / "bases.py"}
    code = tmp_path / "code"
    (code / "calibration").mkdir(parents=True)
    (code / "calibration" / "pca.py").write_text("def fit(): return 1\n")
    (code / "basis.py").write_text("FORMAT = 1\n")
    monkeypatch.setattr(bases_mod, "CALIBRATION_SOURCES", (code / "calibration", code / "basis.py"))
    r = CalibrationRecipe(num_tokens=4096, seq_len=512, max_positions=1024)
    a = basis_cache_path(tiny[0], "packaged:wikipedia/calib", r, "post", tmp_path)
    assert a == basis_cache_path(tiny[0], "packaged:wikipedia/calib", r, "post", tmp_path)
    (code / "calibration" / "pca.py").write_text("def fit(): return 2\n")
    b = basis_cache_path(tiny[0], "packaged:wikipedia/calib", r, "post", tmp_path)
    assert b != a
    (code / "calibration" / "score_aware.py").write_text("\n")  # a new module counts too
    assert basis_cache_path(tiny[0], "packaged:wikipedia/calib", r, "post", tmp_path) not in (a, b)


def test_get_bases_one_pass_and_cache(tiny, monkeypatch, tmp_path):
    from loki.calibration import collect
    from loki.evaluation import bases as bases_mod
    from loki.evaluation import data
    from loki.evaluation.bases import CalibrationRecipe

    model = tiny[0]

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 128 for c in text]}

    monkeypatch.setenv("LOKI_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "load_corpus", lambda name, part="calib", path=None:
                        data.TextSource(name, "some calibration text " * 400, f"test:{name}"))
    passes = []
    real = collect.collect_statistics
    import sys

    monkeypatch.setattr(sys.modules["loki.calibration.calibrate"], "collect_statistics",
                        lambda *a, **k: passes.append(k["kinds"]) or real(*a, **k))
    recipe = CalibrationRecipe(num_tokens=256, seq_len=64, max_positions=128)
    b1 = bases_mod.get_bases(model, Tok(), ("pre", "post", "score"), recipe, progress=False)
    assert set(b1) == {"pre", "post", "score"} and b1["post"].num_tokens == 256 and b1["score"].kind == "score"
    assert b1["post"].max_positions == 128 and len(passes) == 1  # one streaming pass for the three bases
    assert len(list((tmp_path / "bases").glob("*.safetensors"))) == 3
    b2 = bases_mod.get_bases(model, Tok(), ("pre", "score"), recipe, progress=False)
    assert len(passes) == 1  # from the cache
    torch.testing.assert_close(b2["pre"].components, b1["pre"].components)
    with pytest.raises(ValueError, match="names must be"):
        bases_mod.get_bases(model, Tok(), ("other",), recipe)


# ------------------------------------------------------------------------------------------ CLI
def test_cli_help_explains(capsys):
    from loki.cli import main

    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "embedded SmolLM2" in out and "--update-thresholds" in out and "--all-methods" in out
    # one documented exit rule, the one loki.evaluation.gates.verdict applies, and the measured time of the default
    assert gates.EXIT_RULE in out and "Exit status: 0 when no gate fails; 1 when a gate fails" in out
    from loki.evaluation.check import CHECK_TIME

    assert " ".join(CHECK_TIME.split()) in " ".join(out.split()) and "2-core" in CHECK_TIME
    assert "--long" in out and "--device" in out and "--dtype" in out
    # the default configuration it gates: one selection per KV group with softmax-max on a GQA model
    assert "--gqa-select" in out and "softmax-max" in out and "per query head" in out
    for cmd in ("calibrate", "analyze", "ppl", "generate"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--protocol" in out and "{auto,query,kv}" in out and "softmax-max" in out


def test_cli_bad_arguments(capsys, tmp_path):
    from loki.cli import main
    from loki.evaluation.commands import fraction_or_count

    assert fraction_or_count("0.25") == 0.25 and fraction_or_count("16") == 16
    for bad in ("0", "1.5", "abc", "-3"):
        with pytest.raises(Exception, match="fraction|count"):
            fraction_or_count(bad)
    with pytest.raises(SystemExit) as e:
        main(["ppl", "--k", "1.5"])
    assert e.value.code == 2
    assert "fraction must lie in (0, 1]" in capsys.readouterr().err
    assert main(["calibrate", "--tokens", "0", "-o", str(tmp_path / "b.safetensors")]) == 2
    assert "--tokens must be >= 1" in capsys.readouterr().err
    assert main(["calibrate", "-o", str(tmp_path / "missing" / "b.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["check", "--k", "0"])  # --k takes a fraction or a count of tokens, as loki ppl --k
    assert e.value.code == 2 and "--k: a count must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["check", "--k", "1.5"])
    assert e.value.code == 2 and "--k: a fraction must lie in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["check", "--windows", "1024by8"])
    assert e.value.code == 2 and "TOKENSxCOUNT" in capsys.readouterr().err
    if not torch.cuda.is_available():
        for cmd in (["ppl"], ["check"], ["calibrate", "-o", str(tmp_path / "b.safetensors")]):
            assert main([*cmd, "--device", "cuda"]) == 2
            assert "no CUDA device is available" in capsys.readouterr().err
    assert main(["check", "--thresholds", str(tmp_path / "none.json")]) == 2
    assert "--thresholds" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["check", "--out", str(tmp_path / "file")]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert main(["analyze", "--basis", str(tmp_path / "nope.safetensors")]) == 2
    assert "no PCA basis file" in capsys.readouterr().err
    assert main(["ppl", "--windows", "0"]) == 2
    assert main(["generate", "--max-new-tokens", "0"]) == 2


def test_cli_analyze_from_basis_files(tmp_path, capsys):
    from loki.cli import main

    pre, post = PCABasis.random(2, 2, 8, seed=0, rotary="pre"), PCABasis.random(2, 2, 8, seed=1, rotary="post")
    pre.save(tmp_path / "pre.safetensors")
    post.save(tmp_path / "post.safetensors")
    out = tmp_path / "an"
    assert main(["analyze", "--basis", str(tmp_path / "pre.safetensors"), "--basis",
                 f"mine={tmp_path / 'post.safetensors'}", "--out", str(out)]) == 0
    summary = json.loads((out / "rank_summary.json").read_text())
    assert set(summary) == {"pre", "mine"}
    assert (out / "rank90_heatmap.png").is_file()


# ------------------------------------------------------------------------------------------ intervals
def test_paired_increase_interval():
    from loki.evaluation.intervals import paired_increase

    g = torch.Generator().manual_seed(0)
    ref = torch.rand(4, 511, generator=g, dtype=torch.float64) * 4
    same = paired_increase(ref, ref)
    assert same == {"increase": 0.0, "lo": 0.0, "hi": 0.0}
    worse = ref + 0.1 + 0.05 * torch.randn(4, 511, generator=g, dtype=torch.float64)
    r = paired_increase(worse, ref)
    assert r["increase"] == pytest.approx(math.expm1(float((worse - ref).mean())))
    assert r["lo"] < r["increase"] < r["hi"] and r["lo"] > 0.09 and r["hi"] < 0.12
    noisy = ref + 0.5 * torch.randn(4, 511, generator=g, dtype=torch.float64)
    wide = paired_increase(noisy, ref)
    assert wide["hi"] - wide["lo"] > 3 * (r["hi"] - r["lo"])  # more spread, a wider interval
    assert paired_increase(worse, ref) == r  # deterministic
    with pytest.raises(ValueError, match="one shape"):
        paired_increase(worse[:, :10], ref)


# ------------------------------------------------------------------------------------------ the check profile
def test_check_profile_measures_the_default_mode_and_the_rest_behind_an_option():
    """``loki check`` measures the default GQA mode only (full, exact top-k, the default and the paper's basis);
    --all-methods adds every setting per query head, H2O and SparQ."""
    from loki.evaluation import suite

    opts = replace(suite.profile_options("check"), gqa_select="kv")  # as resolved for the embedded GQA model
    names = [s.name for s in suite.suite_methods(opts, 64, 1024, 0.25)]
    assert names == ["exact_topk[kv]", "loki-post[kv]", "loki-score[kv]"]
    more = replace(opts, all_methods=True)
    names = [s.name for s in suite.suite_methods(more, 64, 1024, 0.25)]
    # SparQ's r follows d: 32 of 64 components at the default's d_f 0.5
    assert {"exact_topk[query]", "loki-score[query]", "loki-post[query]", "h2o", "sparq(r=32)"} <= set(names)
    assert "all_methods" not in suite.profile_options("check").profile_settings()  # the same recorded limits
    check_settings = suite.profile_options("check").profile_settings()
    assert check_settings["agreement_tokens"] == 512 and check_settings["windows"] == [[1024, 8]]


def test_check_score_format_reaches_every_loki_row_and_the_recorded_settings():
    """``loki check`` (the int8 copy of d_f 0.5 by default, or ``--score-format int8 --d 0.5``): every Loki row
    scores on the int8 copy (the oracles and the other methods are unchanged) and the thresholds are tied to it;
    ``--score-format native`` takes d_f 0.25 and records no score format (results before the int8 default)."""
    import argparse

    from loki.evaluation import check, suite

    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    opts = check._options(parser.parse_args(["--score-format", "int8", "--d", "0.5"]))
    assert opts.score_format == "int8" and opts.d == 0.5
    specs = suite.suite_methods(replace(opts, gqa_select="kv", all_methods=True), 64, 1024, 0.25)
    assert {s.score_format for s in specs if s.method == "loki"} == {"int8"}
    assert {s.score_format for s in specs if s.method != "loki"} == {"native"}
    assert opts.profile_settings()["score_format"] == "int8"
    default = check._options(parser.parse_args([]))
    assert default.profile_settings() == opts.profile_settings()  # the default is the int8 copy of d_f 0.5
    native = check._options(parser.parse_args(["--score-format", "native"]))
    assert native.d == 0.25 and "score_format" not in native.profile_settings()
    assert check._options(parser.parse_args(["--score-format", "native", "--d", "0.5"])).d == 0.5


def test_check_profile_stays_inside_the_positions_its_bases_cover():
    """No warning about its own configuration: every prompt the check profile feeds Loki, with the question and
    the longest answer decoded, fits the positions its bases were calibrated on."""
    from loki.evaluation import retrieval, suite

    for name in ("check", "tests"):
        opts = suite.profile_options(name)
        covered = opts.recipe.max_positions
        assert max(T for T, _ in opts.windows) <= covered, name
        if opts.retrieval:
            longest = max(opts.retrieval["context_lens"]) + max(retrieval.MAX_NEW_TOKENS.values())
            assert longest <= covered, (name, longest, covered)


def test_check_log_lines_do_not_garble_progress_bars(capsys):
    """A [loki check] line written while a progress bar is active comes on a line of its own (tqdm.write), not
    glued to the bar's text."""
    import re
    import sys

    from tqdm import tqdm

    from loki.evaluation import check

    bar = tqdm(total=3, desc="perplexity", file=sys.stderr, ascii=True)
    bar.update()
    check._log("a message")
    bar.update(2)
    bar.close()
    err = capsys.readouterr().err
    assert [seg for seg in re.split(r"[\r\n]", err) if "a message" in seg] == ["[loki check] a message"]


def test_check_refuses_a_thresholds_file_without_the_profile(tmp_path, capsys):
    """The gates fail closed: a thresholds file that lacks the profile's limits (or the targets, or holds a limit
    of the wrong sign) is an error before the model loads, never a run with fewer gates."""
    from loki.cli import main

    thr = gates.load_thresholds()
    cases = {
        "no-profile": dict(thr, profiles={"tests": thr["profiles"]["tests"]}),
        "no-targets": {k: v for k, v in thr.items() if k != "targets"},
        "negative": json.loads(json.dumps(thr).replace('"max": 0.08', '"max": -0.08', 1)),
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        assert main(["check", "--thresholds", str(path), "--out", str(tmp_path / "r"), "--no-progress"]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: --thresholds {path}: ") and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "r" / "report.md").exists()
    assert "profiles/check/ppl_delta_max" in gates.check_thresholds(cases["no-profile"], "check")
    assert "targets/ppl/1/max" in gates.check_thresholds(cases["negative"], "check")
    assert gates.check_thresholds(thr, "check") is None
