"""scripts/ holds the entry points only (at most 10 files; tools/ the maintainer tools and studies), and every
``scripts/...`` or ``tools/...`` path the README, the docs, the changelog, the tests and the CI files name exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"\b((?:scripts|tools)/[\w./-]+\.(?:py|sh|md))")


def test_scripts_holds_the_entry_points_only():
    scripts = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.is_file())
    assert len(scripts) <= 10, scripts
    assert {"setup.sh", "test.sh", "check.sh"} <= set(scripts)  # CI: .ci/run -> scripts/test.sh
    readme = (ROOT / "tools" / "README.md").read_text()
    for p in (ROOT / "tools").rglob("*"):
        if p.is_file() and p.suffix in (".py", ".sh") and "__pycache__" not in p.parts:
            assert p.relative_to(ROOT / "tools").as_posix() in readme, f"tools/README.md does not list {p}"


def test_every_named_script_and_tool_exists():
    files = [ROOT / n for n in ("README.md", "CHANGELOG.md", "tox.ini", "pyproject.toml", ".ci/run")]
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "tests").glob("*.py"))
    files += sorted((ROOT / "scripts").iterdir()) + sorted(p for p in (ROOT / "tools").rglob("*") if p.is_file())
    files += sorted((ROOT / "benchmarks").rglob("*.py")) + sorted((ROOT / "ci").rglob("*.py"))
    missing = []
    for f in files:
        if not f.is_file() or "__pycache__" in f.parts:
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in PATH.finditer(line):
                if "former" in line[max(0, m.start() - 8):m.start()]:  # a note on where something went
                    continue
                if not (ROOT / m.group(1)).exists():
                    missing.append(f"{f.relative_to(ROOT)}:{n}: {m.group(1)}")
    assert not missing, missing
