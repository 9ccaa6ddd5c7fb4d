#!/usr/bin/env bash
# The first run on a GPU, and the reference results others compare their hardware with:
#   0. bppsa doctor: stops here unless a backend passes on the GPU (the CuPy one is required too)
#   1. the GPU tests (CuPy kernels against their torch twins, BPPSA against autograd/cuDNN)
#   2. compute-sanitizer memcheck and racecheck on the CuPy kernels: the faithful scan at a few shapes, the
#      factored RNN and GRU backward (a training step against autograd) at a few more
#   3. the RNN part of the paper profile (Fig 7, Fig 8 a-f): cuDNN (default and packed) against the faithful
#      layout (bppsa-paper) and the factored one (bppsa-fused, backend cupy-factored) over the paper's T
#      sweep; then the torch backend at the headline configurations
#   4. the measured layouts against the cost model (bppsa gpu-measured: achieved bytes/s and FLOP/s, measured
#      over predicted), and the memory-traffic-bound benchmark of the scan
#   5. an environment record, then a copy of results/<device>/ in results/reference/<device>/
# Every step stops the script on failure.  Logs land in results/<device>/ beside the results.
# Usage: scripts/gpu_reference.sh   (env: PYTHON, CORES, RNN_TARGETS, SANITIZER=path|skip,
#        GPU_MODEL=name|GBps:FP32_TFLOPs[:FP64_TFLOPs[:SMs]] for a GPU the cost model's table lacks)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CORES=${CORES:-all}
RNN_TARGETS=${RNN_TARGETS:-results/fig_7.png results/fig_8_a.png results/fig_8_b.png results/fig_8_c.png results/fig_8_d.png results/fig_8_e.png results/fig_8_f.png}

