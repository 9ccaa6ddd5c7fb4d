"""An LSTM classifier on the RNN's task (Sec 4.1's bitstreams: input 1, hidden 20, 10 classes, head on the last hidden
state): the recurrent layer torch users reach for first, through the same harness."""
from __future__ import annotations

from torch import nn

from .. import nn as bppsa_nn
from .recurrent import RecurrentClassifier


class LSTMClassifier(RecurrentClassifier):
    model = "lstm"

    def __init__(self, input_size: int = 1, hidden: int = 20, classes: int = 10):
        super().__init__()
        self.cell = bppsa_nn.LSTM(input_size, hidden)
        self.head = nn.Linear(hidden, classes)
