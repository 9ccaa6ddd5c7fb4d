"""The timing protocol every benchmark shares: interleaved methods, medians with intervals, a stop rule.

Why these choices (their measured effect under load is in docs/measurements.md; the protocol in docs/timing.md):

- **Median, not mean.** On a shared machine single iterations are sometimes 100x slower than their
  neighbours (a preempted thread); one such outlier moves a 10-sample mean by 10x and leaves the median
  where it was.
- **Interval from order statistics.** The confidence interval of the median uses the binomial
  distribution of the number of samples below it, so it assumes nothing about the shape of the timing
  distribution (which is skewed and often bimodal).
- **Interleaving.** Every method being compared runs one iteration per round, the rounds' orders a Williams
  design (:func:`bppsa.stats.balanced_orders`), so slow phases of the machine hit all methods alike; a speedup is
  then the median of the ratios of *paired* iterations (same round, same batch), not a ratio of two means taken
  minutes apart.
- **Stop when stable.** A configuration is timed until a minimum count *and* a minimum time are
  reached, then until every median (and every paired ratio) is known to within ``rel_ci``, or until a
  cap; what is still too dispersed at the cap is marked ``noisy`` instead of being silently averaged.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from ..stats import balanced_orders, median_ci, ratio_ci, rel_halfwidth

Metric = str | Callable[[Mapping[str, float]], float | None]
TOTAL = "total"  # the metric "sum of every phase": one whole iteration


@dataclass(frozen=True)
class StopRule:
    """When to stop timing one configuration (all methods together)."""
    warmup: int = 3            # untimed rounds first (lazy initialisation, caches, allocator)
    min_iters: int = 10        # timed rounds at least ...
    min_seconds: float = 0.5   # ... and at least this much wall-clock spent in timed rounds
    max_iters: int = 200       # cap: stop here even if not stable ...
    max_seconds: float = 20.0  # ... or after this many seconds of timed rounds
    rel_ci: float = 0.05       # stable: every CI of a median (and of a paired ratio) within +-rel_ci of it
    conf: float = 0.95         # confidence level of those intervals
    noisy_threshold: float = 0.10  # at the end, a relative CI half-width above this marks a method noisy

    def __post_init__(self):
        problems = []
        for name in ("warmup", "min_iters", "max_iters"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                problems.append(f"bench.{name} must be a non-negative integer (got {v!r})")
        for name in ("min_seconds", "max_seconds", "rel_ci", "noisy_threshold"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                problems.append(f"bench.{name} must be a non-negative number (got {v!r})")
        if not problems:
            if self.min_iters < 1:
                problems.append("bench.min_iters must be at least 1")
            if self.max_iters < self.min_iters:
                problems.append(f"bench.max_iters ({self.max_iters}) is below bench.min_iters ({self.min_iters})")
            if self.max_seconds < self.min_seconds:
                problems.append(f"bench.max_seconds ({self.max_seconds}) is below "
                                f"bench.min_seconds ({self.min_seconds})")
        if not isinstance(self.conf, (int, float)) or not 0.5 <= self.conf < 1:
            problems.append(f"bench.conf must be in [0.5, 1) (got {self.conf!r})")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_config(cls, bench: Mapping | None, ignore: Iterable[str] = ()) -> StopRule:
        """Build from the config's ``bench:`` section; unknown keys (not in ``ignore``) are an error."""
        bench = {k: v for k, v in dict(bench or {}).items() if k not in set(ignore)}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(bench) - known)
        if unknown:
            raise ValueError(f"bench: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**bench)

    def as_dict(self) -> dict:
        return asdict(self)

    def cli_args(self) -> str:
        """The command-line flags ``add_stop_rule_args`` reads, e.g. for a Snakemake rule's shell."""
        return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.as_dict().items())

    @classmethod
    def from_args(cls, args) -> StopRule:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def add_stop_rule_args(p) -> None:
    """argparse flags for every StopRule field (defaults: the dataclass's)."""
    d = StopRule()
    for f in fields(StopRule):
        default = getattr(d, f.name)
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(default), default=default,
                       help=f"timing protocol: {f.name} (default {default}; config bench.{f.name})")


def _metric_name(metric: Metric) -> str:
    return metric if isinstance(metric, str) else getattr(metric, "__name__", repr(metric))


def metric_value(phases: Mapping[str, float], metric: Metric) -> float | None:
    """``metric`` of one iteration: 'total' (all phases), a phase name, or a callable; None if absent."""
    if callable(metric):
        return metric(phases)
    if metric == TOTAL:
        return float(sum(phases.values()))
    v = phases.get(metric)
    return None if v is None else float(v)


