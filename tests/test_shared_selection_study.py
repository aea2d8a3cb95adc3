"""tools/studies/shared_selection_study.py end to end on the CPU (--tiny: a tiny random model, 64-token windows), so the
GPU run cannot fail on its code paths: plan, runs, time budget, comparisons, outputs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("shared_selection_study", ROOT / "tools" / "studies" /
                                                  "shared_selection_study.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_plan_puts_the_benchmarked_configuration_and_the_fractions_first(study):
    rows = study.plan_rows(["wikitext", "book"])
    assert rows[0].spec.name == study.BENCHMARKED and rows[0].text == "wikitext" and rows[0].spec.k == 0.25
    ks = [r.spec.k for r in rows]
    first_count = next(i for i, k in enumerate(ks) if isinstance(k, int))
    assert all(isinstance(k, float) for k in ks[:first_count]) and all(isinstance(k, int) for k in ks[first_count:])
    aggs = {r.spec.aggregate for r in rows if r.spec.gqa_select == "kv" and r.spec.method == "loki"}
    assert aggs == {"sum", "max", "softmax-sum", "softmax-max", "union", "agreement"}
    assert {r.spec.name for r in rows if r.spec.basis == "score-group"} == {"loki-score-group[kv:softmax-max]",
                                                                              "loki-score-group[kv:agreement]"}
    assert len({r.key for r in rows}) == len(rows) == 2 * 11 + 2 * 10 + 3 * 11 + 3 * 10
    only = study.plan_rows(["wikitext", "book"], only="book/loki-score[[]query]")
    assert {(r.text, r.spec.name) for r in only} == {("book", "loki-score[query]")} and len(only) == 5
    quick = study.plan_rows(["wikitext", "book"], quick=True)
    assert {r.text for r in quick} == {"wikitext"} and all(r.spec.name != "exact_topk[kv:sum]" for r in quick)


def test_tiny_run_writes_every_output(study, tmp_path, capsys):
    out = tmp_path / "study"
    assert study.main(["--tiny", "--out", str(out), "--fractions", "0.25", "--counts", "none",
                       "--only", "loki-score[[]*,exact_topk[[]query]"]) == 0
    res = json.loads((out / "results.json").read_text())
    names = {(r["text"], r["name"]) for r in res["rows"]}
    assert ("book", "loki-score[kv:union]") in names and ("wikitext", "full") in names
    assert ("book", "loki-score[kv:agreement]") in names
    for r in res["rows"]:
        assert r["bytes_fraction"] is not None and "increase_lo" in r
    shared = [r for r in res["rows"] if r.get("gqa_select") == "kv"]
    fixed = [r for r in shared if r["aggregate"] != "agreement"]
    assert all(r["bytes_fraction"] == pytest.approx(fixed[0]["bytes_fraction"]) for r in fixed)
    # agreement moves tokens between KV heads: the same total, less where a head's share passes its visible tokens
    assert all(0.9 * fixed[0]["bytes_fraction"] <= r["bytes_fraction"] <= fixed[0]["bytes_fraction"] + 1e-9
               for r in shared if r["aggregate"] == "agreement")
    kinds = {c["kind"] for c in res["comparisons"]}
    assert kinds == {"same_budget", "nearest_bytes", "vs_default"}
    vs_default = [c for c in res["comparisons"] if c["kind"] == "vs_default"]
    assert vs_default and all(c["b"] == study.BENCHMARKED != c["a"] and c["b_k"] == c["k"] for c in vs_default)
    md = (out / "report.md").read_text()
    assert md.index(study.BENCHMARKED) < md.index("loki-score[query]") and "Targets for the shared" in md
    assert (out / "ppl_vs_bytes_wikitext.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "ppl_vs_bytes_book.png").is_file()
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].endswith("s)") and "loki-score[kv:union]" in "\n".join(printed)


def test_time_budget_leaves_rows_out_and_says_so(study, tmp_path):
    out = tmp_path / "late"
    assert study.main(["--tiny", "--out", str(out), "--texts", "book", "--quick", "--counts", "none",
                       "--fractions", "0.25", "--time-budget", "0"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in res["rows"]] == ["full"] and len(res["skipped"]) == 10
    assert "Left out by the time budget" in (out / "report.md").read_text()


def test_bad_arguments(study, capsys):
    for argv in (["--out", "x", "--texts", "nope"], ["--out", "x", "--counts", "a"],
                 ["--out", "x", "--fractions", "2"], ["--out", "x", "--tiny", "--only", "nothing*"]):
        with pytest.raises(SystemExit) as e:
            study.main(argv)
        assert e.value.code == 2
    assert "--only" in capsys.readouterr().err
