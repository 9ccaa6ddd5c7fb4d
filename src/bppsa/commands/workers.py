"""`bppsa workers`: BPPSA with the RNN's sequence split over p processes against the pipeline on the same split
(forward, backward and whole-step time per rank in paired rounds, the split layer's default forward beside the serial
hand-off; peak memory per rank), and the comparisons (CSVs); its figure:
`bppsa plot workers`.  docs/distributed.md.

Run plainly, it spawns its processes on this machine.  Under ``torchrun --nproc-per-node P --no-python bppsa
workers ...`` or as ``srun --ntasks P bppsa workers ...``, each launched process is one rank of the group the
launcher describes (P = the largest of ``--ps``); rank 0 writes the CSVs, and the memory is measured in those
processes, before the timing, for BPPSA at the largest p only."""
from __future__ import annotations

import sys
from pathlib import Path

from .argtypes import positive_int


def register(sub) -> None:
    p = sub.add_parser("workers", help="BPPSA over p processes vs the pipeline on the same split: forward, backward, "
                                       "step time, memory (CSV)")
    p.add_argument("--ps", type=positive_int, nargs="+", default=[1, 2], help="process counts (local processes, gloo)")
    p.add_argument("--seq-len", type=positive_int, default=10000, help="T, split over the processes")
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--hidden", type=positive_int, default=20)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--rounds", type=positive_int, default=20, help="timed rounds, every (p, method) once per round")
    p.add_argument("--loss", choices=["last", "steps"], default="last",
                   help="a loss on the last state (the paper's RNN) or on every step")
    p.add_argument("--threads", type=positive_int, default=2,
                   help="the in-process rival's threads (one process, CPU kernel; 1: not run)")
    p.add_argument("--micro-batches", type=positive_int, default=1,
                   help="the pipeline baseline's micro-batches (GPipe; must divide --batch; default 1, the faster "
                        "on CPUs: bppsa.bench.workers.MICRO_BATCHES)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory spawns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a rank is declared lost")
    p.add_argument("--profile", default="manual", help="a label recorded in the CSVs")
    p.add_argument("--out", required=True, help="a folder: time.csv, memory.csv and summary.csv are written there")
    p.set_defaults(func=_workers)


def _workers(args) -> int:
    import torch

    from ..bench import workers as bench
    from ..distributed.launch import init_from_env, launcher_env

    micro = args.micro_batches
    bench.check_sizes(args.ps, args.seq_len, args.batch, micro)  # before any process joins a group
    dtype = getattr(torch, args.dtype)
    shape = dict(T=args.seq_len, B=args.batch, H=args.hidden, micro_batches=micro)
    label = {"profile": args.profile, "dtype": args.dtype, "loss": args.loss, "seq_len": args.seq_len,
             "batch": args.batch, "hidden": args.hidden, "micro_batches": micro}
    launched = launcher_env()
    label["launcher"] = "spawn"
    if launched is not None and launched["world_size"] > 1:
        label["launcher"] = launched["via"]
        # torchrun / srun started one process per rank: this is one of them, in the group they describe
        init_from_env("gloo", timeout=args.timeout)
        rows, mem = bench.launched_rows(args.ps, **shape, dtype=dtype, rounds=args.rounds, seed=args.seed,
                                        loss=args.loss, threads=args.threads, memory=not args.no_memory)
        if launched["rank"] != 0:
            return 0
    else:
        rows = bench.time_rows(args.ps, **shape, dtype=dtype, rounds=args.rounds, seed=args.seed, loss=args.loss,
                               threads=args.threads, timeout=args.timeout)
        mem = []
        if not args.no_memory:
            # the timing written first, whole: a run stopped during the memory spawns (a time limit) keeps it
            _write(args.out, rows, [], label, final=False)
            mem = bench.memory_rows(args.ps, **shape, dtype=dtype, seed=args.seed, loss=args.loss,
                                    threads=args.threads, timeout=args.timeout)
    _write(args.out, rows, mem, label)
    return 0


def _write(folder, rows, mem, label, final: bool = True) -> None:
    """time.csv, memory.csv and summary.csv in ``folder`` (each file whole: io.write_csv), the medians and the
    summary printed when ``final``."""
    import pandas as pd

    from .. import io
    from ..analysis import workers as analysis

    t = pd.DataFrame(rows)
    m = pd.DataFrame(mem, columns=["p", "method", "rank", "threads", "peak_bytes", "backward_s"])
    s = analysis.summary(t, m)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, df in (("time", t), ("memory", m), ("summary", s)):
        io.write_csv(out / f"{name}.csv", df.assign(**label))
    if final:
        for metric in ("forward_s", "backward_s", "fwd_bwd_s"):
            print(f"{metric}:\n{analysis.medians(t, metric).to_string(index=False)}", file=sys.stderr)
        print(s.to_string(index=False), file=sys.stderr)
    else:
        print(f"bppsa workers: timing written to {out}; now the memory spawns", file=sys.stderr)
