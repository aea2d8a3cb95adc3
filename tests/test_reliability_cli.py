"""Plain user errors on the command line exit 2 with one line naming the argument, never a traceback, and are
found before any model is loaded or any calibration runs."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loki.cli import main
from loki.testing.cli import one_error_line


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command gets as far as loading a model."""
    import loki.evaluation.commands as commands
    from loki.evaluation.commands import calibrate, generate, ppl

    def boom(args):
        raise AssertionError("the argument error was not caught before the model load")

    for mod in (commands, calibrate, generate, ppl):
        monkeypatch.setattr(mod, "load_model_from_args", boom)


def _one_error_line(capsys, *words):
    return one_error_line(capsys, *words, whole=True)


def test_empty_prompt(capsys, no_model):
    assert main(["generate", ""]) == 2
    _one_error_line(capsys, "prompt", "empty")


def test_missing_model_folder(capsys, tmp_path, no_model):
    for cmd in (["ppl"], ["generate", "hello"], ["calibrate", "-o", str(tmp_path / "b.safetensors")]):
        assert main([*cmd, "--model", "/nonexistent"]) == 2
        _one_error_line(capsys, "--model", "/nonexistent")
    (tmp_path / "folder").mkdir()
    assert main(["ppl", "--model", str(tmp_path / "folder")]) == 2
    _one_error_line(capsys, "--model", "config.json")


def test_model_folder_checked_in_the_shared_loader(capsys, tmp_path):
    """Commands that reach the shared loader (analyze) get the same one-line error."""
    assert main(["analyze", "--model", "/nonexistent", "--out", str(tmp_path / "a")]) == 2
    _one_error_line(capsys, "--model")


@given(threads=st.integers(max_value=0))
def test_non_positive_threads(threads):
    for cmd in ("ppl", "calibrate", "generate", "analyze"):
        args = [cmd, f"--threads={threads}"] + (["-o", "x.safetensors"] if cmd == "calibrate" else [])
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2


def test_threads_error_names_the_argument(capsys):
    with pytest.raises(SystemExit) as e:
        main(["ppl", "--threads", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "argument --threads: must be >= 1" in err.strip().splitlines()[-1]


def test_set_threads_refuses_non_positive_counts():
    from loki.evaluation.commands import UsageError, set_threads

    with pytest.raises(UsageError, match="--threads must be >= 1"):
        set_threads(-1)
    with pytest.raises(UsageError, match="--threads must be >= 1"):
        set_threads(0)


def test_calibrate_text_file_empty_or_a_directory(capsys, tmp_path, no_model):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n", encoding="utf-8")
    out = str(tmp_path / "b.safetensors")
    assert main(["calibrate", "--text-file", str(empty), "-o", out]) == 2
    _one_error_line(capsys, "--text-file", "empty")
    assert main(["calibrate", "--text-file", str(tmp_path), "-o", out]) == 2
    _one_error_line(capsys, "--text-file", "is a directory")
    assert main(["calibrate", "--text-file", str(tmp_path / "nope.txt"), "-o", out]) == 2
    _one_error_line(capsys, "--text-file", "does not exist")


def test_ppl_text_file_empty_or_a_directory_and_missing_basis(capsys, tmp_path, no_model):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    assert main(["ppl", "--text-file", str(empty)]) == 2
    _one_error_line(capsys, "--text-file", "empty")
    assert main(["ppl", "--text-file", str(tmp_path)]) == 2
    _one_error_line(capsys, "--text-file", "is a directory")
    assert main(["ppl", "--basis", str(tmp_path / "nope.safetensors")]) == 2
    _one_error_line(capsys, "--basis", "does not exist")
    assert main(["ppl", "--calib-tokens", "0"]) == 2
    _one_error_line(capsys, "--calib-tokens")
    assert main(["generate", "hello", "--basis", str(tmp_path)]) == 2
    _one_error_line(capsys, "--basis", "is a directory")


def test_calibrate_output_checked_before_calibrating(capsys, tmp_path, no_model, monkeypatch):
    assert main(["calibrate", "-o", str(tmp_path)]) == 2
    _one_error_line(capsys, "--output", "is a directory")
    afile = tmp_path / "afile"
    afile.write_text("x", encoding="utf-8")
    assert main(["calibrate", "-o", str(afile / "b.safetensors")]) == 2
    _one_error_line(capsys, "--output", "is not a folder")
    assert main(["calibrate", "-o", str(tmp_path / "missing" / "b.safetensors")]) == 2
    _one_error_line(capsys, "--output", "does not exist")
    (tmp_path / "both-pre.safetensors").mkdir()  # --rotary both writes OUTPUT-pre and OUTPUT-post
    assert main(["calibrate", "--kind", "pca", "--rotary", "both", "-o", str(tmp_path / "both.safetensors")]) == 2
    _one_error_line(capsys, "--output", "both-pre.safetensors", "is a directory")

    import tempfile

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", denied)  # a folder that refuses new files
    assert main(["calibrate", "-o", str(tmp_path / "b.safetensors")]) == 2
    _one_error_line(capsys, "--output", "cannot write into", "Permission denied")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_calibrate_output_on_a_read_only_filesystem(capsys, no_model):
    assert main(["calibrate", "-o", "/proc/loki-basis.safetensors"]) == 2
    _one_error_line(capsys, "--output", "cannot write into /proc")


def test_generate_bad_budget_is_one_line(capsys, monkeypatch):
    """A count --d above the model's head dim is found by enable_loki after the model loads: still one line."""
    import torch

    from loki.evaluation.commands import generate
    from loki.testing.models import tiny_model

    class Tok:
        eos_token_id = 0
        chat_template = None

        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.tensor([[1, 2, 3]])}

    monkeypatch.setattr(generate, "load_model_from_args", lambda args: (tiny_model("llama"), Tok()))
    assert main(["generate", "hello", "--method", "exact_topk", "--d", "100"]) == 2
    _one_error_line(capsys, "d=100")
