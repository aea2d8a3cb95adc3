#!/usr/bin/env bash
# Prepare, on a machine with network and this checkout, what a GPU machine without network needs to record the
# ASV history (tools/gpu_asv_run.sh there, tools/gpu_asv_collect.sh back here; docs/maintainers.md):
#
#   .asv/env/carry/            (git-ignored; carry it to the GPU machine with every run command)
#     wheels/                  asv 0.6.6 and what it imports at run time, Python 3.12 manylinux x86_64 / pure wheels
#     shim/                    lazy_importer.py, only when importlib_metadata needs it and no wheel of it exists
#     repo.bundle              `git bundle create` of branch main (ASV and ci/run_asv_history.sh need the history)
#     commits                  the commits to record, full hashes, one a line (the run script's default)
#
# Usage: bash tools/gpu_asv_prepare.sh [COMMIT...]
#   COMMIT...   commits to record (default: main c9f7b34 05ccf09, i.e. HEAD of main, the commit of the recorded
#               end-to-end run and the fused static-cache write); each must be on main's first-parent line
# Environment: LOKI_ASV_CARRY (default .asv/env/carry), LOKI_PY (default .venv/bin/python: pip and a check).
#
# The runtime closure is checked here: the selected wheels are unpacked into a scratch folder and asv's commands
# are imported by an interpreter that sees only them and the standard library (python -S).  Also makes sure the
# embedded model is staged in .gpu-stage/ (tools/gpu_stage.sh prepare) and prints what each GPU command carries.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CARRY=${LOKI_ASV_CARRY:-.asv/env/carry}
PY=${LOKI_PY:-.venv/bin/python}
ASV_VERSION=0.6.6
# What asv run / publish / machine and asv_runner import (asv's environment plugins virtualenv, uv, conda and
# rattler are optional: its plugin manager skips them when their packages are missing; build is only called by
# build_command, empty in asv.conf.json; tomli only below Python 3.11).
RUNTIME=(asv asv_runner json5 tabulate pympler packaging importlib_metadata zipp lazy_importer)
LIMIT=$((64 * 1024 * 1024))  # what one GPU command may carry, the tree included

COMMITS=("$@")
[ "${#COMMITS[@]}" -gt 0 ] || COMMITS=(main c9f7b34 05ccf09)

git rev-parse --verify -q refs/heads/main >/dev/null || { echo "gpu_asv_prepare: no branch main" >&2; exit 2; }
mapfile -t FIRST_PARENT < <(git rev-list --first-parent main)
RESOLVED=()
for c in "${COMMITS[@]}"; do
  h=$(git rev-parse --verify -q "$c^{commit}") || { echo "gpu_asv_prepare: unknown commit $c" >&2; exit 2; }
  printf '%s\n' "${FIRST_PARENT[@]}" | grep -qx "$h" ||
    { echo "gpu_asv_prepare: $c ($h) is not on main's first-parent line" >&2; exit 2; }
  RESOLVED+=("$h")
done

rm -rf "$CARRY"
mkdir -p "$CARRY/wheels" "$CARRY/all"
echo "== wheels of asv==$ASV_VERSION for CPython 3.12 manylinux x86_64"
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -d "$CARRY/all" "asv==$ASV_VERSION" 2>&1 | grep -v "is ignored: it is neither" || true

# keep the runtime closure; report what is left out and why
"$PY" - "$CARRY" "${RUNTIME[@]}" <<'EOF'
import re, shutil, sys, zipfile
from pathlib import Path
carry, keep = Path(sys.argv[1]), set(sys.argv[2:])
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {}
for whl in sorted((carry / "all").glob("*.whl")):
    have[norm(whl.name.split("-")[0])] = whl
missing = sorted(keep - set(have) - {"lazy_importer"})
if missing:
    sys.exit(f"gpu_asv_prepare: no wheel for {missing}")
for name, whl in have.items():
    if name in keep:
        shutil.copy2(whl, carry / "wheels" / whl.name)
left = sorted(n for n in have if n not in keep)
print(f"kept {len([n for n in have if n in keep])} wheels; left out (not imported by asv run/publish/machine "
      f"with an existing environment): {', '.join(left) or 'none'}")
# importlib_metadata >= 10.2 imports lazy_importer (a wheel of its own since lazy-importer 0.1); write the shim
# only when it is required and no wheel of it was found
imd = have.get("importlib_metadata")
meta = zipfile.ZipFile(imd).read(next(n for n in zipfile.ZipFile(imd).namelist()
                                      if n.endswith(".dist-info/METADATA"))).decode()
