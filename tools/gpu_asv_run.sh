#!/usr/bin/env bash
# Record the ASV history of the end-to-end and accuracy benchmarks on a GPU machine without network, whose copy of
# the tree has no usable git history, in commands of at most ~9.5 minutes that follow each other while the machine
# keeps /tmp (docs/maintainers.md has the whole procedure and the commands).
#
# Run from the tree root with .asv/env/carry carried (made by tools/gpu_asv_prepare.sh: asv's wheels, a git
# bundle of main, the list of commits).  Each command:
#   1. keeps the carried folder in the state folder (/tmp/asv-state), so a later command needs no carry;
#   2. unpacks the wheels into the site folder (/tmp/site, where tools/gpu_stage.sh puts the embedded model);
#   3. makes the tree a git repository with branch main from the bundle (never touching a checkout whose main
#      already holds the bundle's commits, and refusing one whose history differs);
#   4. registers the ASV machine from the committed .asv/results/<machine>/machine.json, so every file carries the
#      fields of the recorded history;
#   5. runs ci/run_asv_history.sh for one commit at a time, end-to-end (bench_e2e) and accuracy (bench_accuracy,
#      only once the embedded model is staged: `tools/gpu_stage.sh check`) in one `asv run` where both are due,
#      starting a run only when its estimated time fits the budget (estimates: measured durations of earlier runs,
#      else 240 s for bench_e2e and 150 s for bench_accuracy) and stopping it at the budget's end;
#   6. after every run copies the commit's results file to the state folder and writes the tarball of all the
#      results recorded so far to the output folder, so what was measured comes back even from a command that is
#      cut off; a later command continues with the runs still due (runs with results are not repeated);
#   7. once every run is recorded, publishes the pages (asv publish of the committed history and the new results)
#      when time is left and tars them into the output folder; prints a summary table last: one row per benchmark
#      case, one column per commit.
#
# Usage: bash tools/gpu_asv_run.sh [options] [COMMIT...]
#   COMMIT...          commits to record (hash or prefix, `main`); default: the carried list (carry/commits)
#   --budget S         seconds this command may take, publishing included (default 540)
#   --out DIR          results tarball, pages tarball, log (default $OUT, else <state>/out)
#   --bench LIST       groups to record: e2e,accuracy,select,kernels (default e2e,accuracy; select:
#                      bench_kernels.SplitSelect; kernels: bench_kernels.DecodeAttention, SparQComparison, Device)
#   --e2e-settings L   record bench_e2e for these setting ids only (comma-separated, LOKI_ASV_E2E_SETTINGS; ASV
#                      keeps the values already recorded for the others); the run is due unless the commit's file
#                      holds results of every one of them
#   --python PATH      interpreter with torch (default $ASV_PYTHON or /opt/torch/.venv/bin/python3: the path is part
#                      of every results file's name; keep the one of the recorded history)
#   --machine NAME     ASV machine (default h100)
#   --expect-gpu RE    refuse to run unless nvidia-smi's first GPU name matches RE (default: H100; `none`: no check)
#   --site DIR         site folder (default $LOKI_STAGE_SITE or /tmp/site)
#   --state DIR        state kept between commands (default /tmp/asv-state)
#   --carry DIR        carried folder (default .asv/env/carry)
#   --redo             run again what already has results
#   --publish          build the pages even when runs are still due; --no-publish: never
#   --dry-run          print what would run, change nothing
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$(date +%s)

PY=${ASV_PYTHON:-/opt/torch/.venv/bin/python3}
MACHINE=h100
BUDGET=540
OUTDIR=${OUT:-}
BENCH=e2e,accuracy
EXPECT_GPU=H100
SITE=${LOKI_STAGE_SITE:-/tmp/site}
STATE=/tmp/asv-state
CARRY=.asv/env/carry
REDO=0
PUBLISH=auto
DRY=0
COMMITS=()
E2E_SETTINGS=
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET=$2; shift 2 ;;
    --out) OUTDIR=$2; shift 2 ;;
    --bench) BENCH=$2; shift 2 ;;
    --e2e-settings) E2E_SETTINGS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --machine) MACHINE=$2; shift 2 ;;
    --expect-gpu) EXPECT_GPU=$2; shift 2 ;;
    --site) SITE=$2; shift 2 ;;
    --state) STATE=$2; shift 2 ;;
    --carry) CARRY=$2; shift 2 ;;
    --redo) REDO=1; shift ;;
    --publish) PUBLISH=1; shift ;;
    --no-publish) PUBLISH=0; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "gpu_asv_run: unknown option $1" >&2; exit 2 ;;
    *) COMMITS+=("$1"); shift ;;
  esac
