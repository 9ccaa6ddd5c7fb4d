"""Where the suite's time goes: a pytest plugin that records every test phase, and its summary.

    python -m pytest -q -n auto -p suite_timing --timing-log=LOG.tsv   # with scripts/ on PYTHONPATH
    python scripts/suite_timing.py LOG.tsv [TOP]                       # per file, per worker, slowest items

Each worker appends one row per phase (setup, call, teardown) to LOG.tsv: worker, file, node id, phase,
outcome, start (wall clock), wall seconds and CPU seconds (user + system, of the worker and of the child
processes it waited for: compilers, `bppsa` and `snakemake` subprocesses).  On a shared machine the wall
seconds stretch with the load; the CPU seconds much less so.  A fixture's setup is charged to the first test
that triggers it, as pytest's own --durations does.
"""

import collections
import csv
import os
import resource
import sys
import time

import pytest

_CPU = {}


def _cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def pytest_addoption(parser):
    parser.addoption("--timing-log", default=None, help="append each test phase's duration to this TSV file")


def _timed(when):
    @pytest.hookimpl(wrapper=True)
    def hook(item):
        t0 = _cpu()
        try:
            return (yield)
        finally:
            _CPU[(item.nodeid, when)] = _cpu() - t0
    return hook


pytest_runtest_setup, pytest_runtest_call, pytest_runtest_teardown = map(_timed, ("setup", "call", "teardown"))


def pytest_configure(config):
    pytest_runtest_logreport.path = config.getoption("--timing-log")


def pytest_runtest_logreport(report):
    path = getattr(pytest_runtest_logreport, "path", None)
    if not path or hasattr(report, "node"):  # xdist's controller: the worker that ran the test wrote it already
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    start = getattr(report, "start", time.time() - report.duration)
    cpu = _CPU.pop((report.nodeid, report.when), float("nan"))
    with open(path, "a") as f:
        f.write(f"{worker}\t{report.nodeid.split('::')[0]}\t{report.nodeid}\t{report.when}\t{report.outcome}"
                f"\t{start:.3f}\t{report.duration:.3f}\t{cpu:.3f}\n")


def summary(path, top=25):
    rows = [r + ["nan"] * (8 - len(r)) for r in csv.reader(open(path), delimiter="\t")]
    if any(r[0] != "main" for r in rows):  # under xdist only the workers' rows (a controller's are copies)
        rows = [r for r in rows if r[0] != "main"]
    wall, cpu = collections.defaultdict(float), collections.defaultdict(float)
    by_worker = collections.defaultdict(float)
    span = collections.defaultdict(lambda: [float("inf"), 0.0])
    items = collections.defaultdict(lambda: [0.0, 0.0])
    outcomes, tests = collections.Counter(), collections.Counter()
    for worker, file, node, when, outcome, start, dur, c in rows:
        start, dur, c = float(start), float(dur), float(c)
        wall[file] += dur
        cpu[file] += c
        by_worker[worker] += dur
        s = span[worker]
        s[0], s[1] = min(s[0], start), max(s[1], start + dur)
        items[(node, when)][0] += dur
        items[(node, when)][1] += c
        if when == "call" or outcome != "passed":
            outcomes[(when, outcome)] += 1
        if when == "call" and outcome == "passed":
            tests[file] += 1
    t0 = min(s[0] for s in span.values())
    print(f"outcomes (phase, outcome): {dict(outcomes)}\n")
    print("| worker | wall seconds in tests | first start → last end (s after the first test) |\n|---|---|---|")
    for w in sorted(by_worker):
        print(f"| {w} | {by_worker[w]:.0f} | {span[w][0] - t0:.0f} → {span[w][1] - t0:.0f} |")
    total = sum(wall.values())
    print("\n| file | passed | wall s | share | CPU s |\n|---|---|---|---|---|")
    for f, d in sorted(wall.items(), key=lambda kv: -kv[1]):
        print(f"| {f} | {tests[f]} | {d:.1f} | {100 * d / total:.1f} % | {cpu[f]:.1f} |")
    print(f"| all | {sum(tests.values())} | {total:.0f} | | {sum(cpu.values()):.0f} |")
    print("\n| slowest phases | wall s | CPU s |\n|---|---|---|")
    for (node, when), (d, c) in sorted(items.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {node} ({when}) | {d:.1f} | {c:.1f} |")


if __name__ == "__main__":
    summary(sys.argv[1], *(int(a) for a in sys.argv[2:]))
