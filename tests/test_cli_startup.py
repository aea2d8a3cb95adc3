"""``loki --help``, ``loki --version`` and the help of the commands import neither torch, transformers nor the
kernels (they took 7 s when they did): checked on ``sys.modules`` of a fresh interpreter, not on a wall-clock time.
``import loki`` is lazy as well; its public names load on first use."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import loki

HEAVY = ("torch", "transformers", "triton", "numpy", "lm_eval", "loki.kernels", "loki.basis")

_PROBE = textwrap.dedent("""
    import json, sys
    argv = json.loads(sys.argv[1])
    sys.argv = ["loki", *argv]
    from loki.cli import main
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    print(json.dumps({"code": code, "loaded": [m for m in HEAVY if m in sys.modules]}), file=sys.stderr)
""")


def _run(argv: list[str]) -> tuple[dict, str]:
    code = f"HEAVY = {list(HEAVY)!r}\n" + _PROBE
    res = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads(res.stderr.strip().splitlines()[-1])
    return report, res.stdout


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []], ids=["help", "version", "bare"])
def test_top_level_help_and_version_import_nothing_heavy(argv):
    report, out = _run(argv)
    assert report["loaded"] == [], report
    assert report["code"] in (0, 2)
    if argv == ["--version"]:
        assert out.strip() == f"loki {loki.__version__}"
    else:
        assert "usage: loki" in out and "calibrate" in out


@pytest.mark.parametrize("command", ["calibrate", "analyze", "ppl", "generate", "eval", "fidelity"])
def test_command_help_imports_nothing_heavy(command):
    report, out = _run([command, "--help"])
    assert report == {"code": 0, "loaded": []}, report
    assert f"usage: loki {command}" in out


def test_python_m_loki_cli_help_imports_no_torch():
    """The entry point exactly as documented: ``python -m loki.cli --help`` (``-X importtime`` lists every module
    the interpreter imported, on stderr)."""
    for flag in ("--help", "--version"):
        res = subprocess.run([sys.executable, "-X", "importtime", "-m", "loki.cli", flag], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
        assert {"loki", "loki._version"} <= imported  # the probe sees the imports
        assert not {m for m in imported if m.split(".")[0] in ("torch", "transformers", "triton")}, flag


def test_import_loki_is_lazy_and_its_names_still_load():
    code = ("import sys, loki; assert 'torch' not in sys.modules, 'eager'; "
            "from loki import PCABasis, calibrate, decode_attention, disable_loki, enable_loki; "
            "assert 'torch' in sys.modules; print(PCABasis.__module__, sorted(loki.__all__) == sorted(dir(loki)) "
            "or set(loki.__all__) <= set(dir(loki)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["loki.basis", "True"]
