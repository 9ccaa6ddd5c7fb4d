"""Fig 9 (GRU runtime breakdown per MFCC set and batch size) and Fig 13 (GRU training curves)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from .. import paper
from ..analysis.results import load_all
from ..data.irmas import MFCC_SETS
from ..io import write_csv
from .common import (
    MIN_WIDTH_IN,
    PROTOCOL_NOTE,
    VARIANT_STYLE,
    backends_of,
    baseline_name,
    curve_label,
    device_colors,
    device_order,
    errorbar,
    finish,
    footer_text,
    legend_below,
    n_text,
    save,
    variant,
)

SET_OF_FRAMES = {s.frames: name.upper() for name, s in MFCC_SETS.items()}
SET_ORDER = [n.upper() for n in MFCC_SETS]
# The paper's four categories; BP and BPPSA include the optimizer step, as the paper's
# "full minus nobp" subtraction does.
SEGMENTS = {"FP": "#4c72b0", "FO": "#dd8452", "BP": "#c44e52", "BPPSA": "#55a868"}


def set_name(seq_len: int) -> str:
    return SET_OF_FRAMES.get(int(seq_len), f"T={int(seq_len)}")


def breakdown(lat: pd.DataFrame, sp: pd.DataFrame) -> pd.DataFrame:
    """One row per (device, profile, set, B, BPPSA variant, baseline): median FP/FO/BP/BPPSA seconds per
    iteration, the whole iterations' medians and CIs, and the paired-ratio speedups with their CIs.

    FP forward; FO BPPSA's Jacobian generation; BP and BPPSA the backward pass plus the optimizer
    step, as the paper's "full minus nobp" subtraction counts them.  ``reference`` is the baseline the row is
    measured against: ``baseline`` (autograd, cuDNN) or ``baseline-packed`` (cuDNN per-step, on a GPU).
    """
    lat = lat[lat["mode"] == "full"]
    on = ["device_label", "profile", "seq_len", "batch"]
    med = lat.pivot_table(index=on + ["variant"], columns="phase", values="median", aggfunc="first")
    it = lat[lat["phase"] == "iteration"].set_index(on + ["variant"])
    spw = sp[sp["phase"].isin(["backward-excl-FO", "iteration"])].set_index(on + ["variant", "reference", "phase"])
    rows = []
    baselines = sp[sp["reference"].astype(str).str.startswith("baseline")]
    for key, g in baselines.groupby(on + ["variant", "reference"]):
        ref_key, var_key = tuple(key[:-2]) + (key[-1],), tuple(key[:-1])
        if ref_key not in med.index or var_key not in med.index:
            continue
        a, b = med.loc[ref_key].fillna(0.0), med.loc[var_key].fillna(0.0)
        r = dict(zip(on + ["variant", "reference"], key))
        r.update(set=set_name(key[2]), n=int(g["n"].min()), base_FP=a["forward"],
                 base_BP=a["backward_pass"] + a["optimizer"], FP=b["forward"], FO=b["jacobian"],
                 BPPSA=b["backward_pass"] + b["optimizer"])
        r.update(backend=backends_of(g), reference_backend=backends_of(g, column="reference_backend"))
        for who, k in (("base", ref_key), ("bppsa", var_key)):
            r.update({f"{who}_iter": it.loc[k, "median"], f"{who}_iter_low": it.loc[k, "ci_low"],
                      f"{who}_iter_high": it.loc[k, "ci_high"], f"{who}_noisy": bool(it.loc[k, "noisy"])})
        for phase, name in (("backward-excl-FO", "bp_speedup"), ("iteration", "overall_speedup")):
            row = spw.loc[var_key + (key[-1], phase)]
            r.update({name: row["speedup"], f"{name}_low": row["ci_low"], f"{name}_high": row["ci_high"],
                      f"{name}_noisy": bool(row["noisy"])})
        r["norm"] = r["base_FP"] + r["base_BP"]
        rows.append(r)
    out = pd.DataFrame(rows)
    if out.empty:
        raise FileNotFoundError("no GRU configuration measured with both the baseline and BPPSA")
    out["set_rank"] = out["set"].map({n: i for i, n in enumerate(SET_ORDER)}).fillna(len(SET_ORDER))
    out["device_rank"] = out["device_label"].map({d: i for i, d in enumerate(device_order(out["device_label"]))})
    out = out.sort_values(["device_rank", "reference", "set_rank", "seq_len", "batch"]).reset_index(drop=True)
    return out.drop(columns="device_rank")


def _speedup_label(r) -> str:
    """The text above a configuration's bars: both speedups with their intervals, a '*' where noisy."""
    def one(name, key):
        star = "*" if r[f"{key}_noisy"] else ""
        lo, hi = r[f"{key}_low"], r[f"{key}_high"]
        ci = f"[{lo:.3g}, {hi:.3g}]" if np.isfinite(lo) and np.isfinite(hi) else "[no interval]"  # too few rounds
        return f"{name} {r[key]:.3g}×{star}\n{ci}"

    return one("bwd", "bp_speedup") + "\n" + one("all", "overall_speedup")


