#!/usr/bin/env bash
# Create (or reuse) .venv and install the project with the pinned CPU toolchain.
# torch is pinned to the local CPU build (requirements/ci.txt) so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/ci.txt 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/data.txt 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import loki, torch, triton, transformers; print(f'loki {loki.__version__} | torch {torch.__version__} | triton {triton.__version__} | transformers {transformers.__version__}')"
