"""bppsa.nn.RNN/GRU/LSTM against torch.nn.RNN/GRU/LSTM: the same state dict, the same gradients (issues 33, 48)."""
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
from bppsa.nn.cells import CELLS, Weights
from bppsa.precision import TOLERANCE

ROOT = Path(__file__).resolve().parents[1]
# name -> (ours, torch's, constructor options)
CLASSES = {"rnn": (bnn.RNN, torch.nn.RNN, {}), "rnn_relu": (bnn.RNN, torch.nn.RNN, {"nonlinearity": "relu"}),
           "gru": (bnn.GRU, torch.nn.GRU, {}), "lstm": (bnn.LSTM, torch.nn.LSTM, {}),
           "lstm_proj": (bnn.LSTM, torch.nn.LSTM, {"proj_size": 4})}
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


def _finals(h_n) -> torch.Tensor:
    """h_n, or an LSTM's (h_n, c_n) as one flat tensor (what the loss weighs)."""
    return torch.cat([h_n[0].flatten(), h_n[1].flatten()]) if isinstance(h_n, tuple) else h_n.flatten()


def _run(model, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours: bool):
    """One forward and backward; returns the loss's gradients (x, h0 (and c0), every parameter) and the outputs.
    ``h0``: a tensor, or an LSTM's (h0, c0)."""
    for p in model.parameters():
        p.grad = None
    x = x.detach().requires_grad_(x.requires_grad)
    if isinstance(h0, tuple):
        h0 = tuple(t.detach().requires_grad_() for t in h0)
    elif h0 is not None:
        h0 = h0.detach().requires_grad_()
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
        loss = loss + (_finals(h_n) * w_hn).sum()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    if x.requires_grad:
        grads["input"] = x.grad
    for i, t in enumerate(h0 if isinstance(h0, tuple) else (h0,)):
        if t is not None:
            grads[f"state0_{i}"] = t.grad
    return grads, out.detach(), _finals(h_n).detach()


# (T, B, bias, batch_first, num_layers, h0, lengths, loss, input needs grad, bidirectional)
CASES = [
    (1, 1, True, False, 1, False, False, "hn", False, False),
    (1, 3, True, True, 2, True, True, "both", True, False),
    (2, 3, False, True, 1, True, False, "steps", True, False),
    (7, 17, True, False, 2, True, True, "both", True, False),
    (9, 3, False, False, 2, False, True, "steps", False, False),
    (9, 17, True, True, 1, False, False, "hn", False, False),  # the harness's step: the CPU kernel sums the gradients
    (7, 1, True, False, 1, True, True, "hn", True, False),
    (2, 17, True, True, 2, False, True, "hn", True, False),
    (9, 1, False, False, 2, True, False, "both", False, False),
    (9, 17, True, False, 2, True, False, "hn", True, False),  # layer 2: the single seed with h0; layer 1: per step
    (9, 3, True, False, 2, True, True, "both", True, True),  # bidirectional, each direction from its own end
    (7, 17, True, True, 1, False, False, "hn", False, True),
]
# T = 1000 in fp32 only, the harder bound (torch's own CPU GRU backward takes seconds there)
LONG = [
    (1000, 3, True, False, 1, False, False, "hn", False, False),
    (1000, 17, False, True, 1, True, True, "both", True, False),
]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
MAIN = ("rnn", "gru", "lstm")  # every case; relu's and the projected LSTM's on a share of them (their own paths)
SHARE = [CASES[i] for i in (1, 3, 5, 9, 10)]


def _grid(backends):
    out = []
    for case in CASES + LONG:
        cells = MAIN + (("rnn_relu", "lstm_proj") if case in SHARE or case is LONG[1] else ())
        for cell in cells:
            for backend in backends:
                for dtype in (("fp64", "fp32") if case[0] < 1000 else ("fp32",)):
                    name = "T{}-B{}-bias{}-bf{}-L{}-h0{}-len{}-{}-dx{}-bi{}".format(*case)
                    out.append(pytest.param(case, cell, backend, dtype, id=f"{name}-{cell}-{backend}-{dtype}"))
    return out


@pytest.mark.parametrize("case, cell, backend, dtype", _grid(("torch", "cpu")))
def test_gradients_equal_torch_autograd(case, cell, backend, dtype):
    _check_gradients(case, cell, backend, DTYPES[dtype], torch.device("cpu"))


