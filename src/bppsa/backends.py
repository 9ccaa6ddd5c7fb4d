"""Where the BPPSA backward runs: the torch backend (any device) or CuPy RawKernels (CUDA only).

A backend provides two operations, both on torch tensors in the layout of :mod:`bppsa.scan`:

* ``scan(g, J, L_m=None)``: the exclusive scan (a backend may overwrite ``J`` as workspace);
* ``rnn_jacobians_t(h, W_hh, layout)``: the transposed Jacobians of a tanh RNN in scan order;

and a ``workspace`` (:class:`bppsa.scan.Workspace`) into which a model may build Jacobians that
the same step's scan consumes.
"""
from __future__ import annotations

import warnings

import torch

from . import scan as _scan
from .jacobians import recurrent as _rec

BACKENDS = ("auto", "torch", "cupy", "cpu")


class TorchBackend:
    """Batched torch ops on any device; scratch buffers are reused across iterations."""

    name = "torch"

    def __init__(self):
        self.workspace = _scan.Workspace()

    def scan(self, g: torch.Tensor, J: torch.Tensor, L_m: int | None = None) -> torch.Tensor:
        return _scan.blelloch_scan(g, J, L_m, self.workspace)

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str) -> torch.Tensor:
        # the Jacobians are consumed by the scan of the same step, so their buffer can be reused
        T, B, H = h.shape
        shape = (T if layout == "fused" else 2 * T, B, H, H)
        return _rec.rnn_jacobians_t(h, W_hh, layout, out=self.workspace.get(("jacobians", layout), shape, h))


def cupy_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def _cpu_backend(device):
    """The CPU fast path (bppsa.kernels.cpu); the torch backend, with a warning saying why, where it cannot load."""
    if device is not None and torch.device(device).type != "cpu":
        raise RuntimeError(f"backend 'cpu' runs on CPU tensors only (device {device}); use --device cpu")
    try:
        from .kernels.cpu import CpuBackend
    except Exception as e:  # noqa: BLE001 - any failure to load means "use the reference"
        warnings.warn(f"backend 'cpu' unavailable ({type(e).__name__}: {e}); using the torch backend", stacklevel=3)
        return TorchBackend()
    return CpuBackend()


def get_backend(name: str = "auto", device: torch.device | None = None):
    """Resolve a backend name. 'auto' is cupy on a CUDA device with CuPy installed, else torch."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend '{name}' (choose from {', '.join(BACKENDS)})")
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if name == "auto":
        name = "cupy" if on_cuda and cupy_available() else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        return _cpu_backend(device)
    if not cupy_available():
        raise RuntimeError("backend 'cupy' needs a CUDA GPU and CuPy (pip install cupy-cuda12x)")
    if device is not None and not on_cuda:
        raise RuntimeError("backend 'cupy' runs on CUDA tensors only; use --device cuda")
    from .kernels import CupyBackend

    return CupyBackend()