echo "[gpu_reference] 0/5 bppsa doctor"
"$PY" -m bppsa doctor --device cuda --json > /tmp/bppsa_doctor.$$.json || {
  rm -f /tmp/bppsa_doctor.$$.json
  "$PY" -m bppsa doctor --device cuda >&2 || true
  echo "gpu_reference.sh: bppsa doctor found no backend that works on the GPU (report above)" >&2
  exit 1
}
"$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); c = r['backends']['cupy']
sys.exit(0 if c['ok'] else 'gpu_reference.sh: the CuPy backend fails: ' + c['reason'])" /tmp/bppsa_doctor.$$.json
DEVICE=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['device_slug'])" /tmp/bppsa_doctor.$$.json)
OUT=results/$DEVICE
mkdir -p "$OUT/membound" "$OUT/sanitizer"
mv /tmp/bppsa_doctor.$$.json "$OUT/doctor.json"
"$PY" -m bppsa doctor --device cuda | tee "$OUT/doctor.txt"
echo "[gpu_reference] device: $DEVICE"
# the cost model's peaks for this GPU, settled now rather than after an hour of benchmarks
GPU_NAME=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['gpu']['name'])" "$OUT/doctor.json")
GPU_MODEL=${GPU_MODEL:-$("$PY" -c "import sys; from bppsa.backends.cuda import cost_model
print(cost_model.key_for_device_name(sys.argv[1]) or '')" "$GPU_NAME")}
[ -n "$GPU_MODEL" ] || { echo "gpu_reference.sh: the cost model has no peaks for '$GPU_NAME'; set GPU_MODEL=GBps:FP32_TFLOPs:FP64_TFLOPs:SMs from its datasheet" >&2; exit 1; }
"$PY" -m bppsa gpu-model --gpu "$GPU_MODEL" --seq-len 30000 --batch 16 > /dev/null  # a bad GPU_MODEL stops here
echo "[gpu_reference] cost model peaks: $GPU_MODEL"

echo "[gpu_reference] 1/5 GPU tests"
"$PY" -m pytest -m gpu -q 2>&1 | tee "$OUT/gpu_tests.log"

echo "[gpu_reference] 2/5 compute-sanitizer memcheck and racecheck"
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
if [ "$SANITIZER" = skip ]; then
  echo "[gpu_reference] SANITIZER=skip: not checked" | tee "$OUT/sanitizer/SKIPPED"
else
  [ -x "$SANITIZER" ] || { echo "gpu_reference.sh: compute-sanitizer not found (install the CUDA toolkit, set SANITIZER=/path/to/compute-sanitizer, or SANITIZER=skip)" >&2; exit 1; }
  # T B H dtype layout L_m: one block per level pair, a clipped tail, the fp64 H=64 shared-memory opt-in, the middle scan
  for shape in "1 1 1 float64 paper full" "17 5 20 float32 fused full" "100 3 64 float64 paper full" "33 2 7 float64 fused 2"; do
    read -r T B H DT LAY LM <<<"$shape"
    LMARG=()
    [ "$LM" = full ] || LMARG=(--L-m "$LM")
    for tool in memcheck racecheck; do
      log="$OUT/sanitizer/${tool}_T${T}_B${B}_H${H}_${DT}_${LAY}_L${LM}.log"
      "$SANITIZER" --tool "$tool" --error-exitcode 1 --log-file "$log" \
        "$PY" -m bppsa bench-membound --backends cupy --seq-len "$T" --batch "$B" --hidden "$H" --dtype "$DT" \
        --layout "$LAY" "${LMARG[@]}" --iters 1 --warmup 0 --out "$OUT/sanitizer/bench_${tool}.csv" \
        || { echo "gpu_reference.sh: $tool found errors, see $log" >&2; exit 1; }
      echo "[gpu_reference] $tool T=$T B=$B H=$H $DT $LAY L_m=$LM: clean"
    done
  done
  rm -f "$OUT"/sanitizer/bench_*.csv
  # the factored kernels (up, the middle scan, down with the gradient sums): a whole training step each,
  # T B dtype: one chunk only, several with a short last one, fp64
  for model in rnn gru; do
    for shape in "7 3 float32" "300 5 float32" "129 2 float64"; do
      read -r T B DT <<<"$shape"
      for tool in memcheck racecheck; do
        log="$OUT/sanitizer/${tool}_factored_${model}_T${T}_B${B}_${DT}.log"
        "$SANITIZER" --tool "$tool" --error-exitcode 1 --log-file "$log" \
          "$PY" -m bppsa verify --model "$model" --backend cupy-factored --layout fused --device cuda \
          --seq-len "$T" --batch "$B" --dtype "$DT" > /dev/null \
          || { echo "gpu_reference.sh: $tool found errors (or verify failed), see $log" >&2; exit 1; }
        echo "[gpu_reference] $tool factored $model T=$T B=$B $DT: clean"
      done
    done
  done
fi

echo "[gpu_reference] 3/5 RNN part of the paper profile"
# shellcheck disable=SC2086  # RNN_TARGETS is a list of paths
"$PY" -m snakemake --cores "$CORES" --configfile config/paper.yaml $RNN_TARGETS

echo "[gpu_reference] 3b/5 the torch backend on the same GPU, at the headline configurations"
# a separate results folder (<device>-torch-backend), so the figures overlay it beside the CuPy one
"$PY" -m snakemake --cores "$CORES" --configfile config/paper.yaml --config backend=torch "device_slug=$DEVICE-torch-backend" -- \
  "results/$DEVICE-torch-backend/rnn/bench_T30000_B16.csv" \
  "results/$DEVICE-torch-backend/rnn/bench_T1000_B16.csv"

echo "[gpu_reference] 4/5 the layouts against the cost model; memory-traffic bound of the scan"
"$PY" -m bppsa gpu-measured --gpu "$GPU_MODEL" --bench "$OUT"/rnn/bench_T*_B*.csv --out "$OUT/gpu_measured.csv" \
  | tee "$OUT/gpu_measured.txt"
for shape in "1000 16 20" "10000 16 20" "1000 16 64"; do
  read -r T B H <<<"$shape"
  for dtype in float32 float64; do
    for layout in paper fused; do
      "$PY" -m bppsa bench-membound --seq-len "$T" --batch "$B" --hidden "$H" --dtype "$dtype" --layout "$layout" \
        --iters 50 --out "$OUT/membound/T${T}_B${B}_H${H}_${dtype}_${layout}.csv"
    done
  done
done

echo "[gpu_reference] 5/5 environment record"
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
echo "[gpu_reference] commit results/reference/$DEVICE and results/reference/$DEVICE-torch-backend"
