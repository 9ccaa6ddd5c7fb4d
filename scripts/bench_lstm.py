"""The LSTM's backward on a CPU: the compiled kernel's LSTM kind against torch's eager autograd of torch.nn.LSTM.

    python scripts/bench_lstm.py --seq-len 1000 --batch 16 --hidden 20 --input 1 --threads 1 2 --out lstm.csv

One process, one thread count at a time (``--threads``, torch's and the kernel's team's), every method one iteration
per round in a rotated order (:func:`bppsa.bench.protocol.interleave`), on the same weights and batch:

* ``autograd``, ``autograd-every``: ``loss.backward()`` through ``torch.nn.LSTM`` (torch's default CPU path, oneDNN
  where torch takes it), the loss on h_T or on every h_t; the forward (with autograd's graph) runs before each timed
  backward, untimed;
* ``autograd-nodnn``, ``autograd-nodnn-every``: the same under ``torch.backends.mkldnn.flags(enabled=False)``;
* ``kernel-torch-L0``, ``kernel-torch-tree`` (loss on h_T): what an LSTM layer's backward does on the CPU fast path
  from the forward's states h, c with torch's factors: the gates recomputed (``gates``:
  bppsa.jacobians.lstm.lstm_gates), the chain's factors written by torch (``factors``: LstmChain.from_states) and
  ``CpuBackend.cell_grads`` (``scan``: one kernel call that scans and sums every parameter's gradient), L_m = 0 (the
  linear scan) or the full tree (L_m None);
* ``kernel-L0``, ``kernel-tree`` (loss on h_T) and ``kernel-every-L0``, ``kernel-every-tree`` (on every h_t: the
  affine scan): the same with the kernel's own gate pass (``lstm_jacobians_t(..., states=LstmStates(...))``: the
  chain's set-up is ``factors``, the gate pass runs in the scan's call, ``scan``).

Each method's gradients are checked against autograd's first (fp32: 1e-4, relative to the largest).  The report
gives each method's median with its 95 % interval, its paired ratio to ``autograd`` (> 1: faster than autograd), the
phases' medians, the plan the kernel's team ran, and the load average before and after (this is not an idle-machine
benchmark unless the load says so).
"""
from __future__ import annotations

# isort: off
import bppsa  # noqa: F401 - before torch: its OpenMP settings (bppsa.process)
# isort: on

import argparse
import contextlib
import functools
import os
import platform
import time

import pandas as pd
import torch

