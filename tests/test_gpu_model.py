"""The GPU cost model (``bppsa gpu-model``): counts from the launch plan, the prediction, the command line."""
from __future__ import annotations

import json

import pytest

from bppsa.backends.cuda import cost_model, plan
from bppsa.cli import main


def test_fill_launch_counts_by_hand():
    # T = 2, B = 1, H = 2, paper layout: 4 Jacobians of 2 x 2 written (16), h read (4), W_hh read (4);
    # 1 - h² on the 2 diagonal elements of each of the 2 diagonal Jacobians, two FLOP each.
    launch = plan.rnn_jacobians_launch(2, 1, 2, "paper")
    assert (launch.moved, launch.flop) == (16 + 4 + 4, 2 * 2 * 2)
    fused = plan.rnn_jacobians_launch(2, 1, 2, "fused")
    assert (fused.moved, fused.flop) == (8 + 4 + 4, 3 * 8)


def test_scan_launch_flop_by_hand():
    # N = 4 positions, B = 1, H = 2: level 0 has the spine pair (mv, 2H² = 8) and one mm pair (2H³ = 16),
    # level 1 the spine pair (mv); the down-sweep's only non-spine pair is level 0's (mv).
    _, launches = plan.scan_plan(4, 1, 2)
    assert [(l.kernel, l.flop) for l in launches] == [
        ("bppsa_up_sweep", 8 + 16), ("bppsa_up_sweep", 8), ("bppsa_down_sweep", 0), ("bppsa_down_sweep", 8)]


def test_totals_are_the_steps_sums():
    st = cost_model.steps("faithful", "rnn", 100, 4, 20, 1)
    r = cost_model.predict("faithful", "rnn", 100, 4, 20, 1, 4, cost_model.GPUS["v100"])
    assert r["bytes"] == 4 * sum(s.moved for s in st)
    assert r["flop"] == sum(s.flop for s in st)
    assert r["launches"] == sum(s.kernels for s in st)
    assert r["dtype"] == "float32" and r["gpu"] == "V100 SXM2"


def test_prediction_follows_the_peaks():
    args = ("faithful", "rnn", 3000, 16, 20, 1, 4)
    slow = cost_model.predict(*args, cost_model.parse_gpu("900:15.7:7.8:80"), launch_s=0)
    fast = cost_model.predict(*args, cost_model.parse_gpu("1800:15.7:7.8:80"), launch_s=0)
    assert fast["predicted_s"] < slow["predicted_s"]  # the faithful scan is memory-bound at H = 20
    # a GPU with more SMs than a launch has threads to fill is charged for the idle part
    wide = cost_model.predict(*args, cost_model.parse_gpu("900:15.7:7.8:8000"), launch_s=0)
    assert wide["predicted_s"] > slow["predicted_s"]
    # launch overhead: each kernel pays it
    with_launch = cost_model.predict(*args, cost_model.parse_gpu("900:15.7:7.8:80"), launch_s=1e-5)
    assert with_launch["predicted_s"] == pytest.approx(slow["predicted_s"] + 1e-5 * slow["launches"])


@pytest.mark.parametrize("spec,name", [("H100", "H100 SXM5"), ("rtx-2080-ti", "RTX 2080 Ti"),
                                       ("a100", "A100 SXM4 80 GB")])
def test_gpu_names(spec, name):
    assert cost_model.parse_gpu(spec).name == name


def test_gpu_numbers_and_errors():
    g = cost_model.parse_gpu("1000:20")
    assert (g.bandwidth_GBps, g.fp32_TFLOPs, g.fp64_TFLOPs, g.sms) == (1000, 20, 10, 0)
    for bad in ("k80", "1000", "1000:x", "1000:-1", "1:2:3:4:5"):
        with pytest.raises(ValueError, match="h100"):
            cost_model.parse_gpu(bad)


def test_factored_moves_a_tenth_and_predicts_half_a_millisecond_at_the_papers_largest_shape(capsys):
    rc = main(["gpu-model", "--seq-len", "30000", "--batch", "16", "--hidden", "20", "--dtype", "float32",
               "--gpu", "h100", "--json"])
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["layout"] for r in rows] == ["faithful", "factored"]
    for r in rows:
        assert {"layout", "bytes", "flop", "launches", "predicted_s"} <= set(r)
    faithful, factored = rows
    assert factored["bytes"] <= faithful["bytes"] / 10
    assert factored["predicted_s"] <= 0.5e-3 < faithful["predicted_s"]


