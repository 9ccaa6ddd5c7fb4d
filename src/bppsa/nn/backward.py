"""One recurrent layer's BPPSA backward, for any cell (:mod:`.cells`), on plain tensors (the custom ops of
:mod:`.ops` and the split layer of :mod:`.split` call these).

Time-major throughout: ``x`` [T, B, I], the states ``h`` [T, B, P] hold h_1 .. h_T (and an LSTM's ``c``).  With
``lengths``, the steps past a sequence's end carry its state, so ``h[-1]`` is each sequence's last valid state; in
the backward those steps are identity Jacobians whose cell receives no gradient.

The backward is the scan of :mod:`bppsa.scan` over the cell's transposed Jacobians, with the state's gradient at
T first.  :func:`plan` decides, once, what the scan is (:class:`Plan`):

* **single seed** (the paper's case: only h_n, or only h_T, receives a gradient, every sequence full length):
  the backend's own chain and scan, its fast paths;
* **per step** (a gradient on every h_t, or sequences of several lengths): the affine scan over pairs
  (:func:`bppsa.scan.affine_blelloch_scan`), identities at the steps past a sequence's end, by the backend that
  the layer's backend names for it (:meth:`~bppsa.backends.base.Backend.scanner`);
* either way, where neither the input nor the initial state needs a gradient and the initial state is zero (the
  harness's training step), the backend may accumulate the weights' gradients as it scans (the CPU kernel).

From the scan's total ∇s_t the cell gives its gates' gradients, then every weight's, ∇x and ∇s_0 are GEMMs over
the T·B rows (:meth:`~.cells.base.Cell.grads`).  :func:`run` is that backward for one layer; the split layer
runs it on its slice with the ranks' carry added to the seed.

A training step that measures itself (the harness's :meth:`bppsa.models.recurrent.RecurrentClassifier.bppsa_step`)
wraps its ``loss.backward()`` in :func:`stepping`: the layers' backward then runs on the step's own backend instance
(the sequential rival, an emulated kernel: any :class:`~bppsa.backends.base.Backend`) and times the building of
its chain as the phase ``jacobian``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from .. import scan as _scan
from ..backends import get_backend
from .cells import Cell, Incoming, Needs, Saved, Weights

_backends: dict[tuple[str, str], object] = {}


class _Step:
    """What :func:`stepping` hands the layers' backward.  Process-wide, not thread-local: on a GPU autograd runs
    an op's backward on its own device thread, not on the thread that called ``loss.backward()``."""

    backend = None  # a Backend instance that runs every layer's backward instead of the op's backend name
    phase = None  # name -> context manager, timing the chain's construction as "jacobian"


_step = _Step()


@contextlib.contextmanager
def stepping(backend=None, phase=None):
    """Within: every layer's backward runs on ``backend`` (a :class:`~bppsa.backends.base.Backend` instance,
    whatever the layer's ``backend`` option names; None: the option) and times the construction of its chain
    (Jacobians or factors) as ``phase("jacobian")``, a phase inside the caller's backward."""
    prev = _step.backend, _step.phase
    _step.backend, _step.phase = backend, phase
    try:
        yield
    finally:
        _step.backend, _step.phase = prev


def jacobian_phase():
    """The phase the chain's construction is timed in (nothing outside :func:`stepping`)."""
    return _step.phase("jacobian") if _step.phase is not None else contextlib.nullcontext()


def backend_for(name: str, device: torch.device):
    """The backend ``name`` resolves to on ``device``, one instance per (name, device): its workspace then
    lives from step to step, and 'auto' warns once."""
    key = (name, str(device))
    if key not in _backends:
        _backends[key] = get_backend(name, device)
    return _backends[key]


def layer_backend(name: str, device: torch.device):
    """The backend a layer's backward runs on: :func:`stepping`'s, else the one its ``backend`` option names."""
    return _step.backend if _step.backend is not None else backend_for(name, device)


