"""The cells of bppsa.nn (issue 48): each cell's transposed Jacobian against autograd's Jacobian of one torch.nn step,
block by block; the LSTM's recomputed cell states; one contract for every cell."""
import pytest
import torch

from bppsa.jacobians.lstm import lstm_gate_grads, lstm_gates, lstm_jacobians_t
from bppsa.nn.backward import Options, plan
from bppsa.nn.cells import CELLS, Incoming, Needs, Saved, Weights

F64 = torch.float64


def _module(cell: str, I: int, H: int, proj: int = 0):
    kw = {"nonlinearity": "relu"} if cell == "rnn_relu" else ({"proj_size": proj} if proj else {})
    return CELLS[cell].torch_cls(I, H, dtype=F64, **kw)


def _weights(m) -> Weights:
    return Weights(*(getattr(m, f"{n}_l0", None) for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh",
                                                             "weight_hr")))


def _step_jacobian(m, cell, x_t, s_prev, P):
    """autograd's ∂s_t/∂s_{t-1} of one torch.nn step, the state s = h or [h; c]."""
    def f(s):
        if CELLS[cell].cell_state:
            _, (h, c) = m(x_t, (s[:P].view(1, 1, P), s[P:].view(1, 1, -1)))
            return torch.cat([h.view(-1), c.view(-1)])
        return m(x_t, s.view(1, 1, -1))[1].view(-1)

    return torch.autograd.functional.jacobian(f, s_prev)


@pytest.mark.parametrize("cell, proj", [("rnn", 0), ("rnn_relu", 0), ("gru", 0), ("lstm", 0), ("lstm", 3)])
def test_every_block_of_the_transposed_jacobian_equals_autograds(cell, proj):
    """The twin's dense chain (what every backend is held to), step by step, against autograd: a block left out of
    the LSTM's (the c path diag(f), diag(f a), the input/forget/cell gates' W_hqᵀ diag(c_q), the output gate's, the
    projection) moves its block of the error far above 1e-12."""
    torch.manual_seed(0)
    T, B, I, H = 6, 3, 2, 4
    m = _module(cell, I, H, proj)
    c = CELLS[cell]
    w = _weights(m)
    P = w.out_size
    x = torch.randn(T, B, I, dtype=F64)
    h0 = torch.randn(B, P, dtype=F64)
    c0 = torch.randn(B, H, dtype=F64) if c.cell_state else None
    with torch.no_grad():
        h, cs = c.forward(x, h0, c0, w, None)
        s = Saved(x, h, cs, h0, c0)
        from bppsa.backends import TorchBackend

        J = c.chain(TorchBackend(), s, w).clone()  # scan order: J[k] is step T - k
    states = c.saved_states(s)
    s0 = c.state(h0, c0)
    S = states.shape[-1]
    for t in range(T):
        prev = states[t - 1] if t else s0
        for b in range(B):
            want = _step_jacobian(m, cell, x[t:t + 1, b:b + 1], prev[b], P).t()  # the transposed Jacobian
            got = J[T - 1 - t, b]
            for rows, cols in ((slice(0, P), slice(0, P)), (slice(0, P), slice(P, S)), (slice(P, S), slice(0, P)),
                               (slice(P, S), slice(P, S))):
                if want[rows, cols].numel():
                    assert (got[rows, cols] - want[rows, cols]).abs().max() <= 1e-12, (cell, t, b, rows, cols)


@pytest.mark.parametrize("proj", [0, 3])
def test_lstm_gate_gradients_give_the_jacobians_transpose(proj):
    """λ_{t-1} = J_tᵀ λ_t, computed as the gates' gradients do it (W_hhᵀ dpre, f dc), equals the dense chain's."""
    torch.manual_seed(1)
    T, B, I, H = 5, 2, 3, 4
    m = _module("lstm", I, H, proj)
    w = _weights(m)
    P = w.out_size
    x = torch.randn(T, B, I, dtype=F64)
    with torch.no_grad():
        h, c = CELLS["lstm"].forward(x, None, None, w, None)
        g = lstm_gates(x, h, c, w.w_ih, w.w_hh, w.b_ih, w.b_hh)
        J = lstm_jacobians_t(g, w.w_hh, w.w_hr)
        lam = torch.randn(T, B, P + H, dtype=F64)
        dpre, _, dc = lstm_gate_grads(g, lam[..., :P], lam[..., P:], w.w_hr)
        prev = torch.einsum("tbij,tbj->tbi", J.flip(0), lam)
    assert torch.allclose(prev[..., :P], dpre @ w.w_hh, atol=1e-12, rtol=0)
    assert torch.allclose(prev[..., P:], g.f * dc, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_lstm_cell_states_recomputed_by_the_diagonal_scan(dtype, tol, with_lengths):
    """torch's LSTM kernels return every h_t but only the last c: the cell states c_1 .. c_T the backward needs come
    from the gates and the parallel scan of c_t = f_t c_{t-1} + i_t g_t; here against a step-by-step torch.nn.LSTM
    (T = 301, not a power of two), the steps past a sequence's end carrying its state."""
    torch.manual_seed(2)
    T, B, I, H = 301, 4, 3, 5
    m = torch.nn.LSTM(I, H, dtype=dtype)
    w = _weights(m)
    x = torch.randn(T, B, I, dtype=dtype)
    h0, c0 = torch.randn(B, H, dtype=dtype), torch.randn(B, H, dtype=dtype)
    lengths = torch.tensor([T, 1, 150, 7]) if with_lengths else None
    with torch.no_grad():
        _, c = CELLS["lstm"].forward(x, h0, c0, w, lengths)
        want, state = [], (h0[None], c0[None])
        for t in range(T):
            _, (hn, cn) = m(x[t:t + 1], state)
            if lengths is not None:  # a sequence that has ended keeps its state
                run = (t < lengths)[None, :, None]
                hn, cn = torch.where(run, hn, state[0]), torch.where(run, cn, state[1])
            state = (hn, cn)
            want.append(cn[0])
    want = torch.stack(want)
    assert ((c - want).abs().max() / want.abs().max()).item() <= tol


@pytest.mark.parametrize("cell", list(CELLS))
def test_one_contract_for_every_cell(cell):
    """What the backward asks of a cell, for every cell: a state size that the chain, the plan's seed and the
    gradients agree on; the weights' gradients by name; the initial state's gradient where asked for."""
    torch.manual_seed(3)
    c = CELLS[cell]
    T, B, I, H = 4, 2, 3, 5
    m = _module(cell, I, H)
    w = _weights(m)
    x = torch.randn(T, B, I, dtype=F64)
    with torch.no_grad():
        h, cs = c.forward(x, None, None, w, None)
    s = Saved(x, h, cs)
    S = c.state_size(w)
    assert c.saved_states(s).shape == (T, B, S)
    inc = Incoming(torch.randn(T, B, H, dtype=F64), None, torch.randn(B, H, dtype=F64) if c.cell_state else None)
    p = plan(c, s, inc, Needs(x=True, state0=True))
    assert p.seed.shape == (B, S) and p.direct.shape == (T, B, S) and p.past is None and not p.sums
    from bppsa.nn.backward import run

    dx, ds0, grads = run(c, s, w, inc, Needs(x=True, state0=True), Options("torch"))
    assert dx.shape == x.shape and ds0.shape == (B, S)
    assert {k: v.shape for k, v in grads.items()} == {f"{n}_l0": getattr(m, f"{n}_l0").shape
                                                      for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
