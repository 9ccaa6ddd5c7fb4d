"""``bppsa bench-membound``: the scan backward per backend against the GPU's memory-traffic bound
(:mod:`bppsa.bench.membound`); ``bppsa gpu-model``: the GPU layouts' bytes, FLOP, launches and predicted
time from the launch plan (:mod:`bppsa.backends.cuda.cost_model`), no GPU needed."""
from __future__ import annotations

import argparse

import torch

from .. import device as _device
from ..bench import membound
from ..io import write_csv
from ..precision import DTYPES
from .argtypes import positive_int


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
    """Comma-separated sizes, each checked by the parsers' shared :func:`positive_int`, naming ``what``."""
    try:
        return [positive_int(v) for v in text.split(",")]
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{what} must be >= 1: comma-separated positive integers, got {text!r} ({exc})") from None


def _seq_lens(text: str, input_size: int) -> list[tuple[int, int]]:
    """``--seq-len``: ``T`` or ``T:I`` items (I: that length's input size, as the GRU's MFCC sets have)."""
    out = []
    for item in text.split(","):
        T, _, I = item.partition(":")
        out.append((_ints(T, "--seq-len")[0], _ints(I, "--seq-len's input size")[0] if I else input_size))
    return out


def _case(text: str, hidden: int, input_size: int) -> tuple[str, list[tuple[int, int]], list[int], int]:
    """``--case CELL/SEQ_LENS/BATCHES[/HIDDEN]``, e.g. ``rnn/10,30,100/16`` or ``gru/259:38,1034:12/16,64``."""
    parts = text.split("/")
    if len(parts) not in (3, 4) or parts[0] not in ("rnn", "gru"):
        raise ValueError(f"--case {text!r}: CELL/SEQ_LENS/BATCHES[/HIDDEN] with CELL rnn or gru")
    H = _ints(parts[3], "--case's hidden size")[0] if len(parts) == 4 else hidden
    return parts[0], _seq_lens(parts[1], input_size), _ints(parts[2], "--case's batches"), H


def gpu_model_rows(cases, dtype: str, gpus: list[str], launch_s: float) -> list[dict]:
    """One row per GPU, case (cell, [(T, I)], [B], H), shape and layout."""
    from ..backends.cuda import cost_model

    itemsize = DTYPES[dtype].itemsize
    specs = [cost_model.parse_gpu(g) for g in gpus]
    return [cost_model.predict(layout, cell, T, B, H, I, itemsize, gpu, launch_s)
            for gpu in specs for cell, seq_lens, batches, H in cases for T, I in seq_lens for B in batches
            for layout in cost_model.LAYOUTS]


def gpu_model(args) -> int:
    import json

    import pandas as pd

    from ..backends.cuda import cost_model

    gpus = list(cost_model.GPUS) if args.gpu == "all" else args.gpu.split(",")
    if args.hidden < 1 or args.input_size < 1 or args.launch_us < 0:
        raise ValueError("--hidden and --input-size must be >= 1 and --launch-us >= 0")
    cases = ([_case(c, args.hidden, args.input_size) for c in args.case] if args.case else
             [(args.cell, _seq_lens(args.seq_len, args.input_size), _ints(args.batch, "--batch"), args.hidden)])
    rows = gpu_model_rows(cases, args.dtype, gpus, args.launch_us * 1e-6)
    if args.out:
        write_csv(args.out, pd.DataFrame(rows))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        print(f"{r['gpu']:>16} {r['cell']} T={r['seq_len']:<6} B={r['batch']:<4} {r['layout']:>9}: "
              f"{r['bytes'] / 1e6:10.1f} MB {r['flop'] / 1e9:8.2f} GFLOP {r['launches']:4d} launches "
              f"({r['min_threads_per_launch']}-{r['max_threads_per_launch']} threads) -> "
              f"{r['predicted_s'] * 1e3:8.3f} ms floor, expected {r['expected_s'] * 1e3:.3f} ms "
              f"(graphed {r['graph_s'] * 1e3:.3f} ms, most in {r['dominant']})")
    return 0


def measured_rows(bench, gpu, launch_s: float) -> list[dict]:
    """The GPU layouts measured by ``bppsa bench`` (the RNN's bench CSVs) beside the model's prediction.

    Measured: the median over iterations of the BPPSA variant's Jacobian (or factor) phase plus its backward
    phase, full mode, where the variant ran the CUDA kernels of a layout: ``bppsa-paper`` with backend cupy or
    cupy-factored (both run the faithful kernels for it), ``bppsa-fused`` with cupy-factored (the factored
    kernels).  Beside it: the model's bytes and FLOP over that time (achieved) and as a fraction of the GPU's
    peaks, and cuDNN's backward (``baseline``, ``baseline-packed``) of the same file."""
    from ..backends.cuda import cost_model

    full = bench[bench["mode"] == "full"]
    rows = []
    for (T, B), d in full.groupby(["seq_len", "batch"]):
        per_iter = d.groupby(["variant", "backend", "iter", "phase"])["seconds"].sum().unstack("phase")
        variants = per_iter.index.get_level_values("variant")
        base = {v: float(per_iter.loc[variants == v, "backward"].median()) for v in ("baseline", "baseline-packed")}
        for (variant, backend), it in per_iter.groupby(level=["variant", "backend"]):
            layout = cost_model.LAYOUT_OF.get((variant, backend))
            if layout is None:
                continue
            first = d[d["variant"] == variant].iloc[0]
            H, I = int(first["hidden"]), int(first["input_size"])
            seconds = float((it.get("jacobian", 0) + it["backward"]).median())
            itemsize = DTYPES[str(first["dtype"])].itemsize
            pred = cost_model.predict(layout, "rnn", int(T), int(B), H, I, itemsize, gpu, launch_s)
            rows.append({
                **{k: pred[k] for k in ("layout", "seq_len", "batch", "hidden", "input", "dtype", "gpu", "bytes",
                                        "flop", "launches", "predicted_s")},
                "variant": variant, "backend": backend, "measured_s": seconds,
                "measured_over_predicted": seconds / pred["predicted_s"],
                "expected_s": pred["expected_s"], "measured_over_expected": seconds / pred["expected_s"],
                "achieved_GBps": pred["bytes"] / seconds / 1e9,
                "achieved_GFLOPs": pred["flop"] / seconds / 1e9,
                "bandwidth_fraction": pred["bytes"] / seconds / (gpu.bandwidth_GBps * 1e9),
                "flops_fraction": pred["flop"] / seconds / gpu.peak_flops(itemsize),
                "cudnn_backward_s": base["baseline"], "cudnn_packed_backward_s": base["baseline-packed"],
                "speedup_vs_cudnn": base["baseline"] / seconds,
                "speedup_vs_cudnn_packed": base["baseline-packed"] / seconds,
            })
    return rows


