"""Every gate command docs/benchmarks.md shows on the committed history gives the output and the exit status it
shows.

The section "What the gate says on the committed history" holds ``console`` blocks: ``$ python ci/gate.py ...``
lines, the lines of interest of the output (in order; a line ending in ``...`` is shown in part: it matches an
output line that starts with what precedes it; whitespace runs compare equal), and ``# exit status N``.  Each
command runs here on the committed ``.asv/results`` with this interpreter.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "### What the gate says on the committed history"


def documented_commands(text: str) -> list[tuple[str, list[str], int]]:
    """``[(command, expected lines, exit status)]`` of the section's console blocks."""
    start = text.index(SECTION)
    end = text.find("\n## ", start)
    section = text[start: end if end >= 0 else None]
    out = []
    for block in re.findall(r"```console\n(.*?)```", section, re.S):
        current = None
        for line in block.splitlines():
            if line.startswith("$ "):
                current = [line[2:], [], None]
                out.append(current)
            elif line.startswith("# exit status "):
                current[2] = int(line.split()[-1])
            elif line.strip() and current is not None:
                current[1].append(line)
    return [tuple(c) for c in out]


def _norm(line: str) -> str:
    return " ".join(line.split())


def _matches(expected: str, line: str) -> bool:
    e, got = _norm(expected), _norm(line)
    return got.startswith(e[:-3].rstrip()) if e.endswith("...") else got == e


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines not found in ``output`` in order (empty when every one is there)."""
    lines = output.splitlines()
    i, missing = 0, []
    for want in expected:
        j = next((j for j in range(i, len(lines)) if _matches(want, lines[j])), None)
        if j is None:
            missing.append(want)
        else:
            i = j + 1
    return missing


COMMANDS = documented_commands(DOC.read_text(encoding="utf-8"))


def test_the_section_documents_commands():
    assert len(COMMANDS) >= 6
    assert all(cmd.startswith("python ci/gate.py ") and status is not None for cmd, _, status in COMMANDS)
    assert {status for _, _, status in COMMANDS} == {0, 1, 2}


@pytest.mark.parametrize("command, expected, status", COMMANDS, ids=[c[0][len("python ci/gate.py "):]
                                                                      for c in COMMANDS])
def test_documented_gate_command_reproduces_its_output(command, expected, status):
    argv = shlex.split(command)
    assert argv[0] == "python"
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit status {proc.returncode}, the docs say {status}\n{output}"
    assert not missing_lines(expected, output), (missing_lines(expected, output), output)


def test_the_comparison_can_fail():
    """The matcher is strict: a changed number, a line out of order or a wrong prefix is reported."""
    out = "gate: a\nFAIL x = 1.28, required >= 1.5 (long note)\ngate: PASSED\n"
    assert not missing_lines(["gate: a", "FAIL x = 1.28, required >= 1.5 ...", "gate:   PASSED"], out)
    assert missing_lines(["FAIL x = 1.29, required >= 1.5 ..."], out)
    assert missing_lines(["gate: PASSED", "gate: a"], out) == ["gate: a"]
    assert missing_lines(["gate: PASS"], out) == ["gate: PASS"]
