"""results/report.md: the measured numbers of every experiment on one page, read from the CSVs.

Each section that reads a device folder declares what it reads there (``@reads``); :data:`READS` is what `bppsa
report` reads in each device folder for report.md and claims.md together (:data:`bppsa.analysis.claims.READS`)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from . import claims
from .results import device_dirs, load_all, reads


def _md(df: pd.DataFrame, floatfmt: str = "{:.3g}") -> str:
    """A GitHub-markdown table (no extra dependency)."""
    cols = list(df.columns)
    fmt = lambda v: floatfmt.format(v) if isinstance(v, float) else str(v)  # noqa: E731
    rows = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    rows += ["| " + " | ".join(fmt(v) for v in rec) + " |" for rec in df.itertuples(index=False)]
    return "\n".join(rows)


def _section(title: str, body: str) -> str:
    return f"## {title}\n\n{body.strip()}\n"


@reads("environment.json")
def _environments(results: Path) -> str:
    rows = []
    for label, folder in device_dirs(results):
        env = folder / "environment.json"
        info = json.loads(env.read_text()) if env.exists() else {}
        rows.append({"device": label, "torch": info.get("torch", "?"), "cuda": info.get("cuda", "-"),
                     "driver": info.get("driver", "-"), "cupy": info.get("cupy", "-"),
                     "cpu cores": info.get("cpu_count", "?")})
    return _md(pd.DataFrame(rows)) if rows else "No device has measured anything yet."


@reads("*/verify_*.json")
def _exactness(results: Path) -> str:
    rows = []
    for label, folder in device_dirs(results):
        for js in sorted(folder.glob("*/verify_*.json")):
            v = json.loads(js.read_text())
            rows.append({"device": label, "model": v["model"], "dtype": v["dtype"], "backend": v["backend"],
                         "layout": v["layout"], "max_rel_err": v["max_rel_err"], "tolerance": v["tolerance"]})
    if not rows:
        return "No verify results."
    df = pd.DataFrame(rows)
    agg = df.groupby(["device", "model", "dtype", "backend", "layout"]).agg(
        checks=("max_rel_err", "size"), worst_rel_err=("max_rel_err", "max"),
        tolerance=("tolerance", "first")).reset_index()
    return ("Every BPPSA configuration that was timed was first checked against autograd on the same weights "
            "and batch (`bppsa verify`); the worst relative gradient error per group:\n\n" + _md(agg))


@reads("rnn/speedups.csv", "gru/speedups.csv")
def _speedups(results: Path, model: str) -> str:
    """Every speedup with its interval, and the list of what is noisy or not resolved."""
    try:
        sp = load_all(results, model, "speedups.csv")
    except FileNotFoundError:
        return f"No {model.upper()} benchmarks."
    sp["cell"] = [("not resolved" if not r else f"{m:.3g} [{lo:.3g}, {hi:.3g}]" + (" noisy" if n else ""))
                  for m, lo, hi, n, r in zip(sp["speedup"], sp["ci_low"], sp["ci_high"], sp["noisy"], sp["resolved"])]
    for col in ("backend", "reference_backend"):  # a speedups.csv from before these columns: "?"
        sp[col] = sp[col].fillna("?").astype(str) if col in sp else "?"
    table = sp.pivot_table(index=["device_label", "variant", "backend", "reference", "reference_backend", "seq_len",
                                  "batch", "n"], columns="phase", values="cell", aggfunc="first").reset_index()
    table = table.rename(columns={"device_label": "device", "backend": "BPPSA backend",
                                  "reference_backend": "baseline backend", "seq_len": "T", "batch": "B",
                                  "n": "rounds"})
    best = sp[(sp["phase"] == "backward") & (sp["reference"] == "baseline") & sp["resolved"]]
    head = []
    for dev, g in best.groupby("device_label"):
        r = g.loc[g["speedup"].idxmax()]
        it = sp[(sp["device_label"] == dev) & (sp["phase"] == "iteration") & (sp["reference"] == "baseline")]
        ri = it.loc[it["speedup"].idxmax()]
        head.append(f"- {dev}: largest backward speedup {r.speedup:.3g}× [{r.ci_low:.3g}, {r.ci_high:.3g}] "
                    f"({r.variant}, T={r.seq_len}, B={r.batch}; {_who(r)}); largest whole-iteration speedup "
                    f"{ri.speedup:.3g}× [{ri.ci_low:.3g}, {ri.ci_high:.3g}] ({ri.variant}, T={ri.seq_len}, "
                    f"B={ri.batch}; {_who(ri)})")
    flagged = sp[sp["noisy"] | ~sp["resolved"]]
    if len(flagged):
        items = [f"{r.device_label} {r.variant} ({r.backend}) T={r.seq_len} B={r.batch} {r.phase}: "
                 + ("not resolved (the nobp difference is within the noise)" if not r.resolved else
                    f"{r.speedup:.3g} [{r.ci_low:.3g}, {r.ci_high:.3g}]") for r in flagged.itertuples()]
        noisy = f"**Noisy or not resolved ({len(flagged)} of {len(sp)}):** " + "; ".join(items) + "."
    else:
        noisy = f"No speedup is flagged noisy or unresolved ({len(sp)} measured)."
    return ("\n".join(head) + "\n\nSpeedups are medians of the paired per-round ratios baseline/BPPSA with their 95 % "
            "confidence intervals, each measured by the BPPSA backend and against the baseline backend its row names "
            "(`autograd`: eager PyTorch on a CPU; `cudnn`: cuDNN's RNN on a GPU); the headline uses the reference "
            "`baseline` (cuDNN's default algorithm on a GPU; "
            "`baseline-packed` rows, where present, compare with the per-step algorithm the paper had). "
            "`backward` includes BPPSA's Jacobian generation; `backward-excl-FO` leaves it out (as the paper's GRU "
            "numbers do; the CPU fast path reads the RNN's factors from the states and recomputes the GRU's gates "
            "inside its backward, so there they stay in it); "
            "`backward-nobp` is the paper's subtraction. Paper: see `claims.md`.\n\n"
            + noisy + "\n\n" + _md(table))


def _who(r) -> str:
    return f"BPPSA backend {r.backend} vs baseline {r.reference_backend}"


@reads("rnn/curve_*.csv", "gru/curve_*.csv")
def _curves(results: Path) -> str:
    """Per training curve (Fig 7, Fig 13): the largest per-epoch loss difference from the baseline's, per dtype."""
    rows = []
    for label, folder in device_dirs(results):
        for model in ("rnn", "gru"):
            files = sorted((folder / model).glob("curve_*.csv")) if (folder / model).is_dir() else []
            frames = [f for f in (pd.read_csv(p) for p in files) if len(f)]
            if not frames:
                continue
            c = pd.concat(frames, ignore_index=True)
            for (T, dt, var), d in claims.curve_differences(c).groupby(["seq_len", "dtype", "variant"]):
                d = d.sort_values("epoch")
                last = d.iloc[-1]
                rows.append({"device": label, "model": model, "T": T, "dtype": dt, "variant": var,
                             "BPPSA backend": last["backend"], "baseline backend": last["reference_backend"],
                             "epochs": len(d), "largest loss difference": float(d["rel"].max()),
                             "at epoch 1": float(d["rel"].iloc[0]),
                             "wall-clock baseline/BPPSA": last["baseline_wall_clock_s"] / last["wall_clock_s"]})
    if not rows:
        return "No training curves."
    return ("Relative per-epoch loss difference |BPPSA − baseline| / baseline, same initial weights and batch order "
            "(the verdicts: `claims.md`):\n\n" + _md(pd.DataFrame(rows), "{:.3g}"))


