"""The CPU fast path of the BPPSA backward, and the sequential rival it is measured against.

**The recurrent chains are never built** (:mod:`bppsa.backends.chain`: ``FactoredChain``, ``RnnChain`` and
``PaperChain`` for the RNN's two layouts, ``GruChain``; built for the kernel by :mod:`.chain`): the backend
keeps each as its weights and per-step factors, in lane order, beside the inputs the parameter gradients need.  The
compiled kernel of :mod:`.native` (``chain_scan.c``: the batch as the vector lanes, the lowest up-sweep
levels fused per block) scans them and accumulates the cell's parameter gradients as the prefixes come
out (:func:`param_grads`), on lane slices or block ranges spread over the threads
(:func:`.chain.native_chain_scan`).  Where no C compiler works, the RNN's chain takes
:func:`.chain.rnn_chain_scan` (level 0 as one GEMM from the factors) and the others their dense chain.

**The scan of a dense chain** (:func:`.dense.dense_tree_scan`, reference twin
:func:`bppsa.scan.blelloch_scan`): the same tree, the same ``L_m`` semantics, the same numbers, as
stacked numpy products over the threads.  :func:`cpu_scan` takes either kind of chain.

**The sequential rival** (``CpuBackend(sequential=True)``): the linear scan (``L_m = 0``) of the same
factored chain through the same kernel, the batch split over the threads -- back-propagation built with
the care BPPSA gets, against which its speedups should be read.

Threads: ``torch.get_num_threads()`` (set by ``--threads``); the numpy paths in the calling thread's subnormal
mode (:mod:`.pool`), the compiled scan with its subnormal results flushed whatever that mode (chain_scan.c's
``fp_enter``: its long products underflow), the caller's mode given back.
"""
from __future__ import annotations

import torch

from ... import scan as _scan
from ..base import check_operands
from ..chain import FactoredChain, PaperChain, RnnChain
from ..twin import TorchBackend
from . import forward, native, plan, pool, sliced
from .chain import gru_chain, lstm_chain, native_chain_scan, rnn_chain, rnn_chain_product, rnn_chain_scan
from .dense import dense_tree_scan

__all__ = ["CpuBackend", "cpu_scan", "param_grads", "native"]


@torch.no_grad()
def cpu_scan(g: torch.Tensor, J: torch.Tensor | FactoredChain, L_m: int | None = None,
            workspace: _scan.Workspace | None = None, split: str = "auto") -> torch.Tensor:
    """The modified (heterogeneous) Blelloch scan of :func:`bppsa.scan.blelloch_scan`, multi-threaded.

    ``J`` is the dense chain ``[n, B, H, H]`` or a :class:`FactoredChain` (the compiled kernel,
    :func:`.chain.native_chain_scan`; without it :func:`.chain.rnn_chain_scan` for the RNN's chain, else the dense
    chain, :func:`.dense.dense_tree_scan`).
    ``split`` says how the compiled kernel's threads split the work (:func:`.chain.native_chain_scan`)."""
    check_operands(g, J)
    L = _scan.tree_levels(J.shape[0] + 1, L_m)
    ws = workspace if workspace is not None else _scan.Workspace()
    if isinstance(J, FactoredChain):
        out = native_chain_scan(g, J, L, ws, split)
        if out is not None:
            return out
        if isinstance(J, RnnChain) and L > 0:
            return rnn_chain_scan(g, J, L, ws)
        J = J.dense()
    return dense_tree_scan(g, J, L, ws)


