"""The CNNs trained through BPPSA (``bppsa.nn.Sequential``): `bppsa lenet5-curves` (Fig 6), `bppsa bench-cnn`
(LeNet-5 and the pruned VGG-11, autograd vs BPPSA, the timing protocol) and `bppsa vgg11-retrain-scan` (the pruned
VGG-11 retrained through the scan: time per iteration, per scan step against its static FLOP, generation share)."""
from __future__ import annotations

import sys

import pandas as pd
import torch

from .. import io
from ..bench.protocol import StopRule, add_stop_rule_args
from ..data import cifar
from ..precision import DTYPES
from .argtypes import nonnegative_int, positive_int
from .common import add_runtime_args, optional_int, setup


def register(sub) -> None:
    p = sub.add_parser("lenet5-curves", help="Fig 6: LeNet-5 trained by autograd and by the BPPSA scan from the same "
                       "seed and batches; training and test loss per iteration (CSV)")
    p.add_argument("--data", required=True, help="CIFAR-10 manifest written by `bppsa make-cifar10`")
    p.add_argument("--iterations", type=positive_int, required=True, help="SGD steps (the paper: ~8,000)")
    p.add_argument("--batch-size", type=positive_int, required=True, help="mini-batch (the paper: 256)")
    p.add_argument("--lr", type=float, required=True, help="SGD learning rate (the paper: 0.001)")
    p.add_argument("--momentum", type=float, required=True, help="SGD momentum (the paper: 0.9)")
    p.add_argument("--test-every", type=positive_int, required=True, help="iterations between test losses")
    p.add_argument("--test-samples", type=nonnegative_int, required=True,
                   help="test images per test loss (0: the whole test set)")
    p.add_argument("--L-m", dest="L_m", type=optional_int, default=None,
                   help="BPPSA's up-sweep levels before the linear middle scan ('none': the full tree)")
    p.add_argument("--out", required=True, help="curve CSV, one row per method x split x iteration")
    add_runtime_args(p)
    p.set_defaults(func=_lenet5_curves)

    p = sub.add_parser("bench-cnn", help="time CNN training steps, autograd vs BPPSA (bppsa.nn.Sequential), "
                       "interleaved rounds with medians and intervals (tidy CSV)")
    _network_args(p)
    p.add_argument("--batch", type=positive_int, required=True, help="mini-batch (LeNet-5 in the paper: 256)")
    p.add_argument("--lr", type=float, default=0.001, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--batches", type=positive_int, default=4, help="distinct batches the rounds cycle through")
    add_stop_rule_args(p)
    p.add_argument("--out", required=True, help="tidy CSV: one row per method x round x phase")
    add_runtime_args(p)
    p.set_defaults(func=_bench_cnn)

    p = sub.add_parser("vgg11-retrain-scan", help="retrain the pruned VGG-11 through the BPPSA scan (pruned zeros "
                       "dropped), paired with autograd: time per iteration, per scan step against its static FLOP, "
                       "and the Jacobian-generation share (CSVs)")
    _network_args(p, vgg_only=True)
    p.add_argument("--iterations", type=positive_int, required=True, help="timed retraining iterations per method")
    p.add_argument("--batch-size", type=positive_int, required=True)
    p.add_argument("--lr", type=float, required=True, help="SGD learning rate (config vgg11.lr)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--profile-iterations", type=positive_int, default=2,
                   help="further BPPSA iterations with every scan product timed on its own")
    p.add_argument("--out", required=True, help="per-iteration CSV (method x iteration x phase)")
    p.add_argument("--out-steps", required=True, help="per-scan-step CSV: measured seconds beside static FLOP")
    add_runtime_args(p)
    p.set_defaults(func=_retrain_scan)


def _network_args(p, vgg_only: bool = False) -> None:
    from ..models import vgg

    if not vgg_only:
        p.add_argument("--model", choices=["lenet5", "vgg11"], required=True)
    p.add_argument("--data", required=True, help="CIFAR-10 manifest written by `bppsa make-cifar10`")
    p.add_argument("--models", default=None, help="vgg11: a vgg11-train checkpoint (its pruned-retrained weights and "
                   "masks); without it a freshly initialised VGG-11 pruned by magnitude (--width, --prune)")
    p.add_argument("--width", type=float, default=1.0, help="vgg11 without --models: conv width multiplier")
    p.add_argument("--prune", type=float, default=0.97, help="vgg11 without --models: pruned fraction")
    p.add_argument("--scheme", choices=vgg.SCHEMES, default="class-uniform")
    p.add_argument("--L-m", dest="L_m", type=optional_int, default=None,
                   help="BPPSA's up-sweep levels before the linear middle scan ('none': the full tree)")
    p.add_argument("--keep-zeros", dest="drop_zeros", action="store_false",
                   help="store input- and weight-dependent zeros in the Jacobians (default: dropped, pruning too)")


def _network(args):
    from ..bench import cnn as bench_cnn

    model = getattr(args, "model", "vgg11")
    if model == "lenet5" and args.models:
        raise ValueError("--models is a vgg11-train checkpoint; it does not go with --model lenet5")
    if args.L_m is not None and args.L_m < 0:
        raise ValueError(f"--L-m must be >= 0 or 'none', got {args.L_m}")
    if not (args.lr > 0 and 0 <= args.momentum < 1):
        raise ValueError(f"--lr must be > 0 and --momentum in [0, 1), got {args.lr} and {args.momentum}")
    if args.models:
        import pathlib

        if not pathlib.Path(args.models).is_file():
            raise FileNotFoundError(f"--models: {args.models} does not exist (a vgg11-train checkpoint)")
    return bench_cnn.network(model, width=args.width, prune=args.prune if model == "vgg11" else 0.0,
                             scheme=args.scheme, checkpoint=args.models, seed=args.seed)


def _batches(data, batch: int, count: int, seed: int, device, dtype):
    """``count`` distinct batches of the training set (one permutation of ``seed``), cycled by round."""
    n = len(data.y_train)
    if batch > n:
        raise ValueError(f"--batch {batch} exceeds the {n} training images of {data.name}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    pool = [(data.x_train[perm[(i * batch) % (n - batch + 1):][:batch]].to(device=device, dtype=dtype),
             data.y_train[perm[(i * batch) % (n - batch + 1):][:batch]].to(device)) for i in range(count)]
    return lambda i: pool[i % count]


