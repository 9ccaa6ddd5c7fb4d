"""Models trainable with the autograd baseline or the BPPSA backward."""
from __future__ import annotations

import importlib

# name -> (module, class); imported lazily so each model's dependencies stay its own
_REGISTRY = {
    "rnn": ("bppsa.models.rnn", "RNNClassifier"),
    "gru": ("bppsa.models.gru", "GRUClassifier"),
}
MODELS = tuple(_REGISTRY)


def build(name: str, input_size: int, hidden: int, classes: int):
    """A recurrent classifier by name: ``build('rnn', 1, 20, 10)``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model '{name}' (choose from {', '.join(MODELS)})")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(input_size=input_size, hidden=hidden, classes=classes)
