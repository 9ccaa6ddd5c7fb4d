"""The `.test` configuration end to end through a real SLURM (slurm-wlm on localhost, one fake GPU).

Marked `slurm` and deselected by default: it brings up slurmctld/slurmd/munge with
scripts/slurm-localhost.sh (root, apt-get) and takes minutes. Run it with
`python -m pytest -m slurm -s tests/test_slurm.py`.
"""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLUG = "localhost-slurm"
# rules that run on the measuring device ask for a GPU; the others must not
GPU_RULES = {"environment_record", "rnn_bench", "rnn_train", "rnn_train_in_dtype", "gru_bench", "gru_train",
             "vgg11_train", "lenet5_curves"}
TIMING_RULES = {"rnn_bench", "gru_bench", "rnn_train", "rnn_train_in_dtype", "gru_train", "cpu_speed", "table1_bench",
                "bitstream_bench", "cpu_roofline", "cpu_scaling", "workers_bench", "lbi_ranks"}
# the downloads and the GPU cost model (seconds of arithmetic, no device) run on the submitting host
LOCAL_RULES = {"all", "irmas_make", "cifar10_make", "gpu_model"}
# CPU benchmarks are targets only when the folder is the CPU's (`cpu`); this run's slug is not
CPU_FOLDER_RULES = {"cpu_speed", "cpu_roofline", "cpu_scaling"}


@pytest.fixture
def localhost_slurm():
    """The one-node cluster up; stopped afterwards (munged too) where this test started it."""
    script = str(ROOT / "scripts" / "slurm-localhost.sh")
    was_up = subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode == 0
    try:
        up = subprocess.run(["bash", script], capture_output=True, text=True, timeout=900)
        assert up.returncode == 0, up.stdout + up.stderr
        yield
    finally:
        if not was_up:
            subprocess.run(["bash", script, "stop"], capture_output=True, timeout=60)


@pytest.mark.slurm
def test_test_config_through_slurm(tmp_path, localhost_slurm):
    cmd = [sys.executable, "-m", "snakemake", "--profile", "profiles/slurm",
           "--configfile", ".test/config/config.yaml", "--directory", str(tmp_path),
           # site settings of this one-node cluster: no accounting database, so no account and squeue
           "--slurm-no-account", "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "5",
           "--slurm-keep-successful-logs",
           "--config", f"device_slug={SLUG}", "--verbose"]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=5400)
    wall = time.time() - t0
    out = r.stdout + r.stderr
    (tmp_path / "snakemake.out").write_text(out)
    assert r.returncode == 0, out[-6000:]
    print(f"\n[slurm] {' '.join(cmd[1:])}\n[slurm] wall {wall:.0f} s")
    check_slurm_run(tmp_path, out)


def check_slurm_run(tmp_path, out):
    """What a finished run through SLURM must show (separate, so a kept run can be re-checked)."""
    total = int(re.search(r"^total\s+(\d+)", out, re.M).group(1))
    calls = re.findall(r"sbatch call: (sbatch .*)", out)
    by_rule = {}
    for call in calls:
        rule = re.search(r"--comment '?rule_([a-z0-9_]+?)(?:_wildcards_[^ ']*)?'? ", call).group(1)
        by_rule.setdefault(rule, []).append(call)
    print(f"[slurm] {total} jobs, {len(calls)} submitted with sbatch")
    # every job but the local ones went through sbatch, and each left a SLURM log
    n_local = sum(len(re.findall(rf"^localrule {r}:", out, re.M)) for r in LOCAL_RULES)
    assert len(calls) == total - n_local, (len(calls), total, n_local)
    assert n_local == len(LOCAL_RULES) and not set(by_rule) & LOCAL_RULES  # no local rule went through sbatch
    logs = list((tmp_path / ".snakemake" / "slurm_logs").rglob("*.log"))
    assert len(logs) == len(calls)
    # the CPU benchmarks are only targets in a folder named `cpu`
    assert set(by_rule) >= GPU_RULES | (TIMING_RULES - CPU_FOLDER_RULES) | {"rnn_plot", "report_render"}
    for rule, rule_calls in by_rule.items():
        for call in rule_calls:
            assert ("--gpus=1" in call) == (rule in GPU_RULES), call
            assert ("--exclusive" in call) == (rule in TIMING_RULES), call
            assert "--mem " in call and " -t " in call and "--cpus-per-" in call, call

    # the environment job ran under SLURM with the fake GPU allocated, and recorded it
    env = json.loads((tmp_path / "results" / SLUG / "environment.json").read_text())
    assert env["scheduler"]["slurm_job_id"] and env["scheduler"]["cuda_visible_devices"] == "0"
    assert env["folder_slug"] == SLUG and env["hardware"]["kind"] == "cpu"
    assert json.loads((tmp_path / "results" / SLUG / "hardware.json").read_text()) == env["hardware"]

    figures = ["fig_7.png", *[f"fig_8_{p}.png" for p in "abcdef"], "fig_9.png", "fig_13.png", "fig_10.png"]
    for name in figures:
        png = tmp_path / "results" / name
        assert png.read_bytes()[:4] == b"\x89PNG", name
    assert (tmp_path / "results" / "report.md").stat().st_size > 0
    assert (tmp_path / "results" / "table_1_last_column.txt").stat().st_size > 0

    # BPPSA across processes ran as two srun tasks in one job, one rank each (.test: workers.ps [1, 2])
    (call,) = by_rule["workers_bench"]
    assert "--ntasks=2" in call, call
    import pandas as pd

    t = pd.read_csv(tmp_path / "results" / SLUG / "workers" / "time.csv")
    assert set(t["launcher"]) == {"srun"} and set(t[t["p"] == 2]["rank"]) == {0, 1}
    assert (tmp_path / "results" / "fig_workers.png").read_bytes()[:4] == b"\x89PNG"
