"""Scaling with workers: the backward of autograd, of BPPSA (CPU fast path) and of the compiled
sequential rival (:mod:`.speed`), timed with 1, 2, ... p threads (:mod:`.protocol`, interleaved per
thread count).

The paper's model: BPPSA's scan takes Θ(n/p + log p) steps on p workers, back-propagation Θ(n).
:func:`fit` summarises the measurement per (T, B, method) by medians with intervals and fits
``t(p) = a/p + b`` to BPPSA's medians (``a``: the work that spreads over workers, ``b``: what does
not); :func:`crossover` solves ``a/p + b = t_seq`` for the number of workers at which BPPSA would
overtake the compiled sequential backward.  Beyond the measured thread counts it is an
*extrapolation* and is labelled as one.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch
from scipy.optimize import nnls

from .protocol import StopRule, median_ci
from .speed import AUTOGRAD, SEQUENTIAL, backward_methods, backward_seconds, measure, setup

BPPSA = "bppsa-cpu-fused"


def run(seq_lens, batches, threads, hidden: int | None = None, rule: StopRule | None = None, seed: int = 0,
        dtype=torch.float32, backend: str = "cpu", model: str = "rnn", data: str | None = None) -> list[dict]:
    """Every method at every thread count, per (T, B); the RNN on bitstreams of each T, or a model on a
    dataset file's batches (``data``; ``seq_lens`` is then ignored)."""
    rule = rule or StopRule()
    rows = []
    old = torch.get_num_threads()
    try:
        for T in seq_lens if data is None else [None]:
            for B in batches:
                net, x, y = setup(model, B, seed, dtype, T, hidden, data)
                methods = backward_methods(net, x, y, backends=(backend,))
                for p in threads:
                    torch.set_num_threads(p)
                    rows += measure(methods, rule, AUTOGRAD, backward_seconds, group="backward", threads=p,
                                    model=model, batch=B, seq_len=x.shape[0], hidden=net.cell.hidden_size)
    finally:
        torch.set_num_threads(old)
    return rows


def medians(df: pd.DataFrame, conf: float = 0.95) -> pd.DataFrame:
    """Per (seq_len, batch, method, threads): median backward seconds and interval."""
    d = df[df["phase"].isin(["jacobian", "backward"])]
    per = d.groupby(["seq_len", "batch", "method", "threads", "iter"], as_index=False)["seconds"].sum()
    out = []
    for key, g in per.groupby(["seq_len", "batch", "method", "threads"]):
        med, lo, hi = median_ci(g["seconds"].to_numpy(), conf)
        out.append(dict(zip(["seq_len", "batch", "method", "threads"], key), median_s=med, ci_low=lo, ci_high=hi,
                        n=len(g)))
    return pd.DataFrame(out)


def fit(threads, seconds) -> tuple[float, float]:
    """Least squares ``t(p) = a/p + b`` with a, b >= 0 (a time that grows with p gives a = 0: no
    scaling); with one thread count, b = 0 (the optimistic assumption: all work spreads)."""
    p, t = np.asarray(threads, float), np.asarray(seconds, float)
    if len(np.unique(p)) < 2:
        return float(np.mean(t * p)), 0.0
    (a, b), _ = nnls(np.stack([1 / p, np.ones_like(p)], 1), t)
    return float(a), float(b)


def crossover(a: float, b: float, t_rival: float) -> float:
    """Workers at which a/p + b falls to t_rival (1 if already below at p = 1; inf if never)."""
    if a + b <= t_rival:
        return 1.0
    if t_rival <= b:
        return math.inf
    return a / (t_rival - b)


def crossovers(med: pd.DataFrame) -> pd.DataFrame:
    """Per (seq_len, batch): the fit of BPPSA's medians and the workers needed to overtake each rival
    at its best measured time (the sequential backward does not speed up with workers: Θ(n))."""
    out = []
    measured = int(med["threads"].max())
    for (T, B), g in med.groupby(["seq_len", "batch"]):
        bp = g[g["method"] == BPPSA].sort_values("threads")
        if bp.empty:
            continue
        a, b = fit(bp["threads"], bp["median_s"])
        for rival in (SEQUENTIAL, AUTOGRAD):
            r = g[g["method"] == rival]
            if r.empty:
                continue
            t_rival = float(r["median_s"].min())
            faster = bp[bp["median_s"] < t_rival]
            if not faster.empty:  # measured, no model needed
                p_star, extrapolated = float(faster["threads"].min()), False
            else:
                p_star, extrapolated = crossover(a, b, t_rival), True
            out.append({"seq_len": T, "batch": B, "rival": rival, "rival_best_s": t_rival, "fit_a_s": a, "fit_b_s": b,
                        "crossover_workers": p_star, "max_measured_workers": measured, "extrapolated": extrapolated})
    return pd.DataFrame(out)
