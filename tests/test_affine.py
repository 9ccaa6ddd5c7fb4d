"""bppsa.nn.affine_scan, the differentiable linear recurrence h_t = A_t h_{t-1} + b_t, against autograd of the loop."""
from __future__ import annotations

import pytest
import torch

import bppsa.nn as bnn
from bppsa.nn import affine as affine_mod
from bppsa.nn import backward as nn_backward
from bppsa.scan import affine_blelloch_scan, affine_diagonal_scan, affine_linear_scan, num_levels

B, H = 3, 4


def _rel(got, ref) -> float:
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return float((got - ref).abs().max()) / (scale if scale > 0 else 1.0) if ref.numel() else 0.0


def _loop(A, b, h0):
    """The sequential recurrence, differentiated by autograd: the reference."""
    x = h0 if h0 is not None else torch.zeros_like(b[0])
    out = []
    for t in range(b.shape[0]):
        x = (torch.matmul(A[t], x.unsqueeze(-1)).squeeze(-1) if A.dim() == 4 else A[t] * x) + b[t]
        out.append(x)
    return torch.stack(out)


def _operands(T, dense, dtype, seed, h0=True):
    gen = torch.Generator().manual_seed(seed)
    A = (torch.randn(T, B, H, H, generator=gen, dtype=dtype) / H ** 0.5 if dense
         else torch.rand(T, B, H, generator=gen, dtype=dtype) * 1.6 - 0.8)
    b = torch.randn(T, B, H, generator=gen, dtype=dtype)
    x0 = torch.randn(B, H, generator=gen, dtype=dtype) if h0 else None
    w = torch.randn(T, B, H, generator=gen, dtype=dtype)
    return A, b, x0, w


def _grads(fn, A, b, h0, w):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (A, b, h0)]
    h = fn(*leaves)
    (h * w).sum().backward()
    return h.detach(), [t.grad for t in leaves if t is not None]


TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "diagonal"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_equals_autograd_of_the_loop(backend, dense, dtype):
    """Values and the gradients of A, b and h0, on lengths that are not powers of two, every L_m, with and
    without h0."""
    for T, L_m, h0 in ((1, None, True), (2, None, False), (13, None, True), (37, 0, True), (37, 2, False),
                       (100, None, True)):
        A, b, x0, w = _operands(T, dense, dtype, seed=T, h0=h0)
        h_ref, g_ref = _grads(_loop, A, b, x0, w)
        h, g = _grads(lambda a, bb, x, L_m=L_m: bnn.affine_scan(a, bb, x, backend=backend, L_m=L_m), A, b, x0, w)
        assert h.shape == (T, B, H) and len(g) == len(g_ref)
        assert _rel(h, h_ref) <= TOL[dtype], (T, L_m)
        for name, got, ref in zip(("A", "b", "h0"), g, g_ref):
            assert _rel(got, ref) <= TOL[dtype], (T, L_m, name, _rel(got, ref))


def test_the_diagonal_tree_is_the_dense_tree():
    """affine_diagonal_scan runs affine_blelloch_scan's tree on diagonals: equal to it and to the recurrence."""
    for n in (0, 1, 2, 3, 17, 64):
        gen = torch.Generator().manual_seed(n)
        g = torch.randn(B, H, generator=gen, dtype=torch.float64)
        D = torch.rand(n, B, H, generator=gen, dtype=torch.float64)
        c = torch.randn(n, B, H, generator=gen, dtype=torch.float64)
        ref = affine_linear_scan(g, torch.diag_embed(D), c)
        for L_m in [None] + list(range(num_levels(n + 1) + 1)):
            out = affine_diagonal_scan(g, D, c, L_m)
            assert out.shape == (n, B, H)
            if n:
                assert _rel(out, affine_blelloch_scan(g, torch.diag_embed(D), c, L_m)) <= 1e-15
                assert _rel(out, ref) <= 1e-12


def test_backward_keeps_only_A_the_states_and_h0():
    """Memory linear in T: what autograd saves is A, h and h0 (no level of the tree), and the backward is the
    reverse scan (affine_prefixes), not autograd through the forward's tree."""
    A, b, x0, w = _operands(50, True, torch.float64, seed=3)
    A.requires_grad_()
    b.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        h = bnn.affine_scan(A, b, x0, backend="torch")
    assert sorted(saved) == sorted([A.numel(), x0.numel(), h.numel()])
    calls = []
    real = nn_backward.affine_prefixes
    try:
        nn_backward.affine_prefixes = lambda *a, **k: calls.append(a[2].shape) or real(*a, **k)
        (h * w).sum().backward()
    finally:
        nn_backward.affine_prefixes = real
    assert calls == [torch.Size((49, B, H, H))]  # one reverse scan over the transposed A_2 .. A_T


def test_opcheck():
    for dense in (True, False):
        A, b, x0, w = _operands(11, dense, torch.float64, seed=5)
        torch.library.opcheck(affine_mod.affine_scan_op, (A.requires_grad_(), b.requires_grad_(),
                                                          x0.requires_grad_(), "torch", None))
        h = bnn.affine_scan(A.detach(), b.detach(), x0.detach())
        torch.library.opcheck(affine_mod.affine_scan_backward_op, (A.detach(), h, x0.detach(), w, True, "torch", None))


def test_compiled_equals_eager_without_a_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    seen = CompileCounterWithBackend("aot_eager")

    def loss(A, b, x0, w):
        return (bnn.affine_scan(torch.tanh(A), b, x0) * w).sum()

    compiled = torch.compile(loss, fullgraph=True, backend=seen)
    A, b, x0, w = _operands(9, True, torch.float64, seed=8)
    _, got = _grads(lambda a, bb, x: compiled(a, bb, x, w).reshape(1), A, b, x0, torch.ones(1, dtype=A.dtype))
    _, ref = _grads(lambda a, bb, x: loss(a, bb, x, w).reshape(1), A, b, x0, torch.ones(1, dtype=A.dtype))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert any("torch.ops.bppsa.affine_scan" in g.code for g in seen.graphs)
    assert all(torch.equal(x, y) for x, y in zip(got, ref))


def test_the_layers_per_step_backward_runs_the_same_scan():
    """One mechanism: a loss at every step of a bppsa.nn layer (lengths apart) scans through affine_prefixes."""
    calls = []
    real = nn_backward.affine_prefixes
    gru = bnn.GRU(3, H, backend="torch").double()
    x = torch.randn(7, 2, 3, dtype=torch.float64)
    try:
        nn_backward.affine_prefixes = lambda *a, **k: calls.append(1) or real(*a, **k)
        out, _ = gru(x, lengths=[7, 4])
        out.sum().backward()
    finally:
        nn_backward.affine_prefixes = real
    assert calls == [1]


def test_refusals_name_the_argument():
    A, b, x0, _ = _operands(5, True, torch.float64, seed=1)
    with pytest.raises(ValueError, match="A must be"):
        bnn.affine_scan(A[..., :2], b)
    with pytest.raises(ValueError, match="b must be"):
        bnn.affine_scan(A, b[0])
    with pytest.raises(ValueError, match="h0 must be"):
        bnn.affine_scan(A, b, x0[:1])
    with pytest.raises(TypeError, match="A is torch.float32"):
        bnn.affine_scan(A.float(), b)
    with pytest.raises(ValueError, match="unknown backend"):
        bnn.affine_scan(A, b, backend="nope")
    h = bnn.affine_scan(A.requires_grad_(), b)
    dA, = torch.autograd.grad(h.sum(), A, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dA.sum().backward()
