"""The Elman tanh RNN of Sec 4.1: input 1, hidden 20, 10 classes, head on the last hidden state."""
from __future__ import annotations

from torch import nn

from .. import nn as bppsa_nn
from .recurrent import RecurrentClassifier


class RNNClassifier(RecurrentClassifier):
    model = "rnn"

    def __init__(self, input_size: int = 1, hidden: int = 20, classes: int = 10):
        super().__init__()
        self.cell = bppsa_nn.RNN(input_size, hidden, nonlinearity="tanh")
        self.head = nn.Linear(hidden, classes)
