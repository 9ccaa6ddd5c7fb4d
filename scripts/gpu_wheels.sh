#!/usr/bin/env bash
# Fetch, on a CPU machine with network, the wheels a GPU node's Python lacks for scripts/gpu_check.sh: Snakemake and
# its dependencies (the workflow step), librosa and its (the GRU's MFCCs), and this package's own, for the node's
# Python and platform (CPython 3.12, manylinux x86_64: the device tool's nvidia-h200 image).  Packages the node's image
# already holds (scripts/gpu_node_packages.txt) are not fetched, so the folder stays small enough to travel with the
# working tree.  gpu_check.sh installs from it with `pip install --no-index --no-deps --find-links`: no GPU minute
# goes to fetching, and nothing on the node is upgraded.
#
# Usage: scripts/gpu_wheels.sh [OUT_DIR]     (default .whl/, ignored by git; the device tool carries it: carry=[".whl"])
# env: PYTHON (the pip to fetch with; default python3), GPU_PYTHON (default 3.12), HAVE (default
#      scripts/gpu_node_packages.txt).
# Writes OUT_DIR/*.whl and OUT_DIR/MANIFEST.txt (name==version per wheel); exits non-zero, naming them, when a
# fetched wheel needs a package that is neither fetched nor on the node (an incomplete set).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GPU_PYTHON=${GPU_PYTHON:-3.12}
HAVE=${HAVE:-scripts/gpu_node_packages.txt}
OUT=${1:-.whl}
[ -f "$HAVE" ] || { echo "gpu_wheels: HAVE=$HAVE not found (the node's package list)" >&2; exit 2; }

# what the GPU run imports beyond the node's image: the package's dependencies (pyproject.toml), with Snakemake at the
# version this checkout is tested with where it is installed here
REQS=$("$PY" - <<'EOF'
import re, tomllib
from importlib import metadata
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
out = []
for d in deps:
    name = re.split(r"[<>=!~\s\[;]", d, 1)[0]
    try:
        out.append(f"{name}=={metadata.version(name)}" if name == "snakemake" else d)
    except metadata.PackageNotFoundError:
        out.append(d)
print("\n".join(out))
EOF
)
echo "[gpu_wheels] for CPython $GPU_PYTHON (manylinux x86_64), beyond the node's image:" $REQS
# shellcheck disable=SC2086
"$PY" scripts/gpu_wheels.py "$OUT" "$HAVE" "$GPU_PYTHON" $REQS
