"""The Elman tanh RNN of Sec 4.1: input 1, hidden 20, 10 classes, head on the last hidden state."""
from __future__ import annotations

import torch
from torch import nn

from ..jacobians.recurrent import rnn_grad_preact
from .recurrent import RecurrentClassifier, h_prev


class RNNClassifier(RecurrentClassifier):
    def __init__(self, input_size: int = 1, hidden: int = 20, classes: int = 10):
        super().__init__()
        self.cell = nn.RNN(input_size, hidden, nonlinearity="tanh")
        self.head = nn.Linear(hidden, classes)

    def jacobians_t(self, x, h, layout, backend):
        return backend.rnn_jacobians_t(h, self.cell.weight_hh_l0, layout)

    def grad_hidden(self, scan_out, x, h, layout):
        # For the RNN the useful per-step gradient is ∇a_t (pre-activation).
        return rnn_grad_preact(scan_out, h, layout)

    def cell_param_grads(self, x, h, grad_a):
        hp = h_prev(h)
        gb = grad_a.sum((0, 1))
        return {
            "weight_ih_l0": torch.einsum("tbh,tbi->hi", grad_a, x),
            "weight_hh_l0": torch.einsum("tbh,tbj->hj", grad_a, hp),
            "bias_ih_l0": gb,
            "bias_hh_l0": gb.clone(),
        }
