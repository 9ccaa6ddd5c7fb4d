"""Fig 7 (RNN training curves) and Fig 8a-f (backward latency, speedup and runtime breakdown
against the sequence length T and against the fraction of GPU per sample 1/B)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..analysis.results import load_all
from .common import (
    PROTOCOL_NOTE,
    SHORT_NAME,
    VARIANT_COLOR,
    VARIANT_STYLE,
    backends_of,
    baseline_name,
    curve_label,
    device_colors,
    errorbar,
    finish,
    footer_text,
    legend_below,
    n_text,
    panel_grid,
    panels,
    plain_log_axis,
    save,
    short_label,
    variant,
    variant_backends,
)

HATCH = {"baseline": "//", "baseline-packed": "\\\\", "bppsa-fused": "", "bppsa-paper": "xx"}
PHASE_COLOR = {"forward": "#4c72b0", "jacobian": "#dd8452", "backward_pass": "#c44e52", "optimizer": "#8c8c8c"}


BREAKDOWN = ["forward", "jacobian", "backward_pass", "optimizer"]
PHASE_LABEL = {"forward": "forward", "jacobian": "Jacobian generation", "backward_pass": "backward",
               "optimizer": "optimizer"}


def _variants(df: pd.DataFrame) -> list[str]:
    return sorted(df["variant"].unique(), key=lambda v: (v.startswith("bppsa"), v))


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


def _xlabel(axis: str, d: pd.DataFrame) -> str:
    """The x label: T, or the paper's "fraction of GPU per sample", naming the CPU where the panel's device is one."""
    if axis == "seq_len":
        return "sequence length T"
    cpu = "device" in d and len(d) and d["device"].astype(str).str.startswith("cpu").all()
    return f"fraction of {'the CPU' if cpu else 'GPU'} per sample 1/B"


def _xaxis(ax, d: pd.DataFrame, axis: str) -> None:
    """Log x-axis ticked at the measured values (1/B written as a fraction, as in the paper)."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    vals = sorted(d[axis].unique())
    ax.set_xticks([v if axis == "seq_len" else 1.0 / v for v in vals])
    ax.set_xticklabels([str(v) if axis == "seq_len" else f"1/{v}" for v in vals])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(_xlabel(axis, d))


def _panel_title(dev: str, backend: str, base_backend: str, base: str, fixed_txt: str) -> str:
    """'nvidia-h200 (reference)' over 'BPPSA (cupy-factored) vs cuDNN per-step · B = 16': the device, the
    backends of both sides (the legend, shared by every panel, names only the variants) and the fixed value."""
    who = f"BPPSA ({backend})" if backend else "BPPSA"
    return f"{dev}\n{who} vs {baseline_name(base_backend, base)} · {fixed_txt}"


def _shared_legend(fig, extra=()) -> list:
    """One handle per label over all panels, the baselines first: the figure's legend under the panels."""
    seen = {}
    for ax in fig.axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    order = list(SHORT_NAME.values())
    labels = sorted(seen, key=lambda lab: (order.index(lab) if lab in order else len(order), lab))
    return [seen[lab] for lab in labels] + list(extra)


def _fixed_txt(axis: str, value) -> str:
    return f"B = {value}" if axis == "seq_len" else f"T = {value}"


def _bppsa_variants(d: pd.DataFrame) -> list[str]:
    return sorted(v for v in d["variant"].unique() if str(v).startswith("bppsa"))


