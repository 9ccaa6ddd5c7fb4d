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
    * :meth:`forward`: one layer's states ``(h, c, stats)`` by a forward kernel of the backend's own (``kernel``:
      "rnn_tanh", "rnn_relu", "gru", "lstm"; ``state0 = (h0, c0)``, ``weights`` torch.nn's tensors of the layer;
      ``slices``: 1 the serial forward, k >= 2 the sequence split into k slices run side by side, None the backend's
      choice; ``tol`` the slices' meeting criterion, relative, 0 bitwise; ``stats`` what a sliced run did, None for a
      serial one), or None where it has none: the layer then runs torch's own kernels (cuDNN on a GPU);
    * :meth:`forward_until_meet`: the same steps rerun from a new ``state0`` into ``stored = (h, c)`` (which hold
      their states from another start), each batch element until its new state meets the stored one (within
      ``tol``, relative; 0: bitwise; the rest kept); the last step where one met (T: some never did), or None
      where the backend has no such kernel (the caller reruns all the steps);
    * :meth:`scanner`: the backend that scans a chain of ``kind`` ("rnn", "paper", "gru", "lstm"), and with
      ``per_step`` the affine recurrence of a loss on every state or of sequences of several lengths: itself,
      or the torch twin on the same device where it has no kernel for it;
    * :meth:`levels`: the ``L_m`` a layer's ``L_m="auto"`` takes for scans of chains like ``J`` (``grads``: those
      that sum the cell's gradients): None (the full tree) or a depth, 0 the linear scan;
    * :meth:`scan`: the exclusive scan (a backend may overwrite ``J`` as workspace); :meth:`affine_scan`: the
      per-step-gradient scan ``out[k+1] = J[k] out[k] + c[k]``, identities at the steps ``past`` a sequence's end;
    * :meth:`rnn_jacobians_t`, :meth:`gru_jacobians_t`, :meth:`lstm_jacobians_t`: the transposed Jacobians of an
      Elman RNN (``act`` "tanh" or "relu"), a GRU or an LSTM in scan order (dense ``[n, B, S, S]``, or a chain kept
      as its factors, which also keeps the inputs ``x`` for the parameter gradients; ``gates()`` gives the
      recomputed gates to a backend that builds from them; the LSTM's optional ``states``,
      :class:`~bppsa.backends.chain.LstmStates`, to one that recomputes them itself: the CPU kernel's gate pass);
    * :meth:`chain_product`: the whole chain as one affine map ``(P, q)`` by a kernel of the backend, or None where
      it has none (a middle rank's up-sweep, :func:`bppsa.nn.split.slice_map`);
    * :meth:`cell_grads`: the cell's parameter gradients, ``from_scan(scan)`` of the single seed's scan (``c``
      None) or of the affine one, unless the backend accumulates them as it scans.
    """

    name: str
    workspace: Workspace

    def forward(self, kernel: str, x: torch.Tensor, state0: tuple, weights: tuple, lengths: torch.Tensor | None = None,
                slices: int | None = 1, tol: float = 0.0): ...

    def forward_until_meet(self, kernel: str, x: torch.Tensor, state0: tuple, weights: tuple, lengths,
                           stored: tuple, tol: float = 0.0) -> int | None: ...

    def scanner(self, kind: str, per_step: bool = False) -> Backend: ...

    def levels(self, J: Any, grads: bool = False) -> int | None: ...

    def scan(self, g: torch.Tensor, J: Any, L_m: int | None = None) -> torch.Tensor: ...

    def affine_scan(self, g: torch.Tensor, J: Any, c: torch.Tensor, L_m: int | None = None,
                    past: torch.Tensor | None = None) -> torch.Tensor: ...

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x: torch.Tensor | None = None,
                        act: str = "tanh"): ...

    def gru_jacobians_t(self, x: torch.Tensor, h: torch.Tensor, cell, gates: Callable | None = None): ...

    def lstm_jacobians_t(self, x: torch.Tensor | None, h: torch.Tensor, gates: Callable, W_hh: torch.Tensor,
                         W_hr: torch.Tensor | None = None, states: Any = None): ...

    def chain_product(self, J: Any, c: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        ...

    def cell_grads(self, g: torch.Tensor, J: Any, L_m: int | None, from_scan: Callable[[torch.Tensor], dict],
                   c: torch.Tensor | None = None) -> dict[str, torch.Tensor]: ...


def check_operands(g: torch.Tensor, J) -> None:
    """Raise ValueError unless ``g`` is [B, H] and ``J`` (a tensor, or anything with ``dim()``, ``shape`` and
    ``dtype``, such as a factored chain) is [n, B, H, H] of g's dtype."""
    if g.dim() != 2 or J.dim() != 4 or J.shape[1:3] != g.shape or J.shape[2] != J.shape[3]:
        raise ValueError(f"expected g [B, H] and J [n, B, H, H], got {tuple(g.shape)} and {tuple(J.shape)}")
    if g.dtype != J.dtype:
        raise ValueError(f"g and J must have one dtype (got {g.dtype} and {J.dtype})")