LABEL_FONTSIZE = 6.5


def _fit_labels(ax, anchors) -> None:
    """Raise the y-limit until every label (drawn above its anchor) ends below the top of the axes."""
    fig = ax.figure
    fig.canvas.draw()
    height_px = ax.get_window_extent().height
    y0, y1 = ax.get_ylim()
    need = y1
    for text, anchor in anchors:
        h = text.get_window_extent().height + 4  # the label and its offset, in pixels
        if h < height_px:
            need = max(need, y0 + (anchor - y0) * height_px / (height_px - h))
    ax.set_ylim(y0, need * 1.02)


PER_CONFIG_IN = 0.95  # inches of panel per configuration: its speedup label is about that wide
PER_PANEL_IN = 1.1    # the y axis' labels
MAX_ROW_IN = 18.0


def _fig9_grid(sizes: list[int]):
    """One panel per device and baseline, as wide as its configurations: side by side where they fit in one row
    of MAX_ROW_IN inches, one under the other otherwise."""
    widths = [PER_PANEL_IN + PER_CONFIG_IN * max(n, 2) for n in sizes]
    if sum(widths) <= MAX_ROW_IN:
        fig, axes = plt.subplots(1, len(sizes), figsize=(max(8.0, sum(widths)), 4.8), squeeze=False,
                                 gridspec_kw=dict(width_ratios=widths))
        return fig, list(axes[0])
    fig, axes = plt.subplots(len(sizes), 1, figsize=(max(8.0, max(widths)), 4.2 * len(sizes)), squeeze=False)
    return fig, list(axes[:, 0])


def _fig9_panel(ax, g: pd.DataFrame) -> list:
    """The stacked bars of one device and baseline; returns the speedup labels with their anchors."""
    x = np.arange(len(g))
    norm = g["norm"].to_numpy()
    stacks = {"base": [("FP", g["base_FP"]), ("BP", g["base_BP"])],
              "bppsa": [("FP", g["FP"]), ("FO", g["FO"]), ("BPPSA", g["BPPSA"])]}
    tops = np.zeros(len(g))
    for j, (who, segs) in enumerate(stacks.items()):
        pos = x + (j - 0.5) * BAR_WIDTH
        bottom = np.zeros(len(g))
        for name, vals in segs:
            v = vals.to_numpy() / norm
            ax.bar(pos, v, BAR_WIDTH, bottom=bottom, color=SEGMENTS[name], edgecolor="k", linewidth=0.5,
                   hatch="//" if who == "base" else None)
            bottom += v
        # the whole iteration's median and 95 % CI (the phases' medians need not add up to it exactly)
        errorbar(ax, pos, g[f"{who}_iter"] / norm, g[f"{who}_iter_low"] / norm, g[f"{who}_iter_high"] / norm,
                 g[f"{who}_noisy"], color="k", ls="none", marker="_")
        # fmax: an interval too few rounds could give (NaN) must not hide the label
        tops = np.fmax(tops, np.fmax(bottom, g[f"{who}_iter_high"].to_numpy() / norm))
    # one label per configuration, centred above the taller of its two bars: never on a bar, and a
    # configuration's width apart from the next
    labels = [(ax.annotate(_speedup_label(r), (xi, top), xytext=(0, 3), textcoords="offset points", ha="center",
                           va="bottom", fontsize=LABEL_FONTSIZE, linespacing=1.1), top)
              for xi, top, (_, r) in zip(x, tops, g.iterrows())]
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{s}\nB={b}" for s, b in zip(g["set"], g["batch"])], fontsize=8)
    pad = max(0, 2 - len(g)) / 2  # a panel is at least two configurations wide, its bars in the middle
    ax.set_xlim(-0.6 - pad, len(g) - 0.4 + pad)
    ax.set_xlabel("MFCC set and batch size B", fontsize=8)
    ax.set_ylim(0, max(1.1, float(tops.max()) * 1.05))
    ax.grid(True, axis="y", alpha=0.3)
    return labels


BAR_WIDTH = 0.38


