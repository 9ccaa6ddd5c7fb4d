#!/usr/bin/env bash
# A short, time-boxed check of a GPU: what to run when a GPU is lent for minutes, not hours
# (scripts/gpu_reference.sh is the hours-long version).  Every step has its own time limit, a step that
# fails does not stop the others, and steps that no longer fit before DEADLINE are skipped and listed:
#   1. the machine: nvidia-smi, torch/CUDA/cuDNN, CuPy
#   2. bppsa doctor on the GPU (the kernels compiled by CuPy, a scan and a verify per backend)
#   3. the GPU tests (CuPy kernels against their torch twins, BPPSA against autograd/cuDNN), with
#      compute-sanitizer memcheck/racecheck on the faithful and factored kernels (single seed and per-step
#      gradients) running beside them
#   4. quiet benchmarks, one at a time, most important first: RNN T = 1000 / B = 16, the GRU on set L / B = 16,
#      RNN T = 30,000 / B = 16, RNN T = 1000 / B = 256, RNN T = 100 / B = 16, the GRU on set S / B = 64
#      (cuDNN default and packed, BPPSA paper and fused layouts, backend auto), then their speedups, the
#      cost model's prediction beside them (bppsa gpu-measured), JAX's jax.grad of the same RNN where JAX is
#      installed (scripts/jax_rival.py) and the scan against the copy bandwidth; the headline shapes again with
#      every variant captured in CUDA graphs (bppsa bench --graphed: BPPSA against cuDNN, graph against graph)
# Usage: scripts/gpu_check.sh [RESULTS_DIR]   (default results/<device slug>)
# env: PYTHON, DATA (a folder with T{10,100,1000,10000,30000}.npz bitstreams and mfcc_{l,s}.npz; made here
#      when absent, which needs librosa), DEADLINE (seconds from the start; default 540), SANITIZER=path|skip,
#      DEVICE (default cuda), GPU_MODEL (the cost model's GPU when its table lacks this one).
# Each step's log is RESULTS_DIR/check/<step>.log; RESULTS_DIR/check/steps.tsv lists step, exit status, seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
DEADLINE=${DEADLINE:-540}
T0=$(date +%s)
export PYTHONUNBUFFERED=1 BPPSA_TRACEBACK=1
bppsa() { "$PY" -m bppsa "$@"; }

SLUG=$("$PY" -m bppsa device --device "$DEVICE" 2>/dev/null) || SLUG=unknown-device
RES=${1:-results/$SLUG}
LOG=$RES/check
mkdir -p "$LOG"
printf 'step\trc\tseconds\n' > "$LOG/steps.tsv"
echo "[gpu_check] device $SLUG, results in $RES, deadline ${DEADLINE}s"

left() { echo $((DEADLINE - ($(date +%s) - T0))); }
# step NAME LIMIT_S CMD...: run CMD with a time limit (cut to what is left before the deadline), log it
step() {
  local name=$1 limit=$2 t rc
  shift 2
  if [ "$(left)" -lt $((limit / 3 + 5)) ]; then
    printf '%s\tskipped\t0\n' "$name" >> "$LOG/steps.tsv"
    echo "[gpu_check] $name: skipped, $(left) s left"
    return 0
  fi
  [ "$limit" -le "$(left)" ] || limit=$(left)
  t=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" $(($(date +%s) - t)) >> "$LOG/steps.tsv"
  echo "[gpu_check] $name: rc $rc in $(($(date +%s) - t)) s; $(tail -n 1 "$LOG/$name.log")"
}

