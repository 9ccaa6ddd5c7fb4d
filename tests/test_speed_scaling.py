"""The CPU speed benchmark, roofline and worker scaling: summaries, counts, fits, commands, rules."""
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from bppsa import scan
from bppsa.bench import roofline, scaling, speed
from bppsa.bench.protocol import StopRule
from bppsa.cli import main

ROOT = Path(__file__).resolve().parents[1]
# 6: the fewest rounds with a 95 % median CI
TINY = StopRule(warmup=0, min_iters=6, max_iters=6, min_seconds=0.0, max_seconds=60.0)


def _rows(batch, group, method, secs, phase="backward", noisy=False):
    return [{"batch": batch, "group": group, "method": method, "iter": i, "phase": phase, "seconds": s,
             "noisy": noisy} for i, s in enumerate(secs)]


def test_summary_pairs_iterations_and_reports_intervals():
    n = 12
    auto = [4.0 + 0.01 * i for i in range(n)]
    bp = [a / 2 for a in auto]                                   # exactly 2x, iteration by iteration
    seq = [0.5 * a for a in auto]
    df = pd.DataFrame(_rows(16, "backward", "autograd", auto) + _rows(16, "backward", "sequential", seq, noisy=True)
                      + _rows(16, "backward", "bppsa-cpu-fused", [b / 2 for b in bp], "jacobian")
                      + _rows(16, "backward", "bppsa-cpu-fused", [b / 2 for b in bp])
                      + _rows(16, "backward", "autograd", [9.9] * n, "forward")  # never counted
                      + _rows(16, "scan", "scan-sequential", [3.0] * n, "total")
                      + _rows(16, "scan", "scan-cpu", [1.0] * n, "total"))
    s = speed.summary(df).set_index("ratio")
    assert list(s.columns[:6]) == ["batch", "median", "ci_low", "ci_high", "n", "noisy"]
    r = s.loc["autograd / bppsa-cpu-fused"]
    assert (r["median"], r["ci_low"], r["ci_high"]) == pytest.approx((2.0, 2.0, 2.0))
    assert r["n"] == n and not r["noisy"]
    assert s.loc["sequential / bppsa-cpu-fused", "median"] == pytest.approx(1.0)
    assert bool(s.loc["sequential / bppsa-cpu-fused", "noisy"])  # a noisy side marks the ratio
    assert s.loc["scan-sequential / scan-cpu", "median"] == pytest.approx(3.0)


@pytest.mark.parametrize("n,B,H,L_m", [(1, 1, 3, None), (9, 2, 4, None), (1000, 16, 20, None), (77, 3, 5, 2),
                                       (50, 2, 3, 0)])
def test_scan_cost_counts_the_products_the_scan_makes(n, B, H, L_m, monkeypatch):
    """Count the FLOP of every matmul the torch scan actually issues and compare."""
    flop = [0]
    real = torch.matmul

    def counting(a, b, *args, **kw):
        out = real(a, b, *args, **kw)
        flop[0] += 2 * out.numel() * a.shape[-1]
        return out

    monkeypatch.setattr(torch, "matmul", counting)
    scan.blelloch_scan(torch.randn(B, H), torch.randn(n, B, H, H), L_m)
    assert roofline.scan_cost(n, B, H, L_m)["flop"] == flop[0]


def test_scan_cost_bytes_scale_with_itemsize_and_linear_is_cheaper():
    c4, c8 = roofline.scan_cost(999, 16, 20, None, 4), roofline.scan_cost(999, 16, 20, None, 8)
    assert c8["bytes"] == 2 * c4["bytes"] and c8["flop"] == c4["flop"]
    lin = roofline.scan_cost(999, 16, 20, 0)
    assert lin["flop"] == 998 * 2 * 20 * 20 * 16 and lin["flop"] * 10 < c4["flop"]


def test_chain_scan_cost_counts_the_compiled_scan():
    """The factored chain's scan does about the dense tree's arithmetic (one H^3 product per Jacobian),
    but moves a fraction of its bytes (no level below the fused ones is stored)."""
    dense, chain = roofline.scan_cost(1000, 16, 20), roofline.chain_scan_cost(1000, 16, 20)
    assert 0.9 < chain["flop"] / dense["flop"] < 1.1 and chain["bytes"] * 5 < dense["bytes"]
    seq = roofline.chain_scan_cost(1000, 16, 20, 0)
    assert seq["flop"] == 999 * (2 * 20 * 20 + 20) * 16  # sequential: n - 1 factored mat-vecs
    assert seq["depth"] == 999 * (2 + 5)  # a scaling, the products, a balanced sum of 20 terms
    gru = roofline.chain_scan_cost(1000, 16, 20, kind="gru")
    assert 1.0 < gru["flop"] / chain["flop"] < 1.3  # J_s built from three gates' weights before each product
    paper = roofline.chain_scan_cost(2000, 16, 20, kind="paper")
    assert 0.9 < paper["flop"] / chain["flop"] < 1.15  # two positions per step, one H^3 product per step
    assert roofline.chain_scan_cost(1000, 16, 20, None, 8)["bytes"] == 2 * chain["bytes"]
    rows = roofline.roofline_rows({"scan-cpu-chain": [0.01] * 5}, 1000, 16, 20, None, torch.float32, 100e9, 10e9)
    assert rows[0]["flop"] == chain["flop"] and rows[0]["bound"] == "compute"