done
OUTDIR=${OUTDIR:-$STATE/out}
RESERVE=40            # seconds kept for the pages, the tarballs and the summary
# first estimates, before any run was measured (LOKI_ASV_EST_E2E / LOKI_ASV_EST_ACCURACY override them)
DEFAULT_EST_e2e=${LOKI_ASV_EST_E2E:-240}  # bench_e2e: two settings x (two compiled paths of ~30 s, two eager ones)
DEFAULT_EST_accuracy=${LOKI_ASV_EST_ACCURACY:-150}  # bench_accuracy: model conversion, 3 bases, 8 methods, compiles
DEFAULT_EST_select=${LOKI_ASV_EST_SELECT:-60}  # bench_kernels.SplitSelect: two shapes, compiled once
DEFAULT_EST_kernels=${LOKI_ASV_EST_KERNELS:-90}  # the kernel benchmarks: 29-66 s per commit in the first history
VIRTUAL=0  # --dry-run: the estimated seconds of the runs it lists, so that it shows which would be skipped
declare -A MODULE=([e2e]=bench_e2e [accuracy]=bench_accuracy [select]=bench_kernels.SplitSelect
                  [kernels]='bench_kernels.(DecodeAttention|SparQComparison|Device)')
IFS=, read -r -a GROUPS_WANTED <<< "$BENCH"
for g in "${GROUPS_WANTED[@]}"; do
  [ -n "${MODULE[$g]:-}" ] || { echo "gpu_asv_run: --bench takes e2e, accuracy, select and/or kernels, got $g" >&2; exit 2; }
done

say() { echo "gpu_asv_run [$(( $(date +%s) - START ))s] $*"; }
die() { echo "gpu_asv_run: $*" >&2; exit 2; }
left() { echo $(( START + BUDGET - $(date +%s) - VIRTUAL )); }

if [ "$DRY" = 0 ]; then
  mkdir -p "$OUTDIR" "$STATE"
  exec > >(tee -a "$OUTDIR/gpu_asv_run.log") 2>&1
fi
if [ ! -x "$PY" ]; then
  found=$(command -v "$PY" 2>/dev/null || true)
  if [ -n "$found" ]; then PY=$found; elif [ "$DRY" = 0 ]; then die "no interpreter $PY (--python)"; fi
fi

# ---------------------------------------------------------------------------------------------- the card
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true)
[ -n "$GPU" ] || GPU=$(cd / && "$PY" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>/dev/null || true)
if [ "$EXPECT_GPU" != none ] && ! [[ "$GPU" =~ $EXPECT_GPU ]]; then
  msg="the GPU is '${GPU:-none found}', not $EXPECT_GPU: results filed under machine $MACHINE must come from that card"
  [ "$DRY" = 1 ] && echo "(dry run) $msg" || die "$msg (--expect-gpu none skips this check)"
fi
say "machine $MACHINE, GPU ${GPU:-none}, python $PY, budget ${BUDGET}s, state $STATE, out $OUTDIR"

# ---------------------------------------------------------------------------------------------- carried files
if [ -d "$CARRY" ] && [ -f "$CARRY/repo.bundle" ]; then
  if [ "$DRY" = 1 ]; then echo "+ cp -r $CARRY $STATE/carry"; else
    rm -rf "$STATE/carry.new" && cp -r "$CARRY" "$STATE/carry.new" && rm -rf "$STATE/carry" && mv "$STATE/carry.new" "$STATE/carry"
  fi
elif [ ! -f "$STATE/carry/repo.bundle" ]; then
  [ "$DRY" = 1 ] || die "no $CARRY here (carry it; tools/gpu_asv_prepare.sh makes it) and none kept in $STATE/carry"
fi
KEPT=$STATE/carry
[ "$DRY" = 1 ] && [ ! -d "$KEPT" ] && KEPT=$CARRY

