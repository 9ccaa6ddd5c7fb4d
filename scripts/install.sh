#!/usr/bin/env bash
# Installs the harness into the current Python environment (use a venv or conda env if you like).
# PyTorch is installed first and only if missing, so that:
#   * on a CPU machine `torch==2.13.0` resolves to the CPU wheel where one is provided locally
#     (set TORCH_SPEC / PIP_INDEX_URL to choose another build, e.g. the CPU index of pytorch.org);
#   * on a GPU machine an existing CUDA build of torch is kept, never replaced.
# With an NVIDIA GPU present, CuPy is installed too (the RawKernel backend).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[install] torch not found: installing $TORCH_SPEC"
  "$PY" -m pip install -q "$TORCH_SPEC"
fi
"$PY" -m pip install -q -e ".[test]"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if ! "$PY" -c "import cupy" 2>/dev/null; then
    echo "[install] NVIDIA GPU found: installing CuPy"
    "$PY" -m pip install -q "${CUPY_SPEC:-cupy-cuda12x}" || echo "[install] CuPy install failed; the torch backend will be used"
  fi
fi
"$PY" -c "import bppsa, torch; print('[install] bppsa', bppsa.__version__, '| torch', torch.__version__, '| cuda', torch.cuda.is_available())"
