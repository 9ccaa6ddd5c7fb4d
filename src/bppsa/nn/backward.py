"""One recurrent layer's forward and its BPPSA backward, on plain tensors (the custom ops of :mod:`.ops` call these).

Time-major throughout: ``x`` [T, B, I], the states ``h`` [T, B, H] hold h_1 .. h_T.  With ``lengths``, the steps
past a sequence's end carry its state (h_t = h_{t-1}), so ``h[-1]`` is each sequence's last valid state; in the
backward those steps are identity Jacobians whose cell receives no gradient.

The backward is the scan of :mod:`bppsa.scan` with ∇h_T first:

* **single seed** (the paper's case: only h_n, or only h_T, receives a gradient, every sequence full length):
  the backend's own chain and scan, today's fast paths; where neither the input nor h0 needs a gradient and h0
  is zero, ``backend.cell_grads`` (the CPU kernel accumulates the parameter gradients as it scans);
* **per step** (a gradient on every h_t, or sequences of several lengths): the affine scan over pairs
  (:func:`bppsa.scan.affine_blelloch_scan`) on dense Jacobians, by the backend :func:`per_step_backend` picks.

Either way the scan yields the total ∇h_t, from which the gates' gradients, every weight's, ∇x and ∇h0 are
GEMMs over the T·B rows.

A training step that measures itself (the harness's :meth:`bppsa.models.recurrent.RecurrentClassifier.bppsa_step`)
wraps its ``loss.backward()`` in :func:`stepping`: the layers' backward then runs on the step's own backend instance
(the sequential rival, an emulated kernel: any :class:`~bppsa.backends.base.Backend`) and times the building of
its chain as the phase ``jacobian``.
"""
from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import torch

from .. import scan as _scan
from ..backends import TorchBackend, get_backend
from ..jacobians.gru import gru_gate_grads, gru_gates
from ..jacobians.recurrent import rnn_grad_preact

CELLS = ("rnn", "gru")
GATES = {"rnn": 1, "gru": 3}

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


def _jacobian_phase():
    return _step.phase("jacobian") if _step.phase is not None else contextlib.nullcontext()


def backend_for(name: str, device: torch.device):
    """The backend ``name`` resolves to on ``device``, one instance per (name, device): its workspace then
    lives from step to step, and 'auto' warns once."""
    key = (name, str(device))
    if key not in _backends:
        _backends[key] = get_backend(name, device)
    return _backends[key]


def per_step_backend(backend, device: torch.device):
    """The backend that scans the per-step-gradient (affine) recurrence and the chains with identity steps: the
    backend's own answer (:meth:`~bppsa.backends.base.Backend.scanner`)."""
    return backend.scanner("rnn", per_step=True)


