"""One atomic write (:mod:`loki._io`) for every file the package writes, leaving the mode a plain ``open()`` would:
0o666 less the umask for a new file, the old file's mode for a replaced one (never ``mkstemp``'s private 0o600)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from loki._io import atomic_path, atomic_write, new_temp_folder
from loki.basis import PCABasis

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=lambda m: f"umask{m:03o}")
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _open_mode(folder: Path) -> int:
    """The mode ``open(..., "w")`` gives a new file under the current umask."""
    probe = folder / "probe"
    with open(probe, "w"):
        pass
    mode = _mode(probe)
    probe.unlink()
    return mode


def test_new_file_has_the_mode_of_open(tmp_path, umask):
    want = _open_mode(tmp_path)
    assert want == 0o666 & ~umask
    assert _mode(atomic_write(tmp_path / "a.json", "{}")) == want
    assert _mode(atomic_write(tmp_path / "b.bin", b"\0")) == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin"]  # no temporary file left


def test_replaced_file_keeps_its_mode(tmp_path, umask):
    target = tmp_path / "results.json"
    target.write_text("old")
    target.chmod(0o640)
    atomic_write(target, "new")
    assert target.read_text() == "new" and _mode(target) == 0o640


def test_basis_save_has_the_mode_of_open(tmp_path, umask):
    path = tmp_path / "basis.safetensors"
    PCABasis.random(2, 1, 8).save(path)
    assert _mode(path) == _open_mode(tmp_path)
    PCABasis.load(path)
    assert [p.name for p in tmp_path.iterdir()] == ["basis.safetensors"]


def test_temp_folder_has_the_mode_of_mkdir(tmp_path, umask):
    folder = new_temp_folder(tmp_path, ".convert-")
    assert folder.is_dir() and folder.name.startswith(".convert-")
    assert _mode(folder) == 0o777 & ~umask


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "x.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_the_package_has_one_atomic_write():
    """No module but loki/_io.py makes its own temporary files or renames them over a target (the embedded model's
    cache folder renames a whole folder made by new_temp_folder)."""
    pattern = re.compile(r"\b(mkstemp|mkdtemp|NamedTemporaryFile)\(|\bos\.replace\(")
    found = {}
    for path in sorted((ROOT / "loki").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                if pattern.search(line.split("#")[0]) and not line.lstrip().startswith(("``", '"', "'"))]
        if hits:
            found[rel] = hits
    assert set(found) <= {"loki/_io.py", "loki/embedded.py"}, found
    assert len(found.get("loki/embedded.py", [])) == 2, found  # the converted folder and its legacy name
