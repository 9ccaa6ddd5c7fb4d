#!/usr/bin/env bash
# The data scripts/gpu_check.sh reads (DATA): the bitstreams T1000.npz and T30000.npz (512 samples each) and the GRU's
# MFCC set L (mfcc_l.npz, from 220 clips of the synthetic IRMAS stand-in, whose audio is deleted once extracted).
# Made on a CPU machine beforehand, they travel with the working tree (the device tool: carry=[".gpu-data"]; 13 MiB),
# so no GPU minute goes to them; gpu_check.sh runs this script itself where DATA holds none.
# Usage: scripts/gpu_data.sh [OUT_DIR]   (default .gpu-data/, ignored by git)   env: PYTHON (default python3),
#        THREADS (default 8)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-.gpu-data}
THREADS=${THREADS:-8}
mkdir -p "$OUT"
for T in 1000 30000; do
  "$PY" -m bppsa make-bitstream --seq-len "$T" --samples 512 --out "$OUT/T$T.npz"
done
AUDIO=$(mktemp -d "$OUT/irmas.XXXXXX")
trap 'rm -rf "$AUDIO"' EXIT
"$PY" -m bppsa make-irmas --source synthetic --root "$AUDIO" --clips 220 --threads "$THREADS" --out "$AUDIO/irmas.json"
"$PY" -m bppsa mfcc --corpus "$AUDIO/irmas.json" --set l --threads "$THREADS" --out "$OUT/mfcc_l.npz"
echo "[gpu_data] $(du -sh "$OUT" | cut -f1) in $OUT: $(cd "$OUT" && echo *)"
