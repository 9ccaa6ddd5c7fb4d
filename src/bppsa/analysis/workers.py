"""What ``bppsa workers`` measured, compared: step times (the slowest rank's), paired ratios with intervals, and the
issue's aims beside them (``workers/summary.csv``, the figure and the claims rows read these)."""
from __future__ import annotations

import math

import pandas as pd

from ..stats import median_ci, ratio_ci

# (what, numerator's (p, method), denominator's (p, method), aim, sense): a ratio >= aim ("min") or <= aim ("max").
# ``p`` is the compared process count P (None: the rival runs at p = 1).
AIMS = (
    ("BPPSA backward, p = 1 against p = {P} (speedup)", "bppsa@1", "bppsa@P", 1.6, "min"),
    ("pipeline backward against BPPSA's, both at p = {P} (speedup)", "pipeline@P", "bppsa@P", 1.3, "min"),
    ("BPPSA at p = {P} against one process on the CPU kernel with {P} threads (time ratio)", "bppsa@P", "threads@1",
     1.15, "max"),
    ("sequential backward (one process, L_m = 0) against BPPSA at p = {P} (speedup)", "sequential@1", "bppsa@P",
     math.nan, "min"),
    ("rank_scan at p = {P}: 'rounds' against 'allgather' (time ratio; < 1: rounds faster)", "scan-rounds@P",
     "scan-allgather@P", math.nan, "max"),
)
MEMORY_AIM = ("peak memory per rank, BPPSA p = {P} against p = 1 (ratio)", 0.6, "max")


def step_times(time_df: pd.DataFrame) -> pd.DataFrame:
    """One row per (round, p, method): the step's backward time, its slowest rank's."""
    return (time_df.groupby(["round", "p", "method"], as_index=False)["backward_s"].max()
            .rename(columns={"backward_s": "step_s"}))


def _series(steps: pd.DataFrame, key: str, P: int) -> pd.Series:
    method, _, p = key.partition("@")
    p = P if p == "P" else int(p)
    s = steps[(steps["method"] == method) & (steps["p"] == p)].set_index("round")["step_s"]
    return s


def summary(time_df: pd.DataFrame, mem_df: pd.DataFrame | None) -> pd.DataFrame:
    """The comparisons for every measured P > 1: median paired ratio, its 95 % interval, n, the aim and whether the
    interval clears it (``meets``: True / False / None where the interval does not decide)."""
    steps = step_times(time_df)
    rows = []
    for P in sorted(p for p in steps["p"].unique() if p > 1):
        for what, num, den, aim, sense in AIMS:
            a, b = _series(steps, num, P), _series(steps, den, P)
            common = a.index.intersection(b.index)
            if num.startswith("bppsa@P") and den.startswith("threads") and P != _threads(time_df):
                continue  # the threads rival runs with its own thread count only
            if len(common) == 0:
                continue
            m, lo, hi = ratio_ci(a[common].to_numpy(), b[common].to_numpy())
            rows.append(_row(what.format(P=P), P, "time", m, lo, hi, len(common), aim, sense))
        if mem_df is not None and len(mem_df):
            one = mem_df[(mem_df["method"] == "bppsa") & (mem_df["p"] == 1)]["peak_bytes"].max()
            at = mem_df[(mem_df["method"] == "bppsa") & (mem_df["p"] == P)]["peak_bytes"].max()
            if one > 0 and not math.isnan(at):
                what, aim, sense = MEMORY_AIM
                rows.append(_row(what.format(P=P), P, "memory", at / one, math.nan, math.nan, 1, aim, sense))
    return pd.DataFrame(rows, columns=["compared", "P", "kind", "ratio", "ci_lo", "ci_hi", "n", "aim", "sense",
                                       "meets"])


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


def medians(time_df: pd.DataFrame) -> pd.DataFrame:
    """Median step time and its interval per (p, method): what the figure draws."""
    rows = []
    for (p, method), g in step_times(time_df).groupby(["p", "method"]):
        m, lo, hi = median_ci(g["step_s"])
        rows.append({"p": p, "method": method, "median_s": m, "ci_lo": lo, "ci_hi": hi, "n": len(g)})
    return pd.DataFrame(rows)
