"""Arguments and setup shared by the commands."""
from __future__ import annotations

import argparse

import torch

from .. import device as _device
from ..precision import DTYPES


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    p.add_argument("--device-slug", default=None, help="device label recorded in the CSV (default: detected)")
    p.add_argument("--results-dir", default=None,
                   help="the device's results folder (results/<device>): the hardware this job sees must match the "
                        "hardware recorded there by the first job (hardware.json); the workflow always passes it")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default="adhoc", help="configuration profile recorded with the results")
    p.add_argument("--keep-denormals", dest="flush_denormal", action="store_false",
                   help="do not flush subnormal floats to zero on CPU (flushing is the default: long Jacobian "
                        "products underflow, and x86 handles subnormals up to ~100x slower, for both methods; the "
                        "compiled CPU scan flushes its own results in either mode)")


def setup(args) -> torch.device:
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    if getattr(args, "flush_denormal", False):
        torch.set_flush_denormal(True)
    dev = _device.resolve(args.device)
    if getattr(args, "results_dir", None):
        _device.check_claim(args.results_dir, dev)
    if getattr(args, "device_slug", None) is None:
        args.device_slug = _device.slug(dev)
    return dev


def optional_int(text: str):
    return None if text.lower() in ("none", "null", "full") else int(text)
