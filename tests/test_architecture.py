"""The shape of the package: no import cycles between modules or between subpackages (imports inside functions
included, so none can hide one), modules of at most about 500 lines, and no file read outside the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "loki"
MAX_LINES = 500


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the loki modules it imports anywhere in its file (a package counts as imported with any of its
    modules, as Python runs its __init__ first; a module's own ancestors are left out)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module or ""
                targets = [name] + [f"{name}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in mods and not (mod == dep or mod.startswith(dep + ".")):
                        graph[mod].add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules():
    assert _cycles(_import_graph()) == []


def test_no_import_cycle_between_subpackages():
    """Layers: loki.reference, loki.kernels, loki.basis, loki.calibration, loki.integrations, loki.evaluation and
    the command line each import only the ones below them."""
    graph: dict[str, set[str]] = {}
    for mod, deps in _import_graph().items():
        top = ".".join(mod.split(".")[:2])
        for dep in deps:
            dep_top = ".".join(dep.split(".")[:2])
            if "loki" not in (top, dep_top) and top != dep_top:
                graph.setdefault(top, set()).add(dep_top)
    assert _cycles(graph) == []
    assert "loki.evaluation" not in graph.get("loki.integrations", set())


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_size(name):
    path, _ = _modules()[name]
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path} has more than {MAX_LINES} lines"


def test_nothing_outside_the_package_is_read_or_imported():
    """Files are found relative to the package's own folder (package data), never above it, and no module
    imports the repository's benchmarks, scripts or tests."""
    climb = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?((?:\.parent)+)")
    for name, (path, _) in _modules().items():
        text = path.read_text()
        depth = len(path.relative_to(PACKAGE).parts) - 1  # folders between the module and loki/
        for m in climb.finditer(text):
            ups = m.group(1).count(".parent") - 1  # the first .parent is the module's own folder
            assert ups <= depth, f"{name} reads {ups} folders above its own: outside the package"
        assert not re.search(r"^\s*(from|import)\s+(benchmarks|scripts|tests)\b", text, re.M), name
