"""bppsa.nn.RNN/GRU against torch.nn.RNN/GRU: the same state dict, the same gradients (issue 33's "Done when")."""
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import bppsa.nn as bnn
from bppsa.nn import backward as nn_backward
from bppsa.nn import ops
from bppsa.precision import TOLERANCE

ROOT = Path(__file__).resolve().parents[1]
CLASSES = {"rnn": (bnn.RNN, torch.nn.RNN), "gru": (bnn.GRU, torch.nn.GRU)}
I, H = 3, 6  # one input and hidden size throughout: the CPU kernel builds once per shape
TOL = {torch.float64: TOLERANCE["float64"], torch.float32: TOLERANCE["float32"]}


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got - ref| / max|ref| (the absolute error where ref is all zero, e.g. W_hh at T = 1 and h0 = 0)."""
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return (got - ref).abs().max().item() / (scale if scale > 0 else 1.0) if ref.numel() else 0.0


def _lengths(T: int, B: int, gen: torch.Generator) -> torch.Tensor:
    """Unsorted lengths in [1, T] with a 1 and a T among them (where B allows)."""
    out = torch.randint(1, T + 1, (B,), generator=gen)
    out[B // 2] = 1
    out[0] = T
    return out[torch.randperm(B, generator=gen)]


def _run(model, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours: bool):
    """One forward and backward; returns the loss's gradients (x, h0, every parameter) and the outputs."""
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_(x.requires_grad)
    h0 = None if h0 is None else h0.detach().requires_grad_()
    T = x.shape[1] if batch_first else x.shape[0]
    if lengths is None or ours:
        out, h_n = model(x, h0, lengths=lengths) if ours else model(x, h0)
    else:
        packed = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
        out, h_n = model(packed, h0)
        out, _ = pad_packed_sequence(out, batch_first=batch_first, total_length=T)
    loss = 0
    if loss_kind in ("steps", "both"):
        loss = loss + (out * w_out).sum()
    if loss_kind in ("hn", "both"):
        loss = loss + (h_n * w_hn).sum()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    if x.requires_grad:
        grads["input"] = x.grad
    if h0 is not None:
        grads["h0"] = h0.grad
    return grads, out.detach(), h_n.detach()


# (T, B, bias, batch_first, num_layers, h0, lengths, loss, input needs grad)
CASES = [
    (1, 1, True, False, 1, False, False, "hn", False),
    (1, 3, True, True, 2, True, True, "both", True),
    (2, 3, False, True, 1, True, False, "steps", True),
    (7, 17, True, False, 2, True, True, "both", True),
    (9, 3, False, False, 2, False, True, "steps", False),
    (9, 17, True, True, 1, False, False, "hn", False),  # the harness's step: the CPU kernel sums the gradients
    (7, 1, True, False, 1, True, True, "hn", True),
    (2, 17, True, True, 2, False, True, "hn", True),
    (9, 1, False, False, 2, True, False, "both", False),
    (9, 17, True, False, 2, True, False, "hn", True),  # layer 2: the single seed with h0; layer 1: per step
]
# T = 1000 in fp32 only, the harder bound (torch's own CPU GRU backward takes seconds there)
LONG = [
    (1000, 3, True, False, 1, False, False, "hn", False),
    (1000, 17, False, True, 1, True, True, "both", True),
]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
GRID = [pytest.param(case, cell, backend, dtype, id="T{}-B{}-bias{}-bf{}-L{}-h0{}-len{}-{}-dx{}".format(*case)
                     + f"-{cell}-{backend}-{dtype}")
        for case in CASES + LONG for cell in ("rnn", "gru") for backend in ("torch", "cpu")
        for dtype in (("fp64", "fp32") if case[0] < 1000 else ("fp32",))]


@pytest.mark.parametrize("case, cell, backend, dtype", GRID)
def test_gradients_equal_torch_autograd(case, cell, backend, dtype):
    _check_gradients(case, cell, backend, DTYPES[dtype], torch.device("cpu"))


