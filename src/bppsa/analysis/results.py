"""The results tree: measurements live in results/<device>/<experiment>/, committed reference
measurements of other machines in results/reference/<device>/<experiment>/.  Figures overlay all."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

REFERENCE = "reference"
COMPILED = "-compiled"  # a BPPSA variant run with the backend's own (compiled) forward, not torch's


def reads(*patterns: str):
    """Declares the files a function reads in each device folder (relative to it; ``*`` globs within one name), as
    its attribute ``reads``.  `bppsa report`'s rule declares them in every other device folder (``REPORT_READS``,
    workflow/rules/common.smk), so a folder added re-renders the report; tests/test_workflow.py holds each
    declaration to the files the function opens."""

    def declare(fn):
        fn.reads = patterns
        return fn

    return declare


def device_dirs(results: str | Path = "results") -> list[tuple[str, Path]]:
    """(label, folder) of every device that has measured anything, local ones first.

    Reference devices are labelled ``<device> (reference)``; a local folder is skipped when it is
    the reference folder itself or holds no sub-folders.
    """
    results = Path(results)
    out: list[tuple[str, Path]] = []
    if not results.is_dir():
        return out
    for d in sorted(p for p in results.iterdir() if p.is_dir() and p.name != REFERENCE and not p.name.startswith(".")):
        out.append((d.name, d))
    ref = results / REFERENCE
    if ref.is_dir():
        for d in sorted(p for p in ref.iterdir() if p.is_dir()):
            out.append((f"{d.name} (reference)", d))
    return out


def load_all(results: str | Path, experiment: str, pattern: str) -> pd.DataFrame:
    """Concatenate every CSV matching ``<device>/<experiment>/<pattern>`` with a ``device_label`` column."""
    frames = []
    for label, folder in device_dirs(results):
        for csv in sorted((folder / experiment).glob(pattern)):
            df = pd.read_csv(csv)
            if df.empty:
                continue
            df["device_label"] = label
            frames.append(df)
    if not frames:
        raise FileNotFoundError(f"no {pattern} under {Path(results)}/*/{experiment}/")
    return pd.concat(frames, ignore_index=True)


def variants(df: pd.DataFrame) -> pd.Series:
    """What each row of a training curve or bench table stands for: ``baseline``, ``bppsa-<layout>`` (torch's
    forward, the baseline's: the paper's comparison) or ``bppsa-<layout>-compiled`` (``forward`` = "auto": the
    backend's own forward, a variant of its own; a CSV without the column ran torch's)."""
    layout = df["layout"].fillna("").astype(str) if "layout" in df else ""
    out = df["method"].where(df["method"] == "baseline", "bppsa-" + layout)
    if "forward" in df:
        out = out.where((df["method"] == "baseline") | (df["forward"].fillna("torch") != "auto"), out + COMPILED)
    return out
