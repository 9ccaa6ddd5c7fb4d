"""Which hardware measures: a slug used as the results/<device>/ folder name, and its description."""
from __future__ import annotations

import os
import platform
import re

import torch


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def resolve(device: str = "auto") -> torch.device:
    """'auto' -> cuda if available else cpu; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device '{device}' requested but CUDA is not available")
    return dev


def slug(device: str | torch.device = "auto") -> str:
    """'cpu' or the GPU's name, e.g. 'nvidia-h100-80gb-hbm3'."""
    dev = resolve(device) if isinstance(device, str) else device
    if dev.type == "cuda":
        return _slug(torch.cuda.get_device_name(dev))
    return "cpu"


def describe(device: str | torch.device = "auto") -> dict:
    """An environment record for the results folder."""
    dev = resolve(device) if isinstance(device, str) else device
    info = {
        "device_slug": slug(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),  # of this process (Snakemake sets OMP_NUM_THREADS per job)
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(
            gpu_name=props.name,
            gpu_sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
        try:
            import subprocess

            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()
        except Exception:  # noqa: BLE001 - the record is best-effort
            info["driver"] = "unknown"
        try:
            import cupy

            info["cupy"] = cupy.__version__
        except Exception:  # noqa: BLE001
            info["cupy"] = None
    return info