def _meta(args, net, dev, **extra) -> dict:
    return dict(profile=args.profile, device=args.device_slug, device_type=dev.type, dtype=args.dtype,
                network=net.label, L_m="none" if args.L_m is None else args.L_m, drop_zeros=args.drop_zeros,
                threads=torch.get_num_threads(), flush_denormal=args.flush_denormal, **extra)


def _bench_cnn(args) -> int:
    from ..analysis.cnn import timing_summary
    from ..bench import cnn as bench_cnn

    rule = StopRule.from_args(args)
    net = _network(args)
    dev = setup(args)
    data = cifar.from_manifest(args.data, seed=args.seed)
    batches = _batches(data, args.batch, args.batches, args.seed, dev, DTYPES[args.dtype])
    rows, m, _ = bench_cnn.time_training(net, batches, rule, device=dev, dtype=DTYPES[args.dtype], lr=args.lr,
                                         momentum=args.momentum, L_m=args.L_m, drop_zeros=args.drop_zeros)
    df = pd.DataFrame(rows).assign(**_meta(args, net, dev, model=args.model, batch=args.batch, data=data.name,
                                            rounds=m.iters, stopped_by=m.stopped_by, timed_seconds=m.seconds,
                                            **rule.as_dict()))
    df["noisy"] = df["method"].map(m.noisy)
    io.write_csv(args.out, df)
    _print_timing(timing_summary(df), f"{args.model} B={args.batch}")
    return 0


def _print_timing(s: dict, what: str) -> None:
    def ci(t, scale=1e3, unit=" ms"):
        return f"{t[0] * scale:.3g}{unit} [{t[1] * scale:.3g}, {t[2] * scale:.3g}]"

    print(f"{what}: {s['rounds']} paired rounds; iteration autograd {ci(s['autograd_total'])}, BPPSA "
          f"{ci(s['bppsa_total'])}; backward autograd {ci(s['autograd_backward_total'])}, BPPSA "
          f"{ci(s['bppsa_backward_total'])}; BPPSA/autograd backward {ci(s['ratio_backward_total'], 1, '×')}; "
          f"BPPSA's backward: generation {s['share_jacobian']:.0%}, scan {s['share_scan']:.0%}, parameter "
          f"gradients {s['share_param_grads']:.0%}", file=sys.stderr)


