"""`bppsa paper-shapes`: the extreme shapes come from the config, the GPU memory formula matches the bytes the
code really allocates, and the command runs end to end at tiny shapes."""
import copy
import math

import pandas as pd
import pytest
import torch
import yaml

from bppsa.analysis import gpu_hours
from bppsa.backends import TorchBackend
from bppsa.backends.cuda import memory_model
from bppsa.bench import preflight
from bppsa.cli import main
from bppsa.jacobians.gru import gru_gate_grads, gru_gates
from bppsa.jacobians.recurrent import rnn_grad_preact
from bppsa.models import build
from bppsa.models.vgg import VGG11, feature_shapes

PAPER = "config/paper.yaml"


def _tiny_config(path):
    cfg = preflight.load_config(PAPER)
    cfg["rnn"].update(seq_lens=[5, 13], batch_at_seq_len=3, batches=[2, 4], seq_len_at_batch=9)
    cfg["gru"].update(sets=["s"], batches=[2, 3])
    cfg["vgg11"].update(width=0.0625, batch_size=3)
    path.write_text(yaml.safe_dump(cfg))
    return cfg


def test_jobs_are_read_from_the_config():
    cfg = preflight.load_config(PAPER)
    jobs = {j["name"]: j for j in preflight.extreme_jobs(cfg, PAPER)}
    rnn = cfg["rnn"]
    for layout in rnn["layouts"]:
        long, wide = jobs[f"rnn-{layout} max seq_len"], jobs[f"rnn-{layout} max batch"]
        assert (long["seq_len"], long["batch"]) == (max(rnn["seq_lens"]), rnn["batch_at_seq_len"])
        assert (wide["seq_len"], wide["batch"]) == (rnn["seq_len_at_batch"], max(rnn["batches"]))
        assert long["hidden"] == rnn["hidden"] and long["dtype"] == cfg["dtype"]
    gru = next(j for j in jobs.values() if j["model"] == "gru")
    assert (gru["seq_len"], gru["input_size"], gru["batch"]) == (1034, 12, max(cfg["gru"]["batches"]))
    vgg = jobs["vgg11 train step"]
    assert (vgg["width"], vgg["batch"]) == (cfg["vgg11"]["width"], cfg["vgg11"]["batch_size"])
    assert {j["network"] for j in jobs.values() if j["kind"] == "vgg-flops"} == set(cfg["vgg11"]["flops"]["networks"])


def test_a_missing_key_is_named():
    cfg = preflight.load_config(PAPER)
    del cfg["rnn"]["seq_len_at_batch"]
    with pytest.raises(ValueError, match="'rnn.seq_len_at_batch'"):
        preflight.extreme_jobs(cfg, "x.yaml")
    cfg = preflight.load_config(PAPER)
    cfg["gru"]["batches"] = []
    with pytest.raises(ValueError, match="'gru.batches'"):
        preflight.extreme_jobs(cfg, "x.yaml")


