#!/usr/bin/env bash
# The prepared GPU run (issue 41): what to run when a GPU is lent for minutes, under 9 minutes in all
# (scripts/gpu_reference.sh is the hours-long version).  Every step has its own time limit, a step that fails does not
# stop the others, and steps that no longer fit before DEADLINE are skipped and listed.  Most important first:
#   0. install: the wheels of scripts/gpu_wheels.sh (WHEELS, default .whl/; fetched beforehand on a machine with a
#      network) with `pip install --no-index --no-deps`, then this checkout (editable, no index); the machine, the
#      environment record, bppsa doctor
#   1. the GPU tests, with compute-sanitizer memcheck, racecheck and synccheck on every kernel of issue 41 (the
#      one-launch middle, the warp down kernels, the gradients' reduction: RNN and GRU training steps, single seed and
#      a loss on every step) running beside them
#   2. bppsa bench --graphed at the four headline shapes (RNN T = 1000 / B = 16, T = 30,000 / B = 16, T = 1000 /
#      B = 256, the GRU on set L / B = 16): BPPSA against graphed cuDNN, default and per-step (the per-step algorithm's
#      401 ms iterations at T = 30,000 left out), and their speedups
#   3. this turn's layers (scripts/bench_nn.py): bppsa.nn.LSTM against cuDNN's LSTM at T = 1000 / B = 16, and the
#      forward over slices on CUDA streams against cuDNN's forward at T = 1000 and 30,000 / B = 16; then JAX's
#      compiled BPTT backward at T = 1000 and 30,000 (scripts/jax_rival.py)
#   4. the per-kernel profile (scripts/gpu_profile.py)
#   5. the workflow itself: snakemake --cores all --configfile config/gpu-minutes.yaml, its results in RESULTS_DIR
#      (the GPU panels of Fig 7, 8, 9, 13 and claims.md from the DAG)
#   6. the host's CPU at its full width: bppsa scaling up to 16 threads (the claims rows of the workers at which
#      BPPSA's backward overtakes the compiled sequential one), and bppsa workers with p = 1 .. 16 processes
# Usage: scripts/gpu_check.sh [RESULTS_DIR]   (default results/<device slug>)
# env: PYTHON, DATA (a folder with T{1000,30000}.npz bitstreams and mfcc_l.npz: default .gpu-data/ where
#      scripts/gpu_data.sh made it beforehand, else made here by that script, which needs librosa), DEADLINE (seconds
#      from the start; default 540), SANITIZER=path|skip, DEVICE (default cuda), WHEELS (default .whl),
#      SCALING_THREADS (default 16), ONLY (names or shell patterns of the steps to run, e.g. ONLY="workflow scaling
#      workers": a second call in the same lease for what the first skipped or failed; the first call's rows stay in
#      steps.tsv), ARCHIVE (a .tgz written at exit, however the script ends, holding RESULTS_DIR and its -host-cpu
#      folder without the data: the device tool's way back, ARCHIVE=$OUT/check.tgz).
# At exit the workflow's figures, claims.md and report.md this run wrote in results/ are copied to RESULTS_DIR/workflow.
# Each step's log is RESULTS_DIR/check/<step>.log; RESULTS_DIR/check/steps.tsv lists step, exit status, seconds.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
DEADLINE=${DEADLINE:-540}
T0=$(date +%s)
export PYTHONUNBUFFERED=1 BPPSA_TRACEBACK=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
bppsa() { "$PY" -m bppsa "$@"; }

