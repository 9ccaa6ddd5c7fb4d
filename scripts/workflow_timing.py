"""Where a workflow run's time goes, from Snakemake's own log (.snakemake/log/*.snakemake.log).

    python scripts/workflow_timing.py RUN_DIR/.snakemake/log/<latest>.snakemake.log
    python scripts/workflow_timing.py --caps RUN_DIR/results/<device>     # the timing caps against the intervals

Each job's time is from the timestamp Snakemake prints when it starts the job to the one it prints when the job
finishes (one-second resolution). Prints the run's wall time and, per rule, its jobs, their summed seconds and the
longest one.  With --caps, per benchmark CSV (rnn/bench_*.csv, gru/bench_*.csv): the rounds timed, whether the
stop rule stopped it as stable or at its cap (config bench.max_iters, bench.max_seconds), the timed seconds, and the
widest 95 % interval of its backward speedups as a fraction of the speedup (bench.rel_ci is the aim), so a cap
that binds while the intervals are still wide, or never binds, shows.
"""

import collections
import re
import sys
from datetime import datetime

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
START = re.compile(r"^(?:local)?(?:checkpoint|rule) (\w+):$")
JOBID = re.compile(r"^\s+jobid: (\d+)$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def jobs(path):
    """(rule, seconds) of every job the log shows finishing."""
    stamp, pending, started, out = None, None, {}, []
    for line in open(path):
        line = line.rstrip("\n")
        if m := STAMP.match(line):
            stamp = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif m := START.match(line):
            pending = (m.group(1), stamp)
        elif (m := JOBID.match(line)) and pending:
            started[m.group(1)] = pending
            pending = None
        elif m := FINISHED.match(line):
            rule, t0 = started.pop(m.group(1))
            out.append((rule, (stamp - t0).total_seconds(), t0, stamp))
    return out


def summary(path):
    done = jobs(path)
    wall = (max(j[3] for j in done) - min(j[2] for j in done)).total_seconds()
    per = collections.defaultdict(list)
    for rule, s, *_ in done:
        per[rule].append(s)
    total = sum(s for _, s, *_ in done)
    print(f"{len(done)} jobs, {wall:.0f} s from the first job's start to the last one's end, {total:.0f} job-seconds\n")
    print("| rule | jobs | job-seconds | longest job |\n|---|---|---|---|")
    for rule, secs in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {rule} | {len(secs)} | {sum(secs):.0f} | {max(secs):.0f} |")


def caps(folder):
    from pathlib import Path

    import pandas as pd

    from bppsa.analysis.speedups import speedups

    print("| benchmark | rounds | stopped by | timed s | cap s | widest backward CI, ± | noisy |")
    print("|---|---|---|---|---|---|---|")
    for csv in sorted(Path(folder).glob("*/bench_*.csv")):
        bench = pd.read_csv(csv)
        sp = speedups(bench)
        back = sp[(sp["phase"] == "backward") & sp["resolved"]]
        half = ((back["ci_high"] - back["ci_low"]) / 2 / back["speedup"]).max()
        first = bench.iloc[0]
        print(f"| {csv.parent.name}/{csv.name} | {first['rounds']} | {first['stopped_by']} | "
              f"{first['timed_seconds']:.1f} | {first['max_seconds']:g} | {100 * half:.1f} % | "
              f"{', '.join(sorted(set(bench[bench['noisy']]['variant']))) or 'none'} |")


if __name__ == "__main__":
    if sys.argv[1] == "--caps":
        caps(sys.argv[2])
    else:
        summary(sys.argv[1])