def _storage_bytes(*tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _cupy_scan_allocations(monkeypatch, g, J):
    """Run CupyBackend.scan on CPU tensors with the CUDA launches stubbed out; return the bytes it allocates
    besides J (what it hands to the kernels: S and P)."""
    from bppsa.backends import cuda
    from bppsa.backends.cuda import runtime

    seen = []
    monkeypatch.setattr(runtime, "import_cupy", lambda: None)
    monkeypatch.setattr(runtime, "check_cuda", lambda dtype, *t: torch.device("cpu"))
    monkeypatch.setattr(runtime, "smem_optin", lambda dev: 1 << 30)
    monkeypatch.setattr(runtime, "launch", lambda *a, **k: None)
    monkeypatch.setattr(runtime, "pointer", lambda t: seen.append(t) or t)
    monkeypatch.setattr(runtime, "stream", lambda dev: None)
    be = cuda.CupyBackend()
    P = be.scan(g, J)
    J_seen, S, P_seen = seen[:3]
    assert J_seen is J and P_seen is P
    return S.nbytes + P.nbytes, be


@pytest.mark.parametrize("model,layout", [("rnn", "paper"), ("rnn", "fused"), ("gru", "fused")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recurrent_formula_matches_real_allocations(model, layout, dtype, monkeypatch):
    T, B, H, I, C = 11, 3, 6, (1 if model == "rnn" else 4), 7
    s = dtype.itemsize
    m = memory_model.recurrent_gpu_bytes(model, T, B, H, I, C, layout, s)
    net = build(model, I, H, C).to(dtype)
    x = torch.randn(T, B, I, dtype=dtype)
    y = torch.randint(0, C, (B,))
    assert m["bppsa"]["parameters"] == sum(p.nbytes for p in net.parameters())
    assert m["bppsa"]["inputs"] == x.nbytes + y.nbytes
    with torch.no_grad():
        h, _ = net.cell(x)
    assert m["bppsa"]["hidden_states"] == h.nbytes
    torch.set_grad_enabled(False)  # as bppsa_step builds them (restored by the finally below)
    try:
        _check_bppsa_terms(m, model, layout, monkeypatch, net, x, h, B, H, dtype)
    finally:
        torch.set_grad_enabled(True)
    opt = torch.optim.Adam(net.parameters())
    net.baseline_step(x, y)
    opt.step()
    assert m["bppsa"]["optimizer"] == sum(st[k].nbytes for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert m["bppsa"]["gradients"] == sum(p.grad.nbytes for p in net.parameters())
    assert m["baseline"]["output"] == h.nbytes and m["baseline"]["input_grad"] == x.nbytes


def _check_bppsa_terms(m, model, layout, monkeypatch, net, x, h, B, H, dtype):
    cell = net.cell
    if model == "rnn":
        J = TorchBackend().rnn_jacobians_t(h, cell.weight_hh_l0, layout)
    else:
        gates = gru_gates(x, h, cell.weight_ih_l0, cell.weight_hh_l0, cell.bias_ih_l0, cell.bias_hh_l0)
        assert m["bppsa"]["gates"] == _storage_bytes(gates.r, gates.z, gates.n, gates.M, gates.hp)
        J = TorchBackend().gru_jacobians_t(x, h, cell, lambda: gates)
    assert m["bppsa"]["jacobians"] == J.nbytes
    g = torch.randn(B, H, dtype=dtype)
    ws, be = _cupy_scan_allocations(monkeypatch, g, J.clone())
    assert m["bppsa"]["scan_workspace"] == ws
    if model == "rnn":  # the CUDA path's own Jacobian buffer
        assert be.rnn_jacobians_t(h, cell.weight_hh_l0, layout).nbytes == m["bppsa"]["jacobians"]
    P = TorchBackend().scan(g, J)
    steps = rnn_grad_preact(P, h, layout) if model == "rnn" else gru_gate_grads(gates, P.flip(0))
    assert m["bppsa"]["step_grads"] == steps.nbytes


@pytest.mark.parametrize("width,B", [(0.0625, 1), (0.125, 3)])
def test_vgg_formula_matches_autograd_saved_tensors(width, B):
    torch.manual_seed(0)
    net = VGG11(width=width)
    x, y = torch.randn(B, 3, 32, 32), torch.randint(0, 10, (B,))
    m = memory_model.vgg_gpu_bytes(sum(p.numel() for p in net.parameters()), feature_shapes(width), B, 4)
    assert m["saved_activations"] == preflight.saved_activation_bytes(net, x, y)
    assert m["parameters"] == sum(p.nbytes for p in net.parameters())
    assert m["inputs"] == x.nbytes + y.nbytes
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    assert m["optimizer"] == sum(st["momentum_buffer"].nbytes for st in opt.state.values())


def test_fits_flags_follow_the_formula():
    small = dict(kind="recurrent", model="rnn", seq_len=100, batch=4, hidden=20, input_size=1, classes=10,
                 layout="paper", dtype="float32", L_m=None)
    assert preflight.memory_row(small)["fits_16gb"] and preflight.memory_row(small)["fits_80gb"]
    # 2T·B·H²·4 bytes of Jacobians alone: T = 10^6, B = 256, H = 20 -> 819 GB
    huge = dict(small, seq_len=10**6, batch=256)
    row = preflight.memory_row(huge)
    assert row["gpu_jacobians_gb"] == pytest.approx(2 * 10**6 * 256 * 400 * 4 / 1e9)
    assert not row["fits_16gb"] and not row["fits_80gb"]
    between = dict(small, seq_len=10**5, batch=256)  # 81.9 GB of Jacobians (paper layout), 41 GB fused
    assert not preflight.memory_row(between)["fits_80gb"]
    assert preflight.memory_row(dict(between, layout="fused"))["fits_80gb"]
    assert not preflight.memory_row(dict(between, layout="fused"))["fits_16gb"]


DRY_RUN = """\
rule rnn_verify:
    output: results/x/verify.json
    jobid: 3
    resources: tmpdir=/tmp, mem_mb=16000, runtime=60, gpu=1
localrule report_render:
    jobid: 4
    resources: tmpdir=/tmp, runtime=60, mem_mb=4000
Job stats:
job           count
----------  -------
rnn_verify        1
report_render     1
total             2
"""


def test_dry_run_parser():
    d = gpu_hours.parse_dry_run(DRY_RUN)
    assert d["total"] == 2 and d["counts"] == {"rnn_verify": 1, "report_render": 1}
    assert [(j["rule"], j["runtime_min"], j["gpu"]) for j in d["jobs"]] == [("rnn_verify", 60.0, True),
                                                                             ("report_render", 60.0, False)]


def test_gpu_time_estimate_is_derived_from_config_and_paper():
    cfg = preflight.load_config(PAPER)
    rows = {r["item"]: r for r in gpu_hours.gpu_time_estimate(cfg, {"rnn_bench": 15, "gru_bench": 9, "rnn_train": 2,
                                                                 "gru_train": 6}, None)}
    assert rows["rnn_bench"]["hours"] == pytest.approx(15 * cfg["bench"]["max_seconds"] / 3600)
    # 80 epochs x (53.33 + 29.29 + 2 x 2.13) s (PAPER.md Table 4/5) at 32,000 samples
    assert rows["rnn_train"]["hours"] == pytest.approx(80 * (53.33 + 29.29 + 2 * 2.13) / 3600)
    assert math.isnan(rows["vgg11_train"]["hours"])
    cfg2 = copy.deepcopy(cfg)
    cfg2["bitstream"]["samples"] = 16000
    half = {r["item"]: r for r in gpu_hours.gpu_time_estimate(cfg2, {"rnn_train": 2}, None)}
    assert half["rnn_train"]["hours"] == pytest.approx(rows["rnn_train"]["hours"] / 2)


def test_command_end_to_end_tiny(tmp_path, capsys):
    cfg = _tiny_config(tmp_path / "tiny.yaml")
    out = tmp_path / "shapes.csv"
    rc = main(["paper-shapes", "--configfile", str(tmp_path / "tiny.yaml"), "--out", str(out), "--rounds", "1",
               "--in-process", "--no-dry-run", "--scale", "0.2"])
    assert rc == 0
    df = pd.read_csv(out)
    assert list(df.columns[: len(preflight.COLUMNS)]) == preflight.COLUMNS
    assert len(df) == 2 * len(cfg["rnn"]["layouts"]) + 1 + 1 + len(cfg["vgg11"]["flops"]["networks"])
    checked = df.dropna(subset=["max_rel_err_float32"])
    assert len(checked) == len(df) - 1  # every row but the VGG training step checks exactness
    assert (checked["max_rel_err_float32"] <= 1e-4).all() and (checked["max_rel_err_float64"] <= 1e-10).all()
    assert checked["exact"].all()
    rec = df[df["model"].isin(["rnn", "gru"])]
    assert set(rec["seq_len"]) == {3, 2, 52} and (rec["bppsa_backward_ms"] > 0).all()
    assert (rec["baseline_backward_ms"] > 0).all() and (df["peak_rss_mb"] > 0).all()
    gpu = df.dropna(subset=["gpu_job_gb"])
    assert len(gpu) == len(rec) + 1
    for cap in (16, 80):
        assert (gpu[f"fits_{cap}gb"].astype(bool) == (gpu["gpu_job_gb"] <= cap)).all()
    assert "| rnn-paper max seq_len |" in capsys.readouterr().out


def test_each_job_in_its_own_process():
    job = dict(kind="recurrent", model="rnn", layout="fused", seq_len=6, batch=3, hidden=6, input_size=1, classes=3,
               dtype="float32", seed=0, L_m=None)
    res = preflight.run_job_subprocess(job, rounds=1, fp64=True, timeout=120)
    assert "error" not in res, res
    assert res["max_rel_err_float32"] <= 1e-4 and res["max_rel_err_float64"] <= 1e-10
    assert res["peak_rss_mb"] > 0 and res["backend"] in ("cpu", "torch")