def _check_gradients(case, cell, backend, dtype, device):
    T, B, bias, batch_first, layers, with_h0, with_lengths, loss_kind, dx, bi = case
    ours_cls, torch_cls, kw = CLASSES[cell]
    torch.manual_seed(T * 100 + B)
    ref = torch_cls(I, H, num_layers=layers, bias=bias, batch_first=batch_first, bidirectional=bi, dtype=dtype,
                    **kw).to(device)
    got = ours_cls.from_torch(ref, backend=backend)
    gen = torch.Generator().manual_seed(T + B)
    shape = (B, T, I) if batch_first else (T, B, I)

    def randn(*size):
        return torch.randn(size, generator=gen, dtype=dtype).to(device)

    D, P = (2 if bi else 1), kw.get("proj_size") or H
    x = randn(*shape).requires_grad_(dx)
    h0 = None
    if with_h0:
        h0 = randn(layers * D, B, P)
        h0 = (h0, randn(layers * D, B, H)) if torch_cls is torch.nn.LSTM else h0
    lengths = _lengths(T, B, gen) if with_lengths else None
    w_out = randn(*shape[:2], D * P)
    w_hn = randn(layers * D * B * (P + H if torch_cls is torch.nn.LSTM else H))
    want, out_ref, hn_ref = _run(ref, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours=False)
    have, out, hn = _run(got, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours=True)
    assert set(have) == set(want)
    tol = TOL[dtype]
    assert _rel(out, out_ref) <= tol and _rel(hn, hn_ref) <= tol
    errs = {name: _rel(have[name], want[name]) for name in want}
    assert max(errs.values()) <= tol, errs


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("L_m", [None, 0, 2])
@pytest.mark.parametrize("layout", ["fused", "paper"])
def test_rnn_layouts_and_heterogeneous_scans(layout, L_m, backend, nonlinearity):
    """The harness's scan options (the paper's two Jacobians per step, L_m up-sweep levels) give the same
    gradients, on the single-seed scan and the per-step one, for either nonlinearity."""
    torch.manual_seed(1)
    ref = torch.nn.RNN(I, H, nonlinearity=nonlinearity, dtype=torch.float64)
    got = bnn.RNN.from_torch(ref, backend=backend, layout=layout, L_m=L_m)
    x = torch.randn(37, 5, I, dtype=torch.float64)
    for loss_kind in ("hn", "both"):
        w_out, w_hn = torch.randn(37, 5, H, dtype=torch.float64), torch.randn(5 * H, dtype=torch.float64)
        want = _run(ref, x, None, None, loss_kind, False, w_out, w_hn, ours=False)[0]
        have = _run(got, x, None, None, loss_kind, False, w_out, w_hn, ours=True)[0]
        assert max(_rel(have[k], want[k]) for k in want) <= 1e-10


@pytest.mark.parametrize("cls", [bnn.RNN, bnn.GRU, bnn.LSTM])
@pytest.mark.parametrize("loss_kind", ["hn", "both"])
def test_auto_L_m_is_the_scanning_backends_choice(cls, loss_kind, monkeypatch):
    """The default L_m="auto" asks the backend that scans (levels(J, grads)) and scans at the depth it names; the
    gradients are autograd's whichever depth it names."""
    torch.manual_seed(2)
    ref = cls.cell.torch_cls(I, H, dtype=torch.float64)
    got = cls.from_torch(ref, backend="cpu")
    assert got.L_m == "auto" and "L_m='auto'" in repr(got)
    cpu = type(nn_backward.backend_for("cpu", torch.device("cpu")))
    asked, scanned = [], []
    x = torch.randn(37, 5, I, dtype=torch.float64)
    finals = 2 if cls is bnn.LSTM else 1  # h_n (and c_n)
    w_out, w_hn = torch.randn(37, 5, H, dtype=torch.float64), torch.randn(finals * 5 * H, dtype=torch.float64)
    want = _run(ref, x, None, None, loss_kind, False, w_out, w_hn, ours=False)[0]
    for depth in (0, 2, None):
        monkeypatch.setattr(cpu, "levels", lambda self, J, grads=False, d=depth: asked.append(grads) or d)
        for name in ("scan", "affine_scan", "cell_grads"):
            real = getattr(cpu, name)
            monkeypatch.setattr(cpu, name, lambda self, g, J, *a, _r=real, **k: scanned.append(a[0] if a else None)
                                or _r(self, g, J, *a, **k))
        have = _run(got, x, None, None, loss_kind, False, w_out, w_hn, ours=True)[0]
        assert max(_rel(have[k], want[k]) for k in want) <= 1e-10
        assert asked and scanned and scanned[0] == depth, (depth, scanned)
        asked.clear(), scanned.clear(), monkeypatch.undo()