@torch.no_grad()
def param_grads(g, chain: FactoredChain, L_m: int | None, ws: _scan.Workspace, from_scan,
                split: str = "auto", c: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The cell's parameter gradients from the scan over ``chain``: accumulated by the compiled kernel as
    the prefixes come out, or ``from_scan(scan)`` without it (or for a chain built without x).
    ``g``: ∇h_T.  ``L_m = 0`` is the sequential backward over the same chain.
    ``c``: the loss's direct gradients in scan order (the affine scan, :func:`.chain.native_chain_scan`)."""
    L = _scan.tree_levels(chain.shape[0] + 1, L_m)
    out = native_chain_scan(g, chain, L, ws, split, grads=True, c=c) if chain.I else None
    if out is not None:
        return out
    if c is None:
        return from_scan(cpu_scan(g, chain, L_m, ws, split))
    return from_scan(TorchBackend().affine_scan(g, chain.dense(), c, L_m))


class CpuBackend(TorchBackend):
    """The CPU fast path: the recurrent chains stay factored (:class:`FactoredChain`), scanned by the
    compiled kernel, which also accumulates the cell's parameter gradients; dense chains take the
    threaded numpy tree.

    ``sequential=True`` is the strongest sequential rival built with the same care (name
    ``cpu-sequential``): every scan is the linear one (``L_m = 0``: T dependent mat-vecs, no matrix
    products) through the same kernel, with the batch split over the threads where each gets at least 32 bytes
    of lanes or one batch element (measured: narrower slices made it slower)."""

    name = "cpu"

    def __init__(self, sequential: bool = False):
        super().__init__()
        self.sequential = sequential
        if sequential:
            self.name = "cpu-sequential"
        self._split = "slices" if sequential else "auto"

    def forward(self, kernel: str, x, state0: tuple, weights: tuple, lengths=None, slices: int | None = 1,
                tol: float = 0.0):
        """The compiled forward (:mod:`.forward`; with ``slices`` >= 2 split over the sequence, :mod:`.sliced`;
        None: :func:`.sliced.auto_slices` decides); None where it cannot run the case (no compiler, tensors off the
        CPU, another dtype, an LSTM with a projection)."""
        w_ih, w_hh, b_ih, b_hh, w_hr = weights
        if w_hr is not None or x.device.type != "cpu":
            return None
        h0, c0 = state0
        k = sliced.auto_slices(kernel, x, lengths) if slices is None else slices
        if k <= 1:
            out = forward.compiled_forward(kernel, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths)
            return None if out is None else (*out, None)
        out = sliced.sliced_forward(kernel, x, h0, c0, (w_ih, w_hh, b_ih, b_hh), lengths, k, guess="last", tol=tol)
        if out is not None and slices is None:
            sliced.remember(kernel, x, out[2])
        return out

    def forward_until_meet(self, kernel: str, x, state0: tuple, weights: tuple, lengths, stored: tuple,
                           tol: float = 0.0):
        """:func:`.forward.forward_until_meet` over all the steps; None where it cannot run the case."""
        w_ih, w_hh, b_ih, b_hh, w_hr = weights
        if w_hr is not None or x.device.type != "cpu":
            return None
        return forward.forward_until_meet(kernel, x, *state0, w_ih, w_hh, b_ih, b_hh, 0, x.shape[0], *stored,
                                          lengths=lengths, tol=tol)

    def _L_m(self, L_m):
        return 0 if self.sequential else L_m

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x: torch.Tensor | None = None,
                        act: str = "tanh"):
        if h.device.type != "cpu" or layout not in ("fused", "paper"):
            return super().rnn_jacobians_t(h, W_hh, layout, x, act)  # its error names the layouts
        cls = RnnChain if layout == "fused" else PaperChain
        return rnn_chain(cls, h, W_hh, x, out=lambda shape: self.workspace.get(("factors", "rnn"), shape, h), act=act)

    def gru_jacobians_t(self, x: torch.Tensor, h: torch.Tensor, cell, gates=None):
        if h.device.type != "cpu":
            return super().gru_jacobians_t(x, h, cell, gates)
        T, B, H = h.shape
        out = self.workspace.get(("factors", "gru"), (T, 6 * H + x.shape[2], B), h)
        return gru_chain(x, h, cell, out=out)

    def lstm_jacobians_t(self, x: torch.Tensor | None, h: torch.Tensor, gates, W_hh: torch.Tensor, W_hr=None,
                         states=None):
        """The LSTM's chain over [h; c] kept as its factors (:class:`~bppsa.backends.chain.LstmChain`) for the
        compiled kernel, written by its own gate pass from ``states`` (:class:`~bppsa.backends.chain.LstmStates`;
        with x) in the scan's threads, else by torch from ``gates()``; with a projection (``W_hr``), off the CPU or
        without the kernel, the twin's dense chain."""
        if W_hr is None and h.device.type == "cpu":
            chain = lstm_chain(x, h, gates, W_hh,
                               out=lambda shape: self.workspace.get(("factors", "lstm"), shape, h), states=states)
            if chain is not None:
                return chain
        return super().lstm_jacobians_t(x, h, gates, W_hh, W_hr)

    def levels(self, J, grads: bool = False) -> int | None:
        """``L_m="auto"``'s depth for scans of ``J`` by the compiled kernel: the linear scan (0) where the batch's
        lane slices give every thread one, else the full tree (:func:`.plan.auto_levels`); the twin's answer (the
        full tree) where the kernel does not run ``J``; 0 for the sequential rival."""
        if self.sequential:
            return 0
        if not isinstance(J, FactoredChain) or J.kind == "paper" or not native.available():
            return super().levels(J, grads)
        return plan.auto_levels(J.kind, J.shape[1], J.dtype, pool.threads())

    def scan(self, g: torch.Tensor, J, L_m: int | None = None) -> torch.Tensor:
        return cpu_scan(g, J, self._L_m(L_m), self.workspace, self._split)

    @torch.no_grad()
    def affine_scan(self, g: torch.Tensor, J, c: torch.Tensor, L_m: int | None = None,
                    past: torch.Tensor | None = None) -> torch.Tensor:
        """The per-step-gradient scan, ``out[k+1] = J[k] out[k] + c[k]``: over a factored chain by the compiled
        kernel (one call, the same plan as the single seed's: each block also carries its affine offset); chains
        with identity steps (``past``: sequences of several lengths) or without the kernel, by the torch twin over
        the dense chain."""
        if isinstance(J, FactoredChain) and past is None:
            check_operands(g, J)
            L = _scan.tree_levels(J.shape[0] + 1, self._L_m(L_m))
            out = native_chain_scan(g, J, L, self.workspace, self._split, c=c)
            if out is not None:
                return out
        return super().affine_scan(g, J.dense() if isinstance(J, FactoredChain) else J, c, L_m, past)

    def chain_product(self, J, c: torch.Tensor | None = None):
        """The RNN's tanh chain read from the states (the kernel at hand) as one map, by the compiled kernel's product
        of the whole chain (:func:`.chain.rnn_chain_product`); None for every other chain."""
        if isinstance(J, RnnChain) and J.states is not None and J.act == "tanh":
            h, x = J.states
            return rnn_chain_product(h, J.W_hh, x, c)
        return None

    def cell_grads(self, g, J, L_m, from_scan, c: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if isinstance(J, FactoredChain):
            return param_grads(g, J, self._L_m(L_m), self.workspace, from_scan, self._split, c=c)
        return from_scan(self.scan(g, J, L_m) if c is None else self.affine_scan(g, J, c, L_m))