def fig_latency(lat: pd.DataFrame, axis: str, out: str | Path) -> None:
    """Fig 8a/d: the backward latency per iteration (BPPSA's includes its Jacobian generation), one panel per
    device and baseline: the baseline and each BPPSA layout, one line each."""
    lat = lat[(lat["mode"] == "full") & (lat["phase"] == "backward")]
    fixed = _fixed_values(lat, axis)
    d = _sweep(lat, axis, fixed)
    keys = panels(d, "variant")
    fig, cells = panel_grid(len(keys), height=3.8)
    for (dev, base), (ax,) in zip(keys, cells):
        dd = d[d["device_label"] == dev]
        for var in [base] + _bppsa_variants(dd):
            g = dd[dd["variant"] == var].sort_values(axis)
            errorbar(ax, _x(g, axis), g["median"], g["ci_low"], g["ci_high"], g["noisy"],
                     color=VARIANT_COLOR.get(var, "k"), label=short_label(var), scale=1e3, **VARIANT_STYLE.get(var, {}))
        _xaxis(ax, dd, axis)
        ax.set_yscale("log")
        plain_log_axis(ax, "y", unit="")
        ax.set_ylabel("backward per iteration (ms)")
        bppsa = dd[dd["variant"].astype(str).str.startswith("bppsa")]
        ax.set_title(_panel_title(dev, backends_of(bppsa), backends_of(dd[dd["variant"] == base]), base,
                                  _fixed_txt(axis, fixed[dev])), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    vs = "T" if axis == "seq_len" else "1/B"
    finish(fig, f"Fig 8{'a' if axis == 'seq_len' else 'd'}: backward latency per iteration against {vs} "
           "(BPPSA's includes its Jacobian generation)",
           footer_text(d, f"{PROTOCOL_NOTE}; {n_text(d)}"), handles=_shared_legend(fig))
    save(fig, out)


# the top row of Fig 8b/e: the backward speedup, by the phase timers and by the paper's nobp subtraction
BACKWARD_LINES = {"backward": dict(ls="-", alpha=1.0), "backward-nobp": dict(ls=":", alpha=0.55)}


def _speedup_lines(ax, g: pd.DataFrame, axis: str, phases: dict) -> None:
    for var in _bppsa_variants(g):
        for phase, style in phases.items():
            h = g[(g["variant"] == var) & (g["phase"] == phase) & g["resolved"]].sort_values(axis)
            if h.empty:
                continue
            errorbar(ax, _x(h, axis), h["speedup"], h["ci_low"], h["ci_high"], h["noisy"],
                     color=VARIANT_COLOR.get(var, "k"), ls=style["ls"], alpha=style["alpha"],
                     marker=VARIANT_STYLE.get(var, {}).get("marker", "o"),
                     label=short_label(var) if style.get("label") else None)


def fig_speedup(sp: pd.DataFrame, axis: str, out: str | Path) -> None:
    """Fig 8b/e: medians of paired per-round ratios with their CIs, one column of panels per device and baseline:
    above, the backward (the phase timers solid, the paper's nobp subtraction dotted, left out where it is not
    resolved); below, the whole iteration."""
    sp = sp[sp["phase"].isin(["backward", "backward-nobp", "iteration"])]
    fixed = _fixed_values(sp, axis)
    d = _sweep(sp, axis, fixed)
    keys = panels(d, "reference")
    fig, cells = panel_grid(len(keys), rows_per_panel=2, height=2.8)
    for (dev, base), (top, bottom) in zip(keys, cells):
        g = d[(d["device_label"] == dev) & (d["reference"] == base)]
        _speedup_lines(top, g, axis, BACKWARD_LINES)
        _speedup_lines(bottom, g, axis, {"iteration": dict(ls="-", alpha=1.0, label=True)})
        top.set_title(_panel_title(dev, backends_of(g), backends_of(g, column="reference_backend"), base,
                                   _fixed_txt(axis, fixed[dev])), fontsize=9)
        for ax, what in ((top, "backward"), (bottom, "whole iteration")):
            ax.axhline(1.0, color="k", lw=0.8)
            _xaxis(ax, g, axis)
            ax.set_yscale("log")
            plain_log_axis(ax, "y", unit="×")
            ax.set_ylabel(f"{what} speedup (×)")
            ax.grid(True, which="both", alpha=0.3)
        top.set_xlabel("")
    unresolved = d[~d["resolved"]]
    note = ""
    if len(unresolved):
        pts = sorted(set(zip(unresolved["device_label"], unresolved[axis])))
        name = "T" if axis == "seq_len" else "B"
        note = "; nobp subtraction not resolved (difference within the noise) at " + ", ".join(
            f"{dev} {name}={v}" for dev, v in pts)
    vs = "T" if axis == "seq_len" else "1/B"
    styles = [Line2D([], [], color="k", ls="-", label="backward, phase timers"),
              Line2D([], [], color="k", ls=":", alpha=0.55, label="backward, the paper's nobp subtraction")]
    finish(fig, f"Fig 8{'b' if axis == 'seq_len' else 'e'}: speedup of BPPSA over the baseline against {vs}\n"
           "above: the backward pass; below: the whole iteration",
           footer_text(d, f"median of paired per-round ratios, 95 % CI error bars; hollow = noisy; {n_text(d)}"
                          + note), handles=_shared_legend(fig, styles))
    save(fig, out)


def fig_breakdown(lat: pd.DataFrame, axis: str, out: str | Path) -> None:
    """Fig 8c/f: median time of each phase, normalised by the baseline's median iteration, one panel per device
    and baseline; the phases' colours in one legend below the panels, the variants' hatching in each panel."""
    lat = lat[lat["mode"] == "full"]
    fixed = _fixed_values(lat, axis)
    d = _sweep(lat, axis, fixed)
    keys = panels(d, "variant")
    fig, cells = panel_grid(len(keys), width=4.8, height=4.4)
    for (dev, base), (ax,) in zip(keys, cells):
        dd = d[d["device_label"] == dev]
        g = dd.set_index(["variant", axis, "phase"]).sort_index()
        xs = sorted(dd[axis].unique(), reverse=(axis == "batch"))
        xs = [v for v in xs if (base, v, "iteration") in g.index]  # where this panel's baseline was timed
        norm = {v: g.loc[(base, v, "iteration"), "median"] for v in xs}
        variants = [base] + _bppsa_variants(dd)
        backends = variant_backends(dd)
        width = 0.8 / len(variants)
        for j, var in enumerate(variants):
            pos = np.arange(len(xs)) + (j - (len(variants) - 1) / 2) * width
            bottom = np.zeros(len(xs))
            for phase in BREAKDOWN:
                vals = np.array([g.loc[(var, v, phase), "median"] / norm[v] if (var, v, phase) in g.index else 0.0
                                 for v in xs])
                ax.bar(pos, vals, width, bottom=bottom, color=PHASE_COLOR[phase], edgecolor="k", linewidth=0.4,
                       hatch=HATCH.get(var, ".."))
                bottom += vals
            # the whole iteration's median and CI (the phases' medians need not add up to it exactly)
            at = [(x, g.loc[(var, v, "iteration")], norm[v]) for x, v in zip(pos, xs)
                  if (var, v, "iteration") in g.index]
            if at:
                med, lo, hi = ([r[c] / n for _, r, n in at] for c in ("median", "ci_low", "ci_high"))
                errorbar(ax, [x for x, _, _ in at], med, lo, hi, [r["noisy"] for _, r, _ in at], color="k", ls="none",
                         marker="_")
        ax.set_xticks(np.arange(len(xs)))
        ax.set_xticklabels([str(v) if axis == "seq_len" else f"1/{v}" for v in xs])
        ax.set_xlabel(_xlabel(axis, dd))
        ax.set_ylabel("runtime / baseline runtime")
        bppsa = "/".join(sorted({backends[v] for v in variants[1:] if backends.get(v)}))
        ax.set_title(_panel_title(dev, bppsa, backends.get(base, ""), base, _fixed_txt(axis, fixed[dev])), fontsize=9)
        legend_below(ax, [Patch(facecolor="white", edgecolor="k", hatch=HATCH.get(v, ".."), label=short_label(v))
                          for v in variants])
        ax.grid(True, axis="y", alpha=0.3)
    phases = [Patch(facecolor=PHASE_COLOR[p], edgecolor="k", linewidth=0.4, label=PHASE_LABEL[p]) for p in BREAKDOWN]
    vs = "T" if axis == "seq_len" else "1/B"
    finish(fig, f"Fig 8{'c' if axis == 'seq_len' else 'f'}: runtime breakdown per iteration against {vs}, "
           "normalised by the baseline's median iteration",
           footer_text(d, "bars: median of each phase; black: the whole iteration's median and 95 % CI "
                          f"(hollow = noisy); {n_text(d)}"), handles=phases)
    save(fig, out)


DTYPE_STYLE = {"float32": dict(lw=1.6, alpha=1.0, ms=3), "float64": dict(lw=0.9, alpha=0.75, ms=5, mfc="none")}


def fig_7(curves: pd.DataFrame, out: str | Path) -> None:
    """Loss and accuracy against wall-clock (the paper's Fig 7) in the workflow's precision, and the per-epoch loss
    difference BPPSA vs baseline that claims.md judges, for every precision trained: Fig 7's curves trained in
    float64 too (curve_<variant>_float64.csv) are drawn there, thin and hollow, so that float round-off amplified
    by training can be told apart from a wrong gradient."""
    from ..analysis.claims import CURVE_TOL, CURVE_TOL_FLOAT64, curve_differences

    curves = curves.copy()
    curves["dtype"] = curves["dtype"].fillna("?").astype(str) if "dtype" in curves else "?"
    curves = curves.assign(variant=variant(curves))
    colors = device_colors(curves["device_label"])
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.6))
    # the least precise dtype is the workflow's (the twins are more precise); other dtypes only in the third panel
    main = min(set(curves["dtype"]), key=lambda dt: (dt != "float32", dt != "float64", dt))
    for (dev, var), g in curves[curves["dtype"] == main].groupby(["device_label", "variant"]):
        g = g.sort_values("epoch")
        style = dict(color=colors[dev], ls=VARIANT_STYLE[var]["ls"], marker=VARIANT_STYLE[var]["marker"], ms=3)
        lab = f"{curve_label(var, g)} · {dev}"
        a1.plot(g["wall_clock_s"], g["loss"], label=lab, **style)
        a2.plot(g["wall_clock_s"], g["accuracy"] * 100, label=lab, **style)
    for dev, g in curves.groupby("device_label"):
        for (dt, var), d in curve_differences(g).groupby(["dtype", "variant"]):
            d = d.sort_values("epoch")
            a3.plot(d["epoch"], d["rel"].clip(lower=1e-17), color=colors[dev], ls=VARIANT_STYLE[var]["ls"],
                    marker=VARIANT_STYLE[var]["marker"], **DTYPE_STYLE.get(dt, DTYPE_STYLE["float32"]),
                    label=f"{VARIANT_NAME_SHORT.get(var, var)} ({backends_of(d)}) vs baseline "
                          f"({backends_of(d, column='reference_backend')}) · {dt} · {dev}")
    a1.set_ylabel("training loss (cross-entropy)")
    a2.set_ylabel("training accuracy (%)")
    for a in (a1, a2):
        a.set_xlabel("wall-clock training time (s)")
        a.grid(True, alpha=0.3)
        legend_below(a, fontsize=6)  # under the axes: a third curve (the compiled forward's) leaves no empty corner
    a3.set_yscale("log")
    for tol, dt in ((CURVE_TOL, "float32"), (CURVE_TOL_FLOAT64, "float64")):
        if dt in set(curves["dtype"]):
            a3.axhline(tol, color="k", lw=0.7, ls=":")
            a3.annotate(f"claims.md tolerance, {dt}", (0.01, tol), xycoords=("axes fraction", "data"),
                        xytext=(0, 2), textcoords="offset points", fontsize=6)
    a3.set_xlabel("epoch")
    a3.set_ylabel("|loss(BPPSA) − loss(baseline)| / loss(baseline)")
    a3.set_title("per-epoch loss difference, same initial weights and batches\n(each precision against its own "
                 "baseline; 0 drawn at 1e-17)", fontsize=8)
    a3.xaxis.get_major_locator().set_params(integer=True)
    a3.grid(True, which="major", alpha=0.3)
    if a3.has_data():
        legend_below(a3, fontsize=6)
    T, B = sorted(set(curves["seq_len"])), sorted(set(curves["batch"]))
    epochs = int(curves["epoch"].max())
    others = sorted(set(curves["dtype"]) - {main})
    twin = f" · right: also trained in {', '.join(others)} (thin, hollow)" if others else ""
    finish(fig, f"Fig 7: RNN training curves, T={','.join(map(str, T))}, B={','.join(map(str, B))}, {epochs} "
           f"epochs, lr={','.join(f'{v:g}' for v in sorted(set(curves['lr'])))}, {main}{twin}",
           footer_text(curves, "one point per epoch"))
    save(fig, out)


VARIANT_NAME_SHORT = {"bppsa-fused": "BPPSA fused", "bppsa-paper": "BPPSA paper",
                      "bppsa-fused-compiled": "BPPSA fused, compiled fwd",
                      "bppsa-paper-compiled": "BPPSA paper, compiled fwd"}


def draw(results: str | Path, inputs: list, outputs: list) -> None:
    """Fig 7, then Fig 8a-f, to ``outputs`` (bppsa.plots.registry), from every device folder under ``results``."""
    fig7, *fig8 = outputs
    fig_7(load_all(results, "rnn", "curve_*.csv"), fig7)
    lat = load_all(results, "rnn", "latency.csv")
    sp = load_all(results, "rnn", "speedups.csv")
    panels = iter(fig8)
    for axis in ("seq_len", "batch"):
        for fn, df in zip((fig_latency, fig_speedup, fig_breakdown), (lat, sp, lat)):
            fn(df, axis, next(panels))
