"""Where the BPPSA backward runs: the torch backend (any device), the CPU fast path, or CuPy RawKernels (CUDA).

Every backend is a :class:`Backend` (:mod:`.base`: the methods the models call, and :func:`check_operands`,
the one check of a scan's operands they all make):

* ``torch``: :class:`TorchBackend` (:mod:`.twin`), the reference twin the others are held to;
* ``cpu``: :class:`bppsa.backends.cpu.CpuBackend`, the factored chains and the compiled kernel;
* ``cupy``: :class:`bppsa.backends.cuda.CupyBackend`, the scan and the RNN's Jacobians as CUDA kernels (the
  paper's method: every per-step Jacobian stored);
* ``cupy-factored``: :class:`bppsa.backends.cuda.CupyFactoredBackend`, the recurrent chains kept as their factors
  and scanned in chunks by CUDA kernels (``factored.cu``), no per-step Jacobian stored.

:func:`get_backend` resolves a name; the CPU and CUDA packages are imported only when asked for (they
import :mod:`.base` and :mod:`.twin`, never this module).
"""
from __future__ import annotations

import functools
import warnings

import torch

from .base import Backend, check_operands
from .twin import TorchBackend

__all__ = ["BACKENDS", "CUPY_BACKENDS", "Backend", "TorchBackend", "check_operands", "cupy_probe", "get_backend"]

BACKENDS = ("auto", "torch", "cupy", "cupy-factored", "cpu")
CUPY_BACKENDS = ("cupy", "cupy-factored")


# one kernel of the faithful path and one of the factored path: auto picks the factored one only where both load
_PROBE_KERNELS = (("rnn_jacobians.cu", "bppsa_rnn_jacobians_fused_f32"), ("factored.cu", "bppsa_factored_down_rnn_f32"),
                  ("factored_up.cu", "bppsa_factored_up_rnn_f32"), ("factored_warp.cu", "bppsa_factored_middle_f32"))


def cupy_probe(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether the CuPy backend can run on ``device`` (default: the current CUDA device), and why not.

    Importing CuPy is not enough: it imports where the kernels cannot compile (no NVRTC) or load
    (driver too old for the cubin).  So this compiles and fetches one kernel, once per device."""
    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else f" (torch {torch.__version__} is a CPU build)"
        return False, "torch sees no CUDA GPU" + build
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return False, f"the CuPy backend runs on CUDA devices only, not {dev}"
    return _probe_cuda(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.cache
def _probe_cuda(index: int) -> tuple[bool, str]:
    from .cuda import runtime

    try:
        cp = runtime.import_cupy()
    except RuntimeError as exc:
        return False, str(exc)
    try:
        with cp.cuda.Device(index):
            for source, kernel in _PROBE_KERNELS:
                consts = runtime.reference_constants(source)  # factored_up.cu, factored_warp.cu: at H = 20
                runtime.kernel(source, kernel, index, *((consts,) if consts else ()))
    except Exception as exc:  # noqa: BLE001 - NVRTC, driver and loader errors all mean "unusable"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return False, (f"CuPy {cp.__version__} could not compile and load the kernels on cuda:{index}: "
                       f"{type(exc).__name__}: {first}")
    return True, f"CuPy {cp.__version__} compiled and loaded the kernels on cuda:{index}"


def _cpu_backend(device, fallback_reason: bool = False):
    """The CPU fast path (bppsa.backends.cpu); the torch backend, with a warning saying why, where it cannot load
    (``fallback_reason``: also where its compiled kernel cannot be built, what ``auto`` asks)."""
    if device is not None and torch.device(device).type != "cpu":
        raise RuntimeError(f"backend 'cpu' runs on CPU tensors only (device {device}); use --device cpu")
    try:
        from .cpu import CpuBackend, native
    except Exception as e:  # noqa: BLE001 - any failure to load means "use the reference"
        warnings.warn(f"backend 'cpu' unavailable ({type(e).__name__}: {e}); using the torch backend", stacklevel=3)
        return TorchBackend()
    why = native.unavailable_reason() if fallback_reason else None
    if why is not None:
        warnings.warn(f"backend 'auto' uses torch: the CPU fast path's compiled kernel is unavailable ({why}); "
                      "`bppsa doctor` says how to fix it", RuntimeWarning, stacklevel=3)
        return TorchBackend()
    return CpuBackend()


def get_backend(name: str = "auto", device: torch.device | None = None) -> Backend:
    """Resolve a backend name. 'auto' is cupy-factored (the factored chains; dense Jacobians and the paper layout
    go to the faithful kernels of 'cupy') on a CUDA device where the kernels compile and load
    (:func:`cupy_probe`), else torch, with a warning that says why; on a CPU (or no device given) it is
    the CPU fast path where its compiled kernel builds, else torch, with a warning that says why."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend '{name}' (choose from {', '.join(BACKENDS)})")
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if name == "auto" and not on_cuda:
        return _cpu_backend(device, fallback_reason=True)
    if name == "auto":
        name = "torch"
        ok, why = cupy_probe(device)
        if ok:
            name = "cupy-factored"
        else:
            warnings.warn(f"backend 'auto' uses torch: {why}", RuntimeWarning, stacklevel=2)
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        return _cpu_backend(device)
    ok, why = cupy_probe(device if on_cuda else None)
    if not ok:
        raise RuntimeError(f"backend '{name}' is unusable: {why}")
    if device is not None and not on_cuda:
        raise RuntimeError(f"backend '{name}' runs on CUDA tensors only; use --device cuda")
    if device is not None and torch.device(device).index is not None:
        # CuPy launches on the current device, so make the requested one current
        torch.cuda.set_device(device)
    from .cuda import CupyBackend, CupyFactoredBackend

    return CupyFactoredBackend() if name == "cupy-factored" else CupyBackend()
