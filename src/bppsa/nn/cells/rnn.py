"""The Elman RNN, ``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)`` (torch.nn.RNN): tanh, the paper's, and relu.

Its transposed Jacobian is ``W_hhᵀ diag(d_t)`` with ``d_t`` the nonlinearity's derivative read off the state
itself: ``1 - h_t²`` for tanh, ``1[h_t > 0]`` for relu (``h = relu(a) > 0`` exactly where ``a > 0``).  The paper
layout splits it into two Jacobians per step, ``diag(d_t)`` then ``W_hhᵀ`` (:mod:`bppsa.jacobians.recurrent`).
"""
from __future__ import annotations

import torch
from torch import nn

from ...jacobians.recurrent import derivative
from .base import Cell, Saved, Weights


class TanhRnn(Cell):
    name, kind, gates, torch_cls = "rnn", "rnn", 1, nn.RNN
    kernel = "rnn_tanh"  # torch's, and the compiled forward's (looked up at the call)
    # tanh's rounded map: two trajectories come within an ulp in ~100 steps and can stay an ulp apart for thousands
    meet_ulps = 2
    layouts = ("fused", "paper")
    act = "tanh"

    def torch_run(self, x, state0, w: Weights, batch_sizes=None):
        train, run = torch.is_grad_enabled(), getattr(torch, self.kernel)
        if batch_sizes is None:
            out, h_n = run(x, state0[0], w.torch_params(), w.bias, 1, 0.0, train, False, False)
        else:
            out, h_n = run(x, batch_sizes, state0[0], w.torch_params(), w.bias, 1, 0.0, train, False)
        return out, (h_n,)

    def chain(self, be, s: Saved, w: Weights, layout: str = "fused", with_x: bool = False):
        return be.rnn_jacobians_t(s.h, w.w_hh, layout, s.x if with_x else None, act=self.act)

    def block_values(self, s: Saved, w: Weights) -> int:
        return s.h.shape[1] * 2 * s.h.shape[2]  # the factors and their flip

    def block_steps(self, twin, s: Saved, w: Weights):
        """``J_j = W_hhᵀ diag(d_j)`` kept as its factors ``d`` [n, B, H] (scan order): a product costs the dense
        one's H³ without the dense chain."""
        Wt = w.w_hh.t()

        def step(d, j, A):
            return Wt * d[j].unsqueeze(-2) if A is None else torch.matmul(Wt, A * d[j].unsqueeze(-1))

        return derivative(s.h, self.act).flip(0), step

    def states_grads(self, scan, layout):
        return scan[0::2] if layout == "paper" else scan  # the paper layout's odd entries are ∇a_t

    def preact_grads(self, s: Saved, w: Weights, lam):
        ga = lam * derivative(s.h, self.act)
        return ga, ga, None, {}


class ReluRnn(TanhRnn):
    name, act, kernel = "rnn_relu", "relu", "rnn_relu"
    meet_ulps = 0
