"""`bppsa roofline`: the scan's measured time against this CPU's compute and memory roofs (CSV)."""
from __future__ import annotations

import sys

import pandas as pd
import torch

from .. import io
from ..bench import roofline, speed
from ..bench.protocol import StopRule, interleave
from ..precision import DTYPES
from .argtypes import positive_int
from .common import optional_int
from .speed import add_model_args, add_timing_args, cpu_setup, labelled


def register(sub) -> None:
    p = sub.add_parser("roofline", help="the scan against this CPU's measured GEMM FLOP/s, copy bandwidth and "
                                        "multiply-add latency (CSV)")
    add_model_args(p)
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--L-m", dest="L_m", type=optional_int, default=None)
    p.add_argument("--backends", nargs="+", default=["cpu", "torch"], choices=["cpu", "torch"])
    p.add_argument("--gemm-n", type=positive_int, default=2048, help="size of the GEMM that measures the compute roof")
    p.add_argument("--copy-mib", type=positive_int, default=256, help="size of the copy that measures the memory roof")
    add_timing_args(p, _roofline)


def _roofline(args) -> int:
    cpu_setup(args)
    dtype = DTYPES[args.dtype]
    peak = roofline.peak_gemm_flops(dtype, args.gemm_n)
    bw = roofline.copy_bandwidth(args.copy_mib)
    t_fma = roofline.fma_latency(dtype)
    rows = []
    for B in args.batches:
        model, x, y = speed.setup(args.model, B, args.seed, dtype, args.seq_len, args.hidden, args.data)
        methods = {k: fn for k, (fn, _) in speed.scan_methods(model, x, y, args.backends, args.L_m).items()
                   if not k.startswith("scan-linear-torch")}
        m = interleave(methods, StopRule.from_args(args), metric="total")
        secs = {k: list(m.series(k)) for k in methods}
        for r in roofline.roofline_rows(secs, x.shape[0], B, model.cell.hidden_size, args.L_m, dtype, peak, bw,
                                        kind=args.model, t_fma=t_fma, threads=torch.get_num_threads()):
            r["noisy"] = m.noisy[r["method"]]
            rows.append(r)
    df = labelled(pd.DataFrame(rows), args)
    io.write_csv(args.out, df)
    print(df[["method", "batch", "scan_s", "bound_s", "bound", "x_bound", "achieved_gflops"]].to_string(index=False),
          file=sys.stderr)
    return 0
