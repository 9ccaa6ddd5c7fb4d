"""Shared figure conventions: one colour per device, one line style per method, provenance in the title."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..io import atomic_path  # noqa: E402

VARIANT_STYLE = {"baseline": dict(ls="--", marker="s"), "baseline-packed": dict(ls=":", marker="D"),
                 "bppsa-fused": dict(ls="-", marker="o"), "bppsa-paper": dict(ls="-.", marker="^")}
VARIANT_NAME = {"baseline": "baseline (autograd/cuDNN)",
                "baseline-packed": "baseline, packed (cuDNN per-step, the paper's)",
                "bppsa-fused": "BPPSA (fused Jacobians)", "bppsa-paper": "BPPSA (paper's two Jacobians per step)"}
PROTOCOL_NOTE = "median, 95 % CI error bars; hollow = noisy"


def errorbar(ax, x, med, lo, hi, noisy, *, color, label=None, marker="o", ls="-", scale=1.0, **kw):
    """Medians with their (asymmetric) intervals; points flagged noisy are drawn hollow."""
    import numpy as np

    x, med, lo, hi = (np.asarray(v, dtype=float) for v in (x, med, lo, hi))
    noisy = np.asarray(noisy, dtype=bool)
    yerr = np.vstack([np.clip(med - lo, 0, None), np.clip(hi - med, 0, None)]) * scale
    ax.errorbar(x, med * scale, yerr=yerr, color=color, ls=ls, marker=marker, capsize=2, label=label, **kw)
    if noisy.any():
        ax.plot(x[noisy], med[noisy] * scale, ls="none", marker=marker, color=color, mfc="white", zorder=5, **kw)


def variant(df):
    """'baseline' or 'bppsa-<layout>' per row: what a line or bar of a figure stands for."""
    layout = df["layout"].fillna("").astype(str) if "layout" in df else ""
    return df["method"].where(df["method"] == "baseline", "bppsa-" + layout)


def device_colors(labels) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ordered = sorted(set(labels), key=lambda s: ("reference" in s, s))  # committed reference folders last
    return {lab: cycle[i % len(cycle)] for i, lab in enumerate(ordered)}


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
