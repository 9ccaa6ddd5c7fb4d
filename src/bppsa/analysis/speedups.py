"""One tidy summary per model: latencies and speedups with confidence intervals, from the bench CSVs.

``latency.csv``: per (variant, T, B, mode, phase) the median seconds with its CI, the IQR, and the
mean and std (for comparison with the paper's tables, which report mean +- std), and the ``backend``
that ran the variant (autograd/cudnn for a baseline, the BPPSA backend otherwise).
``speedups.csv``: per (BPPSA variant, T, B, phase) the median of the paired per-round ratios
reference/variant with its CI, with the ``backend`` of the variant and the ``reference_backend`` of the
baseline it is compared with.  Phases:

- ``backward``: the paper's backward, BPPSA's including its Jacobian generation;
- ``backward-excl-FO``: backward pass and optimizer step without BPPSA's Jacobian generation (the
  "forward overhead", FO), as the paper's GRU numbers count it (Fig 9, Table 6);
- ``iteration``: the whole training iteration;
- ``backward-nobp``: the paper's own method, full iteration minus a forward-only run, kept as a
  cross-check.  A difference of two noisy times can be zero or negative; when either side's
  interval reaches zero the row says ``resolved = False`` and carries no speedup.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..stats import median_ci, ratio_ci

RAW_PHASES = ["forward", "jacobian", "backward", "optimizer"]
LATENCY_PHASES = ["forward", "jacobian", "backward_pass", "optimizer", "backward", "iteration"]
SPEEDUP_PHASES = ["backward", "backward-excl-FO", "iteration"]
CONFIG = ["model", "device", "profile", "data", "seq_len", "batch"]


def per_round(bench: pd.DataFrame) -> pd.DataFrame:
    """One row per (configuration, variant, mode, iter) with a column per latency phase."""
    keys = CONFIG + ["variant", "mode", "iter"]
    wide = bench.pivot_table(index=keys, columns="phase", values="seconds", aggfunc="sum")
    wide = wide.reindex(columns=RAW_PHASES).reset_index()
    present = wide[RAW_PHASES].notna()
    wide[RAW_PHASES] = wide[RAW_PHASES].fillna(0.0)
    wide["iteration"] = wide[RAW_PHASES].sum(axis=1)
    wide = wide.rename(columns={"backward": "backward_pass"})
    # the paper's backward; undefined for a forward-only run
    wide["backward"] = (wide["jacobian"] + wide["backward_pass"]).where(present["backward"])
    wide["backward-excl-FO"] = (wide["backward_pass"] + wide["optimizer"]).where(present["backward"])
    return wide


def _config_meta(bench: pd.DataFrame) -> pd.DataFrame:
    cols = [c for c in ("variant", "backend", "reference", "stopped_by", "rounds", "noisy_threshold", "conf",
                        "rel_ci", "noisy") if c in bench]
    meta = bench[bench["mode"] == "full"].groupby(CONFIG + ["variant"])[cols[1:]].first().reset_index()
    return meta


def latency(bench: pd.DataFrame) -> pd.DataFrame:
    bench = _normalise(bench)
    rounds = per_round(bench)
    noisy = bench.groupby(CONFIG + ["variant", "mode"])["noisy"].first()
    conf = bench.groupby(CONFIG)["conf"].first()
    backend = bench.groupby(CONFIG + ["variant"])["backend"].first() if "backend" in bench else None
    rows = []
    for key, g in rounds.groupby(CONFIG + ["variant", "mode"]):
        c = float(conf[key[:len(CONFIG)]])
        which = {} if backend is None else {"backend": backend[key[:-1]]}
        for phase in LATENCY_PHASES:
            x = g[phase].dropna().to_numpy()
            if x.size == 0 or (phase == "jacobian" and not x.any()):
                continue
            med, lo, hi = median_ci(x, c)
            rows.append({**dict(zip(CONFIG + ["variant", "mode"], key)), **which, "phase": phase, "median": med,
                         "ci_low": lo, "ci_high": hi, "q1": float(np.quantile(x, 0.25)),
                         "q3": float(np.quantile(x, 0.75)), "mean": float(x.mean()),
                         "std": float(x.std(ddof=1)) if x.size > 1 else math.nan, "n": int(x.size),
                         "noisy": bool(noisy[key])})
    return pd.DataFrame(rows)


def speedups(bench: pd.DataFrame) -> pd.DataFrame:
    bench = _normalise(bench)
    rounds = per_round(bench).set_index(CONFIG + ["variant", "mode", "iter"]).sort_index()
    meta = _config_meta(bench).set_index(CONFIG + ["variant"])
    rows = []
    for key, cfg in bench.groupby(CONFIG):
        conf, threshold = float(cfg["conf"].iloc[0]), float(cfg["noisy_threshold"].iloc[0])
        present = set(cfg["variant"])
        # every BPPSA variant against every baseline measured beside it (on a GPU: cuDNN's default
        # algorithm and the per-step one the paper had)
        for ref in sorted(v for v in present if not v.startswith("bppsa")):
            for v in sorted(v for v in present if v.startswith("bppsa")):
                rows += _pair(rounds, meta, key, ref, v, conf, threshold)
    return pd.DataFrame(rows)


def _pair(rounds, meta, key, ref, v, conf, threshold) -> list[dict]:
    r_full, v_full = rounds.loc[key + (ref, "full")], rounds.loc[key + (v, "full")]
    mv, mr = meta.loc[key + (v,)], meta.loc[key + (ref,)]
    base = {**dict(zip(CONFIG, key)), "variant": v, "reference": ref, "backend": mv["backend"],
            "reference_backend": mr["backend"], "stopped_by": mv["stopped_by"]}
    out = []
    for phase in SPEEDUP_PHASES:
        num, den = r_full[phase].to_numpy(), v_full[phase].to_numpy()
        med, lo, hi = ratio_ci(num, den, conf)
        out.append({**base, "phase": phase, "speedup": med, "ci_low": lo, "ci_high": hi, "n": int(num.size),
                    "noisy": bool(mv["noisy"] or mr["noisy"] or _wide(med, lo, hi, threshold)),
                    "resolved": True, "mean_speedup": float(np.mean(num) / np.mean(den))})
    if (key + (ref, "nobp", 0)) in rounds.index and (key + (v, "nobp", 0)) in rounds.index:
        out.append({**base, **nobp_speedup(r_full["iteration"].to_numpy(),
                                           rounds.loc[key + (ref, "nobp")]["iteration"].to_numpy(),
                                           v_full["iteration"].to_numpy(),
                                           rounds.loc[key + (v, "nobp")]["iteration"].to_numpy(), conf, threshold)})
    return out


def nobp_speedup(ref_full, ref_nobp, var_full, var_nobp, conf: float = 0.95, threshold: float = 0.1) -> dict:
    """The paper's subtraction, per round (full - forward-only), and the ratio of the two medians.

    The interval combines the two medians' intervals (lo_ref / hi_var, hi_ref / lo_var): conservative,
    since each side alone has coverage ``conf``.  A side whose interval reaches zero is not resolved.
    """
    d_ref = np.asarray(ref_full) - np.asarray(ref_nobp)
    d_var = np.asarray(var_full) - np.asarray(var_nobp)
    mr, lr_, hr = median_ci(d_ref, conf)
    mv, lv, hv = median_ci(d_var, conf)
    out = {"phase": "backward-nobp", "n": int(min(d_ref.size, d_var.size)),
           "mean_speedup": float(np.mean(d_ref) / np.mean(d_var)) if np.mean(d_var) != 0 else math.nan}
    if not (lr_ > 0 and lv > 0):
        return {**out, "speedup": math.nan, "ci_low": math.nan, "ci_high": math.nan, "noisy": True,
                "resolved": False}
    med, lo, hi = mr / mv, lr_ / hv, hr / lv
    return {**out, "speedup": med, "ci_low": lo, "ci_high": hi, "noisy": _wide(med, lo, hi, threshold),
            "resolved": True}


def _wide(med, lo, hi, threshold) -> bool:
    """Whether an interval is wider than +-threshold of its median (or missing: too few samples)."""
    if not (med > 0 and np.isfinite(lo) and np.isfinite(hi)):
        return True
    return max(med - lo, hi - med) / med > threshold


def _normalise(bench: pd.DataFrame) -> pd.DataFrame:
    missing = [c for c in CONFIG + ["variant", "mode", "iter", "phase", "seconds", "reference", "conf",
                                    "noisy_threshold", "noisy"] if c not in bench]
    if "device" in missing and "device_label" in bench:
        bench = bench.assign(device=bench["device_label"])
        missing.remove("device")
    if missing:
        raise ValueError(f"bench CSV lacks column(s) {', '.join(missing)}: written by an older `bppsa bench`? "
                         "Re-run the bench rules.")
    if "graphed" in bench and bench["graphed"].nunique(dropna=False) > 1:
        raise ValueError("these bench CSVs mix graphed runs (`bppsa bench --graphed`: CUDA-graph replays) with eager "
                         "ones; summarise each kind on its own")
    return bench.assign(data=bench["data"].fillna(""))


# -- checks of a run: quiet against loaded, and isolated points along a sweep ---------------------------
RUN_KEYS = ["model", "variant", "reference", "seq_len", "batch", "phase"]


def compare_runs(quiet: pd.DataFrame, loaded: pd.DataFrame, tolerance: float = 0.25) -> pd.DataFrame:
    """Side by side, per speedup: does the loaded run agree with the quiet one within ``tolerance``,
    or flag itself (noisy / not resolved)?  ``ok`` is False where neither holds or a speedup is negative."""
    m = quiet.merge(loaded, on=RUN_KEYS, how="outer", suffixes=("_quiet", "_loaded"))
    rel = (m["speedup_loaded"] / m["speedup_quiet"] - 1).abs()
    m["rel_diff"] = rel
    m["agree"] = rel <= tolerance
    flagged = m["noisy_loaded"].fillna(True).astype(bool) | ~m["resolved_loaded"].fillna(False).astype(bool)
    negative = (m["speedup_quiet"] < 0) | (m["speedup_loaded"] < 0)
    m["ok"] = (m["agree"] | flagged) & ~negative
    return m


def isolated_points(sp: pd.DataFrame, factor: float = 2.0) -> pd.DataFrame:
    """Spikes of a sweep: points more than ``factor`` x above both neighbours, or below both, and not
    flagged noisy.  A point between its neighbours belongs to the trend, however steep (a speedup that
    halves with every doubling of B is 2x from both neighbours and no outlier).

    Sweeps: T at each fixed B and B at each fixed T, per (model, variant, reference, phase).
    """
    out = []
    d = sp[sp["resolved"]]
    for axis, other in (("seq_len", "batch"), ("batch", "seq_len")):
        for _, g in d.groupby(["model", "variant", "reference", "phase", other]):
            g = g.sort_values(axis)
            if len(g) < 3:
                continue
            s = g["speedup"].to_numpy()
            for i in range(1, len(g) - 1):
                far = (all(s[i] > factor * s[j] for j in (i - 1, i + 1))
                       or all(s[j] > factor * s[i] for j in (i - 1, i + 1)))
                if far and not bool(g["noisy"].iloc[i]):
                    out.append(g.iloc[i])
    return pd.DataFrame(out)
