"""CuPy RawKernel backend: the BPPSA scan and the RNN Jacobian fill as hand-written CUDA kernels.

The CUDA sources beside this file (``blelloch.cu``, ``rnn_jacobians.cu``) are compiled with NVRTC
through :class:`cupy.RawModule` the first time they are needed (CuPy caches the binaries per device
and on disk).  Each kernel has a torch reference twin that tests hold it to:

* ``bppsa_{up_sweep,middle_scan,down_sweep}_{f32,f64}`` -- :func:`bppsa.scan.blelloch_scan`;
* ``bppsa_rnn_jacobians_{paper,fused}_{f32,f64}`` -- :func:`bppsa.jacobians.recurrent.rnn_jacobians_t`.

The launch schedule is computed in pure Python by :func:`scan_plan` from :func:`bppsa.scan.levels`,
and tests hold it, the torch scan and the FLOP analysis to :func:`bppsa.scan.reference_scan`: one
definition of the tree, checked (and the kernels emulated) on a machine without a GPU.

Tensors cross from torch to CuPy through DLPack (no copies) and every kernel is launched on
torch's current stream (``cupy.cuda.Stream.from_external``, CuPy >= 14; ``ExternalStream`` before),
so torch's ordering and CUDA-event timing see the kernels like any other torch op.  CuPy is
imported lazily: importing this module never needs it.

CuPy compiles every RawModule with ``-ftz=true`` appended after our options
(:data:`CUPY_APPENDED_OPTIONS`).  The Jacobian fill therefore uses explicitly non-flushing fp32
instructions, so it matches torch bit for bit on subnormal values too; the scan kernels keep
CuPy's flush-to-zero (an absolute error below 1.2e-38 per operation, far inside their fp32
tolerance against the torch scan).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import scan as _scan
from ..backends import TorchBackend
from ..jacobians.recurrent import num_jacobians

__all__ = ["CupyBackend", "Launch", "scan_plan", "rnn_jacobians_launch", "block_threads", "SOURCES", "KERNEL_DIR"]

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("blelloch.cu", "rnn_jacobians.cu")
NVRTC_OPTIONS = ("-std=c++17",)
# What CuPy (14.x, NVRTC backend, no jitify) adds to every RawModule compile, in its order:
# after our options '-ftz=true', then '-arch=sm_XX' (the device's), then this.  The NVRTC tests
# compile with exactly these, so what CI checks is what a GPU run compiles.
CUPY_APPENDED_OPTIONS = ("-ftz=true", "-arch=sm_{arch}", "--device-as-default-execution-space")
MAX_THREADS = 256       # enough to stage a 64x64 operand in 16 coalesced sweeps
FILL_THREADS = 256
FILL_MAX_BLOCKS = 1 << 16  # the fill kernels are grid-stride; more blocks only add scheduling
STATIC_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: base kernel name (dtype suffix added at launch), 1-D grid and block,
    dynamic shared memory in *elements* of the scan's dtype, and the integer arguments that follow
    the pointer arguments, in the order of the C signature."""

    kernel: str
    grid: int
    block: int
    smem_elems: int
    ints: tuple[int, ...]


