"""Where the suite's time goes: a pytest plugin that records every test phase, and its summary.

    python -m pytest -q -n auto -p suite_timing --timing-log=LOG.tsv   # with scripts/ on PYTHONPATH
    python scripts/suite_timing.py LOG.tsv                             # per file, per worker, slowest items

Each worker appends one row per phase (setup, call, teardown) to LOG.tsv: worker, file, node id, phase,
outcome, start (wall clock) and duration in seconds. A fixture's setup is charged to the first test that
triggers it, as pytest's own --durations does.
"""

import collections
import csv
import os
import sys
import time


def pytest_addoption(parser):
    parser.addoption("--timing-log", default=None, help="append each test phase's duration to this TSV file")


def pytest_runtest_logreport(report):
    path = getattr(pytest_runtest_logreport, "path", None)
    if not path or hasattr(report, "node"):  # xdist's controller: the worker that ran the test wrote it already
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    start = getattr(report, "start", time.time() - report.duration)
    with open(path, "a") as f:
        f.write(f"{worker}\t{report.nodeid.split('::')[0]}\t{report.nodeid}\t{report.when}\t{report.outcome}"
                f"\t{start:.3f}\t{report.duration:.3f}\n")


def pytest_configure(config):
    pytest_runtest_logreport.path = config.getoption("--timing-log")


def summary(path, top=25):
    rows = list(csv.reader(open(path), delimiter="\t"))
    by_file = collections.defaultdict(float)
    by_worker = collections.defaultdict(float)
    span = collections.defaultdict(lambda: [float("inf"), 0.0])
    items = collections.defaultdict(float)
    passed = collections.Counter()
    for worker, file, node, when, outcome, start, dur in rows:
        start, dur = float(start), float(dur)
        by_file[file] += dur
        by_worker[worker] += dur
        s = span[worker]
        s[0], s[1] = min(s[0], start), max(s[1], start + dur)
        items[(node, when)] += dur
        if when == "call":
            passed[outcome] += 1
    t0 = min(s[0] for s in span.values())
    print(f"outcomes (call phase): {dict(passed)}\n")
    print("| worker | test seconds | first start → last end (s after the first test) |\n|---|---|---|")
    for w in sorted(by_worker):
        print(f"| {w} | {by_worker[w]:.0f} | {span[w][0] - t0:.0f} → {span[w][1] - t0:.0f} |")
    total = sum(by_file.values())
    print("\n| file | seconds | share |\n|---|---|---|")
    for f, d in sorted(by_file.items(), key=lambda kv: -kv[1]):
        print(f"| {f} | {d:.1f} | {100 * d / total:.1f} % |")
    print(f"| all | {total:.0f} | |\n\n| slowest phases | seconds |\n|---|---|")
    for (node, when), d in sorted(items.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {node} ({when}) | {d:.1f} |")


if __name__ == "__main__":
    summary(sys.argv[1], *(int(a) for a in sys.argv[2:]))