needs = any(re.match(r"Requires-Dist:\s*lazy[-_]importer", l) for l in meta.splitlines())
if needs and "lazy_importer" not in have:
    (carry / "shim").mkdir()
    (carry / "shim" / "lazy_importer.py").write_text(
        '"""Stand-in for the lazy-importer package: importlib_metadata only enters lazy_importer() around its '
        'imports."""\nimport contextlib\n\n\n@contextlib.contextmanager\ndef lazy_importer():\n    yield\n\n\n'
        'def resolve(obj):\n    return obj\n')
    print("lazy_importer: no wheel; shim written")
else:
    print("lazy_importer: " + ("wheel carried" if needs else "not required by this importlib_metadata"))
EOF
rm -rf "$CARRY/all"

echo "== runtime check: asv's commands import from these wheels and the standard library alone"
CHECK=$(mktemp -d)
trap 'rm -rf "$CHECK"' EXIT
for w in "$CARRY"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$CHECK/site"; done
[ -d "$CARRY/shim" ] && cp "$CARRY"/shim/*.py "$CHECK/site/"
# -S: no site-packages; the C extension of asv is abi3 (cp36+), so this interpreter loads it like 3.12 will
(cd "$CHECK" && PYTHONPATH="$CHECK/site" "$ROOT/$PY" -S -c "
import asv, asv.commands.run, asv.commands.publish, asv.commands.machine, asv.plugin_manager, asv.runner
import asv_runner, asv_runner.discovery, asv_runner.server, asv_runner.benchmarks.mark, pympler.asizeof
from asv.plugin_manager import plugin_manager
import asv.plugins
plugin_manager.load_plugins(asv.plugins)
assert asv.__version__ == '$ASV_VERSION', asv.__version__
print('asv', asv.__version__, 'asv_runner', __import__('importlib_metadata').version('asv_runner'), 'ok')
")

echo "== git bundle of main"
git bundle create -q "$CARRY/repo.bundle" main
git bundle verify -q "$CARRY/repo.bundle" >/dev/null 2>&1 || git bundle verify "$CARRY/repo.bundle"
printf '%s\n' "${RESOLVED[@]}" > "$CARRY/commits"
echo "main = $(git rev-parse --short=8 main); commits to record:"
for h in "${RESOLVED[@]}"; do echo "  $(git log -1 --format='%h %ad %s' --date=short "$h" | cut -c1-110)"; done

if [ ! -f .gpu-stage/part1/gguf.aa ] || [ ! -f .gpu-stage/part2/gguf.ab ] || [ ! -f .gpu-stage/part3/gguf.ac ]; then
  echo "== staging the embedded model (tools/gpu_stage.sh prepare)"
  bash tools/gpu_stage.sh prepare
fi

echo "== sizes (one GPU command carries at most 64 MiB, the tree included)"
"$PY" - "$CARRY" "$LIMIT" <<'EOF'
import os, subprocess, sys
carry, limit = sys.argv[1], int(sys.argv[2])
def size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True,
                       check=True).stdout.decode().split("\0")
tree = sum(os.path.getsize(f) for f in files if f and os.path.isfile(f))
mib = lambda n: f"{n / 2**20:6.1f} MiB"
c = size(carry)
parts = [size(f".gpu-stage/part{i}") for i in (1, 2, 3)]
for label, n in ((f"tree (tracked and untracked files)", tree), (f"{carry}", c), (f"{carry}/wheels", size(f"{carry}/wheels")),
                 (f"{carry}/repo.bundle", size(f"{carry}/repo.bundle")),
                 *((f".gpu-stage/part{i + 1}", p) for i, p in enumerate(parts))):
    print(f"  {mib(n)}  {label}")
ok = True
for label, n in (*((f"command {i + 1}: tree + part{i + 1} + carry", tree + p + c) for i, p in enumerate(parts)),
                 ("later commands: tree + carry", tree + c)):
    flag = "ok" if n <= limit else "OVER 64 MiB"
    ok &= n <= limit
    print(f"  {mib(n)}  {label}: {flag}")
if c > 20 * 2**20:
    print(f"gpu_asv_prepare: {carry} is over 20 MiB", file=sys.stderr)
    ok = False
sys.exit(0 if ok else 1)
EOF
echo "ready: carry $CARRY (and .gpu-stage/part1, part2 for the model); docs/maintainers.md lists the commands"
