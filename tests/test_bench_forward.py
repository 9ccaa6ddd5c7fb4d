"""The forward benchmark (bppsa.bench.forward, scripts/bench_forward.py) on tiny sizes: its rows and summary, the
sliced forward's exactness guard, and layers that remember do (their slices never meet)."""
import pandas as pd
import pytest
import torch

from bppsa.backends.cpu import native
from bppsa.bench import forward
from bppsa.bench.protocol import StopRule

pytestmark = pytest.mark.skipif(native.target() is None, reason="no C compiler")
RULE = StopRule(warmup=0, min_iters=2, min_seconds=0.0, max_iters=2, max_seconds=5.0)


def test_rows_and_summary_of_both_experiments():
    rows, summary = forward.run(["gru"], [30], [3], 20, 1, torch.float32, 2, 2, RULE, 60, tol=1e-6,
                                progress=lambda line: None)
    assert isinstance(rows, pd.DataFrame) and set(rows.method) == {"torch", "compiled", "compiled-1", "compiled-2",
                                                                   "sliced-2", "sliced-2-tol"}
    assert (rows.seconds >= 0).all() and len(rows) == 2 * 2 * (2 + 2 * 4) and set(rows.phase) == {"forward", "cpu"}
    comp = summary[summary.experiment == "compiled"].set_index("method")
    assert comp.loc["compiled", "speedup"] > 0 and comp.loc["compiled", "rel_err_vs_torch"] <= 1e-6
    sl = summary[(summary.experiment == "sliced")].set_index(["layer", "method"])
    assert sl.loc[("forgets", "sliced-2"), "tol"] == 0 and sl.loc[("forgets", "sliced-2-tol"), "tol"] == 1e-6
    # the layer that remembers never meets: its one correction runs the whole second slice
    assert sl.loc[("remembers", "sliced-2"), "meet_steps"] == "1:30"


def test_the_tanh_rnn_is_also_timed_at_its_cells_criterion():
    """The layers give the tanh RNN's sliced forward its cell's criterion (two ulps): the benchmark times that too,
    as ``sliced-p-cell``; the bitwise cells have no such row."""
    rows, summary = forward.run(["rnn_tanh", "gru"], [30], [3], 20, 1, torch.float32, 2, 2, RULE, 60,
                                layers=("forgets",), experiments=("sliced",), progress=lambda line: None)
    assert set(rows[rows.cell == "rnn_tanh"].method) == {"compiled-1", "compiled-2", "sliced-2", "sliced-2-cell"}
    assert "sliced-2-cell" not in set(rows[rows.cell == "gru"].method)
    row = summary[(summary.cell == "rnn_tanh") & (summary.method == "sliced-2-cell")].iloc[0]
    assert row.tol == 2 * torch.finfo(torch.float32).eps and row.sweeps >= 1


@pytest.mark.parametrize("cell", ["rnn_tanh", "gru", "lstm"])
def test_a_layer_made_to_remember_keeps_its_start(cell):
    m = forward.make_layer(cell, 1, 20, torch.float64, "remembers")
    x = torch.zeros(200, 2, 1, dtype=torch.float64)
    a = torch.ones(1, 2, 20, dtype=torch.float64) * 0.5
    with torch.no_grad():
        ha = m(x, (a, a) if cell == "lstm" else a)[0]
        hb = m(x, (-a, -a) if cell == "lstm" else -a)[0]
    assert (ha[-1] - hb[-1]).abs().max() > 1e-3  # after 200 steps the two starts still differ
