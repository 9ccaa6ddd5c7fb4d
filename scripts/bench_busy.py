"""The BPPSA backward on a busy host: a training step's backward (RNN, fused layout, the CPU fast path) timed while
another process's busy loop is switched on and off every ``--period`` seconds, so busy and quiet rounds interleave
and each busy round is paired with the quiet round at the same place of the quiet period before it.

    python scripts/bench_busy.py --batch 16 --seq-len 1000 --threads 2 --seconds 60 --out busy.csv
    python scripts/bench_busy.py --no-busy --batch 1 8 16 64 --against /path/to/other/checkout/src   # quiet A/B

Per round and method: the phases of ``RecurrentClassifier.bppsa_step`` (``forward``, ``jacobian``, ``backward``),
``bwd`` = jacobian + backward (what ``bppsa speed`` reports as the BPPSA backward), and inside it ``kernel``: the
compiled team's one call (``native.Team.go``), so ``bwd - kernel`` is the Python and torch around it.  Per state
(quiet, busy): the process's user and system CPU time and context switches (``getrusage``) over the rounds in that
state, and the busy loop's own CPU time (``/proc/<pid>/stat``), so a "busy" that was not busy shows.

``--against SRC``: another checkout's package (its ``src``, e.g. main's) and this one are each imported as a copy
under another name, with its own kernel build; the two run alternately, round by round, on copies of the same
model, batch and load, and the report gives their paired ratio.  ``--busy-session new`` (the default) starts the
busy loop in a session of its own, as another user's job is (with the kernel's autogroups the scheduler then shares
a core between the two sessions, not between the threads); ``same`` keeps it in this one.  torch's thread count
stays ``--threads`` in every phase, as in a training loop; on a busy core torch's own forward at two threads can take
~1 s (its OpenMP threads wait for each other at every op), so busy rounds are few: give ``--max-seconds`` room.
"""
from __future__ import annotations

# isort: off
import bppsa  # before torch: its OpenMP settings (bppsa.process)
from bppsa import process
# isort: on

import argparse
import importlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pandas as pd
import torch

from bppsa.bench.protocol import median_ci, ratio_ci


def load_copy(src: str, name: str):
    """The package at ``src``/bppsa, imported as ``name`` (its imports are relative, so a renamed copy is whole)."""
    tmp = tempfile.mkdtemp(prefix="bench_busy_")
    shutil.copytree(os.path.join(src, "bppsa"), os.path.join(tmp, name),
                    ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, tmp)
    return importlib.import_module(name)


def instrument(pkg, box: dict):
    """Time ``pkg``'s kernel call (Team.go) into box["kernel"], its units run again into box["reruns"]."""
    native = importlib.import_module(pkg.__name__ + ".backends.cpu.native")
    go = native.Team.go

    def timed(self, *a, **k):
        r0 = getattr(self.t, "reruns", 0)  # units run again for a held-up thread (where the team has them)
        t0 = time.perf_counter()
        try:
            return go(self, *a, **k)
        finally:
            box["kernel"] += time.perf_counter() - t0
            box["reruns"] += getattr(self.t, "reruns", 0) - r0

    native.Team.go = timed


def method(pkg, B: int, T: int, H: int, dtype, seed: int):
    """One round of ``pkg``'s training-step backward: seconds per phase."""
    speed = importlib.import_module(pkg.__name__ + ".bench.speed")
    timing = importlib.import_module(pkg.__name__ + ".bench.timing")
    backends = importlib.import_module(pkg.__name__ + ".backends")
    model, x, y = speed.setup("rnn", B, seed, dtype, T, H)
    backend = backends.get_backend("cpu", torch.device("cpu"))
    if backend.name != "cpu":
        raise SystemExit(f"{pkg.__name__}: the CPU fast path is unavailable here")
    timer, box = timing.PhaseTimer(torch.device("cpu")), {"kernel": 0.0, "reruns": 0}
    instrument(pkg, box)

    phase = timer.phase  # one thread count throughout, as a training loop runs: switching torch's count before the
    # backward makes its first OpenMP regions there (the head's backward) wake a new team, ms each on a busy core

    def run() -> dict:
        model.zero_grad(set_to_none=True)
        box["kernel"], box["reruns"] = 0.0, 0
        model.bppsa_step(x, y, backend, "fused", phase=phase)
        ph = timer.collect()
        return {**ph, "bwd": ph["jacobian"] + ph["backward"], "kernel": box["kernel"], "reruns": box["reruns"]}

    def plan_of() -> str:
        try:
            plan = importlib.import_module(pkg.__name__ + ".backends.cpu.plan")
        except ModuleNotFoundError:  # a checkout from before the measured plans (f974ab1's)
            return "(fixed; no plan module)"
        chain = importlib.import_module(pkg.__name__ + ".backends.cpu.chain")
        L = importlib.import_module(pkg.__name__ + ".scan").tree_levels(T + 1, None)
        return plan.choose("rnn", T, B, H, 1, dtype, L, "auto", True, torch.get_num_threads(),
                           lambda: chain.synthetic("rnn", T, B, H, 1, dtype)).describe()

    return run, plan_of