def _retrain_scan(args) -> int:
    from ..analysis.cnn import flop_prediction, generation_share, step_table, timing_summary
    from ..bench import cnn as bench_cnn

    net = _network(args)
    if net.masks is None:
        raise ValueError("vgg11-retrain-scan retrains a pruned network: give --models or --prune > 0")
    dev = setup(args)
    data = cifar.from_manifest(args.data, seed=args.seed)
    dtype = DTYPES[args.dtype]
    batches = _batches(data, args.batch_size, args.iterations + 1, args.seed, dev, dtype)
    rule = StopRule(warmup=1, min_iters=args.iterations, min_seconds=0.0, max_iters=args.iterations,
                    max_seconds=1e12)
    rows, m, losses = bench_cnn.time_training(net, batches, rule, device=dev, dtype=dtype, lr=args.lr,
                                              momentum=args.momentum, L_m=args.L_m, drop_zeros=args.drop_zeros)
    meta = _meta(args, net, dev, model="vgg11", batch=args.batch_size, data=data.name, iterations=args.iterations)
    df = pd.DataFrame(rows).assign(**meta)
    loss = {(meth, i): v for meth, vals in losses.items() for i, v in enumerate(vals)}
    df["loss"] = [loss.get((meth, i)) for meth, i in zip(df["method"], df["iter"])]
    steps = pd.DataFrame(bench_cnn.profile_steps(net, batches, args.profile_iterations, device=dev, dtype=dtype,
                                                 lr=args.lr, momentum=args.momentum, L_m=args.L_m,
                                                 drop_zeros=args.drop_zeros))
    x0, y0 = batches(0)
    flops = pd.DataFrame(bench_cnn.static_step_flops(net, x0[0].cpu(), y0[0].cpu(), L_m=args.L_m,
                                                     drop_zeros=args.drop_zeros))
    table = step_table(steps, flops, args.batch_size)
    steps = steps.merge(flops[["phase", "d", "l", "r", "flop"]].rename(columns={"flop": "flop_per_sample"}),
                        on=["phase", "d", "l", "r"], how="left") if "phase" in steps else steps
    steps = steps.assign(flop_batch=steps.get("flop_per_sample", float("nan")) * args.batch_size, **meta)
    io.write_csv(args.out, df)
    io.write_csv(args.out_steps, steps)
    s = timing_summary(df)
    _print_timing(s, f"pruned VGG-11 retrained through the scan, B={args.batch_size}")
    pred = flop_prediction(table)
    print(f"time per scan step against its static FLOP: Spearman rho {pred['rho']:.2f} over {pred['n']} products "
          f"(one-sided p {pred['p']:.2g}), median {pred['s_per_gflop']:.3g} s/GFLOP; the Jacobian generation is "
          f"{generation_share(steps):.0%} of the profiled backward", file=sys.stderr)
    return 0


def _lenet5_curves(args) -> int:
    from .. import nn as bnn
    from ..models.cnn import lenet5, train_curves

    if not (args.lr > 0 and 0 <= args.momentum < 1):
        raise ValueError(f"--lr must be > 0 and --momentum in [0, 1), got {args.lr} and {args.momentum}")
    if args.L_m is not None and args.L_m < 0:
        raise ValueError(f"--L-m must be >= 0 or 'none', got {args.L_m}")
    dev = setup(args)
    data = cifar.from_manifest(args.data, seed=args.seed)
    methods = {"autograd": lambda net: net,
               "bppsa": lambda net: bnn.Sequential.from_torch(net, L_m=args.L_m)}

    def log(name, it, train, test):
        print(f"[{name}] iteration {it}: training loss {train:.6f}, test loss {test:.6f}", flush=True)

    rows = train_curves(lenet5, data, methods=methods, iterations=args.iterations, batch_size=args.batch_size,
                        lr=args.lr, momentum=args.momentum, test_every=args.test_every,
                        test_samples=args.test_samples, seed=args.seed, dtype=DTYPES[args.dtype], device=dev, log=log)
    df = pd.DataFrame(rows).assign(
        model="lenet5", dtype=args.dtype, batch=args.batch_size, lr=args.lr, momentum=args.momentum,
        L_m="none" if args.L_m is None else args.L_m, data=data.name, train_size=len(data.y_train),
        test_size=args.test_samples or len(data.y_test), profile=args.profile, device_slug=args.device_slug,
        threads=torch.get_num_threads())
    io.write_csv(args.out, df)
    return 0
