#!/usr/bin/env bash
# Set up .venv and run the main job on the embedded default model (SmolLM2-135M): calibrate or reuse
# the PCA bases, run the accuracy suite, write a report (markdown, JSON, plots), fail when a gate fails.
# Extra arguments go to `loki check` (see `loki check --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
# two torch threads by default (the job runs alone); a later --threads overrides it
exec .venv/bin/loki check --threads "${LOKI_THREADS:-2}" "$@"
