"""The GRU's BPPSA backward (Eq. 11 + scan) against autograd, and the Fig 9 / Fig 13 plumbing."""
from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch

from bppsa.backends import get_backend
from bppsa.jacobians.gru import gru_gates, gru_jacobians_t
from bppsa.models import build
from bppsa.models.gru import GRUClassifier
from bppsa.precision import ieee_fp32

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
PARAMS = ["cell.weight_ih_l0", "cell.weight_hh_l0", "cell.bias_ih_l0", "cell.bias_hh_l0", "head.weight", "head.bias"]


def _pair(T, B, I, dtype, seed=0, hidden=20):
    torch.manual_seed(seed)
    ref = build("gru", I, hidden, 11).to(dtype)
    got = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, B, I, generator=g).to(dtype)
    y = torch.randint(0, 11, (B,), generator=g)
    return ref, got, x, y


def _rel_errors(ref, got) -> dict[str, float]:
    out = {}
    for (name, p), (_, q) in zip(ref.named_parameters(), got.named_parameters()):
        assert q.grad is not None, f"BPPSA left no gradient for {name}"
        scale = p.grad.abs().max().item()
        out[name] = (q.grad - p.grad).abs().max().item() / (scale if scale > 0 else 1.0)
    return out


CASES = [(T, B, I) for T, B in [(1, 1), (2, 5), (3, 16), (17, 1), (17, 5), (17, 16), (259, 1), (259, 5), (259, 16)]
         for I in [(12, 24, 38)[(T + B) % 3]]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T,B,I", CASES)
def test_bppsa_step_matches_autograd(T, B, I, dtype):
    ref, got, x, y = _pair(T, B, I, dtype, seed=T * 31 + B)
    loss_ref = ref.baseline_step(x, y)
    loss_got = got.bppsa_step(x, y, get_backend("torch"))
    assert torch.allclose(loss_ref, loss_got, rtol=0, atol=TOL[dtype])
    errs = _rel_errors(ref, got)
    assert set(errs) == set(PARAMS)
    assert max(errs.values()) <= TOL[dtype], errs
    if T > 1:  # the recurrent weights receive real gradient (not a vacuous 0 == 0)
        assert ref.cell.weight_hh_l0.grad.abs().max() > 0


@pytest.mark.parametrize("L_m", [0, 2, None])
def test_heterogeneous_and_linear_scans_are_exact(L_m):
    ref, got, x, y = _pair(100, 4, 24, torch.float64, seed=3)
    ref.baseline_step(x, y)
    got.bppsa_step(x, y, get_backend("torch"), L_m=L_m)
    assert max(_rel_errors(ref, got).values()) <= 1e-10


def test_jacobian_is_eq_11_against_autograd():
    """Each J[k] is (∂h_t/∂h_{t-1})ᵀ for t = T - k, per sample, from autograd on one GRUCell step."""
    torch.manual_seed(0)
    T, B, I, H = 5, 3, 7, 6
    m = GRUClassifier(I, hidden=H).double()
    x = torch.randn(T, B, I, dtype=torch.float64)
    with torch.no_grad():
        h, _ = m.cell(x)
        J = m.jacobians_t(x, h, "fused", get_backend("torch"))
    assert J.shape == (T, B, H, H)
    cell = torch.nn.GRUCell(I, H).double()
    with torch.no_grad():
        for a, b in [("weight_ih", "weight_ih_l0"), ("weight_hh", "weight_hh_l0"), ("bias_ih", "bias_ih_l0"),
                     ("bias_hh", "bias_hh_l0")]:
            getattr(cell, a).copy_(getattr(m.cell, b))
    hp = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
    for t in range(T):
        for b in range(B):
            jac = torch.autograd.functional.jacobian(lambda hh, t=t, b=b: cell(x[t, b:b + 1], hh[None])[0], hp[t, b])
            torch.testing.assert_close(J[T - 1 - t, b], jac.t(), rtol=0, atol=1e-12)


def test_recomputed_gates_reproduce_the_hidden_states():
    torch.manual_seed(1)
    m = GRUClassifier(12)
    x = torch.randn(30, 4, 12)
    with torch.no_grad():
        h, _ = m.cell(x)
        c = m.cell
        g = gru_gates(x, h, c.weight_ih_l0, c.weight_hh_l0, c.bias_ih_l0, c.bias_hh_l0)
    torch.testing.assert_close((1 - g.z) * g.n + g.z * g.hp, h, rtol=0, atol=1e-6)
    J = gru_jacobians_t(g, c.weight_hh_l0)
    assert J.is_contiguous()  # the scan's strided matmuls rely on it for speed


def test_only_the_fused_layout_and_no_gate_cache_left_behind():
    ref, got, x, y = _pair(8, 2, 12, torch.float64)
    with pytest.raises(ValueError, match="GRU has no Jacobian layout 'paper'"):
        got.bppsa_step(x, y, get_backend("torch"), layout="paper")
    got.zero_grad()
    loss = got.bppsa_step(x, y, get_backend("torch"))
    # nothing of the step outlives it: no graph behind the loss, no tensor kept on the model or its layer
    assert loss.grad_fn is None and not loss.requires_grad
    for m in got.modules():
        assert not [k for k, v in vars(m).items() if torch.is_tensor(v)], type(m).__name__


def test_bppsa_and_baseline_train_identically():
    """A few Adam steps: the same weights and losses (the curves of Fig 13 must overlap in loss)."""
    ref, got, _, _ = _pair(1, 1, 12, torch.float64, seed=5)
    opt_r = torch.optim.Adam(ref.parameters(), lr=3e-3)
    opt_g = torch.optim.Adam(got.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(9)
    be = get_backend("torch")
    for _ in range(5):
        x = torch.randn(40, 8, 12, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 11, (8,), generator=gen)
        opt_r.zero_grad()
        opt_g.zero_grad()
        lr_, lg = ref.baseline_step(x, y), got.bppsa_step(x, y, be)
        assert abs(lr_.item() - lg.item()) <= 1e-10
        opt_r.step()
        opt_g.step()
    for p, q in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch", "cupy", "cupy-factored"])
def test_gpu_backends_match_autograd(backend):
    if backend.startswith("cupy"):
        pytest.importorskip("cupy")
    ref, got, x, y = _pair(259, 16, 38, torch.float32)
    ref, got, x, y = ref.cuda(), got.cuda(), x.cuda(), y.cuda()
    with ieee_fp32():  # torch 2.13's cuDNN RNNs default to TF32 (~1e-3), which could not judge 1e-4
        ref.baseline_step(x, y)
        got.bppsa_step(x, y, get_backend(backend, torch.device("cuda")))
    assert max(_rel_errors(ref, got).values()) <= 1e-4


# -- Fig 9 / Fig 13 from tidy CSV rows ---------------------------------------------------------------
def _bench_rows(device, seq_len, batch, base, bppsa, iters=7):
    """Rows as `bppsa bench` writes them: every variant of one configuration, paired by round."""
    rows = []
    for variant, phases in (("baseline", base), ("bppsa-fused", bppsa)):
        for mode in ("full", "nobp"):
            for i in range(iters):
                for ph, sec in phases.items():
                    if mode == "nobp" and ph not in ("forward", "jacobian"):
                        continue
                    rows.append(dict(variant=variant, mode=mode, iter=i, phase=ph, seconds=sec * (1 + 0.01 * i),
                                     method=variant.split("-")[0], layout=variant[6:] if "-" in variant else "",
                                     backend="torch" if "-" in variant else "autograd", noisy=False,
                                     profile="test", device=device, model="gru", seq_len=seq_len, batch=batch,
                                     data="synthetic IRMAS stand-in", reference="baseline", conf=0.95,
                                     noisy_threshold=0.1, stopped_by="stable", rounds=iters))
    return rows


def _summaries(folder, bench):
    from bppsa.analysis import speedups

    speedups.speedups(bench).to_csv(folder / "speedups.csv", index=False)
    speedups.latency(bench).to_csv(folder / "latency.csv", index=False)


def test_fig_9_breakdown_arithmetic_and_figures(tmp_path):
    from bppsa.plots.gru import breakdown, draw

    base = {"forward": 1.0, "backward": 2.5, "optimizer": 0.5}
    bp = {"forward": 0.8, "jacobian": 0.4, "backward": 0.7, "optimizer": 0.5}
    for dev in ("cpu", "some-gpu"):
        d = tmp_path / "results" / dev / "gru"
        d.mkdir(parents=True)
        _summaries(d, pd.DataFrame(_bench_rows(dev, 259, 16, base, bp) + _bench_rows(dev, 1034, 64, base, bp)))
        curves = [dict(epoch=e, wall_clock_s=e * 1.5, loss=2.4 - 0.1 * e, accuracy=0.1 * e, steps=10, profile="test",
                       method=m, layout="fused" if m == "bppsa" else "", seq_len=T, batch=16, lr=3e-3, samples=220,
                       data="synthetic IRMAS stand-in") for e in (1, 2, 3) for m in ("baseline", "bppsa")
                  for T in (259, 517)]
        pd.DataFrame(curves).to_csv(d / "curve_x.csv", index=False)
    from bppsa.analysis.results import load_all

    results = tmp_path / "results"
    b = breakdown(load_all(results, "gru", "latency.csv"), load_all(results, "gru", "speedups.csv"))
    assert len(b) == 4 and set(b["set"]) == {"S", "L"}
    row = b.iloc[0]
    med = 1.03  # the median of the 7 rounds' factors 1.00 ... 1.06
    assert row["base_FP"] == pytest.approx(1.0 * med)
    assert row["base_BP"] == pytest.approx(3.0 * med)  # backward + optimizer
    assert row["FO"] == pytest.approx(0.4 * med)
    # paired per-round ratios: the common factor cancels exactly
    assert row["bp_speedup"] == pytest.approx(3.0 / 1.2)
    assert row["bp_speedup_low"] == pytest.approx(3.0 / 1.2) == row["bp_speedup_high"]
    assert row["overall_speedup"] == pytest.approx(4.0 / 2.4)
    outs = [tmp_path / "figs" / name for name in ("fig_9.png", "fig_13.png", "fig_9_data.csv")]
    draw(tmp_path / "results", [], outs)
    for p in outs:
        assert p.exists() and p.stat().st_size > 0
    table = pd.read_csv(tmp_path / "figs" / "fig_9_data.csv")
    assert set(table["data"]) == {"synthetic IRMAS stand-in"}


def test_cli_refuses_a_layout_the_model_lacks_before_any_work(capsys):
    from bppsa.cli import main

    rc = main(["verify", "--model", "gru", "--layout", "paper", "--seq-len", "3", "--batch", "2", "--device", "cpu"])
    assert rc == 2
    assert "GRU has no Jacobian layout 'paper' (it has: fused)" in capsys.readouterr().err
