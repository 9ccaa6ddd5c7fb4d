#!/usr/bin/env bash
# Builds the workflow's image from docker/Dockerfile with podman and runs the `.test` configuration
# through Snakemake's own --use-singularity path, every job in the image. Apptainer is in no registry
# reachable here, so scripts/apptainer-podman STANDS IN for it (it runs `podman run` on the image).
# For tests/test_container.py; needs root (apt-get, podman). Usage:
#   bash scripts/container-test.sh WORKDIR      # results under WORKDIR; timings in WORKDIR/timings.txt
# Environment: BASE (default localhost/debian-py:bookworm, made here with mmdebstrap when missing),
# BPPSA_TORCH_CUDA (default cpu), IMAGE (default localhost/bppsa:test), REBUILD=1 to rebuild (an image
# built from other sources is rebuilt anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=$(realpath -m "${1:?usage: container-test.sh WORKDIR}")
BASE=${BASE:-localhost/debian-py:bookworm}
IMAGE=${IMAGE:-localhost/bppsa:test}
TORCH_CUDA=${BPPSA_TORCH_CUDA:-cpu}
PY=${PYTHON:-python3}
mkdir -p "$WORK"

if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v mmdebstrap >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc mmdebstrap >/dev/null
fi
# VMs without CAP_SYS_RESOURCE and with mixed cgroups v1/v2 need these (podman's defaults fail there)
if [[ ! -e /etc/containers/containers.conf ]]; then
  cat > /etc/containers/containers.conf <<'CONF'
[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
[engine]
cgroup_manager = "cgroupfs"
CONF
fi
if [[ "$BASE" == localhost/debian-py:bookworm ]] && ! podman image exists "$BASE"; then
  echo "[container] making $BASE with mmdebstrap (no image registry is reachable)"
  tmp=$(mktemp -d)
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$tmp/base.tar"
  podman import "$tmp/base.tar" "$BASE"
  rm -rf "$tmp"
fi

# pip inside the build must see what the host's pip sees (configuration, constraints, local wheels)
mounts=()
for p in /etc/pip.conf /etc/xdg/pip "$HOME/.config/pip" "$HOME/.pip" ${PIP_FIND_LINKS:-} /opt/wheels \
         ${PIP_CONSTRAINT:-} /etc/ssl/certs/ca-certificates.crt; do
  [[ -e "$p" ]] && mounts+=(-v "$p:$p:ro")
done
envs=()
for v in PIP_CERT PIP_FIND_LINKS PIP_DEFAULT_TIMEOUT PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT; do
  [[ -n "${!v:-}" ]] && envs+=(--env "$v=${!v}")
done
# The image is reused only if it was built from exactly these sources (a label records their hash):
# an image of older code would run jobs whose command line no longer matches the rules.
SOURCE=$(find pyproject.toml README.md scripts src docker -type f -not -path '*/__pycache__/*' -print0 \
         | sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1)
built_from=$(podman image inspect --format '{{ index .Labels "bppsa.source" }}' "$IMAGE" 2>/dev/null || true)
if [[ "${REBUILD:-0}" == 1 || "$built_from" != "$SOURCE-$TORCH_CUDA" ]]; then
  t0=$(date +%s)
  podman build --runtime runc --network host "${mounts[@]}" "${envs[@]}" --label "bppsa.source=$SOURCE-$TORCH_CUDA" \
    --build-arg BASE="$BASE" --build-arg BPPSA_TORCH_CUDA="$TORCH_CUDA" -f docker/Dockerfile -t "$IMAGE" .
  echo "build_s=$(( $(date +%s) - t0 ))" > "$WORK/timings.txt"
else
  echo "build_s=cached" > "$WORK/timings.txt"
fi
podman run --rm --runtime runc "$IMAGE" python -c \
  "import bppsa, torch; print('[container] image:', '$IMAGE', 'bppsa', bppsa.__version__, 'torch', torch.__version__)"

# Snakemake on the host, every job in the image through the stand-in `apptainer`
bin="$WORK/stand-in-bin"
mkdir -p "$bin"
ln -sf "$REPO/scripts/apptainer-podman" "$bin/apptainer"
export APPTAINER_STANDIN_LOG="$WORK/apptainer-calls.log"
: > "$APPTAINER_STANDIN_LOG"
t0=$(date +%s)
PATH="$bin:$PATH" "$PY" -m snakemake --cores all --use-singularity --configfile .test/config/config.yaml \
  --directory "$WORK/run" --config container="$IMAGE" device_slug=container-cpu 2>&1 | tee "$WORK/snakemake.log"
echo "run_s=$(( $(date +%s) - t0 ))" >> "$WORK/timings.txt"
cat "$WORK/timings.txt"
