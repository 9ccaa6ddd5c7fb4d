"""``results/fig_workers.png``: BPPSA with the sequence split over p processes against the pipeline on the same
split: backward time (the slowest rank's, median and 95 % interval) and peak memory per rank against p, with the
paper's Θ(n/p + log p) steps and O(n/p) memory per worker drawn through the p = 1 points."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..analysis.results import load_all
from ..analysis.workers import medians
from .common import finish, legend_below, plt, save

STYLE = {"bppsa": dict(color="C1", marker="o", ls="-", label="BPPSA (split over p processes)"),
         "pipeline": dict(color="C0", marker="s", ls="--", label="pipeline on the same split (GPipe)")}


def draw(results: str | Path, inputs: list, outputs: list) -> None:
    """The figure to ``outputs`` (bppsa.plots.registry), from every device folder under ``results``."""
    (out,) = outputs
    time_df = load_all(results, "workers", "time.csv")
    mem_df = load_all(results, "workers", "memory.csv")
    devices = list(dict.fromkeys(time_df["device_label"]))
    fig, axes = plt.subplots(len(devices), 2, figsize=(10, 4.2 * len(devices)), squeeze=False)
    for row, dev in enumerate(devices):
        t = time_df[time_df["device_label"] == dev]
        m = mem_df[mem_df["device_label"] == dev]
        _time_panel(axes[row, 0], t, dev)
        _memory_panel(axes[row, 1], m, dev)
    first = time_df.iloc[0]
    title = (f"BPPSA across processes: RNN T = {first['seq_len']}, B = {first['batch']}, H = {first['hidden']}, "
             f"{first['dtype']}, loss on the {'last state' if first['loss'] == 'last' else 'every step'}\n"
             "backward time and peak memory per rank against p (gloo, one thread per process)")
    n = int(medians(time_df)["n"].min())
    footer = (f"{', '.join(devices)} · profile {', '.join(sorted(set(map(str, time_df['profile']))))} · n = {n} "
              "paired rounds; a step's time is its slowest rank's; memory: peak resident-set growth over one "
              "forward and backward, the largest rank's. Grey: the paper's shapes through the p = 1 point.")
    if "micro_batches" in time_df:  # the pipeline: torch.distributed.pipelining's GPipe schedule over the split
        micro = ", ".join(sorted(set(map(str, time_df["micro_batches"]))))
        footer += f" Pipeline: torch's GPipe schedule, micro-batches of the batch: {micro}."
    finish(fig, title, footer)
    save(fig, out)


def _time_panel(ax, t: pd.DataFrame, dev: str) -> None:
    med = medians(t)
    for method, style in STYLE.items():
        g = med[med["method"] == method].sort_values("p")
        if g.empty:
            continue
        y = g["median_s"].to_numpy() * 1e3
        lo = np.nan_to_num(y - g["ci_lo"].to_numpy() * 1e3)
        hi = np.nan_to_num(g["ci_hi"].to_numpy() * 1e3 - y)
        ax.errorbar(g["p"], y, yerr=[lo, hi], capsize=3, **style)
    b = med[(med["method"] == "bppsa") & (med["p"] == 1)]
    if not b.empty:
        T = float(t["seq_len"].iloc[0])
        ps = np.arange(1, max(int(med["p"].max()), 2) + 1)
        ax.plot(ps, b["median_s"].iloc[0] * 1e3 * (T / ps + np.log2(ps)) / T, color="grey", alpha=0.5, lw=3,
                label="Θ(n/p + log p) (paper)")
    seq = med[(med["method"] == "sequential") & (med["p"] == 1)]
    if not seq.empty:  # the honest rival: back-propagation through the same compiled kernel, one process
        ax.axhline(seq["median_s"].iloc[0] * 1e3, color="k", ls=":", lw=1.2,
                   label="sequential backward, compiled, 1 process")
    ax.set_xlabel("processes p")
    ax.set_ylabel("backward time (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title(f"{dev}: backward time", fontsize=9)
    ax.set_xticks(sorted(set(med["p"])))
    legend_below(ax)


def _memory_panel(ax, m: pd.DataFrame, dev: str) -> None:
    peak = m.groupby(["p", "method"], as_index=False)["peak_bytes"].max()
    for method, style in STYLE.items():
        g = peak[peak["method"] == method].sort_values("p")
        if g.empty:
            continue
        ax.plot(g["p"], g["peak_bytes"] / 2 ** 20, **style)
    b = peak[(peak["method"] == "bppsa") & (peak["p"] == 1)]
    if not b.empty and len(peak):
        ps = np.arange(1, max(int(peak["p"].max()), 2) + 1)
        ax.plot(ps, b["peak_bytes"].iloc[0] / 2 ** 20 / ps, color="grey", alpha=0.5, lw=3, label="O(n/p) (paper)")
    ax.set_xlabel("processes p")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title(f"{dev}: memory per rank", fontsize=9)
    if len(peak):
        ax.set_xticks(sorted(set(peak["p"])))
    ax.set_ylim(bottom=0)
    legend_below(ax)
