"""Scaling with workers: the backward of autograd, of BPPSA (CPU fast path) and of the compiled
sequential rival (:mod:`.speed`), timed with 1, 2, ... p threads (:mod:`.protocol`, interleaved per
thread count).

The paper's model: BPPSA's scan takes Θ(n/p + log p) steps on p workers, back-propagation Θ(n).
:func:`medians` summarises the measurement per (T, B, method) by medians with intervals.
:func:`crossovers` takes BPPSA's measured one-worker time as its per-worker throughput and scales it
by that model, ``t(p) = t_1 (1/p + log2(p)/n)`` (:func:`brent_time`: the work divided perfectly, plus
the tree's depth), to find the workers at which BPPSA would overtake each rival's best measured time
(:func:`crossover`).  Beyond the measured thread counts that is an *extrapolation*, labelled as one,
beside what the measurement says about it: the measured parallel efficiency at the largest thread
count, and the least-squares ``t(p) = a/p + b`` (:func:`fit`; ``b`` is what did not spread).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from ..stats import median_ci
from .protocol import StopRule
from .speed import AUTOGRAD, SEQUENTIAL, backward_methods, measure, setup
from .timing import backward_seconds

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
    from scipy.optimize import nnls  # imported where it is used: every `bppsa` command would pay 0.3 s

    (a, b), _ = nnls(np.stack([1 / p, np.ones_like(p)], 1), t)
    return float(a), float(b)


def brent_time(t1: float, n: int, p) -> float:
    """The paper's Θ(n/p + log p) through a one-worker time: t1 (1/p + log2(p)/n)."""
    return t1 * (1 / p + np.log2(p) / n)


def crossover(t1: float, n: int, t_rival: float) -> float:
    """The fewest workers p at which :func:`brent_time` reaches t_rival (1 if already at p = 1; inf if
    never: the model's minimum, at p = n ln 2, is above it)."""
    if t1 <= t_rival:
        return 1.0
    lo, hi = 1, max(1, int(n * math.log(2)))
    if brent_time(t1, n, hi) > t_rival:
        return math.inf
    while hi - lo > 1:  # brent_time falls on [1, n ln 2]: the first p below t_rival
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if brent_time(t1, n, mid) <= t_rival else (mid, hi)
    return float(hi)


def crossovers(med: pd.DataFrame) -> pd.DataFrame:
    """Per (seq_len, batch) and rival: the workers BPPSA needs to overtake the rival's best measured time
    (measured where it already did; else :func:`crossover` from its one-worker time, an extrapolation),
    BPPSA's measured parallel efficiency at the most threads, and the a/p + b fit."""
    out = []
    measured = int(med["threads"].max())
    for (T, B), g in med.groupby(["seq_len", "batch"]):
        bp = g[g["method"] == BPPSA].sort_values("threads")
        if bp.empty or 1 not in set(bp["threads"]):
            continue
        t1 = float(bp.loc[bp["threads"] == 1, "median_s"].iloc[0])
        top = bp.iloc[-1]
        efficiency = t1 / (float(top["threads"]) * float(top["median_s"]))
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
                p_star, extrapolated = crossover(t1, int(T), t_rival), True
            out.append({"seq_len": T, "batch": B, "rival": rival, "rival_best_s": t_rival, "bppsa_1_worker_s": t1,
                        "crossover_workers": p_star, "max_measured_workers": measured, "extrapolated": extrapolated,
                        "parallel_efficiency": efficiency, "fit_a_s": a, "fit_b_s": b})
    return pd.DataFrame(out)