class Busy:
    """A busy loop in another process, stopped (SIGSTOP) and continued (SIGCONT) on demand."""

    def __init__(self, new_session: bool, pin: int | None):
        cmd = [sys.executable, "-c", "while True: pass"]
        if pin is not None:
            cmd = ["taskset", "-c", str(pin)] + cmd
        self.p = subprocess.Popen(cmd, start_new_session=new_session)
        os.kill(self.p.pid, signal.SIGSTOP)
        self.on = False

    def set(self, on: bool) -> None:
        if on != self.on:
            os.kill(self.p.pid, signal.SIGCONT if on else signal.SIGSTOP)
            self.on = on

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


def host_busy() -> float:
    """CPU seconds every CPU of the host has spent outside idle and iowait since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def usage() -> np.ndarray:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([r.ru_utime, r.ru_stime, r.ru_nvcsw, r.ru_nivcsw, time.perf_counter(), host_busy()])


def measure(methods: dict, seconds: float, max_seconds: float, period: float, settle: float, busy: Busy | None,
            warmup: int, max_other: float) -> tuple:
    """Rounds of every method (order rotated), the busy loop on in odd periods, until the clean periods add up to
    ``seconds`` (or ``max_seconds`` have passed).  A period is clean where the rest of the host (neither this
    process nor the busy loop) used at most ``max_other`` cores in it (and in its partner: a quiet period and the
    busy one after it are kept or dropped together).  Rows (``clean`` marks theirs) and the clean periods'
    resource use per state."""
    names = list(methods)
    for _ in range(warmup):
        for k in names:
            methods[k]()
    rows, periods = [], []
    t_start = time.perf_counter()
    period_no, t_period = 0, t_start
    u0, b0 = usage(), busy.cpu_seconds() if busy else 0.0
    rnd = 0

    def clean_flags() -> list[bool]:
        ok = [p[3] <= max_other for p in periods]
        if busy:  # pairs (2k, 2k + 1)
            ok = [ok[i] and (ok[i ^ 1] if (i ^ 1) < len(ok) else False) for i in range(len(ok))]
        return ok

    while True:
        now = time.perf_counter()
        if now - t_period >= period:
            state = "busy" if busy and busy.on else "quiet"
            u1, b1 = usage(), busy.cpu_seconds() if busy else 0.0
            d, db = u1 - u0, b1 - b0
            periods.append((state, d, db, (d[5] - d[0] - d[1] - db) / d[4]))
            ok = clean_flags()
            if sum(p[1][4] for p, c in zip(periods, ok) if c) >= seconds or now - t_start >= max_seconds:
                break
            period_no, t_period = period_no + 1, now
            if busy:
                busy.set(period_no % 2 == 1)
            u0, b0 = usage(), busy.cpu_seconds() if busy else 0.0
        state = "busy" if busy and busy.on else "quiet"
        settled = time.perf_counter() - t_period >= settle
        for i in range(len(names)):
            k = names[(i + rnd) % len(names)]
            ph = methods[k]()
            rows.append({"method": k, "round": rnd, "period": period_no, "state": state, "settled": settled,
                         **ph})
        rnd += 1
    ok = clean_flags()
    use, busy_cpu = {"quiet": np.zeros(6), "busy": np.zeros(6)}, {"quiet": 0.0, "busy": 0.0}
    for (state, d, db, _), c in zip(periods, ok):
        if c:
            use[state] += d
            busy_cpu[state] += db
    print(f"{sum(ok)} of {len(periods)} periods clean (the rest of the host at most {max_other} cores); "
          f"the others' load per period: {' '.join(f'{p[3]:.2f}' for p in periods)}")
    df = pd.DataFrame(rows)
    df["clean"] = df.period.map(lambda p: ok[p] if p < len(ok) else False)
    df["settled"] &= df["clean"]
    return df, use, busy_cpu


def paired(df: pd.DataFrame, col: str, method: str) -> tuple[np.ndarray, np.ndarray]:
    """Busy rounds of period 2k+1 against the quiet rounds of period 2k, place by place."""
    d = df[(df.method == method) & df.settled]
    q, b = [], []
    for p in sorted(d.period.unique()):
        if p % 2:
            continue
        qs, bs = d[d.period == p][col].to_numpy(), d[d.period == p + 1][col].to_numpy()
        m = min(len(qs), len(bs))
        q.append(qs[:m]), b.append(bs[:m])
    return (np.concatenate(q), np.concatenate(b)) if q else (np.array([]), np.array([]))


def ms(t: tuple) -> str:
    return f"{t[0] * 1e3:.3f} ms [{t[1] * 1e3:.3f}, {t[2] * 1e3:.3f}]"


def report(df: pd.DataFrame, use: dict, busy_cpu: dict, names: list[str], has_busy: bool) -> None:
    if not df.settled.any():
        print("no clean period: nothing to report (another job kept the host busy)")
        return
    cols = ["bwd", "kernel", "around", "jacobian", "backward", "forward"]
    df = df.assign(around=df.bwd - df.kernel)
    for k in names:
        for state in (("quiet", "busy") if has_busy else ("quiet",)):
            d = df[(df.method == k) & (df.state == state) & df.settled]
            print(f"{k:6s} {state:5s} n={len(d):4d}  " + "  ".join(f"{c} {ms(median_ci(d[c].to_numpy()))}"
                                                                for c in cols[:3]))
            print(" " * 19 + "  ".join(f"{c} {ms(median_ci(d[c].to_numpy()))}" for c in cols[3:])
                  + f"  units run again {d.reruns.mean():.2f}/call")
        if has_busy:
            for c in ("bwd", "kernel", "around"):
                q, b = paired(df, c, k)
                r = ratio_ci(b, q)
                print(f"{k:6s} busy / quiet {c:6s}: {r[0]:.3f}x [{r[1]:.3f}, {r[2]:.3f}] (paired, n={len(q)});"
                      f" ratio of medians {np.median(b) / np.median(q):.3f}x")
    for state, u in use.items():
        if u[4] <= 0:
            continue
        cpu = u[0] + u[1]
        others = (u[5] - cpu - busy_cpu[state]) / u[4]
        print(f"{state:5s}: {u[4]:.1f} s, process CPU {cpu:.2f} s ({cpu / u[4]:.2f} cores), system "
              f"{100 * u[1] / cpu:.1f} % of it; context switches {u[2] / u[4]:.0f}/s voluntary, "
              f"{u[3] / u[4]:.0f}/s involuntary; the busy loop {busy_cpu[state] / u[4]:.2f} cores; everything else "
              f"{others:.2f} cores")
    if len(names) == 2:
        a, b = names
        for state in (("quiet", "busy") if has_busy else ("quiet",)):
            for c in ("bwd", "kernel"):
                d = df[(df.state == state) & df.settled].pivot(index="round", columns="method", values=c).dropna()
                r = ratio_ci(d[b].to_numpy(), d[a].to_numpy())
                print(f"{state:5s} {c:6s} {b} / {a}: {r[0]:.3f}x [{r[1]:.3f}, {r[2]:.3f}] (paired, n={len(d)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16])
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--hidden", type=int, default=20)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=60.0, help="clean seconds per batch size")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="per batch size, clean or not")
    ap.add_argument("--max-other", type=float, default=0.1,
                    help="a period counts only where the rest of the host used at most this many cores")
    ap.add_argument("--period", type=float, default=2.0, help="seconds the busy loop stays on, then off")
    ap.add_argument("--settle", type=float, default=0.1, help="rounds this soon after a switch are not counted")
    ap.add_argument("--no-busy", action="store_true", help="no busy loop: quiet rounds only (an A/B)")
    ap.add_argument("--busy-session", choices=("new", "same"), default="new")
    ap.add_argument("--pin", type=int, default=None, help="pin the busy loop to this CPU")
    ap.add_argument("--against", default=None, help="another checkout's src: its package runs as 'base'")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    process.keep_large_blocks()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)  # as the bppsa commands do: the long products underflow
    dtype = getattr(torch, a.dtype)
    pkgs = {"new": bppsa}
    if a.against:  # both sides copies, set up alike (the package imported first and a copy were not: A/A 0.97x)
        here = os.path.dirname(os.path.dirname(os.path.abspath(bppsa.__file__)))
        pkgs = {"base": load_copy(a.against, "bppsa_base"), "new": load_copy(here, "bppsa_new")}
    print(f"torch {torch.__version__}, threads {a.threads}, {os.cpu_count()} CPUs, OpenMP "
          f"{process.openmp_report()['value']}; {', '.join(f'{k}: {p.__file__}' for k, p in pkgs.items())}")
    frames = []
    for B in a.batch:
        methods = {}
        for k, pkg in pkgs.items():
            run, plan_of = method(pkg, B, a.seq_len, a.hidden, dtype, 0)
            methods[k] = run
            print(f"B = {B} {k}: plan {plan_of()}")
        busy = None if a.no_busy else Busy(a.busy_session == "new", a.pin)
        try:
            df, use, busy_cpu = measure(methods, a.seconds, a.max_seconds, a.period, a.settle, busy, a.warmup,
                                        a.max_other)
        finally:
            if busy:
                busy.close()
        print(f"-- B = {B}, T = {a.seq_len}, H = {a.hidden}, {a.dtype}, {a.threads} threads")
        report(df, use, busy_cpu, list(methods), busy is not None)
        frames.append(df.assign(batch=B))
    if a.out:
        pd.concat(frames).to_csv(a.out, index=False)


if __name__ == "__main__":
    main()
