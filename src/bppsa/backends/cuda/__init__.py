"""CuPy RawKernel backend: the BPPSA scan and the RNN Jacobian fill as hand-written CUDA kernels.

The CUDA sources beside this file (``blelloch.cu``, ``rnn_jacobians.cu``, ``factored.cu``) are compiled with NVRTC
through :class:`cupy.RawModule` the first time they are needed (CuPy caches the binaries per device
and on disk).  Each kernel has a torch reference twin that tests hold it to:

* ``bppsa_{up_sweep,middle_scan,down_sweep}_{f32,f64}`` -- :func:`bppsa.scan.blelloch_scan`;
* ``bppsa_rnn_jacobians_{paper,fused}_{f32,f64}`` -- :func:`bppsa.jacobians.recurrent.rnn_jacobians_t`;
* ``bppsa_factored_{up,up_smem,down}_{rnn,gru}_{f32,f64}`` and ``bppsa_factored_middle_{f32,f64}``
  (``factored_up.cu`` and ``factored_warp.cu``, compiled per hidden size, and ``factored.cu``;
  :class:`CupyFactoredBackend`) -- the scan
  over ``chain.dense()`` of a :class:`~bppsa.backends.chain.RnnChain` or
  :class:`~bppsa.backends.chain.GruChain`, and the parameter-gradient sums the CPU kernel accumulates, and the
  per-step-gradient (affine) scan over that chain
  (:func:`bppsa.scan.affine_blelloch_scan`).

The launch schedule is computed in pure Python by :func:`.plan.scan_plan` from :func:`bppsa.scan.levels`,
and tests hold it, the torch scan and the FLOP analysis to :func:`bppsa.scan.reference_scan`: one
definition of the tree, checked (and the kernels emulated) on a machine without a GPU.

:mod:`.runtime` compiles and launches the kernels on torch's current stream, with torch's raw device
pointers; CuPy is imported lazily: importing this package never needs it.  :mod:`.nvrtc` compiles the
sources as CuPy would, with no GPU, driver or CuPy (the tests, ``bppsa doctor``).

CuPy compiles every RawModule with ``-ftz=true`` appended after our options
(:data:`.runtime.CUPY_APPENDED_OPTIONS`).  The Jacobian fill therefore uses explicitly non-flushing fp32
instructions, so it matches torch bit for bit on subnormal values too; the scan kernels keep
CuPy's flush-to-zero (an absolute error below 1.2e-38 per operation, far inside their fp32
tolerance against the torch scan).
"""
from __future__ import annotations

import functools

import torch

from ...jacobians.recurrent import num_jacobians
from ..base import check_operands
from ..chain import FactoredChain, GruChain, RnnChain
from ..twin import TorchBackend
from . import cost_model, plan, runtime

__all__ = ["CupyBackend", "CupyFactoredBackend"]