from bppsa import scan
from bppsa.backends.chain import LstmChain, LstmStates
from bppsa.backends.cpu import CpuBackend, plan
from bppsa.backends.cpu.chain import synthetic
from bppsa.bench.protocol import StopRule, interleave
from bppsa.jacobians.lstm import lstm_gates
from bppsa.nn.cells import CELLS, Weights


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=20)
    ap.add_argument("--input", type=int, default=1)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--min-iters", type=int, default=20)
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--out", default=None, help="CSV of every (threads, method, iter, phase, seconds)")
    a = ap.parse_args(argv)
    T, B, H, I = a.seq_len, a.batch, a.hidden, a.input
    gen = torch.Generator().manual_seed(0)
    lstm = torch.nn.LSTM(I, H)
    x = torch.randn(T, B, I, generator=gen)
    w = torch.randn(T, B, H, generator=gen)
    params = dict(lstm.named_parameters())
    W = [params[k].detach() for k in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")]
    h, c = CELLS["lstm"].forward(x, None, None, Weights(*W), None)  # every h_t and c_t (the cell's torch twin)
    g = torch.cat([w[-1], torch.zeros(B, H)], -1)  # ∇[h_T; c_T]
    direct = torch.cat([w.flip(0)[1:], torch.zeros(T - 1, B, H)], -1)  # ∂l/∂s_{T-1-k} entering after J_k
    direct = torch.cat([direct, torch.zeros(1, B, 2 * H)]).contiguous()
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"mkldnn available {torch.backends.mkldnn.is_available()}; T={T} B={B} H={H} I={I} fp32")

    def autograd(every: bool, dnn: bool):
        def run(_i):
            lstm.zero_grad(set_to_none=True)
            with contextlib.nullcontext() if dnn else torch.backends.mkldnn.flags(enabled=False):
                out, _ = lstm(x)
                loss = (out * w).sum() if every else (out[-1] * w[-1]).sum()
                t0 = time.perf_counter()
                loss.backward()
                t1 = time.perf_counter()
            return {"backward": t1 - t0}
        return run

    be = CpuBackend()

    st = LstmStates(c, W[0], W[2], W[3])

    def kernel(every: bool, L_m, box=None, fill=True):
        def run(_i):
            t0 = time.perf_counter()
            gates = None if fill else lstm_gates(x, h, c, *W)
            t1 = time.perf_counter()
            if fill:
                chain = be.lstm_jacobians_t(x, h, None, W[1], states=st)
            else:
                chain = LstmChain.from_states(x, gates, W[1],
                                              out=lambda shape: be.workspace.get(("factors", "lstm"), shape, h))
            t2 = time.perf_counter()
            grads = be.cell_grads(g, chain, L_m, None, c=direct if every else None)
            t3 = time.perf_counter()
            if box is not None:
                box.update(grads)
            phases = {"factors": t2 - t1, "scan": t3 - t2}
            return phases if fill else {"gates": t1 - t0, **phases}
        return run

    methods = {"autograd": autograd(False, True), "autograd-nodnn": autograd(False, False),
               "autograd-every": autograd(True, True), "autograd-nodnn-every": autograd(True, False),
               "kernel-torch-L0": kernel(False, 0, fill=False), "kernel-torch-tree": kernel(False, None, fill=False),
               "kernel-L0": kernel(False, 0), "kernel-tree": kernel(False, None),
               "kernel-every-L0": kernel(True, 0), "kernel-every-tree": kernel(True, None)}
    rows = []
    for p in a.threads:
        torch.set_num_threads(p)
        # the gradients first: every kernel method against autograd's
        for every in (False, True):
            autograd(every, True)(0)
            want = {k: v.grad.clone() for k, v in params.items()}
            lstm.zero_grad(set_to_none=True)
            out, _ = lstm(x)
            print(f"# threads {p}, loss on {'every h_t' if every else 'h_T'}: autograd's graph ends in "
                  f"{type(out.grad_fn).__name__}", end="")
            with torch.backends.mkldnn.flags(enabled=False):
                out, _ = lstm(x)
            print(f" ({type(out.grad_fn).__name__} without oneDNN)")
            for L_m in (0, None):
                for fill in (True, False):
                    box = {}
                    kernel(every, L_m, box, fill)(0)
                    err = max(((box[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)
                    assert err <= 1e-4, (p, every, L_m, fill, err)
                    print(f"#   kernel L_m={L_m} ({'kernel' if fill else 'torch'} factors): gradients within "
                          f"{err:.1e} of autograd's")
        make = functools.partial(synthetic, "lstm", T, B, 2 * H, I, torch.float32)
        ran = [plan.choose("lstm", T, B, 2 * H, I, torch.float32, L, "auto", True, p, make).describe()
               for L in (scan.tree_levels(T + 1, None), 0)]  # what team_for chose (kept per shape)
        print(f"# threads {p}: the plans the kernel ran: full tree {ran[0]}; L_m = 0 {ran[1]}")
        load0 = os.getloadavg()
        m = interleave(methods, StopRule(warmup=3, min_iters=a.min_iters, min_seconds=2.0, max_iters=200,
                                         max_seconds=a.max_seconds), reference="autograd")
        load1 = os.getloadavg()
        print(f"# threads {p}: {m.iters} rounds ({m.stopped_by}), load average {load0[0]:.1f} before, "
              f"{load1[0]:.1f} after")
        for name in methods:
            med, lo, hi = m.ci(name)
            r, rlo, rhi = m.ratio("autograd", name) if name != "autograd" else (1.0, 1.0, 1.0)
            phases = sorted({row["phase"] for row in m.rows if row["method"] == name})
            ph = ", ".join(f"{q} {float(pd.Series(m.series(name, q)).median()) * 1e3:.2f}" for q in phases)
            print(f"{p} {name:22s} {med * 1e3:9.2f} ms [{lo * 1e3:.2f}, {hi * 1e3:.2f}]  "
                  f"autograd/it {r:6.2f} [{rlo:.2f}, {rhi:.2f}]{'  NOISY' if m.noisy[name] else ''}   ({ph})")
        rows += [{"threads": p, **row} for row in m.rows]
    if a.out:
        pd.DataFrame(rows).to_csv(a.out, index=False)


if __name__ == "__main__":
    main()
