#!/usr/bin/env bash
# Issue 50's measurement of the contributor's loop, for one commit, on a fresh clone in a fresh venv with empty
# caches (kernels, NVRTC, emulator, torch's):
#
#   bash scripts/measure_loop.sh REV OUT_DIR          # e.g. the commit before and the one after, on a quiet machine
#
# Steps, each timed into OUT_DIR/steps.tsv (step, seconds, exit status): the install; the README's test command
# with every test phase logged (OUT_DIR/suite.tsv, summary in suite.md); the second tier where REV has one
# (-m matrix; tier2.tsv, tier2.md); the README's test command again on the now warm caches (suite-warm.*);
# (WARM=0 skips it); `snakemake --cores all` (per rule from Snakemake's log: workflow.md; every output listed in outputs.txt, the
# figures and claims.md copied to OUT_DIR/results/); with WITH_CI=1 also `bash .ci/run` on a second fresh clone and venv.
# The timing tools are this checkout's (scripts/suite_timing.py, scripts/workflow_timing.py), so REV need not have
# them. Say the machine's CPU and load beside the numbers: OUT_DIR/machine.txt records them.
set -uo pipefail
REV=${1:?usage: measure_loop.sh REV OUT_DIR}
OUT=$(realpath -m "${2:?usage: measure_loop.sh REV OUT_DIR}")
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/measure_loop.XXXXXX)
mkdir -p "$OUT/results" "$WORK/tools"
cp "$HERE/scripts/suite_timing.py" "$HERE/scripts/workflow_timing.py" "$WORK/tools/"
: > "$OUT/steps.tsv"
{ date -u; git -C "$HERE" rev-parse "$REV"; lscpu | grep -E "Model name|^CPU\(s\)"; uptime; } > "$OUT/machine.txt"

step() {  # step NAME COMMAND...: run it, append NAME, wall seconds and exit status to steps.tsv
  local name=$1 t0 rc
  shift
  t0=$(date +%s.%N)
  "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '%s\t%.1f\t%s\n' "$name" "$(echo "$(date +%s.%N) - $t0" | bc)" "$rc" | tee -a "$OUT/steps.tsv"
  return 0
}

fresh() {  # fresh DIR: a clone of REV in DIR/clone, a venv in DIR/venv, empty caches under DIR
  git clone -q "$HERE" "$1/clone" && git -C "$1/clone" checkout -q "$REV"
  python3 -m venv "$1/venv"
  export BPPSA_CACHE_DIR="$1/cache" TORCHINDUCTOR_CACHE_DIR="$1/inductor"  # pip keeps its download cache
}

fresh "$WORK/a"
cd "$WORK/a/clone"
# shellcheck disable=SC1091
source "$WORK/a/venv/bin/activate"
step install bash scripts/install.sh
export PYTHONPATH="$WORK/tools"
step suite python -m pytest -q -n auto -p suite_timing --timing-log="$OUT/suite.tsv"
if grep -q '"matrix:' pyproject.toml; then
  step tier2 python -m pytest -q -n auto -m "$(grep -q '"dag:' pyproject.toml && echo "matrix or dag" || echo matrix)" -p suite_timing --timing-log="$OUT/tier2.tsv"
  python "$WORK/tools/suite_timing.py" "$OUT/tier2.tsv" 30 > "$OUT/tier2.md"
fi
if [ "${WARM:-1}" = 1 ]; then
  step suite-warm python -m pytest -q -n auto -p suite_timing --timing-log="$OUT/suite-warm.tsv"
  python "$WORK/tools/suite_timing.py" "$OUT/suite-warm.tsv" 40 > "$OUT/suite-warm.md"
fi
python "$WORK/tools/suite_timing.py" "$OUT/suite.tsv" 40 > "$OUT/suite.md"
unset PYTHONPATH
step workflow snakemake --cores all
python "$WORK/tools/workflow_timing.py" "$(ls -t .snakemake/log/*.snakemake.log | head -1)" > "$OUT/workflow.md"
find results -type f -not -path 'results/reference/*' | sort > "$OUT/outputs.txt"
cp results/*.png results/claims.md results/report.md "$OUT/results/" 2>/dev/null
python "$WORK/tools/workflow_timing.py" --caps results/cpu > "$OUT/caps.md" 2>&1
deactivate

if [ "${WITH_CI:-0}" = 1 ]; then
  fresh "$WORK/b"
  cd "$WORK/b/clone"
  # shellcheck disable=SC1091
  source "$WORK/b/venv/bin/activate"
  step ci env CI=true bash .ci/run
  deactivate
fi
uptime >> "$OUT/machine.txt"
echo "results in $OUT (work tree $WORK; remove it when done)"