def block_threads(H: int) -> int:
    """Threads per scan block: one per output element of an H x H product, whole warps, capped."""
    return min(MAX_THREADS, max(32, -(-H * H // 32) * 32))


def scan_plan(N: int, B: int, H: int, L_m: int | None = None) -> tuple[int, list[Launch]]:
    """The launches of a scan over ``N`` positions: (number of up-sweep levels run, launches).

    Scan kernels all take ``(J, S, P, N, B, H, a, b, c, d)``; for the sweeps ``(a, b, c, d) =
    (first_l, half, step, level)`` and block ``pair * B + b`` handles pair ``pair`` of the level
    (``levels(N)[d].pairs()`` in order, the spine pair first); for the middle scan they are
    ``(size, K, L, 0)`` with one block per batch element.
    """
    lv = _scan.levels(N)
    L = _scan.tree_levels(N, L_m)
    HH = H * H
    threads = block_threads(H)
    ups, downs = [], []
    for level in lv[:L]:
        n_pairs = level.full + (level.tail is not None)
        ints = (N, B, H, level.first_l, level.step // 2, level.step, level.d)
        # Matrix-matrix blocks stage both operands; the spine block's H*H + H fits in the same.
        ups.append(Launch("bppsa_up_sweep", n_pairs * B, threads, 2 * HH, ints))
        downs.append(Launch("bppsa_down_sweep", n_pairs * B, threads, HH + H, ints))
    launches = ups
    size = 1 << L
    K = len(_scan.middle_ends(N, L))  # the blocks of level L the middle scan walks
    if K >= 2:
        launches.append(Launch("bppsa_middle_scan", B, threads, HH + 2 * H, (N, B, H, size, K, L, 0)))
    launches.extend(reversed(downs))
    return L, launches


def rnn_jacobians_launch(T: int, B: int, H: int, layout: str) -> Launch:
    total = num_jacobians(T, layout) * B * H * H
    grid = max(1, min(FILL_MAX_BLOCKS, -(-total // FILL_THREADS)))
    return Launch(f"bppsa_rnn_jacobians_{layout}", grid, FILL_THREADS, 0, (T, B, H))


def cupy_install_hint() -> str:
    major = (torch.version.cuda or "13").split(".")[0]
    return f"pip install cupy-cuda{major}x (the CuPy of torch's CUDA {major}), or bash scripts/install.sh"


def _import_cupy():
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means the backend is unusable
        raise RuntimeError(f"backend 'cupy' needs CuPy ({cupy_install_hint()}): {exc}") from exc
    return cupy


@functools.cache
def _module(source: str):
    cp = _import_cupy()
    return cp.RawModule(code=(KERNEL_DIR / source).read_text(), options=NVRTC_OPTIONS)


@functools.cache
def _kernel(source: str, name: str):
    return _module(source).get_function(name)


_opted_in: dict[tuple[str, int], int] = {}


def _launch(source: str, launch: Launch, dtype: torch.dtype, device: torch.device, pointers) -> None:
    import numpy as np

    if launch.grid > 2**31 - 1:
        raise ValueError(f"{launch.kernel}: {launch.grid} blocks exceed the CUDA grid limit (2^31 - 1)")
    name = f"{launch.kernel}_{_SUFFIX[dtype]}"
    fn = _kernel(source, name)
    smem = launch.smem_elems * dtype.itemsize
    key = (name, device.index)
    if smem > STATIC_SMEM_LIMIT and _opted_in.get(key, 0) < smem:
        fn.max_dynamic_shared_size_bytes = smem  # per function and device: set once, grow if needed
        _opted_in[key] = smem
    args = tuple(pointers) + tuple(np.int64(v) for v in launch.ints)
    fn((launch.grid,), (launch.block,), args, shared_mem=smem)


def max_hidden(dtype: torch.dtype, smem_optin: int) -> int:
    """Largest H whose matrix-matrix block (two H x H operands) fits in ``smem_optin`` bytes."""
    return math.isqrt(smem_optin // (2 * dtype.itemsize))


def _smem_optin(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)  # torch >= 2.2 or so
    if optin is None:
        try:
            optin = _import_cupy().cuda.Device(device.index).attributes["MaxSharedMemoryPerBlockOptin"]
        except Exception:  # noqa: BLE001 - the portable limit is always safe
            optin = STATIC_SMEM_LIMIT
    return int(optin)


def _check_cuda(dtype: torch.dtype, *tensors: torch.Tensor) -> torch.device:
    dev = tensors[0].device
    if dev.type != "cuda":
        raise RuntimeError("backend 'cupy' runs on CUDA tensors only; use --device cuda")
    if dtype not in _SUFFIX:
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


class _OnTorchStream:
    """Makes CuPy launch on torch's current stream of ``device`` (and on that device)."""

    def __init__(self, device: torch.device):
        cp = _import_cupy()
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


def _as_cupy(t: torch.Tensor):
    # Inside _OnTorchStream the consumer stream is torch's own, so the DLPack hand-over needs no
    # cross-stream synchronisation; detach() because tensors that require grad cannot be exported.
    return _import_cupy().from_dlpack(t.detach())


class CupyBackend(TorchBackend):
    """:class:`bppsa.backends.TorchBackend` with the scan and the RNN's Jacobians as CUDA kernels (the
    GRU's Jacobians are built by torch, on the GPU)."""

    name = "cupy"

    def __init__(self):
        _import_cupy()
        super().__init__()

    def scan(self, g: torch.Tensor, J: torch.Tensor, L_m: int | None = None) -> torch.Tensor:
        if g.dim() != 2 or J.dim() != 4 or J.shape[1:3] != g.shape or J.shape[2] != J.shape[3]:
            raise ValueError(f"expected g [B, H] and J [n, B, H, H], got {tuple(g.shape)} and {tuple(J.shape)}")
        n = J.shape[0]
        B, H = g.shape
        if n == 0:
            return g.new_empty((0,) + tuple(g.shape))
        dev = _check_cuda(g.dtype, g, J)
        L, launches = scan_plan(n + 1, B, H, L_m)
        optin = _smem_optin(dev)
        need = max(launch.smem_elems for launch in launches) * g.dtype.itemsize
        if need > optin:
            raise ValueError(
                f"backend 'cupy' scans hidden sizes up to H={max_hidden(g.dtype, optin)} for {g.dtype} on this GPU "
                f"({optin} bytes of shared memory per block; H={H} needs {need}); use backend 'torch'"
            )
        J = J if J.is_contiguous() else J.contiguous()  # a copy is fine: J is workspace anyway
        S = g.new_empty((L + 1, B, H))
        S[0].copy_(g)
        P = g.new_empty((n, B, H))
        with _OnTorchStream(dev):
            ptrs = (_as_cupy(J), _as_cupy(S), _as_cupy(P))
            for launch in launches:
                _launch("blelloch.cu", launch, g.dtype, dev, ptrs)
        return P

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x=None) -> torch.Tensor:
        if h.dim() != 3 or W_hh.shape != (h.shape[2], h.shape[2]):
            raise ValueError(f"expected h [T, B, H] and W_hh [H, H], got {tuple(h.shape)} and {tuple(W_hh.shape)}")
        T, B, H = h.shape
        launch = rnn_jacobians_launch(T, B, H, layout)
        out = h.new_empty((num_jacobians(T, layout), B, H, H))
        if out.numel() == 0:
            return out
        dev = _check_cuda(h.dtype, h, W_hh)
        h = h.detach().contiguous()
        W = W_hh.detach().contiguous()
        with _OnTorchStream(dev):
            _launch("rnn_jacobians.cu", launch, h.dtype, dev, (_as_cupy(h), _as_cupy(W), _as_cupy(out)))
        return out