def _check_gradients(case, cell, backend, dtype, device):
    T, B, bias, batch_first, layers, with_h0, with_lengths, loss_kind, dx = case
    ours_cls, torch_cls = CLASSES[cell]
    torch.manual_seed(T * 100 + B)
    ref = torch_cls(I, H, num_layers=layers, bias=bias, batch_first=batch_first, dtype=dtype).to(device)
    got = ours_cls.from_torch(ref, backend=backend)
    gen = torch.Generator().manual_seed(T + B)
    shape = (B, T, I) if batch_first else (T, B, I)

    def randn(*size):
        return torch.randn(size, generator=gen, dtype=dtype).to(device)

    x = randn(*shape).requires_grad_(dx)
    h0 = randn(layers, B, H) if with_h0 else None
    lengths = _lengths(T, B, gen) if with_lengths else None
    w_out = randn(*shape[:2], H)
    w_hn = randn(layers, B, H)
    want, out_ref, hn_ref = _run(ref, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours=False)
    have, out, hn = _run(got, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours=True)
    assert set(have) == set(want)
    tol = TOL[dtype]
    assert _rel(out, out_ref) <= tol and _rel(hn, hn_ref) <= tol
    errs = {name: _rel(have[name], want[name]) for name in want}
    assert max(errs.values()) <= tol, errs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("L_m", [None, 0, 2])
@pytest.mark.parametrize("layout", ["fused", "paper"])
def test_rnn_layouts_and_heterogeneous_scans(layout, L_m, backend):
    """The harness's scan options (the paper's two Jacobians per step, L_m up-sweep levels) give the same
    gradients, on the single-seed scan and the per-step one."""
    torch.manual_seed(1)
    ref = torch.nn.RNN(I, H, dtype=torch.float64)
    got = bnn.RNN.from_torch(ref, backend=backend, layout=layout, L_m=L_m)
    x = torch.randn(37, 5, I, dtype=torch.float64)
    for loss_kind in ("hn", "both"):
        w_out, w_hn = torch.randn(37, 5, H, dtype=torch.float64), torch.randn(1, 5, H, dtype=torch.float64)
        want = _run(ref, x, None, None, loss_kind, False, w_out, w_hn, ours=False)[0]
        have = _run(got, x, None, None, loss_kind, False, w_out, w_hn, ours=True)[0]
        assert max(_rel(have[k], want[k]) for k in want) <= 1e-10


def test_routing_single_seed_and_per_step(monkeypatch):
    """A loss on h_n alone runs each backend's own scan (on the CPU: the kernel that sums the weights'
    gradients as it scans); a gradient at every step or sequences of several lengths go to per_step_backend."""
    calls = []
    real = nn_backward.per_step_backend
    monkeypatch.setattr(nn_backward, "per_step_backend", lambda be, dev: calls.append(be.name) or real(be, dev))
    cpu = nn_backward.backend_for("cpu", torch.device("cpu"))
    sums = []
    real_cell_grads = type(cpu).cell_grads
    monkeypatch.setattr(type(cpu), "cell_grads", lambda self, *a: sums.append(1) or real_cell_grads(self, *a))
    gru = bnn.GRU(I, H, backend="cpu")
    x = torch.randn(9, 4, I)
    out, h_n = gru(x)
    h_n.sum().backward()
    assert calls == [] and sums == [1]
    out, h_n = gru(x)
    (out.sum() + h_n.sum()).backward()
    assert calls == ["cpu"]
    out, h_n = gru(x, lengths=[9, 2, 9, 5])
    h_n.sum().backward()
    assert calls == ["cpu", "cpu"]
    out, h_n = gru(x, lengths=[9, 9, 9, 9])  # every sequence full: the single seed again
    h_n.sum().backward()
    assert calls == ["cpu", "cpu"] and sums == [1, 1]