def test_roofline_rows_against_all_bounds():
    rows = roofline.roofline_rows({"scan-cpu": [0.02] * 7, "scan-sequential": [0.01] * 7}, 1000, 1, 20, None,
                                  torch.float32, peak=100e9, bandwidth=10e9, t_fma=1e-8, threads=2)
    r = {x["method"]: x for x in rows}
    c = roofline.scan_cost(1000, 1, 20)
    assert r["scan-cpu"]["bound_s"] == pytest.approx(max(c["flop"] / 100e9, c["bytes"] / 10e9))
    assert r["scan-cpu"]["x_bound"] == pytest.approx(0.02 / r["scan-cpu"]["bound_s"])
    seq = r["scan-sequential"]
    assert seq["L_m"] == 0 and seq["flop"] < c["flop"]
    assert seq["t_compute_s"] == pytest.approx(seq["flop"] / 50e9)  # one chain: one of the two cores
    assert seq["t_latency_s"] == pytest.approx(999 * 7 * 1e-8) and seq["bound"] == "latency"


def test_fit_and_crossover():
    p = np.array([1, 2, 4])
    a, b = scaling.fit(p, 8.0 / p + 1.0)
    assert (a, b) == (pytest.approx(8.0), pytest.approx(1.0))
    # the paper's model through the one-worker time: t1 (1/p + log2(p)/n)
    assert scaling.brent_time(8.0, 1000, 4) == pytest.approx(8.0 * (0.25 + 2 / 1000))
    p_star = scaling.crossover(8.0, 1000, 2.5)  # the first p with 8 (1/p + log2 p / 1000) <= 2.5
    assert p_star == 4.0 and scaling.brent_time(8.0, 1000, 3) > 2.5
    assert scaling.crossover(8.0, 1000, 0.05) == math.inf        # below the model's minimum: never
    assert scaling.crossover(8.0, 1000, 20.0) == 1.0
    a, b = scaling.fit([1, 2], [1.0, 2.0])                        # slower with more threads: no scaling
    assert a == 0 and b > 0
    assert scaling.fit([1], [5.0]) == (5.0, 0.0)


def test_crossovers_prefer_measurement_and_label_extrapolation():
    med = pd.DataFrame([
        dict(seq_len=1000, batch=1, method="bppsa-cpu-fused", threads=1, median_s=4.0),
        dict(seq_len=1000, batch=1, method="bppsa-cpu-fused", threads=2, median_s=2.5),
        dict(seq_len=1000, batch=1, method="sequential", threads=1, median_s=1.5),
        dict(seq_len=1000, batch=1, method="sequential", threads=2, median_s=1.6),
        dict(seq_len=1000, batch=1, method="autograd", threads=1, median_s=3.0),
        dict(seq_len=1000, batch=1, method="autograd", threads=2, median_s=3.1)])
    c = scaling.crossovers(med).set_index("rival")
    # 4 (1/p + log2(p)/1000) <= 1.5 first at p = 3 (1.339; p = 2: 2.004): an extrapolation from the 1-worker time
    assert c.loc["sequential", "crossover_workers"] == 3.0 and c.loc["sequential", "extrapolated"]
    assert c.loc["sequential", "parallel_efficiency"] == pytest.approx(4.0 / (2 * 2.5))  # measured: 80 %
    assert c.loc["autograd", "crossover_workers"] == 2 and not c.loc["autograd", "extrapolated"]


