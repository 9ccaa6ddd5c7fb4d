#!/usr/bin/env bash
# Reference results from a GPU machine, for others to compare their hardware with:
#   1. the GPU tests (CuPy kernels against their torch twins, BPPSA against autograd),
#   2. the RNN part of the paper profile (Fig 7, Fig 8 a-f),
#   3. the memory-traffic-bound benchmark of the scan,
#   4. an environment record,
# then a copy of results/<device>/ in results/reference/<device>/.
# Usage: scripts/gpu_reference.sh   (env: PYTHON, CORES, RNN_TARGETS to override the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
CORES=${CORES:-all}
RNN_TARGETS=${RNN_TARGETS:-results/fig_7.png results/fig_8_a.png results/fig_8_b.png results/fig_8_c.png results/fig_8_d.png results/fig_8_e.png results/fig_8_f.png}

"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_reference.sh: no CUDA GPU visible to torch')"
"$PY" -c "import cupy" 2>/dev/null || echo "gpu_reference.sh: warning: CuPy is not importable, the cupy backend will be skipped" >&2
DEVICE=$("$PY" -c "import bppsa.device; print(bppsa.device.slug('cuda'))")
OUT=results/$DEVICE
mkdir -p "$OUT/membound"
echo "[gpu_reference] device: $DEVICE"

echo "[gpu_reference] 1/4 GPU tests"
"$PY" -m pytest -m gpu -q 2>&1 | tee "$OUT/gpu_tests.log"

echo "[gpu_reference] 2/4 RNN part of the paper profile"
# shellcheck disable=SC2086  # RNN_TARGETS is a list of paths
snakemake --cores "$CORES" --configfile config/paper.yaml $RNN_TARGETS

echo "[gpu_reference] 2b/4 the torch backend on the same GPU, at the headline configurations"
# a separate results folder (<device>-torch-backend), so the figures overlay it beside the CuPy one
snakemake --cores "$CORES" --configfile config/paper.yaml --config backend=torch "device_slug=$DEVICE-torch-backend" -- \
  "results/$DEVICE-torch-backend/rnn/bench_T30000_B16_bppsa-fused.csv" \
  "results/$DEVICE-torch-backend/rnn/bench_T1000_B16_bppsa-fused.csv" \
  "results/$DEVICE-torch-backend/rnn/bench_T30000_B16_baseline.csv" \
  "results/$DEVICE-torch-backend/rnn/bench_T1000_B16_baseline.csv"

echo "[gpu_reference] 3/4 memory-traffic bound of the scan"
for shape in "1000 16 20" "10000 16 20" "1000 16 64"; do
  read -r T B H <<<"$shape"
  for dtype in float32 float64; do
    for layout in paper fused; do
      bppsa bench-membound --seq-len "$T" --batch "$B" --hidden "$H" --dtype "$dtype" --layout "$layout" \
        --iters 50 --out "$OUT/membound/T${T}_B${B}_H${H}_${dtype}_${layout}.csv"
    done
  done
done

echo "[gpu_reference] 4/4 environment record"
"$PY" -c "import bppsa.device, json; print(json.dumps(bppsa.device.describe('cuda'), indent=2))" > "$OUT/environment.json.tmp"
mv "$OUT/environment.json.tmp" "$OUT/environment.json"

mkdir -p results/reference
for dev in "$DEVICE" "$DEVICE-torch-backend"; do
  REF=results/reference/$dev
  rm -rf "$REF.tmp"
  cp -r "results/$dev" "$REF.tmp"
  rm -rf "$REF"
  mv "$REF.tmp" "$REF"
  echo "[gpu_reference] done: $REF"
done
