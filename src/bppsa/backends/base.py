"""What every backend provides (:class:`Backend`), and the one check of a scan's operands they all make."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from ..scan import Workspace


@runtime_checkable
class Backend(Protocol):
    """A backend of the BPPSA backward, on torch tensors in the layout of :mod:`bppsa.scan`: every method the
    layers of :mod:`bppsa.nn` call.

    * ``name``: what results and logs call it ("torch", "cpu", "cpu-sequential", "cupy", "cupy-factored");
    * ``workspace``: scratch buffers reused across iterations, into which a model may build Jacobians that
      the same step's scan consumes;
    * :meth:`scanner`: the backend that scans a chain of ``kind`` ("rnn", "paper", "gru", "lstm"), and with
      ``per_step`` the affine recurrence of a loss on every state or of sequences of several lengths: itself,
      or the torch twin on the same device where it has no kernel for it;
    * :meth:`scan`: the exclusive scan (a backend may overwrite ``J`` as workspace); :meth:`affine_scan`: the
      per-step-gradient scan ``out[k+1] = J[k] out[k] + c[k]``, identities at the steps ``past`` a sequence's end;
    * :meth:`rnn_jacobians_t`, :meth:`gru_jacobians_t`, :meth:`lstm_jacobians_t`: the transposed Jacobians of an
      Elman RNN (``act`` "tanh" or "relu"), a GRU or an LSTM in scan order (dense ``[n, B, S, S]``, or a chain kept
      as its factors, which also keeps the inputs ``x`` for the parameter gradients; ``gates()`` gives the
      recomputed gates to a backend that builds from them; the LSTM's optional ``states``,
      :class:`~bppsa.backends.chain.LstmStates`, to one that recomputes them itself: the CPU kernel's gate pass);
    * :meth:`cell_grads`: the cell's parameter gradients, ``from_scan(scan)`` of the single seed's scan (``c``
      None) or of the affine one, unless the backend accumulates them as it scans.
    """

    name: str
    workspace: Workspace

    def scanner(self, kind: str, per_step: bool = False) -> Backend: ...

    def scan(self, g: torch.Tensor, J: Any, L_m: int | None = None) -> torch.Tensor: ...

    def affine_scan(self, g: torch.Tensor, J: Any, c: torch.Tensor, L_m: int | None = None,
                    past: torch.Tensor | None = None) -> torch.Tensor: ...

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x: torch.Tensor | None = None,
                        act: str = "tanh"): ...

    def gru_jacobians_t(self, x: torch.Tensor, h: torch.Tensor, cell, gates: Callable | None = None): ...

    def lstm_jacobians_t(self, x: torch.Tensor | None, h: torch.Tensor, gates: Callable, W_hh: torch.Tensor,
                         W_hr: torch.Tensor | None = None, states: Any = None): ...

    def cell_grads(self, g: torch.Tensor, J: Any, L_m: int | None, from_scan: Callable[[torch.Tensor], dict],
                   c: torch.Tensor | None = None) -> dict[str, torch.Tensor]: ...


def check_operands(g: torch.Tensor, J) -> None:
    """Raise ValueError unless ``g`` is [B, H] and ``J`` (a tensor, or anything with ``dim()``, ``shape`` and
    ``dtype``, such as a factored chain) is [n, B, H, H] of g's dtype."""
    if g.dim() != 2 or J.dim() != 4 or J.shape[1:3] != g.shape or J.shape[2] != J.shape[3]:
        raise ValueError(f"expected g [B, H] and J [n, B, H, H], got {tuple(g.shape)} and {tuple(J.shape)}")
    if g.dtype != J.dtype:
        raise ValueError(f"g and J must have one dtype (got {g.dtype} and {J.dtype})")
