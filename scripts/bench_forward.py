"""The recurrent layers' forward on a CPU: the compiled forward against torch.nn's, and the sliced forward against
the compiled one (bppsa.bench.forward).  On an otherwise idle machine:

    python scripts/bench_forward.py --threads 2 --out forward.csv            # the issue's configurations
    python scripts/bench_forward.py --experiments sliced --batches 16 8 --tol 1e-6 --out sliced.csv

Writes the observations (one row per method and round) to --out and the summary (medians, paired speedups with
their 95 % intervals, the load average) beside it (``<out>_summary.csv``), and prints one line per configuration.
"""
from __future__ import annotations

# isort: off
import bppsa  # noqa: F401 - before torch: its OpenMP settings (bppsa.process)
from bppsa import process
# isort: on

import argparse
from pathlib import Path

import torch

from bppsa.bench import forward
from bppsa.bench.protocol import StopRule, add_stop_rule_args
from bppsa.io import write_csv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", nargs="+", default=["compiled", "sliced"], choices=["compiled", "sliced"])
    p.add_argument("--cells", nargs="+", default=["rnn_tanh", "gru", "lstm"], choices=list(forward._TORCH))
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1000, 10000], help="the compiled experiment's T")
    p.add_argument("--sliced-len", type=int, default=10000, help="the sliced experiment's T")
    p.add_argument("--layers", nargs="+", default=list(forward.LAYERS), choices=list(forward.LAYERS))
    p.add_argument("--batches", nargs="+", type=int, default=[16])
    p.add_argument("--hidden", type=int, default=20)
    p.add_argument("--input", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slices", type=int, default=2)
    p.add_argument("--tol", type=float, default=None, help="also time the sliced forward with this tolerance")
    p.add_argument("--out", default="forward.csv")
    add_stop_rule_args(p)
    p.set_defaults(max_seconds=20.0)
    args = p.parse_args(argv)
    process.keep_large_blocks()  # as the bppsa commands: a [T, B, H] output made every round is not faulted anew
    rows, summary = forward.run(args.cells, args.seq_lens, args.batches, args.hidden, args.input,
                                getattr(torch, args.dtype), args.threads, args.slices, StopRule.from_args(args),
                                args.sliced_len, args.layers, args.tol, args.experiments, progress=print)
    out = Path(args.out)
    write_csv(out, rows)
    write_csv(out.with_name(out.stem + "_summary.csv"), summary)
    print(f"wrote {out} and {out.with_name(out.stem + '_summary.csv')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
