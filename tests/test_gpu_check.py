"""scripts/gpu_check.sh, the prepared GPU run (issue 41): every step is listed with its outcome, and what no longer fits
before the deadline is skipped rather than started (its GPU steps themselves run only on a GPU machine); the
minutes-sized GPU profile it runs the workflow with (config/gpu-minutes.yaml) passes Snakemake's dry run; the wheel
folder it installs from is what scripts/gpu_wheels.sh fetches."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["install", "machine", "environment", "doctor", "data", "sanitizer", "gpu_tests", "graphed_rnn_T1000_B16",
         "graphed_gru_l_B16", "graphed_rnn_T30000_B16", "graphed_rnn_T1000_B256", "speedups_graphed",
         "layers_lstm_T1000_B16", "sliced_forward_T1000_B16", "sliced_forward_T30000_B16", "jax_rival",
         "profile", "workflow", "scaling", "workers", "workers_plot"]


def test_steps_past_the_deadline_are_skipped_and_listed(tmp_path):
    env = {**os.environ, "DEADLINE": "0", "DEVICE": "cpu", "DATA": str(tmp_path / "data"), "SANITIZER": "skip",
           "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no-wheels")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "res")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.split("\t") for line in (tmp_path / "res" / "check" / "steps.tsv").read_text().splitlines()[1:]]
    assert [name for name, *_ in rows] == STEPS
    outcome = dict((name, rc) for name, rc, _ in rows)
    assert outcome.pop("sanitizer") == "skipped" and outcome.pop("install").startswith("no wheels in")
    assert set(outcome.values()) == {"skipped"}  # nothing was started: no step had time left
    assert "device cpu" in r.stdout


def test_only_reruns_the_named_steps_and_the_archive_holds_both_folders(tmp_path):
    """A second call in the same lease (ONLY) runs just the steps it names, by name or pattern, and adds their rows to
    the first call's steps.tsv; at exit the workflow's outputs this run wrote in results/ are copied into the folder;
    ARCHIVE, the device tool's way back, holds the results folder and the host CPU's without the data."""
    import tarfile

    data = tmp_path / "data"
    data.mkdir()
    for name in ("T1000.npz", "T30000.npz", "mfcc_l.npz"):
        (data / name).write_bytes(b"")
    res = tmp_path / "res"
    env = {**os.environ, "DEVICE": "cpu", "DATA": str(data), "SANITIZER": "skip", "PYTHON": sys.executable,
           "WHEELS": str(tmp_path / "no-wheels")}

    def call(only, archive):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(res)], capture_output=True, text=True,
                           env={**env, "ONLY": only, "ARCHIVE": str(archive)}, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return [line.split("\t")[0] for line in (res / "check" / "steps.tsv").read_text().splitlines()[1:]]

    # a figure the workflow draws in results/ during the run (a later mtime than the run's start; an older file, not)
    drawn, stale = ROOT / "results" / f"fig_test_{os.getpid()}.png", ROOT / "results" / f"old_test_{os.getpid()}.md"
    try:
        drawn.write_bytes(b"png")
        stale.write_text("earlier run")
        os.utime(drawn, (time.time() + 600,) * 2)
        os.utime(stale, (time.time() - 600,) * 2)
        assert call("envir*", tmp_path / "first.tgz") == ["environment"]
    finally:
        drawn.unlink()
        stale.unlink()
    assert (res / "environment.json").is_file()
    assert (res / "workflow" / drawn.name).read_bytes() == b"png" and not (res / "workflow" / stale.name).exists()
    (res / "check" / "data").mkdir()
    (res / "check" / "data" / "T1000.npz").write_bytes(b"x")
    assert call("machine", tmp_path / "second.tgz") == ["environment", "machine"]
    with tarfile.open(tmp_path / "second.tgz") as tar:
        names = set(tar.getnames())
    assert {"res/environment.json", "res/check/steps.tsv", "res/check/machine.log", "res-host-cpu",
            f"res/workflow/{drawn.name}"} <= names
    assert not [n for n in names if "check/data" in n]


def test_the_sanitizers_cover_every_new_kernel_and_the_wheels_install_offline():
    """The script's text: memcheck, racecheck and synccheck each on a single-seed training step and a loss on every step
    of both cells in fp32 (the one-launch middle, the warp down kernels, the gradients' reduction); the install from the
    wheel folder with no index; the workflow on the minutes-sized GPU profile; the scaling to 16 threads and the workers
    to 16 processes."""
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "for tool in memcheck racecheck synccheck; do" in text
    for name in ('"${tool}_rnn"', '"${tool}_gru"', '"${tool}_per_step_rnn"', '"${tool}_per_step_gru"'):
        assert name in text
    assert "pip install -q --no-index --no-deps --find-links" in text
    assert "--configfile config/gpu-minutes.yaml" in text and '${SCALING_THREADS:-16}' in text
    # the scaling lands in the host CPU's own device folder, with the crossover claims.md reads
    assert 'HOST="$RES-host-cpu"' in text and "bppsa plot cpu_scaling" in text and "rnn/scaling_crossover.csv" in text
    # so do the workers, at issue 43's shape, up to 16 processes
    assert "bppsa workers --ps 1 2 4 8 16 --seq-len 10000 --batch 16 --hidden 20" in text
    assert '--out "$HOST/workers"' in text and "bppsa plot workers" in text
    assert (ROOT / ".gitignore").read_text().splitlines().count("/.whl/") == 1  # the default WHEELS folder


def test_gpu_minutes_profile_dry_run(tmp_path):
    """config/gpu-minutes.yaml, merged over the default: Snakemake's dry run plans the GPU benchmarks, the training
    curves, the figures and the report (claims) of both models, on the GPU, from the minutes-sized grids."""
    cfg = yaml.safe_load((ROOT / "config" / "gpu-minutes.yaml").read_text())
    assert cfg["profile"] == "gpu-minutes" and cfg["device"] == "cuda"
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile",
                        str(ROOT / "config" / "gpu-minutes.yaml"), "--config", "device_slug=nvidia-h200",
                        "--directory", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = r.stdout + r.stderr
    jobs = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()
            if len(line.split()) == 2 and line.split()[1].isdigit()}
    # Fig 8: 5 lengths + 2 batches (T = 1000, B = 16 shared) = 6 RNN benchmarks; Fig 9: 2 sets at B = 16
    assert jobs["rnn_bench"] == 6 and jobs["gru_bench"] == 2
    for rule in ("rnn_train", "gru_train", "rnn_plot", "gru_plot", "report_render"):
        assert jobs.get(rule, 0) >= 1, rule
    assert jobs["total"] <= 50
    # the CPU experiments are left to the script's own host steps
    assert not {rule for rule in jobs if rule.startswith(("workers_", "lbi_"))}
    # no job shares the GPU with a measurement: every job on the GPU takes the one `timing` unit
    resources = {}
    for block in out.split("\nrule ")[1:]:
        lines = block.splitlines()
        rule = lines[0].rstrip(":")
        line = next((x for x in lines if x.strip().startswith("resources:")), "")
        resources.setdefault(rule, set()).update(x.strip() for x in line.split(":", 1)[-1].split(","))
    on_gpu = {rule for rule, r in resources.items() if "gpu=1" in r}
    assert {"gru_bench", "vgg11_train", "rnn_bench", "environment_record"} <= on_gpu
    assert all("timing=1" in resources[rule] for rule in on_gpu), {r: resources[r] for r in on_gpu}
    assert "timing=1" not in resources["irmas_mfcc"]  # a CPU job runs beside them


@pytest.mark.skipif(torch.cuda.is_available(), reason="its cases fail for want of a CUDA device")
def test_the_profile_step_fails_when_a_case_fails(tmp_path):
    """scripts/gpu_profile.py runs every case even after one fails, then exits non-zero naming the failed ones, so that
    gpu_check's steps.tsv shows the step failed (on this CPU every case fails: there is no CUDA device)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_profile.py"), str(tmp_path), "rnn:10:2:fused",
                        "gru:10:2:fused"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "2 case(s) failed: rnn:10:2:fused gru:10:2:fused" in r.stdout
