"""`bppsa paper-shapes`: the paper profile's extreme configurations, checked on this machine (docs/paper-shapes.md)."""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pandas as pd

from .. import io
from ..analysis import gpu_hours
from ..bench import preflight
from .argtypes import positive_int


def register(sub) -> None:
    p = sub.add_parser("paper-shapes",
                       help="exactness, CPU timings, peak host memory and the computed GPU memory of a config's "
                            "extreme shapes; the profile's job count and a GPU-time estimate")
    p.add_argument("--configfile", default="config/paper.yaml", help="the profile to check (default: %(default)s)")
    p.add_argument("--out", required=True,
                   help="CSV, one row per configuration (e.g. results/<device>/paper_shapes.csv)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="timed rounds per method, after one untimed (default: 3)")
    p.add_argument("--no-fp64", dest="fp64", action="store_false", help="skip the float64 exactness check")
    p.add_argument("--no-vgg-flops", dest="vgg_flops", action="store_false",
                   help="skip the one-sample VGG-11 FLOP analysis rows (vgg11.flops.networks)")
    p.add_argument("--in-process", action="store_true",
                   help="run every job in this process (faster; the peak RSS is then cumulative, not per job)")
    p.add_argument("--job-timeout", type=float, default=None, help="seconds before a job is stopped and reported")
    p.add_argument("--no-dry-run", dest="dry_run", action="store_false",
                   help="skip `snakemake -n` (the job count and the GPU-time estimate)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per job (0: torch's default)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every sequence length and batch size by this (< 1: a quick smoke run; default 1)")
    p.add_argument("--estimate-out", default=None, help="also write the GPU-time estimate as CSV")
    p.set_defaults(func=_run)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float) and v.is_integer() and 1 <= abs(v) < 1e9:
        return str(int(v))  # integer columns that pandas made float (they hold blanks)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4g}"
    return str(v)


def markdown(df: pd.DataFrame, cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
    return "\n".join(lines)


SHOWN = ["name", "seq_len", "batch", "width", "max_rel_err_float32", "max_rel_err_float64", "exact",
         "baseline_backward_ms", "bppsa_backward_ms", "train_step_ms", "peak_rss_mb", "host_mem_limit_mb",
         "gpu_jacobians_gb", "gpu_bppsa_gb", "gpu_baseline_gb", "gpu_job_gb", "fits_16gb", "fits_80gb", "wall_s",
         "note"]


def _run(args) -> int:
    if args.rounds < 1:
        raise ValueError("--rounds must be at least 1")
    t_start = time.perf_counter()
    cfg = preflight.load_config(args.configfile)
    jobs = preflight.extreme_jobs(cfg, args.configfile, vgg_flops=args.vgg_flops, scale=args.scale)
    idle = float("nan") if args.in_process else preflight.idle_rss_mb()
    rows = []
    for job in jobs:
        print(f"[paper-shapes] {job['name']}: {job.get('seq_len', '')} {job['batch']} ...", file=sys.stderr, flush=True)
        if args.in_process:
            res = preflight.run_job(job, args.rounds, args.fp64, args.threads)
        else:
            res = preflight.run_job_subprocess(job, args.rounds, args.fp64, args.threads, args.job_timeout)
        rows.append(preflight.table_row(job, res, cfg, args.rounds, idle))
        print(f"[paper-shapes]   {res.get('wall_s', float('nan')):.1f} s, "
              f"peak RSS {res.get('peak_rss_mb', float('nan')):.0f} MB"
              + (f", {res['error']}" if "error" in res else ""), file=sys.stderr, flush=True)
    df = pd.DataFrame(rows, columns=preflight.COLUMNS)
    df["configfile"] = args.configfile
    df["in_process"] = args.in_process
    df["scale"] = args.scale
    io.write_csv(args.out, df)
    print(f"## Extreme shapes of {args.configfile}\n")
    print(markdown(df, SHOWN))
    print(f"\nMemory: peak_rss_mb is the job's own process, in MiB (idle import of torch + bppsa: {_fmt(idle)}); "
          "gpu_* are computed (GB = 1e9 bytes; backends.cuda.memory_model); gpu_job_gb counts "
          "the baseline's and BPPSA's buffers together, as one bench process holds both.", flush=True)
    failed = df["exact"].eq(False).sum() + df["note"].str.contains("NOT RUN", na=False).sum()

    if args.dry_run:
        root = Path(args.configfile).resolve().parent.parent
        if not (root / "Snakefile").is_file():
            root = Path.cwd()
        dr = gpu_hours.dry_run(args.configfile, root)
        gpu_jobs = [j for j in dr["jobs"] if j["gpu"]]
        print(f"\n## Jobs of the profile\n\n`{dr['command']}` (from {root}): **{dr['total']} jobs** "
              f"({len(gpu_jobs)} ask for a GPU; rule `all` included).\n")
        print("| rule | jobs |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in dr["counts"].items()))
        vgg_ms = df.loc[df["name"] == "vgg11 train step", "train_step_ms"]
        vgg_step_ms = float(vgg_ms.iloc[0]) if len(vgg_ms) else None
        est = pd.DataFrame(gpu_hours.gpu_time_estimate(cfg, dr["counts"], vgg_step_ms, args.configfile))
        total = est["hours"].sum(skipna=True)
        caps = sum(j["runtime_min"] for j in gpu_jobs if math.isfinite(j["runtime_min"])) / 60
        print("\n## GPU-time estimate\n\n| item | jobs | hours | derivation |\n|---|---|---|---|")
        for _, r in est.iterrows():
            print(f"| {r['item']} | {r['jobs']} | {_fmt(r['hours']) or 'not estimated'} | {r['derivation']} |")
        print(f"\n**{total:.1f} GPU hours** for the items with a figure (the paper's own artifact: about 57 hours on "
              f"an RTX 2080Ti, PAPER.md Appendix A). Upper bound from the config: the {len(gpu_jobs)} GPU jobs' "
              f"declared resources.runtime sum to {caps:.0f} h.")
        if args.estimate_out:
            io.write_csv(args.estimate_out, est.assign(total_gpu_hours=total, declared_runtime_hours=caps,
                                                       jobs_total=dr["total"]))
    print(f"\npaper-shapes: {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 1 if failed else 0
