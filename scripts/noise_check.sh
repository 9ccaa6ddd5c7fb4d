#!/usr/bin/env bash
# Quiet vs loaded: run the default workflow's RNN and GRU benchmarks twice, the second time with a busy
# pure-Python loop pinned to one core for the whole run, and print both runs' speedups side by side.
# A loaded speedup must agree with the quiet one within 25 % or be flagged noisy (exit 1 otherwise).
#
#   scripts/noise_check.sh [OUT_DIR] [extra snakemake arguments, e.g. --configfile my.yaml]
#
# Each run works in its own folder (OUT_DIR/quiet, OUT_DIR/loaded; default noise_check/) so the
# default results/ and its figures are left alone; data/ is shared through a symbolic link (DATA_DIR=...
# to use another folder, e.g. with a configuration whose datasets differ from the default ones).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(realpath -m "${1:-noise_check}")"
shift || true
CORE="${BUSY_CORE:-$(( $(nproc) > 1 ? 1 : 0 ))}"
DATA_DIR="$(realpath -m "${DATA_DIR:-$ROOT/data}")"
mkdir -p "$OUT" "$DATA_DIR"
BUSY=""
cleanup() { if [ -n "$BUSY" ]; then kill "$BUSY" 2>/dev/null || true; fi; }
trap cleanup EXIT

run() {  # run NAME [snakemake arguments]
  local name=$1 dir="$OUT/$1"
  shift
  mkdir -p "$dir"
  ln -sfn "$DATA_DIR" "$dir/data"
  local t0=$SECONDS
  # targets first: --forcerun and --configfile take several values each
  python -m snakemake rnn_speedups gru_speedups --snakefile "$ROOT/Snakefile" --directory "$dir" --cores all \
    --forcerun rnn_bench gru_bench "$@" >"$dir/snakemake.log" 2>&1 \
    || { echo "snakemake failed; see $dir/snakemake.log" >&2; tail -20 "$dir/snakemake.log" >&2; exit 2; }
  echo "$name run: $(( SECONDS - t0 )) s"
}

shift_args=("$@")
run quiet "${shift_args[@]}"
taskset -c "$CORE" python3 -c "while True: pass" &
BUSY=$!
echo "busy loop: pid $BUSY on core $CORE"
run loaded "${shift_args[@]}"
kill "$BUSY"; BUSY=""

q=(); l=()
for m in rnn gru; do
  q+=("$(ls "$OUT"/quiet/results/*/$m/speedups.csv | head -1)")
  l+=("$(ls "$OUT"/loaded/results/*/$m/speedups.csv | head -1)")
done
bppsa compare-speedups "${q[@]}" --loaded "${l[@]}" | tee "$OUT/comparison.txt"
