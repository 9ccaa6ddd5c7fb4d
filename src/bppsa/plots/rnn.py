"""Fig 7 (RNN training curves) and Fig 8a-f (backward latency, speedup and runtime breakdown
against the sequence length T and against the fraction of GPU per sample 1/B)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from ..results import load_all
from .common import PHASES, VARIANT_NAME, VARIANT_STYLE, device_colors, phase_summary, provenance, save, variant

HATCH = ["//", "", "xx"]  # one per variant: baseline, then the BPPSA layouts
PHASE_COLOR = {"forward": "#4c72b0", "jacobian": "#dd8452", "backward": "#c44e52", "optimizer": "#8c8c8c"}


def speedups(s: pd.DataFrame) -> pd.DataFrame:
    on = ["device_label", "profile", "seq_len", "batch"]
    base = s[s["variant"] == "baseline"].set_index(on)
    out = []
    for (_, bp) in s[s["variant"] != "baseline"].iterrows():
        key = tuple(bp[k] for k in on)
        if key not in base.index:
            continue
        b = base.loc[key]
        out.append({**{k: bp[k] for k in on}, "backend": bp["backend"], "variant": bp["variant"],
                    "bp_speedup": b["bp_mean"] / bp["bp_mean"],
                    "bp_speedup_by_subtraction": b["bp_by_subtraction"] / bp["bp_by_subtraction"],
                    "total_speedup": b["total_mean"] / bp["total_mean"],
                    "baseline_bp": b["bp_mean"], "bppsa_bp": bp["bp_mean"]})
    return pd.DataFrame(out)


def _sweep(s: pd.DataFrame, axis: str, fixed: dict) -> pd.DataFrame:
    """Rows of the T sweep (axis='seq_len', B fixed) or the B sweep (axis='batch', T fixed), per device."""
    other = "batch" if axis == "seq_len" else "seq_len"
    parts = []
    for dev, grp in s.groupby("device_label"):
        val = fixed.get(dev)
        if val is None:
            continue
        parts.append(grp[grp[other] == val])
    return pd.concat(parts) if parts else s.iloc[:0]


def _fixed_values(s: pd.DataFrame, axis: str) -> dict:
    """The fixed value of the other variable in each device's sweep: the one with most points."""
    other = "batch" if axis == "seq_len" else "seq_len"
    out = {}
    for dev, grp in s.groupby("device_label"):
        counts = grp.groupby(other)[axis].nunique()
        out[dev] = counts.idxmax()
    return out


def _x(df: pd.DataFrame, axis: str):
    return df["seq_len"] if axis == "seq_len" else 1.0 / df["batch"]


XLABEL = {"seq_len": "sequence length T", "batch": "fraction of GPU per sample 1/B"}


