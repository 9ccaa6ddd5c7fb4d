"""Statistics of timing samples: the median with a distribution-free interval, paired ratios, the rounds' orders.

The benchmarks (:mod:`bppsa.bench.protocol`) stop on them, and the analysis (:mod:`bppsa.analysis`) reports
them; why the median and order statistics, not a mean and a normal interval: docs/timing.md.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np


def min_n_for_ci(conf: float = 0.95) -> int:
    """The smallest sample whose order statistics give a median interval of coverage >= conf."""
    n = 1
    while 2 * 0.5 ** n > 1 - conf:
        n += 1
    return n


@functools.cache
def _ci_ranks(n: int, conf: float) -> tuple[int, int]:
    """0-based ranks (lo, hi) of the sorted sample bracketing the median with coverage >= conf.

    P(x_(j) <= median <= x_(n-1-j)) = 1 - 2 P(Bin(n, 1/2) <= j); the largest j keeping that >= conf.
    Below ``min_n_for_ci(conf)`` samples no j qualifies (even the whole range covers only 1 - 2^(1-n));
    ``median_ci`` then gives NaN bounds and ``rel_halfwidth`` infinity.
    """
    half_alpha = (1 - conf) / 2
    j, cdf = -1, 0.0
    log_half_n = n * math.log(0.5)
    for i in range(n // 2 + 1):  # Bin(n, 1/2)'s cdf term by term, in log space (no overflow at large n)
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half_n)
        if cdf > half_alpha:
            break
        j = i
    j = max(j, 0)
    return j, n - 1 - j


def median_ci(x: Iterable[float], conf: float = 0.95) -> tuple[float, float, float]:
    """Median of ``x`` and a distribution-free confidence interval from its order statistics.

    The bounds are NaN while the sample is too small for any interval of that coverage (n < 6 at 95 %).
    """
    a = np.sort(np.asarray(list(x) if not isinstance(x, np.ndarray) else x, dtype=float).ravel())
    a = a[np.isfinite(a)]
    if a.size == 0:
        return math.nan, math.nan, math.nan
    if a.size < min_n_for_ci(conf):
        return float(np.median(a)), math.nan, math.nan  # no order statistics reach the coverage yet
    lo, hi = _ci_ranks(a.size, conf)
    return float(np.median(a)), float(a[lo]), float(a[hi])


def ratio_ci(num: Sequence[float], den: Sequence[float], conf: float = 0.95) -> tuple[float, float, float]:
    """Median of the paired ratios num[i] / den[i] and its confidence interval."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if num.shape != den.shape:
        raise ValueError(f"ratio_ci: {num.size} numerators but {den.size} denominators; the samples must be paired")
    with np.errstate(divide="ignore", invalid="ignore"):
        r = num / den
    return median_ci(r, conf)


def rel_halfwidth(x: Sequence[float], conf: float = 0.95) -> float:
    """The larger side of the median's CI relative to the median (inf when it cannot be told yet)."""
    x = np.asarray(x, dtype=float)
    if x.size < min_n_for_ci(conf):
        return math.inf
    m, lo, hi = median_ci(x, conf)
    if not m > 0:
        return math.inf
    return max(m - lo, hi - m) / m


def balanced_orders(n: int) -> list[list[int]]:
    """The rounds' orders of ``n`` methods, a Williams design: each method runs at every place, and right after each
    other method, equally often (n orders for even n, 2n for odd).  A plain rotation keeps the cyclic order, so one
    method would always follow the same other one and pay for what it leaves behind (spinning OpenMP threads, a cold
    cache): measured, 10-50 % on the forward of the method that followed torch.nn's (docs/timing.md)."""
    if n < 1:
        return [[]]
    first, lo, hi = [0], 1, n - 1
    while lo <= hi:  # 0, 1, n-1, 2, n-2, ...
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    orders = [[(j + r) % n for j in first] for r in range(n)]
    return orders + ([o[::-1] for o in orders] if n % 2 else [])
