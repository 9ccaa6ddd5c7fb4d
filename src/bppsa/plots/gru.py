"""Fig 9 (GRU runtime breakdown per MFCC set and batch size) and Fig 13 (GRU training curves)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from .. import paper
from ..data.irmas import MFCC_SETS
from ..io import write_csv
from ..results import load_all
from .common import PROTOCOL_NOTE, VARIANT_NAME, VARIANT_STYLE, device_colors, errorbar, provenance, save, variant

SET_OF_FRAMES = {s.frames: name.upper() for name, s in MFCC_SETS.items()}
SET_ORDER = [n.upper() for n in MFCC_SETS]
# The paper's four categories; BP and BPPSA include the optimizer step, as the paper's
# "full minus nobp" subtraction does.
SEGMENTS = {"FP": "#4c72b0", "FO": "#dd8452", "BP": "#c44e52", "BPPSA": "#55a868"}


def set_name(seq_len: int) -> str:
    return SET_OF_FRAMES.get(int(seq_len), f"T={int(seq_len)}")


def breakdown(lat: pd.DataFrame, sp: pd.DataFrame) -> pd.DataFrame:
    """One row per (device, profile, set, B, BPPSA variant): median FP/FO/BP/BPPSA seconds per iteration,
    the whole iterations' medians and CIs, and the paired-ratio speedups with their CIs.

    FP forward; FO BPPSA's Jacobian generation; BP and BPPSA the backward pass plus the optimizer
    step, as the paper's "full minus nobp" subtraction counts them.
    """
    lat = lat[lat["mode"] == "full"]
    on = ["device_label", "profile", "seq_len", "batch"]
    med = lat.pivot_table(index=on + ["variant"], columns="phase", values="median", aggfunc="first")
    it = lat[lat["phase"] == "iteration"].set_index(on + ["variant"])
    spw = sp[sp["phase"].isin(["backward-excl-FO", "iteration"])].set_index(on + ["variant", "reference", "phase"])
    rows = []
    for key, g in sp[sp["reference"] == "baseline"].groupby(on + ["variant"]):
        ref_key, var_key = tuple(key[:-1]) + ("baseline",), tuple(key)
        if ref_key not in med.index or var_key not in med.index:
            continue
        a, b = med.loc[ref_key].fillna(0.0), med.loc[var_key].fillna(0.0)
        r = dict(zip(on + ["variant"], key))
        r.update(set=set_name(key[2]), n=int(g["n"].min()), base_FP=a["forward"],
                 base_BP=a["backward_pass"] + a["optimizer"], FP=b["forward"], FO=b["jacobian"],
                 BPPSA=b["backward_pass"] + b["optimizer"])
        for who, k in (("base", ref_key), ("bppsa", var_key)):
            r.update({f"{who}_iter": it.loc[k, "median"], f"{who}_iter_low": it.loc[k, "ci_low"],
                      f"{who}_iter_high": it.loc[k, "ci_high"], f"{who}_noisy": bool(it.loc[k, "noisy"])})
        for phase, name in (("backward-excl-FO", "bp_speedup"), ("iteration", "overall_speedup")):
            row = spw.loc[var_key + ("baseline", phase)]
            r.update({name: row["speedup"], f"{name}_low": row["ci_low"], f"{name}_high": row["ci_high"],
                      f"{name}_noisy": bool(row["noisy"])})
        r["norm"] = r["base_FP"] + r["base_BP"]
        rows.append(r)
    out = pd.DataFrame(rows)
    if out.empty:
        raise FileNotFoundError("no GRU configuration measured with both the baseline and BPPSA")
    out["set_rank"] = out["set"].map({n: i for i, n in enumerate(SET_ORDER)}).fillna(len(SET_ORDER))
    return out.sort_values(["device_label", "set_rank", "seq_len", "batch"]).reset_index(drop=True)


def fig_9(lat: pd.DataFrame, sp: pd.DataFrame, out: str | Path) -> pd.DataFrame:
    d = breakdown(lat, sp)
    devices = sorted(d["device_label"].unique(), key=lambda v: ("reference" in v, v))
    fig, axes = plt.subplots(len(devices), 1, figsize=(max(9.0, 0.9 * d.groupby("device_label").size().max() + 2),
                                                       3.8 * len(devices)), squeeze=False)
    width = 0.38
    for ax, dev in zip(axes[:, 0], devices):
        g = d[d["device_label"] == dev].reset_index(drop=True)
        x = np.arange(len(g))
        norm = g["norm"].to_numpy()
        stacks = {"baseline": [("FP", g["base_FP"]), ("BP", g["base_BP"])],
                  "bppsa": [("FP", g["FP"]), ("FO", g["FO"]), ("BPPSA", g["BPPSA"])]}
        iters = {"baseline": "base", "bppsa": "bppsa"}
        for j, (method, segs) in enumerate(stacks.items()):
            pos = x + (j - 0.5) * width
            bottom = np.zeros(len(g))
            for name, vals in segs:
                v = vals.to_numpy() / norm
                ax.bar(pos, v, width, bottom=bottom, color=SEGMENTS[name], edgecolor="k", linewidth=0.5,
                       hatch="//" if method == "baseline" else None)
                bottom += v
            w = iters[method]
            # the whole iteration's median and 95 % CI (the phases' medians need not add up to it exactly)
            errorbar(ax, pos, g[f"{w}_iter"] / norm, g[f"{w}_iter_low"] / norm, g[f"{w}_iter_high"] / norm,
                     g[f"{w}_noisy"], color="k", ls="none", marker="_")
            if method == "bppsa":
                tops = np.maximum(bottom, g["bppsa_iter_high"].to_numpy() / norm)
                for xi, top, (_, r) in zip(pos, tops, g.iterrows()):
                    ax.annotate(f"bwd {r.bp_speedup:.3g}× [{r.bp_speedup_low:.3g}, {r.bp_speedup_high:.3g}]"
                                f"{' noisy' if r.bp_speedup_noisy else ''}\nall {r.overall_speedup:.3g}× "
                                f"[{r.overall_speedup_low:.3g}, {r.overall_speedup_high:.3g}]"
                                f"{' noisy' if r.overall_speedup_noisy else ''}", (xi, top), xytext=(0, 2),
                                textcoords="offset points", ha="center", va="bottom", fontsize=5)
        ax.axhline(1.0, color="k", lw=0.6, ls=":")
        ax.set_xticks(x)
        ax.set_xticklabels([f"{s}\nB={b}" for s, b in zip(g["set"], g["batch"])], fontsize=8)
        ax.set_xlabel("MFCC set (S: T=259, M: T=517, L: T=1034) and batch size B"
                      "   (left bar: baseline, hatched; right bar: BPPSA)", fontsize=8)
        ax.set_ylabel("time per iteration /\nbaseline (FP + BP)")
        ax.set_ylim(0, max(1.35, float(ax.get_ylim()[1]) * 1.18))  # room for the legend and speedup labels
        ax.set_title(dev, fontsize=9)
        handles = [Patch(facecolor=c, edgecolor="k", label=n) for n, c in SEGMENTS.items()]
        ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("GRU runtime breakdown per iteration (Fig 9), normalised by the baseline's FP + BP\n"
                 "FP forward · FO Jacobian overhead · BP baseline backward · BPPSA scan backward "
                 "(BP and BPPSA include the optimizer step)\n"
                 "labels: BPPSA speedup [95 % CI], medians of paired per-round ratios; bwd = BP / BPPSA (excluding FO, "
                 f"like the paper's {paper.GRU_MAX_BACKWARD.value:g}×), all = whole iteration\n"
                 + provenance(lat, f"bars: medians of each phase; black: {PROTOCOL_NOTE}; "
                                   f"n = {int(d['n'].min())}–{int(d['n'].max())} rounds"), fontsize=8)
    save(fig, out)
    return d


def fig_13(curves: pd.DataFrame, out: str | Path) -> None:
    curves = curves.copy()
    curves["set"] = curves["seq_len"].map(set_name)
    curves["variant"] = variant(curves)
    sets = sorted(curves["set"].unique(), key=lambda n: (SET_ORDER.index(n) if n in SET_ORDER else 99, n))
    colors = device_colors(curves["device_label"])
    fig, axes = plt.subplots(1, len(sets), figsize=(4.6 * len(sets), 4.2), squeeze=False)
    for ax, name in zip(axes[0], sets):
        sub = curves[curves["set"] == name]
        for (dev, var), g in sub.groupby(["device_label", "variant"]):
            g = g.sort_values("epoch")
            style = VARIANT_STYLE.get(var, dict(ls="-", marker="o"))
            ax.plot(g["wall_clock_s"], g["loss"], color=colors[dev], ls=style["ls"], marker=style["marker"], ms=3,
                    label=f"{VARIANT_NAME.get(var, var)} · {dev}")
        spec = MFCC_SETS.get(name.lower())
        ax.set_title(f"set {name} ({spec.frames} frames × {spec.features} features)" if spec else f"set {name}",
                     fontsize=9)
        ax.set_xlabel("wall-clock training time (s)")
        ax.set_ylabel("training loss (cross-entropy)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    B = ",".join(map(str, sorted(set(curves["batch"]))))
    lr = ",".join(f"{v:g}" for v in sorted(set(curves["lr"])))
    epochs = int(curves["epoch"].max())
    samples = ",".join(map(str, sorted(set(curves["samples"])))) if "samples" in curves else "?"
    fig.suptitle(f"GRU training curves (Fig 13): B={B}, {epochs} epochs, Adam lr={lr}, {samples} clips\n"
                 + provenance(curves, "one point per epoch"), fontsize=8)
    save(fig, out)


def plot_all(results: str | Path, out_dir: str | Path) -> list[Path]:
    results, out_dir = Path(results), Path(out_dir)
    outs = [out_dir / "fig_9.png", out_dir / "fig_13.png"]
    lat, sp = load_all(results, "gru", "latency.csv"), load_all(results, "gru", "speedups.csv")
    d = fig_9(lat, sp, outs[0])
    # the numbers behind the bars, for the report (seconds per iteration)
    d["data"] = ", ".join(sorted(set(map(str, lat["data"].fillna(""))))) if "data" in lat else ""
    cols = ["device_label", "profile", "data", "set", "seq_len", "batch", "variant", "n", "base_FP", "base_BP", "FP",
            "FO", "BPPSA", "bp_speedup", "bp_speedup_low", "bp_speedup_high", "bp_speedup_noisy", "overall_speedup",
            "overall_speedup_low", "overall_speedup_high", "overall_speedup_noisy"]
    table = out_dir / "fig_9_data.csv"
    write_csv(table, d[cols])
    fig_13(load_all(results, "gru", "curve_*.csv"), outs[1])
    return outs + [table]
