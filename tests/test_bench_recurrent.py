"""The recurrent benchmark loop: the packed baseline, interleaved timing, the untimed warm-up, speedups.csv."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

from bppsa.analysis import speedups
from bppsa.backends import get_backend
from bppsa.bench.protocol import StopRule
from bppsa.bench.recurrent import parse_variant, time_interleaved, train_epochs, warm_up
from bppsa.models import build


@pytest.mark.parametrize("model, T, F", [("rnn", 17, 1), ("gru", 13, 6)])
def test_packed_baseline_gives_the_same_gradients(model, T, F):
    torch.manual_seed(0)
    a = build(model, F, 8, 5).double()
    b = build(model, F, 8, 5).double()
    b.load_state_dict(a.state_dict())
    x, y = torch.randn(T, 4, F, dtype=torch.float64), torch.randint(0, 5, (4,))
    la, lb = a.baseline_step(x, y), b.baseline_step(x, y, packed=True)
    assert torch.allclose(la, lb, rtol=0, atol=1e-12)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-12 * max(1.0, p.grad.abs().max()), n


def test_variant_names():
    assert parse_variant("baseline-packed") == ("baseline", "", True)
    assert parse_variant("bppsa-paper") == ("bppsa", "paper", False)
    with pytest.raises(ValueError, match="unknown variant 'bppsa-diagonal'"):
        parse_variant("bppsa-diagonal")


def _make(seed=0):
    def make():
        torch.manual_seed(seed)
        return build("rnn", 1, 6, 3).double()
    return make


def test_time_interleaved_pairs_every_variant_on_the_same_batches():
    seen = []
    x = torch.randn(11, 4, 1, dtype=torch.float64)
    y = torch.randint(0, 3, (4,))

    def batches(i):
        seen.append(i)
        return x * (1 + i), y

    rule = StopRule(warmup=1, min_iters=6, min_seconds=0, max_iters=6, max_seconds=60)
    rows, m = time_interleaved(_make(), batches, ["baseline", "baseline-packed", "bppsa-fused"], rule,
                               device="cpu", backend=get_backend("torch", torch.device("cpu")), lr=1e-3)
    df = pd.DataFrame(rows)
    assert m.iters == 6 and set(df["iter"]) == set(range(6))
    assert set(zip(df["variant"], df["mode"])) == {(v, mo) for v in ("baseline", "baseline-packed", "bppsa-fused")
                                                  for mo in ("full", "nobp")}
    # 7 rounds (1 warm-up) x 6 methods, each round handing every method batch i
    assert sorted(seen) == sorted([i for i in range(7) for _ in range(6)])
    assert set(df[(df["variant"] == "bppsa-fused") & (df["mode"] == "full")]["phase"]) == {
        "forward", "jacobian", "backward", "optimizer"}
    assert set(df[df["mode"] == "nobp"]["phase"]) <= {"forward", "jacobian"}


def test_warm_up_leaves_the_weights_alone_and_curves_start_equal():
    model = _make()()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(9, 4, 1, dtype=torch.float64), torch.randint(0, 3, (4,))
    warm_up(model, (x, y), "bppsa", lr=0.1, backend=get_backend("torch", torch.device("cpu")))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_training_curves_of_both_methods_agree_after_the_warm_up():
    X, Y = torch.randn(9, 32, 1, dtype=torch.float64), torch.randint(0, 3, (32,))

    def get_batch(idx):
        idx = torch.as_tensor(np.asarray(idx))
        return X[:, idx], Y[idx]

    curves = {}
    for method in ("baseline", "bppsa"):
        be = get_backend("torch", torch.device("cpu")) if method == "bppsa" else None
        curves[method] = list(train_epochs(_make()(), 32, 8, get_batch, method, device="cpu", epochs=3, lr=1e-2,
                                           backend=be))
    for a, b in zip(curves["baseline"], curves["bppsa"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9)


def test_the_compiled_forward_curve_trains_like_the_others_and_only_it_leaves_torchs_forward(tmp_path):
    """`bppsa train --forward auto` (the -compiled variant): the same losses as BPPSA with torch's forward (fp64),
    the layer run with the backend's own forward and the CSV saying which; verify checks either forward."""
    from bppsa.cli import main
    from bppsa.verify import verify

    data = tmp_path / "bits.npz"
    assert main(["make-bitstream", "--seq-len", "11", "--samples", "24", "--seed", "0", "--out", str(data)]) == 0
    common = ["train", "--model", "rnn", "--data", str(data), "--batch", "8", "--hidden", "6", "--epochs", "2",
              "--lr", "1e-2", "--device", "cpu", "--dtype", "float64", "--backend", "cpu"]
    for name, extra in (("torch", []), ("auto", ["--forward", "auto"])):
        assert main([*common, "--method", "bppsa", *extra, "--out", str(tmp_path / f"{name}.csv")]) == 0
    torch_fwd, auto = (pd.read_csv(tmp_path / f"{n}.csv") for n in ("torch", "auto"))
    assert set(torch_fwd["forward"]) == {"torch"} and set(torch_fwd["forward_kernel"]) == {"torch"}
    assert set(auto["forward"]) == {"auto"} and set(auto["forward_kernel"]) <= {"compiled", "torch"}
    assert auto["loss"].to_numpy() == pytest.approx(torch_fwd["loss"].to_numpy(), rel=1e-12)
    assert main([*common, "--method", "baseline", "--forward", "auto", "--out", str(tmp_path / "b.csv")]) != 0
    for forward in ("torch", "auto"):
        r = verify("gru", 13, 3, dtype="float64", backend="cpu", forward=forward)
        assert r["ok"] and r["forward"] == forward