@dataclass
class Measurement:
    """What ``interleave`` measured.

    ``rows``: one dict per (method, iter, phase, seconds), iter counting timed rounds from 0.
    ``noisy``: per method, whether a metric (or its paired ratio to the reference) stayed more
    dispersed than ``rule.noisy_threshold``.  ``spread``: those relative CI half-widths, keyed
    ``(method, metric)`` and ``(reference/method, metric)`` for the ratios.
    """
    rows: list[dict]
    noisy: dict[str, bool]
    iters: int
    stopped_by: str  # 'stable' | 'cap'
    seconds: float = 0.0  # wall-clock spent in timed rounds
    spread: dict[tuple[str, str], float] = field(default_factory=dict)
    rule: StopRule | None = None
    reference: str | None = None

    def series(self, method: str, metric: Metric = TOTAL) -> np.ndarray:
        """Per timed round, ``metric`` of ``method`` (NaN where the metric was absent)."""
        return _series(self.rows, method, metric, self.iters)

    def ci(self, method: str, metric: Metric = TOTAL) -> tuple[float, float, float]:
        return median_ci(self.series(method, metric), self.rule.conf if self.rule else 0.95)

    def ratio(self, num: str, den: str, metric: Metric = TOTAL) -> tuple[float, float, float]:
        """Median paired ratio num/den of ``metric`` (e.g. baseline/bppsa = speedup) with its CI."""
        return ratio_ci(self.series(num, metric), self.series(den, metric), self.rule.conf if self.rule else 0.95)


def _series(rows: list[dict], method: str, metric: Metric, iters: int) -> np.ndarray:
    per_iter: list[dict[str, float]] = [dict() for _ in range(iters)]
    for r in rows:
        if r["method"] == method:
            per_iter[r["iter"]][r["phase"]] = r["seconds"]
    out = np.full(iters, math.nan)
    for i, phases in enumerate(per_iter):
        if phases:
            v = metric_value(phases, metric)
            out[i] = math.nan if v is None else v
    return out


def interleave(methods: Mapping[str, Callable[[int], Mapping[str, float]]], rule: StopRule, *,
               reference: str | None = None, metric: Metric | Sequence[Metric] = TOTAL,
               compare: Iterable[str] | None = None, clock: Callable[[], float] = time.perf_counter,
               progress: Callable[[int, float], None] | None = None) -> Measurement:
    """Time ``methods`` round by round until the stop rule says so.

    Each callable gets the iteration index ``i`` (the same for every method within a round, counting
    the warm-up rounds too, so ``batches(i)`` gives all methods the same batch) and returns the
    seconds of each phase of that one iteration.  ``metric`` (one or several) is what must be stable;
    a method whose phases lack a named metric is not held to it.  With ``reference``, the paired ratios
    reference/method of every method in ``compare`` (default: all others) must be stable too.
    """
    names = list(methods)
    if not names:
        raise ValueError("interleave: no methods to time")
    if any("/" in m for m in names):
        raise ValueError(f"interleave: method names may not contain '/' (it separates ratio names): {names}")
    if reference is not None and reference not in methods:
        raise ValueError(f"interleave: reference '{reference}' is not one of the methods ({', '.join(names)})")
    compared = [m for m in (names if compare is None else compare) if m != reference]
    missing = [m for m in compared if m not in methods]
    if missing:
        raise ValueError(f"interleave: compare names unknown method(s) {', '.join(missing)}")
    metrics = [metric] if isinstance(metric, str) or callable(metric) else list(metric)

    orders = balanced_orders(len(names))

    def run_round(i: int, r: int) -> list[tuple[str, Mapping[str, float]]]:
        # no method always runs first, nor always right after the same other one (whose threads may still spin)
        return [(names[j], methods[names[j]](i)) for j in orders[r % len(orders)]]

    for r in range(rule.warmup):
        run_round(r, r)

    rows: list[dict] = []
    values = {(m, _metric_name(q)): [] for m in names for q in metrics}
    n, spent, stopped_by = 0, 0.0, "cap"
    spread: dict[tuple[str, str], float] = {}
    while True:
        t0 = clock()
        out = run_round(rule.warmup + n, rule.warmup + n)
        spent += clock() - t0
        for m, phases in out:
            for p, s in phases.items():
                rows.append({"method": m, "iter": n, "phase": p, "seconds": float(s)})
            for q in metrics:
                v = metric_value(phases, q)
                values[m, _metric_name(q)].append(math.nan if v is None else v)
        n += 1
        if progress is not None:
            progress(n, spent)
        if n >= rule.min_iters and spent >= rule.min_seconds:
            spread = _spreads(values, names, metrics, reference, compared, rule.conf)
            if all(v <= rule.rel_ci for v in spread.values()):
                stopped_by = "stable"
                break
        if n >= rule.max_iters or spent >= rule.max_seconds:
            break
    spread = _spreads(values, names, metrics, reference, compared, rule.conf)
    noisy = {m: False for m in names}
    for (who, _), v in spread.items():
        if v > rule.noisy_threshold:
            noisy[who.split("/", 1)[1] if "/" in who else who] = True
    return Measurement(rows=rows, noisy=noisy, iters=n, stopped_by=stopped_by, seconds=spent,
                       spread=spread, rule=rule, reference=reference)


def _spreads(values, names, metrics, reference, compared, conf) -> dict[tuple[str, str], float]:
    out = {}
    for q in map(_metric_name, metrics):
        for m in names:
            x = np.asarray(values[m, q])
            if np.isnan(x).all():
                continue  # this method has no such phase (e.g. a forward-only run and 'backward')
            out[m, q] = rel_halfwidth(x[np.isfinite(x)], conf)
        if reference is not None:
            ref = np.asarray(values[reference, q])
            for m in compared:
                x = np.asarray(values[m, q])
                ok = np.isfinite(ref) & np.isfinite(x)
                if ok.any():
                    with np.errstate(divide="ignore", invalid="ignore"):
                        out[f"{reference}/{m}", q] = rel_halfwidth(ref[ok] / x[ok], conf)
    return out
