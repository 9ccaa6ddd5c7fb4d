"""`bppsa vgg11-train` and `bppsa vgg11-flops`: the pruned VGG-11 micro-benchmark of Sec 4.3 and 5.3."""
from __future__ import annotations

import dataclasses
import pickle
import resource
import time

import numpy as np
import pandas as pd
import torch

from .. import flops as fl
from .. import io, paper
from ..data import cifar
from ..models import vgg
from .argtypes import positive_int
from .common import add_runtime_args, optional_int, setup


def _data_args(p) -> None:
    p.add_argument("--data", required=True, help="CIFAR-10 manifest written by `bppsa make-cifar10`")


def register(sub) -> None:
    p = sub.add_parser("make-cifar10", help="CIFAR-10 for VGG-11: download (resumed, MD5-checked), stand-in or a "
                       "path; checks every batch and writes the manifest training reads")
    p.add_argument("--source", required=True, help="download | standin | <path to the tarball or "
                   "cifar-10-batches-py> (config cifar10.source)")
    p.add_argument("--root", required=True, help="where the download goes and is unpacked (config cifar10.root)")
    p.add_argument("--url", default=cifar.URL, help="where to download from (config cifar10.url; a mirror)")
    p.add_argument("--md5", default=cifar.MD5, help="the tarball's MD5 (config cifar10.md5)")
    p.add_argument("--out", required=True, help="manifest JSON (the rule's output)")
    p.set_defaults(func=_make_cifar10)

    p = sub.add_parser("vgg11-train",
                       help="train VGG-11, prune it by magnitude, retrain with masks held; accuracies (CSV)")
    _data_args(p)
    p.add_argument("--width", type=float, required=True, help="conv width multiplier (1.0 = the real VGG-11)")
    p.add_argument("--epochs", type=positive_int, required=True, help="training epochs (the paper: 100)")
    p.add_argument("--retrain-epochs", type=positive_int, required=True,
                   help="retraining epochs after pruning (the paper: 100)")
    p.add_argument("--batch-size", type=positive_int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--weight-decay", type=float, required=True)
    p.add_argument("--no-augment", dest="augment", action="store_false")
    p.add_argument("--prune", type=float, required=True, help="fraction of conv and linear weights pruned")
    p.add_argument("--scheme", choices=vgg.SCHEMES, required=True)
    p.add_argument("--out-models", required=True, help="checkpoint with the trained and the pruned-retrained weights")
    p.add_argument("--out", required=True, help="accuracy CSV")
    add_runtime_args(p)
    p.set_defaults(func=_train)

    p = sub.add_parser("vgg11-flops", help="static FLOP analysis of BPPSA and the BP baseline over CSR Jacobians (CSV)")
    _data_args(p)
    p.add_argument("--models", default=None, help="checkpoint from vgg11-train (omit with --untrained)")
    p.add_argument("--untrained", action="store_true",
                   help="analyse a freshly initialised network pruned by magnitude instead (a budget check only)")
    p.add_argument("--width", type=float, default=1.0, help="with --untrained: width multiplier")
    p.add_argument("--prune", type=float, default=0.97, help="with --untrained: pruned fraction")
    p.add_argument("--scheme", choices=vgg.SCHEMES, default="class-uniform")
    p.add_argument("--networks", nargs="+", choices=["pruned", "dense"], required=True)
    p.add_argument("--samples", type=positive_int, required=True,
                   help="test images analysed (one batch, one scan per sample)")
    p.add_argument("--L-m", dest="L_m", type=optional_int, required=True,
                   help="up-sweep levels before the linear middle scan (the paper: L0-L2, i.e. 2; 'none' = full)")
    p.add_argument("--keep-zeros", dest="drop_zeros", action="store_false",
                   help="count input-dependent zeros as stored (default: every zero value is skipped)")
    p.add_argument("--dense-limit-gb", type=float, required=True,
                   help="memory cap of the dense-GEMM fast path of a product")
    p.add_argument("--out", required=True, help="per-product CSV")
    p.add_argument("--out-summary", default=None, help="per-sample totals and the run's time and peak memory (CSV)")
    add_runtime_args(p)
    p.set_defaults(func=_flops)


def _make_cifar10(args) -> int:
    m = cifar.prepare(args.source, args.root, args.out, url=args.url, md5=args.md5)
    print(f"{args.out}: {m['source']}" + (f" in {m['folder']}" if m["folder"] else ""))
    return 0


def _train(args) -> int:
    dev = setup(args)
    torch.manual_seed(args.seed)
    data = cifar.from_manifest(args.data, seed=args.seed)
    model = vgg.VGG11(width=args.width).to(dev)
    cfg = vgg.TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                          augment=args.augment, seed=args.seed)
    rows = []

    def log(phase):
        return lambda r: print(f"[{phase}] epoch {r['epoch']}: loss {r['train_loss']:.4f} ({r['seconds']:.1f} s)",
                               flush=True)

    def final_loss(hist):
        return hist[-1]["train_loss"] if hist else float("nan")

    t0 = time.perf_counter()
    hist = vgg.train(model, data.x_train, data.y_train, cfg, log=log("train"))
    acc_dense = vgg.accuracy(model, data.x_test, data.y_test)
    rows.append(dict(network="dense", stage="trained", epochs=args.epochs, top1=acc_dense,
                     seconds=time.perf_counter() - t0, final_train_loss=final_loss(hist),
                     pruned_fraction=vgg.pruned_fraction(model)["all"]))
    dense_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    masks = vgg.magnitude_masks(model, args.prune, args.scheme)
    vgg.apply_masks(model, masks)
    rows.append(dict(network="pruned", stage="pruned, before retraining", epochs=0,
                     top1=vgg.accuracy(model, data.x_test, data.y_test), seconds=0.0, final_train_loss=float("nan"),
                     pruned_fraction=vgg.pruned_fraction(model)["all"]))
    t0 = time.perf_counter()
    hist = vgg.train(model, data.x_train, data.y_train, dataclasses.replace(cfg, epochs=args.retrain_epochs),
                     masks=masks, log=log("retrain"))
    frac = vgg.pruned_fraction(model)
    rows.append(dict(network="pruned", stage="retrained", epochs=args.retrain_epochs,
                     top1=vgg.accuracy(model, data.x_test, data.y_test), seconds=time.perf_counter() - t0,
                     final_train_loss=final_loss(hist), pruned_fraction=frac["all"]))
    df = pd.DataFrame(rows)
    df["paper_top1"] = df["stage"].map(paper.VGG11_TOP1_BY_STAGE)  # the paper's CIFAR-10 accuracies, for reference
    df["data"], df["width"], df["prune"], df["scheme"] = data.name, args.width, args.prune, args.scheme
    df["profile"], df["device_slug"] = args.profile, args.device_slug
    df["train_size"], df["test_size"] = len(data.y_train), len(data.y_test)
    df["per_layer_pruned"] = "; ".join(f"{k}={v:.4f}" for k, v in frac.items() if k != "all")
    print(df[["network", "stage", "top1", "paper_top1", "pruned_fraction"]].to_string(index=False))
    with io.atomic_path(args.out_models, suffix=".pt") as tmp:
        torch.save({"width": args.width, "data": data.name, "dense": dense_state,
                    "pruned": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                    "masks": masks, "prune": args.prune, "scheme": args.scheme}, tmp)
    io.write_csv(args.out, df)
    return 0


