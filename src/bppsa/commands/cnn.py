"""`bppsa lenet5-curves`: Fig 6, LeNet-5 trained through autograd and through BPPSA (``bppsa.nn.Sequential``)."""
from __future__ import annotations

import pandas as pd
import torch

from .. import io
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
