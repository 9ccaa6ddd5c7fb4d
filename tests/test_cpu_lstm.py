"""The LSTM's factored chain (bppsa.backends.chain.LstmChain) and its compiled kernel kind (chain_scan.c's KIND 3),
held to the dense chain the chain stands for, the torch twin's scans over it, and autograd of torch.nn.LSTM."""
import math

import pytest
import torch

from bppsa import scan
from bppsa.backends import TorchBackend
from bppsa.backends.chain import LstmChain, LstmStates
from bppsa.backends.cpu import CpuBackend, native, plan
from bppsa.backends.cpu.chain import chain_product, native_chain_scan
from bppsa.jacobians.lstm import LstmGates, lstm_factors, lstm_gate_grads, lstm_gates, lstm_jacobians_t
from bppsa.jacobians.recurrent import rnn_jacobians_t


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def _rel_grads(got: dict, ref: dict) -> float:
    assert got.keys() >= ref.keys(), (sorted(got), sorted(ref))
    for k in ref:
        assert got[k].shape == ref[k].shape, k
    return max(_rel(got[k], ref[k]) for k in ref)


class Case:
    """An LSTM layer (torch.nn.LSTM, random weights), a batch, its forward (every c_t at hand), the recomputed gates
    and the cell's parameter gradients from a scan's output (time order).

    ``forget``: added to the forget gate's bias, so that f ≈ σ(4) = 0.98 and the gradient reaches back through the
    whole chain (|λ| stays O(1) over 1000 steps): with f ≈ 0.5 it vanishes within ~10 steps (|λ| ~1e-15 at 64, the
    first block), and a scan's error beyond the spine would not show against its largest value."""

    def __init__(self, T, B, I, H, seed, dtype=torch.float64, scale=1.0, h0=True, bias=True, forget=4.0):
        gen = torch.Generator().manual_seed(seed)
        self.lstm = torch.nn.LSTM(I, H, bias=bias).to(dtype)
        with torch.no_grad():
            for p in self.lstm.parameters():
                p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=dtype) / math.sqrt(H))
            if bias:
                self.lstm.bias_ih_l0[H:2 * H] += forget
        self.x = torch.randn(T, B, I, generator=gen, dtype=dtype)
        self.h0 = torch.randn(B, H, generator=gen, dtype=dtype) if h0 else torch.zeros(B, H, dtype=dtype)
        self.c0 = torch.randn(B, H, generator=gen, dtype=dtype) if h0 else torch.zeros(B, H, dtype=dtype)
        self.T, self.B, self.I, self.H, self.dtype = T, B, I, H, dtype
        self.h, self.c = self._forward()
        self.g = torch.randn(B, 2 * H, generator=gen, dtype=dtype)

    @torch.no_grad()
    def _forward(self):
        """Every h_t and c_t, torch.nn.LSTM's equations step by step (it returns only the last c_t)."""
        m, (T, B, _), H = self.lstm, self.x.shape, self.H
        b = m.bias_ih_l0 + m.bias_hh_l0 if m.bias else self.x.new_zeros(4 * H)
        xin = torch.addmm(b, self.x.reshape(T * B, -1), m.weight_ih_l0.t()).view(T, B, -1)
        hs, cs, h, c = [], [], self.h0, self.c0
        for t in range(T):
            pre = torch.addmm(xin[t], h, m.weight_hh_l0.t())
            i, f, o = pre[:, :H].sigmoid(), pre[:, H:2 * H].sigmoid(), pre[:, 3 * H:].sigmoid()
            c = f * c + i * pre[:, 2 * H:3 * H].tanh()
            h = o * c.tanh()
            hs.append(h)
            cs.append(c)
        return torch.stack(hs), torch.stack(cs)

    @property
    def weights(self):
        m = self.lstm
        return (m.weight_ih_l0, m.weight_hh_l0, getattr(m, "bias_ih_l0", None), getattr(m, "bias_hh_l0", None))

    def states(self, h0=True):
        """What the kernel's own gate pass reads beside x and h."""
        W_ih, _, b_ih, b_hh = (None if t is None else t.detach() for t in self.weights)
        return LstmStates(self.c, W_ih, b_ih, b_hh, self.h0 if h0 else None, self.c0 if h0 else None)

    @property
    def W_hh(self):
        return self.lstm.weight_hh_l0.detach()

    def gates(self, dtype=None):
        """The gates recomputed from the states (``dtype``: from the states and weights cast to it)."""
        d = dtype or self.dtype
        w = [None if t is None else t.detach().to(d) for t in self.weights]
        return lstm_gates(*(t.to(d) for t in (self.x, self.h, self.c)), *w, self.h0.to(d), self.c0.to(d))

    def chain(self, x=True):
        return LstmChain.from_states(self.x if x else None, self.gates(), self.W_hh)

    def from_scan(self, out, dtype=torch.float64):
        """The parameter gradients from the scan's output ``out`` [T, B, 2H] (scan order: out[k] = λ at s_{T-k}),
        as GEMMs over the T·B rows, in ``dtype`` (the gates recomputed in it): what the kernel's mode 1 sums as it
        scans."""
        lam = out.to(dtype).flip(0)
        H, T, B = self.H, self.T, self.B
        dpre, _, _ = lstm_gate_grads(self.gates(dtype), lam[..., :H], lam[..., H:])
        d2 = dpre.reshape(T * B, 4 * H)
        hp = torch.cat([self.h0[None], self.h[:-1]]).to(dtype).reshape(T * B, H)
        bias = d2.sum(0)
        return {"weight_ih_l0": d2.t() @ self.x.to(dtype).reshape(T * B, self.I), "bias_ih_l0": bias,
                "bias_hh_l0": bias.clone(), "weight_hh_l0": d2.t() @ hp}


