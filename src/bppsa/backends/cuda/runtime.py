"""The CuPy runtime glue: compile the ``.cu`` sources beside this file with NVRTC (through
:class:`cupy.RawModule`, once per process and device), and launch them on torch's current stream.

A launch hands the kernel torch's raw device pointers and the handle of torch's current stream; CuPy
only compiles, loads and launches.  The first GPU run found the DLPack hand-over of the earlier design
costing most of a backward's host time (docs/measurements.md, "Measurements the code cites").  A pointer
costs nothing, and since every kernel runs on the
stream torch allocated its operands on, torch's caching allocator orders their reuse as for any torch
op.  CuPy is imported lazily (:func:`import_cupy`): importing this module never needs it.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .plan import Launch

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("blelloch.cu", "rnn_jacobians.cu", "factored.cu", "factored_up.cu", "factored_warp.cu")
NVRTC_OPTIONS = ("-std=c++17",)
# What CuPy (14.x, NVRTC backend, no jitify) adds to every RawModule compile, in its order:
# after our options '-ftz=true', then '-arch=sm_XX' (the device's), then this.  The NVRTC tests
# compile with exactly these, so what CI checks is what a GPU run compiles.
CUPY_APPENDED_OPTIONS = ("-ftz=true", "-arch=sm_{arch}", "--device-as-default-execution-space")
STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def reference_constants(source: str) -> tuple[tuple[str, int], ...]:
    """The compile-time constants a check compiles ``source`` with where no plan gives them (the NVRTC, SASS and nvcc
    tests, ``bppsa doctor``): ``factored_up.cu`` at the paper's H = 20, ``factored_warp.cu`` at H = 20 and the GRU's
    I = 12."""
    from .plan import up_constants, warp_constants

    return {"factored_up.cu": up_constants(20), "factored_warp.cu": warp_constants(20, 12)}.get(source, ())


def define_options(consts) -> tuple[str, ...]:
    """``-DNAME=value`` per compile-time constant (:attr:`.plan.Launch.consts`)."""
    return tuple(f"-D{name}={int(value)}" for name, value in consts)


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
def _module(source: str, device_index: int, consts: tuple = ()):
    cp = import_cupy()
    return cp.RawModule(code=(KERNEL_DIR / source).read_text(), options=NVRTC_OPTIONS + define_options(consts))


@functools.cache
def kernel(source: str, name: str, device_index: int, consts: tuple = ()):
    """Kernel ``name`` of ``source`` compiled with the constants ``consts`` (one module per source and constants),
    loaded on device ``device_index`` (which must be current)."""
    return _module(source, device_index, consts).get_function(name)


_opted_in: dict[tuple, int] = {}


def launch(source: str, step: Launch, dtype: torch.dtype, device: torch.device, pointers, stream) -> None:
    """Launch kernel ``step.kernel`` of ``source`` for ``dtype`` on ``device`` (current) and ``stream``
    (:func:`stream`) with the device ``pointers`` (:func:`pointer`) and the plan's integers."""
    if step.grid > 2**31 - 1:
        raise ValueError(f"{step.kernel}: {step.grid} blocks exceed the CUDA grid limit (2^31 - 1)")
    name = f"{step.kernel}_{SUFFIX[dtype]}"
    fn = kernel(source, name, device.index, *((step.consts,) if step.consts else ()))
    smem = step.smem_elems * dtype.itemsize
    key = (name, device.index, step.consts)
    if smem > STATIC_SMEM_LIMIT and _opted_in.get(key, 0) < smem:
        fn.max_dynamic_shared_size_bytes = smem  # per function and device: set once, grow if needed
        _opted_in[key] = smem
    args = tuple(pointers) + tuple(np.int64(v) for v in step.ints)
    fn((step.grid,), (step.block,), args, shared_mem=smem, stream=stream)


def smem_optin(device: torch.device) -> int:
    """The most dynamic shared memory a block may opt in to on ``device`` (bytes; asked every backward, so cached)."""
    return _smem_optin(device.index)


@functools.cache
def _smem_optin(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    optin = getattr(props, "shared_memory_per_block_optin", None)  # torch >= 2.2 or so
    if optin is None:
        try:
            optin = import_cupy().cuda.Device(index).attributes["MaxSharedMemoryPerBlockOptin"]
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


class TorchStream:
    """What CuPy's launch reads of a stream: its handle (``ptr``), here torch's."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


def stream(device: torch.device) -> TorchStream:
    """Torch's current stream on ``device``, for :func:`launch`.  Its handle goes to the driver as it is, so the
    kernels are ordered with torch's work on it (the legacy default stream included: handle 0 means that stream to
    the driver whatever CuPy's own default is)."""
    return TorchStream(torch.cuda.current_stream(device).cuda_stream)


def pointer(t: torch.Tensor) -> np.uint64:
    """The device address of ``t``'s first element, as the kernels' 64-bit pointer parameters take it (the kernels
    read every operand densely, so a strided view is refused)."""
    if not t.is_contiguous():
        raise ValueError(f"a kernel operand must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
    return np.uint64(t.data_ptr())
