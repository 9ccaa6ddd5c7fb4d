"""Full IEEE fp32 on CUDA for exactness checks: no TF32 in cuBLAS matmuls or cuDNN convs and RNNs.

With TF32 (on Ampere and later), an fp32 reference is itself only ~1e-3 accurate, so it cannot
judge BPPSA's 1e-4.  torch >= 2.9 has per-operator ``fp32_precision`` settings, and on torch 2.13
``torch.backends.cudnn.rnn.fp32_precision`` defaults to ``"tf32"``; mixing them with the legacy
``allow_tf32`` flags raises, so only one of the two APIs is used, whichever this torch has.
"""
from __future__ import annotations

import contextlib

import torch

# The dtypes the commands take, and BPPSA's exactness bound against autograd in each (max relative
# error of any parameter's gradient).
DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


def _new_api_targets():
    b = torch.backends
    rnn = getattr(b.cudnn, "rnn", None)
    if rnn is None or not hasattr(rnn, "fp32_precision"):
        return None
    return [b.cuda.matmul, b.cudnn.conv, rnn]


@contextlib.contextmanager
def ieee_fp32():
    targets = _new_api_targets()
    if targets is not None:
        saved = [t.fp32_precision for t in targets]
        try:
            for t in targets:
                t.fp32_precision = "ieee"
            yield
        finally:
            for t, v in zip(targets, saved):
                t.fp32_precision = v
        return
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        saved_mm = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved_mm
