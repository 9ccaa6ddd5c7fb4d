"""`bppsa verify`, `bppsa bench` and `bppsa train`: the recurrent models (RNN and GRU)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import torch

from .. import io
from ..backends import BACKENDS, get_backend
from ..bench.protocol import StopRule, add_stop_rule_args
from ..bench.recurrent import (
    METHODS,
    NOBP,
    VARIANTS,
    baseline_backend_name,
    compiled_forward_here,
    parse_variant,
    time_interleaved,
    train_epochs,
)
from ..data.sequences import open_dataset
from ..models import MODELS, SPECS, build, check_layout
from ..precision import DTYPES
from ..verify import verify
from .argtypes import positive_int
from .common import add_runtime_args, optional_int, setup


def _model_args(p, data_required: bool) -> None:
    p.add_argument("--model", choices=MODELS, default="rnn")
    p.add_argument("--hidden", type=positive_int, default=None, help="default: the model's (bppsa.models.SPECS)")
    p.add_argument("--backend", choices=BACKENDS, default="auto")
    p.add_argument("--layout", choices=sorted({lay for s in SPECS.values() for lay in s.layouts}), default="fused",
                   help="Jacobian layout; the GRU has 'fused' only")
    p.add_argument("--L-m", dest="L_m", type=optional_int, default=None,
                   help="heterogeneous scan levels (default: full Blelloch)")
    if data_required:
        p.add_argument("--data", required=True, help="dataset file (bitstream or feature .npz)")
    add_runtime_args(p)


def register(sub) -> None:
    p = sub.add_parser("verify", help="one batch through autograd and BPPSA; compare every gradient")
    _model_args(p, data_required=False)
    p.add_argument("--seq-len", type=positive_int, required=True)
    p.add_argument("--batch", type=positive_int, required=True)
    p.add_argument("--input-size", type=positive_int, default=None, help="default: the model's (bppsa.models.SPECS)")
    p.add_argument("--forward", choices=["torch", "auto"], default="torch",
                   help="BPPSA's forward: torch's kernels (what every timed comparison of the paper's claims runs) or "
                        "the backend's own (auto: the CPU's compiled kernel)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.set_defaults(func=_verify, dtype="float64")

    p = sub.add_parser("bench", help="time the baseline and BPPSA variants of one configuration, interleaved "
                                     "(tidy CSV, one row per variant x mode x iteration x phase)")
    _model_args(p, data_required=True)
    p.add_argument("--batch", type=positive_int, required=True)
    p.add_argument("--variants", nargs="+", default=["baseline", "bppsa-fused"], choices=VARIANTS,
                   help="the first is the reference of the speedups (default: baseline bppsa-fused)")
    p.add_argument("--packed-baseline", choices=["auto", "on", "off"], default="auto",
                   help="also time baseline-packed (cuDNN's per-step algorithm, the paper's baseline); "
                        "auto: on a CUDA device only")
    p.add_argument("--lr", type=float, required=True, help="config rnn.lr / gru.lr")
    add_stop_rule_args(p)
    p.add_argument("--no-nobp", dest="nobp", action="store_false", help="skip the paper's forward-only runs")
    p.add_argument("--verify-out", nargs="+", default=[], metavar="JSON",
                   help="first check every BPPSA variant's gradients against autograd at this (T, B), as `bppsa "
                        "verify` does, and write each result here (one file per BPPSA variant, in the order of "
                        "--variants); a failed check stops the command before any timing")
    p.add_argument("--graphed", action="store_true",
                   help="CUDA only: capture each variant's iteration, phase by phase, in CUDA graphs and time their "
                        "replays (the device's time, no host work per launch; checked against an eager step first)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_bench)

    p = sub.add_parser("train", help="train both ways; per-epoch loss, accuracy and wall-clock (CSV)")
    _model_args(p, data_required=True)
    p.add_argument("--batch", type=positive_int, required=True)
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--forward", choices=["torch", "auto"], default="torch",
                   help="BPPSA's forward: torch's kernels, the baseline's (the paper's comparison), or the backend's "
                        "own (auto: the CPU's compiled kernel; the variant bppsa-<layout>-compiled)")
    p.add_argument("--epochs", type=positive_int, required=True)
    p.add_argument("--lr", type=float, required=True, help="config rnn.lr / gru.lr")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_train)


def _setup(args):
    """The runtime, once the model and its layout are known to go together (before any work)."""
    check_layout(args.model, args.layout)
    args.hidden = args.hidden or SPECS[args.model].hidden
    return setup(args)


def _check(args, dev, seq_len, input_size, layout, out, show=None) -> bool:
    """One batch through autograd and BPPSA (bppsa.verify), the result printed to ``show``; written to ``out``
    only where it passes, so the workflow cannot proceed past a failure."""
    # `bppsa bench`'s check runs torch's forward, the one its variants time; `bppsa verify --forward auto` the other
    res = verify(args.model, seq_len, args.batch, args.hidden, input_size, dtype=args.dtype, backend=args.backend,
                 layout=layout, L_m=args.L_m, seed=args.seed, device=str(dev),
                 forward=getattr(args, "forward", "torch"))
    res["device_slug"] = args.device_slug
    print(json.dumps(res, sort_keys=True), file=show or sys.stdout)
    if not res["ok"]:
        print(f"bppsa {args.command}: {layout} layout at T={seq_len}, B={args.batch}: max_rel_err "
              f"{res['max_rel_err']:.3e} exceeds the {args.dtype} tolerance {res['tolerance']:.0e}", file=sys.stderr)
        return False
    if out:
        io.write_json(out, res)
    return True


def _verify(args) -> int:
    dev = _setup(args)
    return 0 if _check(args, dev, args.seq_len, args.input_size, args.layout, args.out) else 1


def _model_for(args, ds, dev):
    torch.manual_seed(args.seed)
    return build(args.model, ds.input_size, args.hidden, ds.classes).to(device=dev, dtype=DTYPES[args.dtype])


def _bench(args) -> int:
    rule = StopRule.from_args(args)
    variants = list(dict.fromkeys(args.variants))
    for v in variants:
        parse_variant(v)
    dev = _setup(args)
    if args.graphed and dev.type != "cuda":
        raise ValueError(f"--graphed captures CUDA graphs and needs a CUDA device; --device resolved to '{dev}'")
    if args.packed_baseline == "on" or (args.packed_baseline == "auto" and dev.type == "cuda"):
        variants.insert(1 if variants[0] == "baseline" else 0, "baseline-packed")
        variants = list(dict.fromkeys(variants))
    ds = open_dataset(args.data, DTYPES[args.dtype], dev)
    if ds.n < args.batch:
        raise ValueError(f"{args.data}: {ds.n} samples, fewer than one batch of {args.batch}")
    checked = [v for v in variants if parse_variant(v)[0] == "bppsa"]
    if args.verify_out and len(args.verify_out) != len(checked):
        raise ValueError(f"--verify-out: {len(args.verify_out)} file(s) for {len(checked)} BPPSA variant(s) "
                         f"({', '.join(checked)})")
    for v, out in zip(checked, args.verify_out):  # the gradient check before the timing, in this process
        if not _check(args, dev, ds.seq_len, ds.input_size, parse_variant(v)[1], out, show=sys.stderr):
            return 1
    starts = ds.n // args.batch

    def batches(i):
        s = (i % starts) * args.batch
        return ds.get_batch(np.arange(s, s + args.batch))

    needs_bppsa = any(parse_variant(v)[0] == "bppsa" for v in variants)
    backend = get_backend(args.backend, dev) if needs_bppsa else None
    rows, m = time_interleaved(lambda: _model_for(args, ds, dev), batches, variants, rule, device=dev,
                               backend=backend, L_m=args.L_m, lr=args.lr, nobp=args.nobp, graphed=args.graphed,
                               desc=f"{args.model} T={ds.seq_len} B={args.batch}")
    df = pd.DataFrame(rows)
    parsed = {v: parse_variant(v) for v in variants}
    df["method"] = df["variant"].map(lambda v: parsed[v][0])
    df["layout"] = df["variant"].map(lambda v: parsed[v][1])
    df["backend"] = df["variant"].map(lambda v: backend.name if parsed[v][0] == "bppsa"
                                      else baseline_backend_name(dev, parsed[v][2]))
    df["L_m"] = df["variant"].map(lambda v: args.L_m if parsed[v][0] == "bppsa" else None)
    df["noisy"] = [m.noisy[v if mode == "full" else f"{v}@{NOBP}"] for v, mode in zip(df["variant"], df["mode"])]
    meta = dict(profile=args.profile, device=args.device_slug, model=args.model, dtype=args.dtype,
                seq_len=ds.seq_len, batch=args.batch, hidden=args.hidden, input_size=ds.input_size,
                data=ds.source, threads=torch.get_num_threads(), flush_denormal=args.flush_denormal,
                graphed=args.graphed, reference=variants[0], rounds=m.iters, stopped_by=m.stopped_by,
                timed_seconds=round(m.seconds, 4),
                **rule.as_dict())
    for k, v in meta.items():
        df[k] = v
    io.write_csv(args.out, df)
    _print_summary(df, m)
    return 0


def _print_summary(df: pd.DataFrame, m) -> None:
    per_iter = df[df["mode"] == "full"].groupby(["variant", "phase"])["seconds"].median().unstack(fill_value=0.0)
    print(per_iter.to_string(float_format=lambda v: f"{v * 1e3:9.3f} ms"), file=sys.stderr)
    print(f"{m.iters} rounds in {m.seconds:.1f} s, stopped: {m.stopped_by}; noisy: "
          f"{', '.join(k for k, v in m.noisy.items() if v) or 'none'}", file=sys.stderr)


def _train(args) -> int:
    dev = _setup(args)
    ds = open_dataset(args.data, DTYPES[args.dtype], dev)
    model = _model_for(args, ds, dev)
    backend = get_backend(args.backend, dev) if args.method == "bppsa" else None
    if args.forward != "torch" and args.method != "bppsa":
        raise ValueError("--forward names BPPSA's forward; the baseline always runs torch's")
    # which forward ran, recorded: 'auto' runs torch's kernels where there is no compiled one (no C compiler, a GPU)
    kernel = "torch"
    if args.forward == "auto" and compiled_forward_here(model, ds.get_batch(np.arange(1))[0]):
        kernel = "compiled"
    elif args.forward == "auto":
        print(f"bppsa train: no compiled forward for the {args.model.upper()} here ({args.dtype}, {dev}): "
              "--forward auto runs torch's kernels", file=sys.stderr)
    rows = list(train_epochs(model, ds.n, args.batch, ds.get_batch, args.method, device=dev, epochs=args.epochs,
                             lr=args.lr, seed=args.seed, backend=backend, layout=args.layout, L_m=args.L_m,
                             desc=f"train {args.model} {args.method}", forward=args.forward))
    df = pd.DataFrame(rows)
    meta = dict(profile=args.profile, device=args.device_slug, model=args.model, method=args.method,
                backend=backend.name if backend else baseline_backend_name(dev),
                layout=args.layout if backend else "", forward=args.forward, forward_kernel=kernel,
                dtype=args.dtype, seq_len=ds.seq_len, batch=args.batch,
                hidden=args.hidden, lr=args.lr, samples=ds.n, data=ds.source)
    for k, v in meta.items():
        df[k] = v
    io.write_csv(args.out, df)
    return 0