class CupyBackend(TorchBackend):
    """:class:`bppsa.backends.twin.TorchBackend` with the scan and the RNN's Jacobians as CUDA kernels (the
    GRU's Jacobians are built by torch, on the GPU)."""

    name = "cupy"
    KINDS = ("rnn", "paper", "gru")  # the chains its kernels scan (dense)

    def __init__(self):
        runtime.import_cupy()
        super().__init__()

    def scan(self, g: torch.Tensor, J: torch.Tensor, L_m: int | None = None) -> torch.Tensor:
        check_operands(g, J)
        n = J.shape[0]
        B, H = g.shape
        if n == 0:
            return g.new_empty((0,) + tuple(g.shape))
        dev = runtime.check_cuda(g.dtype, g, J)
        L, launches = plan.scan_plan(n + 1, B, H, L_m)
        optin = runtime.smem_optin(dev)
        need = max(launch.smem_elems for launch in launches) * g.dtype.itemsize
        if need > optin:
            raise ValueError(
                f"backend 'cupy' scans hidden sizes up to H={plan.max_hidden(g.dtype, optin)} for {g.dtype} on this "
                f"GPU "
                f"({optin} bytes of shared memory per block; H={H} needs {need}); use backend 'torch'"
            )
        J = J if J.is_contiguous() else J.contiguous()  # a copy is fine: J is workspace anyway
        S = g.new_empty((L + 1, B, H))
        S[0].copy_(g)
        P = g.new_empty((n, B, H))
        s, ptrs = runtime.stream(dev), (runtime.pointer(J), runtime.pointer(S), runtime.pointer(P))
        for launch in launches:
            runtime.launch("blelloch.cu", launch, g.dtype, dev, ptrs, s)
        return P

    def scanner(self, kind: str, per_step: bool = False) -> TorchBackend:
        """Itself for the dense chains of the RNN and the GRU; the torch twin on the same device for the affine
        recurrence (no kernel of this backend scans it) and for the LSTM's chain (no CUDA kernel has its state
        yet: the twin's dense scan)."""
        if per_step or kind not in self.KINDS:
            return self.twin
        return self

    @functools.cached_property
    def twin(self) -> TorchBackend:
        """The torch twin this backend hands what it has no kernel for (its own workspace, kept from step to
        step: a CUDA graph may capture the backward)."""
        return TorchBackend()

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x=None,
                        act: str = "tanh") -> torch.Tensor:
        if act != "tanh":  # the fill kernel writes tanh's derivative: the twin's chain, scanned by this backend
            return super().rnn_jacobians_t(h, W_hh, layout, x, act)
        if h.dim() != 3 or W_hh.shape != (h.shape[2], h.shape[2]):
            raise ValueError(f"expected h [T, B, H] and W_hh [H, H], got {tuple(h.shape)} and {tuple(W_hh.shape)}")
        T, B, H = h.shape
        launch = plan.rnn_jacobians_launch(T, B, H, layout)
        out = h.new_empty((num_jacobians(T, layout), B, H, H))
        if out.numel() == 0:
            return out
        dev = runtime.check_cuda(h.dtype, h, W_hh)
        h = h.detach().contiguous()
        W = W_hh.detach().contiguous()
        ptrs = (runtime.pointer(h), runtime.pointer(W), runtime.pointer(out))
        runtime.launch("rnn_jacobians.cu", launch, h.dtype, dev, ptrs, runtime.stream(dev))
        return out


