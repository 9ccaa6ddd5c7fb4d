"""The last column of Table 1 (and the sparsity column beside it) from the measured CSVs."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import io, paper
from ..analysis.results import load_all
from ..paper import TABLE1_SPARSITY as PAPER_SPARSITY  # the paper's printed values, not measured here
from ..paper import TABLE1_SPEEDUP as PAPER_SPEEDUP

ORDER = ("Convolution", "ReLU", "Max-pooling")
EXPRESSION = {"Convolution": "1 - hf*wf/(hi*wi)", "ReLU": "1 - 1/(c*h*w)", "Max-pooling": "1 - hf*wf/(ci*hi*wi)"}


def table1_text(df) -> str:
    lines = [
        "# Table 1: sparsity of guaranteed zeros and speedup of the analytic CSR generation of the transposed",
        "# Jacobian over PyTorch autograd generating it one column (one vector-Jacobian product) at a time.",
        "# Operators: VGG-11's first conv (3->64, 3x3, padding 1), ReLU and 2x2 max-pool on a 32x32 input.",
        "# measured sparsity = 1 - nnz/(rows*cols) of the analytic CSR (input-dependent zeros stored, guaranteed",
        f"# zeros not); 'paper' columns are the values printed in the paper ({paper.PAPER_CPU}, "
        f"{paper.TABLE1_TRIALS} trials).",
    ]
    for label, d in df.groupby("device_label", sort=False):
        first = d.iloc[0]
        lines.append("")
        onednn = "on" if bool(first["mkldnn"]) else "off"
        lines.append(f"## device: {label} (processor {first['processor']}, {int(first['threads'])} threads, "
                     f"oneDNN for autograd: {onednn}); profile: {first['profile']}; data: {first['data']}")
        header = (f"{'operator':<12} {'expression':<22} {'expr. value':>11} {'measured':>9} {'paper':>8}   "
                  f"{'analytic (ms)':>14} {'autograd (s)':>13} {'speedup':>9} {'paper':>8}  "
                  "repeats (analytic/autograd)   [times: median ± half the IQR; speedup: ratio of medians]")
        lines.append(header)
        for op in ORDER:
            r = d[d["operator"] == op]
            if r.empty:
                continue
            an = r[r["method"] == "analytic"]["seconds"].to_numpy()
            ag = r[r["method"] == "autograd-columns"]["seconds"].to_numpy()
            speed = np.median(ag) / np.median(an) if len(an) and len(ag) else float("nan")
            lines.append(
                f"{op:<12} {EXPRESSION[op]:<22} {r['sparsity_expression'].iloc[0]:>11.5f} "
                f"{r['sparsity'].iloc[0]:>9.5f} "
                f"{PAPER_SPARSITY[op]:>8.5f}   {1e3 * np.median(an):>8.3f}±{1e3 * _iqr(an) / 2:<5.3f} "
                f"{np.median(ag) if len(ag) else float('nan'):>7.2f}±{_iqr(ag) / 2:<5.2f} {speed:>8.3g}x "
                f"{PAPER_SPEEDUP[op]:>7.2g}x  {len(an)}/{len(ag)}"
            )
    return "\n".join(lines) + "\n"


def _iqr(x) -> float:
    return float(np.subtract(*np.percentile(x, [75, 25]))) if len(x) else float("nan")


def draw(results: str | Path, inputs: list, outputs: list) -> None:
    """Table 1's text to ``outputs`` (bppsa.plots.registry), from every device folder under ``results``."""
    (out,) = outputs
    df = load_all(results, "jacobians", "table1*.csv")
    io.write_text(out, table1_text(df))