# -- the chain -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,B,I,H", [(1, 1, 1, 3), (7, 3, 4, 3), (100, 17, 1, 20)])
def test_the_chain_is_the_dense_jacobian_chain(T, B, I, H):
    """dense() is bppsa.jacobians.lstm.lstm_jacobians_t bit for bit, and the chain keeps x and h' (h_0 first)."""
    case = Case(T, B, I, H, seed=T + B)
    chain = case.chain()
    want = lstm_jacobians_t(case.gates(), case.W_hh)
    assert chain.kind == "lstm" and chain.hidden == H and chain.shape == (T, B, 2 * H, 2 * H) == want.shape
    torch.testing.assert_close(chain.dense(), want, rtol=0, atol=0)
    f = chain.f  # [steps, 7H + I, B], scan order, lane order
    torch.testing.assert_close(f[:, 6 * H:6 * H + I].permute(0, 2, 1), case.x.flip(0), rtol=0, atol=0)
    torch.testing.assert_close(f[-1, 6 * H + I:].t(), case.h0, rtol=0, atol=0)
    torch.testing.assert_close(f[:-1, 6 * H + I:].permute(0, 2, 1), case.h[:-1].flip(0), rtol=0, atol=0)
    assert LstmChain.from_states(None, case.gates(), case.W_hh).I == 0


def _step(lstm, x_t):
    """s_t = [h_t; c_t] of one step of ``lstm`` from s_{t-1} (batch rows), as a function autograd differentiates."""
    H = lstm.hidden_size

    def step(s):
        _, (h, c) = lstm(x_t[None], (s[:, :H][None].contiguous(), s[:, H:][None].contiguous()))
        return torch.cat([h[0], c[0]], -1)
    return step


@pytest.mark.parametrize("H", [3, 20])
def test_every_block_of_the_dense_chain_is_autograds_jacobian_of_a_torch_lstm_step(H):
    """J_k = (∂s_t/∂s_{t-1})ᵀ at t = T - k, from autograd of torch.nn.LSTM, each of the four blocks on its own
    (fp64, 1e-12: they differ only by the rounding of the gates recomputed by lstm_gates)."""
    T, B, I = 7, 3, 4
    case = Case(T, B, I, H, seed=H)
    J = case.chain().dense()
    s = torch.cat([torch.cat([case.h0[None], case.h[:-1]]), torch.cat([case.c0[None], case.c[:-1]])], -1)
    for t in range(T):
        full = torch.autograd.functional.jacobian(_step(case.lstm, case.x[t]), s[t], vectorize=True)  # [B, 2H, B, 2H]
        for b in range(B):
            want = full[b, :, b].t()  # (∂s_t/∂s_{t-1})ᵀ: rows s_{t-1}, columns s_t
            got = J[T - 1 - t, b]
            for name, r, c in (("h'h", slice(0, H), slice(0, H)), ("h'c", slice(0, H), slice(H, None)),
                               ("c'h", slice(H, None), slice(0, H)), ("c'c", slice(H, None), slice(H, None))):
                assert _rel(got[r, c], want[r, c]) <= 1e-12, (t, b, name)
        others = full.clone()
        others[range(B), :, range(B)] = 0
        assert not others.any()  # no batch element's state reaches another's


