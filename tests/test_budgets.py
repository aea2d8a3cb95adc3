"""Fixed-count budgets (k an int number of tokens) beside fractions: the suite, the command line, the report, the
gates and the targets; the accuracy-versus-bytes plot."""

from __future__ import annotations

import argparse

import pytest
import torch

from loki.basis import PCABasis
from loki.evaluation import gates, report, suite
from loki.evaluation.targets import load_targets, target_gates, target_status
from loki.testing.models import ByteTokenizer, tiny_model


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, seed=3)
    bases = {"post": PCABasis.random(2, 2, 16, seed=1, rotary="post"),
             "score": PCABasis.random(2, 2, 16, seed=2, rotary="post")}
    mp = pytest.MonkeyPatch()
    mp.setattr(suite, "get_bases", lambda model, tok, names, recipe, **kw: {n: bases[n] for n in names})
    opts = suite.profile_options("tests", windows=((48, 2), (24, 1)), k=0.25, k_values=(6,), k_counts=(8, 16, 64),
                                 bases=("post", "score"), agreement=False, rank=False, retrieval=None,
                                 exactness_window=(16, 1), fast_path=True, progress=False, log=None)
    out = tmp_path_factory.mktemp("run")
    try:
        res = suite.run_suite(model, ByteTokenizer(128), opts, out_dir=out)
    finally:
        mp.undo()
    return res, out


def test_the_suite_measures_counts_beside_fractions(tiny_run):
    res, out = tiny_run
    rows = res["perplexity"]
    assert res["settings"]["k_counts"] == [8, 16, 64] and res["settings"]["count_window"] == 48
    at48 = {(r["name"], r["k"]) for r in rows if r["seq_len"] == 48 and r["method"] != "full"}
    at24 = {r["k"] for r in rows if r["seq_len"] == 24 and r["method"] != "full"}
    ks48 = {k for _, k in at48}
    assert ks48 == {0.25, 6, 8, 16} and all(isinstance(k, int) for k in ks48 - {0.25})  # 64 >= 48: full attention
    assert at24 == {0.25, 6}  # counts of k_counts only at the count window; k_values everywhere
    for r in rows:
        assert r["bytes_fraction"] is not None and 0 < r["bytes_fraction"] <= 1.5
    loki16 = next(r for r in rows if r["method"] == "loki" and r["k"] == 16 and r["seq_len"] == 48
                  and r["gqa_select"] == "query")
    n = torch.arange(1, 48).double()
    want = float((torch.clamp(n, max=16) / n).mean())
    assert loki16["selected_fraction"] >= want - 1e-9  # per query head: at least k distinct tokens per KV head
    assert any(c["k"] == 16 and c["kind"] == "loki_vs_oracle" for c in res["comparisons"])
    assert res["plots"]["ppl_vs_bytes"] == "ppl_vs_bytes.png"
    assert "CUDA" in res["fast_path"]["skipped"]  # the compiled fast path is a GPU section
    assert (out / "ppl_vs_bytes.png").read_bytes()[:4] == b"\x89PNG"


def test_reports_and_gates_read_count_rows(tiny_run, tmp_path):
    res, _ = tiny_run
    md = report.markdown_report(res)
    assert "| 16 tok |" in md and "bytes of dense" in md and "fixed counts 8 tok, 16 tok, 64 tok" in md
    g = gates.evaluate_gates(res, gates.load_thresholds(), "tests", allow_missing=True)
    assert g and all("value" in x for x in g)
    # a run whose primary budget is a count: the structural gates look at the count's rows
    primary = dict(res, settings=dict(res["settings"], k=16))
    assert gates.primary_setting(primary) == (48, 16) and isinstance(gates.primary_setting(primary)[1], int)
    names = [x["name"] for x in gates.evaluate_gates(primary, gates.load_thresholds(), "tests", allow_missing=True)]
    assert any("ordering" in n for n in names)
    assert gates.row_key(next(r for r in res["perplexity"] if r["k"] == 8), (48, 0.25)).endswith("@T48,k8")


