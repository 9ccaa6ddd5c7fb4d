"""The shared timing protocol: median intervals, paired ratios, the stop rule, interleaving."""
import collections
import math

import numpy as np
import pytest

from bppsa.bench.protocol import StopRule, interleave
from bppsa.stats import balanced_orders, median_ci, min_n_for_ci, ratio_ci, rel_halfwidth


def test_median_ci_is_the_textbook_order_statistics():
    # n = 20 at 95 %: [x_(6), x_(15)] (1-based), coverage 0.959
    assert median_ci(np.arange(1, 21)) == (10.5, 6.0, 15.0)
    # n = 100: [x_(40), x_(61)]
    assert median_ci(np.arange(1, 101))[1:] == (40.0, 61.0)
    assert min_n_for_ci(0.95) == 6 and min_n_for_ci(0.99) == 8


def test_median_ci_covers_the_true_median_at_its_level():
    rng = np.random.default_rng(0)
    trials, n = 4000, 25
    # skewed like timings: lognormal, true median exp(0) = 1
    hits = sum(lo <= 1.0 <= hi for _, lo, hi in (median_ci(rng.lognormal(0, 0.5, n)) for _ in range(trials)))
    assert 0.94 <= hits / trials <= 0.99  # exact coverage for n = 25 is 0.957


def test_one_outlier_moves_the_mean_not_the_median():
    x = np.full(20, 1e-3)
    x[7] = 0.3  # a preempted iteration, 300x its neighbours
    m, lo, hi = median_ci(x)
    assert m == lo == hi == 1e-3
    assert x.mean() > 10 * m


def test_ratio_ci_pairs_and_rejects_unpaired():
    rng = np.random.default_rng(1)
    load = rng.lognormal(0, 0.8, 40)  # common-mode slowdowns hit both methods of a round
    base, fast = 4e-3 * load, 1e-3 * load * rng.lognormal(0, 0.01, 40)
    m, lo, hi = ratio_ci(base, fast)
    assert lo <= 4.0 <= hi and (hi - lo) / m < 0.02
    # the same numbers unpaired (ratio of medians of shuffled samples) would be far less certain
    assert rel_halfwidth(base) > 0.2
    with pytest.raises(ValueError, match="paired"):
        ratio_ci(base, fast[:-1])


def test_too_small_samples_have_no_interval():
    m, lo, hi = median_ci([3.0, 1.0, 2.0])
    assert m == 2.0 and math.isnan(lo) and math.isnan(hi)
    assert rel_halfwidth([1.0] * 5) == math.inf
    assert rel_halfwidth([1.0] * 6) == 0.0


def test_stop_rule_validation_names_the_key():
    with pytest.raises(ValueError, match="bench.max_iters"):
        StopRule(min_iters=10, max_iters=5)
    with pytest.raises(ValueError, match="bench.conf"):
        StopRule(conf=1.0)
    with pytest.raises(ValueError, match="bench.rel_ci"):
        StopRule(rel_ci=-0.1)
    with pytest.raises(ValueError, match="unknown key.*iterz"):
        StopRule.from_config({"warmup": 1, "iterz": 3})
    assert StopRule.from_config({"warmup": 1, "max_seconds": 3}).warmup == 1


class FakeMachine:
    """Methods whose 'seconds' come from a generator and a clock that advances by them."""

    def __init__(self, costs):
        self.t, self.costs, self.calls = 0.0, costs, []

    def clock(self):
        return self.t

    def method(self, name):
        def run(i):
            self.calls.append((name, i))
            phases = self.costs[name](i)
            self.t += sum(phases.values())
            return phases
        return run


def test_stable_methods_stop_once_minimums_are_met():
    fm = FakeMachine({"a": lambda i: {"forward": 1e-3, "backward": 3e-3},
                      "b": lambda i: {"forward": 1e-3, "backward": 1e-3}})
    rule = StopRule(warmup=2, min_iters=8, min_seconds=0.05, max_iters=1000, max_seconds=10)
    m = interleave({k: fm.method(k) for k in "ab"}, rule, reference="a", clock=fm.clock)
    assert m.stopped_by == "stable" and m.noisy == {"a": False, "b": False}
    # 0.05 s at 6 ms per round: the time minimum binds, not the count
    assert m.iters == math.ceil(0.05 / 6e-3 - 1e-9)
    assert m.ratio("a", "b", "backward") == (3.0, 3.0, 3.0)
    assert m.ratio("a", "b") == (2.0, 2.0, 2.0)
    assert {r["iter"] for r in m.rows} == set(range(m.iters))
    assert len(m.rows) == m.iters * 2 * 2


