"""Latent Bounded Interfaces (docs/lbi.md): quality against the dense baseline, bytes per backward, backward time."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..analysis.lbi import PAPER_GAP, gaps, load_train  # noqa: E402
from .common import finish, legend_below, plain_log_axis, save  # noqa: E402

COLORS = {"dense": "#555555"}
_CYCLE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def _read(inputs: list) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    train = [f for f in inputs if Path(f).name.startswith("train_")]
    traffic = [f for f in inputs if Path(f).name == "traffic.csv"]
    times = [f for f in inputs if Path(f).name == "backward_time.csv"]
    if not train or not traffic or not times:
        raise ValueError("bppsa plot lbi needs lbi/train_*.csv, lbi/traffic.csv and lbi/backward_time.csv; "
                         f"got {inputs}")
    return (load_train(train), pd.read_csv(traffic[0]),
            pd.read_csv(times[0]))


def draw(results: str | Path, inputs: list, outputs: list) -> None:
    (out,) = outputs
    train, traffic, times = _read(inputs)
    fig, axes = plt.subplots(2, 2, figsize=(10.5, 8.2))
    (a, b), (c, d) = axes

    # (a) validation cross-entropy during training, seed-averaged
    curve = train[train["row"] == "curve"]
    labels = ["dense"] + [f"lbi r={r}" for r in sorted(curve.loc[curve["kind"] == "lbi", "r"].dropna().astype(int)
                                                        .unique())]
    color = {lab: COLORS.get(lab, _CYCLE[i % len(_CYCLE)]) for i, lab in enumerate(labels)}
    for lab in labels:
        g = curve[curve["label"] == lab].groupby("step")["val_ce"].mean()
        a.plot(g.index, g.values, color=color[lab], marker="o", ms=3, ls="--" if lab == "dense" else "-",
               label=lab if lab == "dense" else lab.replace("lbi ", "LBI "))
    a.set_xlabel("training step")
    a.set_ylabel("validation cross-entropy (nats/byte)")
    a.set_title("(a) training on CPython's pydoc topics", fontsize=9)
    a.legend(fontsize=7)

    # (b) the gap to dense at the end, against r
    gp = gaps(train)
    for name, style in (("window", dict(marker="o", ls="-", color="#1f77b4")),
                        ("prefix", dict(marker="s", ls=":", color="#d62728"))):
        s = gp[gp["eval"] == name].sort_values("r")
        if len(s):
            b.errorbar(s["r"], s["gap"], yerr=s["std"], capsize=3, **style,
                       label="whole window (as trained)" if name == "window" else "each position: its past only")
    b.axhspan(*PAPER_GAP, color="#999999", alpha=0.25, label="paper, r = 16: 0.16–0.35")
    b.axhline(0, color="black", lw=0.6)
    b.set_xscale("log", base=2)
    rs = sorted(gp["r"].unique()) if len(gp) else [16]
    b.set_xticks(rs, [str(r) for r in rs])
    b.set_xlabel("interface rank r")
    b.set_ylabel("LBI − dense, validation CE (nats/byte)")
    b.set_title("(b) the gap to the dense baseline (same blocks, steps, seed)", fontsize=9)
    b.legend(fontsize=7)

    # (c) bytes each rank sends per backward (the most any rank sends)
    m = traffic[(traffic["source"] == "measured") & (traffic["phase"] == "backward")]
    per = m.groupby(["mode", "what", "ranks"])["bytes"].max().reset_index()
    for (mode, what), style in {("scan", "interface"): dict(color="#1f77b4", marker="o", ls="-"),
                                ("scan-allreduce", "interface"): dict(color="#d62728", marker="D", ls="-."),
                                ("pipeline", "interface"): dict(color="#555555", marker="s", ls="--"),
                                ("scan", "embedding"): dict(color="#2ca02c", marker="^", ls=":")}.items():
        s = per[(per["mode"] == mode) & (per["what"] == what)].sort_values("ranks")
        name = {"scan": "scan (rank_scan)", "scan-allreduce": "scan (the paper's all_reduce)",
                "pipeline": "pipeline"}[mode] if what == "interface" else "embedding grad all_reduce (every mode)"
        if len(s):
            c.plot(s["ranks"], s["bytes"] / 1024, **style, label=name)
    paper = traffic[(traffic["source"] == "paper-config") & (traffic["mode"] == "scan-allreduce")]
    if len(paper):
        pk = paper["bytes"].max() / 1024
        c.axhline(pk, color="#9467bd", lw=1, ls=(0, (1, 1)),
                  label=f"paper's scheme and config (K=8, r=64, B=1, bf16): {pk:.1f} KiB")
    c.set_yscale("log")
    plain_log_axis(c, "y", unit="")
    c.set_xlabel("ranks (= regions)")
    c.set_ylabel("KiB sent per backward (max over ranks)")
    r0, b0 = int(m["r"].iloc[0]), int(m["batch"].iloc[0])
    c.set_title(f"(c) payload per backward, r = {r0}, B = {b0}, {int(m['itemsize'].iloc[0])}-byte numbers",
                fontsize=9)
    c.set_xticks(sorted(per["ranks"].unique()))
    legend_below(c, below_pt=32)

    # (d) backward time: the slowest rank per round, median over rounds
    t = times.groupby(["mode", "ranks", "iteration"])["backward_s"].max().reset_index()
    for mode, style in (("scan", dict(color="#1f77b4", marker="o", ls="-")),
                        ("scan-allreduce", dict(color="#d62728", marker="D", ls="-.")),
                        ("pipeline", dict(color="#555555", marker="s", ls="--"))):
        s = t[t["mode"] == mode].groupby("ranks")["backward_s"]
        if not len(s):
            continue
        med, lo, hi = s.median(), s.quantile(0.25), s.quantile(0.75)
        d.errorbar(med.index, med.values * 1e3, yerr=np.vstack([(med - lo).values, (hi - med).values]) * 1e3,
                   capsize=3, **style, label=f"{mode} backward")
    d.set_xlabel("ranks (= regions)")
    d.set_ylabel("backward, slowest rank (ms)")
    d.set_title("(d) backward time on gloo ranks (median, quartiles)", fontsize=9)
    d.set_xticks(sorted(t["ranks"].unique()))
    d.legend(fontsize=7)

    fin = train[train["row"] == "final"].iloc[0]
    device = Path(inputs[0]).parent.parent.name  # results/<device>/lbi/...
    footer = (f"{device}: profile {', '.join(sorted(set(map(str, train['profile']))))} · corpus {fin['corpus_corpus']} "
              f"(Python {fin['corpus_python']}, {int(fin['corpus_bytes'])} bytes, "
              f"sha256 {str(fin['corpus_sha256'])[:12]}) "
              f"· {int(fin['regions'])} regions × 2 blocks, d = {int(fin['d'])}, T = {int(fin['seq'])}, "
              f"B = {int(fin['batch'])}, {int(fin['steps'])} steps, seeds {sorted(set(train['seed']))} · "
              f"times: {int(times['iteration'].max()) + 1} rounds, {int(times['threads'].iloc[0])} thread(s) per rank")
    finish(fig, "Latent Bounded Interfaces: quality against dense, and what crosses ranks per backward", footer)
    save(fig, out)
