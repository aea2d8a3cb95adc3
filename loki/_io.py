"""Output files of the commands and the library: checked before the work starts, written atomically.

A long run (a calibration, an accuracy suite, an lm-eval evaluation) must not lose its result to an output path
that was bad from the start.  Commands check every output path with :func:`output_file_problem` or
:func:`output_folder_problem` before they load a model, and every result file is written by :func:`atomic_write`
(a temporary file in the same folder, then ``os.replace``): an interrupted write leaves the previous file intact,
and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_path", "atomic_write", "new_temp_folder", "output_file_problem", "output_folder_problem"]


def _probe(folder: Path, option: str) -> str | None:
    """Why no new file can be created in the existing folder ``folder``, or None."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".loki-write-check-"):
            pass
    except OSError as exc:
        return f"{option}: cannot write into {folder} ({exc.strerror or exc})"
    return None


def output_file_problem(path: str | os.PathLike, option: str, *, existing: str = "replace",
                        force_option: str | None = None) -> str | None:
    """Why a result cannot be written to the file ``path`` (given with ``option``), or None when it can.

    The folder must exist and accept a new file (a temporary file is created and removed); ``path`` must not be a
    folder.  ``existing`` says what happens to a file already at ``path``: ``"replace"`` (it is replaced; it must
    be writable) or ``"refuse"`` (refused, naming ``force_option`` when there is one).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return f"{option} {p} is a directory; give a file path"
    folder = p.parent
    if not folder.exists():
        return f"{option}: output folder {folder} does not exist"
    if not folder.is_dir():
        return f"{option}: {folder} is not a folder"
    if p.exists():
        if existing == "refuse":
            hint = f" (pass {force_option} to replace it)" if force_option else ""
            return f"{option} {p} already exists{hint}"
        if not os.access(p, os.W_OK):
            return f"{option} {p} is not writable"
    return _probe(folder, option)


def output_folder_problem(path: str | os.PathLike, option: str) -> str | None:
    """Why results cannot be written into the folder ``path`` (given with ``option``), or None when they can.

    An existing folder must accept new files; a missing one must be creatable: its nearest existing ancestor
    must be a folder that accepts new files (nothing is created here)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        return f"{option} {p} exists and is not a folder"
    if p.is_dir():
        return _probe(p, option)
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{option} {p}: {parent} is a file, so the folder cannot be created"
    return _probe(parent, option)


def _new_temp_file(folder: Path, name: str, suffix: str) -> Path:
    """An empty new file in ``folder`` under a unique hidden name, created as ``open(..., "w")`` creates files:
    mode 0o666 less the process's umask (``tempfile.mkstemp`` would make it private, 0o600)."""
    for _ in range(100):
        tmp = folder / f".{name}.{secrets.token_hex(4)}{suffix}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"cannot create a temporary file beside {folder / name}")


def new_temp_folder(parent: Path, prefix: str) -> Path:
    """An empty new folder in ``parent`` under a unique name starting with ``prefix``, created as ``os.mkdir``
    creates folders (0o777 less the umask; ``tempfile.mkdtemp`` would make it private), for a folder written
    whole and then renamed into place."""
    for _ in range(100):
        tmp = Path(parent) / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"cannot create a temporary folder in {parent}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; when the block ends without an exception the file written
    there replaces ``path`` (``os.replace``), else it is removed.  ``suffix`` (default: ``path``'s own) keeps
    writers that infer a format from the name working.

    The file ends with the mode ``open(path, "w")`` would leave: that of the file it replaces, else 0o666 less the
    umask.  The one atomic write of the package: results, bases, task files and caches all go through it."""
    path = Path(path)
    tmp = _new_temp_file(path.parent, path.name, path.suffix if suffix is None else suffix)
    try:
        try:
            mode = path.stat().st_mode & 0o7777  # a replaced file keeps its mode, as open() keeps it
        except FileNotFoundError:
            mode = tmp.stat().st_mode & 0o7777  # the umask's, as open() creates files
        yield tmp
        os.chmod(tmp, mode)  # also where the writer replaced the file by one of its own (safetensors: 0o600)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, data: str | bytes, encoding: str = "utf-8") -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically (a temporary file in the same folder, then
    ``os.replace``); returns ``path`` as a :class:`~pathlib.Path`."""
    path = Path(path)
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding=encoding)
    return path
