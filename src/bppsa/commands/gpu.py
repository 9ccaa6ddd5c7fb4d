"""GPU-only measurements: how close the scan backward comes to the memory-traffic bound.

``bppsa bench-membound`` times the scan of the BPPSA backward for each backend with CUDA events and
compares it with the time the bytes it must move would take at the GPU's device-to-device copy
bandwidth.  A ratio near 1 means the scan is memory-traffic bound and the kernels leave little on
the table; a large ratio means launch latency, the serial depth of the tree, or compute dominates.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from .. import device as _device
from ..io import write_csv

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def scan_bytes(n: int, B: int, H: int, itemsize: int, L_m: int | None = None) -> int:
    """Bytes a scan over ``n`` Jacobians must read and write, from the launch schedule.

    Counted per ◇ operation and batch element, as logical traffic of global memory: an up-sweep
    product reads its two operands and writes one (matrix-vector on the spine, matrix-matrix off
    it); a down-sweep product reads a matrix and a vector and writes two vectors; the spine's
    down-sweep step copies one vector; a middle (linear) step reads a matrix and a vector and
    writes a vector.  The Jacobian fill is not included (see :func:`jacobian_fill_bytes`).
    """
    from ..kernels import scan_plan

    if n == 0:
        return 0
    HH = H * H
    elems = 0
    for launch in scan_plan(n + 1, B, H, L_m)[1]:
        pairs = launch.grid // B
        if launch.kernel == "bppsa_up_sweep":
            elems += (HH + 2 * H) + (pairs - 1) * 3 * HH
        elif launch.kernel == "bppsa_down_sweep":
            elems += 2 * H + (pairs - 1) * (HH + 3 * H)
        else:  # middle scan: K block ends, the first prefix copied, then K - 2 products
            K = launch.ints[4]
            elems += 2 * H + (K - 2) * (HH + 2 * H)
    return elems * B * itemsize


def jacobian_fill_bytes(T: int, B: int, H: int, itemsize: int, layout: str) -> int:
    """Bytes the Jacobian fill writes: every element of the ``[n, B, H, H]`` array."""
    slots = T if layout == "fused" else 2 * T
    return slots * B * H * H * itemsize


def copy_bandwidth_GBps(dev: torch.device, nbytes: int = 1 << 28, reps: int = 20) -> float:
    """Best device-to-device copy bandwidth over ``reps`` copies (read + write bytes per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = _time_cuda(lambda: dst.copy_(src), reps, dev)
    return 2 * nbytes / min(times) / 1e9


def _time_cuda(fn, reps: int, dev: torch.device, setup=None) -> list[float]:
    """Seconds per call of ``fn`` by CUDA events on the current stream; ``setup`` runs untimed."""
    out = []
    for _ in range(reps):
        arg = setup() if setup is not None else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn() if setup is None else fn(arg)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def _backends(names: list[str], dev: torch.device):
    from ..backends import get_backend

    for name in names:
        try:
            yield get_backend(name, dev)
        except RuntimeError as exc:
            print(f"bench-membound: skipping backend '{name}': {exc}", file=sys.stderr)


def bench_membound(args) -> int:
    import pandas as pd

    from ..backends import TorchBackend

    if not torch.cuda.is_available():
        raise RuntimeError("bench-membound measures GPU memory traffic and needs a CUDA GPU; none is available")
    dev = _device.resolve(args.device)
    if dev.type != "cuda":
        raise RuntimeError(f"bench-membound needs a CUDA device, got '{args.device}'")
    torch.cuda.set_device(dev)
    if args.iters < 1 or min(args.seq_len, args.batch, args.hidden) < 1:
        raise ValueError("--iters, --seq-len, --batch and --hidden must be >= 1")
    dtype = DTYPES[args.dtype]
    T, B, H = args.seq_len, args.batch, args.hidden
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    # Jacobians of a real tanh RNN state sequence, so magnitudes (and any denormal slow paths)
    # are those of training, not of arbitrary random matrices.
    h = torch.tanh(torch.randn(T, B, H, device=dev, dtype=dtype, generator=gen))
    W = torch.randn(H, H, device=dev, dtype=dtype, generator=gen) / H**0.5
    g = torch.randn(B, H, device=dev, dtype=dtype, generator=gen)
    J = TorchBackend().rnn_jacobians_t(h, W, args.layout).contiguous()
    n = J.shape[0]
    itemsize = J.dtype.itemsize
    bw = copy_bandwidth_GBps(dev)
    moved = scan_bytes(n, B, H, itemsize, args.L_m)
    fill = jacobian_fill_bytes(T, B, H, itemsize, args.layout)
    bound = moved / (bw * 1e9)

    rows = []
    for be in _backends(args.backends.split(","), dev):
        def scan(Jw, be=be):
            be.scan(g, Jw, args.L_m)

        def jac(be=be):
            be.rnn_jacobians_t(h, W, args.layout)

        clone = J.clone  # the scan overwrites J, so each repeat gets a fresh copy, untimed
        _time_cuda(scan, args.warmup, dev, setup=clone)
        t_scan = _time_cuda(scan, args.iters, dev, setup=clone)
        _time_cuda(jac, args.warmup, dev)
        t_jac = _time_cuda(jac, args.iters, dev)
        mean = statistics.fmean(t_scan)
        rows.append({
            "device": _device.slug(dev),
            "backend": be.name,
            "dtype": args.dtype,
            "layout": args.layout,
            "seq_len": T,
            "batch": B,
            "hidden": H,
            "L_m": "" if args.L_m is None else args.L_m,
            "n_jacobians": n,
            "scan_seconds_mean": mean,
            "scan_seconds_std": statistics.stdev(t_scan) if len(t_scan) > 1 else 0.0,
            "n": len(t_scan),
            "bytes_moved": moved,
            "achieved_GBps": moved / mean / 1e9,
            "copy_bandwidth_GBps": bw,
            "bound_seconds": bound,
            "ratio_to_bound": mean / bound,
            "jacobian_fill_bytes": fill,
            "jacobian_seconds_mean": statistics.fmean(t_jac),
            "jacobian_seconds_std": statistics.stdev(t_jac) if len(t_jac) > 1 else 0.0,
        })
    if not rows:
        raise RuntimeError("no backend could run")
    write_csv(args.out, pd.DataFrame(rows))
    for r in rows:
        print(f"{r['backend']:>5}: scan {r['scan_seconds_mean'] * 1e3:.3f} ± {r['scan_seconds_std'] * 1e3:.3f} ms, "
              f"{r['achieved_GBps']:.1f} GB/s of {bw:.1f} GB/s copy bandwidth, {r['ratio_to_bound']:.2f}× the bound")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench-membound",
        help="time the scan backward per backend against the GPU's memory-traffic bound (CUDA only)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seq-len", type=int, default=1000, help="sequence length T")
    p.add_argument("--batch", type=int, default=16, help="batch size B")
    p.add_argument("--hidden", type=int, default=20, help="hidden size H")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--layout", choices=["paper", "fused"], default="paper")
    p.add_argument("--L-m", dest="L_m", type=int, default=None, help="up-sweep levels before a linear middle scan (default: full scan)")
    p.add_argument("--backends", default="cupy,torch", help="comma-separated backends to time")
    p.add_argument("--iters", type=int, default=50, help="timed repeats")
    p.add_argument("--warmup", type=int, default=5, help="untimed repeats first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, help="CSV to write (atomically)")
    p.set_defaults(func=bench_membound)
