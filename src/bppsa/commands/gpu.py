"""``bppsa bench-membound``: the scan backward per backend against the GPU's memory-traffic bound
(:mod:`bppsa.bench.membound`); ``bppsa gpu-model``: the GPU layouts' bytes, FLOP, launches and predicted
time from the launch plan (:mod:`bppsa.backends.cuda.model`), no GPU needed."""
from __future__ import annotations

import argparse

import torch

from .. import device as _device
from ..bench import membound
from ..io import write_csv
from ..precision import DTYPES


def bench_membound(args) -> int:
    import pandas as pd

    if not torch.cuda.is_available():
        raise RuntimeError("bench-membound measures GPU memory traffic and needs a CUDA GPU; none is available")
    dev = _device.resolve(args.device)
    if dev.type != "cuda":
        raise RuntimeError(f"bench-membound needs a CUDA device, got '{args.device}'")
    torch.cuda.set_device(dev)
    if args.iters < 1 or min(args.seq_len, args.batch, args.hidden) < 1:
        raise ValueError("--iters, --seq-len, --batch and --hidden must be >= 1")
    rows = membound.measure(dev, args.backends.split(","), args.seq_len, args.batch, args.hidden, DTYPES[args.dtype],
                            args.layout, args.L_m, args.iters, args.warmup, args.seed)
    write_csv(args.out, pd.DataFrame(rows))
    for r in rows:
        print(f"{r['backend']:>5}: scan {r['scan_seconds_mean'] * 1e3:.3f} ± {r['scan_seconds_std'] * 1e3:.3f} ms, "
              f"{r['achieved_GBps']:.1f} GB/s of {r['copy_bandwidth_GBps']:.1f} GB/s copy bandwidth, "
              f"{r['ratio_to_bound']:.2f}× the bound")
    return 0


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{what}: comma-separated integers, got {text!r}") from None
    if min(vals) < 1:
        raise ValueError(f"{what} must be >= 1, got {text!r}")
    return vals


def _seq_lens(text: str, input_size: int) -> list[tuple[int, int]]:
    """``--seq-len``: ``T`` or ``T:I`` items (I: that length's input size, as the GRU's MFCC sets have)."""
    out = []
    for item in text.split(","):
        T, _, I = item.partition(":")
        out.append((_ints(T, "--seq-len")[0], _ints(I, "--seq-len's input size")[0] if I else input_size))
    return out


def gpu_model_rows(cell: str, seq_lens: list[tuple[int, int]], batches: list[int], hidden: int, dtype: str,
                   gpus: list[str], launch_s: float) -> list[dict]:
    from ..backends.cuda import model

    itemsize = DTYPES[dtype].itemsize
    specs = [model.parse_gpu(g) for g in gpus]
    return [model.predict(layout, cell, T, B, hidden, I, itemsize, gpu, launch_s)
            for gpu in specs for T, I in seq_lens for B in batches for layout in model.LAYOUTS]


def gpu_model(args) -> int:
    import json

    import pandas as pd

    gpus = list(_gpu_keys()) if args.gpu == "all" else args.gpu.split(",")
    if args.hidden < 1 or args.input_size < 1 or args.launch_us < 0:
        raise ValueError("--hidden and --input-size must be >= 1 and --launch-us >= 0")
    rows = gpu_model_rows(args.cell, _seq_lens(args.seq_len, args.input_size), _ints(args.batch, "--batch"),
                          args.hidden, args.dtype, gpus, args.launch_us * 1e-6)
    if args.out:
        write_csv(args.out, pd.DataFrame(rows))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"{r['gpu']:>16} {r['cell']} T={r['seq_len']:<6} B={r['batch']:<4} {r['layout']:>9}: "
              f"{r['bytes'] / 1e6:10.1f} MB {r['flop'] / 1e9:8.2f} GFLOP {r['launches']:4d} launches "
              f"({r['min_threads_per_launch']}-{r['max_threads_per_launch']} threads) -> "
              f"{r['predicted_s'] * 1e3:8.3f} ms")
    return 0


def _gpu_keys():
    from ..backends.cuda import model

    return model.GPUS


def register(subparsers) -> None:
    m = subparsers.add_parser(
        "gpu-model",
        help="the GPU layouts' bytes, FLOP, launches and predicted time from the launch plan (no GPU needed)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m.add_argument("--cell", choices=["rnn", "gru"], default="rnn")
    m.add_argument("--seq-len", default="30000",
                   help="sequence length T, or T:I with that length's input size (comma-separated for several)")
    m.add_argument("--batch", default="16", help="batch size B (comma-separated for several)")
    m.add_argument("--hidden", type=int, default=20, help="hidden size H")
    m.add_argument("--input-size", type=int, default=1, help="input size I (the bitstream RNN's is 1)")
    m.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    m.add_argument("--gpu", default="h100",
                   help="rtx2070, rtx2080ti, v100, a100, h100 (comma-separated, or 'all'), or numbers "
                        "GBps:FP32_TFLOPs[:FP64_TFLOPs[:SMs]]")
    m.add_argument("--launch-us", type=float, default=3.0, help="assumed overhead per kernel launch (µs)")
    m.add_argument("--json", action="store_true", help="print a JSON list, one object per layout")
    m.add_argument("--out", default=None, help="also write the rows to this CSV (atomically)")
    m.set_defaults(func=gpu_model)

    p = subparsers.add_parser(
        "bench-membound",
        help="time the scan backward per backend against the GPU's memory-traffic bound (CUDA only)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seq-len", type=int, default=1000, help="sequence length T")
    p.add_argument("--batch", type=int, default=16, help="batch size B")
    p.add_argument("--hidden", type=int, default=20, help="hidden size H")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--layout", choices=["paper", "fused"], default="paper")
    p.add_argument("--L-m", dest="L_m", type=int, default=None,
                   help="up-sweep levels before a linear middle scan (default: full scan)")
    p.add_argument("--backends", default="cupy,torch", help="comma-separated backends to time")
    p.add_argument("--iters", type=int, default=50, help="timed repeats")
    p.add_argument("--warmup", type=int, default=5, help="untimed repeats first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, help="CSV to write (atomically)")
    p.set_defaults(func=bench_membound)
