"""One recurrent layer's forward, for any cell: the backend's own forward kernel where it has one (the CPU's compiled
forward, serial or split over slices of the sequence), else torch's (:meth:`~.cells.base.Cell.forward`, cuDNN on a
GPU), which is also the twin the compiled one is tested against.

``slices`` (a layer's ``parallel_forward``): 1 the serial forward; None the backend's choice
(:func:`bppsa.backends.cpu.sliced.auto_slices`: where the batch leaves threads idle and the last call of the shape
paid); 0 as many slices as threads; k >= 2 that many.  What a sliced run did (its sweeps, meeting lengths, hand-off:
:func:`bppsa.backends.cpu.sliced.sliced_forward`'s ``stats``) is recorded per thread for the layer to read
(:func:`take_stats`).
"""
from __future__ import annotations

import threading

import torch

from .backward import Options, backend_for
from .cells import Cell, Weights

_record = threading.local()


def layer_forward(cell: Cell, x, h0, c0, w: Weights, lengths, options: Options):
    """The states ``(h, c)`` of one layer (``c`` None but for a cell state), the steps past each sequence's end
    carrying its last state."""
    slices = options.slices
    if slices == 0:
        slices = torch.get_num_threads()
    out = backend_for(options.backend, x.device).forward(cell.kernel, x, (h0, c0), w.tensors(), lengths, slices)
    if out is None:
        h, c = cell.forward(x, h0, c0, w, lengths)
        stats = None
    else:
        h, c, stats = out
    if stats is not None:
        stats = {k: v for k, v in stats.items() if k != "starts"}  # (the next call's guess: kept by the backend)
    record(stats)
    return h, c


def record(stats: dict | None) -> None:
    """One layer's forward done: what it did (None: a serial forward), for :func:`take_stats`' recorder."""
    calls = getattr(_record, "calls", None)
    if calls is not None:
        calls.append(stats)


def take_stats(calls: list | None) -> list | None:
    """Start recording this thread's forwards into ``calls`` (a list; None: stop), returning what was recorded."""
    done = getattr(_record, "calls", None)
    _record.calls = calls
    return done
