"""`bppsa device`, `bppsa make-bitstream` and `bppsa bench-bitstream` (the bitstream sets need no torch)."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("device", help="print the device slug (results/<device>/) or its full record")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print the environment record as JSON")
    p.add_argument("--device-slug", default=None, help="the results folder's name, recorded beside the detected one")
    p.add_argument("--results-dir", default=None,
                   help="check the hardware against the one recorded in this folder (see `bppsa bench --help`)")
    p.set_defaults(func=_device_cmd)

    p = sub.add_parser("make-bitstream", help="generate a bitstream dataset (Eq. 8)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_make_bitstream)

    p = sub.add_parser("bench-bitstream", help="time, peak memory and size of generating one bitstream set (CSV)")
    p.add_argument("--seq-len", type=int, default=30000)
    p.add_argument("--samples", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_bench_bitstream)


def _device_cmd(args) -> int:
    from .. import device as _device

    dev = _device.resolve(args.device)
    if args.results_dir:
        _device.check_claim(args.results_dir, dev)
    if not args.json:
        print(_device.slug(dev))
        return 0
    info = _device.describe(dev)
    if args.device_slug:
        info["folder_slug"] = args.device_slug
    print(json.dumps(info, indent=2))
    return 0


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