@pytest.mark.parametrize("cls", [bnn.GRU, bnn.LSTM])
def test_routing_single_seed_and_per_step(cls, monkeypatch):
    """A loss on h_n alone runs each backend's own scan (on the CPU: the kernel that sums the weights'
    gradients as it scans); a gradient at every step or sequences of several lengths ask the backend for its
    per-step scanner (the plan: bppsa.nn.backward.plan)."""
    cpu = nn_backward.backend_for("cpu", torch.device("cpu"))
    calls, sums = [], []
    real_scanner, real_cell_grads = type(cpu).scanner, type(cpu).cell_grads
    monkeypatch.setattr(type(cpu), "scanner", lambda self, kind, per_step=False: calls.append((kind, per_step))
                        or real_scanner(self, kind, per_step))
    monkeypatch.setattr(type(cpu), "cell_grads", lambda self, *a, c=None: sums.append(c is None)
                        or real_cell_grads(self, *a, c=c))
    layer = cls(I, H, backend="cpu")
    kind = layer.cell.kind
    x = torch.randn(9, 4, I)

    def finals(h_n):
        return h_n[0] if isinstance(h_n, tuple) else h_n

    out, h_n = layer(x)
    finals(h_n).sum().backward()
    assert calls == [(kind, False)] and sums == [True]
    out, h_n = layer(x)
    (out.sum() + finals(h_n).sum()).backward()  # every step, full lengths: the affine scan, gradients summed
    assert calls[-1] == (kind, True) and sums == [True, False]
    out, h_n = layer(x, lengths=[9, 2, 9, 5])
    finals(h_n).sum().backward()  # identity steps: the affine scan, the gradients from its output
    assert calls[-1] == (kind, True) and sums == [True, False]
    out, h_n = layer(x, lengths=[9, 9, 9, 9])  # every sequence full: the single seed again
    finals(h_n).sum().backward()
    assert calls[-1] == (kind, False) and sums == [True, False, True]


def test_packed_sequence_is_a_drop_in():
    """A PackedSequence in, a PackedSequence out: the same data, batch sizes and order as torch's, h_n in the
    batch's own order, and the same gradients."""
    for cell, bi in (("gru", False), ("lstm", True)):
        ours_cls, torch_cls, kw = CLASSES[cell]
        torch.manual_seed(2)
        ref = torch_cls(I, H, num_layers=2, bidirectional=bi, dtype=torch.float64, **kw)
        got = ours_cls.from_torch(ref, backend="cpu")
        x = torch.randn(8, 5, I, dtype=torch.float64, requires_grad=True)
        results = []
        for model in (ref, got):
            x.grad = None
            packed = pack_padded_sequence(x, torch.tensor([3, 8, 1, 8, 5]), enforce_sorted=False)
            out, h_n = model(packed)
            (out.data.square().sum() + _finals(h_n)[-1].sum()).backward()
            results.append((out, _finals(h_n).detach(), x.grad.clone()))
        (o_ref, hn_ref, gx_ref), (o, hn, gx) = results
        assert torch.equal(o.batch_sizes, o_ref.batch_sizes) and torch.equal(o.sorted_indices, o_ref.sorted_indices)
        assert _rel(o.data, o_ref.data) <= 1e-10 and _rel(hn, hn_ref) <= 1e-10 and _rel(gx, gx_ref) <= 1e-10


@pytest.mark.parametrize("cell", ["rnn", "lstm_proj"])
def test_unbatched_input(cell):
    ours_cls, torch_cls, kw = CLASSES[cell]
    torch.manual_seed(3)
    ref = torch_cls(I, H, num_layers=2, bidirectional=True, dtype=torch.float64, **kw)
    got = ours_cls.from_torch(ref, backend="torch")
    x, h0 = torch.randn(6, I, dtype=torch.float64), torch.randn(4, kw.get("proj_size", H), dtype=torch.float64)
    hx = (h0, torch.randn(4, H, dtype=torch.float64)) if torch_cls is torch.nn.LSTM else h0
    (o_ref, hn_ref), (o, hn) = ref(x, hx), got(x, hx)
    assert o.shape == o_ref.shape and _finals(hn).shape == _finals(hn_ref).shape
    assert _rel(o, o_ref) <= 1e-12 and _rel(_finals(hn), _finals(hn_ref)) <= 1e-12


