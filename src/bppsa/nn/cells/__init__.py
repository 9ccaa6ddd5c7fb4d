"""The recurrent cells of :mod:`bppsa.nn`, one class each (:class:`~.base.Cell`: the contract), by name."""
from .base import Cell, Incoming, Needs, Saved, Weights
from .gru import Gru
from .lstm import Lstm
from .rnn import ReluRnn, TanhRnn

CELLS: dict[str, Cell] = {c.name: c for c in (TanhRnn(), ReluRnn(), Gru(), Lstm())}

__all__ = ["CELLS", "Cell", "Gru", "Incoming", "Lstm", "Needs", "ReluRnn", "Saved", "TanhRnn", "Weights"]