def test_speed_run_tiny_end_to_end():
    rows = speed.run(9, [4], hidden=6, rule=TINY, backends=("cpu", "torch"))
    df = pd.DataFrame(rows)
    compiled = speed.compiled_forward_here(*speed.setup("rnn", 4, 0, torch.float32, 9, 6)[:2])
    steps = {"step-autograd", "step-bppsa-cpu-fused", "step-bppsa-torch-fused"}
    steps |= {"step-bppsa-cpu-fused-compiled", "step-bppsa-torch-fused-compiled"} if compiled else set()
    assert set(df["method"]) == {"autograd", "sequential", "bppsa-cpu-fused", "bppsa-torch-fused", "scan-cpu",
                                 "scan-cpu-chain", "scan-torch", "scan-sequential", "scan-linear-torch"} | steps
    assert (df.groupby("method")["iter"].nunique() == 6).all()
    # the paper's comparisons run torch's forward; only the -compiled variants run the backend's own
    forward = df.dropna(subset=["forward"]).groupby("method")["forward"].unique().map(list).to_dict()
    assert all(f == (["auto"] if m.endswith("-compiled") else ["torch"]) for m, f in forward.items()), forward
    assert set(forward) == set(df.loc[df["group"] != "scan", "method"])
    step = df[df["group"] == "step"]
    assert set(step["phase"]) >= {"forward", "backward"}  # the whole step: its forward is timed too
    assert step["forward_sliced"].between(0, 1).all()
    s = speed.summary(df)
    want = {"autograd / bppsa-cpu-fused", "sequential / bppsa-cpu-fused", "scan-sequential / scan-cpu",
            "scan-sequential / scan-cpu-chain", "step-autograd / step-bppsa-cpu-fused"}
    if compiled:
        want |= {"step-autograd / step-bppsa-cpu-fused-compiled",
                 "step-bppsa-cpu-fused / step-bppsa-cpu-fused-compiled"}
    assert want <= set(s.ratio)
    assert (s["median"] > 0).all() and (s["ci_low"] <= s["median"]).all() and (s["median"] <= s["ci_high"]).all()
    # step_batches: the step group on its own batch sizes, the others on theirs
    df = pd.DataFrame(speed.run(9, [4], hidden=6, rule=TINY, backends=("cpu",), groups=("backward", "step"),
                                step_batches=[3]))
    assert df.groupby("group")["batch"].unique().map(list).to_dict() == {"backward": [4], "step": [3]}


def test_the_step_summary_pairs_each_variant_with_autograd_and_the_compiled_with_its_twin():
    n = 10
    auto = [6.0 + 0.01 * i for i in range(n)]
    df = pd.DataFrame(
        _rows(16, "step", "step-autograd", [a / 2 for a in auto], "forward") + _rows(16, "step", "step-autograd",
                                                                                    [a / 2 for a in auto])
        + _rows(16, "step", "step-bppsa-cpu-fused", [a / 4 for a in auto], "forward")  # a step 2x faster
        + _rows(16, "step", "step-bppsa-cpu-fused", [a / 4 for a in auto])
        + _rows(16, "step", "step-bppsa-cpu-fused-compiled", [a / 40 for a in auto], "forward")  # its forward 10x
        + _rows(16, "step", "step-bppsa-cpu-fused-compiled", [a / 4 for a in auto]))
    s = speed.summary(df).set_index("ratio")
    assert list(s.index) == ["step-autograd / step-bppsa-cpu-fused", "step-autograd / step-bppsa-cpu-fused-compiled",
                             "step-bppsa-cpu-fused / step-bppsa-cpu-fused-compiled"]
    assert s.loc["step-autograd / step-bppsa-cpu-fused", "median"] == pytest.approx(2.0)  # forward + backward
    assert s.loc["step-autograd / step-bppsa-cpu-fused-compiled", "median"] == pytest.approx(1 / 0.275)
    assert s.loc["step-bppsa-cpu-fused / step-bppsa-cpu-fused-compiled", "median"] == pytest.approx(0.5 / 0.275)


def test_a_step_whose_gradients_are_wrong_is_not_timed(monkeypatch):
    from bppsa.models.recurrent import RecurrentClassifier

    real = RecurrentClassifier.bppsa_step

    def wrong(self, x, y, *a, **k):
        loss = real(self, x, y, *a, **k)
        self.head.bias.grad.mul_(1.01)
        return loss

    monkeypatch.setattr(RecurrentClassifier, "bppsa_step", wrong)
    net, x, y = speed.setup("rnn", 4, 0, torch.float32, 9, 6)
    with pytest.raises(RuntimeError, match="step-bppsa-cpu-fused: its gradients differ from autograd's"):
        speed.step_methods(net, x, y, ("cpu",))


def _mfcc_file(path, N=4, T=13, F=6, classes=11):
    rng = np.random.default_rng(0)
    np.savez(path, X=rng.standard_normal((N, T, F)).astype(np.float32), y=rng.integers(0, classes, N),
             classes=np.array([f"c{i}" for i in range(classes)]), source=np.array("test"))
    return path