def test_torch_layer_is_in_training_mode_where_autograd_records(monkeypatch):
    """cuDNN refuses a backward through a forward run in inference mode (every GPU baseline failed so on the H200);
    on the CPU the flag changes no number, so only the call can show it."""
    seen = []
    for name in ("rnn_tanh", "gru", "lstm"):
        real = getattr(torch, name)
        # train is the 7th argument, the 8th in the packed form (data, batch_sizes, hx, params, ...)
        monkeypatch.setattr(torch, name, lambda *a, real=real: seen.append(a[7] if isinstance(a[3], (list, tuple))
                                                                           else a[6]) or real(*a))
    x, h0, c0, *w, lengths = _op_args("rnn", torch.float64, False)
    CELLS["rnn"].torch_run(x, (h0.detach()[None],), Weights(*w))[1][0].sum().backward()  # the harness's baseline
    # the layers' forward on torch's kernels (backend="torch": on a CPU "auto" runs the compiled forward)
    bnn.RNN(I, H, dtype=torch.float64, backend="torch")(x.detach())
    packed = pack_padded_sequence(x.detach(), torch.tensor([5, 1, 3]), enforce_sorted=False)
    bnn.GRU(I, H, dtype=torch.float64, backend="torch")(packed)
    bnn.LSTM(I, H, dtype=torch.float64, backend="torch")(packed)
    assert seen == [True, False, False, False] and all(type(t) is bool for t in seen), seen


@pytest.mark.parametrize("cell", ["rnn", "rnn_relu", "gru", "lstm"])
def test_the_sliced_forward_is_the_serial_forward(cell):
    """parallel_forward=True (the compiled forward split over slices of the sequence, corrected until they meet):
    the serial compiled forward's states bit for bit (within 1e-12 for the tanh RNN, which meets within two ulps),
    whatever the slices' guesses (zeros, then the last call's),
    lengths ending inside a slice, and the backward through it equal to torch.nn's autograd; its record of each
    call (sweeps, meeting lengths, hand-off) per layer and direction (False records none); on torch's kernels the
    same within 1e-12."""
    ours_cls, torch_cls, kw = CLASSES[cell]
    torch.manual_seed(12)
    ref = torch_cls(I, H, num_layers=2, dtype=torch.float64, **kw)
    serial = ours_cls.from_torch(ref, backend="cpu", parallel_forward=False)
    sliced = ours_cls.from_torch(ref, backend="cpu", parallel_forward=True)
    gen = torch.Generator().manual_seed(13)
    T, B = 1201, 3
    x = torch.randn(T, B, I, generator=gen, dtype=torch.float64) * 0.5
    lengths = torch.tensor([T, 700, 1])
    w_out, w_hn = torch.randn(T, B, H, generator=gen, dtype=torch.float64), torch.randn(2 * B * H * (
        2 if torch_cls is torch.nn.LSTM else 1), generator=gen, dtype=torch.float64)
    with torch.no_grad():
        want = serial(x, lengths=lengths)
        for _ in range(2):  # zeros, then the last call's starts as the guesses
            got = sliced(x, lengths=lengths)
            if sliced.cell.meet_ulps == 0:  # bitwise: the serial forward's bits
                assert torch.equal(got[0], want[0]) and torch.equal(_finals(got[1]), _finals(want[1]))
            else:  # the tanh RNN meets within its ulps: the error is (slices - 1) times that, carried by its Jacobian
                assert _rel(got[0], want[0]) <= 1e-12 and _rel(_finals(got[1]), _finals(want[1])) <= 1e-12
    assert len(sliced.forward_stats) == 2 and all(st["sweeps"] >= 1 for st in sliced.forward_stats)
    assert serial.forward_stats == [None, None]
    have = _run(sliced, x, None, lengths, "both", False, w_out, w_hn, ours=True)[0]
    ref_grads = _run(ref, x, None, lengths, "both", False, w_out, w_hn, ours=False)[0]
    assert max(_rel(have[k], ref_grads[k]) for k in ref_grads) <= 1e-10
    # torch's kernels (a GPU's cuDNN, on CUDA streams there): the same sweeps, meeting within a few ulps
    twin_serial = ours_cls.from_torch(ref, backend="torch", parallel_forward=False)
    twin = ours_cls.from_torch(ref, backend="torch", parallel_forward=True)
    with torch.no_grad():
        want = twin_serial(x, lengths=lengths)
        for _ in range(2):
            got = twin(x, lengths=lengths)
            assert _rel(got[0], want[0]) <= 1e-12 and _rel(_finals(got[1]), _finals(want[1])) <= 1e-12
    assert twin_serial.forward_stats == [None, None] and all(st["sweeps"] >= 1 for st in twin.forward_stats)


