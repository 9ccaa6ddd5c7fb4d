"""The BPPSA layers (bppsa.nn) on a CPU: the backward of a loss on every step (the per-step-gradient scan) beside the
loss on h_n alone (the paper's single seed), and eager autograd (torch.nn.RNN/GRU, the same weights) with the same
losses.  Methods interleaved round by round on the same batch (bppsa.bench.protocol); one CSV row per method and
round, then the medians and the paired ratios with their 95 % intervals.

    python scripts/bench_nn.py --model rnn --seq-len 1000 --batch 16 --threads 2 --out nn_speed.csv
"""
from __future__ import annotations

import argparse
import time

# isort: off
import bppsa.nn  # before torch: its OpenMP settings (bppsa.process)
import pandas as pd
import torch
# isort: on

from bppsa.bench.protocol import StopRule, interleave
from bppsa.stats import median_ci, ratio_ci


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("rnn", "gru"), default="rnn")
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=20)
    ap.add_argument("--input-size", type=int, default=None, help="default: 1 (rnn), 12 (gru: set L's features)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)  # as the bppsa commands do: the long products underflow
    I = a.input_size or (1 if a.model == "rnn" else 12)
    torch.manual_seed(0)
    layer = (bppsa.nn.RNN if a.model == "rnn" else bppsa.nn.GRU)(I, a.hidden, backend="cpu")
    ref = layer.to_torch()
    x = torch.randn(a.seq_len, a.batch, I)
    w = torch.randn(a.seq_len, a.batch, a.hidden)  # the per-step loss's weights: sum_t <w_t, h_t>

    def method(mod, per_step: bool):
        def run(i: int) -> dict:
            for p in mod.parameters():
                p.grad = None
            out, h_n = mod(x)
            loss = (out * w).sum() if per_step else (h_n[-1] * w[-1]).sum()
            t0 = time.perf_counter()
            loss.backward()
            return {"backward": time.perf_counter() - t0}
        return run

    methods = {"bppsa-single-seed": method(layer, False), "bppsa-per-step": method(layer, True),
               "autograd-single-seed": method(ref, False), "autograd-per-step": method(ref, True)}
    m = interleave(methods, StopRule(max_seconds=a.max_seconds), reference="bppsa-per-step", metric="backward")
    df = pd.DataFrame(m.rows).assign(model=a.model, seq_len=a.seq_len, batch=a.batch, hidden=a.hidden,
                                     threads=a.threads)
    df.to_csv(a.out, index=False)
    per = {k: df[(df.method == k) & (df.phase == "backward")].sort_values("iter")["seconds"].to_numpy()
           for k in methods}
    for k, v in per.items():
        med, lo, hi = median_ci(v)
        print(f"{k:22s} backward {med * 1e3:8.3f} ms [{lo * 1e3:.3f}, {hi * 1e3:.3f}]  n={len(v)}")
    for num, den in (("bppsa-per-step", "bppsa-single-seed"), ("autograd-per-step", "bppsa-per-step"),
                     ("autograd-single-seed", "bppsa-single-seed")):
        r, lo, hi = ratio_ci(per[num], per[den])
        print(f"{num} / {den}: {r:.2f}x [{lo:.2f}, {hi:.2f}]")


if __name__ == "__main__":
    main()
