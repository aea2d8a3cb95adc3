#!/usr/bin/env bash
# Create (or reuse) .venv and install the project with the pinned CPU toolchain.
# torch (pinned in requirements/ci.txt) is installed first as the CPU build from PyTorch's CPU index, so pip never
# pulls PyPI's multi-GB CUDA build; where that index cannot be reached, pip's own configuration supplies it
# (tools/install_torch.sh).  LOKI_TORCH_INDEX names another index (a CUDA one for the GPU kernels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
LOKI_TORCH_INDEX=${LOKI_TORCH_INDEX:-https://download.pytorch.org/whl/cpu} bash tools/install_torch.sh .venv/bin/python
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/ci.txt 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/data.txt 2>&1 | grep -v "is ignored: it is neither" || true
# the distribution was called "loki" before it became "loki-attention": drop an old editable install of it
if .venv/bin/python -c "import importlib.metadata as m, json, sys
d = json.loads(m.distribution('loki').read_text('direct_url.json') or '{}')
sys.exit(not d.get('dir_info', {}).get('editable'))" 2>/dev/null; then
  .venv/bin/python -m pip uninstall -q -y loki
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import loki, torch, triton, transformers; print(f'loki {loki.__version__} | torch {torch.__version__} | triton {triton.__version__} | transformers {transformers.__version__}')"