# -- the ops --------------------------------------------------------------------------------------


def _op_args(cell, dtype, with_lengths, grad=True):
    """The forward op's tensors: (x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths); c0 and w_hr where the cell has
    them (``lstm_proj``: the LSTM's op with a projection)."""
    gen = torch.Generator().manual_seed(4)
    c = CELLS["lstm" if cell == "lstm_proj" else cell]
    G, P, T, B = c.gates, (4 if cell == "lstm_proj" else H), 5, 3

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad)

    lengths = torch.tensor([5, 1, 3]) if with_lengths else None
    c0 = r(B, H) if c.cell_state else None
    w_hr = r(P, H) if cell == "lstm_proj" else None
    return (r(T, B, I), r(B, P), c0, r(G * H, I), r(G * H, P), r(G * H), r(G * H), w_hr, lengths)


OP_CELLS = ["rnn", "rnn_relu", "gru", "lstm", "lstm_proj"]


def _op_name(cell):
    return "lstm" if cell == "lstm_proj" else cell


@pytest.mark.parametrize("with_lengths", [False, True], ids=["full", "lengths"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cell", OP_CELLS)
def test_opcheck(cell, dtype, with_lengths):
    """torch.library.opcheck on the forward op (its fake, its autograd formula, AOT dispatch) and the backward op."""
    args = _op_args(cell, dtype, with_lengths)
    backend = "torch" if dtype == torch.float64 else "cpu"  # the forward's autograd formula runs the backward op
    name = _op_name(cell)
    torch.library.opcheck(ops.OPS[name], args + (backend, "fused", None, 1))
    x, h0, c0, *w, lengths = (t.detach() if t is not None else None for t in args)
    h, _, c, _ = ops.OPS[name](x, h0, c0, *w, lengths, "cpu", "fused", None, 1)
    gen = torch.Generator().manual_seed(5)
    grads = (torch.randn(h.shape, generator=gen, dtype=dtype), torch.randn(h.shape[1:], generator=gen, dtype=dtype),
             torch.randn(c.shape[1:], generator=gen, dtype=dtype) if c0 is not None else None)
    torch.library.opcheck(ops.BACKWARD_OPS[name], (x, h0, c0, *w, lengths, h, c, *grads, True, True, "cpu", "fused",
                                                   None))


@pytest.mark.parametrize("with_lengths", [False, True], ids=["full", "lengths"])
@pytest.mark.parametrize("cell", OP_CELLS)
def test_gradcheck_fp64(cell, with_lengths):
    x, h0, c0, *w, lengths = _op_args(cell, torch.float64, with_lengths)
    c = CELLS[_op_name(cell)]
    for backend in ("torch", "cpu"):
        def f(x, h0, c0, *w, backend=backend):
            out = ops.layer(c, x, (h0, c0), Weights(*w), lengths, nn_backward.Options(backend))
            return tuple(t for t in out if t is not None)

        # fast mode: vᵀJu against the analytic vᵀ(J u) for random u, v (torch's own fast gradcheck), one backward
        # instead of one per output element; the elementwise equality with autograd is test_gradients_equal_...
        assert torch.autograd.gradcheck(f, (x, h0, c0, *w), fast_mode=True)


def test_every_op_has_a_cuda_kernel():
    """The CUDA registration (the tensors' device made current, then the backends resolve on it) exists even
    where this torch cannot run it."""
    for cell in CELLS:
        for name in (cell, f"{cell}_backward"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"bppsa::{name}", "CUDA"), name


def test_eager_mode_does_not_import_the_compiler():
    """A custom op's first call imports torch._dynamo (~2 s a process on two vCPUs, paid by every workflow job);
    eager mode runs the op's functions as an autograd.Function instead."""
    code = ("import sys, torch, bppsa.nn as bnn\n"
            "for cls in (bnn.RNN, bnn.GRU, bnn.LSTM):\n"
            f"    out, h_n = cls({I}, {H}, backend='cpu')(torch.randn(9, 4, {I}))\n"  # kernels built
            "    (out.sum() + (h_n[0] if isinstance(h_n, tuple) else h_n).sum()).backward()\n"
            "print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False", "eager bppsa.nn imported torch._dynamo"
    assert "Exception ignored" not in r.stderr, r.stderr[-2000:]  # nothing left to fail at the interpreter's exit


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_double_backward_raises(cell):
    x, h0, c0, *w, lengths = _op_args(cell, torch.float64, False)
    h, h_n, _ = ops.layer(CELLS[cell], x, (h0, c0), Weights(*w), lengths, nn_backward.Options("torch"))
    (gx,) = torch.autograd.grad(h_n.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        gx.sum().backward()


# -- training steps ---------------------------------------------------------------------------------


class _Tagger(torch.nn.Module):
    """A sequence labeller on padded batches: a loss at every valid step and on h_n (and an LSTM's c_n)."""

    def __init__(self, backend: str, cls=bnn.GRU):
        super().__init__()
        self.gru = cls(I, H, num_layers=2, batch_first=True, backend=backend)
        self.head = torch.nn.Linear(H, 4)

    def forward(self, x, lengths, y):
        out, h_n = self.gru(x, lengths=lengths)
        loss = torch.nn.functional.cross_entropy(self.head(out).flatten(0, 1), y.flatten())
        return loss + _finals(h_n).square().mean()


def _step(model, fn, batch):
    for p in model.parameters():
        p.grad = None
    loss = fn(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _batch():
    gen = torch.Generator().manual_seed(6)
    return torch.randn(4, 7, I, generator=gen), torch.tensor([7, 2, 5, 1]), torch.randint(0, 4, (4, 7), generator=gen)


def _compiled_step(compile_backend: str, device: str | torch.device = "cpu", backend: str = "cpu", cls=bnn.GRU):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch.manual_seed(7)
    eager = _Tagger(backend, cls).to(device)
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
    op = f"torch.ops.bppsa.{eager.gru.cell.name}"
    assert any(op in g.code for g in seen.graphs), [g.code for g in seen.graphs]
    return got, _step(eager, eager, batch)


@pytest.mark.parametrize("cls", [bnn.GRU, bnn.LSTM])
def test_compiled_training_step_has_no_graph_break_and_equals_eager(cls):
    """fullgraph=True through dynamo and AOTAutograd (the ops' fake and autograd formulas); the graph runs
    eagerly, so the numbers are eager's bit for bit."""
    (loss, grads), (loss_ref, grads_ref) = _compiled_step("aot_eager", cls=cls)
    assert torch.equal(loss, loss_ref) and all(torch.equal(a, b) for a, b in zip(grads, grads_ref))


@pytest.mark.slow  # inductor's C++ compile: ~50 s on two cores the first time, ~8 s from its cache
def test_inductor_training_step_equals_eager():
    (loss, grads), (loss_ref, grads_ref) = _compiled_step("inductor")
    assert _rel(loss, loss_ref) <= 1e-4 and max(_rel(a, b) for a, b in zip(grads, grads_ref)) <= 1e-4


@pytest.mark.parametrize("cls", [bnn.GRU, bnn.LSTM])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_two_backward_runs_are_bitwise_equal(backend, cls):
    _two_backward_runs_are_bitwise_equal(backend, torch.device("cpu"), cls)


def _two_backward_runs_are_bitwise_equal(backend: str, device: torch.device, cls=bnn.GRU):
    torch.manual_seed(8)
    model = _Tagger(backend, cls).to(device)
    model.gru.L_m = None
    x, lengths, y = _batch()
    x, y = x.to(device), y.to(device)
    full = torch.full((4,), 7)
    for lens in (lengths, full):
        first = _step(model, model, (x, lens, y))[1]
        second = _step(model, model, (x, lens, y))[1]
        assert all(torch.equal(a, b) for a, b in zip(first, second))
    rnn = (bnn.RNN if cls is bnn.GRU else cls)(I, H, backend=backend, device=device)
    xs = torch.randn(1000, 16, I).to(device)
    runs = []
    for _ in range(2):
        rnn.zero_grad()
        _finals(rnn(xs)[1]).sum().backward()
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


@pytest.mark.parametrize("cell", ["rnn", "rnn_relu", "gru", "lstm", "lstm_proj"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bi", [False, True], ids=["uni", "bi"])
def test_state_dict_round_trips_with_torch(cell, bias, bi):
    """torch's parameter names in torch's order (``_reverse``, ``weight_hr``), its initialisation's bounds,
    load_state_dict(strict=True) both ways, from_torch and to_torch."""
    ours_cls, torch_cls, kw = CLASSES[cell]
    t = torch_cls(I, H, num_layers=2, bias=bias, batch_first=True, bidirectional=bi, **kw)
    ours = ours_cls(I, H, 2, **({"nonlinearity": kw.get("nonlinearity", "tanh")} if torch_cls is torch.nn.RNN else {}),
                    bias=bias, batch_first=True, bidirectional=bi, **{k: v for k, v in kw.items() if k == "proj_size"})
    assert list(ours.state_dict()) == list(t.state_dict())
    assert [p.shape for p in ours.parameters()] == [p.shape for p in t.parameters()]
    bound = 1 / H ** 0.5
    assert all(p.abs().max() <= bound for p in ours.parameters())
    ours.load_state_dict(t.state_dict(), strict=True)
    back = torch_cls(I, H, num_layers=2, bias=bias, batch_first=True, bidirectional=bi, **kw)
    back.load_state_dict(ours.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), t.state_dict().values()))
    conv = ours_cls.from_torch(t).to_torch()
    assert type(conv) is torch_cls and conv.batch_first and conv.num_layers == 2 and conv.bias == bias
    assert conv.bidirectional == bi and conv.proj_size == kw.get("proj_size", 0)
    assert getattr(conv, "nonlinearity", None) == getattr(t, "nonlinearity", None)
    assert all(torch.equal(a, b) for a, b in zip(conv.state_dict().values(), t.state_dict().values()))


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: bnn.RNN(I, H, nonlinearity="sigmoid"), "nonlinearity='sigmoid'"),
    (lambda: bnn.GRU(I, H, proj_size=2), "proj_size"),
    (lambda: bnn.LSTM(I, H, proj_size=H), "proj_size"),
    (lambda: bnn.LSTM(I, H, proj_size=-1), "proj_size"),
    (lambda: bnn.GRU(I, H, dtype=torch.float16), "half precision"),
    (lambda: bnn.RNN(I, H, dtype=torch.bfloat16), "half precision"),
    (lambda: bnn.LSTM(I, H, dtype=torch.bfloat16), "half precision"),
    (lambda: bnn.GRU(I, H, backend="tpu"), "unknown backend 'tpu'"),
    (lambda: bnn.GRU(I, H, layout="paper"), "unknown layout 'paper'"),
    (lambda: bnn.LSTM(I, H, layout="paper"), "unknown layout 'paper'"),
    (lambda: bnn.RNN(I, H, L_m=-1), "L_m"),
    (lambda: bnn.GRU(I, H, L_m="full"), "L_m must be 'auto'"),
    (lambda: bnn.LSTM(I, H, L_m=True), "L_m must be 'auto'"),
    (lambda: bnn.GRU(I, H, bidirectional=True, process_group=object()), "bidirectional=True with a process_group"),
    (lambda: bnn.LSTM.from_torch(torch.nn.GRU(I, H)), "takes a LSTM"),
    (lambda: bnn.GRU(I, H, parallel_forward=2), "parallel_forward"),
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
    with pytest.raises(ValueError, match="h_0 must be"):
        gru(x, torch.zeros(2, 2, H))
    with pytest.raises(ValueError, match="hx must be one tensor"):
        gru(x, (torch.zeros(1, 2, H), torch.zeros(1, 2, H)))
    lstm = bnn.LSTM(I, H, backend="torch")
    with pytest.raises(ValueError, match=re.escape("hx must be a tuple (h_0, c_0)")):
        lstm(x, torch.zeros(1, 2, H))
    with pytest.raises(ValueError, match="c_0 must be"):
        lstm(x, (torch.zeros(1, 2, H), torch.zeros(1, 2, H + 1)))
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
@pytest.mark.parametrize("cell", ["rnn", "rnn_relu", "gru", "lstm"])
def test_cupy_factored_backend_emulated(cell, emulated_cupy_factored):
    """The layers on the factored CUDA kernels: the harness's step (the kernels sum the weights' gradients),
    the single seed with h0 and ∇x (the kernels' scan), per-step gradients (the kernels' affine sums; with ∇x their
    affine scan; variable lengths: the twin).  The relu RNN's factors are torch's, scanned by the same kernels; the
    LSTM's chain has no CUDA kernel: the twin's dense scan, on the same device."""
    calls = emulated_cupy_factored
    calls.clear()
    ours_cls, torch_cls, kw = CLASSES[cell]
    for case in [(9, 17, True, False, 1, False, False, "hn", False), (7, 3, False, True, 2, True, False, "hn", True),
                 (37, 5, True, False, 1, False, False, "both", False),
                 (9, 3, False, True, 1, True, False, "steps", True),
                 (7, 3, True, False, 1, True, True, "both", True)]:
        T, B, bias, batch_first, layers, with_h0, with_lengths, loss_kind, dx = case
        torch.manual_seed(T + B)
        ref = torch_cls(I, H, num_layers=layers, bias=bias, batch_first=batch_first, dtype=torch.float64, **kw)
        got = ours_cls.from_torch(ref, backend="cupy-factored")
        gen = torch.Generator().manual_seed(T)
        shape = (B, T, I) if batch_first else (T, B, I)
        x = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_(dx)
        S = 2 * H if torch_cls is torch.nn.LSTM else H
        h0 = None
        if with_h0:
            h0 = torch.randn(layers, B, H, generator=gen, dtype=torch.float64)
            h0 = (h0, torch.randn(layers, B, H, generator=gen, dtype=torch.float64)) if S > H else h0
        lengths = _lengths(T, B, gen) if with_lengths else None
        w_out = torch.randn(shape[:2] + (H,), dtype=torch.float64)
        w_hn = torch.randn(layers * B * S, dtype=torch.float64)
        want = _run(ref, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours=False)[0]
        have = _run(got, x, h0, lengths, loss_kind, batch_first, w_out, w_hn, ours=True)[0]
        assert max(_rel(have[k], want[k]) for k in want) <= 1e-10, case
    # case 2's first layer takes the second's ∇x at every step; variable lengths (the last case) go to the twin
    expected = [] if cell == "lstm" else ["sums", "scan", "affine scan", "affine sums", "affine scan"]
    assert [c for c in calls if c != "gru factors"] == expected
    assert ("gru factors" in calls) == (cell == "gru")  # the GRU's factors by their kernel


# -- on a GPU (skipped without one): the CuPy backends, torch's current stream, CUDA graphs --------------------

GPU_BACKENDS = ("cupy-factored", "cupy")  # 'auto' on a GPU is cupy-factored
GPU_GRID = _grid(GPU_BACKENDS)


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
@pytest.mark.parametrize("cell", OP_CELLS)
def test_gpu_opcheck(cell, dtype, with_lengths, backend, cuda_fp32):
    args = tuple(t.detach().to(cuda_fp32).requires_grad_() if t is not None and t.is_floating_point() else t
                 for t in _op_args(cell, dtype, with_lengths))
    torch.library.opcheck(ops.OPS[_op_name(cell)], args + (backend, "fused", None, 1))


def _graph_loss(model, x, w, loss_kind):
    out, h_n = model(x)
    h_n = h_n[0] + h_n[1] if isinstance(h_n, tuple) else h_n  # an LSTM's (h_n, c_n): both read
    loss = (h_n * w[-1]).sum()
    return loss + (out * w[:-1]).sum() if loss_kind == "both" else loss


@pytest.mark.gpu
@pytest.mark.parametrize("loss_kind", ["hn", "both"])  # the single seed (the factored kernels); every step (twin)
@pytest.mark.parametrize("cell", ["rnn", "gru", "lstm"])
def test_gpu_training_step_captured_in_a_cuda_graph(cell, loss_kind, cuda_fp32):
    """A whole forward and backward captured in one CUDA graph (the launches on torch's current stream,
    nothing synchronising) and replayed on new inputs gives eager mode's gradients bit for bit, also after
    eager calls of another shape have run on the same backend in between."""
    dev = cuda_fp32
    T, B = 37, 16
    torch.manual_seed(9)
    model = CLASSES[cell][0](I, H, num_layers=2, backend="cupy-factored", device=dev, **CLASSES[cell][2])
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
