"""`bppsa verify`, `bppsa bench` and `bppsa train`: the recurrent models (RNN and GRU)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import torch

from .. import io
from ..backends import BACKENDS, get_backend
from ..bench.recurrent import METHODS, baseline_backend_name, time_iterations, train_epochs
from ..data.sequences import open_dataset
from ..jacobians.recurrent import LAYOUTS
from ..models import MODELS, build
from ..verify import verify
from .common import DTYPES, add_runtime_args, optional_int, setup


def _model_args(p, data_required: bool) -> None:
    p.add_argument("--model", choices=MODELS, default="rnn")
    p.add_argument("--hidden", type=int, default=20)
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--layout", choices=LAYOUTS, default="fused")
    p.add_argument("--L-m", dest="L_m", type=optional_int, default=None, help="heterogeneous scan levels (default: full Blelloch)")
    if data_required:
        p.add_argument("--data", required=True, help="dataset file (bitstream or feature .npz)")
    add_runtime_args(p)


def register(sub) -> None:
    p = sub.add_parser("verify", help="one batch through autograd and BPPSA; compare every gradient")
    _model_args(p, data_required=False)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--input-size", type=int, default=None, help="default: 1 (rnn), 12 (gru)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.set_defaults(func=_verify, dtype="float64")

    p = sub.add_parser("bench", help="time training iterations phase by phase (tidy CSV)")
    _model_args(p, data_required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--methods", nargs="+", default=["baseline", "bppsa"], choices=METHODS)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-nobp", dest="nobp", action="store_false", help="skip the paper's forward-only runs")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_bench)

    p = sub.add_parser("train", help="train both ways; per-epoch loss, accuracy and wall-clock (CSV)")
    _model_args(p, data_required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_train)


def _verify(args) -> int:
    dev = setup(args)
    res = verify(args.model, args.seq_len, args.batch, args.hidden, args.input_size, dtype=args.dtype,
                 backend=args.backend, layout=args.layout, L_m=args.L_m, seed=args.seed, device=str(dev))
    res["device_slug"] = args.device_slug
    text = json.dumps(res, sort_keys=True)
    print(text)
    if not res["ok"]:
        print(f"bppsa verify: max_rel_err {res['max_rel_err']:.3e} exceeds the {args.dtype} tolerance "
              f"{res['tolerance']:.0e}", file=sys.stderr)
        return 1
    if args.out:  # only a passing check is kept, so the workflow cannot proceed past a failure
        io.write_json(args.out, res)
    return 0


def _model_for(args, ds, dev):
    torch.manual_seed(args.seed)
    return build(args.model, ds.input_size, args.hidden, ds.classes).to(device=dev, dtype=DTYPES[args.dtype])


def _bench(args) -> int:
    dev = setup(args)
    ds = open_dataset(args.data, DTYPES[args.dtype], dev)
    if ds.n < args.batch:
        raise ValueError(f"{args.data}: {ds.n} samples, fewer than one batch of {args.batch}")
    starts = ds.n // args.batch

    def batches(i):
        s = (i % starts) * args.batch
        return ds.get_batch(np.arange(s, s + args.batch))

    rows = []
    for method in args.methods:
        backend = get_backend(args.backend, dev) if method == "bppsa" else None
        for mode in (["full", "nobp"] if args.nobp else ["full"]):
            model = _model_for(args, ds, dev)
            tag = f"{args.model} {method} {mode} T={ds.seq_len} B={args.batch}"
            for r in time_iterations(model, batches, method, device=dev, backend=backend, layout=args.layout,
                                     L_m=args.L_m, lr=args.lr, warmup=args.warmup, iters=args.iters, mode=mode, desc=tag):
                r.update(method=method, mode=mode,
                         backend=backend.name if backend else baseline_backend_name(dev),
                         layout=args.layout if method == "bppsa" else "",
                         L_m=args.L_m if method == "bppsa" else None)
                rows.append(r)
    df = pd.DataFrame(rows)
    meta = dict(profile=args.profile, device=args.device_slug, model=args.model, dtype=args.dtype,
                seq_len=ds.seq_len, batch=args.batch, hidden=args.hidden, input_size=ds.input_size,
                data=ds.source, warmup=args.warmup, threads=torch.get_num_threads(),
                flush_denormal=args.flush_denormal)
    for k, v in meta.items():
        df[k] = v
    io.write_csv(args.out, df)
    _print_summary(df)
    return 0


def _print_summary(df: pd.DataFrame) -> None:
    full = df[df["mode"] == "full"]
    per_iter = full.groupby(["method", "phase"])["seconds"].mean().unstack(fill_value=0.0)
    print(per_iter.to_string(float_format=lambda v: f"{v * 1e3:9.3f} ms"), file=sys.stderr)


def _train(args) -> int:
    dev = setup(args)
    ds = open_dataset(args.data, DTYPES[args.dtype], dev)
    model = _model_for(args, ds, dev)
    backend = get_backend(args.backend, dev) if args.method == "bppsa" else None
    rows = list(train_epochs(model, ds.n, args.batch, ds.get_batch, args.method, device=dev, epochs=args.epochs,
                             lr=args.lr, seed=args.seed, backend=backend, layout=args.layout, L_m=args.L_m,
                             desc=f"train {args.model} {args.method}"))
    df = pd.DataFrame(rows)
    meta = dict(profile=args.profile, device=args.device_slug, model=args.model, method=args.method,
                backend=backend.name if backend else baseline_backend_name(dev),
                layout=args.layout if backend else "", dtype=args.dtype, seq_len=ds.seq_len, batch=args.batch,
                hidden=args.hidden, lr=args.lr, samples=ds.n, data=ds.source)
    for k, v in meta.items():
        df[k] = v
    io.write_csv(args.out, df)
    return 0