def test_the_twins_gradients_from_the_scan_equal_autograd_of_torch_lstm():
    """The reference every kernel gradient below is held to: from the twin's scan over the dense chain (the loss on
    h_T: the seed [∇h_T; 0]; on every h_t: the affine scan), the parameter gradients equal autograd's through
    torch.nn.LSTM with h_0, c_0 given (fp64, 1e-10)."""
    T, B, I, H = 37, 3, 4, 6
    case = Case(T, B, I, H, seed=1)
    w = torch.randn(T, B, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for per_step in (False, True):
        lstm = case.lstm
        lstm.zero_grad()
        out, _ = lstm(case.x, (case.h0[None], case.c0[None]))
        (out * w).sum().backward() if per_step else (out[-1] * w[-1]).sum().backward()
        want = {k: v.grad for k, v in lstm.named_parameters()}
        g = torch.cat([w[-1], torch.zeros(B, H, dtype=torch.float64)], -1)
        J = case.chain().dense()
        twin = TorchBackend()
        if per_step:
            c = torch.cat([w.flip(0)[1:], torch.zeros(T, B, H, dtype=torch.float64)[1:]], -1)
            c = torch.cat([c, torch.zeros(1, B, 2 * H, dtype=torch.float64)])  # c[T-1] enters after the last step
            got = case.from_scan(twin.affine_scan(g, J, c))
        else:
            got = case.from_scan(twin.scan(g, J))
        assert _rel_grads(got, want) <= 1e-10, per_step


# -- the compiled kernel's kind --------------------------------------------------------------------------------

kernel = pytest.mark.skipif(not native.available(), reason=f"no compiled kernel: {native.unavailable_reason()}")
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}

# (T, B, I, H): lengths whose N = T + 1 is no power of two but at T = 1 (a single position), one batch element (its
# blocks as the lanes), one lane slice and more, both hidden sizes and inputs.  Few sizes: each (H, I, lanes, dtype)
# is a C build (~1-10 s).
CASES = [(1, 1, 1, 6), (2, 3, 4, 6), (7, 17, 1, 6), (100, 1, 1, 6), (100, 17, 1, 20), (1001, 3, 4, 20),
         (1001, 1, 1, 20)]


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request, monkeypatch):
    """The kernel's team on one thread, or two (every split worth a hand-off: the shapes here are small)."""
    monkeypatch.setattr(plan, "MIN_CHUNK_FLOP", 1)
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T,B,I,H", CASES)
def test_the_kernel_scans_the_lstm_chain_as_the_twin_scans_its_dense_chain(threads, T, B, I, H, dtype):
    """CpuBackend's LSTM chain through the kernel: the scan, the affine scan (a direct gradient at every state,
    c's both halves), and the parameter gradients it sums as the prefixes come out (mode 1), for L_m None, 0, 2,
    against the twin over chain.dense() (fp64) and the gradients from the twin's scan."""
    case = Case(T, B, I, H, seed=T * B + I + H, dtype=dtype, scale=0.5)
    be = CpuBackend()
    chain = be.lstm_jacobians_t(case.x, case.h, case.gates, case.W_hh)
    assert isinstance(chain, LstmChain) and chain.shape == (T, B, 2 * H, 2 * H)
    J, g = chain.dense().double(), case.g.double()
    c = torch.randn(T, B, 2 * H, generator=torch.Generator().manual_seed(T), dtype=dtype)
    # the twin's linear scans in fp64 (every tree computes the same prefixes; the linear one is the cheapest)
    ref, aref = TorchBackend().scan(g, J, 0), TorchBackend().affine_scan(g, J, c.double(), 0)
    want, awant = case.from_scan(ref), case.from_scan(aref)
    tol = TOL[dtype]
    for L_m in (None, 0, 2):
        L = scan.tree_levels(T + 1, L_m)
        assert native_chain_scan(case.g, chain, L, be.workspace) is not None  # the kernel, not a fallback
        assert _rel(be.scan(case.g, chain, L_m), ref) <= tol, ("scan", L_m)
        got = be.cell_grads(case.g, chain, L_m, lambda out: pytest.fail("the kernel sums them"))
        assert _rel_grads(got, want) <= tol, ("grads", L_m)
        assert _rel(be.affine_scan(case.g, chain, c, L_m), aref) <= tol, ("affine", L_m)
        got = be.cell_grads(case.g, chain, L_m, lambda out: pytest.fail("the kernel sums them"), c=c)
        assert _rel_grads(got, awant) <= tol, ("affine grads", L_m)


@kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T,B,I,H", [(7, 17, 1, 6), (100, 17, 1, 20), (1001, 3, 4, 20)])
def test_both_thread_splits_and_a_chain_without_x(T, B, I, H, dtype, monkeypatch):
    """Threads owning lane slices or sharing every slice's blocks give the same scan; a chain built without x (the
    protocol's x None) scans through the kernel and leaves the gradients to from_scan."""
    monkeypatch.setattr(plan, "MIN_CHUNK_FLOP", 1)
    case = Case(T, B, I, H, seed=5, dtype=dtype, scale=0.5)
    chain = case.chain()
    ref = TorchBackend().scan(case.g.double(), chain.dense().double(), 0)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for split in ("slices", "blocks"):
            got = native_chain_scan(case.g, chain, scan.tree_levels(T + 1, None), scan.Workspace(), split)
            assert _rel(got, ref) <= TOL[dtype], split
        bare = CpuBackend().lstm_jacobians_t(None, case.h, case.gates, case.W_hh)
        assert isinstance(bare, LstmChain) and bare.I == 0
        seen = []
        CpuBackend().cell_grads(case.g, bare, None, seen.append)
        assert len(seen) == 1 and _rel(seen[0], ref) <= TOL[dtype]
    finally:
        torch.set_num_threads(old)


@kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T,B,I,H", [(1, 3, 4, 6), (100, 17, 1, 6), (1001, 3, 4, 20), (7, 1, 1, 20)])
def test_the_kernels_chain_product_is_the_dense_chains(T, B, I, H, dtype):
    """chain_product (a middle rank's map): P = J_{n-1} ... J_0 and the affine offset q, against the dense chain
    multiplied out in fp64.  In fp32 the kernel forms each J_k's entries with its own roundings (an ulp from
    dense()'s), and with f ≈ 0.98 (|λ| ≈ 1) nothing damps them: over n steps they add up to n·ε at worst, 6e-5 at
    n = 1001 (2e-6 to 1.5e-5 over four seeds on an AVX-512 Xeon, the same with its AVX2 build): the project's fp32
    bound, 1e-4."""
    tol = {torch.float64: TOL[torch.float64], torch.float32: 1e-4}[dtype]
    case = Case(T, B, I, H, seed=7, dtype=dtype, scale=0.5)
    chain = case.chain()
    c = torch.randn(T, B, 2 * H, generator=torch.Generator().manual_seed(1), dtype=dtype)
    J = chain.dense().double()
    P, q = J[0], c[0].double()
    for k in range(1, T):
        P = J[k] @ P
        q = (J[k] @ q.unsqueeze(-1)).squeeze(-1) + c[k].double()
    got, none = chain_product(chain)
    assert none is None and _rel(got, P) <= tol
    got, off = chain_product(chain, c)
    assert _rel(got, P) <= tol and _rel(off, q) <= tol


@kernel
def test_the_lstm_chain_takes_the_twins_dense_chain_with_a_projection_or_without_the_kernel(monkeypatch):
    T, B, H, P = 7, 3, 4, 2
    gen = torch.Generator().manual_seed(9)
    r = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    gates = LstmGates(i=r(T, B, H), f=r(T, B, H), g=r(T, B, H), o=r(T, B, H), tc=r(T, B, H), cp=r(T, B, H),
                      hp=r(T, B, P))
    W_hh, W_hr, h = r(4 * H, P), r(P, H), r(T, B, P)
    J = CpuBackend().lstm_jacobians_t(r(T, B, 1), h, lambda: gates, W_hh, W_hr)
    assert isinstance(J, torch.Tensor) and torch.equal(J, lstm_jacobians_t(gates, W_hh, W_hr))
    case = Case(7, 3, 4, 3, seed=9)
    monkeypatch.setattr(native, "available", lambda: False)
    J = CpuBackend().lstm_jacobians_t(case.x, case.h, case.gates, case.W_hh)
    assert isinstance(J, torch.Tensor) and torch.equal(J, lstm_jacobians_t(case.gates(), case.W_hh))


# -- relu's RNN read from its states by the kernel (chain_scan.c's ACT) ----------------------------------------