def no_autocast(device: torch.device):
    """The layers run in their tensors' dtype (fp32 under autocast): no matmul inside may be downcast."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()  # autocast off already: no context to build on every call


def check_layer(cell: str, x, h0, w_ih, w_hh, b_ih, b_hh, lengths) -> None:
    """Shapes, dtypes and lengths of one layer's operands, with errors that say what was expected."""
    if x.dim() != 3:
        raise ValueError(f"bppsa.nn: expected a time-major input [T, B, I], got shape {tuple(x.shape)}")
    T, B, I = x.shape
    H = w_hh.shape[1]
    G = GATES[cell]
    if T == 0:
        raise ValueError("bppsa.nn: the input has no time steps (T = 0)")
    if tuple(w_ih.shape) != (G * H, I) or tuple(w_hh.shape) != (G * H, H):
        raise ValueError(f"bppsa.nn: weights {tuple(w_ih.shape)}, {tuple(w_hh.shape)} do not fit input size {I} "
                         f"and hidden size {H}")
    if (b_ih is None) != (b_hh is None):
        raise ValueError("bppsa.nn: give both biases or neither")
    for name, t in (("h0", h0), ("weight_ih", w_ih), ("weight_hh", w_hh), ("bias_ih", b_ih), ("bias_hh", b_hh)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise TypeError(f"bppsa.nn: {name} is {t.dtype} on {t.device}, the input {x.dtype} on {x.device}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"bppsa.nn: dtype {x.dtype} is not supported (float32 and float64 are; under autocast "
                        "the layers run in float32)")
    if h0 is not None and tuple(h0.shape) != (B, H):
        raise ValueError(f"bppsa.nn: h0 must be [B, H] = {(B, H)}, got {tuple(h0.shape)}")
    if lengths is not None:
        if lengths.dtype != torch.int64 or tuple(lengths.shape) != (B,):
            raise ValueError(f"bppsa.nn: lengths must be int64 [B] = [{B}], got {lengths.dtype} {tuple(lengths.shape)}")
        if B and (int(lengths.min()) < 1 or int(lengths.max()) > T):
            raise ValueError(f"bppsa.nn: every length must lie in [1, T = {T}], got {lengths.tolist()}")


def valid_steps(lengths: torch.Tensor | None, T: int, device) -> torch.Tensor | None:
    """[T, B] bool: whether step t of sequence b is inside it (None: every step is)."""
    if lengths is None:
        return None
    return torch.arange(T, device=device)[:, None] < lengths.to(device)[None, :]


def torch_layer(cell: str, x, hx, w_ih, w_hh, b_ih, b_hh, batch_sizes=None):
    """``(output, h_n)`` of one layer by torch's own recurrent kernel (cuDNN on a GPU), as torch.nn.RNN/GRU call it:
    ``x`` [T, B, I] (or a PackedSequence's data with its ``batch_sizes``), ``hx`` [1, B, H].  Differentiable by
    autograd: the harness's baseline trains through it, the layers' forward runs it without a graph.  cuDNN keeps
    what its backward needs only in training mode, so that is the mode wherever autograd records (no dropout
    here, so the numbers are the same)."""
    params = [w_ih, w_hh] + ([b_ih, b_hh] if b_ih is not None else [])
    run = torch.rnn_tanh if cell == "rnn" else torch.gru
    train = torch.is_grad_enabled()
    if batch_sizes is None:
        return run(x, hx, params, b_ih is not None, 1, 0.0, train, False, False)
    return run(x, batch_sizes, hx, params, b_ih is not None, 1, 0.0, train, False)


@torch.no_grad()
def layer_forward(cell: str, x, h0, w_ih, w_hh, b_ih, b_hh, lengths) -> torch.Tensor:
    """The states h_1 .. h_T [T, B, H] by torch's own recurrent kernels (cuDNN on a GPU), the steps past each
    sequence's end carrying its last state."""
    T, B, _ = x.shape
    H = w_hh.shape[1]
    hx = (h0 if h0 is not None else x.new_zeros(B, H)).unsqueeze(0).contiguous()
    if lengths is None or bool((lengths == T).all()):
        return torch_layer(cell, x, hx, w_ih, w_hh, b_ih, b_hh)[0].contiguous()
    # the packed path, as torch.nn.RNN/GRU runs a PackedSequence: the same kernels, the same numbers
    nn_rnn = torch.nn.utils.rnn
    packed = nn_rnn.pack_padded_sequence(x, lengths.cpu(), enforce_sorted=False)
    data, _ = torch_layer(cell, packed.data, hx.index_select(1, packed.sorted_indices), w_ih, w_hh, b_ih, b_hh,
                          packed.batch_sizes)
    out, _ = nn_rnn.pad_packed_sequence(packed._replace(data=data), total_length=T)
    last = torch.minimum(torch.arange(T, device=x.device)[:, None], (lengths.to(x.device) - 1)[None, :])
    return out.gather(0, last.unsqueeze(-1).expand(T, B, H)).contiguous()


def _gru_cell(w_ih, w_hh, b_ih, b_hh):
    """What the backends take as the GRU (torch.nn.GRU's attribute names), zero biases where there are none."""
    if b_ih is None:
        b_ih, b_hh = w_ih.new_zeros(w_ih.shape[0]), w_hh.new_zeros(w_hh.shape[0])
    return SimpleNamespace(weight_ih_l0=w_ih, weight_hh_l0=w_hh, bias_ih_l0=b_ih, bias_hh_l0=b_hh)


def _single_seed(grad_h, lengths, T: int, device) -> bool:
    """Whether only h_T receives a gradient, from every sequence at its step T: the paper's scan.  On a CPU the
    values decide (a zero per-step gradient is none); on a GPU only their absence, so that nothing syncs (a
    CUDA graph may capture the backward)."""
    on_cpu = device.type == "cpu"
    no_steps = grad_h is None or (on_cpu and not bool(grad_h[:-1].any()))
    full = lengths is None or (on_cpu and bool((lengths == T).all()))
    return no_steps and full


@torch.no_grad()
def layer_backward(cell: str, x, h0, w_ih, w_hh, b_ih, b_hh, lengths, h, grad_h, grad_h_n, need_x: bool,
                   need_h0: bool, backend: str, layout: str, L_m: int | None):
    """The gradients ``(dx, dh0, dW_ih, dW_hh, db_ih, db_hh)`` of one layer from the gradients of its outputs,
    ``grad_h`` (∂l/∂h_t, every step; None: none) and ``grad_h_n`` (∂l/∂h_n; None: none); ``dx`` and ``dh0``
    are None unless asked for, the biases' where there are none."""
    T, B, _ = x.shape
    dev = x.device
    be = _step.backend if _step.backend is not None else backend_for(backend, dev)
    seed = grad_h[-1] if grad_h is not None else None
    if grad_h_n is not None:
        seed = grad_h_n if seed is None else seed + grad_h_n
    if seed is None:
        seed = h.new_zeros(h.shape[1:])
    seed = seed.contiguous()
    valid = valid_steps(lengths, T, dev)
    gates = None  # the GRU's gates, recomputed where something asks (not where the CPU kernel does it itself)
    if cell == "gru":
        b = _gru_cell(w_ih, w_hh, b_ih, b_hh)
        gates = functools.cache(lambda: gru_gates(x, h, w_ih, w_hh, b.bias_ih_l0, b.bias_hh_l0, h0))

    if _single_seed(grad_h, lengths, T, dev):
        if not need_x and not need_h0 and h0 is None:
            # the harness's training step: the backend may accumulate the weights' gradients as it scans
            with _jacobian_phase():
                J = layer_chain(be, cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, layout, with_x=True)
            grads = be.cell_grads(seed, J, L_m, lambda out: _grads(cell, x, h0, w_ih, w_hh, h, gates, None,
                                                                   _dh(cell, out, layout), layout, out)[2])
            return None, None, *_weights(grads, b_ih is not None)
        with _jacobian_phase():
            J = layer_chain(be, cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, layout)
        scan = be.scan(seed, J, L_m)
        dh = _dh(cell, scan, layout)
    elif valid is None and not need_x and not need_h0 and h0 is None:
        # a loss on every state, full lengths: the backend may accumulate the weights' gradients as it scans
        ps = per_step_backend(be, dev)
        with _jacobian_phase():
            J = layer_chain(ps, cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, "fused", with_x=True)
        grads = ps.cell_grads(seed, J, L_m, lambda out: _grads(
            cell, x, h0, w_ih, w_hh, h, gates, None, _dh(cell, out, "fused"), "fused", out)[2], c=_direct(grad_h, h))
        return None, None, *_weights(grads, b_ih is not None)
    else:
        layout, scan = "fused", None
        dh = per_step_scan(per_step_backend(be, dev), cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, valid, seed,
                           grad_h, L_m)
    dx, dh0, grads = _grads(cell, x, h0, w_ih, w_hh, h, gates, valid, dh, layout, scan, need_x, need_h0)
    return dx, dh0, *_weights(grads, b_ih is not None)


def _weights(grads: dict, bias: bool):
    return (grads["weight_ih_l0"], grads["weight_hh_l0"],
            grads["bias_ih_l0"] if bias else None, grads["bias_hh_l0"] if bias else None)


def layer_chain(be, cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, layout, with_x=False):
    """The backend's transposed Jacobians in scan order (dense, or kept as factors by the fast paths), from the
    forward's states ``h`` [T, B, H]; ``with_x``: a factored chain also keeps the inputs, for the weights'
    gradients accumulated as it scans.  ``gates``: a callable that gives the GRU's recomputed gates (None: the
    backend recomputes them with h0 = 0)."""
    if cell == "rnn":
        return be.rnn_jacobians_t(h, w_hh, layout, x if with_x else None)
    return be.gru_jacobians_t(x, h, _gru_cell(w_ih, w_hh, b_ih, b_hh), gates)


def _dh(cell: str, scan: torch.Tensor, layout: str) -> torch.Tensor:
    """The total ∇h_t, t = 1..T (time order), from the scan's output (the paper layout interleaves ∇a_t)."""
    return (scan[0::2] if cell == "rnn" and layout == "paper" else scan).flip(0)


def per_step_scan(be, cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, valid, seed, grad_h, L_m):
    """∇h_t (time order) where a gradient enters at every step or the sequences end apart: the affine scan of
    ``be`` (:func:`per_step_backend`) over its fused chain, identities at the steps past a sequence's end."""
    with _jacobian_phase():
        J = layer_chain(be, cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, "fused")
    past = None if valid is None else ~valid.flip(0)  # scan order: J[k] is step T - k
    return affine_prefixes(be, seed, J, _direct(grad_h, h), L_m, past).flip(0)


def affine_prefixes(ps, g, J, c, L_m, past=None) -> torch.Tensor:
    """THE affine scan of :mod:`bppsa.nn`: ``out[0] = g``, ``out[k] = J[k-1] out[k-1] + c[k-1]`` over the chain ``J``
    (dense [n, B, H, H], the backend's factored chain, or a diagonal [n, B, H]), by ``ps.affine_scan`` (``ps``: the
    backend :func:`per_step_backend` chose), a diagonal chain by :func:`bppsa.scan.affine_diagonal_scan`
    (elementwise, any device).  The layers' per-step-gradient backward and :func:`bppsa.nn.affine_scan` (forward
    and backward) both run here."""
    if J.dim() == 3:
        if past is not None:
            J = torch.where(past.unsqueeze(-1), torch.ones((), dtype=J.dtype, device=J.device), J)
        return _scan.affine_diagonal_scan(g, J, c, L_m)
    return ps.affine_scan(g, J, c, L_m, past)


def _direct(grad_h, h) -> torch.Tensor:
    """The affine scan's vectors c [T, B, H] (scan order) from ∂l/∂h_t (time order): pair k is (J[k], ∂l/∂h_{T-1-k});
    the last one's vector would be ∂l/∂h_0, which no output reads."""
    c = h.new_zeros(h.shape)
    if grad_h is not None:
        c[:-1] = grad_h[:-1].flip(0)
    return c


GRAD_BLOCK_VALUES = 1 << 18  # values of one block's [steps, B, gates + inputs + hidden] rows (grads_from_scan)


def grads_from_scan(cell, x, h0, w_ih, w_hh, b_ih, b_hh, h, valid, lam, need_x=False, need_h0=False):
    """:func:`_grads` from the scan's own output ``lam`` (scan order: ``lam[k]`` is ∇h at step T - k), block by block
    over time (``GRAD_BLOCK_VALUES``), the GRU's gates recomputed per block from the state before it: beside ``dx``
    no temporary grows with T, so a slice of the sequence holds its states, ``lam`` and little else."""
    T, B, H = h.shape
    # a block's temporaries stay a fraction of the states' own T x B x H, however short the slice
    step = max(1, min(GRAD_BLOCK_VALUES // max(1, B * (GATES[cell] * H + x.shape[2] + H)), -(-T // 4)))
    dx = x.new_empty(x.shape) if need_x else None
    dh0, total = None, None
    cb = _gru_cell(w_ih, w_hh, b_ih, b_hh) if cell == "gru" else None
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        prev = h0 if t0 == 0 else h[t0 - 1]
        gates = None
        if cell == "gru":
            g = gru_gates(x[t0:t1], h[t0:t1], w_ih, w_hh, cb.bias_ih_l0, cb.bias_hh_l0, prev)
            gates = lambda g=g: g  # noqa: E731 - what _grads calls
        dxb, dh0b, grads = _grads(cell, x[t0:t1], prev, w_ih, w_hh, h[t0:t1], gates,
                                  None if valid is None else valid[t0:t1], lam[T - t1:T - t0].flip(0), "fused", None,
                                  need_x, need_h0 and t0 == 0)
        if dx is not None:
            dx[t0:t1] = dxb
        if t0 == 0:
            dh0 = dh0b
        total = grads if total is None else {k: total[k].add_(v) for k, v in grads.items()}
    return dx, dh0, total


def _grads(cell, x, h0, w_ih, w_hh, h, gates, valid, dh, layout, scan, need_x=False, need_h0=False):
    """``(dx, dh0, {weight: gradient})`` from the total ∇h_t: the gradients of the cell's pre-activations
    (∇a_t for the RNN, the gates' for the GRU; zero past a sequence's end), then GEMMs over the T·B rows."""
    T, B, H = h.shape
    hp = torch.cat([h0.unsqueeze(0) if h0 is not None else h.new_zeros((1, B, H)), h[:-1]])  # h_{t-1}
    if cell == "rnn":
        ga = rnn_grad_preact(scan, h, layout) if scan is not None else dh * (1 - h * h)
        gi = gh = ga if valid is None else ga * valid.unsqueeze(-1)
        carry_h0 = 0
    else:
        gates = gates()
        G = gru_gate_grads(gates, dh)  # (dR, dZ, dN, dM)
        if valid is not None:
            G = G * valid.unsqueeze(-1)
        gi = G[..., :3 * H]  # ∂l/∂(W_ih x + b_ih), gates r, z, n
        gh = torch.cat([G[..., :2 * H], G[..., 3 * H:]], -1)  # ∂l/∂(W_hh h' + b_hh), gates r, z, n
        carry_h0 = dh[0] * gates.z[0]  # h = (1 - z) n + z h': the direct path to h'
    gi2, gh2 = gi.reshape(T * B, -1), gh.reshape(T * B, -1)
    grads = {"weight_ih_l0": gi2.t() @ x.reshape(T * B, -1), "weight_hh_l0": gh2.t() @ hp.reshape(T * B, H),
             "bias_ih_l0": gi2.sum(0), "bias_hh_l0": gh2.sum(0)}
    dx = (gi2 @ w_ih).view(x.shape) if need_x else None
    dh0 = gh[0] @ w_hh + carry_h0 if need_h0 else None
    return dx, dh0, grads
