"""Models trainable with the autograd baseline or the BPPSA backward."""
from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

from ..jacobians import LAYOUTS as _RNN_LAYOUTS  # torch-free: the workflow imports SPECS


@dataclass(frozen=True)
class ModelSpec:
    """Where a model lives, its paper sizes, and the Jacobian layouts its BPPSA backward takes."""

    module: str
    cls: str
    input_size: int
    hidden: int
    classes: int
    layouts: tuple[str, ...]  # the first is the default


# imported lazily so each model's dependencies stay its own
SPECS = {
    "rnn": ModelSpec("bppsa.models.rnn", "RNNClassifier", input_size=1, hidden=20, classes=10,
                     layouts=tuple(sorted(_RNN_LAYOUTS))),  # ("fused", "paper")
    # input 12: the MFCC features of IRMAS set L (bppsa.data.irmas.MFCC_SETS); 11 instrument classes
    "gru": ModelSpec("bppsa.models.gru", "GRUClassifier", input_size=12, hidden=20, classes=11, layouts=("fused",)),
    # not in the paper: the RNN's task through an LSTM (the recurrent layer torch users reach for first)
    "lstm": ModelSpec("bppsa.models.lstm", "LSTMClassifier", input_size=1, hidden=20, classes=10, layouts=("fused",)),
}
MODELS = tuple(SPECS)


def spec(name: str) -> ModelSpec:
    if name not in SPECS:
        raise ValueError(f"unknown model '{name}' (choose from {', '.join(MODELS)})")
    return SPECS[name]


def check_layout(name: str, layout: str) -> None:
    if layout not in spec(name).layouts:
        has = ", ".join(spec(name).layouts)
        raise ValueError(f"the {name.upper()} has no Jacobian layout '{layout}' (it has: {has})")


def build(name: str, input_size: int | None = None, hidden: int | None = None, classes: int | None = None):
    """A recurrent classifier by name, the paper's sizes where not given: ``build('rnn')``."""
    s = spec(name)
    cls = getattr(importlib.import_module(s.module), s.cls)
    return cls(input_size=input_size or s.input_size, hidden=hidden or s.hidden, classes=classes or s.classes)


def copy_model(model):
    """A deep copy whose recurrent cells hold their weights in one block again: ``copy.deepcopy`` leaves them
    apart, and cuDNN then compacts them on every call (its "not part of single contiguous chunk" warning)."""
    from torch import nn

    out = copy.deepcopy(model)
    for m in out.modules():
        if isinstance(m, nn.RNNBase):
            m.flatten_parameters()
    return out
