"""The recurrent layers' forward on a CPU: the compiled forward against torch's, and the sliced forward against the
compiled one (``scripts/bench_forward.py``; the kernels: :mod:`bppsa.backends.cpu.forward` and ``.sliced``).

Two experiments, each configuration's methods timed in one process, interleaved round by round on the same layer
and inputs (:func:`bppsa.bench.protocol.interleave`); a speedup is the median of the paired per-round ratios with
its distribution-free 95 % interval:

- ``compiled``: ``torch`` (the torch.nn module's own forward under no_grad, oneDNN as it comes: for the LSTM its
  fused kernel) against ``compiled`` (:func:`~bppsa.backends.cpu.forward.compiled_forward`), both on ``threads``;
- ``sliced``: ``compiled-1`` (the compiled forward on one thread: the reference), ``compiled-p`` (on ``threads``:
  the batch split) and ``sliced-p`` (:func:`~bppsa.backends.cpu.sliced.sliced_forward`, ``slices`` slices on
  ``threads``, meeting bitwise; ``sliced-p-cell`` at the cell's own criterion where it is not bitwise, the one the
  layers use, ``Cell.meet_ulps``: the tanh RNN's two ulps; ``sliced-p-tol`` with a tolerance), for a layer that
  forgets (torch's init) and one that remembers (:func:`make_layer`: the LSTM's forget gates' and the GRU's update
  gates' biases raised by 6; the RNNs with W_hh = 0.999 · orthogonal, no biases and W_ih / 100, so that the states
  stay small: a start is still felt after 3000 steps).

Inputs are the paper's bitstreams (x_t ~ Bernoulli(0.05 + 0.1 c)).  Rows (one per method, round and phase):
``experiment``, ``cell``, ``layer`` (forgets / remembers), ``T``, ``B``, ``H``, ``I``, ``dtype``, ``threads``,
``method``, ``iter``, ``phase`` (``forward``: wall-clock, the metric; ``cpu``: the calling thread's CPU time, all the
work of a one-thread method, less sensitive to other processes), ``seconds``.  The summary: per configuration and
method the median and its interval, the paired ratio against the reference (``torch`` / ``compiled-1``) with its
interval (and the paired ratio of CPU times, meaningful where both methods ran on one thread), ``noisy``, the load
average before and after, and the sliced forward's last stats (sweeps, meeting steps, hand-off).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pandas as pd
import torch

from ..backends.cpu import forward, sliced
from ..data import bitstream
from .protocol import StopRule, interleave

__all__ = ["LAYERS", "make_layer", "bench_compiled", "bench_sliced", "run"]

LAYERS = ("forgets", "remembers")
_TORCH = {"rnn_tanh": ("RNN", {"nonlinearity": "tanh"}), "rnn_relu": ("RNN", {"nonlinearity": "relu"}),
          "gru": ("GRU", {}), "lstm": ("LSTM", {})}


def make_layer(cell: str, I: int, H: int, dtype: torch.dtype, layer: str = "forgets", seed: int = 0):
    """The torch.nn module of ``cell``: torch's init (it forgets its start within tens to hundreds of steps), or
    changed so that it remembers (its recurrence kept near the identity)."""
    torch.manual_seed(seed)
    name, kw = _TORCH[cell]
    m = getattr(torch.nn, name)(I, H, dtype=dtype, **kw)
    if layer == "remembers":
        with torch.no_grad():
            if cell == "lstm":  # gates i, f, g, o: forget gates ~ sigmoid(6) = 0.9975
                m.bias_ih_l0[H:2 * H] += 6.0
            elif cell == "gru":  # gates r, z, n: h' ~ z h with z ~ 0.9975
                m.bias_ih_l0[H:2 * H] += 6.0
            else:  # a near-linear, near-orthogonal recurrence: the states stay small, where tanh' ~ 1
                q, _ = torch.linalg.qr(torch.randn(H, H, dtype=dtype))
                m.weight_hh_l0.copy_(0.999 * q)
                m.weight_ih_l0.mul_(0.01)
                m.bias_ih_l0.zero_()
                m.bias_hh_l0.zero_()
    elif layer != "forgets":
        raise ValueError(f"layer must be one of {LAYERS} (got {layer!r})")
    return m


def _weights(m):
    return (m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0)


def _inputs(T: int, B: int, dtype, seed: int = 0):
    bits, y = bitstream.generate(T, B, seed=seed, progress=False)
    return bitstream.batch(bits, y, T, np.arange(B), dtype=dtype)[0]


def _timed(fn):
    """One round: the call's wall-clock seconds (``forward``, the metric) and the calling thread's CPU seconds
    (``cpu``: all of a one-thread method's work, without the time the host gave to other processes)."""
    def once(_i):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), time.thread_time()
        return {"forward": t1 - t0, "cpu": c1 - c0}
    return once


