"""GPU-only: how close the scan backward comes to the memory-traffic bound (``bppsa bench-membound``).

The scan of each backend is timed with CUDA events and compared with the time the bytes it must
move would take at the GPU's device-to-device copy bandwidth.  A ratio near 1 means the scan is
memory-traffic bound and the kernels leave little on the table; a large ratio means launch latency,
the serial depth of the tree, or compute dominates.
"""
from __future__ import annotations

import statistics
import sys

import torch

from .. import device as _device
from ..jacobians.recurrent import num_jacobians
from .timing import PhaseTimer


def scan_bytes(n: int, B: int, H: int, itemsize: int, L_m: int | None = None) -> int:
    """Bytes a scan over ``n`` Jacobians must read and write, from the launch schedule.

    Counted per ◇ operation and batch element, as logical traffic of global memory: an up-sweep
    product reads its two operands and writes one (matrix-vector on the spine, matrix-matrix off
    it); a down-sweep product reads a matrix and a vector and writes two vectors; the spine's
    down-sweep step copies one vector; a middle (linear) step reads a matrix and a vector and
    writes a vector.  The Jacobian fill is not included (see :func:`jacobian_fill_bytes`).
    """
    from ..backends.cuda.plan import scan_plan

    if n == 0:
        return 0
    return sum(launch.moved for launch in scan_plan(n + 1, B, H, L_m)[1]) * itemsize


def jacobian_fill_bytes(T: int, B: int, H: int, itemsize: int, layout: str) -> int:
    """Bytes the Jacobian fill writes: every element of the ``[n, B, H, H]`` array."""
    return num_jacobians(T, layout) * B * H * H * itemsize


def copy_bandwidth_GBps(dev: torch.device, nbytes: int = 1 << 28, reps: int = 20) -> float:
    """Best device-to-device copy bandwidth over ``reps`` copies (read + write bytes per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = cuda_seconds(lambda: dst.copy_(src), reps, dev)
    return 2 * nbytes / min(times) / 1e9


def cuda_seconds(fn, reps: int, dev: torch.device, setup=None) -> list[float]:
    """Seconds per call of ``fn`` (CUDA events on the current stream, :class:`PhaseTimer`); ``setup()``
    runs untimed before each call and its result is ``fn``'s argument."""
    timer, out = PhaseTimer(dev), []
    for _ in range(reps):
        arg = setup() if setup is not None else None
        with timer.phase("call"):
            fn() if setup is None else fn(arg)
        out.append(timer.collect()["call"])
    return out


def _backends(names: list[str], dev: torch.device):
    from ..backends import get_backend

    for name in names:
        try:
            yield get_backend(name, dev)
        except RuntimeError as exc:
            print(f"bench-membound: skipping backend '{name}': {exc}", file=sys.stderr)


def rnn_operands(T: int, B: int, H: int, dtype: torch.dtype, dev: torch.device, seed: int):
    """h, W_hh and g of a real tanh RNN state sequence, so magnitudes (and any denormal slow paths)
    are those of training, not of arbitrary random matrices."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    h = torch.tanh(torch.randn(T, B, H, device=dev, dtype=dtype, generator=gen))
    W = torch.randn(H, H, device=dev, dtype=dtype, generator=gen) / H ** 0.5
    g = torch.randn(B, H, device=dev, dtype=dtype, generator=gen)
    return h, W, g


def _mean_std(ts: list[float]) -> tuple[float, float]:
    return statistics.fmean(ts), (statistics.stdev(ts) if len(ts) > 1 else 0.0)


def measure(dev: torch.device, backends: list[str], T: int, B: int, H: int, dtype: torch.dtype, layout: str,
            L_m: int | None, iters: int, warmup: int, seed: int) -> list[dict]:
    """One row per backend that runs here: the scan's and the Jacobian fill's time against the bound."""
    from ..backends.twin import TorchBackend

    h, W, g = rnn_operands(T, B, H, dtype, dev, seed)
    J = TorchBackend().rnn_jacobians_t(h, W, layout).contiguous()
    n, itemsize = J.shape[0], J.dtype.itemsize
    bw = copy_bandwidth_GBps(dev)
    moved = scan_bytes(n, B, H, itemsize, L_m)
    rows = []
    for be in _backends(backends, dev):
        def scan(Jw, be=be):
            be.scan(g, Jw, L_m)

        def fill(be=be):
            be.rnn_jacobians_t(h, W, layout)

        cuda_seconds(scan, warmup, dev, setup=J.clone)  # the scan overwrites J: a fresh copy each, untimed
        scan_mean, scan_std = _mean_std(cuda_seconds(scan, iters, dev, setup=J.clone))
        cuda_seconds(fill, warmup, dev)
        fill_mean, fill_std = _mean_std(cuda_seconds(fill, iters, dev))
        rows.append({
            "device": _device.slug(dev), "backend": be.name, "dtype": str(dtype).removeprefix("torch."),
            "layout": layout, "seq_len": T, "batch": B, "hidden": H, "L_m": "" if L_m is None else L_m,
            "n_jacobians": n, "scan_seconds_mean": scan_mean, "scan_seconds_std": scan_std, "n": iters,
            "bytes_moved": moved, "achieved_GBps": moved / scan_mean / 1e9, "copy_bandwidth_GBps": bw,
            "bound_seconds": moved / (bw * 1e9), "ratio_to_bound": scan_mean / (moved / (bw * 1e9)),
            "jacobian_fill_bytes": jacobian_fill_bytes(T, B, H, itemsize, layout),
            "jacobian_seconds_mean": fill_mean, "jacobian_seconds_std": fill_std,
        })
    if not rows:
        raise RuntimeError("no backend could run")
    return rows