def fig_9(lat: pd.DataFrame, sp: pd.DataFrame, out: str | Path) -> pd.DataFrame:
    """Fig 9: per configuration the baseline's bar (hatched: FP + BP) beside BPPSA's (FP + FO + BPPSA), normalised
    by the baseline's FP + BP, one panel per device and baseline; the speedups with their intervals above."""
    d = breakdown(lat, sp)
    keys = list(dict.fromkeys(zip(d["device_label"], d["reference"])))
    groups = [d[(d["device_label"] == dev) & (d["reference"] == ref)].reset_index(drop=True) for dev, ref in keys]
    fig, axes = _fig9_grid([len(g) for g in groups])
    fitted = []
    for ax, (dev, ref), g in zip(axes, keys, groups):
        fitted.append((ax, _fig9_panel(ax, g)))
        be, ref_be = backends_of(g), backends_of(g, column="reference_backend")
        ax.set_title(f"{dev}\nBPPSA{f' ({be})' if be else ''} vs {baseline_name(ref_be, ref)}", fontsize=9)
    for ax in axes:
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel("time per iteration / baseline (FP + BP)")
    handles = [Patch(facecolor=c, edgecolor="k", label=n) for n, c in SEGMENTS.items()]
    handles += [Patch(facecolor="white", edgecolor="k", hatch="//", label="left: baseline"),
                Patch(facecolor="white", edgecolor="k", label="right: BPPSA")]
    cpu_note = ("; on a CPU the fast path recomputes the gates inside its backward: there FO is only the set-up and "
                "bwd includes it") if "backend" in sp and (sp["backend"] == "cpu").any() else ""
    sets = ", ".join(f"{n.upper()}: T={s.frames}" for n, s in MFCC_SETS.items())
    finish(fig, "Fig 9: GRU runtime breakdown per iteration, normalised by the baseline's FP + BP\n"
           "above the bars: BPPSA's speedup [95 % CI], bwd = backward without FO, all = whole iteration (* noisy)",
           footer_text(lat, f"FP forward · FO Jacobian overhead · BP baseline backward · BPPSA scan backward (BP and "
                            f"BPPSA include the optimizer step) · sets {sets}{cpu_note}\n"
                            f"bwd = BP / BPPSA as the paper's {paper.GRU_MAX_BACKWARD.value:g}×; speedups: medians of "
                            f"paired per-round ratios; bars: medians of each phase; black: {PROTOCOL_NOTE}; "
                            + n_text(d)), handles=handles)
    for ax, labels in fitted:  # the final layout first: the labels' room depends on the axes' height
        _fit_labels(ax, labels)
    save(fig, out)
    return d


def fig_13(curves: pd.DataFrame, out: str | Path) -> None:
    curves = curves.copy()
    curves["set"] = curves["seq_len"].map(set_name)
    curves["variant"] = variant(curves)
    sets = sorted(curves["set"].unique(), key=lambda n: (SET_ORDER.index(n) if n in SET_ORDER else 99, n))
    colors = device_colors(curves["device_label"])
    # never narrower than the title: one set alone (the .test profile) clipped it
    fig, axes = plt.subplots(1, len(sets), figsize=(max(4.6 * len(sets), MIN_WIDTH_IN), 4.2), squeeze=False)
    for ax, name in zip(axes[0], sets):
        sub = curves[curves["set"] == name]
        for (dev, var), g in sub.groupby(["device_label", "variant"]):
            g = g.sort_values("epoch")
            style = VARIANT_STYLE.get(var, dict(ls="-", marker="o"))
            ax.plot(g["wall_clock_s"], g["loss"], color=colors[dev], ls=style["ls"], marker=style["marker"], ms=3,
                    label=f"{curve_label(var, g)} · {dev}")
        spec = MFCC_SETS.get(name.lower())
        ax.set_title(f"set {name} ({spec.frames} frames × {spec.features} features)" if spec else f"set {name}",
                     fontsize=9)
        ax.set_xlabel("wall-clock training time (s)")
        ax.set_ylabel("training loss (cross-entropy)")
        ax.grid(True, alpha=0.3)
        legend_below(ax)  # under the axes: three curves leave no empty corner in a set's panel
    B = ",".join(map(str, sorted(set(curves["batch"]))))
    lr = ",".join(f"{v:g}" for v in sorted(set(curves["lr"])))
    epochs = int(curves["epoch"].max())
    samples = ",".join(map(str, sorted(set(curves["samples"])))) if "samples" in curves else "?"
    finish(fig, f"Fig 13: GRU training curves, B={B}, {epochs} epochs, Adam lr={lr}, {samples} clips",
           footer_text(curves, "one point per epoch"))
    save(fig, out)


def draw(results: str | Path, inputs: list, outputs: list) -> None:
    """Fig 9, Fig 13 and the numbers behind Fig 9's bars, to ``outputs`` (bppsa.plots.registry), from every device
    folder under ``results``."""
    fig9, fig13, table = outputs
    lat, sp = load_all(results, "gru", "latency.csv"), load_all(results, "gru", "speedups.csv")
    d = fig_9(lat, sp, fig9)
    # the numbers behind the bars, for the report (seconds per iteration)
    d["data"] = ", ".join(sorted(set(map(str, lat["data"].fillna(""))))) if "data" in lat else ""
    cols = ["device_label", "profile", "data", "set", "seq_len", "batch", "variant", "reference", "n", "base_FP",
            "base_BP", "FP", "FO", "BPPSA", "bp_speedup", "bp_speedup_low", "bp_speedup_high", "bp_speedup_noisy",
            "overall_speedup", "overall_speedup_low", "overall_speedup_high", "overall_speedup_noisy"]
    write_csv(table, d[cols])
    fig_13(load_all(results, "gru", "curve_*.csv"), fig13)