SLUG=$("$PY" -m bppsa device --device "$DEVICE" 2>/dev/null) || SLUG=unknown-device
RES=${1:-results/$SLUG}
HOST="$RES-host-cpu"
LOG=$RES/check
ONLY=${ONLY:-}
mkdir -p "$LOG" "$HOST"
[ -n "$ONLY" ] && [ -f "$LOG/steps.tsv" ] || printf 'step\trc\tseconds\n' > "$LOG/steps.tsv"
echo "[gpu_check] device $SLUG, results in $RES, deadline ${DEADLINE}s${ONLY:+, only: $ONLY}"
touch "$LOG/started"
# at exit, however the script ends: the workflow's own figures, claims and report (results/*, drawn over every device
# folder) copied into RES/workflow/ where this run wrote them, so they are committed with the folder; then ARCHIVE
finish() {
  mkdir -p "$RES/workflow"
  find results -maxdepth 1 -type f -newer "$LOG/started" ! -name README.md -exec cp -p {} "$RES/workflow/" \;
  if [ -n "${ARCHIVE:-}" ]; then
    tar czf "$ARCHIVE" --exclude=check/data -C "$(dirname "$RES")" "$(basename "$RES")" "$(basename "$HOST")" \
      && echo "[gpu_check] archived in $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1))"
  fi
}
trap finish EXIT
trap 'exit 143' TERM INT

