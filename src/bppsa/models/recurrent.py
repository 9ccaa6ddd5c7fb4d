"""Shared machinery of the recurrent classifiers: the BPPSA training step, phase by phase.

A subclass supplies the cell (``self.cell``, a torch.nn.RNN/GRU with one layer, time-major), the
head (``self.head``), and three methods: ``jacobians_t`` (the transposed Jacobians from the
forward's states and inputs, built by the backend), ``grads_from_scan`` (turn the scan's output into the
per-step gradients the parameters need, in time order: ∇a_t for the RNN, the gates' gradients for the
GRU) and ``cell_param_grads`` (every cell parameter's gradient from those, by GEMMs over the T·B rows).
A backend that accumulates the parameter gradients as it scans (the CPU fast path) calls neither.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.base import Head

Phase = Callable[[str], contextlib.AbstractContextManager]


def no_phase(name: str):
    return contextlib.nullcontext()


class RecurrentClassifier(nn.Module):
    cell: nn.RNNBase
    head: nn.Linear

    def forward(self, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """Baseline forward (autograd; cuDNN on GPU): logits from the last hidden state.

        ``packed`` feeds the same batch as a PackedSequence (every length T): cuDNN then runs its
        per-step algorithm, the one the paper's 2020 baseline had, instead of the persistent
        small-hidden-size kernels current PyTorch picks for dense input.
        """
        if packed:
            lengths = torch.full((x.shape[1],), x.shape[0], dtype=torch.int64)  # on the CPU, as torch requires
            x = nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=True)
        _, h_n = self.cell(x)
        return self.head(h_n[-1])

    # -- subclass hooks ---------------------------------------------------------------------------
    def jacobians_t(self, x, h, layout, backend):  # pragma: no cover - abstract
        raise NotImplementedError

    def grads_from_scan(self, scan_out, x, h, layout):  # pragma: no cover - abstract
        raise NotImplementedError

    def cell_param_grads(self, x, h, step_grads) -> dict[str, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def head_backward(self, h_last: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, backend) -> torch.Tensor:
        """The head's backward in closed form (``backend.head_grads``): its weight's and bias's gradients
        added to their ``.grad``, and ∇h_T returned."""
        return Head(self.head, h_last, logits, y, backend)()

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
                   phase: Phase = no_phase, backward: bool = True) -> torch.Tensor:
        """Forward without autograd, then the scan backward; fills every parameter's ``.grad``."""
        with torch.no_grad():  # once for the whole step (a mode switch costs ~10 µs on caches the forward evicted)
            with phase("forward"):
                h, _ = self.cell(x)  # [T, B, H]: h_1 .. h_T
                h_last = h[-1]
                logits = self.head(h_last)
                loss = F.cross_entropy(logits, y)
            with phase("jacobian"):
                J = self.jacobians_t(x, h, layout, backend)
            if not backward:
                return loss
            with phase("backward"):
                head = Head(self.head, h_last, logits, y, backend)  # ∇h_T, which a backend may compute its own way
                from_scan = lambda out: self.cell_param_grads(x, h, self.grads_from_scan(out, x, h, layout))  # noqa: E731
                grads = backend.cell_grads(head, J, L_m, from_scan)
                del J
                for name, g in grads.items():
                    p = getattr(self.cell, name)
                    p.grad = g if p.grad is None else p.grad + g
        return loss

