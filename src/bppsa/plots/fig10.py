"""Fig 10: FLOP of each BPPSA step (CSR operands) against its dense size m*n*k, beside BP's gradient operators."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..analysis.results import load_all  # noqa: E402
from .common import save  # noqa: E402


# the paper's five series; the baseline drawn as green circles as in the paper
def _scan_ops(kind, critical):
    return lambda d: (d.phase != "baseline") & (d.kind == kind) & (d.critical == critical)


SERIES = [
    ("mv", _scan_ops("mv", False), dict(marker="o", c="tab:orange", alpha=0.5, s=22)),
    ("mm", _scan_ops("mm", False), dict(marker="o", c="tab:blue", alpha=0.5, s=22)),
    ("mv (critical)", _scan_ops("mv", True), dict(marker="o", c="tab:red", s=30)),
    ("mm (critical)", _scan_ops("mm", True), dict(marker="o", c="tab:purple", s=30)),
    ("baseline (BP)", lambda d: d.phase == "baseline",
     dict(marker="o", facecolors="none", edgecolors="tab:green", s=40, linewidths=1.3)),
]
TITLES = {"pruned": "pruned VGG-11 (retrained), as in the paper", "dense": "unpruned VGG-11, for comparison"}


def draw(results: str | Path, inputs: list, outputs: list) -> None:
    """Fig 10 to ``outputs`` (bppsa.plots.registry), from every device folder under ``results``."""
    (out,) = outputs
    df = load_all(results, "vgg11", "flops.csv")
    df["critical"] = df["critical"].astype(bool)
    nets = [n for n in ("pruned", "dense") if n in set(df["network"])]
    fig, axes = plt.subplots(1, len(nets), figsize=(6.2 * len(nets), 5.0), squeeze=False)
    for ax, net in zip(axes[0], nets):
        d = df[df["network"] == net]
        zero = int((d["flop"] <= 0).sum())
        d = d[d["flop"] > 0]  # a product of all-zero operands has no place on a log axis
        for label, sel, style in SERIES:
            s = d[sel(d)]
            if len(s):
                ax.scatter(s["dense_size"], s["flop"], label=f"{label} ({len(s)})", **style)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("m·n·k (size of the product if the matrices were dense)")
        ax.set_ylabel("FLOP with CSR operands")
        first = d.iloc[0] if len(d) else df[df["network"] == net].iloc[0]
        samples = df[df["network"] == net][["device_label", "sample"]].drop_duplicates().shape[0]
        how = f"{100 * float(first['prune']):g}% pruned ({first['scheme']})" if net == "pruned" else "no weight pruned"
        per = d.groupby(["device_label", "sample"])
        crit = per.apply(lambda t: t.loc[(t.phase != "baseline") & t.critical, "flop"].sum()).mean()
        base = per.apply(lambda t: t.loc[t.phase == "baseline", "flop"].sum()).mean()
        ax.text(0.98, 0.02, f"per sample: BPPSA critical path {crit:.3g} FLOP\nBP (all steps) {base:.3g} FLOP",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=8)
        ax.set_title(f"{TITLES[net]}\nwidth ×{first['width']:g}, {how}, "
                     f"L_m={first['L_m']}, {samples} sample(s)" + (f", {zero} zero-FLOP ops not shown" if zero else ""),
                     fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    profiles = ", ".join(sorted(set(map(str, df["profile"]))))
    devices = ", ".join(sorted(set(df["device_label"])))
    data = ", ".join(sorted(set(map(str, df["data"]))))
    models = ", ".join(sorted(set(map(str, df["models"]))))
    fig.suptitle(f"Fig 10: FLOP per step, BPPSA vs BP · profile: {profiles} · device: {devices}\n"
                 f"data: {data} · models: {models}", fontsize=10)
    save(fig, out)