def _config(experiment, cell, layer, T, B, H, I, dtype, threads) -> dict:
    return {"experiment": experiment, "cell": cell, "layer": layer, "T": T, "B": B, "H": H, "I": I,
            "dtype": str(dtype).removeprefix("torch."), "threads": threads}


def _collect(cfg: dict, meas, reference: str, extra: dict | None = None):
    rows = [{**cfg, "method": r["method"], "iter": r["iter"], "phase": r["phase"], "seconds": r["seconds"]}
            for r in meas.rows]
    summary = []
    for method in dict.fromkeys(r["method"] for r in meas.rows):
        med, lo, hi = meas.ci(method, "forward")
        row = {**cfg, "method": method, "iters": meas.iters, "median_s": med, "ci_lo_s": lo, "ci_hi_s": hi,
               "cpu_median_s": meas.ci(method, "cpu")[0], "noisy": meas.noisy[method], "reference": reference}
        if method != reference:
            r, rlo, rhi = meas.ratio(reference, method, "forward")
            row.update(speedup=r, speedup_lo=rlo, speedup_hi=rhi,
                       cpu_speedup=meas.ratio(reference, method, "cpu")[0])
        summary.append({**row, **(extra or {})})
    return rows, summary


def bench_compiled(cell: str, T: int, B: int, H: int, I: int, dtype, threads: int, rule: StopRule):
    """torch.nn's forward against the compiled forward: (rows, summary rows)."""
    m = make_layer(cell, I, H, dtype)
    x = _inputs(T, B, dtype)
    h0 = torch.zeros(1, B, H, dtype=dtype)
    state = (h0, torch.zeros_like(h0)) if cell == "lstm" else h0
    w = _weights(m)
    with torch.no_grad():
        ref = m(x, state)[0]
    got = forward.compiled_forward(cell, x, None, None, *w, threads=threads)
    if got is None:
        raise RuntimeError("the compiled forward is unavailable here (no C compiler?)")
    err = ((got[0] - ref).abs().max() / ref.abs().max()).item()

    def run_torch():
        with torch.no_grad():
            m(x, state)

    methods = {"torch": _timed(run_torch),
               "compiled": _timed(lambda: forward.compiled_forward(cell, x, None, None, *w, threads=threads))}
    load0 = os.getloadavg()[0]
    meas = interleave(methods, rule, reference="torch", metric="forward")
    cfg = _config("compiled", cell, "forgets", T, B, H, I, dtype, threads)
    return _collect(cfg, meas, "torch", {"rel_err_vs_torch": err, "load1_before": load0,
                                         "load1_after": os.getloadavg()[0]})


def _cell_tol(kernel: str, dtype) -> float:
    """The meeting criterion the layers give the sliced forward of this kernel (``Cell.meet_tol``; 0: bitwise)."""
    from ..nn.cells import CELLS

    return next(c for c in CELLS.values() if c.kernel == kernel).meet_tol(dtype)


