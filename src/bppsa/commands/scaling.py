"""`bppsa scaling`: backward time against the number of worker threads (CSV); its figure: `bppsa plot cpu_scaling`."""
from __future__ import annotations

import sys

import pandas as pd

from .. import io
from ..bench import scaling
from ..bench.protocol import StopRule
from ..device import default_threads
from ..models import MODELS
from ..precision import DTYPES
from .argtypes import positive_int
from .speed import add_timing_args, cpu_setup, labelled


def register(sub) -> None:
    p = sub.add_parser("scaling", help="autograd / BPPSA / compiled sequential backward vs threads (CSV)")
    p.add_argument("--model", choices=MODELS, default="rnn")
    p.add_argument("--seq-lens", type=positive_int, nargs="+", default=[1000, 10000],
                   help="the RNN's bitstream lengths")
    p.add_argument("--data", default=None, help="a dataset file to take the batches from (required for the GRU)")
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--hidden", type=positive_int, default=None, help="default: the model's (bppsa.models.SPECS)")
    p.add_argument("--max-threads", type=int, default=0, help="time 1 .. this many threads (0: every core)")
    add_timing_args(p, _scaling)


def _scaling(args) -> int:
    cpu_setup(args)
    top = args.max_threads or default_threads()
    if top < 1:
        raise ValueError(f"--max-threads must be >= 1 (got {top})")
    rows = scaling.run(args.seq_lens, args.batches, list(range(1, top + 1)), args.hidden, StopRule.from_args(args),
                       args.seed, DTYPES[args.dtype], model=args.model, data=args.data)
    df = labelled(pd.DataFrame(rows), args)
    io.write_csv(args.out, df)
    print(scaling.medians(df).to_string(index=False), file=sys.stderr)
    return 0
