"""The GRU of Sec 4.2 (Eq. 10): hidden 20, 11 IRMAS instrument classes, head on the last hidden state."""
from __future__ import annotations

from torch import nn

from .. import nn as bppsa_nn
from .recurrent import RecurrentClassifier


class GRUClassifier(RecurrentClassifier):
    model = "gru"

    def __init__(self, input_size: int, hidden: int = 20, classes: int = 11):
        super().__init__()
        self.cell = bppsa_nn.GRU(input_size, hidden)
        self.head = nn.Linear(hidden, classes)
