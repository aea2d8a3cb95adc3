#!/usr/bin/env bash
# Benchmark a range of commits with ASV on a GPU machine, one result file per commit under .asv/results.
#
# ASV's "existing" environment never builds or installs anything, so this script does what ASV would:
# it checks every commit out into a scratch worktree and points the benchmark processes at it with
# ASV_PYTHONPATH (ASV drops PYTHONPATH itself).  The benchmark suite is the one of the current checkout
# (benchmarks/ here), so every commit is measured by the same code; a commit that lacks a module the suite
# needs has its benchmarks skipped, not failed.  Results are recorded under each commit's own hash
# (--set-commit-hash) in this checkout's .asv/results, ready to commit.
#
# Usage: ci/run_asv_history.sh [options] [REV_RANGE]
#   REV_RANGE         commits to measure, oldest first, on the first-parent line (default: the last 20 of HEAD,
#                     i.e. `git rev-list --first-parent -n 20 HEAD`); e.g. main~10..main or A..B
#   -n N              at most N commits (default 20)
#   --force           re-run commits that already have results on this machine
#   --machine NAME    ASV machine name (default $ASV_MACHINE or h100)
#   --python PATH     the interpreter with torch/triton/asv installed (default $ASV_PYTHON or python3); keep it
#                     at one fixed path: the results' environment name embeds it
#   --bench REGEX     only benchmarks matching REGEX (passed to asv run --bench)
#   --dry-run         list the commits and the commands, run nothing
#   -- ARGS...        extra arguments for `asv run` (e.g. --quick, --show-stderr)
#
# Benchmarks are launched with `--launch-method forkserver` (the suite is imported once, then forked per
# benchmark; ASV's default "spawn" re-imports torch and triton for every one of the ~26 kernel benchmarks,
# minutes per commit).  CUDA is first touched in the forked children only.  LOKI_ASV_LAUNCH=spawn reverts.
#
# Environment: ASV_MACHINE, ASV_PYTHON, LOKI_ASV_WORKTREE (scratch worktree, default .asv/env/worktree),
# LOKI_ASV_LAUNCH (ASV launch method, default forkserver).
set -euo pipefail

ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"

MACHINE=${ASV_MACHINE:-h100}
PY=${ASV_PYTHON:-python3}
COUNT=20
FORCE=0
DRY=0
BENCH=()
RANGE=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n) COUNT=$2; shift 2 ;;
    --force) FORCE=1; shift ;;
    --machine) MACHINE=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --bench) BENCH=(--bench "$2"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    -*) echo "run_asv_history: unknown option $1" >&2; exit 2 ;;
    *) RANGE=$1; shift ;;
  esac
done

PY=$(command -v "$PY")
RESULTS="$ROOT/.asv/results"
WORKTREE=${LOKI_ASV_WORKTREE:-$ROOT/.asv/env/worktree}  # .asv/env is git-ignored

# The machine description: written once with fixed fields, so that every run files its results under the
# same name (asv would otherwise ask interactively).
if ! "$PY" - "$MACHINE" <<'EOF'
import json, os, sys
path = os.path.expanduser("~/.asv-machine.json")
sys.exit(0 if os.path.isfile(path) and sys.argv[1] in json.load(open(path)) else 1)
EOF
then
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true)
  echo "run_asv_history: registering ASV machine '$MACHINE' (${GPU:-no GPU found})"
  [ "$DRY" = 1 ] || "$PY" -m asv machine --yes --machine "$MACHINE" --os "$(uname -s)" --arch "$(uname -m)" \
    --cpu "${GPU:-unknown GPU}" --num_cpu "$(nproc)" \
    --ram "$(awk '/MemTotal/ {print $2 * 1024}' /proc/meminfo)"
fi

mapfile -t COMMITS < <(
  if [ -n "$RANGE" ]; then
    git rev-list --first-parent --reverse "$RANGE" | tail -n "$COUNT"
  else
    git rev-list --first-parent -n "$COUNT" HEAD | tac
  fi
)
if [ "${#COMMITS[@]}" -eq 0 ]; then
  echo "run_asv_history: no commits in ${RANGE:-HEAD}" >&2
  exit 2
fi

if [ "$DRY" = 0 ]; then
  if [ -e "$WORKTREE/.git" ]; then
    git worktree remove --force "$WORKTREE" 2>/dev/null || rm -rf "$WORKTREE"
  fi
  git worktree prune
  mkdir -p "$(dirname "$WORKTREE")"
  git worktree add --detach "$WORKTREE" "${COMMITS[0]}" >/dev/null
  trap 'git -C "$ROOT" worktree remove --force "$WORKTREE" >/dev/null 2>&1 || true' EXIT
fi

done_n=0; skipped_n=0; failed=()
for c in "${COMMITS[@]}"; do
  short=${c:0:8}
  if [ "$FORCE" = 0 ] && compgen -G "$RESULTS/$MACHINE/$short-*.json" >/dev/null; then
    echo "== $short: results exist on $MACHINE, skipped (--force re-runs)"
    skipped_n=$((skipped_n + 1))
    continue
  fi
  echo "== $short $(git log -1 --format='%ad %s' --date=short "$c")"
  cmd=("$PY" -m asv run --python=same --machine "$MACHINE" --set-commit-hash="$c" \
       --launch-method "${LOKI_ASV_LAUNCH:-forkserver}" "${BENCH[@]}" "${EXTRA[@]}")
  if [ "$DRY" = 1 ]; then
    echo "   ASV_PYTHONPATH=$WORKTREE ${cmd[*]}"
    continue
  fi
  git -C "$WORKTREE" checkout --quiet --detach --force "$c"
  # The worktree's package first; its loki/evaluation finds the accuracy thresholds of that commit.
  if ASV_PYTHONPATH="$WORKTREE${ASV_PYTHONPATH:+:$ASV_PYTHONPATH}" "${cmd[@]}"; then
    done_n=$((done_n + 1))
  else
    echo "== $short: asv run failed" >&2
    failed+=("$short")
  fi
done

echo "run_asv_history: $done_n measured, $skipped_n already had results, ${#failed[@]} failed ${failed[*]:-}"
echo "results: $RESULTS/$MACHINE (commit them); pages: $PY -m asv publish && $PY -m asv preview"
[ "${#failed[@]}" -eq 0 ]
