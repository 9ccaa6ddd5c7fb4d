"""Shared machinery of the recurrent classifiers: a BPPSA layer (:mod:`bppsa.nn`), a linear head on its last
state, and the two training steps, phase by phase.

A subclass sets ``self.cell`` (a one-layer, time-major :class:`bppsa.nn.RNN`, ``GRU`` or ``LSTM``, whose
parameters have torch.nn's names, so state dicts are those of a torch.nn cell) and ``self.head``.  The autograd
baseline runs torch's own recurrent kernel (cuDNN on a GPU) on the cell's weights; the BPPSA step is the layer's
forward, the head and ``loss.backward()``, whose layer backward is the scan.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import backward as layer_backward
from ..nn.cells import Saved
from . import check_layout

Phase = Callable[[str], contextlib.AbstractContextManager]


def no_phase(name: str):
    return contextlib.nullcontext()


class RecurrentClassifier(nn.Module):
    model: str  # the name in bppsa.models.SPECS
    cell: nn.Module  # bppsa.nn.RNN, GRU or LSTM, one layer, time-major
    head: nn.Linear

    def forward(self, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """Baseline forward (autograd through torch's own kernel, as torch.nn.RNN/GRU run it; cuDNN on GPU):
        logits from the last hidden state.

        ``packed`` feeds the same batch as a PackedSequence (every length T): cuDNN then runs its
        per-step algorithm, the one the paper's 2020 baseline had, instead of the persistent
        small-hidden-size kernels current PyTorch picks for dense input.
        """
        T, B, _ = x.shape
        w, cell = self.cell.layer_weights(0), self.cell.cell
        state0 = cell.initial_states(x, None, None, w)
        if packed:
            lengths = torch.full((B,), T, dtype=torch.int64)  # on the CPU, as torch requires
            seq = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=True)
            _, finals = cell.torch_run(seq.data, state0, w, seq.batch_sizes)
        else:
            _, finals = cell.torch_run(x, state0, w)
        return self.head(finals[0][-1])

    def saved(self, x: torch.Tensor, h: torch.Tensor) -> Saved:
        """What the layer's backward keeps from a forward from zero that gave the states ``h`` (an LSTM's cell
        states recomputed)."""
        w, cell = self.cell.layer_weights(0), self.cell.cell
        return Saved(x, h, cell.cell_states(x, h, cell.initial_states(x, None, None, w), w, None))

    def jacobians_t(self, x: torch.Tensor, h: torch.Tensor, layout: str, backend):
        """The chain the layer's backward builds on ``backend`` from the states ``h`` [T, B, H]: the transposed
        Jacobians in scan order, dense or kept as factors (with the inputs, for the weights' gradients)."""
        check_layout(self.model, layout)
        return self.cell.cell.chain(backend, self.saved(x, h), self.cell.layer_weights(0), layout, with_x=True)

    # -- the two training steps -------------------------------------------------------------------
    def baseline_step(self, x, y, phase: Phase = no_phase, backward: bool = True,
                      packed: bool = False) -> torch.Tensor:
        with phase("forward"):
            loss = F.cross_entropy(self(x, packed=packed), y)
        if backward:
            with phase("backward"):
                loss.backward()
        return loss.detach()

    def bppsa_step(self, x, y, backend, layout: str = "fused", L_m: int | None = None,
                   phase: Phase = no_phase, backward: bool = True, forward: str = "torch") -> torch.Tensor:
        """One BPPSA training step through the layer: its forward, the head, ``loss.backward()`` (every
        parameter's ``.grad``), with the layer's backward on ``backend`` (a Backend instance) over ``layout``'s
        chain and the scan of ``L_m``.  ``forward``: the backend whose forward the layer runs, "torch" (torch's own
        kernels, the baseline's forward: the paper compares the backward with the same forward on both sides) or
        "auto" (the CPU's compiled forward, a variant of its own).  Phases: ``forward``, ``jacobian`` (the chain's
        construction, inside the backward, which does not count it again) and ``backward``.  ``backward=False`` is
        the paper's forward-only run: the forward and the chain."""
        check_layout(self.model, layout)
        self.cell.layout, self.cell.L_m, self.cell.backend = layout, L_m, forward
        if not backward:
            with torch.no_grad():
                with phase("forward"):
                    h, h_n = self.cell(x)
                    loss = F.cross_entropy(self.head(_last(h_n)), y)
                with phase("jacobian"):
                    self.jacobians_t(x, h, layout, backend)
            return loss
        with phase("forward"):
            _, h_n = self.cell(x)
            loss = F.cross_entropy(self.head(_last(h_n)), y)  # views back to the op's h_n: nothing copied
        with phase("backward"), layer_backward.stepping(backend, phase):
            loss.backward()
        return loss.detach()


def _last(h_n) -> torch.Tensor:
    """The last layer's h_n [B, H] (an LSTM's of its (h_n, c_n))."""
    return (h_n[0] if isinstance(h_n, tuple) else h_n)[-1]
