#!/usr/bin/env bash
# Brings up a one-node SLURM "cluster" on this machine (Debian's slurm-wlm): munge, slurmctld and
# slurmd, no accounting database, one fake GPU (a gres backed by /dev/null: jobs that ask for
# --gpus=1 are scheduled and get CUDA_VISIBLE_DEVICES=0, but there is no GPU behind it, so they
# run on the CPU). For tests of the SLURM path (tests/test_slurm.py); never on a real cluster.
# Idempotent: run it again and it only (re)starts what is down. Needs root (apt-get, daemons).
#   bash scripts/slurm-localhost.sh          # bring up, wait for the node to be idle
#   bash scripts/slurm-localhost.sh stop     # stop the daemons (munged too)
set -euo pipefail

CONF=/etc/slurm
running() { [[ -s /run/$1.pid ]] && kill -0 "$(cat /run/$1.pid)" 2>/dev/null; }
stop() {  # by the pid files the daemons write (SlurmdPidFile, SlurmctldPidFile below)
  for d in slurmd slurmctld; do
    if running $d; then kill "$(cat /run/$d.pid)"; fi
  done
}
if [[ "${1:-}" == "stop" ]]; then  # and munged, which the bring-up starts where it is not running
  stop
  m=/run/munge/munged.pid
  if [[ -s $m ]] && kill -0 "$(cat $m)" 2>/dev/null; then kill "$(cat $m)"; fi
  exit 0
fi
[[ $(id -u) == 0 ]] || { echo "slurm-localhost: needs root (apt-get, daemons)" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v sbatch >/dev/null; then
  echo "[slurm] installing slurm-wlm"
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null
fi

# munge authenticates slurmctld <-> slurmd <-> clients
[[ -s /etc/munge/munge.key ]] || mungekey -c
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  su -s /bin/sh munge -c /usr/sbin/munged
  sleep 1
  munge -n | unmunge >/dev/null
fi

host=$(hostname)
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))  # leave 20 % to the OS
mkdir -p "$CONF" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
new=$(mktemp)
cat > "$new" <<CONF
# written by scripts/slurm-localhost.sh
ClusterName=localhost
SlurmctldHost=localhost
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# without accounting, finished jobs are only visible to squeue for MinJobAge seconds, and the
# Snakemake executor asks squeue for their state: keep it well above its polling interval
MinJobAge=300
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
GresTypes=gpu
NodeName=localhost NodeHostname=$host CPUs=$cpus RealMemory=$mem Gres=gpu:1 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
# a gres needs a device file; /dev/null stands in for the GPU that is not there
echo "NodeName=localhost Name=gpu File=/dev/null" > "$CONF/gres.conf.new"
changed=0
cmp -s "$new" "$CONF/slurm.conf" || { mv "$new" "$CONF/slurm.conf"; changed=1; }
cmp -s "$CONF/gres.conf.new" "$CONF/gres.conf" || { mv "$CONF/gres.conf.new" "$CONF/gres.conf"; changed=1; }
rm -f "$new" "$CONF/gres.conf.new"
chmod 644 "$CONF/slurm.conf" "$CONF/gres.conf"

if [[ $changed == 1 ]]; then stop; sleep 1; fi
running slurmctld || /usr/sbin/slurmctld
for _ in $(seq 30); do scontrol ping >/dev/null 2>&1 && break; sleep 1; done
running slurmd || /usr/sbin/slurmd
scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
for _ in $(seq 60); do
  state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
  case "$state" in idle|mixed|allocated) echo "[slurm] node localhost: $state ($cpus CPUs, ${mem} MB, gpu:1 fake)"; exit 0;; esac
  sleep 1
done
echo "[slurm] node did not come up (state: ${state:-unknown}); see /var/log/slurm/" >&2
exit 1