def _xaxis(ax, d: pd.DataFrame, axis: str) -> None:
    """Log x-axis ticked at the measured values (1/B written as a fraction, as in the paper)."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    vals = sorted(d[axis].unique())
    ax.set_xticks([v if axis == "seq_len" else 1.0 / v for v in vals])
    ax.set_xticklabels([str(v) if axis == "seq_len" else f"1/{v}" for v in vals])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(XLABEL[axis])


def fig_latency(s: pd.DataFrame, axis: str, out: str | Path) -> None:
    fixed = _fixed_values(s, axis)
    d = _sweep(s, axis, fixed)
    colors = device_colors(s["device_label"])
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for (dev, var), g in d.groupby(["device_label", "variant"]):
        g = g.sort_values(axis)
        ax.errorbar(_x(g, axis), g["bp_mean"] * 1e3, yerr=g["bp_std"] * 1e3, color=colors[dev],
                    label=f"{VARIANT_NAME[var]} · {dev}", capsize=2, **VARIANT_STYLE[var])
    _xaxis(ax, d, axis)
    ax.set_yscale("log")
    ax.set_ylabel("backward latency per iteration (ms)")
    other = "B" if axis == "seq_len" else "T"
    fixed_txt = ", ".join(f"{other}={v}" for v in sorted(set(fixed.values())))
    ax.set_title(f"Backward latency per iteration vs {'T' if axis == 'seq_len' else '1/B'} ({fixed_txt})\n"
                 + provenance(d, f"mean ± std of n={int(d['n'].min())} iterations"), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, out)


def fig_speedup(s: pd.DataFrame, axis: str, out: str | Path) -> None:
    fixed = _fixed_values(s, axis)
    sp = speedups(_sweep(s, axis, fixed))
    colors = device_colors(s["device_label"])
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for (dev, var), g in sp.groupby(["device_label", "variant"]):
        g = g.sort_values(axis)
        x = _x(g, axis)
        tag = f"{var} · {dev}"
        mk = VARIANT_STYLE[var]["marker"]
        ax.plot(x, g["bp_speedup"], "-" + mk, color=colors[dev], label=f"backward (phase timers), {tag}")
        ax.plot(x, g["bp_speedup_by_subtraction"], ":" + mk, color=colors[dev], alpha=0.6, mfc="none",
                label=f"backward (paper's nobp subtraction), {tag}")
        ax.plot(x, g["total_speedup"], "--" + mk, color=colors[dev], alpha=0.6, label=f"whole iteration, {tag}")
    ax.axhline(1.0, color="k", lw=0.8)
    _xaxis(ax, sp, axis)
    ax.set_yscale("log")
    ax.set_ylabel("speedup of BPPSA over the baseline (×)")
    ax.set_title("BPPSA speedup over the baseline\n" + provenance(_sweep(s, axis, fixed), "ratio of means"), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, out)


def fig_breakdown(s: pd.DataFrame, axis: str, out: str | Path) -> None:
    fixed = _fixed_values(s, axis)
    d = _sweep(s, axis, fixed)
    devices = sorted(d["device_label"].unique(), key=lambda v: ("reference" in v, v))
    fig, axes = plt.subplots(len(devices), 1, figsize=(10, 3.4 * len(devices)), squeeze=False)
    for ax, dev in zip(axes[:, 0], devices):
        g = d[d["device_label"] == dev]
        xs = sorted(g[axis].unique(), reverse=(axis == "batch"))
        norm = {v: g[(g[axis] == v) & (g["variant"] == "baseline")]["total_mean"].mean() for v in xs}
        variants = ["baseline"] + sorted(v for v in g["variant"].unique() if v != "baseline")
        width = 0.8 / len(variants)
        for j, var in enumerate(variants):
            bottom = np.zeros(len(xs))
            for phase in PHASES:
                vals = np.array([g[(g[axis] == v) & (g["variant"] == var)][f"{phase}_mean"].mean() / norm[v]
                                 for v in xs])
                vals = np.nan_to_num(vals)
                ax.bar(np.arange(len(xs)) + (j - (len(variants) - 1) / 2) * width, vals, width, bottom=bottom,
                       color=PHASE_COLOR[phase], edgecolor="k", linewidth=0.4, hatch=HATCH[j % len(HATCH)])
                bottom += vals
        ax.set_xticks(np.arange(len(xs)))
        ax.set_xticklabels([str(v) if axis == "seq_len" else f"1/{v}" for v in xs])
        ax.set_xlabel(XLABEL[axis])
        ax.set_ylabel("runtime / baseline runtime")
        ax.set_title(dev, fontsize=9)
        handles = [Patch(facecolor=PHASE_COLOR[p], edgecolor="k", linewidth=0.4, label=p) for p in PHASES]
        handles += [Patch(facecolor="white", edgecolor="k", hatch=HATCH[j % len(HATCH)], label=VARIANT_NAME[v])
                    for j, v in enumerate(variants)]
        ax.legend(handles=handles, fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Runtime breakdown per iteration, normalised by the baseline\n"
                 + provenance(d, f"means of n={int(d['n'].min())} iterations"), fontsize=8)
    save(fig, out)


def fig_7(curves: pd.DataFrame, out: str | Path) -> None:
    colors = device_colors(curves["device_label"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
    curves = curves.assign(variant=variant(curves))
    for (dev, var), g in curves.groupby(["device_label", "variant"]):
        g = g.sort_values("epoch")
        style = dict(color=colors[dev], ls=VARIANT_STYLE[var]["ls"], marker=VARIANT_STYLE[var]["marker"], ms=3)
        lab = f"{VARIANT_NAME[var]} · {dev}"
        a1.plot(g["wall_clock_s"], g["loss"], label=lab, **style)
        a2.plot(g["wall_clock_s"], g["accuracy"] * 100, label=lab, **style)
    a1.set_ylabel("training loss (cross-entropy)")
    a2.set_ylabel("training accuracy (%)")
    for a in (a1, a2):
        a.set_xlabel("wall-clock training time (s)")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    T, B = sorted(set(curves["seq_len"])), sorted(set(curves["batch"]))
    epochs = int(curves["epoch"].max())
    fig.suptitle(f"RNN training curves, T={','.join(map(str, T))}, B={','.join(map(str, B))}, {epochs} epochs, "
                 f"lr={','.join(f'{v:g}' for v in sorted(set(curves['lr'])))}\n"
                 + provenance(curves, "one point per epoch"), fontsize=8)
    save(fig, out)


def plot_all(results: str | Path, out_dir: str | Path) -> list[Path]:
    results, out_dir = Path(results), Path(out_dir)
    s = phase_summary(load_all(results, "rnn", "bench_*.csv"))
    outs = []
    for axis, (a, b, c) in {"seq_len": ("a", "b", "c"), "batch": ("d", "e", "f")}.items():
        for letter, fn in zip((a, b, c), (fig_latency, fig_speedup, fig_breakdown)):
            path = out_dir / f"fig_8_{letter}.png"
            fn(s, axis, path)
            outs.append(path)
    path = out_dir / "fig_7.png"
    fig_7(load_all(results, "rnn", "curve_*.csv"), path)
    outs.append(path)
    return outs
