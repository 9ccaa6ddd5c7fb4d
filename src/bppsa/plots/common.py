"""Shared figure conventions: one panel per device and baseline, one colour per variant, a title of at most two
lines with the profile and device in a footer, the backend that measured each line in its legend entry, and log
axes labelled in plain numbers."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..analysis.results import COMPILED, variants  # noqa: E402
from ..io import atomic_path  # noqa: E402

VARIANT_STYLE = {"baseline": dict(ls="--", marker="s"), "baseline-packed": dict(ls=":", marker="D"),
                 "bppsa-fused": dict(ls="-", marker="o"), "bppsa-paper": dict(ls="-.", marker="^"),
                 "bppsa-fused-compiled": dict(ls=(0, (1, 1)), marker="v"),
                 "bppsa-paper-compiled": dict(ls=(0, (3, 1, 1, 1, 1, 1)), marker="<")}
VARIANT_NAME = {"baseline": "baseline", "baseline-packed": "baseline, packed (per-step, the paper's)",
                "bppsa-fused": "BPPSA (fused Jacobians)", "bppsa-paper": "BPPSA (paper's two Jacobians per step)",
                "bppsa-fused-compiled": "BPPSA (fused), compiled forward",
                "bppsa-paper-compiled": "BPPSA (paper's layout), compiled forward"}
PROTOCOL_NOTE = "median, 95 % CI error bars; hollow = noisy"


def backends_of(df, where=None, column: str = "backend") -> str:
    """The backend(s) a table's rows were measured with, as written in its ``backend`` column ("" if none:
    a CSV from before the column existed)."""
    if column not in df:
        return ""
    d = df if where is None else df[where]
    names = sorted({str(v) for v in d[column].dropna() if str(v)})
    return "/".join(names)


def variant_label(var: str, backend: str = "") -> str:
    """A legend entry for a variant, naming the backend that measured it: 'baseline (autograd)',
    'BPPSA (fused Jacobians), backend torch'."""
    name = VARIANT_NAME.get(var, var)
    if not backend:
        return name
    return f"{name} ({backend})" if var.startswith("baseline") else f"{name}, backend {backend}"


def variant_backends(df, key: str = "variant") -> dict[str, str]:
    """variant -> its backend(s), from a table with ``variant`` and ``backend`` columns."""
    if "backend" not in df or key not in df:
        return {}
    return {v: backends_of(g) for v, g in df.groupby(key)}


# -- log axes in plain numbers -------------------------------------------------------------------------
# mantissas per decade, sparsest first; the first that gives at least MIN_TICKS ticks in range is used
_MANTISSAS = ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9))
MIN_TICKS = 3
MAX_TICKS = 9


def nice_log_ticks(lo: float, hi: float) -> list[float]:
    """Ticks of a log axis from ``lo`` to ``hi``: 1-2-5 numbers (0.5, 1, 2, 5, 10, 20, ...), denser on a short
    range, sparser (1, 10, 100 ...) on a long one; only values inside [lo, hi]."""
    if not (lo > 0 and hi > lo and math.isfinite(lo) and math.isfinite(hi)):
        return []
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)

    def inside(mantissas):
        return [float(f"{m * 10.0 ** e:.12g}") for e in decades for m in mantissas if lo <= m * 10.0 ** e <= hi]

    ticks = []
    for mantissas in _MANTISSAS:
        ticks = inside(mantissas)
        if len(ticks) >= MIN_TICKS:
            break
    step = 1
    while len(ticks) > MAX_TICKS:  # a range over many decades: 1, 10, 100 ..., then every other decade ...
        ticks = [t for t in inside((1,)) if round(math.log10(t)) % step == 0]
        step += 1
    return ticks


def plain_number(value: float, unit: str = "") -> str:
    """0.5 -> '0.5×', 10 -> '10×', 1500 -> '1500×': never '5 × 10⁻¹'."""
    text = f"{value:.6g}"
    if "e" in text:
        text = f"{value:.12f}".rstrip("0").rstrip(".")
    return text + unit


def plain_log_axis(ax, axis: str = "y", unit: str = "×") -> list[float]:
    """Label a log axis in plain numbers at ticks inside its current (data) range; call after plotting.

    Major ticks at ``nice_log_ticks``; the minor ticks stay (for the grid) but carry no labels, so matplotlib's
    '6 × 10⁻¹' minor labels never appear.  Returns the ticks.
    """
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    which = ax.yaxis if axis == "y" else ax.xaxis
    lo, hi = sorted(ax.get_ylim() if axis == "y" else ax.get_xlim())
    ticks = nice_log_ticks(lo, hi)
    if len(ticks) < 2 and lo > 0:  # a range too short for two ticks (0.95 to 1.05): widen it to the next ones
        fine = nice_log_ticks(lo / 10, hi * 10)
        lo, hi = max([t for t in fine if t <= lo], default=lo), min([t for t in fine if t >= hi], default=hi)
        ticks = nice_log_ticks(lo, hi)
    which.set_major_locator(FixedLocator(ticks))
    which.set_major_formatter(FuncFormatter(lambda v, _pos: plain_number(v, unit)))
    which.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    which.set_minor_formatter(NullFormatter())
    (ax.set_ylim if axis == "y" else ax.set_xlim)(lo, hi)  # the fixed ticks must not widen the range
    return ticks


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
    """'baseline', 'bppsa-<layout>' or 'bppsa-<layout>-compiled' per row: what a line or bar of a figure stands for
    (:func:`bppsa.analysis.results.variants`)."""
    return variants(df)


def curve_label(var: str, g) -> str:
    """A training curve's legend entry: the variant and its backend, and where a ``-compiled`` variant found no
    compiled forward on its machine (``forward_kernel``), that it ran torch's kernels."""
    label = variant_label(var, backends_of(g))
    if var.endswith(COMPILED) and "forward_kernel" in g and (g["forward_kernel"].astype(str) == "torch").any():
        label += " (no compiled forward there: torch's)"
    return label