def test_packed_sequence_is_a_drop_in():
    """A PackedSequence in, a PackedSequence out: the same data, batch sizes and order as torch's, h_n in the
    batch's own order, and the same gradients."""
    torch.manual_seed(2)
    ref = torch.nn.GRU(I, H, num_layers=2, dtype=torch.float64)
    got = bnn.GRU.from_torch(ref, backend="cpu")
    x = torch.randn(8, 5, I, dtype=torch.float64, requires_grad=True)
    results = []
    for model in (ref, got):
        x.grad = None
        packed = pack_padded_sequence(x, torch.tensor([3, 8, 1, 8, 5]), enforce_sorted=False)
        out, h_n = model(packed)
        (out.data.square().sum() + h_n[-1].sum()).backward()
        results.append((out, h_n.detach(), x.grad.clone()))
    (o_ref, hn_ref, gx_ref), (o, hn, gx) = results
    assert torch.equal(o.batch_sizes, o_ref.batch_sizes) and torch.equal(o.sorted_indices, o_ref.sorted_indices)
    assert _rel(o.data, o_ref.data) <= 1e-10 and _rel(hn, hn_ref) <= 1e-10 and _rel(gx, gx_ref) <= 1e-10


def test_unbatched_input():
    torch.manual_seed(3)
    ref = torch.nn.RNN(I, H, num_layers=2, dtype=torch.float64)
    got = bnn.RNN.from_torch(ref, backend="torch")
    x, h0 = torch.randn(6, I, dtype=torch.float64), torch.randn(2, H, dtype=torch.float64)
    (o_ref, hn_ref), (o, hn) = ref(x, h0), got(x, h0)
    assert o.shape == o_ref.shape and hn.shape == hn_ref.shape
    assert _rel(o, o_ref) <= 1e-12 and _rel(hn, hn_ref) <= 1e-12


def test_torch_layer_is_in_training_mode_where_autograd_records(monkeypatch):
    """cuDNN refuses a backward through a forward run in inference mode (every GPU baseline failed so on the H200);
    on the CPU the flag changes no number, so only the call can show it."""
    seen = []
    for name in ("rnn_tanh", "gru"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, real=real: seen.append(a[6] if len(a) == 9 else a[7]) or real(*a))
    x, h0, w_ih, w_hh, b_ih, b_hh, lengths = _op_args("rnn", torch.float64, False)
    hx = h0.detach()[None]
    nn_backward.torch_layer("rnn", x, hx, w_ih, w_hh, b_ih, b_hh)[1].sum().backward()  # the harness's baseline
    bnn.RNN(I, H, dtype=torch.float64)(x.detach())  # the layer's forward, under no_grad
    packed = pack_padded_sequence(x.detach(), torch.tensor([5, 1, 3]), enforce_sorted=False)
    bnn.GRU(I, H, dtype=torch.float64)(packed)
    assert seen == [True, False, False], seen


# -- the ops --------------------------------------------------------------------------------------


def _op_args(cell, dtype, with_lengths, grad=True):
    gen = torch.Generator().manual_seed(4)
    G = 3 if cell == "gru" else 1
    T, B = 5, 3

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)

    lengths = torch.tensor([5, 1, 3]) if with_lengths else None
    return (r(T, B, I), r(B, H), r(G * H, I), r(G * H, H), r(G * H), r(G * H), lengths)


