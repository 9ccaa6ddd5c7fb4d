"""Where the BPPSA backward runs: the torch backend (any device) or CuPy RawKernels (CUDA only).

A backend provides these operations, on torch tensors in the layout of :mod:`bppsa.scan`:

* ``scan(g, J, L_m=None)``: the exclusive scan (a backend may overwrite ``J`` as workspace);
* ``rnn_jacobians_t(h, W_hh, layout, x=None)``, ``gru_jacobians_t(x, h, cell, gates=None)``: the
  transposed Jacobians of a tanh RNN or a GRU in scan order (dense ``[n, B, H, H]``, or a chain kept as
  its factors, which also keeps the inputs ``x`` for the parameter gradients; ``gates()`` gives the
  GRU's recomputed gates to a backend that builds from them);
* ``cell_grads(g, J, L_m, from_scan)``: the cell's parameter gradients, ``from_scan(scan(g, J, L_m))``
  unless the backend accumulates them as it scans;

and a ``workspace`` (:class:`bppsa.scan.Workspace`) into which a model may build Jacobians that
the same step's scan consumes.
"""
from __future__ import annotations

import functools
import warnings

import torch

from . import scan as _scan
from .jacobians import gru as _gru
from .jacobians import recurrent as _rec

BACKENDS = ("auto", "torch", "cupy", "cpu")


class TorchBackend:
    """Batched torch ops on any device; scratch buffers are reused across iterations."""

    name = "torch"

    def __init__(self):
        self.workspace = _scan.Workspace()

    def scan(self, g: torch.Tensor, J: torch.Tensor, L_m: int | None = None) -> torch.Tensor:
        return _scan.blelloch_scan(g, J, L_m, self.workspace)

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x=None) -> torch.Tensor:
        # the Jacobians are consumed by the scan of the same step, so their buffer can be reused
        T, B, H = h.shape
        shape = (_rec.num_jacobians(T, layout), B, H, H)
        return _rec.rnn_jacobians_t(h, W_hh, layout, out=self.workspace.get(("jacobians", layout), shape, h))

    def gru_jacobians_t(self, x: torch.Tensor, h: torch.Tensor, cell, gates=None) -> torch.Tensor:
        g = gates() if gates is not None else _gru.gru_gates(x, h, cell.weight_ih_l0, cell.weight_hh_l0,
                                                             cell.bias_ih_l0, cell.bias_hh_l0)
        T, B, H = h.shape
        return _gru.gru_jacobians_t(g, cell.weight_hh_l0, out=self.workspace.get(("jacobians", "gru"), (T, B, H, H), h))

    def cell_grads(self, g: torch.Tensor, J: torch.Tensor, L_m: int | None, from_scan) -> dict:
        return from_scan(self.scan(g, J, L_m))


_PROBE_KERNEL = ("rnn_jacobians.cu", "bppsa_rnn_jacobians_fused_f32")


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
    from . import kernels

    try:
        cp = kernels._import_cupy()
    except RuntimeError as exc:
        return False, str(exc)
    try:
        with cp.cuda.Device(index):
            kernels._kernel(*_PROBE_KERNEL)
    except Exception as exc:  # noqa: BLE001 - NVRTC, driver and loader errors all mean "unusable"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return False, (f"CuPy {cp.__version__} could not compile and load the kernels on cuda:{index}: "
                       f"{type(exc).__name__}: {first}")
    return True, f"CuPy {cp.__version__} compiled and loaded the kernels on cuda:{index}"


def _cpu_backend(device, fallback_reason: bool = False):
    """The CPU fast path (bppsa.kernels.cpu); the torch backend, with a warning saying why, where it cannot load
    (``fallback_reason``: also where its compiled kernel cannot be built, what ``auto`` asks)."""
    if device is not None and torch.device(device).type != "cpu":
        raise RuntimeError(f"backend 'cpu' runs on CPU tensors only (device {device}); use --device cpu")
    try:
        from .kernels import native
        from .kernels.cpu import CpuBackend
    except Exception as e:  # noqa: BLE001 - any failure to load means "use the reference"
        warnings.warn(f"backend 'cpu' unavailable ({type(e).__name__}: {e}); using the torch backend", stacklevel=3)
        return TorchBackend()
    why = native.unavailable_reason() if fallback_reason else None
    if why is not None:
        warnings.warn(f"backend 'auto' uses torch: the CPU fast path's compiled kernel is unavailable ({why}); "
                      "`bppsa doctor` says how to fix it", RuntimeWarning, stacklevel=3)
        return TorchBackend()
    return CpuBackend()


def get_backend(name: str = "auto", device: torch.device | None = None):
    """Resolve a backend name. 'auto' is cupy on a CUDA device where the kernels compile and load
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
            name = "cupy"
        else:
            warnings.warn(f"backend 'auto' uses torch: {why}", RuntimeWarning, stacklevel=2)
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        return _cpu_backend(device)
    ok, why = cupy_probe(device if on_cuda else None)
    if not ok:
        raise RuntimeError(f"backend 'cupy' is unusable: {why}")
    if device is not None and not on_cuda:
        raise RuntimeError("backend 'cupy' runs on CUDA tensors only; use --device cuda")
    if device is not None and torch.device(device).index is not None:
        # CuPy launches on the current device, so make the requested one current
        torch.cuda.set_device(device)
    from .kernels import CupyBackend

    return CupyBackend()
