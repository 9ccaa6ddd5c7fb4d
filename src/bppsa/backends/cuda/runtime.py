"""The CuPy runtime glue: compile the ``.cu`` sources beside this file with NVRTC (through
:class:`cupy.RawModule`, once per process and device), and launch them on torch's current stream.

Tensors cross from torch to CuPy through DLPack (no copies) and every kernel is launched on
torch's current stream (``cupy.cuda.Stream.from_external``, CuPy >= 14; ``ExternalStream`` before),
so torch's ordering and CUDA-event timing see the kernels like any other torch op.  CuPy is
imported lazily (:func:`import_cupy`): importing this module never needs it.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from .plan import Launch

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("blelloch.cu", "rnn_jacobians.cu", "factored.cu")
NVRTC_OPTIONS = ("-std=c++17",)
# What CuPy (14.x, NVRTC backend, no jitify) adds to every RawModule compile, in its order:
# after our options '-ftz=true', then '-arch=sm_XX' (the device's), then this.  The NVRTC tests
# compile with exactly these, so what CI checks is what a GPU run compiles.
CUPY_APPENDED_OPTIONS = ("-ftz=true", "-arch=sm_{arch}", "--device-as-default-execution-space")
STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def cupy_install_hint() -> str:
    major = (torch.version.cuda or "13").split(".")[0]
    return f"pip install cupy-cuda{major}x (the CuPy of torch's CUDA {major}), or bash scripts/install.sh"


def import_cupy():
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means the backend is unusable
        raise RuntimeError(f"backend 'cupy' needs CuPy ({cupy_install_hint()}): {exc}") from exc
    return cupy


@functools.cache
def _module(source: str):
    cp = import_cupy()
    return cp.RawModule(code=(KERNEL_DIR / source).read_text(), options=NVRTC_OPTIONS)


@functools.cache
def kernel(source: str, name: str):
    return _module(source).get_function(name)


_opted_in: dict[tuple[str, int], int] = {}


def launch(source: str, step: Launch, dtype: torch.dtype, device: torch.device, pointers) -> None:
    """Launch kernel ``step.kernel`` of ``source`` for ``dtype`` on ``device`` (current) with the CuPy arrays
    ``pointers`` and the plan's integers."""
    import numpy as np

    if step.grid > 2**31 - 1:
        raise ValueError(f"{step.kernel}: {step.grid} blocks exceed the CUDA grid limit (2^31 - 1)")
    name = f"{step.kernel}_{SUFFIX[dtype]}"
    fn = kernel(source, name)
    smem = step.smem_elems * dtype.itemsize
    key = (name, device.index)
    if smem > STATIC_SMEM_LIMIT and _opted_in.get(key, 0) < smem:
        fn.max_dynamic_shared_size_bytes = smem  # per function and device: set once, grow if needed
        _opted_in[key] = smem
    args = tuple(pointers) + tuple(np.int64(v) for v in step.ints)
    fn((step.grid,), (step.block,), args, shared_mem=smem)


def smem_optin(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)  # torch >= 2.2 or so
    if optin is None:
        try:
            optin = import_cupy().cuda.Device(device.index).attributes["MaxSharedMemoryPerBlockOptin"]
        except Exception:  # noqa: BLE001 - the portable limit is always safe
            optin = STATIC_SMEM_LIMIT
    return int(optin)


def check_cuda(dtype: torch.dtype, *tensors: torch.Tensor) -> torch.device:
    dev = tensors[0].device
    if dev.type != "cuda":
        raise RuntimeError("backend 'cupy' runs on CUDA tensors only; use --device cuda")
    if dtype not in SUFFIX:
        raise ValueError(f"backend 'cupy' supports float32 and float64, got {dtype}")
    for t in tensors:
        if t.device != dev or t.dtype != dtype:
            raise ValueError(f"expected {dtype} tensors on {dev}, got {t.dtype} on {t.device}")
    current = torch.cuda.current_device()
    if dev.index != current:
        # torch's stream handle carries no device, and CuPy launches on the current device
        raise ValueError(f"backend 'cupy': the tensors are on {dev} but the current CUDA device is cuda:{current}; "
                         f"call torch.cuda.set_device({dev.index}) "
                         f"(or use `with torch.cuda.device({dev.index})`) first")
    return dev


_CUDA_STREAM_PER_THREAD = 2  # cudaStreamPerThread


def _cupy_per_thread_default_stream() -> bool:
    try:
        from cupy_backends.cuda import stream as _s  # what CuPy itself resolves "stream 0" to

        return _s.get_default_stream_ptr() == _CUDA_STREAM_PER_THREAD
    except Exception:  # noqa: BLE001 - older/newer CuPy: the switch it reads at import
        return os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "0") == "1"


def _cupy_stream(cp, torch_stream):
    """A CuPy stream that *is* torch's ``torch_stream``."""
    if torch_stream.cuda_stream == 0 and _cupy_per_thread_default_stream():
        raise RuntimeError(
            "backend 'cupy': CuPy uses the per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1), so "
            "torch's default stream (handle 0) would mean another stream to CuPy and the kernels would not be ordered "
            "after torch's work; unset CUPY_CUDA_PER_THREAD_DEFAULT_STREAM or run under `with torch.cuda.stream(s)`")
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy >= 14: the CUDA stream protocol (torch.cuda.Stream.__cuda_stream__)
        return from_external(torch_stream)
    return cp.cuda.ExternalStream(torch_stream.cuda_stream, torch_stream.device.index)


class OnTorchStream:
    """Makes CuPy launch on torch's current stream of ``device`` (and on that device)."""

    def __init__(self, device: torch.device):
        cp = import_cupy()
        self._dev = cp.cuda.Device(device.index)
        self._stream = _cupy_stream(cp, torch.cuda.current_stream(device))

    def __enter__(self):
        self._dev.__enter__()
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        self._dev.__exit__(*exc)
        return False


def as_cupy(t: torch.Tensor):
    # Inside OnTorchStream the consumer stream is torch's own, so the DLPack hand-over needs no
    # cross-stream synchronisation; detach() because tensors that require grad cannot be exported.
    return import_cupy().from_dlpack(t.detach())
