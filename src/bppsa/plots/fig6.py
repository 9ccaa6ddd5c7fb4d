"""Fig 6: LeNet-5's training and test loss per iteration, trained through autograd and through BPPSA
(``bppsa.nn.Sequential``) from the same seed and batches, and their difference (as Fig 7's third panel), in the
workflow's precision and in the float64 twin that tells round-off from a wrong gradient."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D

from ..analysis.results import load_all
from .common import device_colors, finish, footer_text, save

# autograd wide and pale underneath, BPPSA thin and dashed on top: where they overlap both stay visible
METHOD_STYLE = {"autograd": dict(ls="-", lw=3.0, alpha=0.4), "bppsa": dict(ls="--", lw=1.2)}
METHOD_LABEL = {"autograd": "autograd", "bppsa": "BPPSA (bppsa.nn.Sequential)"}
SPLIT_STYLE = {"train": dict(marker=None), "test": dict(marker="o", ms=3)}
DTYPE_STYLE = {"float32": dict(lw=1.4, alpha=1.0), "float64": dict(lw=0.8, alpha=0.8, mfc="none")}


def loss_differences(c: pd.DataFrame) -> pd.DataFrame:
    """Per device, dtype, split and iteration: |loss(BPPSA) - loss(autograd)| / loss(autograd)."""
    rows = []
    for (dev, dt, split), g in c.groupby(["device_label", "dtype", "split"]):
        t = g.pivot_table(index="iteration", columns="method", values="loss")
        if not {"autograd", "bppsa"} <= set(t.columns):
            continue
        rel = ((t["bppsa"] - t["autograd"]).abs() / t["autograd"].abs()).dropna()
        rows += [dict(device_label=dev, dtype=dt, split=split, iteration=int(i), rel=float(r)) for i, r in rel.items()]
    return pd.DataFrame(rows, columns=["device_label", "dtype", "split", "iteration", "rel"])


def fig_6(curves: pd.DataFrame, out: str | Path) -> None:
    from ..analysis.claims import CURVE_TOL, CURVE_TOL_FLOAT64

    curves = curves.copy()
    curves["dtype"] = curves["dtype"].astype(str)
    main = min(set(curves["dtype"]), key=lambda dt: (dt != "float32", dt != "float64", dt))
    colors = device_colors(curves["device_label"])
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.6))
    for (dev, method), g in curves[curves["dtype"] == main].groupby(["device_label", "method"]):
        for ax, split in ((a1, "train"), (a2, "test")):
            d = g[g["split"] == split].sort_values("iteration")
            ax.plot(d["iteration"], d["loss"], color=colors[dev], **METHOD_STYLE.get(method, {}),
                    **SPLIT_STYLE[split])
    for (dev, dt, split), d in loss_differences(curves).groupby(["device_label", "dtype", "split"]):
        d = d.sort_values("iteration")
        a3.plot(d["iteration"], d["rel"].clip(lower=1e-17), color=colors[dev], ls="-" if split == "train" else ":",
                **SPLIT_STYLE[split], **DTYPE_STYLE.get(dt, DTYPE_STYLE["float32"]))
    a1.set_ylabel("training loss of the iteration's batch")
    a2.set_ylabel("test loss (cross-entropy)")
    for a in (a1, a2):
        a.set_xlabel("iteration")
        a.grid(True, alpha=0.3)
    a1.legend(handles=[Line2D([], [], color="k", **METHOD_STYLE[m], label=METHOD_LABEL[m]) for m in METHOD_STYLE],
              fontsize=7)
    a3.set_yscale("log")
    for tol, dt in ((CURVE_TOL, "float32"), (CURVE_TOL_FLOAT64, "float64")):
        if dt in set(curves["dtype"]):
            a3.axhline(tol, color="k", lw=0.7, ls=(0, (1, 3)))
            a3.annotate(f"claims.md tolerance, {dt}", (0.01, tol), xycoords=("axes fraction", "data"),
                        xytext=(0, 2), textcoords="offset points", fontsize=6)
    a3.set_xlabel("iteration")
    a3.set_ylabel("|loss(BPPSA) − loss(autograd)| / loss(autograd)")
    a3.set_title("loss difference, same initial weights and batches (0 drawn at 1e-17)", fontsize=8)
    a3.grid(True, which="major", alpha=0.3)
    handles = [Line2D([], [], color="k", ls="-", label="training loss"),
               Line2D([], [], color="k", ls=":", marker="o", ms=3, label="test loss")]
    handles += [Line2D([], [], color="k", label=dt, **DTYPE_STYLE.get(dt, {})) for dt in sorted(set(curves["dtype"]))]
    if a3.has_data():
        a3.legend(handles=handles, fontsize=6, loc="lower right")
    if len(colors) > 1:
        a2.legend(handles=[Line2D([], [], color=c, label=dev) for dev, c in colors.items()], fontsize=7)
    first = curves.iloc[0]
    others = sorted(set(curves["dtype"]) - {main})
    twin = f" · right: also trained in {', '.join(others)} (thin)" if others else ""
    L_m = ",".join(sorted(set(curves["L_m"].astype(str)))) if "L_m" in curves else "?"
    finish(fig, f"Fig 6: LeNet-5 trained by autograd and by BPPSA, B={int(first['batch'])}, SGD lr={first['lr']:g} "
           f"momentum={first['momentum']:g}, {int(curves['iteration'].max())} iterations, L_m={L_m}, {main}{twin}",
           footer_text(curves, f"test loss on {int(first['test_size'])} test images of {first['data']}"))
    save(fig, out)


def draw(results: str | Path, inputs: list, outputs: list) -> None:
    """Fig 6 to ``outputs`` (bppsa.plots.registry), from every device folder under ``results``."""
    (out,) = outputs
    fig_6(load_all(results, "lenet5", "curve_*.csv"), out)