step machine 60 bash -c "nvidia-smi; nvidia-smi -q -d CLOCK,POWER | head -60; \"$PY\" -c '
import torch, platform; print(\"python\", platform.python_version(), \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
\"cudnn\", torch.backends.cudnn.version(), torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\")
import cupy; print(\"cupy\", cupy.__version__)'"
step environment 30 bash -c "\"$PY\" -c \"import bppsa.device, json; print(json.dumps(bppsa.device.describe('$DEVICE'), \
  indent=2))\" > $RES/environment.json.tmp && mv $RES/environment.json.tmp $RES/environment.json"
step doctor 150 bash -c "\"$PY\" -m bppsa doctor --device $DEVICE; rc=\$?; \
  \"$PY\" -m bppsa doctor --device $DEVICE --json > $LOG/doctor.json; exit \$rc"

# data: the prepared folder, or made here
DATA=${DATA:-$RES/check/data}
if [ ! -f "$DATA/T30000.npz" ]; then
  mkdir -p "$DATA"
  step data 120 bash -c "set -e; for T in 10 100 1000 10000 30000; do \"$PY\" -m bppsa make-bitstream --seq-len \$T \
    --samples 512 --out $DATA/T\$T.npz; done; \"$PY\" -m bppsa make-irmas --source synthetic --root $DATA/irmas \
    --clips 220 --threads 8 --out $DATA/irmas.json; for s in l s; do \"$PY\" -m bppsa mfcc --corpus $DATA/irmas.json \
    --set \$s --threads 8 --out $DATA/mfcc_\$s.npz; done"
fi

# a loss on every step of bppsa.nn on cupy-factored (T = 37: ten chunks and more) against torch.nn's gradients, fp64
PER_STEP='import sys, torch, bppsa.nn as bnn
cell, dev = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
ref = (torch.nn.RNN if cell == "rnn" else torch.nn.GRU)(12, 20, dtype=torch.float64).to(dev)
got = (bnn.RNN if cell == "rnn" else bnn.GRU).from_torch(ref, backend="cupy-factored")
x = torch.randn(37, 3, 12, dtype=torch.float64, device=dev)
w = torch.randn(37, 3, 20, dtype=torch.float64, device=dev)
for m in (ref, got):
    (m(x)[0] * w).sum().backward()
err = max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item() for a, b in zip(got.parameters(), ref.parameters()))
print(f"per-step gradients, {cell}, cupy-factored against torch.nn: max rel err {err:.2e}")
sys.exit(0 if err <= 1e-10 else 1)'

# the sanitizer runs beside the tests (neither is timed)
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
pids=()
if [ "$SANITIZER" != skip ] && [ -x "$SANITIZER" ]; then
  sanitize() {  # NAME TOOL CMD...
    local name=$1 tool=$2
    shift 2
    step "sanitizer_$name" 180 "$SANITIZER" --tool "$tool" --error-exitcode 1 --log-file "$LOG/sanitizer_$name.txt" "$@"
  }
  sanitize memcheck_faithful memcheck "$PY" -m bppsa bench-membound --backends cupy --seq-len 100 --batch 3 \
    --hidden 64 --dtype float64 --layout paper --iters 1 --warmup 0 --out "$LOG/sanitizer_bench.csv" &
  pids+=($!)
  sanitize memcheck_factored_rnn memcheck "$PY" -m bppsa verify --model rnn --backend cupy-factored --layout fused \
    --device "$DEVICE" --seq-len 300 --batch 5 --dtype float32 &
  pids+=($!)
  sanitize racecheck_factored_gru racecheck "$PY" -m bppsa verify --model gru --backend cupy-factored --layout fused \
    --device "$DEVICE" --seq-len 129 --batch 2 --dtype float64 &
  pids+=($!)
  # the per-step-gradient (affine) scan of the factored kernels: offsets, carry kernel, down kernel with c injected
  sanitize memcheck_affine_rnn memcheck "$PY" -c "$PER_STEP" rnn "$DEVICE" &
  pids+=($!)
  sanitize racecheck_affine_gru racecheck "$PY" -c "$PER_STEP" gru "$DEVICE" &
  pids+=($!)
else
  printf 'sanitizer\tskipped\t0\n' >> "$LOG/steps.tsv"
fi
step gpu_tests 200 "$PY" -m pytest -m gpu -q -n 6 -p no:cacheprovider --junitxml="$LOG/gpu_tests.xml" \
  tests/test_kernels.py tests/test_factored_kernels.py tests/test_gru.py tests/test_nn.py tests/test_bench_recurrent.py
[ "${#pids[@]}" -eq 0 ] || wait "${pids[@]}"

# quiet benchmarks, one at a time, most important first
PROTO=(--warmup 3 --min-iters 10 --min-seconds 0.5 --max-iters 200 --max-seconds 6 --threads 0 --results-dir "$RES"
       --device "$DEVICE" --profile gpu-check)
RNN_VARIANTS=(--variants baseline baseline-packed bppsa-paper bppsa-fused)
mkdir -p "$RES/rnn" "$RES/gru"
# rnn T B LIMIT [MAX_SECONDS]: T = 30,000 needs more than the default cap for paired intervals (1.7 s a round)
rnn() { step "bench_rnn_T$1_B$2" "$3" "$PY" -m bppsa bench --model rnn --data "$DATA/T$1.npz" --batch "$2" \
  "${RNN_VARIANTS[@]}" --lr 1e-5 "${PROTO[@]}" --max-seconds "${4:-6}" --out "$RES/rnn/bench_T$1_B$2.csv"; }
gru() { step "bench_gru_$1_B$2" "$3" "$PY" -m bppsa bench --model gru --data "$DATA/mfcc_$1.npz" --batch "$2" \
  --variants baseline baseline-packed bppsa-fused --lr 3e-4 "${PROTO[@]}" --out "$RES/gru/bench_$1_B$2.csv"; }
rnn 1000 16 60
gru l 16 60
rnn 30000 16 90 12
rnn 1000 256 60
step speedups_rnn 30 bash -c "\"$PY\" -m bppsa speedups $RES/rnn/bench_*.csv --out $RES/rnn/speedups.csv \
  --latency-out $RES/rnn/latency.csv && cat $RES/rnn/speedups.csv"
GPU_NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null || echo none)
GPU_MODEL=${GPU_MODEL:-$("$PY" -c "import sys; from bppsa.backends.cuda import cost_model
print(cost_model.key_for_device_name(sys.argv[1]) or '')" "$GPU_NAME" 2>/dev/null)}
if [ -n "$GPU_MODEL" ]; then
  step gpu_measured 30 bash -c "\"$PY\" -m bppsa gpu-measured --gpu $GPU_MODEL --bench $RES/rnn/bench_T*_B*.csv \
    --out $RES/gpu_measured.csv"
else
  printf 'gpu_measured\tno cost-model entry for %s\t0\n' "$GPU_NAME" >> "$LOG/steps.tsv"
fi
# the headline shapes graphed: each variant's iteration captured phase by phase in CUDA graphs and replayed (the
# device's time, no host work per launch), BPPSA against cuDNN graphed the same way; cuDNN's per-step algorithm
# graphed in a step of its own (a capture it cannot make fails that step alone)
mkdir -p "$RES/rnn/graphed" "$RES/gru/graphed"
GRAPHED=(--graphed --no-nobp "${PROTO[@]}")
grnn() { step "graphed_rnn_T$1_B$2${4:-}" "$3" "$PY" -m bppsa bench --model rnn --data "$DATA/T$1.npz" --batch "$2" \
  --variants baseline bppsa-fused --packed-baseline "${5:-off}" --lr 1e-5 "${GRAPHED[@]}" \
  --out "$RES/rnn/graphed/bench_T$1_B$2${4:-}.csv"; }
grnn 1000 16 45
step graphed_gru_l_B16 45 "$PY" -m bppsa bench --model gru --data "$DATA/mfcc_l.npz" --batch 16 \
  --variants baseline bppsa-fused --packed-baseline off --lr 3e-4 "${GRAPHED[@]}" --out "$RES/gru/graphed/bench_l_B16.csv"
grnn 30000 16 60
grnn 1000 256 45
grnn 1000 16 60 _packed on
step speedups_graphed 30 bash -c "\"$PY\" -m bppsa speedups $RES/rnn/graphed/bench_T*_B*[0-9].csv \
  --out $RES/rnn/graphed/speedups.csv && \"$PY\" -m bppsa speedups $RES/rnn/graphed/bench_T1000_B16_packed.csv \
  --out $RES/rnn/graphed/speedups_packed.csv; \"$PY\" -m bppsa speedups $RES/gru/graphed/bench_l_B16.csv \
  --out $RES/gru/graphed/speedups.csv; cat $RES/rnn/graphed/speedups*.csv $RES/gru/graphed/speedups.csv"
# JAX's compiled BPTT backward of the same RNN, the rival a user would pick (where JAX is installed; else a note)
step jax_rival 75 "$PY" scripts/jax_rival.py --out "$RES/rnn/jax_rival.csv" --seq-len 1000 30000 --batch 16 \
  --data-dir "$DATA" --min-iters 3 --max-seconds 5
rnn 100 16 40
gru s 64 40
step speedups 30 bash -c "\"$PY\" -m bppsa speedups $RES/rnn/bench_*.csv --out $RES/rnn/speedups.csv \
  --latency-out $RES/rnn/latency.csv && \"$PY\" -m bppsa speedups $RES/gru/bench_*.csv --out $RES/gru/speedups.csv \
  --latency-out $RES/gru/latency.csv && cat $RES/rnn/speedups.csv $RES/gru/speedups.csv"
mkdir -p "$RES/membound"
for T in 1000 10000; do
  for layout in fused paper; do
    step "membound_T${T}_$layout" 40 "$PY" -m bppsa bench-membound --device "$DEVICE" --seq-len "$T" --batch 16 \
      --dtype float32 --layout "$layout" --iters 30 --out "$RES/membound/T${T}_B16_H20_float32_$layout.csv"
  done
done
echo "[gpu_check] done in $(($(date +%s) - T0)) s"
cat "$LOG/steps.tsv"