def test_targets_take_counts(tiny_run):
    res, _ = tiny_run
    thr = {"targets": {"ppl": [{"window": 48, "k": 16, "max": 100.0}, {"window": 48, "k": 16.0, "max": 100.0}]}}
    ppl, _ = load_targets(thr)
    assert isinstance(ppl[0].k, int) and isinstance(ppl[1].k, float) and "k = 16" in ppl[0].label
    g = target_gates(res, thr, "tests", profile_applies=False)
    assert len(g) == 1 and "k=16" in g[0]["name"] and g[0]["passed"]  # the fraction 16.0 is no count: unmeasured
    st = target_status(res, thr)
    assert [s["status"] for s in st] == ["met", "not measured"]


def test_command_line_budgets():
    from loki.evaluation import check

    assert check._budget("512") == 512 and isinstance(check._budget("512"), int)
    assert check._budget("0.25") == 0.25 and check._budget("1.0") == 1.0
    for bad in ("0", "1.5", "-3", "abc"):
        with pytest.raises(argparse.ArgumentTypeError, match="count|fraction"):
            check._budget(bad)
    assert check._counts("512,1024") == (512, 1024) and check._counts("none") == ()
    with pytest.raises(argparse.ArgumentTypeError):
        check._counts("0")
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    args = parser.parse_args(["--k", "1024", "--k-counts", "256,512", "--retrieval-k", "2048"])
    opts = check._options(args)
    assert (opts.k, opts.k_counts, opts.retrieval_k) == (1024, (256, 512), 2048)


def test_options_keep_counts_and_fractions_apart():
    opts = suite.profile_options("tests", k=1.0, k_values=(1, 0.5, 1.0))
    assert opts.all_k == (1.0, 1, 0.5)
    long = suite.profile_options("long")
    assert long.budgets_at(8192) == (0.25, 0.125, 0.0625, 512, 1024, 2048)
    assert long.budgets_at(1024) == (0.25, 0.125, 0.0625)
    assert "k_counts" not in long.profile_settings()  # the recorded regression limits keep applying


def test_byte_tokenizer():
    tok = ByteTokenizer(128)
    ids = tok("ab")["input_ids"]
    assert ids == [ord("a") % 127 + 1, ord("b") % 127 + 1] and max(tok("ÿ" * 9)["input_ids"]) < 128


def test_loki_ppl_takes_an_aggregate_and_prints_the_bytes(monkeypatch, tmp_path, capsys):
    from loki.cli import main
    from loki.evaluation.commands import ppl
    from loki.reference import GQA_AGGREGATES

    parser = argparse.ArgumentParser()
    ppl.add_arguments(parser)
    assert next(a for a in parser._actions if a.dest == "aggregate").choices == ("auto", *GQA_AGGREGATES)
    model = tiny_model("llama", vocab_size=128)
    monkeypatch.setattr(ppl, "load_tokenizer_and_config", lambda args, log=None: (ByteTokenizer(128), model.config))
    monkeypatch.setattr(ppl, "load_model_from_args", lambda args: (model, ByteTokenizer(128)))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    assert main(["ppl", "--text-file", str(text), "--windows", "16x2", "--device", "cpu", "--method", "exact_topk",
                 "--gqa-select", "kv", "--aggregate", "union", "--k", "4"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "perplexity" in x)
    assert "gqa=kv:union" in line and "bytes of dense per decode step 0." in line
    basis0 = tmp_path / "basis0.safetensors"
    PCABasis.random(2, 2, 16, seed=0).save(basis0)
    assert main(["ppl", "--text-file", str(text), "--windows", "16x2", "--device", "cpu", "--basis", str(basis0),
                 "--gqa-select", "kv", "--aggregate", "agreement", "--k", "4"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "perplexity" in x)
    assert "gqa=kv:agreement" in line and "bytes of dense per decode step 0." in line
    # the defaults: "auto" resolved as enable_loki resolves it (tiny_model: 4 query / 2 KV heads), and printed so
    basis = tmp_path / "basis.safetensors"
    PCABasis.random(2, 2, 16, seed=0).save(basis)
    assert main(["ppl", "--text-file", str(text), "--windows", "16x2", "--device", "cpu", "--basis", str(basis),
                 "--k", "4"]) == 0
    assert "gqa=kv:softmax-max" in next(x for x in capsys.readouterr().out.splitlines() if "perplexity" in x)
    assert main(["ppl", "--text-file", str(text), "--windows", "16x2", "--device", "cpu", "--method", "exact_topk",
                 "--k", "4"]) == 0
    assert "gqa=query " in next(x for x in capsys.readouterr().out.splitlines() if "perplexity" in x)
