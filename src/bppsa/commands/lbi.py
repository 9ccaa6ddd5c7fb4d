"""`bppsa lbi-train` and `bppsa lbi-ranks`: Latent Bounded Interfaces (docs/lbi.md)."""
from __future__ import annotations

import pandas as pd
import torch

from .. import io
from .argtypes import nonnegative_int, positive_int


def _sizes(p) -> None:
    p.add_argument("--d", type=positive_int, default=64, help="model width")
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--seq", type=positive_int, default=64, help="sequence length (bytes)")
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads (per rank for lbi-ranks)")


def register(sub) -> None:
    p = sub.add_parser("lbi-train", help="train the LBI language model or its dense baseline on CPython's "
                                         "documentation topics (bytes); validation cross-entropy (CSV)")
    p.add_argument("--kind", choices=("dense", "lbi"), required=True)
    p.add_argument("--r", type=positive_int, default=None, help="interface rank (kind lbi)")
    p.add_argument("--regions", type=positive_int, default=4, help="K, regions of two blocks each")
    _sizes(p)
    p.add_argument("--steps", type=positive_int, required=True)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=positive_int, default=50)
    p.add_argument("--val-windows", type=positive_int, default=64, help="validation windows of --seq bytes")
    p.add_argument("--backward", choices=("autograd", "scan"), default="autograd",
                   help="scan: the interface scan backward (the same gradients, more work on one core)")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N] | auto (a GPU where torch sees one)")
    p.add_argument("--profile", default="adhoc")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_train)

    p = sub.add_parser("lbi-ranks", help="LBI with one region per rank (gloo processes): bytes each rank sends per "
                                         "step, and backward time by scan and by pipeline (two CSVs)")
    p.add_argument("--ranks", type=positive_int, nargs="+", required=True, help="group sizes (= regions), each >= 1")
    p.add_argument("--r", type=positive_int, default=16)
    _sizes(p)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds (one step per mode each)")
    p.add_argument("--warmup", type=nonnegative_int, default=1, help="untimed rounds first")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--profile", default="adhoc")
    p.add_argument("--traffic-out", required=True)
    p.add_argument("--time-out", required=True)
    p.set_defaults(func=_ranks)


def _positive(args, *names) -> None:
    for n in names:
        v = getattr(args, n)
        if v is None or v < 1:
            raise SystemExit(f"bppsa {args.command}: --{n.replace('_', '-')} must be >= 1 (got {v})")


def _train(args) -> None:
    from ..bench.lbi import train_run

    _positive(args, "d", "heads", "seq", "batch", "steps", "eval_every", "val_windows", "threads", "regions")
    if args.kind == "lbi":
        _positive(args, "r")
    elif args.r is not None:
        raise SystemExit("bppsa lbi-train: --r is for --kind lbi (the dense baseline has no interface)")
    torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    curve, final = train_run(args.kind, args.r, regions=args.regions, d=args.d, heads=args.heads, seq=args.seq,
                             batch=args.batch, steps=args.steps, lr=args.lr, seed=args.seed,
                             eval_every=args.eval_every, val_count=args.val_windows, backward=args.backward,
                             device=device)
    rows = [{**c, "row": "curve"} for c in curve] + [{**final, "step": args.steps, "row": "final"}]
    df = pd.DataFrame(rows).assign(profile=args.profile)
    io.write_csv(args.out, df)
    print(f"{final['label']}: validation cross-entropy {final['val_ce']:.4f} nats/byte "
          f"(prefix-only {final['val_prefix_ce']:.4f}) -> {args.out}")


def _ranks(args) -> None:
    from ..bench.lbi import rank_rows

    _positive(args, "r", "d", "heads", "seq", "batch", "repeats", "threads")
    if any(p < 1 for p in args.ranks):
        raise SystemExit(f"bppsa lbi-ranks: --ranks must be >= 1 each (got {args.ranks})")
    dtype = getattr(torch, args.dtype)
    traffic, times = rank_rows(args.ranks, args.r, batch=args.batch, seq=args.seq, d=args.d, heads=args.heads,
                               repeats=args.repeats, warmup=args.warmup, dtype=dtype, seed=args.seed,
                               threads=args.threads)
    io.write_csv(args.traffic_out, pd.DataFrame(traffic).assign(profile=args.profile))
    io.write_csv(args.time_out, pd.DataFrame(times).assign(profile=args.profile, threads=args.threads))
    print(f"LBI on ranks {args.ranks}: traffic -> {args.traffic_out}, times -> {args.time_out}")
