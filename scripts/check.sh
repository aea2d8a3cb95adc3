#!/usr/bin/env bash
# Set up .venv and run the main job on the embedded default model (SmolLM2-135M-Instruct): calibrate or reuse the
# PCA bases, run the accuracy suite of the check profile, write loki-report/ (report.md opening with the verdict:
# does Loki work on this model, at what cost, how fast; results.json; plots). Exit status: 0 when no gate fails,
# 1 when one does, 2 on bad arguments (`loki check --help` states the rule and the measured time).
# Extra arguments go to `loki check`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
# two torch threads by default (the job runs alone); a later --threads overrides it
exec .venv/bin/loki check --threads "${LOKI_THREADS:-2}" "$@"
