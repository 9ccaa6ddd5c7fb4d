"""The analysis of the measured CSVs: `bppsa speedups` (one model's latency.csv and speedups.csv), `bppsa
compare-speedups` (two runs side by side) and `bppsa report` (report.md, claims.md).  Imports stay inside
the handlers: these jobs need neither torch nor the models."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("speedups", help="latency.csv and speedups.csv of one model: medians, paired-ratio "
                                        "speedups and their confidence intervals, from bench CSVs")
    p.add_argument("bench", nargs="+", help="bench CSVs written by `bppsa bench`")
    p.add_argument("--out", required=True, help="speedups.csv")
    p.add_argument("--latency-out", required=True, help="latency.csv")
    p.set_defaults(func=_speedups)

    p = sub.add_parser("compare-speedups", help="two runs' speedups.csv side by side (e.g. quiet vs loaded); "
                                                "exit 1 where a loaded speedup neither agrees nor flags itself")
    p.add_argument("quiet", nargs="+", help="speedups.csv of the reference run (one per model)")
    p.add_argument("--loaded", nargs="+", required=True, help="speedups.csv of the other run, same models")
    p.add_argument("--tolerance", type=float, default=0.25)
    p.set_defaults(func=_compare)

    p = sub.add_parser("report", help="write results/report.md from the measured CSVs")
    p.add_argument("--results", default="results")
    p.add_argument("--out", default="results/report.md")
    p.add_argument("--claims-out", default=None, help="also write the claims table here (results/claims.md)")
    p.set_defaults(func=_report)


def _report(args) -> int:
    from .. import io
    from ..analysis.report import build

    io.write_text(args.out, build(args.results))
    if args.claims_out:
        from ..analysis import claims

        io.write_text(args.claims_out, claims.render(claims.collect(args.results)))
    return 0


def _speedups(args) -> int:
    import pandas as pd

    from .. import io
    from ..analysis import speedups

    frames = []
    for path in args.bench:
        try:
            frames.append(pd.read_csv(path))
        except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
            raise ValueError(f"{path}: cannot read the bench CSV ({e})") from e
    bench = pd.concat(frames, ignore_index=True)
    sp = speedups.speedups(bench)
    io.write_csv(args.latency_out, speedups.latency(bench))
    io.write_csv(args.out, sp)
    flagged = sp[sp["noisy"] | ~sp["resolved"]]
    print(f"{len(sp)} speedups, {int(sp['noisy'].sum())} noisy, {int((~sp['resolved']).sum())} not resolved",
          file=sys.stderr)
    if len(flagged):
        print(flagged[["variant", "seq_len", "batch", "phase", "speedup", "ci_low", "ci_high"]].to_string(),
              file=sys.stderr)
    return 0


def _compare(args) -> int:
    import numpy as np
    import pandas as pd

    from ..analysis import speedups

    def read(paths):
        return pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)

    quiet, loaded = read(args.quiet), read(args.loaded)
    m = speedups.compare_runs(quiet, loaded, args.tolerance)

    def cell(med, lo, hi, noisy, resolved):
        if not resolved or not np.isfinite(med):
            return "not resolved"
        return f"{med:7.3g} [{lo:.3g}, {hi:.3g}]" + (" noisy" if noisy else "")

    m["quiet"] = [cell(*r) for r in zip(m.speedup_quiet, m.ci_low_quiet, m.ci_high_quiet, m.noisy_quiet.fillna(True),
                                        m.resolved_quiet.fillna(False))]
    m["loaded"] = [cell(*r) for r in zip(m.speedup_loaded, m.ci_low_loaded, m.ci_high_loaded,
                                         m.noisy_loaded.fillna(True), m.resolved_loaded.fillna(False))]
    m["verdict"] = np.where(m["ok"], np.where(m["agree"], "agrees", "flagged"), "FAIL")
    cols = ["model", "variant", "reference", "seq_len", "batch", "phase", "quiet", "loaded", "rel_diff", "verdict"]
    with pd.option_context("display.width", 250, "display.max_rows", None, "display.max_colwidth", 40):
        print(m[cols].sort_values(cols[:6]).to_string(index=False, float_format=lambda v: f"{v:.1%}"))
    iso = speedups.isolated_points(quiet)
    print(f"\n{int(m['agree'].sum())} agree within {args.tolerance:.0%}, {int((m['ok'] & ~m['agree']).sum())} "
          f"flagged in the loaded run, {int((~m['ok']).sum())} FAIL; {len(iso)} unflagged point(s) of the quiet run "
          f"more than 2x away from both neighbours")
    if len(iso):
        print(iso[["model", "variant", "seq_len", "batch", "phase", "speedup"]].to_string(index=False))
    return 0 if m["ok"].all() and iso.empty else 1