@kernel
@pytest.mark.parametrize("layout", ["fused", "paper"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("B", [1, 3, 17])
def test_relus_rnn_takes_the_kernels_states_path_as_tanhs_does(layout, dtype, B):
    """rnn_jacobians_t(act="relu") keeps the states (no factor written by torch): the kernel's d = 1[h > 0] from them
    gives the scan and gradients of the same kernel over torch's written factors bit for bit, its compiled writer
    writes torch's factors bit for bit (+0 and -0 states included), and the scan equals the twin's over the dense
    relu chain."""
    T, H, I = 101, 6, 2  # test_nn's hidden size: its relu layers' builds
    gen = torch.Generator().manual_seed(B)
    h = torch.relu(torch.randn(T, B, H, generator=gen, dtype=dtype))
    h[h == 0] = torch.where(torch.rand(int((h == 0).sum()), generator=gen) < 0.5, 0.0, -0.0).to(dtype)
    assert (h == 0).any() and torch.signbit(h[h == 0]).any()
    x = torch.randn(T, B, I, generator=gen, dtype=dtype)
    W = torch.randn(H, H, generator=gen, dtype=dtype) / math.sqrt(H)
    g = torch.randn(B, H, generator=gen, dtype=dtype)
    chain = CpuBackend().rnn_jacobians_t(h, W, layout, x, act="relu")
    assert chain.states is not None and chain._f is None and chain.act == "relu"
    L = scan.tree_levels(chain.shape[0] + 1, None)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = [native_chain_scan(g, chain, L, scan.Workspace(), grads=grads) for grads in (False, True)]
        written = type(chain)(chain.W_hh, chain.f.clone(), chain.I, act="relu")  # torch's rnn_factors
        compiled = torch.empty_like(written.f)
        native.rnn_factors(h, x, compiled, 0, T, act="relu")
        torch.testing.assert_close(compiled, written.f, rtol=0, atol=0)
        for grads, a in zip((False, True), got):
            want = native_chain_scan(g, written, L, scan.Workspace(), grads=grads)
            if grads:
                assert a.keys() == want.keys() and all(torch.equal(a[k], want[k]) for k in want)
            else:
                assert torch.equal(a, want)
        dense = rnn_jacobians_t(h, W, layout, act="relu")
        assert torch.equal(chain.dense(), dense)
        ref = TorchBackend().scan(g.double(), dense.double(), 0)
        assert _rel(got[0], ref) <= TOL[dtype]
    finally:
        torch.set_num_threads(old)


# -- the kernel's own gate pass (lstm_factors, native.LstmFill) -----------------------------------------------

@kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("B,h0,bias", [(1, True, True), (3, False, True), (17, True, False)])
def test_the_kernels_gate_pass_writes_torchs_factors_in_the_scans_threads(B, h0, bias, dtype):
    """With the forward's states (LstmStates), the chain's factors are left to the kernel's gate pass, which the
    scan's team writes in units of steps: gates() is never called, the factors are torch's to a few ulp (its exp,
    1 - p computed, not from a rounded gate; fp32's tanh the forward's, 1 - tanh² from it; fp64: 1e-14 of each row
    block's largest; fp32: within 2e-6
    of the exact factors of the same states, where torch's own cf = c' f (1 - f) from a rounded f ≈ 0.98 is ~2e-6
    off) and x and h' (h_0, or 0, first) bit for bit, and the scan and gradients are those of the same kernel over the
    factors written before it, bit for bit."""
    T, I, H = 101, 4, 20
    case = Case(T, B, I, H, seed=B, dtype=dtype, h0=h0, bias=bias)
    if not h0:
        assert not case.h0.any() and not case.c0.any()
    be = CpuBackend()
    lazy = be.lstm_jacobians_t(case.x, case.h, lambda: pytest.fail("the kernel recomputes the gates"), case.W_hh,
                               states=case.states(h0))
    assert isinstance(lazy, LstmChain) and lazy._fill is not None
    L = scan.tree_levels(T + 1, None)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = native_chain_scan(case.g, lazy, L, scan.Workspace(), grads=True)
        assert lazy.claim_fill() is None  # the threads wrote it
        eager = case.chain()
        exact = [t.flip(0).permute(0, 2, 1) for t in lstm_factors(case.gates(torch.float64))]
        for r, name in enumerate(("a", "ci", "cf", "cg", "co", "f")):
            rows = slice(r * H, (r + 1) * H)
            if dtype == torch.float64:
                assert _rel(lazy.f[:, rows], eager.f[:, rows]) <= 1e-14, name
            else:
                assert _rel(lazy.f[:, rows], exact[r]) <= 2e-6, name
        torch.testing.assert_close(lazy.f[:, 6 * H:], eager.f[:, 6 * H:], rtol=0, atol=0)
        written = LstmChain(lazy.W_hh, lazy.f.clone(), I)
        want = native_chain_scan(case.g, written, L, scan.Workspace(), grads=True)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        # a reader of f before any scan: the pass spread over the pool's threads, the same bits
        again = CpuBackend().lstm_jacobians_t(case.x, case.h, None, case.W_hh, states=case.states(h0))
        again._f.fill_(math.nan)  # whatever the pass leaves unwritten shows
        torch.testing.assert_close(again.f, written.f, rtol=0, atol=0)
    finally:
        torch.set_num_threads(old)
