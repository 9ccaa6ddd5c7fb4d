"""The GRU of torch.nn.GRU (gates r, z, n; Eq. 10 of the paper; its Jacobian is Appendix E's:
:mod:`bppsa.jacobians.gru`)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ...jacobians.gru import gru_gate_grads, gru_gates
from .base import Cell, Saved, Weights


def module_view(w: Weights) -> SimpleNamespace:
    """The layer as the backends take a GRU (torch.nn.GRU's attribute names), zero biases where there are none."""
    b_ih, b_hh = w.b_ih, w.b_hh
    if b_ih is None:
        b_ih, b_hh = w.w_ih.new_zeros(w.w_ih.shape[0]), w.w_hh.new_zeros(w.w_hh.shape[0])
    return SimpleNamespace(weight_ih_l0=w.w_ih, weight_hh_l0=w.w_hh, bias_ih_l0=b_ih, bias_hh_l0=b_hh)


class Gru(Cell):
    name, kind, gates, torch_cls = "gru", "gru", 3, nn.GRU
    kernel = "gru"

    def torch_run(self, x, state0, w: Weights, batch_sizes=None):
        train = torch.is_grad_enabled()
        if batch_sizes is None:
            out, h_n = torch.gru(x, state0[0], w.torch_params(), w.bias, 1, 0.0, train, False, False)
        else:
            out, h_n = torch.gru(x, batch_sizes, state0[0], w.torch_params(), w.bias, 1, 0.0, train, False)
        return out, (h_n,)

    def _gates(self, s: Saved, w: Weights):
        m = module_view(w)
        return gru_gates(s.x, s.h, w.w_ih, w.w_hh, m.bias_ih_l0, m.bias_hh_l0, s.h0)

    def chain(self, be, s: Saved, w: Weights, layout: str = "fused", with_x: bool = False):
        # (the CPU kernel's chain always keeps x, and recomputes its own gates)
        return be.gru_jacobians_t(s.x, s.h, module_view(w), gates=lambda: self.saved_gates(s, w))

    def preact_grads(self, s: Saved, w: Weights, lam):
        g = self.saved_gates(s, w)
        G = gru_gate_grads(g, lam)  # (dR, dZ, dN, dM)
        H = lam.shape[-1]
        gi = G[..., :3 * H]  # ∂l/∂(W_ih x + b_ih), gates r, z, n
        gh = torch.cat([G[..., :2 * H], G[..., 3 * H:]], -1)  # ∂l/∂(W_hh h' + b_hh), gates r, z, n
        return gi, gh, lam[0] * g.z[0], {}  # h = (1 - z) n + z h': the direct path to h'
