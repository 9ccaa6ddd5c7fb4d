"""``results/fig_workers.png``: BPPSA with the sequence split over p processes against the pipeline on the same
split, per device: the forward, the backward and the whole training step (each the slowest rank's, median and 95 %
interval) and peak memory per rank against p; the split layer's default forward (the sweeps) beside the serial
hand-off (``parallel_forward=False``); the paper's Θ(n/p + log p) steps (backward) and O(n/p) memory per worker, and
a perfect split's n/p (forward, step), drawn through the p = 1 points."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..analysis.results import load_all
from ..analysis.workers import medians
from .common import finish, legend_below, plain_log_axis, plt, save

STYLE = {"bppsa": dict(color="C1", marker="o", ls="-", label="BPPSA (split over p processes; forward: the sweeps)"),
         # hollow and larger: where it equals the default (which falls back to it), both markers stay visible
         "bppsa-handoff": dict(color="C2", marker="^", ls="-.", mfc="none", ms=9,
                               label="BPPSA, forward by the serial hand-off"),
         "pipeline": dict(color="C0", marker="s", ls="--", label="pipeline on the same split (GPipe)")}
# (time.csv's column, panel title, the paper's or an ideal shape through the p = 1 point: (label, f(T, p)))
TIME_PANELS = (
    ("forward_s", "forward", ("n/p (a perfect split)", lambda T, p: 1 / p)),
    ("backward_s", "backward", ("Θ(n/p + log p) (paper)", lambda T, p: (T / p + np.log2(p)) / T)),
    ("fwd_bwd_s", "training step (forward + backward)", ("n/p (a perfect split)", lambda T, p: 1 / p)),
)
SEQUENTIAL = {"forward_s": "compiled forward, 1 process", "backward_s": "sequential backward, compiled, 1 process",
              "fwd_bwd_s": "sequential step (compiled), 1 process"}


def draw(results: str | Path, inputs: list, outputs: list) -> None:
    """The figure to ``outputs`` (bppsa.plots.registry), from every device folder under ``results``."""
    (out,) = outputs
    time_df = load_all(results, "workers", "time.csv")
    mem_df = load_all(results, "workers", "memory.csv")
    devices = list(dict.fromkeys(time_df["device_label"]))
    fig, axes = plt.subplots(2 * len(devices), 2, figsize=(11, 8.8 * len(devices)), squeeze=False)
    for row, dev in enumerate(devices):
        t = time_df[time_df["device_label"] == dev]
        m = mem_df[mem_df["device_label"] == dev]
        cells = [axes[2 * row, 0], axes[2 * row, 1], axes[2 * row + 1, 0]]
        for ax, (metric, what, shape) in zip(cells, TIME_PANELS):
            _time_panel(ax, t, dev, metric, what, shape)
        _memory_panel(axes[2 * row + 1, 1], m, dev)
    first = time_df.iloc[0]
    title = (f"BPPSA across processes: RNN T = {first['seq_len']}, B = {first['batch']}, H = {first['hidden']}, "
             f"{first['dtype']}, loss on the {'last state' if first['loss'] == 'last' else 'every step'}\n"
             "forward, backward, whole step and peak memory per rank against p (gloo, one thread per process)")
    n = int(medians(time_df)["n"].min())
    footer = (f"{', '.join(devices)} · profile {', '.join(sorted(set(map(str, time_df['profile']))))} · n = {n} "
              "paired rounds; a step's time is its slowest rank's; memory: peak resident-set growth over one "
              "forward and backward, the largest rank's. Grey: the paper's shapes (and a perfect split's n/p) "
              "through the p = 1 point. The hand-off is the default layer's forward at p = 1.")
    if "forward_sweeps" in time_df:  # what the default forward did: its sweeps, or the hand-off it falls back to
        d = time_df[(time_df["method"] == "bppsa") & (time_df["p"] > 1)]
        if len(d):
            footer += (f" The default's forward ran the serial hand-off in {int((d['forward_sweeps'] == 0).sum())} of "
                       f"{len(d)} rank-steps at p > 1 (after a call whose sweeps did not pay).")
    if "micro_batches" in time_df:  # the pipeline: torch.distributed.pipelining's GPipe schedule over the split
        micro = ", ".join(sorted(set(map(str, time_df["micro_batches"]))))
        footer += f" Pipeline: torch's GPipe schedule, micro-batches of the batch: {micro}; its forward: the fill."
    finish(fig, title, footer)
    save(fig, out)


def _time_panel(ax, t: pd.DataFrame, dev: str, metric: str, what: str, shape) -> None:
    med = medians(t, metric)
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
        label, f = shape
        ax.plot(ps, b["median_s"].iloc[0] * 1e3 * f(T, ps), color="grey", alpha=0.5, lw=3, label=label)
    seq = med[(med["method"] == "sequential") & (med["p"] == 1)]
    if not seq.empty:  # the honest rival: the same compiled kernels in one process
        ax.axhline(seq["median_s"].iloc[0] * 1e3, color="k", ls=":", lw=1.2, label=SEQUENTIAL[metric])
    ax.set_xlabel("processes p")
    ax.set_ylabel(f"{what.split(' (')[0]} time (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title(f"{dev}: {what}", fontsize=9)
    if len(med):
        ax.set_xticks(sorted(set(med["p"])))
    if ax.has_data():
        plain_log_axis(ax, "y", unit="")
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
