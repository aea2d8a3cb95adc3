#!/usr/bin/env bash
# Install the torch release pinned in requirements/ci.txt into an environment, as the CPU build from PyTorch's
# CPU index (PyPI's Linux wheels of the same version are the multi-GB CUDA build).
#
#   bash tools/install_torch.sh [PYTHON]        (default: .venv/bin/python)
#
# LOKI_TORCH_INDEX overrides the index (default https://download.pytorch.org/whl/cpu; a CUDA index such as
# https://download.pytorch.org/whl/cu128 for the GPU kernels).  Nothing is done when the pinned version is
# installed already.  When the index cannot be reached (a machine without that network access), torch comes from
# pip's own configuration (`pip config list`: a local index or wheel folder) and a note says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
INDEX=${LOKI_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
PIN=$(grep -E '^torch==' requirements/ci.txt | head -n 1 | sed 's/[[:space:]#].*//')
VERSION=${PIN#torch==}
if "$PY" - "$VERSION" <<'EOF' 2>/dev/null; then
import importlib.metadata as m, sys
sys.exit(m.version("torch").split("+")[0] != sys.argv[1])
EOF
  exit 0
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if "$PY" - "$INDEX" <<'EOF' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
EOF
  echo "installing $PIN from $INDEX"
  ARGS=(--index-url "$INDEX" "$PIN")
else
  echo "note: $INDEX cannot be reached; $PIN comes from pip's configured indexes (pip config list)" >&2
  ARGS=("$PIN")
fi
# (this machine's pip configuration may name a missing wheel folder: pip's warning about it is dropped)
{ "${PIP[@]}" "${ARGS[@]}" 2>&1; } | { grep -v "is ignored: it is neither" || true; }