def bench_sliced(cell: str, layer: str, T: int, B: int, H: int, I: int, dtype, threads: int, slices: int,
                 rule: StopRule, tol: float | None = None):
    """The compiled forward on one thread and on ``threads``, and the sliced forward on ``threads`` (and with the
    tolerance ``tol`` where given): (rows, summary rows).  The sliced forward's bits are checked against the
    compiled one's (tol = 0) before any timing."""
    m = make_layer(cell, I, H, dtype, layer)
    x = _inputs(T, B, dtype)
    w = _weights(m)
    serial = forward.compiled_forward(cell, x, None, None, *w, threads=1)
    if serial is None:
        raise RuntimeError("the compiled forward is unavailable here (no C compiler?)")
    h, _, stats = sliced.sliced_forward(cell, x, None, None, w, None, slices, threads=threads)
    if not torch.equal(h, serial[0]):
        raise AssertionError(f"the sliced forward's states are not the serial forward's bits ({cell}, {layer})")
    last = {}

    def run_sliced(t):
        def go():
            last[t] = sliced.sliced_forward(cell, x, None, None, w, None, slices, tol=t, threads=threads)[2]
        return go

    p = threads
    methods = {"compiled-1": _timed(lambda: forward.compiled_forward(cell, x, None, None, *w, threads=1)),
               f"compiled-{p}": _timed(lambda: forward.compiled_forward(cell, x, None, None, *w, threads=p)),
               f"sliced-{p}": _timed(run_sliced(0.0))}
    cell_tol = _cell_tol(cell, dtype)
    if cell_tol:
        methods[f"sliced-{p}-cell"] = _timed(run_sliced(cell_tol))
    if tol:
        methods[f"sliced-{p}-tol"] = _timed(run_sliced(tol))
    load0 = os.getloadavg()[0]
    meas = interleave(methods, rule, reference="compiled-1", metric="forward")
    cfg = _config("sliced", cell, layer, T, B, H, I, dtype, threads)
    rows, summary = _collect(cfg, meas, "compiled-1", {"load1_before": load0, "load1_after": os.getloadavg()[0],
                                                        "slices": slices})
    for row in summary:
        t = (tol if row["method"].endswith("-tol") else cell_tol if row["method"].endswith("-cell")
             else 0.0 if row["method"].startswith("sliced") else None)
        if t is not None and t in last:
            st = last[t]
            row.update(tol=t, sweeps=st["sweeps"], handoff=len(st["handoff"]), bound=st["bound"],
                       meet_steps=";".join(f"{k}:{v}" for sw in st["meet_steps"] for k, v in sw.items()))
    return rows, summary


def run(cells, seq_lens, batches, H: int, I: int, dtype, threads: int, slices: int, rule: StopRule,
        sliced_len: int, layers=LAYERS, tol: float | None = None, experiments=("compiled", "sliced"),
        progress=print):
    """Every configuration of both experiments: (observations, summary) as DataFrames."""
    rows, summary = [], []
    torch.set_num_threads(threads)
    for B in batches:
        if "compiled" in experiments:
            for cell in cells:
                for T in seq_lens:
                    r, s = bench_compiled(cell, T, B, H, I, dtype, threads, rule)
                    rows += r
                    summary += s
                    progress(_line(s))
        if "sliced" in experiments:
            for cell in cells:
                for layer in layers:
                    r, s = bench_sliced(cell, layer, sliced_len, B, H, I, dtype, threads, slices, rule, tol)
                    rows += r
                    summary += s
                    progress(_line(s))
    return pd.DataFrame(rows), pd.DataFrame(summary)


def _line(summary) -> str:
    head = summary[0]
    parts = [f"{head['experiment']} {head['cell']} {head['layer']} T={head['T']} B={head['B']}:"]
    for r in summary:
        txt = f"{r['method']} {r['median_s'] * 1e3:.3f} ms"
        if "speedup" in r:
            txt += f" ({r['speedup']:.2f}x [{r['speedup_lo']:.2f}, {r['speedup_hi']:.2f}]; cpu {r['cpu_speedup']:.2f}x)"
        if "sweeps" in r:
            txt += f" sweeps {r['sweeps']} meet {r['meet_steps']}"
        parts.append(txt)
    return " | ".join(parts) + f" | load {head['load1_before']:.1f}->{head['load1_after']:.1f}"