def device_colors(labels) -> dict[str, str]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ordered = sorted(set(labels), key=lambda s: ("reference" in s, s))  # committed reference folders last
    return {lab: cycle[i % len(cycle)] for i, lab in enumerate(ordered)}


def save(fig, path: str | Path) -> None:
    fig.tight_layout(rect=getattr(fig, "_bppsa_rect", (0, 0, 1, 1)))  # finish() leaves room for title and footer
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=130)
    plt.close(fig)


# -- one panel per device and baseline; a short title, provenance in a footer ----------------------------------------
BASELINE_NAME = {"autograd": "autograd", "cudnn": "cuDNN", "cudnn-per-step": "cuDNN per-step",
                 "autograd-packed": "autograd, packed"}
SHORT_NAME = {"baseline": "baseline", "baseline-packed": "baseline, per-step", "bppsa-fused": "BPPSA fused",
              "bppsa-paper": "BPPSA paper's layout", "bppsa-fused-compiled": "BPPSA fused, compiled fwd",
              "bppsa-paper-compiled": "BPPSA paper's, compiled fwd"}
VARIANT_COLOR = {"baseline": "#555555", "baseline-packed": "#555555", "bppsa-fused": "#1f77b4",
                 "bppsa-paper": "#d62728", "bppsa-fused-compiled": "#2ca02c", "bppsa-paper-compiled": "#9467bd"}
MAX_COLUMNS = 3
MIN_WIDTH_IN = 8.0  # a two-line figure title fits; a single panel is drawn this wide


def device_order(labels) -> list[str]:
    """This machine's folders first, committed reference folders after them."""
    return sorted(set(labels), key=lambda s: ("reference" in s, s))


def short_label(var: str, backend: str = "") -> str:
    """'BPPSA fused (cupy-factored)': a legend entry short enough for a panel a third of a page wide."""
    name = SHORT_NAME.get(var, var)
    return f"{name} ({backend})" if backend else name


def baseline_name(backend: str, var: str = "baseline") -> str:
    """How a panel names its baseline: 'cuDNN per-step' for the backend cudnn-per-step, the backend itself
    where it has no nicer name, the variant where the CSV names no backend."""
    if not backend:
        return SHORT_NAME.get(var, var)
    return "/".join(BASELINE_NAME.get(b, b) for b in backend.split("/"))