@pytest.mark.parametrize("cell,I", [("rnn", 1), ("gru", 12)])
def test_factored_never_writes_the_jacobians(cell, I, monkeypatch):
    # at chunks of 128 steps, where the aggregates (H x H per chunk) are few: the model's own chunk size trades
    # bytes for latency (at C = 8 the GRU's middle scan moves more than the factors)
    monkeypatch.setattr(cost_model, "chunk_size", lambda *a, **kw: 128)
    T, B, H = 1034, 16, 20
    dense = T * B * H * H * 8  # one pass over the dense fp64 Jacobians
    faithful = cost_model.predict("faithful", cell, T, B, H, I, 8, cost_model.GPUS["a100"])
    factored = cost_model.predict("factored", cell, T, B, H, I, 8, cost_model.GPUS["a100"])
    assert faithful["bytes"] > 5 * dense  # written, then read and written again level by level
    # the factors (and for the GRU its recomputed gates) instead: RNN 2H + I rows a step, GRU 6H + I
    assert factored["bytes"] < (1 if cell == "rnn" else 4) * dense
    assert factored["bytes"] < faithful["bytes"] / (10 if cell == "rnn" else 2.5)


def test_cli_table_and_csv(tmp_path, capsys):
    out = tmp_path / "m.csv"
    rc = main(["gpu-model", "--cell", "gru", "--seq-len", "259,1034", "--batch", "16", "--input-size", "12",
               "--gpu", "all", "--out", str(out)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(cost_model.GPUS) * 2 * len(cost_model.LAYOUTS)
    import pandas as pd

    df = pd.read_csv(out)
    assert len(df) == len(lines) and set(df["layout"]) == set(cost_model.LAYOUTS)


def test_cli_rejects_bad_input(capsys):
    assert main(["gpu-model", "--seq-len", "0"]) != 0
    assert "--seq-len must be >= 1" in capsys.readouterr().err
    assert main(["gpu-model", "--gpu", "k80"]) != 0
    assert "rtx2070" in capsys.readouterr().err


def _bench(backend: str):
    """A bench CSV as `bppsa bench` writes it on a GPU: three iterations of every variant, full mode."""
    import pandas as pd

    rows = []
    times = {"baseline": {"forward": 1e-3, "backward": 30e-3}, "baseline-packed": {"forward": 1e-3, "backward": 40e-3},
             "bppsa-paper": {"forward": 1e-3, "jacobian": 1e-3, "backward": 2e-3},
             "bppsa-fused": {"forward": 1e-3, "jacobian": 0.1e-3, "backward": 0.4e-3}}
    for variant, phases in times.items():
        for it, scale in enumerate((1.0, 1.5, 0.9)):  # medians: scale 1.0
            for phase, s in phases.items():
                rows.append({"variant": variant, "mode": "full", "iter": it, "phase": phase, "seconds": s * scale,
                             "backend": "autograd" if variant.startswith("baseline") else backend,
                             "seq_len": 1000, "batch": 16, "hidden": 20, "input_size": 1, "dtype": "float32"})
            rows.append({**rows[-1], "mode": "nobp", "phase": "forward", "seconds": 99.0})  # never counted
    return pd.DataFrame(rows)


def test_measured_against_the_model(tmp_path, capsys):
    import pandas as pd

    csv = tmp_path / "bench_T1000_B16.csv"
    _bench("cupy-factored").to_csv(csv, index=False)
    out = tmp_path / "measured.csv"
    assert main(["gpu-measured", "--bench", str(csv), "--gpu", "h100", "--out", str(out)]) == 0
    df = pd.read_csv(out).set_index("layout")
    assert set(df.index) == {"faithful", "factored"}
    for layout, seconds in (("faithful", 3e-3), ("factored", 0.5e-3)):
        r = df.loc[layout]
        pred = cost_model.predict(layout, "rnn", 1000, 16, 20, 1, 4, cost_model.GPUS["h100"])
        assert r["measured_s"] == pytest.approx(seconds)
        assert r["predicted_s"] == pytest.approx(pred["predicted_s"])
        assert r["achieved_GBps"] == pytest.approx(pred["bytes"] / seconds / 1e9)
        assert r["flops_fraction"] == pytest.approx(pred["flop"] / seconds / 67e12)
        assert r["speedup_vs_cudnn"] == pytest.approx(30e-3 / seconds)
        assert r["speedup_vs_cudnn_packed"] == pytest.approx(40e-3 / seconds)
    assert "factored (cupy-factored)" in capsys.readouterr().out


def test_measured_needs_the_cuda_kernels(tmp_path, capsys):
    csv = tmp_path / "bench.csv"
    _bench("cupy").to_csv(csv, index=False)  # the fused variant on the faithful kernels: not the factored layout
    assert main(["gpu-measured", "--bench", str(csv), "--gpu", "a100", "--out", str(tmp_path / "m.csv")]) == 0
    import pandas as pd

    assert list(pd.read_csv(tmp_path / "m.csv")["layout"]) == ["faithful"]
    _bench("cpu").to_csv(csv, index=False)
    assert main(["gpu-measured", "--bench", str(csv), "--gpu", "a100", "--out", str(tmp_path / "n.csv")]) != 0
    assert "ran the CUDA kernels" in capsys.readouterr().err
    assert not (tmp_path / "n.csv").exists()


@pytest.mark.parametrize("name,key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", None),
                                      ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", None),
                                      ("NVIDIA GeForce RTX 2080 Ti", "rtx2080ti"), ("Tesla V100-SXM2-16GB", "v100"),
                                      ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L4", None)])
def test_device_names(name, key):
    assert cost_model.key_for_device_name(name) == key


def test_cases_in_one_run(tmp_path):
    """What the workflow's gpu_model rule runs: several cells and sweeps in one CSV."""
    import pandas as pd

    out = tmp_path / "m.csv"
    assert main(["gpu-model", "--case", "rnn/10,30/16/20", "--case", "rnn/1000/2,4,8/20",
                 "--case", "gru/259:38,1034:12/16/20", "--gpu", "h100,v100", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert len(df) == 2 * (2 + 3 + 2) * len(cost_model.LAYOUTS)
    gru = df[df["cell"] == "gru"]
    assert sorted(set(zip(gru["seq_len"], gru["input"]))) == [(259, 38), (1034, 12)]
    assert set(df[df["cell"] == "rnn"]["input"]) == {1}
    for bad in ("lstm/10/16", "rnn/10", "rnn/10/16/20/1"):
        assert main(["gpu-model", "--case", bad, "--out", str(tmp_path / "x.csv")]) != 0
    assert not (tmp_path / "x.csv").exists()


# -- the expected time: latency terms and the shared-load ceiling, held to the H200 run --------------------------
REFERENCE = __import__("pathlib").Path(__file__).resolve().parents[1] / "results" / "reference" / "nvidia-h200"


def _h200_measurements():
    """(layout, cell, T, B, I, measured seconds) of today's kernels on the H200 (2026-11-26): the median over
    iterations of the Jacobian (factor) phase plus the backward phase, as ``bppsa gpu-measured`` takes it, from the
    run's latency CSVs, for every BPPSA variant that ran the CUDA kernels."""
    import pandas as pd

    from bppsa.backends.cuda.cost_model import LAYOUT_OF

    out = []
    for cell, inputs in (("rnn", {}), ("gru", {259: 38, 1034: 12})):
        lat = pd.read_csv(REFERENCE / cell / "latency.csv")
        rows = lat[(lat["mode"] == "full") & (lat["phase"] == "backward")]
        for r in rows.itertuples():
            layout = LAYOUT_OF.get((r.variant, r.backend))
            if layout is not None:
                out.append((layout, cell, int(r.seq_len), int(r.batch), inputs.get(int(r.seq_len), 1), r.median))
    return out


def test_the_h200_run_is_read_whole():
    got = {(lay, cell, T, B) for lay, cell, T, B, _, _ in _h200_measurements()}
    assert got == {("factored", "rnn", 100, 16), ("factored", "rnn", 1000, 16), ("factored", "rnn", 1000, 256),
                   ("factored", "rnn", 30000, 16), ("faithful", "rnn", 100, 16), ("faithful", "rnn", 1000, 16),
                   ("faithful", "rnn", 1000, 256), ("faithful", "rnn", 30000, 16), ("factored", "gru", 259, 64),
                   ("factored", "gru", 1034, 16)}
    import pandas as pd

    # the same numbers gpu_measured.csv holds for the RNN
    gm = pd.read_csv(REFERENCE / "gpu_measured.csv")
    for lay, cell, T, B, _, seconds in _h200_measurements():
        row = gm[(gm["layout"] == lay) & (gm["seq_len"] == T) & (gm["batch"] == B)]
        if cell == "rnn" and len(row):
            assert row["measured_s"].iloc[0] == pytest.approx(seconds)


@pytest.fixture
def planned_as_the_h200_run(monkeypatch):
    """The factored plan as the 2026-11-27 H200 run ran it: the middle phase as the Blelloch kernels (a full tree,
    one launch per level) and factored.cu's down kernel (a block per pair), before issue 41's middle and warp down
    kernels (its sum over the blocks was one torch op; the gradients' reduction kernel costs the host the same launch);
    the chunk size's cache cleared around."""
    orig = plan.factored_plan
    monkeypatch.setattr(plan, "factored_plan",
                        lambda *a, **kw: orig(*a, **{**kw, "L_m": kw.get("L_m") or 64, "warp_down": False}))
    monkeypatch.setattr(cost_model, "GRU_FACTOR_KERNEL", False)  # the GRU's factors by torch's passes
    cost_model.chunk_size.cache_clear()
    yield
    cost_model.chunk_size.cache_clear()


@pytest.mark.parametrize("case", _h200_measurements(), ids=lambda c: f"{c[0]}-{c[1]}-T{c[2]}-B{c[3]}")
def test_expected_time_within_1_5x_of_the_h200_run(case, planned_as_the_h200_run):
    layout, cell, T, B, I, seconds = case
    r = cost_model.predict(layout, cell, T, B, 20, I, 4, cost_model.GPUS["h200"])
    ratio = seconds / r["expected_s"]
    assert 1 / 1.5 <= ratio <= 1.5, (case, r["expected_s"], r["host_s"], r["device_s"])
    assert r["predicted_s"] < seconds  # the floor stays a floor


def test_expected_terms():
    gpu = cost_model.GPUS["h200"]
    args = ("factored", "rnn", 30000, 16, 20, 1, 4, gpu)
    base = cost_model.expected(*args)
    # without host work per launch (a CUDA graph), only the device remains
    graphed = cost_model.expected(*args, host=False)
    assert graphed["host_s"] == 0 and graphed["expected_s"] == pytest.approx(graphed["device_s"])
    assert graphed["expected_s"] < base["expected_s"]
    # the shared-load ceiling binds the up kernel's arithmetic: more loads per FMA, more time; none, less
    assert cost_model.expected(*args, lds_per_fma=8)["device_s"] > base["device_s"]
    assert cost_model.expected(*args, lds_per_fma=0)["device_s"] <= base["device_s"]
    # a GPU of unknown clock has no ceiling: never slower than one with it
    nock = cost_model.Gpu("x", gpu.bandwidth_GBps, gpu.fp32_TFLOPs, gpu.fp64_TFLOPs, gpu.sms, gpu.threads_per_sm)
    assert cost_model.expected("factored", "rnn", 30000, 16, 20, 1, 4, nock)["device_s"] <= base["device_s"]
    # at a small shape the host's time is the backward's time; where every Jacobian is scanned, the device's
    small = cost_model.expected("factored", "rnn", 100, 16, 20, 1, 4, gpu)
    assert small["expected_s"] < small["host_s"] * 1.1 and small["device_s"] < small["host_s"] / 4
    dense = cost_model.expected("faithful", "rnn", 30000, 16, 20, 1, 4, gpu)
    assert dense["device_s"] > 2 * dense["host_s"]
    # the latency term: each block of the factored kernels walks its chunk's steps (the up kernel C - 1 products)
    C = cost_model.chunk_size("rnn", 30000, 16, 20, 1, 4, gpu)
    st = {s.name: s for s in cost_model.steps("factored", "rnn", 30000, 16, 20, 1, 4, gpu)}
    assert st["bppsa_factored_up_rnn"].serial == C - 1 and st["bppsa_factored_up_rnn"].step == "mm"
    # the warp down kernel and the middle kernel: their chains in clocks (assumptions, _down_warp_seconds and
    # _middle_clocks), at least a global load's latency a step of a warp's chunk
    down = st["bppsa_factored_down_warp_rnn"]
    assert down.seconds >= C * cost_model.GLOBAL_LATENCY_S and st["bppsa_factored_middle"].seconds > 0
    assert st["torch.rnn_factors"].serial == 0
