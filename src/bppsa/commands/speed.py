"""`bppsa speed`: the CPU speed benchmark of the RNN backward and of the scan alone."""
from __future__ import annotations

import sys

import pandas as pd
import torch

from .. import io
from ..bench import speed
from .common import DTYPES, add_runtime_args, optional_int, setup


def register(sub) -> None:
    p = sub.add_parser("speed", help="RNN backward and scan-alone speed ratios (CSV)")
    p.add_argument("--seq-len", type=int, default=1000)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--hidden", type=int, default=20)
    p.add_argument("--layouts", nargs="+", default=["fused", "paper"], choices=["fused", "paper"])
    p.add_argument("--L-m", dest="L_ms", type=optional_int, nargs="+", default=[None],
                   help="scan variants to time (none = full Blelloch)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", required=True)
    add_runtime_args(p)
    p.set_defaults(func=_speed)


def ratios(df: pd.DataFrame) -> pd.DataFrame:
    """The three headline ratios per batch size (means over repeats)."""
    m = df.groupby(["batch", "what", "layout", "L_m"], dropna=False)["seconds"].mean()
    out = []
    for B in sorted(df["batch"].unique()):
        mb = m.loc[B]
        auto = mb.loc["autograd_backward"].iloc[0]
        assoc = mb.loc["scan_associative_generic"].iloc[0]
        for (what, layout, L_m), secs in mb.items():
            if what == "bppsa_backward":
                out.append({"batch": B, "ratio": "autograd_backward / bppsa_backward", "layout": layout, "L_m": L_m,
                            "value": auto / secs})
            if what == "scan_blelloch":
                out.append({"batch": B, "ratio": "associative_scan_generic / scan_blelloch", "layout": layout,
                            "L_m": L_m, "value": assoc / secs})
    return pd.DataFrame(out)


def _speed(args) -> int:
    dev = setup(args)
    if dev.type != "cpu":
        raise ValueError("bppsa speed measures the CPU; run it with --device cpu")
    rows = speed.run(args.seq_len, args.batches, args.hidden, args.layouts, args.L_ms, args.repeats, args.warmup,
                     args.seed, DTYPES[args.dtype])
    df = pd.DataFrame(rows)
    for k, v in dict(profile=args.profile, device=args.device_slug, dtype=args.dtype,
                     threads=torch.get_num_threads(), flush_denormal=args.flush_denormal).items():
        df[k] = v
    io.write_csv(args.out, df)
    print(ratios(df).to_string(index=False), file=sys.stderr)
    return 0
