"""Fig 6 (LeNet-5 through autograd and BPPSA): the command's curves, the figure, and its claims.md row."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_figures import _assert_reads_at_a_glance

from bppsa.analysis import claims
from bppsa.cli import main
from bppsa.plots import common, registry


def test_lenet5_curves_are_the_same_training_both_ways(tmp_path):
    """A few real iterations on the stand-in: both methods start from the same loss and stay within float64
    round-off of each other (exact gradients), and the CSV says how it was made."""
    manifest = tmp_path / "cifar10.json"
    assert main(["make-cifar10", "--source", "standin", "--root", str(tmp_path), "--out", str(manifest)]) == 0
    out = tmp_path / "curve_float64.csv"
    assert main(["lenet5-curves", "--data", str(manifest), "--iterations", "4", "--batch-size", "3", "--lr", "0.05",
                 "--momentum", "0.9", "--test-every", "2", "--test-samples", "20", "--L-m", "none", "--threads", "1",
                 "--dtype", "float64", "--out", str(out)]) == 0
    c = pd.read_csv(out)
    assert set(c["method"]) == {"autograd", "bppsa"} and set(c["split"]) == {"train", "test"}
    train = c[c["split"] == "train"].pivot_table(index="iteration", columns="method", values="loss")
    assert list(train.index) == [1, 2, 3, 4]
    assert train["autograd"].iloc[0] == train["bppsa"].iloc[0]  # same weights, same first batch
    assert train["autograd"].nunique() > 1  # it trained
    rel = ((train["bppsa"] - train["autograd"]).abs() / train["autograd"]).max()
    assert rel <= claims.CURVE_TOL_FLOAT64
    test = c[c["split"] == "test"]
    assert sorted(set(test["iteration"])) == [2, 4] and (test["test_size"] == 20).all()
    assert (c["dtype"] == "float64").all() and (c["L_m"].astype(str) == "none").all()


def test_lenet5_curves_refuses_bad_sizes_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["lenet5-curves", "--data", "x.json", "--iterations", "0", "--batch-size", "3", "--lr", "0.1",
              "--momentum", "0.9", "--test-every", "2", "--test-samples", "0", "--out", str(tmp_path / "x.csv")])
    assert "argument --iterations: must be a positive integer" in capsys.readouterr().err
    assert main(["lenet5-curves", "--data", "x.json", "--iterations", "2", "--batch-size", "3", "--lr", "0.1",
                 "--momentum", "1.5", "--test-every", "2", "--test-samples", "0",
                 "--out", str(tmp_path / "x.csv")]) == 2
    assert "--momentum" in capsys.readouterr().err


def _curves(folder: Path, dtype: str, drift: float, wrong: float = 0.0, n: int = 30) -> None:
    """Synthetic curve CSV: BPPSA's losses differ from autograd's by ``drift`` growing with the iteration
    (round-off amplified by training) plus ``wrong`` from the first iteration on (a wrong gradient)."""
    it = np.arange(1, n + 1)
    base = 2.3 * np.exp(-it / 20)
    rows = []
    for method, loss in (("autograd", base), ("bppsa", base * (1 + wrong + drift * np.exp(it / 4) / np.exp(n / 4)))):
        rows += [dict(method=method, split="train", iteration=i, loss=v, wall_clock_s=0.1 * i)
                 for i, v in zip(it, loss)]
        rows += [dict(method=method, split="test", iteration=i, loss=v + 0.1, wall_clock_s=0.1 * i)
                 for i, v in zip(it, loss) if i % 5 == 0]
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).assign(model="lenet5", dtype=dtype, batch=8, lr=0.03, momentum=0.9, L_m="1",
                              data="stand-in (sklearn digits 8x8 -> 32x32x3)", train_size=1437, test_size=256,
                              profile="default", device_slug="cpu").to_csv(folder / f"curve_{dtype}.csv", index=False)


@pytest.mark.parametrize("f32, f64, wrong, verdict", [
    (1e-5, 1e-15, 0.0, "holds"),  # the same curve in both precisions
    (1e-2, 1e-14, 0.0, "partly"),  # float32 round-off amplified; exact in float64
    (1e-2, 1e-2, 1e-3, "not reproduced"),  # different from the first iteration, float64 too: a wrong gradient
])
def test_the_claim_row_tells_round_off_from_a_wrong_gradient(tmp_path, f32, f64, wrong, verdict):
    folder = tmp_path / "results" / "cpu" / "lenet5"
    _curves(folder, "float32", f32, wrong)
    _curves(folder, "float64", f64, wrong)
    (row,) = claims.lenet5_curve_claims(tmp_path / "results")
    assert row.verdict == verdict, row
    assert "Fig 6" in row.claim and "float64" in row.measured and "iteration" in row.measured
    if verdict != "holds":
        assert "iteration" in row.reason and "epoch" not in row.reason
    assert lenet5_in_table(tmp_path / "results")


def lenet5_in_table(results: Path) -> bool:
    return any("LeNet-5" in c.claim for c in claims.collect(results))


def test_fig_6_reads_at_a_glance(tmp_path, monkeypatch):
    """Drawn through the registry: three panels (training loss, test loss, their difference with the float64
    twin), legends, the profile and device in the footer, no overlapping text."""
    results = tmp_path / "results"
    _curves(results / "cpu" / "lenet5", "float32", 1e-5)
    _curves(results / "cpu" / "lenet5", "float64", 1e-15)
    kept = []
    monkeypatch.setattr(common.plt, "close", kept.append)
    monkeypatch.setattr(common.plt.Figure, "savefig", lambda fig, path, **kw: Path(path).write_bytes(b""))
    fig6 = registry.FIGURES["lenet5"]
    assert [Path(p).name for p in fig6.paths("cpu")] == ["fig_6.png"]
    fig6.run(results, [], [tmp_path / "fig_6.png"])
    (fig,) = kept
    assert len(fig.axes) == 3
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert "float64" in labels and "test loss" in labels
    _assert_reads_at_a_glance(fig, "fig_6.png")
    common.plt.close(fig)
