"""The GRU of Sec 4.2 (Eq. 10): hidden 20, 11 IRMAS instrument classes, head on the last hidden state."""
from __future__ import annotations

from torch import nn

from ..jacobians.gru import Gates, gru_gate_grads, gru_gates, gru_param_grads
from .recurrent import RecurrentClassifier


class GRUClassifier(RecurrentClassifier):
    def __init__(self, input_size: int, hidden: int = 20, classes: int = 11):
        super().__init__()
        self.cell = nn.GRU(input_size, hidden)
        self.head = nn.Linear(hidden, classes)
        # The gates recomputed for the Jacobians are reused for the gates' gradients of the same step
        # (keyed by the identity of h), so the backward does not pay for them a second time.
        self._gates: tuple[object, Gates] | None = None

    @staticmethod
    def _check_layout(layout: str) -> None:
        from . import check_layout

        check_layout("gru", layout)

    def _gates_for(self, x, h) -> Gates:
        if self._gates is not None and self._gates[0] is h:
            return self._gates[1]
        c = self.cell
        g = gru_gates(x, h, c.weight_ih_l0, c.weight_hh_l0, c.bias_ih_l0, c.bias_hh_l0)
        self._gates = (h, g)
        return g

    def jacobians_t(self, x, h, layout, backend):
        self._check_layout(layout)
        return backend.gru_jacobians_t(x, h, self.cell, lambda: self._gates_for(x, h))

    def grads_from_scan(self, scan_out, x, h, layout):
        self._check_layout(layout)
        return gru_gate_grads(self._gates_for(x, h), scan_out.flip(0))  # the scan yields ∇h_T .. ∇h_1

    def cell_param_grads(self, x, h, gate_grads):
        self._gates = None  # the step is over; do not keep [T, B, H] tensors alive
        return gru_param_grads(x, h, gate_grads)