@pytest.mark.parametrize("with_lengths", [False, True], ids=["full", "lengths"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cell", ["rnn", "gru"])
def test_opcheck(cell, dtype, with_lengths):
    """torch.library.opcheck on the forward op (its fake, its autograd formula, AOT dispatch) and the backward op."""
    args = _op_args(cell, dtype, with_lengths)
    backend = "torch" if dtype == torch.float64 else "cpu"  # the forward's autograd formula runs the backward op
    torch.library.opcheck(ops.OPS[cell], args + (backend, "fused", None))
    x, h0, *w, lengths = (t.detach() if t is not None else None for t in args)
    h = ops.OPS[cell](x, h0, *w, lengths, "cpu", "fused", None)[0]
    gen = torch.Generator().manual_seed(5)
    grads = (torch.randn(h.shape, generator=gen, dtype=dtype), torch.randn(h.shape[1:], generator=gen, dtype=dtype))
    bwd = ops.rnn_backward if cell == "rnn" else ops.gru_backward
    torch.library.opcheck(bwd, (x, h0, *w, lengths, h, *grads, True, True, "cpu", "fused", None))


@pytest.mark.parametrize("with_lengths", [False, True], ids=["full", "lengths"])
@pytest.mark.parametrize("cell", ["rnn", "gru"])
def test_gradcheck_fp64(cell, with_lengths):
    x, h0, w_ih, w_hh, b_ih, b_hh, lengths = _op_args(cell, torch.float64, with_lengths)
    for backend in ("torch", "cpu"):
        def f(*a, backend=backend):
            return ops.layer(cell, *a, lengths, backend)

        assert torch.autograd.gradcheck(f, (x, h0, w_ih, w_hh, b_ih, b_hh))


def test_every_op_has_a_cuda_kernel():
    """The CUDA registration (the tensors' device made current, then the backends resolve on it) exists even
    where this torch cannot run it."""
    for name in ("rnn", "gru", "rnn_backward", "gru_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"bppsa::{name}", "CUDA"), name


def test_eager_mode_does_not_import_the_compiler():
    """A custom op's first call imports torch._dynamo (~2 s a process on two vCPUs, paid by every workflow job);
    eager mode runs the op's functions as an autograd.Function instead."""
    code = ("import sys, torch, bppsa.nn as bnn\n"
            "for cls in (bnn.RNN, bnn.GRU):\n"
            f"    out, h_n = cls({I}, {H}, backend='cpu')(torch.randn(9, 4, {I}))\n"  # kernels built
            "    (out.sum() + h_n.sum()).backward()\n"
            "print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False", "eager bppsa.nn imported torch._dynamo"
    assert "Exception ignored" not in r.stderr, r.stderr[-2000:]  # nothing left to fail at the interpreter's exit


def test_double_backward_raises():
    x, h0, *w, lengths = _op_args("gru", torch.float64, False)
    h, h_n = ops.layer("gru", x, h0, *w, lengths, "torch")
    (gx,) = torch.autograd.grad(h_n.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        gx.sum().backward()


# -- training steps ---------------------------------------------------------------------------------


class _Tagger(torch.nn.Module):
    """A sequence labeller on padded batches: a loss at every valid step and on h_n."""

    def __init__(self, backend: str):
        super().__init__()
        self.gru = bnn.GRU(I, H, num_layers=2, batch_first=True, backend=backend)
        self.head = torch.nn.Linear(H, 4)

    def forward(self, x, lengths, y):
        out, h_n = self.gru(x, lengths=lengths)
        return torch.nn.functional.cross_entropy(self.head(out).flatten(0, 1), y.flatten()) + h_n.square().mean()


def _step(model, fn, batch):
    for p in model.parameters():
        p.grad = None
    loss = fn(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _batch():
    gen = torch.Generator().manual_seed(6)
    return torch.randn(4, 7, I, generator=gen), torch.tensor([7, 2, 5, 1]), torch.randint(0, 4, (4, 7), generator=gen)


def _compiled_step(compile_backend: str, device: str | torch.device = "cpu", backend: str = "cpu"):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch.manual_seed(7)
    eager = _Tagger(backend).to(device)
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    seen = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(model, fullgraph=True, backend=seen)
    x, lengths, y = _batch()
    batch = (x.to(device), lengths, y.to(device))
    got = _step(model, compiled, batch)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the trace went through the custom op (its fake formula), not the eager autograd.Function
    assert any("torch.ops.bppsa.gru" in g.code for g in seen.graphs), [g.code for g in seen.graphs]
    return got, _step(eager, eager, batch)


def test_compiled_training_step_has_no_graph_break_and_equals_eager():
    """fullgraph=True through dynamo and AOTAutograd (the ops' fake and autograd formulas); the graph runs
    eagerly, so the numbers are eager's bit for bit."""
    (loss, grads), (loss_ref, grads_ref) = _compiled_step("aot_eager")
    assert torch.equal(loss, loss_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))


@pytest.mark.slow  # inductor's C++ compile: ~50 s on two cores the first time, ~8 s from its cache
def test_inductor_training_step_equals_eager():
    (loss, grads), (loss_ref, grads_ref) = _compiled_step("inductor")
    assert _rel(loss, loss_ref) <= 1e-4 and max(_rel(a, b) for a, b in zip(grads, grads_ref)) <= 1e-4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_two_backward_runs_are_bitwise_equal(backend):
    _two_backward_runs_are_bitwise_equal(backend, torch.device("cpu"))


def _two_backward_runs_are_bitwise_equal(backend: str, device: torch.device):
    torch.manual_seed(8)
    model = _Tagger(backend).to(device)
    model.gru.L_m = None
    x, lengths, y = _batch()
    x, y = x.to(device), y.to(device)
    full = torch.full((4,), 7)
    for lens in (lengths, full):
        first = _step(model, model, (x, lens, y))[1]
        second = _step(model, model, (x, lens, y))[1]
        assert all(torch.equal(a, b) for a, b in zip(first, second))
    rnn = bnn.RNN(I, H, backend=backend, device=device)
    xs = torch.randn(1000, 16, I).to(device)
    runs = []
    for _ in range(2):
        rnn.zero_grad()
        rnn(xs)[1].sum().backward()
        runs.append([p.grad.clone() for p in rnn.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_autocast_runs_in_fp32():
    torch.manual_seed(9)
    gru = bnn.GRU(I, H, backend="torch")
    x = torch.randn(5, 2, I)
    want = gru(x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gru(x.bfloat16())[0]
    assert got.dtype == torch.float32
    assert _rel(got, gru(x.bfloat16().float())[0]) == 0 and _rel(got, want) < 1e-2  # only x was rounded


def test_dropout_between_layers():
    torch.manual_seed(10)
    ref = torch.nn.GRU(I, H, num_layers=2, dropout=0.5, dtype=torch.float64).eval()
    got = bnn.GRU.from_torch(ref)
    x = torch.randn(6, 3, I, dtype=torch.float64)
    assert not got.training and _rel(got(x)[0], ref(x)[0]) <= 1e-12  # no dropout in eval, as torch
    got.train()
    torch.manual_seed(0)
    a = got(x)[0]
    torch.manual_seed(0)
    assert torch.equal(a, got(x)[0]) and not torch.equal(a, ref(x)[0])


# -- state dicts and conversions ------------------------------------------------------------------


@pytest.mark.parametrize("cell", ["rnn", "gru"])
@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trips_with_torch(cell, bias):
    ours_cls, torch_cls = CLASSES[cell]
    t = torch_cls(I, H, num_layers=2, bias=bias, batch_first=True)
    ours = ours_cls(I, H, 2, **({"nonlinearity": "tanh"} if cell == "rnn" else {}), bias=bias, batch_first=True)
    assert list(ours.state_dict()) == list(t.state_dict())
    ours.load_state_dict(t.state_dict(), strict=True)
    back = torch_cls(I, H, num_layers=2, bias=bias, batch_first=True)
    back.load_state_dict(ours.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), t.state_dict().values()))
    conv = ours_cls.from_torch(t).to_torch()
    assert type(conv) is torch_cls and conv.batch_first and conv.num_layers == 2 and conv.bias == bias
    assert all(torch.equal(a, b) for a, b in zip(conv.state_dict().values(), t.state_dict().values()))


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: bnn.RNN(I, H, bidirectional=True), "bidirectional=True"),
    (lambda: bnn.GRU(I, H, 1, True, False, 0.0, True), "bidirectional=True"),
    (lambda: bnn.RNN(I, H, nonlinearity="relu"), "nonlinearity='relu'"),
    (lambda: bnn.RNN(I, H, 1, "relu"), "nonlinearity='relu'"),
    (lambda: bnn.GRU(I, H, proj_size=2), "proj_size"),
    (lambda: bnn.GRU(I, H, dtype=torch.float16), "half precision"),
    (lambda: bnn.RNN(I, H, dtype=torch.bfloat16), "half precision"),
    (lambda: bnn.GRU.from_torch(torch.nn.GRU(I, H, bidirectional=True)), "bidirectional=True"),
    (lambda: bnn.RNN.from_torch(torch.nn.RNN(I, H, nonlinearity="relu")), "nonlinearity='relu'"),
    (lambda: bnn.GRU(I, H, backend="tpu"), "unknown backend 'tpu'"),
    (lambda: bnn.GRU(I, H, layout="paper"), "unknown layout 'paper'"),
    (lambda: bnn.RNN(I, H, L_m=-1), "L_m"),
])
def test_refused_options_name_themselves(make, match):
    with pytest.raises((ValueError, TypeError), match=re.escape(match)):
        make()


def test_refused_inputs():
    gru = bnn.GRU(I, H, backend="torch")
    x = torch.randn(5, 2, I)
    with pytest.raises(TypeError, match="half precision"):
        gru(x.half())
    with pytest.raises(TypeError, match="half precision"):
        copy.deepcopy(gru).half()(x.half())
    with pytest.raises(ValueError, match=re.escape("every length must lie in [1, T = 5]")):
        gru(x, lengths=[5, 0])
    with pytest.raises(ValueError, match=re.escape("every length must lie in [1, T = 5]")):
        gru(x, lengths=[6, 1])
    with pytest.raises(ValueError, match="hx must be"):
        gru(x, torch.zeros(2, 2, H))
    packed = pack_padded_sequence(x, torch.tensor([5, 2]))
    with pytest.raises(ValueError, match="carries its lengths"):
        gru(packed, lengths=[5, 2])
    with pytest.raises(TypeError, match="takes a GRU"):
        bnn.GRU.from_torch(torch.nn.RNN(I, H))


# -- the README ------------------------------------------------------------------------------------


def test_readme_example_runs_as_written():
    text = (ROOT / "README.md").read_text()
    section = text.split("## BPPSA in your own model", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    gru = scope["gru"]
    assert all(p.grad is not None for p in gru.parameters())
    assert scope["out"][3, 1:].abs().max() == 0  # zero past the sequence of length 1


# -- the CUDA backends, their kernels emulated on the CPU -------------------------------------------


@pytest.fixture(scope="module")
def emulated_cupy_factored():
    """CupyFactoredBackend (the GPU's 'auto') with its kernels run by tests/cuda_emulator.py: the same launch
    plans and buffers, on CPU tensors; what the layers get for backend='cupy-factored' here."""
    from types import SimpleNamespace

    import numpy as np
    from cuda_emulator import build_emulator, emulated_factored, emulated_launch, emulated_scan

    from bppsa.backends.cuda import CupyBackend, CupyFactoredBackend, runtime

    lib = build_emulator()
    mp = pytest.MonkeyPatch()
    mp.setattr(runtime, "import_cupy", lambda: None)
    mp.setattr(runtime, "check_cuda", lambda dtype, *ts: torch.device("cpu"))
    mp.setattr(runtime, "smem_optin", lambda dev: 227 * 1024)  # an H100's
    calls = []

    def factored(self, g, chain, L_m, grads, C=None, c=None):
        calls.append(("affine " if c is not None else "") + ("sums" if grads else "scan"))
        c = None if c is None else c.numpy()
        return torch.from_numpy(emulated_factored(lib, chain, g.numpy(), C, grads, L_m, c)[0])

    def scan(self, g, J, L_m=None):
        calls.append("dense scan")
        return torch.from_numpy(emulated_scan(lib, g.numpy(), J.contiguous().numpy(), L_m)[0])

    def launch(src, step, dtype, dev, args, stream):  # the GRU's factor kernel, on the CPU tensors' memory
        assert step.kernel == "bppsa_gru_factors", step.kernel
        calls.append("gru factors")
        emulated_launch(lib, step, np.float64 if dtype == torch.float64 else np.float32,
                        [SimpleNamespace(ptr=int(a)) for a in args])

    mp.setattr(runtime, "launch", launch)
    mp.setattr(runtime, "stream", lambda dev: None)
    mp.setattr(CupyFactoredBackend, "_factored", factored)
    mp.setattr(CupyBackend, "scan", scan)
    mp.setitem(nn_backward._backends, ("cupy-factored", "cpu"), CupyFactoredBackend())
    yield calls
    mp.undo()


@pytest.mark.slow  # one g++ build of the emulator (~20 s)
@pytest.mark.parametrize("cell", ["rnn", "gru"])
def test_cupy_factored_backend_emulated(cell, emulated_cupy_factored):
    """The layers on the factored CUDA kernels: the harness's step (the kernels sum the weights' gradients),
    the single seed with h0 and ∇x (the kernels' scan), per-step gradients (the kernels' affine sums; with ∇x their
    affine scan; variable lengths: the twin)."""
    calls = emulated_cupy_factored
    calls.clear()
    ours_cls, torch_cls = CLASSES[cell]
    for case in [(9, 17, True, False, 1, False, False, "hn", False), (7, 3, False, True, 2, True, False, "hn", True),
                 (37, 5, True, False, 1, False, False, "both", False),
                 (9, 3, False, True, 1, True, False, "steps", True),
                 (7, 3, True, False, 1, True, True, "both", True)]:
        T, B, bias, batch_first, layers, with_h0, with_lengths, loss_kind, dx = case
        torch.manual_seed(T + B)
        ref = torch_cls(I, H, num_layers=layers, bias=bias, batch_first=batch_first, dtype=torch.float64)
        got = ours_cls.from_torch(ref, backend="cupy-factored")
        gen = torch.Generator().manual_seed(T)
        shape = (B, T, I) if batch_first else (T, B, I)
        x = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_(dx)
        h0 = torch.randn(layers, B, H, generator=gen, dtype=torch.float64) if with_h0 else None
        lengths = _lengths(T, B, gen) if with_lengths else None
        w_out, w_hn = torch.randn(shape[:2] + (H,), dtype=torch.float64), torch.randn(layers, B, H, dtype=torch.float64)
        want = _run(ref, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours=False)[0]
        have = _run(got, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours=True)[0]
        assert max(_rel(have[k], want[k]) for k in want) <= 1e-10, case
    # case 2's first layer takes the second's ∇x at every step; variable lengths (the last case) go to the twin
    assert [c for c in calls if c != "gru factors"] == ["sums", "scan", "affine scan", "affine sums", "affine scan"]
    assert ("gru factors" in calls) == (cell == "gru")  # the GRU's factors by their kernel


# -- on a GPU (skipped without one): the CuPy backends, torch's current stream, CUDA graphs --------------------

GPU_BACKENDS = ("cupy-factored", "cupy")  # 'auto' on a GPU is cupy-factored
GPU_GRID = [pytest.param(case, cell, backend, dtype, id="T{}-B{}-bias{}-bf{}-L{}-h0{}-len{}-{}-dx{}".format(*case)
                         + f"-{cell}-{backend}-{dtype}")
            for case in CASES + LONG for cell in ("rnn", "gru") for backend in GPU_BACKENDS
            for dtype in (("fp64", "fp32") if case[0] < 1000 else ("fp32",))]


@pytest.fixture
def cuda_fp32():
    """The GPU, with TF32 off: cuDNN's fp32 RNN and torch's matmuls in fp32, as the 1e-4 bound assumes."""
    pytest.importorskip("cupy")
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("case, cell, backend, dtype", GPU_GRID)
def test_gpu_gradients_equal_torch_autograd(case, cell, backend, dtype, cuda_fp32):
    """The same grid on the GPU: bppsa.nn on each CuPy backend against torch.nn (cuDNN) on one state dict."""
    _check_gradients(case, cell, backend, DTYPES[dtype], cuda_fp32)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("with_lengths", [False, True], ids=["full", "lengths"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cell", ["rnn", "gru"])
def test_gpu_opcheck(cell, dtype, with_lengths, backend, cuda_fp32):
    x, h0, *w, lengths = (t.detach().to(cuda_fp32).requires_grad_() if t is not None and t.is_floating_point()
                          else t for t in _op_args(cell, dtype, with_lengths))
    torch.library.opcheck(ops.OPS[cell], (x, h0, *w, lengths, backend, "fused", None))


def _graph_loss(model, x, w, loss_kind):
    out, h_n = model(x)
    loss = (h_n * w[-1]).sum()
    return loss + (out * w[:-1]).sum() if loss_kind == "both" else loss


@pytest.mark.gpu
@pytest.mark.parametrize("loss_kind", ["hn", "both"])  # the single seed (the factored kernels); every step (twin)
@pytest.mark.parametrize("cell", ["rnn", "gru"])
def test_gpu_training_step_captured_in_a_cuda_graph(cell, loss_kind, cuda_fp32):
    """A whole forward and backward captured in one CUDA graph (the launches on torch's current stream,
    nothing synchronising) and replayed on new inputs gives eager mode's gradients bit for bit, also after
    eager calls of another shape have run on the same backend in between."""
    dev = cuda_fp32
    T, B = 37, 16
    torch.manual_seed(9)
    model = CLASSES[cell][0](I, H, num_layers=2, backend="cupy-factored", device=dev)
    eager = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(10)
    static_x = torch.randn(T, B, I, generator=gen).to(dev)
    static_w = torch.randn(T + 1, B, H, generator=gen).to(dev)  # w[:-1] weighs the outputs, w[-1] h_n
    params = list(model.parameters())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: kernels compiled and loaded, the allocator's pools settled
        for _ in range(3):
            for p in params:
                p.grad = None
            _graph_loss(model, static_x, static_w, loss_kind).backward()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _graph_loss(model, static_x, static_w, loss_kind).backward()

    def eager_grads(x, w):
        for p in eager.parameters():
            p.grad = None
        _graph_loss(eager, x, w, loss_kind).backward()
        return [p.grad for p in eager.parameters()]

    for k in range(3):
        x, w = torch.randn(T, B, I, generator=gen).to(dev), torch.randn(T + 1, B, H, generator=gen).to(dev)
        static_x.copy_(x)
        static_w.copy_(w)
        graph.replay()
        got = [p.grad.clone() for p in params]
        want = eager_grads(x, w)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), [_rel(a, b) for a, b in zip(got, want)]
        eager_grads(x[:, : B - 5 + k], w[:, : B - 5 + k])  # another shape through the same backend instance


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_two_backward_runs_are_bitwise_equal(backend, cuda_fp32):
    _two_backward_runs_are_bitwise_equal(backend, cuda_fp32)


@pytest.mark.gpu
def test_gpu_compiled_training_step_equals_eager(cuda_fp32):
    (loss, grads), (loss_ref, grads_ref) = _compiled_step("aot_eager", cuda_fp32, "cupy-factored")
    assert torch.equal(loss, loss_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))