def panels(df, reference_col: str) -> list[tuple[str, str]]:
    """(device, baseline variant) of every panel: one per device and baseline it was measured against,
    in device order, the default baseline before the per-step one."""
    keys = {(str(d), str(r)) for d, r in zip(df["device_label"], df[reference_col]) if str(r).startswith("baseline")}
    order = {d: i for i, d in enumerate(device_order(k[0] for k in keys))}
    return sorted(keys, key=lambda k: (order[k[0]], k[1] != "baseline", k[1]))


def panel_grid(n: int, rows_per_panel: int = 1, width: float = 4.4, height: float = 3.4):
    """A figure with ``n`` panels, at most MAX_COLUMNS a row; each panel ``rows_per_panel`` axes tall.
    Returns (fig, [[axes of panel 0 top to bottom], ...]); unused cells are removed."""
    cols = min(n, MAX_COLUMNS) or 1
    blocks = -(-n // cols) or 1
    size = (max(width * cols, MIN_WIDTH_IN), height * blocks * rows_per_panel)
    fig, axes = plt.subplots(blocks * rows_per_panel, cols, figsize=size, squeeze=False)
    out = []
    for i in range(blocks * cols):
        block, col = divmod(i, cols)
        cells = [axes[block * rows_per_panel + r, col] for r in range(rows_per_panel)]
        if i < n:
            out.append(cells)
        else:
            for ax in cells:
                ax.remove()
    return fig, out


def legend_below(ax, handles=None, below_pt: float = 30, **kw):
    """A panel's legend under its x-axis label, where it hides no line or bar (tight_layout makes room for it)."""
    from matplotlib.transforms import offset_copy

    anchor = offset_copy(ax.transAxes, fig=ax.figure, y=-below_pt, units="points")
    extra = {"handles": handles} if handles is not None else {}
    kw.setdefault("fontsize", 7)
    return ax.legend(**extra, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=anchor, **kw)


def n_text(df) -> str:
    """How many timed rounds stand behind the points: 'n = 8 rounds', 'n = 7–200 rounds'."""
    if not len(df):
        return "n = 0"
    lo, hi = int(df["n"].min()), int(df["n"].max())
    return f"n = {lo} rounds" if lo == hi else f"n = {lo}–{hi} rounds"


def footer_text(df, note: str = "") -> str:
    """Where the numbers come from, per device: its profile and, where stand-in data was used, which."""
    parts = []
    for dev in device_order(df["device_label"]):
        d = df[df["device_label"] == dev]
        profiles = ", ".join(sorted(set(map(str, d["profile"])))) if "profile" in d else "?"
        extra = ""
        if "data" in d:
            standin = sorted({s for s in map(str, d["data"]) if "stand-in" in s})
            extra = f", data: {', '.join(standin)}" if standin else ""
        parts.append(f"{dev}: profile {profiles}{extra}")
    return " · ".join(parts) + (f"\n{note}" if note else "")


def _wrap(text: str, width_in: float, fontsize: float) -> str:
    import textwrap

    chars = max(40, int(width_in * 72 / (0.52 * fontsize)))  # an average character is about half an em wide
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def finish(fig, title: str, footer: str, handles=None, title_size: float = 10, footer_size: float = 7) -> None:
    """Lay out a figure: the title on top (at most two lines), the footer below everything (profile, device,
    protocol), a figure legend for what every panel shares above the footer, the panels in between."""
    if title.count("\n") > 1:
        raise ValueError(f"a figure title has at most two lines: {title!r}")
    width = fig.get_figwidth()
    fig.suptitle(title, fontsize=title_size, y=0.995, va="top")
    foot = fig.text(0.01, 0.004, _wrap(footer, width - 0.2, footer_size), fontsize=footer_size, ha="left",
                    va="bottom", color="#333333")
    r = fig.canvas.get_renderer()
    fig_h = fig.bbox.height
    pad = 6 / fig_h
    bottom = foot.get_window_extent(r).height / fig_h + pad
    if handles:
        leg = fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, bottom), ncol=len(handles),
                         fontsize=8, frameon=False)
        if leg.get_window_extent(r).width > fig.bbox.width * 0.98:
            leg.remove()
            leg = fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, bottom),
                             ncol=-(-len(handles) // 2), fontsize=8, frameon=False)
        bottom += leg.get_window_extent(r).height / fig_h
    fig._bppsa_rect = (0, bottom, 1, 1)  # tight_layout leaves room for the suptitle itself
    fig.tight_layout(rect=fig._bppsa_rect)
