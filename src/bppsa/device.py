"""Which hardware measures: a slug used as the results/<device>/ folder name, and its description.

Two guards keep a results folder honest:

* no silent CPU: ``device: auto`` on a machine where an NVIDIA GPU is visible but torch cannot use it
  (a CUDA 13 torch on an older driver, a CPU-only torch, a container started without ``--nv``) is an
  error that says why, never a quiet fallback to measuring the CPU;
* a folder claims one piece of hardware: the first job that writes into ``results/<device>/`` records
  the hardware it saw (``hardware.json``); a later job that sees other hardware fails, so results from
  two machines never mix under one name (Snakemake re-parses the Snakefile in every cluster job and
  container, so the folder name alone proves nothing about where a job ran).
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import torch

# The oldest driver each CUDA major version of torch runs on (NVIDIA's compatibility table).
MIN_DRIVER = {11: 450, 12: 525, 13: 580}
CLAIM_FILE = "hardware.json"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _nvidia_smi(*args: str) -> str | None:
    """stdout of `nvidia-smi ARGS`, or None where there is no working nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def visible_gpus() -> list[str]:
    """GPU names `nvidia-smi -L` lists ('GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)')."""
    out = _nvidia_smi("-L") or ""
    return [m.group(1).strip() for m in re.finditer(r"^GPU \d+: (.+?)(?: \(UUID:.*)?$", out, re.M)]


def _in_container() -> bool:
    return any(os.environ.get(v) for v in ("APPTAINER_CONTAINER", "SINGULARITY_CONTAINER", "container")) or any(
        Path(p).exists() for p in ("/.dockerenv", "/run/.containerenv"))


def cuda_unusable_reason() -> str | None:
    """Why torch cannot use a GPU this machine shows, or None when no GPU is visible at all."""
    gpus = visible_gpus()
    if gpus:
        seen = f"nvidia-smi lists {len(gpus)} GPU(s) ({gpus[0]})"
        driver = (_nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader") or "").split("\n")[0].strip()
        built = torch.version.cuda
        if built is None:
            why = f"this torch ({torch.__version__}) is a CPU-only build"
        else:
            need = MIN_DRIVER.get(int(built.split(".")[0]))
            try:
                have = int(driver.split(".")[0])
            except ValueError:
                have = None
            if need and have is not None and have < need:
                why = (f"torch {torch.__version__} is built for CUDA {built}, which needs an NVIDIA driver >= {need}; "
                       f"this machine's driver is {driver}")
            else:
                why = (f"torch {torch.__version__} (CUDA {built}) cannot initialise CUDA with driver "
                       f"{driver or 'unknown'} (see torch.cuda.is_available()'s warning)")
        fix = ("install the torch build that matches the driver (bash scripts/install.sh picks it) or update the "
               "driver")
        return f"{seen}, but {why}. Fix it ({fix}), or set `device: cpu` to measure the CPU on purpose."
    if Path("/dev/nvidiactl").exists() and _in_container():
        return ("this container sees the NVIDIA device files but no driver (no nvidia-smi): it was started without "
                "--nv. Run with `--apptainer-args \"--nv\"` (profiles/slurm does) or set `device: cpu` to measure "
                "the CPU on purpose.")
    return None


def resolve(device: str = "auto") -> torch.device:
    """'auto' -> cuda if usable, cpu if no GPU is visible; an error if one is visible but unusable."""
    if device == "auto":
        if not torch.cuda.is_available():
            reason = cuda_unusable_reason()
            if reason:
                raise RuntimeError(f"device 'auto' would silently measure the CPU: {reason}")
            return torch.device("cpu")
        device = "cuda"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        reason = cuda_unusable_reason() or "no NVIDIA GPU is visible (nvidia-smi lists none)."
        raise RuntimeError(f"device '{device}' requested but CUDA is not available: {reason}")
    if dev.type == "cuda" and dev.index is None:  # "cuda": the current device, by its index
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def slug(device: str | torch.device = "auto") -> str:
    """'cpu' or the GPU's name, e.g. 'nvidia-h100-80gb-hbm3'."""
    dev = resolve(device) if isinstance(device, str) else device
    if dev.type == "cuda":
        return _slug(torch.cuda.get_device_name(dev))
    return "cpu"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(dev: torch.device) -> dict:
    """What a job measures on: the GPU's name, or the CPU's model when it runs on the CPU."""
    if dev.type == "cuda":
        return {"kind": "cuda", "name": torch.cuda.get_device_name(dev)}
    return {"kind": "cpu", "name": _cpu_model()}


def check_claim(folder: str | os.PathLike, dev: torch.device) -> dict:
    """Record the hardware of ``folder`` on first use; fail if this job sees other hardware.

    The record is created with a hard link from a complete temporary file, so two jobs starting at
    once cannot both claim the folder or read a half-written record.
    """
    folder = Path(folder)
    seen = hardware(dev)
    claim = folder / CLAIM_FILE
    if not claim.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{CLAIM_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(seen, indent=2, sort_keys=True) + "\n")
        try:
            os.link(tmp, claim)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    claimed = json.loads(claim.read_text())
    if claimed != seen:
        def what(h):
            return f"the GPU {h['name']}" if h.get("kind") == "cuda" else f"the CPU ({h.get('name')}) and no GPU"

        raise RuntimeError(
            f"{folder}/ holds results measured on {what(claimed)} ({claim}), but this job sees {what(seen)}. "
            "Run it where that hardware is (on a cluster: a node with it, with --gpus for a GPU), or give this "
            "hardware its own folder with another `device_slug`.")
    return seen


def _scheduler() -> dict:
    """What the batch system gave the job, when there is one (evidence that it ran through it)."""
    keys = ("SLURM_JOB_ID", "SLURM_JOB_PARTITION", "SLURM_JOB_NODELIST", "SLURM_CPUS_PER_TASK", "SLURM_JOB_GPUS",
            "CUDA_VISIBLE_DEVICES", "APPTAINER_CONTAINER", "SINGULARITY_CONTAINER")
    return {k.lower(): os.environ[k] for k in keys if k in os.environ}


def describe(device: str | torch.device = "auto") -> dict:
    """An environment record for the results folder."""
    dev = resolve(device) if isinstance(device, str) else device
    info = {
        "device_slug": slug(dev),
        "hardware": hardware(dev),
        "hostname": platform.node(),
        "in_container": _in_container(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),  # of this process (Snakemake sets OMP_NUM_THREADS per job)
    }
    sched = _scheduler()
    if sched:
        info["scheduler"] = sched
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(
            gpu_name=props.name,
            gpu_sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
        driver = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader") or "unknown"
        info["driver"] = driver.split("\n")[0].strip()
        try:
            import cupy

            info["cupy"] = cupy.__version__
        except Exception:  # noqa: BLE001
            info["cupy"] = None
    return info


def default_threads() -> int:
    """All the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
