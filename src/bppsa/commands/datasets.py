"""`bppsa make-bitstream` and `bppsa bench-bitstream` (the bitstream sets need no torch)."""
from __future__ import annotations

from .argtypes import positive_int


def register(sub) -> None:
    p = sub.add_parser("make-bitstream", help="generate a bitstream dataset (Eq. 8)")
    p.add_argument("--seq-len", type=positive_int, required=True)
    p.add_argument("--samples", type=positive_int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_make_bitstream)

    p = sub.add_parser("bench-bitstream", help="time, peak memory and size of generating one bitstream set (CSV)")
    p.add_argument("--seq-len", type=positive_int, default=30000)
    p.add_argument("--samples", type=positive_int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_bench_bitstream)


def _bench_bitstream(args) -> int:
    """Generation runs in a child process so that its peak RSS is its own."""
    import os
    import resource
    import subprocess
    import sys
    import tempfile
    import time

    import pandas as pd

    from .. import io

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"T{args.seq_len}.npz")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "bppsa", "make-bitstream", "--seq-len", str(args.seq_len),
                        "--samples", str(args.samples), "--seed", str(args.seed), "--out", path], check=True)
        seconds = time.perf_counter() - t0
        size = os.path.getsize(path)
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux: kB
    row = dict(seq_len=args.seq_len, samples=args.samples, seconds=seconds, peak_rss_mb=peak_mb,
               file_mb=size / 1e6, cpu_count=os.cpu_count())
    io.write_csv(args.out, pd.DataFrame([row]))
    print(row)
    return 0


def _make_bitstream(args) -> int:
    from ..data import bitstream

    bitstream.write(args.out, args.seq_len, args.samples, args.seed)
    return 0