def test_speed_runs_the_gru_on_a_dataset(tmp_path):
    """The GRU's speed benchmark reads its batches from an MFCC file; its sequential rival and BPPSA run the
    GRU's factored chain; the GRU has no paper layout and needs --data."""
    data = _mfcc_file(tmp_path / "mfcc.npz")
    rows = speed.run(None, [3], hidden=6, rule=TINY, backends=("cpu",), model="gru", data=str(data))
    df = pd.DataFrame(rows)
    net, x, _ = speed.setup("gru", 3, 0, torch.float32, data=str(data))
    compiled = {"step-bppsa-cpu-fused-compiled"} if speed.compiled_forward_here(net, x) else set()
    assert set(df["method"]) == {"autograd", "sequential", "bppsa-cpu-fused", "scan-cpu", "scan-cpu-chain",
                                 "scan-sequential", "scan-linear-torch", "step-autograd",
                                 "step-bppsa-cpu-fused"} | compiled
    assert set(df["model"]) == {"gru"} and set(df["seq_len"]) == {13} and set(df["input_size"]) == {6}
    assert set(df.loc[df["method"] == "sequential", "backend"]) == {"cpu-sequential"}
    with pytest.raises(ValueError, match="--data"):
        speed.run(None, [3], model="gru")
    assert main(["speed", "--device", "cpu", "--model", "gru", "--data", str(data), "--layouts", "paper",
                 "--out", str(tmp_path / "x.csv")]) == 2


def test_scan_methods_refuse_a_wrong_scan(monkeypatch):
    from bppsa.backends import cpu

    monkeypatch.setattr(cpu.CpuBackend, "scan", lambda self, g, J, L_m=None: scan.blelloch_scan(g, J, L_m) * 1.01)
    torch.manual_seed(0)
    from bppsa.models.rnn import RNNClassifier

    x, y = speed.bitstream_batch(9, 4, 0, torch.float32)
    with pytest.raises(RuntimeError, match="scan-cpu disagrees"):
        speed.scan_methods(RNNClassifier(hidden=6), x, y, ("cpu",))


def test_commands_write_csvs_and_figure(tmp_path):
    rule = ["--warmup", "0", "--min-iters", "2", "--max-iters", "2", "--min-seconds", "0"]
    sp, rf, sc = tmp_path / "speed.csv", tmp_path / "roofline.csv", tmp_path / "scaling.csv"
    argv = ["speed", "--device", "cpu", "--seq-len", "9", "--batches", "4", "--hidden", "6", *rule, "--out", str(sp)]
    assert main(argv) == 0
    assert main(["roofline", "--device", "cpu", "--seq-len", "9", "--batches", "4", "--hidden", "6", "--gemm-n", "64",
                 "--copy-mib", "1", *rule, "--out", str(rf)]) == 0
    roof = pd.read_csv(rf)
    assert set(roof["method"]) == {"scan-cpu", "scan-cpu-chain", "scan-torch", "scan-sequential"}
    assert (roof["peak_gflops"] > 0).all() and (roof["copy_gbs"] > 0).all() and (roof["x_bound"] > 0).all()
    assert main(["scaling", "--device", "cpu", "--seq-lens", "9", "--batches", "4", "--hidden", "6",
                 "--max-threads", "2", *rule, "--out", str(sc)]) == 0
    df = pd.read_csv(sc)
    assert set(df["threads"]) == {1, 2}
    fig, cross = tmp_path / "fig.png", tmp_path / "cross.csv"
    assert main(["plot", "cpu_scaling", "--input", str(sc), "--out", str(fig), str(cross)]) == 0
    assert fig.read_bytes()[:4] == b"\x89PNG" and fig.stat().st_size > 10_000
    assert set(pd.read_csv(cross)["rival"]) == {"sequential", "autograd"}
    assert not list(tmp_path.glob("*.tmp*"))


def test_speed_refuses_a_gpu_device(capsys):
    assert main(["speed", "--device", "cuda", "--out", "x.csv"]) == 2


def test_schema_names_a_bad_scaling_key(tmp_path):
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["rnn"]["scaling"]["max_seconds"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(path),
                        "--directory", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "max_seconds" in r.stdout + r.stderr


def test_default_workflow_lists_roofline_and_scaling(tmp_path):
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "2", "--directory", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    for model in ("rnn", "gru"):
        for target in (f"{model}/roofline.csv", f"{model}/scaling.csv", f"fig_scaling_{model}.png",
                       f"{model}/speed.csv"):
            assert target in out
    assert "--model gru --data data/irmas/mfcc_l.npz" in out  # the GRU's benchmarks read MFCC set L