def _bench(ref_full, ref_nobp, var_full, var_nobp):
    """A bench CSV of one configuration whose per-round iteration totals are the given arrays."""
    rows = []
    for v, mode, x in (("baseline", "full", ref_full), ("baseline", "nobp", ref_nobp),
                       ("bppsa-fused", "full", var_full), ("bppsa-fused", "nobp", var_nobp)):
        for i, s in enumerate(x):
            if mode == "full":
                rows += [dict(variant=v, mode=mode, iter=i, phase="forward", seconds=s * 0.25),
                         dict(variant=v, mode=mode, iter=i, phase="backward", seconds=s * 0.75)]
            else:
                rows.append(dict(variant=v, mode=mode, iter=i, phase="forward", seconds=s))
    df = pd.DataFrame(rows)
    return df.assign(model="rnn", device="cpu", profile="t", data="d", seq_len=10, batch=4, reference="baseline",
                     conf=0.95, noisy_threshold=0.1, noisy=False, backend="x", stopped_by="stable",
                     rounds=len(ref_full))


def test_speedups_are_paired_ratios_and_survive_an_outlier():
    load = np.ones(20)
    load[5] = 300.0  # one preempted round slows every method of that round
    sp = speedups.speedups(_bench(4e-3 * load, 1e-3 * load, 1e-3 * load, 0.5e-3 * load)).set_index("phase")
    assert sp.loc["backward", "speedup"] == pytest.approx(4.0)
    assert sp.loc["backward", "ci_low"] == pytest.approx(4.0) == sp.loc["backward", "ci_high"]
    assert sp.loc["iteration", "speedup"] == pytest.approx(4.0)
    assert sp.loc["backward-nobp", "speedup"] == pytest.approx(3e-3 / 0.5e-3)
    assert not sp["noisy"].any() and sp["resolved"].all()
    # the mean, as the paper's tables use it, is what the outlier would have dragged along
    assert math.isfinite(sp.loc["backward", "mean_speedup"])


