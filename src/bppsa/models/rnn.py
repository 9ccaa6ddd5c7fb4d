"""The Elman tanh RNN of Sec 4.1: input 1, hidden 20, 10 classes, head on the last hidden state."""
from __future__ import annotations

from torch import nn

from ..jacobians.recurrent import rnn_grad_preact
from .recurrent import RecurrentClassifier


class RNNClassifier(RecurrentClassifier):
    def __init__(self, input_size: int = 1, hidden: int = 20, classes: int = 10):
        super().__init__()
        self.cell = nn.RNN(input_size, hidden, nonlinearity="tanh")
        self.head = nn.Linear(hidden, classes)

    def jacobians_t(self, x, h, layout, backend):
        return backend.rnn_jacobians_t(h, self.cell.weight_hh_l0, layout, x)

    def grads_from_scan(self, scan_out, x, h, layout):
        return rnn_grad_preact(scan_out, h, layout)  # for the RNN the useful per-step gradient is ∇a_t

    def cell_param_grads(self, x, h, grad_a):
        # Sums over every step and batch element: single GEMMs over the T·B rows (h_0 = 0 adds nothing).
        T, B, H = h.shape
        ga = grad_a.reshape(T * B, H)
        gb = ga.sum(0)
        return {
            "weight_ih_l0": ga.t() @ x.reshape(T * B, -1),
            "weight_hh_l0": ga[B:].t() @ h[:-1].reshape((T - 1) * B, H),
            "bias_ih_l0": gb,
            "bias_hh_l0": gb.clone(),
        }
