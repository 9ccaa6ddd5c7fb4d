#!/usr/bin/env bash
# Installs the harness into the current Python environment (use a venv or conda env if you like).
# scripts/install_plan.py decides which builds (its docstring has the rules):
#   * no NVIDIA GPU: torch is installed only if missing (TORCH_SPEC, default torch==2.13.0, which
#     resolves to the CPU wheel where one is provided locally), then this package;
#   * a GPU: the torch build its driver supports (CUDA 13 for drivers >= 580, else CUDA 12), an
#     installed CUDA build if the driver runs it, then the CuPy and NVRTC wheels of torch's CUDA
#     major; it stops if torch then cannot use the GPU.
# BPPSA_TORCH_CUDA=cpu|12|13 forces the choice without asking nvidia-smi (image builds have no GPU).
# TORCH_SPEC, TORCH_INDEX_URL and CUPY_SPEC override the torch requirement, its index and the CuPy wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PLAN=$("$PY" scripts/install_plan.py)
eval "$PLAN"
for note in "${PLAN_NOTES[@]}"; do echo "[install] $note"; done
if [ "$PLAN_TORCH_UNINSTALL" = 1 ]; then
  "$PY" -m pip uninstall -y -q torch
fi
if [ "${#PLAN_TORCH_ARGS[@]}" -gt 0 ]; then
  echo "[install] installing ${PLAN_TORCH_ARGS[*]}"
  "$PY" -m pip install -q "${PLAN_TORCH_ARGS[@]}"
fi
"$PY" scripts/install_plan.py --check "$PLAN_CUDA" "$PLAN_NEED_GPU"
"$PY" -m pip install -q -e ".[test]"
if [ "$PLAN_CUDA" != cpu ]; then
  if [ "${#PLAN_CUPY_UNINSTALL[@]}" -gt 0 ]; then
    echo "[install] removing ${PLAN_CUPY_UNINSTALL[*]} (a CuPy for another CUDA major)"
    "$PY" -m pip uninstall -y -q "${PLAN_CUPY_UNINSTALL[@]}"
  fi
  echo "[install] CUDA $PLAN_CUDA: installing ${PLAN_GPU_ARGS[*]}"
  "$PY" -m pip install -q "${PLAN_GPU_ARGS[@]}" || echo "[install] CuPy install failed; the torch backend will be used"
fi
"$PY" -c "import bppsa, torch; print('[install] bppsa', bppsa.__version__, '| torch', torch.__version__, '| cuda', torch.version.cuda, '| GPU', torch.cuda.is_available())"
if [ "$PLAN_NEED_GPU" = 1 ]; then
  echo "[install] next: python3 -m bppsa doctor   (checks the driver, CuPy, NVRTC and both backends on the GPU)"
fi