# ---------------------------------------------------------------------------------------------- asv into the site
install_wheels() {
  local want marker=$SITE/.asv-wheels
  want=$(cd "$KEPT/wheels" && ls -- *.whl | sort)
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then say "wheels: already in $SITE"; return; fi
  mkdir -p "$SITE"
  local w name
  for w in "$KEPT"/wheels/*.whl; do
    name=$(basename "$w" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    case "$name" in
      packaging|importlib_metadata|zipp|lazy_importer)  # shared with the interpreter's own packages: never shadow
        if (cd / && env -u PYTHONPATH "$PY" -c "import $name" 2>/dev/null); then
          echo "  $name: the interpreter's own"; continue
        fi ;;
    esac
    "$PY" -m zipfile -e "$w" "$SITE" && echo "  $name: unpacked into $SITE"
  done
  if [ -d "$KEPT/shim" ] && ! (cd / && PYTHONPATH=$SITE "$PY" -c "import lazy_importer" 2>/dev/null); then
    cp "$KEPT"/shim/*.py "$SITE/" && echo "  lazy_importer: shim"
  fi
  echo "$want" > "$marker"
}
if [ "$DRY" = 1 ]; then
  echo "+ unzip $KEPT/wheels/*.whl into $SITE (packaging, importlib_metadata, zipp, lazy_importer only where $PY lacks them)"
else
  install_wheels
  (cd / && PYTHONPATH=$SITE "$PY" -m asv --version) >/dev/null || die "asv does not run from $SITE"
  say "$(cd / && PYTHONPATH=$SITE "$PY" -m asv --version)"
fi

# ---------------------------------------------------------------------------------------------- the repository
restore_repo() {
  local bundle=$KEPT/repo.bundle tip top
  tip=$(git bundle list-heads "$bundle" refs/heads/main | cut -d' ' -f1)
  [ -n "$tip" ] || die "$bundle has no branch main"
  git config --global --get-all safe.directory 2>/dev/null | grep -qx '\*' || git config --global --add safe.directory '*'
  top=$(git rev-parse --show-toplevel 2>/dev/null || true)
  if [ -n "$top" ] && [ "$(cd "$top" && pwd -P)" = "$(pwd -P)" ] &&
     [ "$(git rev-parse --is-shallow-repository 2>/dev/null)" = false ]; then
    if git merge-base --is-ancestor "$tip" refs/heads/main 2>/dev/null; then
      say "git: main already holds the bundle's main (${tip:0:8}); repository left as it is"
      return
    fi
    # a checkout whose main has commits the bundle's main lacks is someone's work: leave it as it is; a copy of an
    # older tree (main an ancestor of the bundle's) moves forward, losing nothing
    if [ ! -f "$(git rev-parse --git-dir)/loki-asv-bundle" ]; then
      git fetch -q --no-tags "$bundle" "+refs/heads/main:refs/remotes/bundle/main"
      if git rev-parse -q --verify refs/heads/main >/dev/null &&
         ! git merge-base --is-ancestor refs/heads/main refs/remotes/bundle/main 2>/dev/null; then
        die "this checkout's main has commits the bundle's ${tip:0:8} lacks: run in the GPU machine's copy"
      fi
    else
      git fetch -q --no-tags "$bundle" "+refs/heads/main:refs/remotes/bundle/main"
    fi
  else
    [ -e .git ] && mv .git ".git.unusable-$START"
    git init -q
    touch .git/loki-asv-bundle  # made from the bundle: a later command may move its main
    git fetch -q --no-tags "$bundle" "+refs/heads/main:refs/remotes/bundle/main"
  fi
  git update-ref refs/heads/main refs/remotes/bundle/main
  git symbolic-ref HEAD refs/heads/main
  say "git: branch main = ${tip:0:8} from the bundle ($(git rev-list --count main) commits)"
}
if [ "$DRY" = 1 ]; then
  echo "+ git init (when the tree has no usable repository); git fetch $KEPT/repo.bundle main:refs/remotes/bundle/main;" \
       "git update-ref refs/heads/main refs/remotes/bundle/main; git config --global --add safe.directory '*'"
else
  restore_repo
fi

# ---------------------------------------------------------------------------------------------- the ASV machine
if [ "$DRY" = 1 ]; then
  echo "+ ~/.asv-machine.json: machine $MACHINE with the fields of .asv/results/$MACHINE/machine.json"
else
  "$PY" - "$MACHINE" "$GPU" <<'EOF'
import json, os, platform, sys
name, gpu = sys.argv[1], sys.argv[2]
committed = os.path.join(".asv", "results", name, "machine.json")
if os.path.isfile(committed):
    fields = {k: v for k, v in json.load(open(committed)).items() if k != "version"}
else:
    fields = {"machine": name, "os": platform.system(), "cpu": gpu or "unknown GPU"}
path = os.path.expanduser("~/.asv-machine.json")
data = json.load(open(path)) if os.path.isfile(path) else {"version": 1}
if data.get(name) != fields:
    data[name] = fields
    data.setdefault("version", 1)
    json.dump(data, open(path, "w"), indent=4, sort_keys=True)
print(f"asv machine {name}: {fields}")
EOF
fi

# ---------------------------------------------------------------------------------------------- results so far
RES=.asv/results/$MACHINE
mkdir -p "$STATE/results/$MACHINE" 2>/dev/null || true
if [ "$DRY" = 0 ]; then
  mkdir -p "$RES"
  cp "$STATE"/results/"$MACHINE"/*.json "$RES/" 2>/dev/null || true
  # asv run rewrites the benchmark list from its discovery at the measured commit; the pages need the current one
  [ -f .asv/results/benchmarks.json ] && [ ! -f "$STATE/benchmarks.json.$START" ] &&
    cp .asv/results/benchmarks.json "$STATE/benchmarks.json.$START"
fi
restore_list() { [ -f "$STATE/benchmarks.json.$START" ] && cp "$STATE/benchmarks.json.$START" .asv/results/benchmarks.json || true; }

pack() {
  tar czf "$OUTDIR/asv-results-$MACHINE.tar.gz.tmp" -C "$STATE/results" "$MACHINE" &&
    mv "$OUTDIR/asv-results-$MACHINE.tar.gz.tmp" "$OUTDIR/asv-results-$MACHINE.tar.gz"
}

# ---------------------------------------------------------------------------------------------- the commits
if [ "${#COMMITS[@]}" -eq 0 ]; then
  [ -f "$KEPT/commits" ] || die "no commits given and no $KEPT/commits"
  mapfile -t COMMITS < "$KEPT/commits"
fi
HASHES=()
for c in "${COMMITS[@]}"; do
  if [ "$DRY" = 1 ] && ! git rev-parse -q --verify "$c^{commit}" >/dev/null 2>&1; then HASHES+=("$c"); continue; fi
  h=$(git rev-parse -q --verify "$c^{commit}") || die "unknown commit $c"
  HASHES+=("$h")
done

MODEL=0
if LOKI_STAGE_SITE=$SITE bash tools/gpu_stage.sh check >/dev/null 2>&1; then MODEL=1; fi

# done GROUP HASH: the commit's results file has entries of the group's module (with --e2e-settings, for e2e: a
# value of its speed-up for every one of the settings)
done_group() {
  local f
  for f in "$RES/${2:0:8}"-*.json; do
    [ -f "$f" ] || continue
    if [ "$1" = e2e ] && [ -n "$E2E_SETTINGS" ]; then
      "$PY" - "$f" "$E2E_SETTINGS" <<'PYEOF' && return 0
import itertools, json, math, sys
res = json.load(open(sys.argv[1])).get("results", {})
want = sys.argv[2].split(",")
got = set()
for name, entry in res.items():
    if not name.startswith("bench_e2e.") or not isinstance(entry, list) or len(entry) < 2 or not entry[1]:
        continue
    for combo, value in zip(itertools.product(*entry[1]), entry[0] or []):
        if isinstance(value, (int, float)) and math.isfinite(value):
            got.update(p.strip("'") for p in combo)
sys.exit(0 if all(w in got for w in want) else 1)
PYEOF
      continue
    fi
    grep -qE "\"${MODULE[$1]}\." "$f" && return 0
  done
  return 1
}

all_done() {
  local h=$1 g
  shift
  for g in "$@"; do done_group "$g" "$h" || return 1; done
}

# estimate GROUP...: seconds for one asv run of these groups (earlier runs' durations, split by the defaults)
estimate() {
  local total=0 g d est
  for g in "$@"; do
    d=$(eval echo "\$DEFAULT_EST_$g")
    est=$(awk -v g="$g" -v d="$d" -v de="$DEFAULT_EST_e2e" -v da="$DEFAULT_EST_accuracy" '
      { n = split($1, gs, ","); s = 0; has = 0
        for (i = 1; i <= n; i++) { s += (gs[i] == "e2e" ? de : da); if (gs[i] == g) has = 1 }
        if (has) { v = $2 * d / s; if (v > m) m = v; seen = 1 } }
      END { if (seen) printf "%d", m * 1.1 + 10; else printf "%d", d }' "$STATE/durations" 2>/dev/null || echo "$d")
    total=$((total + est))
  done
  echo "$total"
}

# run_limited SECONDS CMD...: run CMD in its own session; at the limit, end that session's processes (asv's
# benchmark processes run in process groups of their own, which a plain timeout would leave running)
stop_session() {
  local sid=$1 pids
  [ -n "$sid" ] && command -v ps >/dev/null || return 0
  pids=$(ps -e -o pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
  [ -n "$pids" ] || return 0
  kill -TERM $pids 2>/dev/null || true
  sleep 5
  pids=$(ps -e -o pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
}
run_limited() {
  local limit=$1 rc=0 pidfile job t0=$SECONDS
  shift
  if ! command -v setsid >/dev/null; then timeout -k 20 "$limit" "$@" || return $?; return 0; fi
  pidfile=$(mktemp)
  setsid -w bash -c 'echo $$ > "$0"; exec "$@"' "$pidfile" "$@" &
  job=$!
  while kill -0 "$job" 2>/dev/null; do
    if [ $((SECONDS - t0)) -ge "$limit" ]; then
      say "time limit of this run ($limit s) reached: stopping it (its results are not saved; a later command re-runs it)"
      stop_session "$(cat "$pidfile")"
      break
    fi
    sleep 2
  done
  wait "$job" || rc=$?
  stop_session "$(cat "$pidfile")"
  rm -f "$pidfile"
  return $rc
}

ran=0; skipped=(); failed=()
for h in "${HASHES[@]}"; do
  short=${h:0:8}
  due=()
  for g in "${GROUPS_WANTED[@]}"; do
    if [ "$REDO" = 0 ] && done_group "$g" "$h"; then say "$short $g: has results (--redo runs it again)"; continue; fi
    if [ "$g" = accuracy ] && [ "$MODEL" = 0 ]; then
      say "$short accuracy: waiting for the embedded model (tools/gpu_stage.sh install part1, part2, part3)"
      skipped+=("$short:accuracy(model)"); continue
    fi
    due+=("$g")
  done
  [ "${#due[@]}" -gt 0 ] || continue
  # the whole commit in one asv run when it fits, else the first group that fits
  pick=()
  for choice in "${due[*]}" "${due[@]}"; do
    read -r -a try <<< "$choice"
    if [ $(( $(estimate "${try[@]}") + RESERVE )) -le "$(left)" ]; then pick=("${try[@]}"); break; fi
  done
  for g in "${due[@]}"; do
    [[ " ${pick[*]} " == *" $g "* ]] || { say "$short $g: skipped, $(estimate "$g") s estimated, $(( $(left) - RESERVE )) s left"; skipped+=("$short:$g"); }
  done
  [ "${#pick[@]}" -gt 0 ] || continue
  regex=$(for g in "${pick[@]}"; do
             if [ "$g" = e2e ] && [ -n "$E2E_SETTINGS" ]; then echo "^bench_e2e.*\\('(${E2E_SETTINGS//,/|})'\\)\$"
             else echo "^${MODULE[$g]}"; fi
           done | paste -sd'|')
  [ "${#pick[@]}" -gt 1 ] && regex="($regex)"
  limit=$(( $(left) - 20 ))
  cmd=(bash ci/run_asv_history.sh --force --python "$PY" --machine "$MACHINE" --bench "$regex" -n 1 "$h"
       -- --quick --show-stderr)
  envs=(LOKI_CACHE="$STATE/loki-cache/$short" ASV_PYTHONPATH="$SITE" PYTHONPATH="$SITE"
        LOKI_ASV_E2E_SETTINGS="$E2E_SETTINGS"
        TRITON_CACHE_DIR="$STATE/triton-cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1)
  say "== $short ${pick[*]}: estimated $(estimate "${pick[@]}") s, stopped after $limit s"
  if [ "$DRY" = 1 ]; then
    echo "+ ${envs[*]} ${cmd[*]}"
    VIRTUAL=$((VIRTUAL + $(estimate "${pick[@]}")))
    continue
  fi
  # the converted model is shared; the bases are per commit (older commits' cache keys lack the code fingerprint)
  mkdir -p "$STATE/loki-cache/models" "$STATE/loki-cache/$short"
  [ -e "$STATE/loki-cache/$short/models" ] || ln -s ../models "$STATE/loki-cache/$short/models"
  t0=$(date +%s)
  touch "$STATE/run-start"
  rc=0
  run_limited "$limit" env "${envs[@]}" "${cmd[@]}" || rc=$?
  dt=$(( $(date +%s) - t0 ))
  restore_list
  if [ -n "$(find "$RES" -name "$short-*.json" -newer "$STATE/run-start")" ] && all_done "$h" "${pick[@]}"; then
    echo "$(IFS=,; echo "${pick[*]}") $dt" >> "$STATE/durations"
    cp "$RES/$short"-*.json "$STATE/results/$MACHINE/"
    pack
    ran=$((ran + 1))
    say "== $short ${pick[*]}: recorded in $dt s (exit $rc)"
  else
    failed+=("$short:${pick[*]}")
    say "== $short ${pick[*]}: nothing recorded after $dt s (exit $rc)"
  fi
done
[ "$DRY" = 1 ] && { echo "+ asv publish --no-pull --html-dir $STATE/html; tar the pages and the results into $OUTDIR"; exit 0; }
pack

# ---------------------------------------------------------------------------------------------- the pages
[ "$PUBLISH" = auto ] && { [ "${#skipped[@]}" -eq 0 ] && [ "${#failed[@]}" -eq 0 ] && PUBLISH=1 || PUBLISH=later; }
if [ "$PUBLISH" = 1 ] && [ "$(left)" -ge 25 ]; then
  restore_list
  rm -rf "$STATE/html"
  if (PYTHONPATH=$SITE timeout $(( $(left) - 10 )) "$PY" -m asv publish --no-pull --html-dir "$STATE/html" >"$STATE/publish.log" 2>&1); then
    tar czf "$OUTDIR/asv-html.tar.gz" -C "$STATE" html
    size=$(stat -c %s "$OUTDIR/asv-html.tar.gz")
    if [ "$size" -gt $((15 * 1024 * 1024)) ]; then rm -f "$OUTDIR/asv-html.tar.gz"; say "pages: $size bytes, too large to return"; else
      say "pages: $OUTDIR/asv-html.tar.gz ($size bytes)"; fi
  else
    say "pages: asv publish failed: $(tail -n 3 "$STATE/publish.log")"
  fi
elif [ "$PUBLISH" = 1 ]; then
  say "pages: not built (time)"
elif [ "$PUBLISH" = later ]; then
  say "pages: built once every run is recorded (--publish builds them now)"
fi
restore_list

# ---------------------------------------------------------------------------------------------- summary
say "this command: $ran runs recorded; skipped: ${skipped[*]:-none}; failed: ${failed[*]:-none}"
say "results of this series: $OUTDIR/asv-results-$MACHINE.tar.gz ($(ls "$STATE/results/$MACHINE" | wc -l) files)"
"$PY" - "$STATE/results/$MACHINE" .asv/results/benchmarks.json "${HASHES[@]}" <<'EOF'
import itertools, json, math, os, sys
folder, listing, hashes = sys.argv[1], sys.argv[2], sys.argv[3:]
meta = json.load(open(listing)) if os.path.isfile(listing) else {}
files = {}
for name in os.listdir(folder):
    d = json.load(open(os.path.join(folder, name)))
    files[d["commit_hash"]] = d
cols = [h for h in hashes if h in files]
if not cols:
    print("summary: no results recorded yet"); sys.exit(0)
rows = {}
for h in cols:
    d = files[h]
    ci, pi = d["result_columns"].index("result"), d["result_columns"].index("params")
    for name, row in d["results"].items():
        if not name.startswith(("bench_e2e.", "bench_accuracy.")):
            continue
        params, result = row[pi] or [], row[ci]
        combos = list(itertools.product(*params)) if params else [()]
        values = result if isinstance(result, list) else [result] * len(combos)
        for combo, v in zip(combos, values):
            key = name.replace("bench_e2e.EndToEndDecode.", "e2e.").replace("bench_accuracy.", "acc.")
            key += "(" + ",".join(str(c).strip("'") for c in combo) + ")" if combo else ""
            rows.setdefault(key, {})[h] = v
fmt = lambda v: "failed" if v is None else ("n/a" if isinstance(v, float) and math.isnan(v) else f"{v:.4g}")
w = max(len(k) for k in rows)
print("summary (value per commit; n/a = skipped, failed = no value):")
print("  " + "benchmark".ljust(w) + "".join(f"  {h[:8]:>10}" for h in cols))
for key in sorted(rows):
    print("  " + key.ljust(w) + "".join(f"  {fmt(rows[key].get(h)) if h in rows[key] else '-':>10}" for h in cols))
for h in cols:
    durs = {k: round(v) for k, v in files[h].get("durations", {}).items() if "setup_cache" in k}
    print(f"  {h[:8]} setup_cache seconds: {durs}")
EOF