def no_autocast(device: torch.device):
    """The layers run in their tensors' dtype (fp32 under autocast): no matmul inside may be downcast."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()  # autocast off already: no context to build on every call


AUTO = -1  # Options.L_m for a layer's L_m="auto" (the torch op's schema takes an int): the backend's levels()


@dataclass(frozen=True)
class Options:
    """How a layer runs: the backend's name, the chain's layout, the heterogeneous scan's L_m (:data:`AUTO`: the
    backend's choice) and the forward's slices (:mod:`.forward`)."""

    backend: str = "auto"
    layout: str = "fused"
    L_m: int | None = None
    slices: int | None = 1


def check_layer(cell: Cell, x, h0, c0, w: Weights, lengths) -> None:
    """Shapes, dtypes and lengths of one layer's operands, with errors that say what was expected."""
    if x.dim() != 3:
        raise ValueError(f"bppsa.nn: expected a time-major input [T, B, I], got shape {tuple(x.shape)}")
    T, B, I = x.shape
    P, H = w.out_size, cell.hidden(w)
    if T == 0:
        raise ValueError("bppsa.nn: the input has no time steps (T = 0)")
    if tuple(w.w_ih.shape) != (cell.gates * H, I) or tuple(w.w_hh.shape) != (cell.gates * H, P):
        raise ValueError(f"bppsa.nn: weights {tuple(w.w_ih.shape)}, {tuple(w.w_hh.shape)} do not fit input size {I} "
                         f"and hidden size {H}")
    if w.w_hr is not None and tuple(w.w_hr.shape) != (P, H):
        raise ValueError(f"bppsa.nn: weight_hr {tuple(w.w_hr.shape)} does not fit proj_size {P} and hidden size {H}")
    if (w.b_ih is None) != (w.b_hh is None):
        raise ValueError("bppsa.nn: give both biases or neither")
    for name, t in (("h0", h0), ("c0", c0), ("weight_ih", w.w_ih), ("weight_hh", w.w_hh), ("bias_ih", w.b_ih),
                    ("bias_hh", w.b_hh), ("weight_hr", w.w_hr)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise TypeError(f"bppsa.nn: {name} is {t.dtype} on {t.device}, the input {x.dtype} on {x.device}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"bppsa.nn: dtype {x.dtype} is not supported (float32 and float64 are; under autocast "
                        "the layers run in float32)")
    if h0 is not None and tuple(h0.shape) != (B, P):
        raise ValueError(f"bppsa.nn: h0 must be [B, {'proj_size' if w.w_hr is not None else 'H'}] = {(B, P)}, got "
                         f"{tuple(h0.shape)}")
    if c0 is not None and tuple(c0.shape) != (B, H):
        raise ValueError(f"bppsa.nn: c0 must be [B, H] = {(B, H)}, got {tuple(c0.shape)}")
    if lengths is not None:
        if lengths.dtype != torch.int64 or tuple(lengths.shape) != (B,):
            raise ValueError(f"bppsa.nn: lengths must be int64 [B] = [{B}], got {lengths.dtype} {tuple(lengths.shape)}")
        if B and (int(lengths.min()) < 1 or int(lengths.max()) > T):
            raise ValueError(f"bppsa.nn: every length must lie in [1, T = {T}], got {lengths.tolist()}")


def valid_steps(lengths: torch.Tensor | None, T: int, device, t0: int = 0) -> torch.Tensor | None:
    """[T, B] bool: whether step t0 + t of sequence b is inside it (None: every step is)."""
    if lengths is None:
        return None
    return torch.arange(t0, t0 + T, device=device)[:, None] < lengths.to(device)[None, :]


# -- the plan ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What one layer's (or one slice's) backward scans: from the ``seed`` ∇s_T [B, S], the single seed's scan, or
    with ``direct`` (the loss's gradients at the steps before the last, [T, B, S] in scan order: pair k is
    (J[k], ∂l/∂s_{T-1-k})) and ``past`` (the identity steps past a sequence's end, [T, B] in scan order) the
    affine scan; ``sums``: whether the backend may sum the weights' gradients as it scans (no ∇x, no ∇s_0, a zero
    initial state, no identity steps)."""

    seed: torch.Tensor
    direct: torch.Tensor | None
    past: torch.Tensor | None
    sums: bool

    @property
    def per_step(self) -> bool:
        return self.direct is not None or self.past is not None

    def with_seed(self, seed: torch.Tensor) -> Plan:
        return dataclasses.replace(self, seed=seed.contiguous())


def plan(cell: Cell, s: Saved, inc: Incoming, need: Needs) -> Plan:
    """The backward's :class:`Plan` from the gradients that reach the layer's outputs.  On a CPU the values decide
    (a zero per-step gradient is none, lengths that are all T are none); on a GPU only their absence, so that
    nothing syncs (a CUDA graph may capture the backward)."""
    on_cpu = s.h.device.type == "cpu"
    seed_h = inc.h[-1] if inc.h is not None else None
    if inc.h_n is not None:
        seed_h = inc.h_n if seed_h is None else seed_h + inc.h_n
    if seed_h is None:
        seed_h = s.h.new_zeros(s.h.shape[1:])
    seed_c = inc.c_n if inc.c_n is not None or s.c is None else s.c.new_zeros(s.c.shape[1:])
    seed = cell.state(seed_h, seed_c).contiguous()
    steps = inc.h is not None and (not on_cpu or bool(inc.h[:-1].any()))
    past = None
    if s.valid is not None and not (on_cpu and bool(s.valid.all())):
        past = ~s.valid.flip(0)
    direct = None
    if steps or past is not None:
        direct = s.h.new_zeros(s.h.shape[:2] + seed.shape[-1:])
        if inc.h is not None:
            direct[:-1, :, :s.h.shape[-1]] = inc.h[:-1].flip(0)  # the last pair's would be ∂l/∂s_0: no output's
    sums = not need.x and not need.state0 and s.h0 is None and s.c0 is None and past is None
    return Plan(seed, direct, past, sums)


def scan_states(cell: Cell, s: Saved, w: Weights, p: Plan, be, options: Options):
    """The states' total gradients in scan order (λ at step T - k) by ``p``'s scan, or, where ``p.sums`` lets
    the backend sum the weights' gradients as it scans, those gradients (a dict) instead."""
    layout = "fused" if p.per_step else options.layout
    ps = be.scanner(cell.kind, p.per_step)
    with jacobian_phase():
        J = cell.chain(ps, s, w, layout, with_x=p.sums)
    L_m = ps.levels(J, p.sums) if options.L_m == AUTO else options.L_m
    if p.sums:
        def from_scan(out):
            return cell.grads(s, w, cell.states_grads(out, layout).flip(0), Needs())[2]

        return ps.cell_grads(p.seed, J, L_m, from_scan, c=p.direct)
    if not p.per_step:
        return cell.states_grads(ps.scan(p.seed, J, L_m), layout)
    return affine_prefixes(ps, p.seed, J, p.direct, L_m, p.past)


@torch.no_grad()
def run(cell: Cell, s: Saved, w: Weights, inc: Incoming, need: Needs, options: Options):
    """One layer's backward: ``(dx, ds0, {weight: gradient})`` (``dx``, ``ds0`` None unless asked for)."""
    be = layer_backend(options.backend, s.x.device)
    out = scan_states(cell, s, w, plan(cell, s, inc, need), be, options)
    if isinstance(out, dict):
        return None, None, out
    return cell.grads(s, w, out.flip(0), need)


def affine_prefixes(ps, g, J, c, L_m, past=None) -> torch.Tensor:
    """THE affine scan of :mod:`bppsa.nn`: ``out[0] = g``, ``out[k] = J[k-1] out[k-1] + c[k-1]`` over the chain ``J``
    (dense [n, B, H, H], the backend's factored chain, or a diagonal [n, B, H]), by ``ps.affine_scan``, a diagonal
    chain by :func:`bppsa.scan.affine_diagonal_scan` (elementwise, any device).  The layers' per-step-gradient
    backward and :func:`bppsa.nn.affine_scan` (forward and backward) both run here."""
    if J.dim() == 3:
        if past is not None:
            J = torch.where(past.unsqueeze(-1), torch.ones((), dtype=J.dtype, device=J.device), J)
        return _scan.affine_diagonal_scan(g, J, c, L_m)
    return ps.affine_scan(g, J, c, L_m, past)


GRAD_BLOCK_VALUES = 1 << 18  # values of one block's [steps, B, gates + inputs + state] rows (grads_from_scan)


def grads_from_scan(cell: Cell, s: Saved, w: Weights, lam: torch.Tensor, need: Needs):
    """:meth:`~.cells.base.Cell.grads` from a scan's output ``lam`` (scan order: ``lam[k]`` is ∇s at step T - k),
    block by block over time (``GRAD_BLOCK_VALUES``), the gates recomputed per block from the state before it:
    beside ``dx`` no temporary grows with T, so a slice of the sequence holds its states, ``lam`` and little
    else."""
    T, B = s.h.shape[:2]
    row = cell.gates * cell.hidden(w) + s.x.shape[2] + lam.shape[-1]
    # a block's temporaries stay a fraction of the states' own T x B x S, however short the slice
    step = max(1, min(GRAD_BLOCK_VALUES // max(1, B * row), -(-T // 4)))
    dx = s.x.new_empty(s.x.shape) if need.x else None
    ds0, total = None, None
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        dxb, ds0b, grads = cell.grads(s.block(t0, t1), w, lam[T - t1:T - t0].flip(0),
                                      Needs(need.x, need.state0 and t0 == 0))
        if dx is not None:
            dx[t0:t1] = dxb
        if t0 == 0:
            ds0 = ds0b
        total = grads if total is None else {k: total[k].add_(v) for k, v in grads.items()}
    return dx, ds0, total
