"""Where a result came from: the commit of the checkout the package runs from, the versions of the packages that
produced it and the device it ran on.  ``loki check`` stores :func:`provenance` in ``results.json``.

Nothing here raises: what cannot be found (no checkout, no ``git``, a package that is not installed) is ``None``.
Importing this module imports no third-party package.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["device_info", "git_commit", "package_versions", "provenance"]

#: The project's own folder in a checkout: the parent of the ``loki`` package.
_PACKAGE_DIR = Path(__file__).resolve().parent


def _git(root: Path, *args: str) -> str | None:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    for k in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(k, None)
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, env=env,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit(package_dir: str | os.PathLike | None = None) -> dict:
    """``{"commit": full hash or None, "dirty": bool or None}`` of the checkout the package runs from.

    The checkout counts only when the package folder (``package_dir``, default: this package) lies directly in
    the root of a git work tree, as in a clone of the project; an installed copy gives ``None``, even inside
    some other repository.  ``dirty``: tracked files differ from the commit."""
    pkg = Path(package_dir).resolve() if package_dir is not None else _PACKAGE_DIR
    root = pkg.parent
    none = {"commit": None, "dirty": None}
    if not (root / ".git").exists():
        return none
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root:
        return none
    head = _git(root, "rev-parse", "--verify", "HEAD")
    if head is None or len(head.strip()) < 40:
        return none
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": head.strip(), "dirty": None if status is None else bool(status.strip())}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - broken metadata must not fail a run
        return None


def package_versions() -> dict[str, str | None]:
    """Versions of python and of the packages a result depends on (``None``: not installed).  ``loki`` is the
    version of the code that runs (``loki.__version__``), whatever distribution metadata is installed."""
    from loki._version import __version__

    out = {"loki": __version__, "python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "numpy"):
        out[name] = _version(name)
    return out


def device_info(device=None) -> dict:
    """``{"type", "name"}`` of a device (a ``torch.device``, a string or ``None`` for the CPU): the CUDA card's
    name, or the CPU model; with ``cuda``, the CUDA version torch was built with (``None`` on a CPU build)."""
    kind = str(getattr(device, "type", None) or device or "cpu").split(":")[0]
    name = None
    cuda = None
    try:
        import torch

        cuda = torch.version.cuda
        if kind == "cuda" and torch.cuda.is_available():
            name = torch.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001
        pass
    if kind == "cpu":
        name = _cpu_name()
    return {"type": kind, "name": name, "cuda": cuda}


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def provenance(device=None) -> dict:
    """The commit, package versions, device and platform of a run (JSON-able; never raises)."""
    out: dict = {}
    for key, fn in (("git", git_commit), ("versions", package_versions), ("device", lambda: device_info(device))):
        try:
            value = fn()
        except Exception:  # noqa: BLE001 - provenance is a record, never a reason to fail a run
            value = None
        if key == "git":
            out.update(value or {"commit": None, "dirty": None})
        else:
            out[key] = value
    out["platform"] = platform.platform()
    return out
