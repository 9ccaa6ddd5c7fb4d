"""What ``bppsa workers`` measured, compared: step times (the slowest rank's backward, forward or whole step), paired
ratios with intervals, and the issues' aims beside them (``workers/summary.csv``, the figure and the claims rows read
these)."""
from __future__ import annotations

import math

import pandas as pd

from ..stats import median_ci, ratio_ci

# (what, numerator's (p, method), denominator's (p, method), aim, sense, metric): a ratio >= aim ("min") or <= aim
# ("max") of the slowest rank's ``metric`` (time.csv's column).  ``P`` is the compared process count.
AIMS = (
    ("BPPSA backward, p = 1 against p = {P} (speedup)", "bppsa@1", "bppsa@P", 1.6, "min", "backward_s"),
    ("pipeline backward against BPPSA's, both at p = {P} (speedup)", "pipeline@P", "bppsa@P", 1.3, "min",
     "backward_s"),
    ("BPPSA at p = {P} against one process on the CPU kernel with {P} threads (time ratio)", "bppsa@P", "threads@1",
     1.15, "max", "backward_s"),
    ("sequential backward (one process, L_m = 0) against BPPSA at p = {P} (speedup)", "sequential@1", "bppsa@P",
     math.nan, "min", "backward_s"),
    ("rank_scan at p = {P}: 'rounds' against 'allgather' (time ratio; < 1: rounds faster)", "scan-rounds@P",
     "scan-allgather@P", math.nan, "max", "backward_s"),
    # the whole training step and its forward (issue 49): the same layers at p = 1, and the serial hand-off
    ("BPPSA training step (forward + backward), p = 1 against p = {P} (speedup)", "bppsa@1", "bppsa@P", 1.7, "min",
     "fwd_bwd_s"),
    ("BPPSA forward, p = 1 against p = {P} (speedup)", "bppsa@1", "bppsa@P", math.nan, "min", "forward_s"),
    ("BPPSA forward, the serial hand-off against the default (the sweeps), both at p = {P} (speedup)",
     "bppsa-handoff@P", "bppsa@P", 1.7, "min", "forward_s"),
)
MEMORY_AIM = ("peak memory per rank, BPPSA p = {P} against p = 1 (ratio)", 0.6, "max")


def step_times(time_df: pd.DataFrame, metric: str = "backward_s") -> pd.DataFrame:
    """One row per (round, p, method): the step's ``metric`` (backward_s, forward_s, fwd_bwd_s), its slowest
    rank's; none for a method that did not record it (NaN)."""
    d = time_df.dropna(subset=[metric])
    return d.groupby(["round", "p", "method"], as_index=False)[metric].max().rename(columns={metric: "step_s"})


def _series(steps: pd.DataFrame, key: str, P: int) -> pd.Series:
    method, _, p = key.partition("@")
    p = P if p == "P" else int(p)
    s = steps[(steps["method"] == method) & (steps["p"] == p)].set_index("round")["step_s"]
    return s


def summary(time_df: pd.DataFrame, mem_df: pd.DataFrame | None) -> pd.DataFrame:
    """The comparisons for every measured P > 1: median paired ratio, its 95 % interval, n, the aim and whether the
    interval clears it (``meets``: True / False / None where the interval does not decide)."""
    metrics = {m: step_times(time_df, m) for m in {a[-1] for a in AIMS} if m in time_df}  # (older CSVs lack some)
    rows = []
    for P in sorted(p for p in time_df["p"].unique() if p > 1):
        for what, num, den, aim, sense, metric in AIMS:
            if metric not in metrics:
                continue
            a, b = _series(metrics[metric], num, P), _series(metrics[metric], den, P)
            common = a.index.intersection(b.index)
            if num.startswith("bppsa@P") and den.startswith("threads") and P != _threads(time_df):
                continue  # the threads rival runs with its own thread count only
            if len(common) == 0:
                continue
            m, lo, hi = ratio_ci(a[common].to_numpy(), b[common].to_numpy())
            rows.append(_row(what.format(P=P), P, "time", m, lo, hi, len(common), aim, sense) | {"metric": metric})
        if mem_df is not None and len(mem_df):
            one = mem_df[(mem_df["method"] == "bppsa") & (mem_df["p"] == 1)]["peak_bytes"].max()
            at = mem_df[(mem_df["method"] == "bppsa") & (mem_df["p"] == P)]["peak_bytes"].max()
            if one > 0 and not math.isnan(at):
                what, aim, sense = MEMORY_AIM
                rows.append(_row(what.format(P=P), P, "memory", at / one, math.nan, math.nan, 1, aim, sense)
                            | {"metric": "peak_bytes"})
    return pd.DataFrame(rows, columns=["compared", "P", "kind", "metric", "ratio", "ci_lo", "ci_hi", "n", "aim",
                                       "sense", "meets"])


def _threads(time_df: pd.DataFrame) -> int:
    t = time_df[time_df["method"] == "threads"]["threads"]
    return int(t.max()) if len(t) else 0


def _row(what, P, kind, m, lo, hi, n, aim, sense):
    if math.isnan(aim):
        meets = None
    elif kind == "memory":
        meets = m <= aim if sense == "max" else m >= aim
    elif math.isnan(lo):
        meets = None
    elif sense == "min":
        meets = True if lo >= aim else (False if hi < aim else None)
    else:
        meets = True if hi <= aim else (False if lo > aim else None)
    return {"compared": what, "P": P, "kind": kind, "ratio": m, "ci_lo": lo, "ci_hi": hi, "n": n, "aim": aim,
            "sense": sense, "meets": meets}


def medians(time_df: pd.DataFrame, metric: str = "backward_s") -> pd.DataFrame:
    """Median step time (``metric``: the backward, the forward or the whole step) and its interval per (p, method):
    what the figure draws."""
    rows = []
    if metric not in time_df:
        return pd.DataFrame(columns=["p", "method", "median_s", "ci_lo", "ci_hi", "n"])
    for (p, method), g in step_times(time_df, metric).groupby(["p", "method"]):
        m, lo, hi = median_ci(g["step_s"])
        rows.append({"p": p, "method": method, "median_s": m, "ci_lo": lo, "ci_hi": hi, "n": len(g)})
    return pd.DataFrame(rows)
