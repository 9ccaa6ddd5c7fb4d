"""The layers of bppsa.nn against their torch.nn twins on a CPU: forward, backward and a training step (forward,
backward, SGD), interleaved round by round on the same weights and batch (bppsa.bench.layers); one CSV row per
method, round and phase, then the medians and the paired ratios with their 95 % intervals.

    python scripts/bench_nn.py --layer lstm --seq-len 1000 --batch 16 --threads 2 --loss hn --L-m none 0 2 \
        --out lstm_nn.csv
"""
from __future__ import annotations

import argparse

# isort: off
import bppsa.nn  # noqa: F401 - before torch: its OpenMP settings (bppsa.process)
import torch
# isort: on

from bppsa import io, process
from bppsa.bench import layers
from bppsa.bench.protocol import StopRule


def _L(v: str):
    v = v.lower()
    return None if v == "none" else v if v == "auto" else int(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", choices=tuple(layers.LAYERS), default="rnn")
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=20)
    ap.add_argument("--input-size", type=int, default=1)
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--loss", choices=("hn", "steps"), default="hn")
    ap.add_argument("--L-m", type=_L, nargs="+", default=["auto"],
                    help="the bppsa layers' L_m (auto, the layers' default: the backend's choice; none: the full tree, "
                         "named -tree; an int)")
    ap.add_argument("--parallel-forward", dest="forwards", nargs="+", default=["none"],
                    choices=("none", "true", "false"), help="the bppsa layers' parallel_forward (none: where it pays)")
    ap.add_argument("--jax", action="store_true", help="also JAX's jitted training step (one-layer RNNs; needs jax)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--keep-denormals", dest="flush_denormal", action="store_false",
                    help="keep subnormal floats (a user's default mode; flushing is the default, as in the commands)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(a.flush_denormal)  # flushed by default, as the commands: the long products underflow
    process.keep_large_blocks()  # as the bppsa commands: the [T, B, H] outputs made every round are not faulted anew
    forwards = tuple({"none": None, "true": True, "false": False}[f] for f in a.forwards)
    df = layers.run(a.layer, a.seq_len, a.batch, a.hidden, a.input_size, a.num_layers, a.loss, tuple(a.L_m),
                    StopRule(max_seconds=a.max_seconds), forwards=forwards, device=a.device, jax=a.jax)
    io.write_csv(a.out, df)
    s = layers.summary(df)
    print(s.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    io.write_csv(a.out.replace(".csv", "") + "_summary.csv", s)


if __name__ == "__main__":
    main()
