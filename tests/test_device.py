"""Device identity: no silent CPU, a results folder claims one piece of hardware, and the run stops
before any job when the folder name could not be trusted (cluster, containers)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bppsa import device

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = str(ROOT / ".test" / "config" / "config.yaml")


def fake_nvidia_smi(folder: Path, driver="535.104.05") -> dict:
    """A `nvidia-smi` that lists one H100, first on PATH: a GPU machine whose torch cannot use it."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        '  *-L*) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)";;\n'
        f'  *driver_version*) echo "{driver}";;\n'
        '  *) echo "fake nvidia-smi";;\n'
        "esac\n")
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def _run(args, env=None, cwd=ROOT):
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's torch can use a GPU")


@needs_no_cuda
def test_auto_with_a_visible_gpu_but_no_cuda_torch_stops_and_says_why(tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin")
    r = _run([sys.executable, "-m", "bppsa", "device", "--device", "auto"], env=env)
    assert r.returncode != 0
    assert "NVIDIA H100 80GB HBM3" in r.stderr and "silently measure the CPU" in r.stderr
    expected = "CPU-only build" if torch.version.cuda is None else "driver"
    assert expected in r.stderr and "`device: cpu`" in r.stderr
    # `device: cuda` fails the same way, and `device: cpu` is the way out
    r = _run([sys.executable, "-m", "bppsa", "device", "--device", "cuda"], env=env)
    assert r.returncode != 0 and "NVIDIA H100" in r.stderr
    r = _run([sys.executable, "-m", "bppsa", "device", "--device", "cpu"], env=env)
    assert r.returncode == 0 and r.stdout.strip() == "cpu"


@needs_no_cuda
def test_workflow_with_a_visible_gpu_but_no_cuda_torch_stops_before_any_job(tmp_path):
    env = fake_nvidia_smi(tmp_path / "bin")
    r = _run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", TEST_CONFIG,
              "--directory", str(tmp_path)], env=env)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "config key `device`" in out and "NVIDIA H100" in out, out[-3000:]
    assert not (tmp_path / "results").exists()


def test_driver_too_old_for_torchs_cuda_build_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin", driver="570.86.15")["PATH"])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    reason = device.cuda_unusable_reason()
    assert "built for CUDA 13.0, which needs an NVIDIA driver >= 580" in reason and "570.86.15" in reason


def test_no_gpu_visible_means_cpu_without_complaint(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device.cuda_unusable_reason() is None or Path("/dev/nvidiactl").exists()
    assert device.resolve("auto").type == "cpu"
    with pytest.raises(RuntimeError, match="no NVIDIA GPU is visible"):
        device.resolve("cuda")


def test_a_folder_claims_the_hardware_its_first_job_saw(tmp_path):
    folder = tmp_path / "results" / "my-gpu"
    seen = device.check_claim(folder, torch.device("cpu"))
    assert json.loads((folder / device.CLAIM_FILE).read_text()) == seen
    assert device.check_claim(folder, torch.device("cpu")) == seen  # the same hardware: fine
    (folder / device.CLAIM_FILE).write_text(json.dumps({"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}))
    with pytest.raises(RuntimeError, match=r"measured on the GPU NVIDIA H100 80GB HBM3.*sees the CPU .* and no GPU"):
        device.check_claim(folder, torch.device("cpu"))
    assert not list(folder.glob("*.tmp"))


def test_a_job_on_other_hardware_than_its_folder_claims_fails(tmp_path):
    folder = tmp_path / "results" / "h100"
    folder.mkdir(parents=True)
    (folder / device.CLAIM_FILE).write_text(json.dumps({"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}))
    out = folder / "rnn" / "verify.json"
    r = _run([sys.executable, "-m", "bppsa", "verify", "--model", "rnn", "--seq-len", "3", "--batch", "2",
              "--hidden", "4", "--device", "cpu", "--device-slug", "h100", "--results-dir", str(folder),
              "--out", str(out)])
    assert r.returncode != 0 and "holds results measured on the GPU NVIDIA H100" in r.stderr, r.stderr
    assert not out.exists()


def test_use_singularity_without_an_image_stops_naming_the_key_and_the_build(tmp_path):
    r = _run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--use-singularity",
              "--configfile", TEST_CONFIG, "--directory", str(tmp_path)])
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "config key `container`" in out and "apptainer build" in out, out[-3000:]
    assert "docker/bppsa.def" in out
    assert not (tmp_path / "results").exists() and not (tmp_path / "data").exists()
    # a .sif image that is not there: named, with the command that builds it
    r = _run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--use-singularity",
              "--configfile", TEST_CONFIG, "--directory", str(tmp_path), "--config", "container=bppsa.sif"])
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "names the image bppsa.sif, which is not here" in out, out[-3000:]
    assert "apptainer build" in out
    # an image without a device_slug: the host cannot tell what the containers will see
    (tmp_path / "bppsa.sif").write_bytes(b"")
    r = _run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--use-singularity",
              "--configfile", TEST_CONFIG, "--directory", str(tmp_path), "--config", "container=bppsa.sif"])
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "`device_slug` must be set" in out, out[-3000:]


def test_cluster_run_without_device_slug_stops_before_any_job(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm")
    r = _run([sys.executable, "-m", "snakemake", "--executor", "slurm", "--jobs", "1", "--slurm-no-account",
              "--configfile", TEST_CONFIG, "--directory", str(tmp_path), "--workflow-profile", "none"])
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "config key `device_slug` must be set" in out, out[-3000:]
    assert "sbatch call" not in out and not (tmp_path / "results").exists() and not (tmp_path / "data").exists()