def test_rounds_rotate_and_share_the_iteration_index():
    fm = FakeMachine({k: (lambda i: {"x": 1.0}) for k in "abc"})
    rule = StopRule(warmup=1, min_iters=6, min_seconds=0, max_iters=6)
    interleave({k: fm.method(k) for k in "abc"}, rule, clock=fm.clock)
    rounds = [fm.calls[3 * r:3 * r + 3] for r in range(7)]
    assert all(len({i for _, i in rnd}) == 1 for rnd in rounds)  # same batch index within a round
    assert [rnd[0][1] for rnd in rounds] == list(range(7))          # warm-up round is i = 0
    firsts = [rnd[0][0] for rnd in rounds[1:]]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]         # each method first equally often


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_round_orders_balance_places_and_predecessors(n):
    """A Williams design: every method at every place equally often, and right after every other equally often
    (a rotation would keep one predecessor per method)."""
    orders = balanced_orders(n)
    assert all(sorted(o) == list(range(n)) for o in orders) and len(orders) == (n if n % 2 == 0 else 2 * n)
    for place in range(n):
        assert sorted(o[place] for o in orders) == sorted(list(range(n)) * (len(orders) // n))
    pairs = collections.Counter((o[k], o[k + 1]) for o in orders for k in range(n - 1))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1


def test_dispersed_method_runs_to_the_cap_and_is_flagged():
    rng = np.random.default_rng(2)
    fm = FakeMachine({"base": lambda i: {"backward": 1e-3},
                      "wild": lambda i: {"backward": float(rng.lognormal(-7, 1.5))}})
    rule = StopRule(warmup=0, min_iters=10, min_seconds=0, max_iters=40, max_seconds=100, noisy_threshold=0.1)
    m = interleave({k: fm.method(k) for k in ("base", "wild")}, rule, reference="base", clock=fm.clock)
    assert m.stopped_by == "cap" and m.iters == 40
    assert m.noisy == {"base": False, "wild": True}
    assert m.spread["base/wild", "total"] > 0.1


def test_time_cap_stops_a_slow_configuration():
    fm = FakeMachine({"slow": lambda i: {"x": 0.4 * (1 + (i % 2))}})
    rule = StopRule(warmup=1, min_iters=2, min_seconds=0, max_iters=1000, max_seconds=3.0)
    m = interleave({"slow": fm.method("slow")}, rule, clock=fm.clock)
    assert m.stopped_by == "cap" and m.seconds >= 3.0 and m.iters < 10


def test_metrics_absent_from_a_method_are_not_required_and_compare_restricts_ratios():
    rng = np.random.default_rng(3)
    fm = FakeMachine({"full": lambda i: {"forward": 1e-3, "backward": 2e-3},
                      "nobp": lambda i: {"forward": float(rng.lognormal(-7, 1.0))},
                      "fast": lambda i: {"forward": 1e-3, "backward": 5e-4}})
    rule = StopRule(warmup=0, min_iters=10, min_seconds=0, max_iters=30)
    m = interleave({k: fm.method(k) for k in ("full", "nobp", "fast")}, rule, reference="full",
                   metric=["backward"], compare=["fast"], clock=fm.clock)
    assert m.stopped_by == "stable" and not any(m.noisy.values())
    assert set(m.spread) == {("full", "backward"), ("fast", "backward"), ("full/fast", "backward")}
    assert np.isnan(m.series("nobp", "backward")).all()


def test_bad_arguments_are_named():
    rule = StopRule()
    with pytest.raises(ValueError, match="reference 'z'"):
        interleave({"a": lambda i: {"x": 1.0}}, rule, reference="z")
    with pytest.raises(ValueError, match="no methods"):
        interleave({}, rule)


def test_ci_ranks_equal_scipys_binomial_quantiles():
    """The median interval's ranks, from Bin(n, 1/2) summed in log space, are scipy's for every n up to 3000."""
    from scipy.stats import binom

    from bppsa.stats import _ci_ranks

    for conf in (0.9, 0.95, 0.99):
        alpha = 1 - conf
        for n in range(1, 3001):
            j = int(binom.ppf(alpha / 2, n, 0.5))
            while j >= 0 and binom.cdf(j, n, 0.5) > alpha / 2:
                j -= 1
            j = max(j, 0)
            assert _ci_ranks(n, conf) == (j, n - 1 - j), (n, conf)