def gpu_measured(args) -> int:
    import pandas as pd

    from ..backends.cuda import cost_model

    gpu = cost_model.parse_gpu(args.gpu)
    frames = []
    for path in args.bench:
        try:
            frames.append(pd.read_csv(path))
        except (OSError, pd.errors.ParserError) as exc:
            raise ValueError(f"--bench {path}: {exc}") from exc
    rows = measured_rows(pd.concat(frames, ignore_index=True), gpu, args.launch_us * 1e-6)
    if not rows:
        raise ValueError("no BPPSA variant in these bench CSVs ran the CUDA kernels (backend cupy or cupy-factored)")
    write_csv(args.out, pd.DataFrame(rows))
    for r in rows:
        print(f"T={r['seq_len']:<6} B={r['batch']:<4} {r['layout']:>9} ({r['backend']}): measured "
              f"{r['measured_s'] * 1e3:8.3f} ms, floor {r['predicted_s'] * 1e3:8.3f} ms "
              f"({r['measured_over_predicted']:.1f}x), expected {r['expected_s'] * 1e3:8.3f} ms "
              f"({r['measured_over_expected']:.2f}x); {r['achieved_GBps']:.0f} GB/s "
              f"({r['bandwidth_fraction']:.0%} of peak), {r['achieved_GFLOPs']:.0f} GFLOP/s "
              f"({r['flops_fraction']:.0%}); cuDNN {r['speedup_vs_cudnn']:.1f}x, packed "
              f"{r['speedup_vs_cudnn_packed']:.1f}x slower")
    return 0


def _add_launch_us(parser) -> None:
    from ..backends.cuda.cost_model import LAUNCH_S

    parser.add_argument("--launch-us", type=float, default=LAUNCH_S * 1e6,
                        help="assumed overhead per kernel launch (µs)")


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
    m.add_argument("--hidden", type=positive_int, default=20, help="hidden size H")
    m.add_argument("--input-size", type=positive_int, default=1, help="input size I (the bitstream RNN's is 1)")
    m.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    m.add_argument("--gpu", default="h100",
                   help="rtx2070, rtx2080ti, v100, a100, h100 (comma-separated, or 'all'), or numbers "
                        "GBps:FP32_TFLOPs[:FP64_TFLOPs[:SMs]]")
    m.add_argument("--case", action="append", default=[],
                   help="CELL/SEQ_LENS/BATCHES[/HIDDEN] (e.g. gru/259:38,1034:12/16,64), repeatable: these "
                        "instead of --cell, --seq-len, --batch")
    _add_launch_us(m)
    m.add_argument("--json", action="store_true", help="print a JSON list, one object per layout")
    m.add_argument("--out", default=None, help="also write the rows to this CSV (atomically)")
    m.set_defaults(func=gpu_model)

    g = subparsers.add_parser(
        "gpu-measured",
        help="the GPU layouts measured by `bppsa bench` against the cost model: achieved bytes/s and FLOP/s",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g.add_argument("--bench", nargs="+", required=True, help="the RNN's bench CSVs (results/<device>/rnn/bench_*.csv)")
    g.add_argument("--gpu", required=True, help="the GPU the benches ran on: a name of the model's table or numbers "
                                                "GBps:FP32_TFLOPs[:FP64_TFLOPs[:SMs]]")
    _add_launch_us(g)
    g.add_argument("--out", required=True, help="CSV to write (atomically)")
    g.set_defaults(func=gpu_measured)

    p = subparsers.add_parser(
        "bench-membound",
        help="time the scan backward per backend against the GPU's memory-traffic bound (CUDA only)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seq-len", type=positive_int, default=1000, help="sequence length T")
    p.add_argument("--batch", type=positive_int, default=16, help="batch size B")
    p.add_argument("--hidden", type=positive_int, default=20, help="hidden size H")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--layout", choices=["paper", "fused"], default="paper")
    p.add_argument("--L-m", dest="L_m", type=int, default=None,
                   help="up-sweep levels before a linear middle scan (default: full scan)")
    p.add_argument("--backends", default="cupy,torch", help="comma-separated backends to time")
    p.add_argument("--iters", type=positive_int, default=50, help="timed repeats")
    p.add_argument("--warmup", type=int, default=5, help="untimed repeats first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True, help="CSV to write (atomically)")
    p.set_defaults(func=bench_membound)