def test_speedups_refuse_graphed_and_eager_runs_mixed():
    """A graphed run's phases are device time without the host; summed with an eager run's (the same
    configuration keys) they would make a number that is neither."""
    eager = _bench(4e-3 * np.ones(4), 1e-3 * np.ones(4), np.ones(4), np.ones(4)).assign(graphed=False)
    assert len(speedups.speedups(eager))
    with pytest.raises(ValueError, match="mix graphed runs"):
        speedups.speedups(pd.concat([eager, eager.assign(graphed=True)]))


def test_graphed_timing_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device, got 'cpu'"):
        time_interleaved(_make(), lambda i: None, ["baseline"], StopRule(), device="cpu", graphed=True)


def test_nobp_difference_within_the_noise_is_not_resolved():
    rng = np.random.default_rng(0)
    full = 1e-3 * rng.lognormal(0, 0.3, 30)
    nobp = 1e-3 * rng.lognormal(0, 0.3, 30)  # the "backward" is smaller than the noise
    sp = speedups.speedups(_bench(4e-3 * np.ones(30), 1e-3 * np.ones(30), full, nobp)).set_index("phase")
    row = sp.loc["backward-nobp"]
    assert not row["resolved"] and math.isnan(row["speedup"]) and row["noisy"]


def test_latency_has_medians_intervals_and_the_paper_statistics():
    lat = speedups.latency(_bench(np.arange(1, 21) * 1e-3, np.ones(20), np.ones(20), np.ones(20)))
    r = lat[(lat["variant"] == "baseline") & (lat["mode"] == "full") & (lat["phase"] == "iteration")].iloc[0]
    assert (r["median"], r["ci_low"], r["ci_high"]) == pytest.approx((10.5e-3, 6e-3, 15e-3))
    assert r["mean"] == pytest.approx(10.5e-3) and r["n"] == 20 and r["q1"] < r["median"] < r["q3"]


def test_latency_and_speedups_name_the_backend_of_each_variant():
    """The figures' legends and the report name who measured each number from these columns."""
    bench = _bench(4e-3 * np.ones(8), np.ones(8) * 1e-3, 1e-3 * np.ones(8), 0.5e-3 * np.ones(8))
    bench["backend"] = np.where(bench["variant"] == "baseline", "autograd", "cpu")
    lat = speedups.latency(bench)
    assert dict(lat.groupby("variant")["backend"].unique().map(list)) == {"baseline": ["autograd"],
                                                                         "bppsa-fused": ["cpu"]}
    sp = speedups.speedups(bench)
    assert set(sp["backend"]) == {"cpu"} and set(sp["reference_backend"]) == {"autograd"}


def _sp(points, noisy=()):
    return pd.DataFrame([dict(model="rnn", variant="bppsa-fused", reference="baseline", seq_len=T, batch=B,
                              phase="backward", speedup=s, ci_low=s * 0.9, ci_high=s * 1.1, noisy=(T, B) in noisy,
                              resolved=True) for (T, B), s in points.items()])


def test_compare_runs_accepts_agreement_or_a_flag_and_nothing_else():
    quiet = _sp({(10, 16): 1.0, (100, 16): 2.0, (1000, 16): 4.0})
    loaded = _sp({(10, 16): 1.2, (100, 16): 0.5, (1000, 16): 0.4}, noisy={(100, 16)})
    m = speedups.compare_runs(quiet, loaded).set_index("seq_len")
    assert m.loc[10, "agree"] and m.loc[10, "ok"]            # within 25 %
    assert not m.loc[100, "agree"] and m.loc[100, "ok"]      # off, but flagged noisy
    assert not m.loc[1000, "ok"]                             # off and unflagged


def test_isolated_points_along_a_sweep():
    sp = _sp({(10, 16): 1.0, (30, 16): 0.1, (100, 16): 1.2, (300, 16): 2.0})
    iso = speedups.isolated_points(sp)
    assert list(iso["seq_len"]) == [30]
    assert speedups.isolated_points(_sp({(10, 16): 1.0, (30, 16): 0.1, (100, 16): 1.2}, noisy={(30, 16)})).empty
    # a steep monotone trend (2.1x and 2.4x steps, as Fig 8e's B sweep on a CPU) is not a spike
    assert speedups.isolated_points(_sp({(10, 16): 1.36, (30, 16): 0.649, (100, 16): 0.27})).empty


