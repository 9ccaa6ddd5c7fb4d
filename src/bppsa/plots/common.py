"""Shared figure conventions: one colour per device, one line style per method, provenance in the title."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..io import atomic_path  # noqa: E402

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
