"""Scaling figure: backward time and speedup against worker threads, beside the paper's shapes."""
from __future__ import annotations

import math
import sys

import numpy as np
import pandas as pd
from matplotlib import ticker

from ..bench.scaling import BPPSA, brent_time, crossovers, medians
from ..bench.speed import AUTOGRAD, SEQUENTIAL
from ..io import atomic_path, write_csv
from .common import backends_of, plain_log_axis, plt

STYLE = {AUTOGRAD: dict(color="C0", marker="s", ls="--", label="autograd (eager)"),
         SEQUENTIAL: dict(color="C2", marker="^", ls=":", label="compiled sequential"),
         BPPSA: dict(color="C1", marker="o", ls="-", label="BPPSA (cpu fast path)")}


def plot(df: pd.DataFrame, out) -> pd.DataFrame:
    """Render one column per (T, B): time (top) and speedup over 1 thread (bottom); returns the crossovers."""
    med = medians(df)
    cross = crossovers(med)
    # the legend names the backend the CSV says ran BPPSA, not the one this code expects
    be = backends_of(df, df["method"] == BPPSA) if "method" in df else ""
    styles = {**STYLE, BPPSA: {**STYLE[BPPSA], "label": f"BPPSA (backend {be})" if be else "BPPSA"}}
    keys = sorted(med.groupby(["seq_len", "batch"]).groups)
    fig, axes = plt.subplots(2, len(keys), figsize=(4.2 * len(keys), 7), squeeze=False)
    for col, (T, B) in enumerate(keys):
        g = med[(med.seq_len == T) & (med.batch == B)]
        top, bot = axes[0, col], axes[1, col]
        pmax = int(g["threads"].max())
        for method, style in styles.items():
            m = g[g.method == method].sort_values("threads")
            if m.empty:
                continue
            p, t = m["threads"].to_numpy(), m["median_s"].to_numpy()
            top.errorbar(p, t * 1e3, yerr=[(t - m["ci_low"]) * 1e3, (m["ci_high"] - t) * 1e3], capsize=3, **style)
            bot.plot(p, t[0] / t, **style)
        bp = g[g.method == BPPSA].sort_values("threads")
        c = cross[(cross.seq_len == T) & (cross.batch == B) & (cross.rival == SEQUENTIAL)]
        verdict = ""
        if not bp.empty:
            # the paper's shapes through BPPSA's / the rivals' 1-thread points: Θ(n/p + log p) and Θ(n)
            ps = np.arange(1, max(pmax, 2) * 4 + 1)
            shape = (T / ps + np.log2(ps)) / T
            bot.plot(ps, 1 / shape, color="C1", alpha=0.35, lw=3, label="Θ(n/p + log p) (paper's scan)")
            bot.plot(ps, np.ones_like(ps), color="C0", alpha=0.35, lw=3, label="Θ(n) (back-propagation)")
            if not c.empty:
                t1, p_star = float(c.bppsa_1_worker_s.iloc[0]), float(c.crossover_workers.iloc[0])
                reach = int(min(max(p_star if math.isfinite(p_star) else pmax * 8, pmax) * 1.5, 4096))
                pe = np.unique(np.geomspace(1, max(reach, 2), 60).round())
                top.plot(pe, brent_time(t1, T, pe) * 1e3, color="C1", ls=(0, (1, 2)),
                         label="BPPSA, Θ(n/p + log p) from its 1-worker time (extrapolation)")
                top.axhline(float(c.rival_best_s.iloc[0]) * 1e3, color="C2", alpha=0.4)
                if math.isfinite(p_star):
                    tag = "extrapolated" if bool(c.extrapolated.iloc[0]) else "measured"
                    top.axvline(p_star, color="k", ls="--", lw=0.8)
                    verdict = f"overtakes sequential at p≈{p_star:.0f} (dashed, {tag})"
                else:
                    verdict = "never overtakes sequential (Θ(n/p + log p))"
        # the crossover in the title, where no legend can cover it
        top.set_title(f"T = {T}, B = {B}" + (f"\n{verdict}" if verdict else ""), fontsize=9)
        top.set(xscale="log", yscale="log", xlabel="worker threads p", ylabel="backward (ms), median ± 95% CI")
        plain_log_axis(top, "y", unit="")
        bot.set(xscale="log", xlabel="worker threads p", ylabel="speedup over p = 1")
        bot.set_xticks([2 ** k for k in range(int(math.log2(max(pmax, 2) * 4)) + 1)])
        top.set_xticks([2 ** k for k in range(int(math.log2(max(top.get_xlim()[1], 2))) + 1)])
        for ax in (top, bot):
            ax.grid(True, which="both", alpha=0.3)
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    # one legend for every panel, below them: inside a panel it covers points or curves
    handles = dict(zip(*axes[1, 0].get_legend_handles_labels()[::-1]))
    handles.update(zip(*axes[0, 0].get_legend_handles_labels()[::-1]))
    ncol = min(2, len(keys))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, fontsize=7)
    dev = ", ".join(sorted(map(str, df["device"].unique()))) if "device" in df else "?"
    profiles = ", ".join(sorted(map(str, df["profile"].unique()))) if "profile" in df else "?"
    fig.suptitle(f"Backward vs workers on {dev} · profile {profiles}\n(measured up to p = {int(med.threads.max())}; "
                 "dotted: extrapolated)",
                 fontsize=10)  # two lines: one column of panels is narrower than the title
    fig.tight_layout(rect=(0, 0.02 + 0.025 * -(-len(handles) // ncol), 1, 1))
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return cross


def draw(results, inputs: list, outputs: list) -> None:
    """The figure, then the fitted crossovers (CSV), to ``outputs`` (bppsa.plots.registry), from this device's
    ``scaling.csv`` files (``inputs``) alone."""
    fig, crossover = outputs
    cross = plot(pd.concat([pd.read_csv(p) for p in inputs], ignore_index=True), fig)
    write_csv(crossover, cross)
    print(cross.to_string(index=False), file=sys.stderr)