def _networks(args) -> tuple[dict[str, vgg.VGG11], str | None]:
    if args.untrained:
        torch.manual_seed(args.seed)
        dense = vgg.VGG11(width=args.width)
        pruned = vgg.VGG11(width=args.width)
        pruned.load_state_dict(dense.state_dict())
        vgg.apply_masks(pruned, vgg.magnitude_masks(pruned, args.prune, args.scheme))
        return {"dense": dense, "pruned": pruned}, None
    if not args.models:
        raise ValueError("vgg11-flops needs --models (a vgg11-train checkpoint) or --untrained")
    try:  # tensors and plain values only: a checkpoint is never a program
        ck = torch.load(args.models, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        why = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), "")
        raise ValueError(f"{args.models}: refused by torch.load(weights_only=True), which admits only tensors "
                         f"and plain values; a vgg11-train checkpoint holds nothing else ({why})") from None
    nets = {}
    for name in ("dense", "pruned"):
        m = vgg.VGG11(width=ck["width"])
        m.load_state_dict(ck[name])
        nets[name] = m
    args.width, args.prune, args.scheme = ck["width"], ck["prune"], ck["scheme"]
    return nets, ck["data"]


def _flops(args) -> int:
    setup(args)
    if args.samples < 1:
        raise ValueError("--samples must be >= 1")
    t_start = time.perf_counter()
    nets, trained_on = _networks(args)
    data = cifar.from_manifest(args.data, seed=args.seed)
    if trained_on is not None and trained_on != data.name:
        raise ValueError(f"the models were trained on '{trained_on}' but {args.data} gives '{data.name}'")
    x, y = data.x_test[: args.samples], data.y_test[: args.samples]
    dtype = np.float64 if args.dtype == "float64" else np.float32
    gemm_kw = dict(dense_limit_bytes=int(args.dense_limit_gb * 2**30))
    records, summary = [], []
    for net in args.networks:
        model = nets[net].double() if dtype == np.float64 else nets[net].float()
        model.eval()
        xb = x.to(next(model.parameters()).dtype).requires_grad_(False)
        feats = model.features(xb).detach().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(model.classifier(feats.flatten(1)), y)  # one real batch
        (g,) = torch.autograd.grad(loss, feats)
        for s in range(args.samples):
            t0 = time.perf_counter()
            res = fl.analyse_sample(model.features, xb[s].detach(), g[s], args.L_m, drop_zeros=args.drop_zeros,
                                    dtype=dtype, **gemm_kw)
            secs = time.perf_counter() - t0
            records += fl.ops_records(res["ops"], network=net, sample=s)
            summary.append(dict(network=net, sample=s, seconds=secs, **fl.flop_summary(res["ops"])))
            last = summary[-1]
            print(f"[{net}] sample {s}: {secs:.1f} s; BPPSA critical path {last['bppsa_critical_flop']:.3g} FLOP "
                  f"(max step {last['bppsa_max_step_flop']:.3g}), BP {last['baseline_total_flop']:.3g} FLOP "
                  f"(max step {last['baseline_max_step_flop']:.3g})", flush=True)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    meta = dict(profile=args.profile, device_slug=args.device_slug, data=data.name, width=args.width, prune=args.prune,
                scheme=args.scheme, L_m="none" if args.L_m is None else args.L_m, drop_zeros=args.drop_zeros,
                models="untrained, pruned by magnitude" if args.untrained else "trained / pruned-retrained")
    df = pd.DataFrame(records).assign(**meta)
    io.write_csv(args.out, df)
    if args.out_summary:
        sm = pd.DataFrame(summary).assign(**meta, run_seconds=time.perf_counter() - t_start, peak_rss_gb=peak_gb,
                                          threads=torch.get_num_threads())
        io.write_csv(args.out_summary, sm)
    print(f"total {time.perf_counter() - t_start:.1f} s, peak RSS {peak_gb:.2f} GiB", flush=True)
    return 0
