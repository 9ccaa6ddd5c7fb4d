"""The LSTM of torch.nn.LSTM (gates i, f, g, o; ``proj_size`` projects h), whose state for the scan is (h, c).

Its transposed Jacobian over (h, c) factors (:mod:`bppsa.jacobians.lstm`): ∂c_t/∂c_{t-1} = diag(f_t), the other
blocks diagonals times weight blocks.  torch's kernels (oneDNN on a CPU, cuDNN on a GPU) return every h_t but
only the last c: the cell states c_1 .. c_T are recomputed from the gates by the parallel scan of their diagonal
linear recurrence ``c_t = f_t c_{t-1} + i_t g_t`` (:func:`bppsa.scan.affine_diagonal_scan`), not step by step.
"""
from __future__ import annotations

import torch
from torch import nn

from ... import scan as _scan
from ...backends.chain import LstmStates
from ...jacobians.lstm import lstm_gate_grads, lstm_gates
from .base import Cell, Saved, Weights


class Lstm(Cell):
    name, kind, gates, torch_cls = "lstm", "lstm", 4, nn.LSTM
    kernel = "lstm"
    cell_state = True

    def torch_run(self, x, state0, w: Weights, batch_sizes=None):
        train = torch.is_grad_enabled()
        if batch_sizes is None:
            out, h_n, c_n = torch.lstm(x, state0, w.torch_params(), w.bias, 1, 0.0, train, False, False)
        else:
            out, h_n, c_n = torch.lstm(x, batch_sizes, state0, w.torch_params(), w.bias, 1, 0.0, train, False)
        return out, (h_n, c_n)

    @torch.no_grad()
    def cell_states(self, x, h, state0, w: Weights, valid):
        T, B, P = h.shape
        H = self.hidden(w)
        hp = torch.cat([state0[0], h[:-1]])
        pre = torch.mm(x.reshape(T * B, -1), w.w_ih.t()).addmm_(hp.reshape(T * B, P), w.w_hh.t())
        if w.bias:
            pre += w.b_ih + w.b_hh
        pre = pre.view(T, B, 4 * H)
        f = pre[..., H:2 * H].sigmoid()
        ig = pre[..., :H].sigmoid() * pre[..., 2 * H:3 * H].tanh()
        if valid is not None:  # past a sequence's end the state is carried: c_t = 1 c_{t-1} + 0
            f = torch.where(valid.unsqueeze(-1), f, 1.0)
            ig = torch.where(valid.unsqueeze(-1), ig, 0.0)
        c1 = torch.addcmul(ig[0], f[0], state0[1][0])
        if T == 1:
            return c1.unsqueeze(0).contiguous()
        c = _scan.affine_diagonal_scan(c1, f[1:].contiguous(), ig[1:].contiguous())  # c_1 .. c_{T-1}
        return torch.cat([c, torch.addcmul(ig[-1], f[-1], c[-1]).unsqueeze(0)]).contiguous()

    def _gates(self, s: Saved, w: Weights):
        return lstm_gates(s.x, s.h, s.c, w.w_ih, w.w_hh, w.b_ih, w.b_hh, s.h0, s.c0)

    def chain(self, be, s: Saved, w: Weights, layout: str = "fused", with_x: bool = False):
        # (x and the states always: a backend with a gate pass of its own, the CPU kernel's, reads them instead of
        # torch's gates, as the GRU's chain always keeps x)
        states = LstmStates(s.c, w.w_ih, w.b_ih, w.b_hh, s.h0, s.c0)
        return be.lstm_jacobians_t(s.x, s.h, lambda: self.saved_gates(s, w), w.w_hh, w.w_hr, states=states)

    def preact_grads(self, s: Saved, w: Weights, lam):
        P = w.out_size
        g = self.saved_gates(s, w)
        lam_h = lam[..., :P]
        dpre, lam_m, dc = lstm_gate_grads(g, lam_h, lam[..., P:], w.w_hr)
        direct0 = torch.cat([lam_h.new_zeros(lam_h.shape[1:]), g.f[0] * dc[0]], -1)  # c = f c' + ...: to c'
        extra = {}
        if w.w_hr is not None:  # h = W_hr m, m = o tanh(c)
            T, B = lam.shape[:2]
            extra["weight_hr_l0"] = lam_h.reshape(T * B, P).t() @ (g.o * g.tc).reshape(T * B, -1)
        return dpre, dpre, direct0, extra

    def extra_names(self, w: Weights):
        return ("weight_hr_l0",) if w.w_hr is not None else ()
