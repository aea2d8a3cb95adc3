#!/usr/bin/env bash
# Bring the ASV results that tools/gpu_asv_run.sh recorded on the GPU machine into this checkout
# (docs/maintainers.md): unpack the returned tarball(s) into .asv/results/<machine>/, check with ci/gate.py that
# every recorded commit's end-to-end and accuracy values are read, refresh the committed benchmark list when the
# suite changed (ci/asv_benchmark_list.py), and build the pages (.asv/html) from the whole history.
#
# Usage: bash tools/gpu_asv_collect.sh [options] PATH...
#   PATH...          asv-results-<machine>.tar.gz files, or the folders the GPU commands' files came back in (the
#                    tarball is cumulative: the last one holds every commit of the series; given several, later
#                    ones win)
#   --machine NAME   ASV machine (default h100)
#   --any-env        accept results of another environment than the recorded history's
#                    (existing-py_opt_torch_.venv_bin_python3, i.e. /opt/torch/.venv/bin/python3)
#   --no-publish     do not run asv publish
# Environment: LOKI_PY (default .venv/bin/python, with asv installed).
#
# The gate's verdict (failures, known misses) is printed as information; the script fails only when results
# cannot be read (gate exit 2), the benchmark list cannot be discovered, or a file is not an ASV results file.
# Nothing is committed: the last lines say what to add.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${LOKI_PY:-.venv/bin/python}
MACHINE=h100
ENV_EXPECTED=existing-py_opt_torch_.venv_bin_python3
ANY_ENV=0
PUBLISH=1
PATHS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --machine) MACHINE=$2; shift 2 ;;
    --any-env) ANY_ENV=1; shift ;;
    --no-publish) PUBLISH=0; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "gpu_asv_collect: unknown option $1" >&2; exit 2 ;;
    *) PATHS+=("$1"); shift ;;
  esac
done
[ "${#PATHS[@]}" -gt 0 ] || { echo "usage: $0 [--machine NAME] [--any-env] [--no-publish] TARBALL|DIR..." >&2; exit 2; }

TARBALLS=()
for p in "${PATHS[@]}"; do
  if [ -d "$p" ]; then
    [ -f "$p/asv-results-$MACHINE.tar.gz" ] || { echo "gpu_asv_collect: $p has no asv-results-$MACHINE.tar.gz" >&2; exit 2; }
    TARBALLS+=("$p/asv-results-$MACHINE.tar.gz")
  elif [ -f "$p" ]; then
    TARBALLS+=("$p")
  else
    echo "gpu_asv_collect: no such file or folder: $p" >&2; exit 2
  fi
done

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for t in "${TARBALLS[@]}"; do
  tar xzf "$t" -C "$TMP"
done
[ -d "$TMP/$MACHINE" ] || { echo "gpu_asv_collect: the tarballs hold no $MACHINE/ folder" >&2; exit 2; }

# check, then copy: ASV results files (api version 2) of this machine and environment, one per commit; nothing is
# copied when any file is not
"$PY" - "$TMP/$MACHINE" ".asv/results/$MACHINE" "$MACHINE" "$ENV_EXPECTED" "$ANY_ENV" "$TMP/hashes" <<'EOF'
import json, os, shutil, sys
src, dst, machine, env_expected, any_env, out = sys.argv[1:7]
files, bad = [], []
for name in sorted(os.listdir(src)):
    if name in ("machine.json", "benchmarks.json") or not name.endswith(".json"):
        continue
    try:
        d = json.load(open(os.path.join(src, name)))
    except ValueError as exc:
        bad.append(f"{name}: {exc}"); continue
    if d.get("version") != 2 or "result_columns" not in d or (d.get("params") or {}).get("machine") != machine:
        bad.append(f"{name}: not an ASV results file (api version 2) of machine {machine}"); continue
    if d.get("env_name") != env_expected and any_env != "1":
        bad.append(f"{name}: environment {d.get('env_name')!r}, the history's is {env_expected!r} (--any-env)"); continue
    files.append((name, d))
if bad:
    sys.exit("gpu_asv_collect: nothing copied:\n  " + "\n  ".join(bad))
if not files:
    sys.exit("gpu_asv_collect: no results files in the tarballs")
os.makedirs(dst, exist_ok=True)
with open(out, "w") as f:
    for name, d in files:
        new = not os.path.exists(os.path.join(dst, name))
        shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
        mods = sorted({k.split(".")[0] for k in d["results"]})
        print(f"{'added' if new else 'updated'}: {dst}/{name} ({', '.join(mods)})")
        f.write(d["commit_hash"] + "\n")
EOF
mapfile -t HASHES < "$TMP/hashes"

status=0
for h in "${HASHES[@]}"; do
  echo "== gate: ${h:0:8} (--bench '^bench_(e2e|accuracy)')"
  rc=0
  out=.asv/env/gate-$MACHINE-${h:0:8}.txt  # the whole table (git-ignored)
  mkdir -p .asv/env
  "$PY" ci/gate.py --results .asv/results --machine "$MACHINE" --commit "$h" --bench '^bench_(e2e|accuracy)' \
    > "$out" 2>&1 || rc=$?
  grep -E "^(gate:|FAIL (threshold|regression):)" "$out" | cut -c1-240 || true
  case $rc in
    0) echo "   read; the gate passed (table: $out)" ;;
    1) echo "   read; the gate lists failures (above; table: $out): information, see known_misses in ci/thresholds.json" ;;
    *) echo "   the gate could not read the results (exit $rc):"; tail -n 5 "$out"; status=1 ;;
  esac
done

echo "== benchmark list (.asv/results/benchmarks.json)"
rc=0
"$PY" ci/asv_benchmark_list.py --check || rc=$?
if [ "$rc" = 1 ]; then
  "$PY" ci/asv_benchmark_list.py && echo "   regenerated: the suite changed since it was committed; commit it"
elif [ "$rc" != 0 ]; then
  echo "gpu_asv_collect: the benchmark list could not be discovered (exit $rc)" >&2; status=1
fi

if [ "$PUBLISH" = 1 ]; then
  echo "== pages (.asv/html)"
  if "$PY" -m asv publish > "$TMP/publish.txt" 2>&1; then
    echo "   built: $PY -m asv preview serves them"
  else
    tail -n 5 "$TMP/publish.txt"; status=1
  fi
fi

echo "== to commit:"
echo "   git add $(for h in "${HASHES[@]}"; do printf '.asv/results/%s/%s-*.json ' "$MACHINE" "${h:0:8}"; done).asv/results/benchmarks.json"
exit $status