left() { echo $((DEADLINE - ($(date +%s) - T0))); }
# selected NAME: whether ONLY (unset: every step) names the step, by name or shell pattern
selected() {
  [ -z "$ONLY" ] && return 0
  local pattern patterns
  read -r -a patterns <<< "$ONLY"  # split on blanks, no file-name expansion
  for pattern in "${patterns[@]}"; do
    # shellcheck disable=SC2053
    [[ $1 == $pattern ]] && return 0
  done
  return 1
}
# step NAME LIMIT_S CMD...: run CMD with a time limit (cut to what is left before the deadline), log it
step() {
  local name=$1 limit=$2 t rc
  shift 2
  selected "$name" || return 0
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

WHEELS=${WHEELS:-.whl}
# (under ONLY, also where a fresh machine lacks what the wheels hold)
if selected install || ! "$PY" -c "import snakemake, librosa" 2> /dev/null; then
  if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    ONLY='' step install 120 bash -c "\"$PY\" -m pip install -q --no-index --no-deps --find-links \"$WHEELS\" \"$WHEELS\"/*.whl && \
      \"$PY\" -m pip install -q --no-index --no-deps --no-build-isolation -e . && \"$PY\" -m snakemake --version"
  else
    printf 'install\tno wheels in %s\t0\n' "$WHEELS" >> "$LOG/steps.tsv"
  fi
fi
step machine 60 bash -c "nvidia-smi; nvidia-smi -q -d CLOCK,POWER | head -60; \"$PY\" -c '
import torch, platform; print(\"python\", platform.python_version(), \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
\"cudnn\", torch.backends.cudnn.version(), torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\")
import cupy; print(\"cupy\", cupy.__version__)'"
step environment 30 bash -c "\"$PY\" -c \"import bppsa.device, json; print(json.dumps(bppsa.device.describe('$DEVICE'), \
  indent=2))\" > $RES/environment.json.tmp && mv $RES/environment.json.tmp $RES/environment.json"
step doctor 150 bash -c "\"$PY\" -m bppsa doctor --device $DEVICE; rc=\$?; \
  \"$PY\" -m bppsa doctor --device $DEVICE --json > $LOG/doctor.json; exit \$rc"

# data: the prepared folder (scripts/gpu_data.sh, run beforehand and carried), or made here by the same script
if [ -z "${DATA:-}" ] && [ -f .gpu-data/T30000.npz ] && [ -f .gpu-data/mfcc_l.npz ]; then DATA=.gpu-data; fi
DATA=${DATA:-$RES/check/data}
if [ ! -f "$DATA/T30000.npz" ] || [ ! -f "$DATA/mfcc_l.npz" ]; then
  ONLY='' step data 120 env PYTHON="$PY" bash scripts/gpu_data.sh "$DATA"
fi

# a loss on every step of bppsa.nn on cupy-factored (T = 37) against torch.nn's gradients (fp32: the warp down kernel
# of both cells; fp64 the GRU's shared-memory one)
PER_STEP='import sys, torch, bppsa.nn as bnn
cell, dev, dt = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)
ref = (torch.nn.RNN if cell == "rnn" else torch.nn.GRU)(12, 20, dtype=dt).to(dev)
got = (bnn.RNN if cell == "rnn" else bnn.GRU).from_torch(ref, backend="cupy-factored")
x = torch.randn(37, 3, 12, dtype=dt, device=dev)
w = torch.randn(37, 3, 20, dtype=dt, device=dev)
for m in (ref, got):
    (m(x)[0] * w).sum().backward()
err = max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item() for a, b in zip(got.parameters(), ref.parameters()))
print(f"per-step gradients, {cell}, {dt}, cupy-factored against torch.nn: max rel err {err:.2e}")
sys.exit(0 if err <= (1e-10 if dt == torch.float64 else 1e-4) else 1)'

# the sanitizer runs beside the tests (neither is timed)
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
pids=()
if [ "$SANITIZER" != skip ] && [ -x "$SANITIZER" ]; then
  sanitize() {  # NAME TOOL CMD...
    local name=$1 tool=$2
    shift 2
    step "sanitizer_$name" 180 "$SANITIZER" --tool "$tool" --error-exitcode 1 --log-file "$LOG/sanitizer_$name.txt" "$@"
  }
  # a training step (single seed): up, the one-launch middle, the warp down kernel with the sums, the reduction
  for tool in memcheck racecheck synccheck; do
    sanitize "${tool}_rnn" "$tool" "$PY" -m bppsa verify --model rnn --backend cupy-factored --layout fused \
      --device "$DEVICE" --seq-len 300 --batch 5 --dtype float32 &
    pids+=($!)
    sanitize "${tool}_gru" "$tool" "$PY" -m bppsa verify --model gru --backend cupy-factored --layout fused \
      --device "$DEVICE" --seq-len 129 --batch 3 --dtype float32 &
    pids+=($!)
    # a loss on every step: the offsets (the down kernel from zero), the middle kernel's mode 2, the injected c_k
    sanitize "${tool}_per_step_rnn" "$tool" "$PY" -c "$PER_STEP" rnn "$DEVICE" float32 &
    pids+=($!)
    sanitize "${tool}_per_step_gru" "$tool" "$PY" -c "$PER_STEP" gru "$DEVICE" float32 &
    pids+=($!)
  done
  sanitize memcheck_gru_fp64 memcheck "$PY" -m bppsa verify --model gru --backend cupy-factored --layout fused \
    --device "$DEVICE" --seq-len 129 --batch 2 --dtype float64 &
  pids+=($!)
elif [ -z "$ONLY" ]; then
  printf 'sanitizer\tskipped\t0\n' >> "$LOG/steps.tsv"
fi
step gpu_tests 200 "$PY" -m pytest -m gpu -q -n 6 -p no:cacheprovider -o addopts="" --junitxml="$LOG/gpu_tests.xml" \
  tests/test_kernels.py tests/test_factored_kernels.py tests/test_gru.py tests/test_nn.py tests/test_bench_recurrent.py
[ "${#pids[@]}" -eq 0 ] || wait "${pids[@]}"

# the headline shapes graphed: each variant's iteration captured phase by phase in CUDA graphs and replayed (the
# device's time, no host work per launch), BPPSA against cuDNN graphed the same way, its default and its per-step
# algorithm (a capture the per-step algorithm cannot make fails that step alone)
PROTO=(--warmup 3 --min-iters 10 --min-seconds 0.5 --max-iters 200 --max-seconds 5 --threads 0 --results-dir "$RES"
       --device "$DEVICE" --profile gpu-check)
mkdir -p "$RES/rnn/graphed" "$RES/gru/graphed"
GRAPHED=(--graphed --no-nobp "${PROTO[@]}")
grnn() { step "graphed_rnn_T$1_B$2" "$3" "$PY" -m bppsa bench --model rnn --data "$DATA/T$1.npz" --batch "$2" \
  --variants baseline bppsa-fused --packed-baseline "$4" --lr 1e-5 "${GRAPHED[@]}" \
  --out "$RES/rnn/graphed/bench_T$1_B$2.csv"; }
grnn 1000 16 45 on
step graphed_gru_l_B16 45 "$PY" -m bppsa bench --model gru --data "$DATA/mfcc_l.npz" --batch 16 \
  --variants baseline bppsa-fused --packed-baseline on --lr 3e-4 "${GRAPHED[@]}" --out "$RES/gru/graphed/bench_l_B16.csv"
grnn 30000 16 50 off
grnn 1000 256 45 on
step speedups_graphed 20 bash -c "\"$PY\" -m bppsa speedups $RES/rnn/graphed/bench_T*_B*.csv \
  --out $RES/rnn/graphed/speedups.csv; \"$PY\" -m bppsa speedups $RES/gru/graphed/bench_l_B16.csv \
  --out $RES/gru/graphed/speedups.csv; cat $RES/rnn/graphed/speedups.csv $RES/gru/graphed/speedups.csv"
# this turn's layers against cuDNN (issue 51; a first measurement, no aim): bppsa.nn.LSTM (its backward the torch
# twin's dense scan: no CUDA kernel has the LSTM's state yet) against torch.nn.LSTM; the forward split over slices of
# the sequence on CUDA streams (parallel_forward=True) against cuDNN's forward and the layer's serial one
mkdir -p "$RES/layers"
LAYERS=(--device "$DEVICE" --batch 16 --hidden 20 --max-seconds 8)
step layers_lstm_T1000_B16 30 "$PY" scripts/bench_nn.py --layer lstm --seq-len 1000 "${LAYERS[@]}" \
  --out "$RES/layers/lstm_T1000_B16.csv"
for T in 1000 30000; do
  step "sliced_forward_T${T}_B16" 40 "$PY" scripts/bench_nn.py --layer rnn --seq-len "$T" --parallel-forward true false \
    "${LAYERS[@]}" --out "$RES/layers/rnn_forward_T${T}_B16.csv"
done
# JAX's compiled BPTT backward of the same RNN, the rival a user would pick (where JAX is installed; else a note)
step jax_rival 60 "$PY" scripts/jax_rival.py --out "$RES/rnn/jax_rival.csv" --seq-len 1000 30000 --batch 16 \
  --data-dir "$DATA" --min-iters 3 --max-seconds 4
# where one training step's time goes, kernel by kernel
step profile 60 "$PY" scripts/gpu_profile.py "$RES/profile" rnn:1000:16:fused rnn:30000:16:fused gru:1034:16:fused
# the workflow itself on the GPU, minutes-sized: its figures and claims in RESULTS_DIR
SNAKE_SLUG=$(basename "$RES")
step workflow 240 "$PY" -m snakemake --cores all --configfile config/gpu-minutes.yaml \
  --config device_slug="$SNAKE_SLUG" --rerun-incomplete --keep-going
# the host's CPU at its full width: the CPU fast path's scaling to SCALING_THREADS threads (1 .. 16 on a GPU host)
# in a device folder of its own beside the GPU's (the host's CPU), with the figure and the crossover claims.md reads
mkdir -p "$HOST/rnn"
step scaling 60 bash -c "\"$PY\" -m bppsa scaling --model rnn --seq-lens 1000 --batches 16 --device cpu \
  --max-threads \"${SCALING_THREADS:-16}\" --min-iters 5 --max-seconds 1 --out \"$HOST/rnn/scaling.csv\" \
  && \"$PY\" -m bppsa plot cpu_scaling --results \"$(dirname "$RES")\" --input \"$HOST/rnn/scaling.csv\" \
  --out \"$HOST/fig_scaling_rnn.png\" \"$HOST/rnn/scaling_crossover.csv\""
# BPPSA with the sequence split over up to 16 processes on the host's cores (issue 43's figure at the issue's shape):
# the split's backward against the pipeline's per p, their memory per rank, and the ranks' scan by both strategies
# per p, which decides rank_scan's default (ALLGATHER_UP_TO)
# (its figure a step of its own: the timing is written before the memory spawns, so a run cut there still draws)
step workers 120 "$PY" -m bppsa workers --ps 1 2 4 8 16 --seq-len 10000 --batch 16 --hidden 20 --rounds 5 \
  --threads 16 --profile gpu-check --out "$HOST/workers"
step workers_plot 30 bash -c "test -f \"$HOST/workers/time.csv\" && \"$PY\" -m bppsa plot workers \
  --results \"$(dirname "$RES")\" --out \"$HOST/fig_workers.png\""
echo "[gpu_check] done in $(($(date +%s) - T0)) s"
cat "$LOG/steps.tsv"
