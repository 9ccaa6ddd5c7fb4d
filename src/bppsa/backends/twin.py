"""The torch backend: the reference twin every other backend is held to, on any device."""
from __future__ import annotations

import torch

from .. import scan as _scan
from ..jacobians import gru as _gru
from ..jacobians import lstm as _lstm
from ..jacobians import recurrent as _rec
from .base import check_operands


class TorchBackend:
    """Batched torch ops on any device; scratch buffers are reused across iterations."""

    name = "torch"

    def __init__(self):
        self.workspace = _scan.Workspace()

    def forward(self, kernel: str, x, state0: tuple, weights: tuple, lengths=None, slices: int | None = 1,
                tol: float = 0.0):
        """None: the twin's forward is torch's own kernels, which the layer runs itself."""
        return None

    def forward_until_meet(self, kernel: str, x, state0: tuple, weights: tuple, lengths, stored: tuple,
                           tol: float = 0.0):
        """None: torch's kernels cannot stop where two trajectories meet (the caller reruns every step)."""
        return None

    def scanner(self, kind: str, per_step: bool = False) -> TorchBackend:
        """Itself: the twin scans every chain, dense."""
        return self

    def scan(self, g: torch.Tensor, J: torch.Tensor, L_m: int | None = None) -> torch.Tensor:
        check_operands(g, J)
        return _scan.blelloch_scan(g, J, L_m, self.workspace)

    def affine_scan(self, g: torch.Tensor, J: torch.Tensor, c: torch.Tensor, L_m: int | None = None,
                    past: torch.Tensor | None = None) -> torch.Tensor:
        """The per-step-gradient scan (:func:`bppsa.scan.affine_blelloch_scan`): the prefixes of
        ``out[k] = J[k-1] out[k-1] + c[k-1]`` from ``out[0] = g``, over the dense chain ``J``.  ``past``
        ([n, B] bool, optional): the steps whose Jacobian is the identity instead (past a sequence's end)."""
        check_operands(g, J)
        if past is not None:
            eye = torch.eye(J.shape[-1], dtype=J.dtype, device=J.device)
            J = torch.where(past[..., None, None], eye, J)
        return _scan.affine_blelloch_scan(g, J, c, L_m, self.workspace)

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x=None,
                        act: str = "tanh") -> torch.Tensor:
        # the Jacobians are consumed by the scan of the same step, so their buffer can be reused
        T, B, H = h.shape
        shape = (_rec.num_jacobians(T, layout), B, H, H)
        return _rec.rnn_jacobians_t(h, W_hh, layout, out=self.workspace.get(("jacobians", layout), shape, h), act=act)

    def gru_jacobians_t(self, x: torch.Tensor, h: torch.Tensor, cell, gates=None) -> torch.Tensor:
        g = gates() if gates is not None else _gru.gru_gates(x, h, cell.weight_ih_l0, cell.weight_hh_l0,
                                                             cell.bias_ih_l0, cell.bias_hh_l0)
        T, B, H = h.shape
        return _gru.gru_jacobians_t(g, cell.weight_hh_l0, out=self.workspace.get(("jacobians", "gru"), (T, B, H, H), h))

    def lstm_jacobians_t(self, x, h: torch.Tensor, gates, W_hh: torch.Tensor, W_hr=None, states=None) -> torch.Tensor:
        g = gates()
        T, B, P = h.shape
        S = P + g.f.shape[-1]
        return _lstm.lstm_jacobians_t(g, W_hh, W_hr, out=self.workspace.get(("jacobians", "lstm"), (T, B, S, S), h))

    def chain_product(self, J, c: torch.Tensor | None = None):
        """The whole chain as one map ``(P, q)`` by a kernel of this backend (``P = J[n-1] ... J[0]``, ``q`` the affine
        recurrence's offset with ``c``), or None where it has none: the caller composes it (the twin has none)."""
        return None

    def levels(self, J, grads: bool = False) -> int | None:
        """The ``L_m`` that ``L_m="auto"`` takes for scans of chains like ``J`` (``grads``: the scans that sum the
        cell's gradients): the full tree (None), the paper's scan.  The CPU's compiled kernel chooses its own."""
        return None

    def cell_grads(self, g, J, L_m: int | None, from_scan, c: torch.Tensor | None = None) -> dict:
        """The cell's parameter gradients, ``from_scan`` of the single seed's scan or (``c``: the loss's gradients
        at every step, in scan order) of the affine one; a backend may accumulate them as it scans instead."""
        return from_scan(self.scan(g, J, L_m) if c is None else self.affine_scan(g, J, c, L_m))