@reads("rnn/speed.csv")
def _speed(results: Path) -> str:
    from ..bench.speed import summary

    parts = []
    for label, folder in device_dirs(results):
        path = folder / "rnn" / "speed.csv"
        if path.exists():
            r = summary(pd.read_csv(path))
            r.insert(0, "device", label)
            parts.append(r)
    return _md(pd.concat(parts)) if parts else "No CPU speed benchmark."


def _csv_section(path: Path, empty: str, columns: list[str] | None = None) -> str:
    if not path.exists():
        return empty
    df = pd.read_csv(path)
    return _md(df[[c for c in columns if c in df.columns]] if columns else df)


def build(results: str | Path = "results") -> str:
    results = Path(results)
    out = ["# BPPSA reproduction: measured results\n",
           "Generated by `bppsa report` from the CSVs under `results/` (every device folder, including "
           "`results/reference/`). Figures: `fig_6.png`, `fig_7.png`, `fig_8_{a..f}.png`, `fig_9.png`, `fig_10.png`, "
           "`fig_13.png`. "
           "The paper's claims against these numbers: `claims.md`.\n",
           _section("Devices", _environments(results)),
           _section("Exactness", _exactness(results)),
           _section("RNN (Fig 8)", _speedups(results, "rnn")),
           _section("RNN backward on the CPU (speed benchmark)", _speed(results))]
    out.append(_section("GRU (Fig 9)", _speedups(results, "gru")))
    out.append(_section("Training curves (Fig 7, Fig 13)", _curves(results)))
    table1 = results / "table_1_last_column.txt"
    out.append(_section("Table 1", "```\n" + table1.read_text().strip() + "\n```" if table1.exists() else "Not run."))
    out.append(_section("Pruned VGG-11 (Fig 10)", _vgg(results)))
    out.append(_section("Pruned VGG-11 retrained through the scan (beside Fig 10)", _vgg_scan(results)))
    out.append(_section("CNN training steps, autograd vs BPPSA (bench-cnn)", _cnn_bench(results)))
    return "\n".join(out)


