"""The sliced forward (bppsa.backends.cpu.sliced): at tol = 0 the serial compiled forward's bits, and torch's forward
within 1e-12 (fp64) / 1e-6 (fp32), for layers that forget (torch's init on bitstreams) and layers that remember
(bppsa.bench.forward.make_layer: an LSTM with a large forget-gate bias, a tanh RNN with W_hh = 0.999 orthogonal and
small inputs), lengths that end inside a slice, 1 to 4 slices; the Jacobi sweeps, the hand-off and the guess; the
error bound of a tolerance."""
import pytest
import torch
from test_cpu_forward import TOL, bitstreams, layer, one_torch_thread, rel_err, torch_states, weights  # noqa: F401

from bppsa.backends.cpu import forward, native, sliced
from bppsa.bench.forward import make_layer

pytestmark = pytest.mark.skipif(native.target() is None, reason="no C compiler")
H = 20


def remembering(cell, dtype, seed=0):
    return make_layer(cell, 1, H, dtype, "remembers", seed)


def case(cell, dtype, T, B, *, remember=False, seed=0):
    m = remembering(cell, dtype, seed) if remember else layer(cell, 1, H, dtype, seed)
    x = bitstreams(T, B, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    h0 = torch.rand(B, H, generator=gen, dtype=dtype) - 0.5
    c0 = torch.rand(B, H, generator=gen, dtype=dtype) - 0.5 if cell == "lstm" else None
    return m, x, h0, c0


def serial(cell, m, x, h0, c0, lengths=None):
    return forward.compiled_forward(cell, x, h0, c0, *weights(m), lengths=lengths)


def check_exact(cell, m, x, h0, c0, slices, lengths=None, **kw):
    h, c, stats = sliced.sliced_forward(cell, x, h0, c0, weights(m), lengths, slices, **kw)
    sh, sc = serial(cell, m, x, h0, c0, lengths)
    assert torch.equal(h, sh), (cell, slices, stats)
    assert c is None if cell != "lstm" else torch.equal(c, sc)
    return h, c, stats


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cell", ["rnn_tanh", "gru", "lstm"])
def test_layers_that_forget_give_the_serial_bits_and_torch_s_states(cell, dtype):
    m, x, h0, c0 = case(cell, dtype, 1201, 5)
    for slices in (1, 2, 3, 4):
        h, c, stats = check_exact(cell, m, x, h0, c0, slices)
        if slices == 1:
            assert stats["sweeps"] == 1 and not stats["meet_steps"]
        elif cell != "rnn_tanh":  # they meet within their slices: the Jacobi sweeps converged, no hand-off
            assert not stats["fallback"] and stats["sweeps"] <= slices, stats
            assert all(s < 1201 // slices for sweep in stats["meet_steps"] for s in sweep.values()), stats
    ref_h, ref_c = torch_states(cell, m, x, h0, c0 if c0 is not None else torch.zeros_like(h0))
    assert rel_err(h, ref_h) <= TOL[dtype] and (c is None or rel_err(c, ref_c) <= TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cell", ["rnn_tanh", "lstm"])
def test_layers_that_remember_give_the_serial_bits_and_torch_s_states(cell, dtype):
    """fp64 within 1e-12 of torch.  In fp32 a remembering LSTM's states are ill-conditioned: torch's own fp32 forward
    is up to ~3e-5 (relative) from the fp64 states of the same weights, so the fp32 states are held to the fp64
    truth: within 1e-6, or within 3x torch's own fp32 error where that is larger."""
    m, x, h0, c0 = case(cell, dtype, 801, 3, remember=True)
    for slices in (2, 4):
        h, c, stats = check_exact(cell, m, x, h0, c0, slices)
        # no slice meets: every correction runs its slice to the end; beyond max_sweeps the hand-off finishes
        assert stats["fallback"] == (slices > sliced.MAX_SWEEPS), stats
    start = (h0, c0 if c0 is not None else torch.zeros_like(h0))
    ref = torch_states(cell, m, x, *start)
    if dtype == torch.float64:
        assert rel_err(h, ref[0]) <= TOL[dtype] and (c is None or rel_err(c, ref[1]) <= TOL[dtype])
        return
    m64 = layer(cell, 1, H, torch.float64, 0)
    with torch.no_grad():
        for name, p in m64.named_parameters():
            p.copy_(dict(m.named_parameters())[name])
    truth = torch_states(cell, m64, x.double(), *(s.double() for s in start))
    for ours, theirs, exact in ((h, ref[0], truth[0]), (c, ref[1], truth[1])):
        if ours is not None:
            assert rel_err(ours.double(), exact) <= max(TOL[dtype], 3 * rel_err(theirs.double(), exact))


@pytest.mark.parametrize("cell", ["rnn_relu", "gru", "lstm"])
def test_lengths_that_end_inside_a_slice(cell):
    dtype, T = torch.float32, 900
    m, x, h0, c0 = case(cell, dtype, T, 9)
    lengths = torch.tensor([900, 1, 299, 300, 301, 450, 610, 899, 900])
    for slices in (2, 3, 4):
        h, c, _ = check_exact(cell, m, x, h0, c0, slices, lengths)
    ref_h, ref_c = torch_states(cell, m, x, h0, c0 if c0 is not None else torch.zeros_like(h0), lengths)
    assert rel_err(h, ref_h) <= TOL[dtype] and (c is None or rel_err(c, ref_c) <= TOL[dtype])


def test_the_hand_off_finishes_what_the_sweeps_leave_and_threads_change_no_bit():
    cell, dtype = "rnn_tanh", torch.float64
    m, x, h0, c0 = case(cell, dtype, 400, 2, remember=True)
    h1, _, stats = check_exact(cell, m, x, h0, c0, 4, max_sweeps=1, threads=1)
    assert stats["sweeps"] == 1 and stats["handoff"] == [1, 2, 3] and stats["fallback"]
    h2, _, _ = check_exact(cell, m, x, h0, c0, 4, max_sweeps=2, threads=2)
    assert torch.equal(h1, h2)


def test_the_last_call_s_starts_are_a_guess_that_needs_no_correction():
    cell, dtype = "lstm", torch.float32
    m, x, h0, c0 = case(cell, dtype, 600, 4)
    _, _, first = check_exact(cell, m, x, h0, c0, 3, guess=None)
    assert first["sweeps"] >= 2
    _, _, again = check_exact(cell, m, x, h0, c0, 3, guess="last")
    assert again["sweeps"] == 1 and not again["meet_steps"]
    _, _, given = check_exact(cell, m, x, h0, c0, 3, guess=first["starts"])
    assert given["sweeps"] == 1


def test_a_tolerance_keeps_the_error_within_its_bound():
    """tol > 0 on a forgetting tanh RNN (whose trajectories meet bitwise rarely): the slices meet, and the error
    against the serial forward stays within (K - 1) · tol · max|h| times the largest norm of the layer's Jacobian
    products along the way, here bounded by max‖W_hh‖∞ ≥ ‖diag(1 - h²) W_hh‖∞ per step and at most 1 from the second
    step on (measured below on the serial states)."""
    cell, dtype, T, K, tol = "rnn_tanh", torch.float64, 1600, 4, 1e-9
    m, x, h0, _ = case(cell, dtype, T, 6)
    h, _, stats = sliced.sliced_forward(cell, x, h0, None, weights(m), None, K, tol=tol)
    assert not stats["fallback"] and all(s < T // K for sweep in stats["meet_steps"] for s in sweep.values())
    sh, _ = serial(cell, m, x, h0, None)
    err = (h - sh).abs().max().item()
    # the largest ∞-norm of a product of the serial trajectory's Jacobians J_t = diag(1 - h_t²) W_hh, over products
    # of up to 64 steps (they shrink below 1e-3 well before: a layer that forgets)
    W = m.weight_hh_l0.detach()
    J = (1 - sh ** 2).unsqueeze(-1) * W  # [T, B, H, H]
    worst, P = 0.0, torch.eye(H, dtype=dtype).expand(T - 64, 6, H, H)
    for k in range(64):
        P = J[k:T - 64 + k] @ P
        worst = max(worst, P.abs().sum(-1).amax().item())
    bound = (K - 1) * tol * sh.abs().max().item() * max(1.0, worst)
    assert 0 < err <= bound, (err, bound)


@pytest.mark.parametrize("cell", ["rnn_tanh", "lstm"])
def test_a_rerun_of_one_slice_spreads_its_lanes_over_the_threads(cell, monkeypatch):
    """A batch of one register makes one job per slice: a correction of one slice then takes the lanes the serial
    forward takes on these threads (narrower on AVX-512), so it runs on them all; the bits stay the serial ones."""
    dtype, p, B = torch.float32, 2, 16
    m, x, h0, c0 = case(cell, dtype, 600, B, remember=True)
    calls, run = [], forward.run
    monkeypatch.setattr(forward, "run", lambda pb, jobs, threads: calls.append(len(jobs)) or run(pb, jobs, threads))
    h, c, stats = sliced.sliced_forward(cell, x, h0, c0, weights(m), None, 2, threads=p)
    monkeypatch.undo()
    assert stats["meet_steps"] and len(calls) == 2, (stats, calls)  # sweep 0, then slice 1's rerun
    assert calls[1] >= min(p, -(-B // forward.plan_lanes(B, dtype, p))), calls
    sh, sc = serial(cell, m, x, h0, c0)
    assert torch.equal(h, sh) and (c is None or torch.equal(c, sc))
