"""The LSTM's factored chain (bppsa.backends.chain.LstmChain) and its compiled kernel kind (chain_scan.c's KIND 3),
held to the dense chain the chain stands for, the torch twin's scans over it, and autograd of torch.nn.LSTM."""
import math

import pytest
import torch

from bppsa.backends import TorchBackend
from bppsa.backends.chain import LstmChain
from bppsa.jacobians.lstm import lstm_gate_grads, lstm_gates, lstm_jacobians_t


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def _rel_grads(got: dict, ref: dict) -> float:
    assert got.keys() >= ref.keys(), (sorted(got), sorted(ref))
    for k in ref:
        assert got[k].shape == ref[k].shape, k
    return max(_rel(got[k], ref[k]) for k in ref)


class Case:
    """An LSTM layer (torch.nn.LSTM, random weights), a batch, its forward stepped by torch.nn.LSTM itself (so every
    c_t is at hand), the recomputed gates and the cell's parameter gradients from a scan's output (time order)."""

    def __init__(self, T, B, I, H, seed, dtype=torch.float64, scale=1.0, h0=True):
        gen = torch.Generator().manual_seed(seed)
        self.lstm = torch.nn.LSTM(I, H).to(dtype)
        with torch.no_grad():
            for p in self.lstm.parameters():
                p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=dtype) / math.sqrt(H))
        self.x = torch.randn(T, B, I, generator=gen, dtype=dtype)
        self.h0 = torch.randn(B, H, generator=gen, dtype=dtype) if h0 else torch.zeros(B, H, dtype=dtype)
        self.c0 = torch.randn(B, H, generator=gen, dtype=dtype) if h0 else torch.zeros(B, H, dtype=dtype)
        hs, cs, h, c = [], [], self.h0[None], self.c0[None]
        with torch.no_grad():
            for t in range(T):
                _, (h, c) = self.lstm(self.x[t:t + 1], (h, c))
                hs.append(h[0])
                cs.append(c[0])
        self.h, self.c = torch.stack(hs), torch.stack(cs)
        self.T, self.B, self.I, self.H, self.dtype = T, B, I, H, dtype
        self.g = torch.randn(B, 2 * H, generator=gen, dtype=dtype)

    @property
    def W_hh(self):
        return self.lstm.weight_hh_l0.detach()

    def gates(self):
        m = self.lstm
        return lstm_gates(self.x, self.h, self.c, m.weight_ih_l0.detach(), m.weight_hh_l0.detach(),
                          m.bias_ih_l0.detach(), m.bias_hh_l0.detach(), self.h0, self.c0)

    def chain(self, x=True):
        return LstmChain.from_states(self.x if x else None, self.gates(), self.W_hh)

    def from_scan(self, out):
        """The parameter gradients from the scan's output ``out`` [T, B, 2H] (scan order: out[k] = λ at s_{T-k}),
        as GEMMs over the T·B rows: what the kernel's mode 1 sums as it scans."""
        lam = out.flip(0)
        H, T, B = self.H, self.T, self.B
        dpre, _, _ = lstm_gate_grads(self.gates(), lam[..., :H], lam[..., H:])
        d2 = dpre.reshape(T * B, 4 * H)
        hp = torch.cat([self.h0[None], self.h[:-1]]).reshape(T * B, H)
        bias = d2.sum(0)
        return {"weight_ih_l0": d2.t() @ self.x.reshape(T * B, self.I), "bias_ih_l0": bias,
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
    T, B, I, H = 37, 3, 4, 5
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