@reads("vgg11/accuracy.csv", "vgg11/flops_summary.csv")
def _vgg(results: Path) -> str:
    vgg = []
    for label, folder in device_dirs(results):
        acc = folder / "vgg11" / "accuracy.csv"
        if acc.exists():
            vgg.append(f"**{label}**, accuracy:\n\n" + _csv_section(acc, "", ["network", "stage", "epochs", "top1",
                                                                             "pruned_fraction", "paper_top1", "data"]))
        fl = folder / "vgg11" / "flops_summary.csv"
        if fl.exists():
            cols = ["bppsa_critical_flop", "bppsa_max_step_flop", "baseline_total_flop", "baseline_max_step_flop"]
            df = pd.read_csv(fl).groupby("network")[cols].mean().reset_index()
            vgg.append(f"**{label}**, FLOP per sample (mean over samples):\n\n" + _md(df))
    return "\n\n".join(vgg) if vgg else "Not run."


@reads("vgg11/retrain_scan.csv", "vgg11/retrain_scan_steps.csv")
def _vgg_scan(results: Path) -> str:
    """Per device: BPPSA's retraining iteration against autograd's, where its backward goes, and each tree level's
    measured time beside its static FLOP (bppsa vgg11-retrain-scan; docs/cnn.md)."""
    from .cnn import per_iteration, retrain_scan_runs, timing_summary

    parts = []
    for label, rows, steps in retrain_scan_runs(results):
        s = timing_summary(rows)
        med = per_iteration(rows).groupby("method").median(numeric_only=True).drop(columns="iter")
        scan = steps[steps["what"] == "scan"]
        levels = scan.groupby(["iteration", "phase", "d"]).agg(seconds=("seconds", "sum"),
                                                                flop_batch=("flop_batch", "sum"),
                                                                products=("seconds", "size"))
        levels = levels.groupby(["phase", "d"]).median().reset_index()
        parts.append(f"**{label}** ({rows['network'].iloc[0]}, B={int(rows['batch'].iloc[0])}, "
                     f"L_m={rows['L_m'].iloc[0]}): BPPSA/autograd per iteration "
                     f"{claims.fmt_ci(*s['ratio_total'])}, backward {claims.fmt_ci(*s['ratio_backward_total'])} over "
                     f"{s['rounds']} paired iterations; median seconds per phase:\n\n" + _md(med.reset_index())
                     + "\n\nScan levels (median over the profiled iterations; FLOP: the static count for the batch):"
                     "\n\n" + _md(levels))
    return "\n\n".join(parts) if parts else "Not run (config vgg11_scan.iterations: 0)."


@reads("cnn/bench_*.csv")
def _cnn_bench(results: Path) -> str:
    """Per device and case: medians with intervals of the training iteration and the backward, the paired ratio
    BPPSA/autograd, and where BPPSA's backward goes."""
    from .cnn import timing_summary

    rows = []
    for label, folder in device_dirs(results):
        for path in sorted((folder / "cnn").glob("bench_*.csv")) if (folder / "cnn").is_dir() else []:
            df = pd.read_csv(path)
            if df.empty:
                continue
            s, first = timing_summary(df), df.iloc[0]
            rows.append({"device": label, "model": first["model"], "B": int(first["batch"]), "L_m": first["L_m"],
                         "rounds": s["rounds"], "autograd backward (ms)": 1e3 * s["autograd_backward_total"][0],
                         "BPPSA backward (ms)": 1e3 * s["bppsa_backward_total"][0],
                         "BPPSA/autograd backward": claims.fmt_ci(*s["ratio_backward_total"]),
                         "generation": f"{s['share_jacobian']:.0%}", "scan": f"{s['share_scan']:.0%}",
                         "param grads": f"{s['share_param_grads']:.0%}"})
    return _md(pd.DataFrame(rows)) if rows else "Not run (config cnn_bench: no batches)."


SECTIONS = (_environments, _exactness, _speedups, _speed, _curves, _vgg, _vgg_scan, _cnn_bench)  # read device folders
READS = tuple(dict.fromkeys([*(pattern for section in SECTIONS for pattern in section.reads), *claims.READS]))
