"""CuPy RawKernel backend: the BPPSA scan and the RNN Jacobian fill as hand-written CUDA kernels.

The CUDA sources beside this file (``blelloch.cu``, ``rnn_jacobians.cu``) are compiled with NVRTC
through :class:`cupy.RawModule` the first time they are needed (CuPy caches the binaries per device
and on disk).  Each kernel has a torch reference twin that tests hold it to:

* ``bppsa_{up_sweep,middle_scan,down_sweep}_{f32,f64}`` -- :func:`bppsa.scan.blelloch_scan`;
* ``bppsa_rnn_jacobians_{paper,fused}_{f32,f64}`` -- :func:`bppsa.jacobians.recurrent.rnn_jacobians_t`.

The launch schedule is computed in pure Python by :func:`.plan.scan_plan` from :func:`bppsa.scan.levels`,
and tests hold it, the torch scan and the FLOP analysis to :func:`bppsa.scan.reference_scan`: one
definition of the tree, checked (and the kernels emulated) on a machine without a GPU.

:mod:`.runtime` compiles and launches the kernels on torch's current stream, tensors crossing through
DLPack; CuPy is imported lazily: importing this package never needs it.  :mod:`.nvrtc` compiles the
sources as CuPy would, with no GPU, driver or CuPy (the tests, ``bppsa doctor``).

CuPy compiles every RawModule with ``-ftz=true`` appended after our options
(:data:`.runtime.CUPY_APPENDED_OPTIONS`).  The Jacobian fill therefore uses explicitly non-flushing fp32
instructions, so it matches torch bit for bit on subnormal values too; the scan kernels keep
CuPy's flush-to-zero (an absolute error below 1.2e-38 per operation, far inside their fp32
tolerance against the torch scan).
"""
from __future__ import annotations

import torch

from ...jacobians.recurrent import num_jacobians
from ..base import check_operands
from ..twin import TorchBackend
from . import plan, runtime

__all__ = ["CupyBackend"]


class CupyBackend(TorchBackend):
    """:class:`bppsa.backends.twin.TorchBackend` with the scan and the RNN's Jacobians as CUDA kernels (the
    GRU's Jacobians are built by torch, on the GPU)."""

    name = "cupy"

    def __init__(self):
        runtime.import_cupy()
        super().__init__()

    def scan(self, g: torch.Tensor, J: torch.Tensor, L_m: int | None = None) -> torch.Tensor:
        check_operands(g, J)
        n = J.shape[0]
        B, H = g.shape
        if n == 0:
            return g.new_empty((0,) + tuple(g.shape))
        dev = runtime.check_cuda(g.dtype, g, J)
        L, launches = plan.scan_plan(n + 1, B, H, L_m)
        optin = runtime.smem_optin(dev)
        need = max(launch.smem_elems for launch in launches) * g.dtype.itemsize
        if need > optin:
            raise ValueError(
                f"backend 'cupy' scans hidden sizes up to H={plan.max_hidden(g.dtype, optin)} for {g.dtype} on this "
                f"GPU "
                f"({optin} bytes of shared memory per block; H={H} needs {need}); use backend 'torch'"
            )
        J = J if J.is_contiguous() else J.contiguous()  # a copy is fine: J is workspace anyway
        S = g.new_empty((L + 1, B, H))
        S[0].copy_(g)
        P = g.new_empty((n, B, H))
        with runtime.OnTorchStream(dev):
            ptrs = (runtime.as_cupy(J), runtime.as_cupy(S), runtime.as_cupy(P))
            for launch in launches:
                runtime.launch("blelloch.cu", launch, g.dtype, dev, ptrs)
        return P

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x=None) -> torch.Tensor:
        if h.dim() != 3 or W_hh.shape != (h.shape[2], h.shape[2]):
            raise ValueError(f"expected h [T, B, H] and W_hh [H, H], got {tuple(h.shape)} and {tuple(W_hh.shape)}")
        T, B, H = h.shape
        launch = plan.rnn_jacobians_launch(T, B, H, layout)
        out = h.new_empty((num_jacobians(T, layout), B, H, H))
        if out.numel() == 0:
            return out
        dev = runtime.check_cuda(h.dtype, h, W_hh)
        h = h.detach().contiguous()
        W = W_hh.detach().contiguous()
        with runtime.OnTorchStream(dev):
            ptrs = (runtime.as_cupy(h), runtime.as_cupy(W), runtime.as_cupy(out))
            runtime.launch("rnn_jacobians.cu", launch, h.dtype, dev, ptrs)
        return out