class CupyFactoredBackend(CupyBackend):
    """The factored GPU backward (``factored.cu``): the recurrent chains stay as their factors (the RNN's
    fused layout as :class:`~bppsa.backends.chain.RnnChain`, the GRU as
    :class:`~bppsa.backends.chain.GruChain`, built by torch on the GPU) and no per-step Jacobian is ever
    stored.  Three phases (:func:`.plan.factored_plan`): each thread builds some columns of one chunk's aggregate in
    registers (up; in shared memory where H is too large); one launch carries g across the aggregates, a warp tree
    per batch element (middle: vectors come out; the Blelloch kernels where ``L_m`` bounds the tree);
    a warp per (chunk, batch element) pair replays its chunk from its carry (down; a block per pair in shared memory
    where its registers would not hold it), writing the scan's output or the pair's sums of the parameter gradients,
    which one more kernel adds in a fixed order into the flat gradients (their views are what ``cell_grads``
    returns).  The paper layout and dense chains take
    :class:`CupyBackend`."""

    name = "cupy-factored"
    KINDS = ("rnn", "gru")  # the chains its factored kernels scan (plan.FACTORED_KINDS)

    def scanner(self, kind: str, per_step: bool = False) -> TorchBackend:
        """Itself for the RNN's and the GRU's chains, the affine recurrence included (identity steps, dense chains
        and the paper layout go to the twin inside :meth:`affine_scan` and the faithful kernels); the twin for the
        LSTM's."""
        return self if kind in self.KINDS else self.twin

    def rnn_jacobians_t(self, h: torch.Tensor, W_hh: torch.Tensor, layout: str, x=None, act: str = "tanh"):
        if layout != "fused":
            return super().rnn_jacobians_t(h, W_hh, layout, x, act)
        if h.dim() != 3 or W_hh.shape != (h.shape[2], h.shape[2]):
            raise ValueError(f"expected h [T, B, H] and W_hh [H, H], got {tuple(h.shape)} and {tuple(W_hh.shape)}")
        runtime.check_cuda(h.dtype, h, W_hh, *(() if x is None else (x,)))
        T, B, H = h.shape
        rows = 2 * H + (0 if x is None else x.shape[2])
        return RnnChain.from_states(h, W_hh, x, out=self.workspace.get(("factors", "rnn"), (T, rows, B), h), act=act)

    def gru_jacobians_t(self, x: torch.Tensor, h: torch.Tensor, cell, gates=None):
        """The GRU's chain, its factors written by one kernel from the forward's states (``bppsa_gru_factors``, in
        place of torch's gate recomputation and ~30 ops; ``GruChain.from_states`` is its twin)."""
        dev = runtime.check_cuda(h.dtype, h, x, cell.weight_hh_l0)
        T, B, H = h.shape
        I = x.shape[2]
        f = self.workspace.get(("factors", "gru"), (T, 6 * H + I, B), h)
        if T * B == 0:
            return GruChain(cell.weight_hh_l0, f, I)
        launch = plan.gru_factors_launch(T, B, H, I)
        if launch.smem_elems * h.dtype.itemsize > runtime.smem_optin(dev):  # (H, I far beyond the paper's)
            return GruChain.from_states(x, h, cell, out=f)
        zeros = h.new_zeros(3 * H)
        ops = [t.detach().contiguous() for t in (x, h, cell.weight_ih_l0, cell.weight_hh_l0,
                                                 zeros if cell.bias_ih_l0 is None else cell.bias_ih_l0,
                                                 zeros if cell.bias_hh_l0 is None else cell.bias_hh_l0)]
        runtime.launch("factored.cu", launch, h.dtype, dev, [runtime.pointer(t) for t in ops] + [runtime.pointer(f)],
                       runtime.stream(dev))
        return GruChain(cell.weight_hh_l0, f, I)

    def scan(self, g: torch.Tensor, J, L_m: int | None = None) -> torch.Tensor:
        if not _factored(J):
            return super().scan(g, J.dense() if isinstance(J, FactoredChain) else J, L_m)
        return self._factored(g, J, L_m, grads=False)

    def cell_grads(self, g, J, L_m, from_scan, c: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if not _factored(J) or not J.I or not self.sums_fit(J, g.dtype, g.device):
            # the scan's output, then the parameter gradients as GEMMs: also where the sums' block would not fit
            # this GPU's shared memory (the GRU at H = 64 in fp64 on an H100/H200: 259 KiB of 227)
            return from_scan(self.scan(g, J, L_m) if c is None else self.affine_scan(g, J, c, L_m))
        return plan.grad_views(self._factored(g, J, L_m, grads=True, c=c), J.grad_layout(), J.I + 1 + J.shape[2])

    def affine_scan(self, g: torch.Tensor, J, c: torch.Tensor, L_m: int | None = None,
                    past: torch.Tensor | None = None) -> torch.Tensor:
        """The per-step-gradient scan, ``out[k+1] = J[k] out[k] + c[k]``, by the factored kernels (:func:`.plan.
        factored_plan`'s ``affine``); chains with identity steps (``past``) or dense ones by the torch twin."""
        if _factored(J) and past is None:
            return self._factored(g, J, L_m, grads=False, c=c)
        return super().affine_scan(g, J.dense() if isinstance(J, FactoredChain) else J, c, L_m, past)

    @staticmethod
    def sums_fit(chain, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the down kernel that sums the parameter gradients fits in a block's shared memory here."""
        n, B, H, _ = chain.shape
        if n == 0:
            return True
        need = max(plan.factored_smem(chain.kind, H, chain.I, True)) * dtype.itemsize
        return need <= runtime.smem_optin(device)

    def _factored(self, g: torch.Tensor, chain, L_m, grads: bool, C: int | None = None,
                  c: torch.Tensor | None = None) -> torch.Tensor:
        """The scan's output P [n, B, H], or (``grads``) the flat parameter gradients (:func:`.plan.grad_index`);
        ``c`` [n, B, H]: the per-step gradients of the affine scan (None: the single seed's scan)."""
        check_operands(g, chain)
        n, B, H, _ = chain.shape
        if n == 0:
            return g.new_empty((0, B, H))
        dev = runtime.check_cuda(g.dtype, g, chain.f, chain.Wt, *(() if c is None else (c,)))
        if c is not None and tuple(c.shape) != (n, B, H):
            raise ValueError(f"the per-step gradients c must be [n, B, H] = {[n, B, H]}, got {list(c.shape)}")
        C, launches = cost_model.factored_plan(chain.kind, n, B, H, chain.I, C, gpu=_model_gpu(dev), grads=grads,
                                               L_m=L_m, itemsize=g.dtype.itemsize, affine=c is not None)
        optin = runtime.smem_optin(dev)
        need = max(x.smem_elems for x in launches) * g.dtype.itemsize
        if need > optin:
            raise ValueError(
                f"backend 'cupy-factored' needs {need} bytes of shared memory per block for a {chain.kind} chain at "
                f"H={H}, I={chain.I} in {g.dtype}, but this GPU allows {optin}; use backend 'cupy' or 'torch'")
        shapes = plan.factored_buffers(chain.kind, n, B, H, chain.I, C, launches, L_m)
        g = g.contiguous()
        unused = g.new_empty(1)  # for a pointer the kernel's mode never touches (one element: a real address)
        bufs = {"Wt": chain.Wt.contiguous(), "f": chain.f.contiguous(), "c": None if c is None else c.contiguous()}
        kept = {"carries": "carries", "agg": "aggregates", "accs": "sums"}  # reused from call to call (workspace)
        for name, shape in shapes.items():
            if shape is None:
                bufs[name] = None
            elif name == "gmap":
                bufs[name] = self._grad_map(chain, g.device)
            elif name == "carries" and shape[0] == 1:
                bufs[name] = g[None]  # one chunk: the down launch alone, from g
            else:
                bufs[name] = (self.workspace.get(("factored", kept[name]), shape, g) if name in kept
                              else g.new_empty(shape))
        if bufs["S"] is not None:
            bufs["S"][0].copy_(g)  # the middle scan's spine starts from g
        elif shapes["carries"][0] > 1:
            bufs["carries"][0].copy_(g)  # the one-launch middle phase starts from g
        ptr = {k: runtime.pointer(unused if t is None else t) for k, t in bufs.items()}
        ptr["unused"] = runtime.pointer(unused)
        s = runtime.stream(dev)
        for step in launches:
            runtime.launch(plan.factored_source(step), step, g.dtype, dev, plan.factored_operands(step, ptr), s)
        return bufs["grads"] if shapes["P"] is None else bufs["P"]

    def _grad_map(self, chain, device) -> torch.Tensor:
        """The flat gradients' entries of the sums (:func:`.plan.grad_index`), int32 on ``device``, once per shape."""
        n, B, H, _ = chain.shape
        key = (chain.kind, H, chain.I, str(device))
        cache = self.__dict__.setdefault("_grad_maps", {})
        if key not in cache:
            index, _ = plan.grad_index(chain.grad_layout(), chain.I + 1 + H)
            cache[key] = torch.tensor(index, dtype=torch.int32, device=device)
        return cache[key]


@functools.lru_cache(maxsize=16)  # once per device: a backward's host time is what the GPU runs wait on
def _model_gpu(dev: torch.device):
    """The cost model's entry for this GPU (the chunk size is planned for it); None (an H100) where it has none."""
    if dev.type != "cuda" or not torch.cuda.is_available():  # (a stand-in device in the tests without a GPU)
        return None
    key = cost_model.key_for_device_name(torch.cuda.get_device_name(dev))
    return cost_model.GPUS[key] if key else None


def _factored(J) -> bool:
    """Whether the factored kernels take ``J`` (the RNN's fused chain or the GRU's chain)."""
    return isinstance(J, FactoredChain) and J.kind in plan.FACTORED_KINDS
