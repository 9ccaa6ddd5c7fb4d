"""`bppsa roofline`: the scan's measured time against this CPU's compute and memory roofs (CSV)."""
from __future__ import annotations

import sys

import pandas as pd
import torch

from .. import io
from ..bench import roofline, speed
from ..bench.protocol import StopRule, interleave
from ..models.rnn import RNNClassifier
from ..precision import DTYPES
from .common import optional_int
from .speed import add_timing_args, cpu_setup, labelled


def register(sub) -> None:
    p = sub.add_parser("roofline", help="the scan against this CPU's measured GEMM FLOP/s and copy bandwidth (CSV)")
    p.add_argument("--seq-len", type=int, default=1000)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--hidden", type=int, default=20)
    p.add_argument("--L-m", dest="L_m", type=optional_int, default=None)
    p.add_argument("--backends", nargs="+", default=["cpu", "torch"], choices=["cpu", "torch"])
    p.add_argument("--gemm-n", type=int, default=2048, help="size of the GEMM that measures the compute roof")
    p.add_argument("--copy-mib", type=int, default=256, help="size of the copy that measures the memory roof")
    add_timing_args(p, _roofline)


def _roofline(args) -> int:
    cpu_setup(args)
    dtype = DTYPES[args.dtype]
    peak = roofline.peak_gemm_flops(dtype, args.gemm_n)
    bw = roofline.copy_bandwidth(args.copy_mib)
    rows = []
    for B in args.batches:
        torch.manual_seed(args.seed)
        model = RNNClassifier(hidden=args.hidden).to(dtype)
        x, y = speed.bitstream_batch(args.seq_len, B, args.seed, dtype)
        methods = {k: fn for k, (fn, _) in speed.scan_methods(model, x, y, args.backends, args.L_m).items()
                   if not k.startswith("scan-linear-torch")}
        m = interleave(methods, StopRule.from_args(args), metric="total")
        secs = {k: list(m.series(k)) for k in methods}
        for r in roofline.roofline_rows(secs, args.seq_len, B, args.hidden, args.L_m, dtype, peak, bw):
            r["noisy"] = m.noisy[r["method"]]
            rows.append(r)
    df = labelled(pd.DataFrame(rows), args)
    io.write_csv(args.out, df)
    print(df[["method", "batch", "scan_s", "bound_s", "bound", "x_bound", "achieved_gflops"]].to_string(index=False),
          file=sys.stderr)
    return 0
