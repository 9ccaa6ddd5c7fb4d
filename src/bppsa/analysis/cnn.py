"""Summaries of the CNN timings (``bppsa bench-cnn`` and ``bppsa vgg11-retrain-scan``), for the report and claims.md.

From the tidy per-iteration rows (method, iter, phase, seconds): medians with their intervals, the paired ratio
BPPSA/autograd, where BPPSA's backward goes (Jacobian generation, scan, parameter gradients); from the profiled
scan products beside the static FLOP of the same products: whether FLOP predicts time (Spearman's rank
correlation) and the seconds per GFLOP.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..stats import median_ci, ratio_ci
from .results import device_dirs

BACKWARD_PHASES = ("backward", "jacobian", "scan", "param_grads")


def retrain_scan_runs(results):
    """(device label, per-iteration rows, profiled steps) of every device folder holding both of
    ``vgg11-retrain-scan``'s CSVs, neither empty."""
    for label, folder in device_dirs(results):
        paths = (folder / "vgg11" / "retrain_scan.csv", folder / "vgg11" / "retrain_scan_steps.csv")
        if all(q.is_file() for q in paths):
            rows, steps = (pd.read_csv(q) for q in paths)
            if len(rows) and len(steps):
                yield label, rows, steps


def per_iteration(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, iter): ``total`` (all phases), ``backward`` (with BPPSA's parts) and each phase."""
    wide = rows.pivot_table(index=["method", "iter"], columns="phase", values="seconds", aggfunc="sum", fill_value=0.0)
    wide["total"] = wide.sum(axis=1)
    wide["backward_total"] = wide[[p for p in BACKWARD_PHASES if p in wide]].sum(axis=1)
    return wide.reset_index()


def timing_summary(rows: pd.DataFrame, reference: str = "autograd", method: str = "bppsa", conf: float = 0.95) -> dict:
    """Medians (with CIs) of the iteration and the backward per method, the paired ratios method/reference, and
    the shares of BPPSA's backward."""
    w = per_iteration(rows)
    a = w[w["method"] == reference].set_index("iter")
    b = w[w["method"] == method].set_index("iter")
    common = a.index.intersection(b.index)
    out = {"rounds": int(len(common))}
    for name, d in ((reference, a), (method, b)):
        for metric in ("total", "backward_total"):
            out[f"{name}_{metric}"] = median_ci(d[metric], conf)
    for metric in ("total", "backward_total"):
        out[f"ratio_{metric}"] = ratio_ci(b.loc[common, metric], a.loc[common, metric], conf)
    bw = b["backward_total"].replace(0.0, np.nan)
    for part in ("jacobian", "scan", "param_grads"):
        out[f"share_{part}"] = float(np.nanmedian(b[part] / bw)) if part in b else math.nan
    return out


def step_table(steps: pd.DataFrame, flops: pd.DataFrame, batch: int) -> pd.DataFrame:
    """Each scan product: its median measured seconds over the profiled iterations beside its static FLOP for the
    batch (one sample's count times ``batch``, each sample's chain having its own block)."""
    scan = steps[steps["what"] == "scan"].copy()
    scan["d"] = scan["d"].astype(int)
    med = scan.groupby(["phase", "d", "l", "r"], as_index=False).agg(
        seconds=("seconds", "median"), kind=("kind", "first"), nnz_out=("nnz_out", "median"))
    f = flops.copy()
    f["d"] = f["d"].astype(int)
    out = med.merge(f[["phase", "d", "l", "r", "flop"]], on=["phase", "d", "l", "r"], how="left")
    out["flop_batch"] = out["flop"] * batch
    return out


def flop_prediction(table: pd.DataFrame) -> dict:
    """Spearman's rank correlation of the products' times with their FLOP, its one-sided p-value, and the median
    seconds per GFLOP of the products that do any FLOP."""
    from scipy.stats import spearmanr

    t = table.dropna(subset=["seconds", "flop_batch"])
    t = t[t["flop_batch"] > 0]
    if len(t) < 3:
        return dict(n=len(t), rho=math.nan, p=math.nan, s_per_gflop=math.nan)
    rho, p_two = spearmanr(t["flop_batch"], t["seconds"])
    p = p_two / 2 if rho > 0 else 1 - p_two / 2
    return dict(n=int(len(t)), rho=float(rho), p=float(p),
                s_per_gflop=float(np.median(t["seconds"] / (t["flop_batch"] / 1e9))))


def generation_share(steps: pd.DataFrame) -> float:
    """The Jacobian generation's share of the profiled backward parts (generation + scan + parameter gradients)."""
    per = steps.groupby(["iteration", "what"])["seconds"].sum().unstack(fill_value=0.0)
    total = per.sum(axis=1)
    return float(np.median(per.get("jacobian", 0.0) / total)) if len(per) else math.nan
