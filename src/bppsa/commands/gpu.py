"""``bppsa bench-membound``: the scan backward per backend against the GPU's memory-traffic bound
(:mod:`bppsa.bench.membound`)."""
from __future__ import annotations

import argparse

import torch

from .. import device as _device
from ..bench import membound
from ..io import write_csv
from ..precision import DTYPES


def bench_membound(args) -> int:
    import pandas as pd

    if not torch.cuda.is_available():
        raise RuntimeError("bench-membound measures GPU memory traffic and needs a CUDA GPU; none is available")
    dev = _device.resolve(args.device)
    if dev.type != "cuda":
        raise RuntimeError(f"bench-membound needs a CUDA device, got '{args.device}'")
    torch.cuda.set_device(dev)
    if args.iters < 1 or min(args.seq_len, args.batch, args.hidden) < 1:
        raise ValueError("--iters, --seq-len, --batch and --hidden must be >= 1")
    rows = membound.measure(dev, args.backends.split(","), args.seq_len, args.batch, args.hidden, DTYPES[args.dtype],
                            args.layout, args.L_m, args.iters, args.warmup, args.seed)
    write_csv(args.out, pd.DataFrame(rows))
    for r in rows:
        print(f"{r['backend']:>5}: scan {r['scan_seconds_mean'] * 1e3:.3f} ± {r['scan_seconds_std'] * 1e3:.3f} ms, "
              f"{r['achieved_GBps']:.1f} GB/s of {r['copy_bandwidth_GBps']:.1f} GB/s copy bandwidth, "
              f"{r['ratio_to_bound']:.2f}× the bound")
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
    p.add_argument("--L-m", dest="L_m", type=int, default=None,
                   help="up-sweep levels before a linear middle scan (default: full scan)")
    p.add_argument("--backends", default="cupy,torch", help="comma-separated backends to time")
    p.add_argument("--iters", type=int, default=50, help="timed repeats")
    p.add_argument("--warmup", type=int, default=5, help="untimed repeats first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, help="CSV to write (atomically)")
    p.set_defaults(func=bench_membound)
