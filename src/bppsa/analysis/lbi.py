"""Latent Bounded Interfaces' measurements, summarised (no torch): the quality gap to the dense baseline and the
bytes per backward (read by claims.md's LBI rows and by ``bppsa plot lbi``)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

__all__ = ["PAPER_BYTES", "PAPER_GAP", "gaps", "load_train", "traffic_check"]

PAPER_GAP = (0.16, 0.35)  # the paper's validation cross-entropy gap to dense at r = 16 (LBI.md)
PAPER_BYTES = 56 * 1024  # "about 56 KB" per backward; 7 x 64 x 64 x 2 bytes = 56 KiB fits it (LBI.md)


def load_train(files) -> pd.DataFrame:
    """The rows of every ``lbi/train_*.csv`` (``bppsa lbi-train``) given."""
    return pd.concat([pd.read_csv(f) for f in sorted(map(str, files))], ignore_index=True)


def gaps(train: pd.DataFrame) -> pd.DataFrame:
    """Per interface rank r and evaluation (``window``: the whole window, as trained and as the paper evaluates;
    ``prefix``: each position scored from its past alone): the final validation cross-entropy of LBI minus the dense
    baseline's of the same seed, mean and standard deviation over the seeds both have."""
    fin = train[train["row"] == "final"]
    dense = fin[fin["kind"] == "dense"].set_index("seed")
    rows = []
    for r, g in fin[fin["kind"] == "lbi"].groupby("r"):
        g = g.set_index("seed")
        seeds = sorted(set(g.index) & set(dense.index))
        if not seeds:
            continue
        for col, name in (("val_ce", "window"), ("val_prefix_ce", "prefix")):
            d = g.loc[seeds, col] - dense.loc[seeds, col]
            rows.append({"r": int(r), "eval": name, "gap": float(d.mean()),
                         "std": float(d.std(ddof=1)) if len(d) > 1 else 0.0, "seeds": len(seeds),
                         "lbi": float(g.loc[seeds, col].mean()), "dense": float(dense.loc[seeds, col].mean())})
    return pd.DataFrame(rows, columns=["r", "eval", "gap", "std", "seeds", "lbi", "dense"])


def traffic_check(traffic: pd.DataFrame) -> dict:
    """What ``lbi/traffic.csv`` says: whether every interface count measured on real ranks equals the formula, the
    largest per-rank backward interface payload measured by mode (``busiest``) and the embedding's all_reduce, and
    the formula's value for the paper's scheme (scan-allreduce) at the paper's configuration (bytes, busiest rank)."""
    m = traffic[traffic["source"] == "measured"]
    iface = m[m["what"] == "interface"]
    bwd = m[m["phase"] == "backward"]
    paper = traffic[(traffic["source"] == "paper-config") & (traffic["mode"] == "scan-allreduce")]
    busiest = bwd[bwd["what"] == "interface"].groupby("mode")["bytes"].max()
    return {
        "counts_match": bool(len(iface)) and bool((iface["bytes"] == iface["formula_bytes"]).all()),
        "mismatches": int((iface["bytes"] != iface["formula_bytes"]).sum()),
        "ranks": sorted(int(p) for p in m["ranks"].unique()),
        "r": int(m["r"].iloc[0]) if len(m) else None, "batch": int(m["batch"].iloc[0]) if len(m) else None,
        "itemsize": int(m["itemsize"].iloc[0]) if len(m) else None,
        "busiest": {str(k): int(v) for k, v in busiest.items()},
        "embedding": int(bwd[bwd["what"] == "embedding"]["bytes"].max()),
        "paper_bytes": int(paper["bytes"].max()) if len(paper) else None,
        "paper_jacobians": (int(paper["regions"].iloc[0]) - 1) * int(paper["batch"].iloc[0])
        * int(paper["r"].iloc[0]) ** 2 * int(paper["itemsize"].iloc[0]) if len(paper) else None,
        "paper_config": ({k: int(paper[k].iloc[0]) for k in ("regions", "batch", "r", "itemsize")}
                         if len(paper) else None),
    }


def train_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("lbi/train_*.csv"))
