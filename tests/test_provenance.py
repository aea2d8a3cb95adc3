"""Provenance of results: the commit of the checkout, package versions and device, and ``loki check`` storing them in
``results.json`` and ``report.md``."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import loki
from loki import provenance as prov
from loki.evaluation import check, report

ROOT = Path(__file__).resolve().parents[1]
IN_CHECKOUT = (ROOT / ".git").exists() and shutil.which("git") is not None


@pytest.mark.skipif(not IN_CHECKOUT, reason="needs a git checkout and git")
def test_commit_of_the_checkout():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    got = prov.git_commit()
    assert got["commit"] == head and isinstance(got["dirty"], bool)


def test_no_commit_outside_a_checkout(tmp_path, monkeypatch):
    pkg = tmp_path / "site-packages" / "loki"
    pkg.mkdir(parents=True)
    assert prov.git_commit(pkg) == {"commit": None, "dirty": None}
    if IN_CHECKOUT:  # a package folder somewhere inside another repository's tree is not that repository's code
        assert prov.git_commit(ROOT / "loki" / "evaluation") == {"commit": None, "dirty": None}
    # no git program at all: still no error
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert prov.git_commit(ROOT / "loki") == {"commit": None, "dirty": None}


def test_package_versions_and_device():
    v = prov.package_versions()
    assert v["loki"] == loki.__version__ and v["python"] == platform.python_version()
    assert v["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert set(v) >= {"loki", "python", "torch", "triton", "transformers"}
    d = prov.device_info(torch.device("cpu"))
    assert d["type"] == "cpu" and isinstance(d["name"], str) and d["name"]
    p = prov.provenance("cpu")
    assert set(p) == {"commit", "dirty", "versions", "device", "platform"}
    json.dumps(p)  # JSON-able


def test_provenance_never_raises(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("broken")

    monkeypatch.setattr(prov, "git_commit", boom)
    monkeypatch.setattr(prov, "package_versions", boom)
    p = prov.provenance()
    assert p["commit"] is None and p["versions"] is None and p["device"]["type"] == "cpu"


class _Model:
    device = torch.device("cpu")


def test_check_writes_provenance_into_results_json(tmp_path, monkeypatch):
    """``loki check`` end to end with the model and the suite replaced by stand-ins (the real suite is covered
    elsewhere): results.json and report.md carry the provenance."""
    import loki.evaluation.models as models

    monkeypatch.setattr(models, "load_default_model", lambda **kw: (_Model(), None))
    suite = {"settings": {"profile": "tests", "k": 0.25}, "perplexity": []}
    monkeypatch.setattr(check, "run_suite", lambda *a, **k: suite)
    gate = {"name": "stand-in gate", "passed": True, "value": 0.0, "bound": 1.0}
    monkeypatch.setattr(check, "evaluate_gates", lambda *a, **k: [gate])
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    out = tmp_path / "report"
    args = parser.parse_args(["--profile", "tests", "--out", str(out), "--no-progress", "--threads", "1"])
    assert check.run(args) == 0
    res = json.loads((out / "results.json").read_text())
    p = res["provenance"]
    assert p["versions"]["loki"] == loki.__version__ and p["versions"]["torch"]
    assert p["device"] == prov.device_info("cpu") and p["device"]["name"]
    assert p["commit"] == prov.git_commit()["commit"] and (p["commit"] is not None) == IN_CHECKOUT
    md = (out / "report.md").read_text()
    assert f"loki {loki.__version__}" in md and f"device: cpu ({p['device']['name']})" in md


def test_report_line_of_the_provenance():
    md = report.markdown_report({"provenance": {
        "commit": "0123456789abcdef" * 2 + "01234567", "dirty": True,
        "versions": {"loki": "9.9", "triton": None, "torch": "2.13.0+cpu"},
        "device": {"type": "cuda", "name": "NVIDIA H100"}}})
    assert ("- code: commit 0123456789ab with local changes; loki 9.9, torch 2.13.0+cpu; device: cuda "
            "(NVIDIA H100)") in md
    md = report.markdown_report({"provenance": {"commit": None, "versions": {}, "device": {}}})
    assert "not a git checkout" in md
