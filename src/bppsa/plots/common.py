"""Shared figure conventions: one colour per device, one line style per method, provenance in the title."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import pandas as pd  # noqa: E402

from ..io import atomic_path  # noqa: E402

PHASES = ["forward", "jacobian", "backward", "optimizer"]

VARIANT_STYLE = {"baseline": dict(ls="--", marker="s"), "bppsa-fused": dict(ls="-", marker="o"),
                 "bppsa-paper": dict(ls="-.", marker="^")}
VARIANT_NAME = {"baseline": "baseline (autograd/cuDNN)", "bppsa-fused": "BPPSA (fused Jacobians)",
                "bppsa-paper": "BPPSA (paper's two Jacobians per step)"}


def variant(df):
    """'baseline' or 'bppsa-<layout>' per row: what a line or bar of a figure stands for."""
    layout = df["layout"].fillna("").astype(str) if "layout" in df else ""
    return df["method"].where(df["method"] == "baseline", "bppsa-" + layout)


def device_colors(labels) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {lab: cycle[i % len(cycle)] for i, lab in enumerate(sorted(set(labels), key=lambda s: ("reference" in s, s)))}


def provenance(df, repeats: str) -> str:
    profiles = ", ".join(sorted(set(map(str, df["profile"])))) if "profile" in df else "?"
    devices = ", ".join(sorted(set(df["device_label"])))
    extra = ""
    if "data" in df:
        standin = sorted({s for s in map(str, df["data"]) if "stand-in" in s})
        if standin:
            extra = " · data: " + ", ".join(standin)
    return f"profile: {profiles} · device: {devices} · {repeats}{extra}"


def save(fig, path: str | Path) -> None:
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=130)
    plt.close(fig)


def per_iteration(bench: pd.DataFrame) -> pd.DataFrame:
    """One row per (device, method, T, B, mode, iter) with a column per phase and the derived times.

    ``bp`` is the backward time as the paper defines it: the baseline's backward; BPPSA's Jacobian
    generation plus its scan backward.  ``total`` is the whole iteration.
    """
    bench = bench.assign(variant=variant(bench))
    keys = ["device_label", "profile", "variant", "backend", "seq_len", "batch", "mode", "iter"]
    wide = bench.pivot_table(index=keys, columns="phase", values="seconds", aggfunc="sum", fill_value=0.0)
    wide = wide.reindex(columns=PHASES, fill_value=0.0).reset_index()
    wide["bp"] = wide["jacobian"] + wide["backward"]
    wide["total"] = wide[PHASES].sum(axis=1)
    return wide


def phase_summary(bench: pd.DataFrame) -> pd.DataFrame:
    """Mean/std per configuration, the backward speedup and the paper's nobp cross-check."""
    it = per_iteration(bench)
    keys = ["device_label", "profile", "variant", "backend", "seq_len", "batch"]
    full = it[it["mode"] == "full"].groupby(keys).agg(
        n=("iter", "size"), **{f"{c}_mean": (c, "mean") for c in PHASES + ["bp", "total"]},
        bp_std=("bp", "std"), total_std=("total", "std")).reset_index()
    nobp = it[it["mode"] == "nobp"].groupby(keys)["total"].mean().rename("nobp_total_mean").reset_index()
    s = full.merge(nobp, on=keys, how="left")
    # the paper's method: backward = full iteration - forward-only iteration
    s["bp_by_subtraction"] = s["total_mean"] - s["nobp_total_mean"]
    return s
