"""`bppsa bench-cnn` and `bppsa vgg11-retrain-scan` at toy sizes: the records they write (not their timings, which
are taken on a quiet machine), the claims rows read from them, and that the scan retrains as autograd does."""
import numpy as np
import pandas as pd
import pytest

from bppsa.analysis import claims, report
from bppsa.analysis.cnn import flop_prediction, step_table, timing_summary
from bppsa.cli import main


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    out = root / "cifar10.json"
    assert main(["make-cifar10", "--source", "standin", "--root", str(root), "--out", str(out)]) == 0
    return out


def test_bench_cnn_lenet5_records_paired_rounds_and_the_backwards_parts(manifest, tmp_path):
    out = tmp_path / "bench.csv"
    assert main(["bench-cnn", "--model", "lenet5", "--data", str(manifest), "--batch", "2", "--batches", "2",
                 "--warmup", "1", "--min-iters", "3", "--max-iters", "3", "--min-seconds", "0", "--threads", "1",
                 "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert set(df["method"]) == {"autograd", "bppsa"} and (df["rounds"] == 3).all()
    phases = {m: set(g["phase"]) for m, g in df.groupby("method")}
    assert phases["autograd"] == {"forward", "backward", "optimizer"}
    assert phases["bppsa"] == {"forward", "backward", "optimizer", "jacobian", "scan", "param_grads"}
    assert (df["seconds"] >= 0).all()
    s = timing_summary(df)
    assert s["rounds"] == 3 and s["ratio_backward_total"][0] > 0
    assert 0 < s["share_jacobian"] < 1 and 0 < s["share_scan"] < 1
    folder = tmp_path / "results" / "cpu" / "cnn"
    folder.mkdir(parents=True)
    df.to_csv(folder / "bench_lenet5_B2.csv", index=False)
    text = report._cnn_bench(tmp_path / "results")
    assert "lenet5" in text and "BPPSA/autograd backward" in text and "| cpu |" in text


def test_vgg11_retrain_scan_retrains_as_autograd_and_prices_each_step(manifest, tmp_path):
    it, steps = tmp_path / "retrain_scan.csv", tmp_path / "retrain_scan_steps.csv"
    assert main(["vgg11-retrain-scan", "--data", str(manifest), "--width", "0.0625", "--prune", "0.9",
                 "--iterations", "3", "--batch-size", "2", "--lr", "0.01", "--L-m", "2", "--profile-iterations", "1",
                 "--threads", "1", "--dtype", "float64", "--out", str(it), "--out-steps", str(steps)]) == 0
    df, st = pd.read_csv(it), pd.read_csv(steps)
    # the same weights, batches and masks: the scan retrains exactly as autograd does
    loss = df.groupby(["method", "iter"])["loss"].first().unstack(0)
    assert len(loss) == 3
    np.testing.assert_allclose(loss["bppsa"], loss["autograd"], rtol=1e-10)
    scan = st[st["what"] == "scan"]
    assert len(scan) and scan["flop_per_sample"].notna().all()  # every product has its static FLOP
    assert set(st["what"]) == {"jacobian", "scan", "params"}
    table = step_table(st, st[st["what"] == "scan"].rename(columns={"flop_per_sample": "flop"}), 2)
    assert len(table) == scan.groupby(["phase", "d", "l", "r"]).ngroups
    assert flop_prediction(table)["n"] >= 3
    folder = tmp_path / "results" / "cpu" / "vgg11"
    folder.mkdir(parents=True)
    df.to_csv(folder / "retrain_scan.csv", index=False)
    st.to_csv(folder / "retrain_scan_steps.csv", index=False)
    text = report._vgg_scan(tmp_path / "results")
    assert "BPPSA/autograd per iteration" in text and "Scan levels" in text
    rows = claims.vgg_scan_claims(tmp_path / "results")
    assert [r.verdict for r in rows][0] == "not measurable here"  # a CPU: the paper's case is a GPU's
    assert "Spearman" in rows[1].measured and rows[1].verdict in claims.VERDICTS


def test_retrain_scan_refuses_an_unpruned_network_and_a_missing_checkpoint(manifest, tmp_path):
    base = ["vgg11-retrain-scan", "--data", str(manifest), "--iterations", "1", "--batch-size", "2", "--lr", "0.01",
            "--out", str(tmp_path / "a.csv"), "--out-steps", str(tmp_path / "b.csv")]
    assert main(base + ["--prune", "0"]) == 2
    assert main(base + ["--models", str(tmp_path / "missing.pt")]) == 2
    assert not (tmp_path / "a.csv").exists()


def test_verdicts():
    assert claims.retrain_verdict(0.5, 0.9, gpu=True)[0] == "holds"
    assert claims.retrain_verdict(0.9, 1.1, gpu=True)[0] == "partly"
    assert claims.retrain_verdict(2.0, 3.0, gpu=True)[0] == "not reproduced"
    assert claims.retrain_verdict(0.5, 0.9, gpu=False)[0] == "not measurable here"
    assert claims.flop_time_verdict(0.9, 0.001)[0] == "holds"
    assert claims.flop_time_verdict(0.4, 0.01)[0] == "partly"
    assert claims.flop_time_verdict(0.1, 0.3)[0] == "not reproduced"
