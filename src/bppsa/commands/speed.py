"""`bppsa speed`: the CPU speed benchmark of the recurrent backward, of the scan alone and of the whole training step
with torch's and with the compiled forward (paired ratios)."""
from __future__ import annotations

import sys

import pandas as pd
import torch

from .. import io
from ..backends import BACKENDS, CUPY_BACKENDS
from ..bench import speed
from ..bench.protocol import StopRule, add_stop_rule_args
from ..models import MODELS, check_layout
from ..precision import DTYPES
from .argtypes import positive_int
from .common import add_runtime_args, optional_int, setup


def add_timing_args(p, func) -> None:
    """What every CPU timing command takes after its own flags: the stop rule, --out, the runtime flags."""
    add_stop_rule_args(p)
    p.add_argument("--out", required=True)
    add_runtime_args(p)
    p.set_defaults(func=func)


def cpu_setup(args) -> None:
    """``setup`` for the commands that measure the CPU itself; any other device is an error."""
    if setup(args).type != "cpu":
        raise ValueError(f"bppsa {args.command} measures the CPU; run it with --device cpu")


def labelled(df: pd.DataFrame, args, **extra) -> pd.DataFrame:
    """Record how a timing CSV was made: profile, device, dtype, threads, subnormal mode (a column the
    measurement already has, e.g. the scaling's per-row threads, is kept)."""
    for k, v in dict(profile=args.profile, device=args.device_slug, dtype=args.dtype,
                     threads=torch.get_num_threads(), flush_denormal=args.flush_denormal, **extra).items():
        if k not in df:
            df[k] = v
    return df


def register(sub) -> None:
    p = sub.add_parser("speed", help="RNN/GRU/LSTM backward, scan-alone and whole-step speed ratios (CSV)")
    add_model_args(p)
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--step-batches", type=positive_int, nargs="*", default=None,
                   help="the batch sizes of the whole-step group (autograd, BPPSA with torch's forward, BPPSA with "
                        "the compiled forward); default: --batches; none given: no step group")
    p.add_argument("--layouts", nargs="+", default=["fused"], choices=["fused", "paper"])
    p.add_argument("--L-m", dest="L_ms", type=optional_int, nargs="+", default=[None],
                   help="scan variants to time (none = full Blelloch)")
    p.add_argument("--backends", nargs="+", default=["cpu", "torch"],
                   choices=[b for b in BACKENDS if b not in CUPY_BACKENDS],
                   help="BPPSA backends to time (cpu: the fast path; torch: its reference twin)")
    add_timing_args(p, _speed)


def add_model_args(p) -> None:
    """Which recurrent model and inputs a CPU benchmark times: the RNN or the LSTM on bitstreams of --seq-len, or
    any model on the first samples of --data (the GRU: an MFCC set)."""
    p.add_argument("--model", choices=MODELS, default="rnn")
    p.add_argument("--seq-len", type=positive_int, default=1000,
                   help="the RNN's or the LSTM's bitstream length (without --data)")
    p.add_argument("--data", default=None, help="a dataset file to take the batches from (required for the GRU)")
    p.add_argument("--hidden", type=positive_int, default=None, help="default: the model's (bppsa.models.SPECS)")


def _speed(args) -> int:
    for layout in args.layouts:
        check_layout(args.model, layout)
    cpu_setup(args)
    rows = speed.run(args.seq_len, args.batches, args.hidden, args.layouts, args.L_ms, args.backends,
                     StopRule.from_args(args), args.seed, DTYPES[args.dtype], model=args.model, data=args.data,
                     step_batches=args.step_batches)
    df = labelled(pd.DataFrame(rows), args)
    io.write_csv(args.out, df)
    print(speed.summary(df).to_string(index=False), file=sys.stderr)
    return 0