def test_an_interval_missing_for_lack_of_samples_counts_as_noisy():
    sp = speedups.speedups(_bench(4e-3 * np.ones(4), 1e-3 * np.ones(4), 1e-3 * np.ones(4), 0.5e-3 * np.ones(4)))
    assert sp["noisy"].all() and sp["ci_low"].isna().all()


def test_phases_nest_and_the_bppsa_step_reports_its_jacobians_inside_the_backward():
    """A phase opened inside another counts only in itself (the phases add up to the whole), and the BPPSA step
    through the bppsa.nn layer times its chain's construction as ``jacobian`` inside ``backward``:
    ``backward_seconds`` is the step's whole backward, whichever backend runs it."""
    import time

    from bppsa.bench.timing import PhaseTimer, backward_seconds, timed

    timer = PhaseTimer(torch.device("cpu"))
    t_all, _ = timed(lambda: _nested(timer))
    ph = timer.collect()
    assert set(ph) == {"outer", "inner"} and ph["inner"] >= 0.02 and ph["outer"] >= 0.01
    assert ph["outer"] + ph["inner"] == pytest.approx(t_all, rel=0.1)
    assert timer.collect() == {}
    secs, out = timed(lambda: time.sleep(0.01) or 7)
    assert out == 7 and secs >= 0.01

    torch.manual_seed(0)
    net = build("rnn").double()
    x, y = torch.rand(50, 3, 1, dtype=torch.float64).round(), torch.tensor([1, 2, 3])
    for be in (get_backend("torch"), get_backend("cpu")):
        net.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        net.bppsa_step(x, y, be, phase=timer.phase)
        whole = time.perf_counter() - t0
        ph = timer.collect()
        assert set(ph) == {"forward", "jacobian", "backward"}
        assert 0 < ph["jacobian"] < backward_seconds(ph) and ph["backward"] > 0
        assert sum(ph.values()) == pytest.approx(whole, rel=0.25)
        assert all(p.grad is not None for p in net.parameters())


def _nested(timer):
    import time

    with timer.phase("outer"):
        time.sleep(0.01)
        with timer.phase("inner"):
            time.sleep(0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("model, T, F", [("rnn", 37, 1), ("gru", 29, 6)])
def test_gpu_graphed_timing_replays_every_phase_and_matches_eager(model, T, F):
    """Every variant (cuDNN's default and per-step algorithms, BPPSA on the factored kernels) captured phase by
    phase in CUDA graphs: each full-mode graph is checked against an eager step inside (the dtype's tolerance,
    or it raises); the phases are the eager run's, the jacobian phase inside the backward's graph."""
    dev = torch.device("cuda")

    def make():
        torch.manual_seed(0)
        return build(model, F, 20, 3).to(dev)

    x = torch.randn(T, 5, F, device=dev)
    y = torch.randint(0, 3, (5,), device=dev)
    rule = StopRule(warmup=1, min_iters=3, min_seconds=0, max_iters=3, max_seconds=60)
    variants = ["baseline", "baseline-packed", "bppsa-fused"]
    rows, m = time_interleaved(make, lambda i: (x * (1 + i), y), variants, rule, device=dev,
                               backend=get_backend("auto", dev), lr=1e-3, graphed=True)
    df = pd.DataFrame(rows)
    assert m.iters == 3 and (df["seconds"] > 0).all()
    full = df[df["mode"] == "full"]
    for v in variants:
        assert set(full[full["variant"] == v]["phase"]) == {"forward", "backward", "optimizer"}, v
    assert set(df[df["mode"] == "nobp"]["phase"]) <= {"forward", "jacobian"}
