"""The custom ops behind :mod:`bppsa.nn`: one recurrent layer's forward and its BPPSA backward, one pair per cell.

``bppsa::<cell>`` (the forward; cell = rnn, rnn_relu, gru, lstm) returns the states h_1 .. h_T, h_n and, for the
LSTM, the cell states c_1 .. c_T and c_n (empty tensors for the other cells); ``bppsa::<cell>_backward`` returns
the gradients of the input, h0, c0 and every weight (:mod:`.backward`).  Every cell has the same schema: the wide,
flat argument lists ``torch.library`` needs live here only, and are packed once into the records of
:mod:`.cells.base` (:class:`~.cells.base.Weights`, :class:`~.cells.base.Saved`, ...).  Each op has a fake (meta)
implementation, so torch.compile traces through it without a graph break, and the forward's autograd formula calls
the backward op.  The backward op's own formula raises: BPPSA's backward is a scan, not a differentiable graph, so
there is no double backward.

One implementation serves every device: the backend named by the op's ``backend`` argument is resolved on the
tensors' device (:func:`bppsa.backends.get_backend`: the CPU kernel, the CuPy kernels, the torch twin).  The CUDA
registration only makes the tensors' device current; the CuPy backends launch on torch's current stream.

Eager mode calls the same forward and autograd formula as a plain :class:`torch.autograd.Function`
(:func:`layer`): a custom op's first call imports torch's compiler (~2 s on a 2-vCPU machine), which every
workflow job would otherwise pay.  A trace (torch.compile, a dispatch mode such as fake tensors) goes
through the op.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import backward as _bw
from . import forward as _fw
from .cells import CELLS, Cell, Incoming, Needs, Saved, Weights

_ARGS = ("Tensor x, Tensor? h0, Tensor? c0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? w_hr, "
         "Tensor? lengths")
_FWD = f"({_ARGS}, str backend, str layout, int? L_m, int? slices) -> (Tensor, Tensor, Tensor, Tensor)"
_BWD = (f"({_ARGS}, Tensor h, Tensor c, Tensor? grad_h, Tensor? grad_h_n, Tensor? grad_c_n, bool need_x, "
        "bool need_state0, str backend, str layout, int? L_m) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
N_ARGS = 13  # the forward's arguments

DOUBLE_BACKWARD = ("bppsa.nn: double backward is not supported: the BPPSA backward is a scan over the forward's "
                   "Jacobians, not a differentiable graph (use torch.nn for higher-order gradients)")


def _empty_if_none(t, like):
    return t if t is not None else like.new_empty(0)


def _define(cell: Cell):
    """Register ``bppsa::<cell>`` and ``bppsa::<cell>_backward`` with their fake and autograd formulas."""

    def forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, backend, layout, L_m, slices):
        w = Weights(w_ih, w_hh, b_ih, b_hh, w_hr)
        _bw.check_layer(cell, x, h0, c0, w, lengths)
        with _bw.no_autocast(x.device):
            h, c = _fw.layer_forward(cell, x, h0, c0, w, lengths, _bw.Options(backend, layout, L_m, slices))
        return h, h[-1].clone(), _empty_if_none(c, x), (c[-1].clone() if c is not None else x.new_empty(0))

    def gradients(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, h, c, grad_h, grad_h_n, grad_c_n, need_x,
                  need_state0, backend, layout, L_m):
        w = Weights(w_ih, w_hh, b_ih, b_hh, w_hr)
        s = Saved(x, h, c if cell.cell_state else None, h0, c0, _bw.valid_steps(lengths, x.shape[0], x.device))
        with _bw.no_autocast(x.device):
            dx, ds0, grads = _bw.run(cell, s, w, Incoming(grad_h, grad_h_n, grad_c_n),
                                     Needs(need_x, need_state0), _bw.Options(backend, layout, L_m))
        dh0, dc0 = cell.split_state(ds0, w) if ds0 is not None else (None, None)
        return (dx, dh0, dc0, grads["weight_ih_l0"], grads["weight_hh_l0"], grads.get("bias_ih_l0") if w.bias else None,
                grads.get("bias_hh_l0") if w.bias else None, grads.get("weight_hr_l0"))

    def backward(*args):
        # an op returns tensors: an empty one stands for "no gradient" (see _fake_backward)
        return tuple(t.contiguous() if t is not None else args[0].new_empty(0) for t in gradients(*args))

    fwd = torch.library.custom_op(f"bppsa::{cell.name}", forward, mutates_args=(), schema=_FWD)
    bwd = torch.library.custom_op(f"bppsa::{cell.name}_backward", backward, mutates_args=(), schema=_BWD)

    def on_device(impl):
        def run(*args):
            with torch.cuda.device(args[0].device):
                return impl(*args)
        return run

    forward_on_device = on_device(forward)
    fwd.register_kernel("cuda", forward_on_device)
    bwd.register_kernel("cuda", on_device(backward))
    gradients_on_device = on_device(gradients)

    @fwd.register_fake
    def _fake_forward(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, backend, layout, L_m, slices):
        T, B, _ = x.shape
        P, H = w_hh.shape[1], w_ih.shape[0] // cell.gates
        if cell.cell_state:
            return x.new_empty((T, B, P)), x.new_empty((B, P)), x.new_empty((T, B, H)), x.new_empty((B, H))
        return x.new_empty((T, B, P)), x.new_empty((B, P)), x.new_empty(0), x.new_empty(0)

    @bwd.register_fake
    def _fake_backward(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, h, c, grad_h, grad_h_n, grad_c_n, need_x,
                       need_state0, backend, layout, L_m):
        def like(t, needed=True):
            return t.new_empty(t.shape) if t is not None and needed else x.new_empty(0)
        return (like(x, need_x), like(h0, need_state0), like(c0, need_state0), like(w_ih), like(w_hh), like(b_ih),
                like(b_hh), like(w_hr))

    def setup_context(ctx, inputs, output):
        x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, backend, layout, L_m, slices = inputs
        ctx.save_for_backward(x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, output[0], output[2])
        ctx.options = (backend, layout, L_m)
        # an output that no loss reads gets None, not zeros: a loss on h_n alone is the paper's single-seed scan
        ctx.set_materialize_grads(False)

    def backward_formula(ctx, grad_h, grad_h_n, grad_c, grad_c_n):
        # grad_c: the cell states c_1 .. c_T are saved for the backward, never handed to a loss (the layer
        # returns c_n alone), so nothing reaches them
        need = ctx.needs_input_grad
        if grad_h is None and grad_h_n is None and grad_c_n is None:
            return (None,) * N_ARGS
        x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, h, c = ctx.saved_tensors
        need_state0 = (need[1] and h0 is not None) or (need[2] and c0 is not None)
        args = (x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, h, c, grad_h, grad_h_n, grad_c_n, need[0],
                need_state0, *ctx.options)
        if torch.is_grad_enabled() or is_in_torch_dispatch_mode():
            grads = bwd(*args)  # a trace (torch.compile) or a graph of the backward (whose own backward raises)
        else:  # eager: the implementation itself, without the dispatcher's layers of Python around a custom op
            grads = (gradients_on_device if x.is_cuda else gradients)(*args)  # None where no gradient
        keep = (need[0], need[1] and h0 is not None, need[2] and c0 is not None, need[3], need[4],
                need[5] and b_ih is not None, need[6] and b_hh is not None, need[7] and w_hr is not None)
        return (*(g if k else None for g, k in zip(grads, keep)), None, None, None, None, None)

    fwd.register_autograd(backward_formula, setup_context=setup_context)

    def no_double_backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD)

    bwd.register_autograd(no_double_backward, setup_context=lambda ctx, inputs, output: None)

    context, formula = setup_context, backward_formula  # a class body cannot read a name it assigns

    class Eager(torch.autograd.Function):
        """The op's forward and autograd formula without the dispatcher (see the module's docstring).  The forward
        takes ``ctx`` and fills it itself (the op's setup_context): a Function with a separate ``setup_context``
        has its arguments bound by ``inspect.signature`` on every call (torch's ``Function.apply``), ~40 µs of a
        layer's call."""

        @staticmethod
        def forward(ctx, *args):
            out = (forward_on_device if args[0].is_cuda else forward)(*args)
            context(ctx, args, out)
            return out

        backward = staticmethod(formula)

    return fwd, bwd, Eager


_DEFINED = {name: _define(cell) for name, cell in CELLS.items()}
OPS = {name: d[0] for name, d in _DEFINED.items()}
BACKWARD_OPS = {name: d[1] for name, d in _DEFINED.items()}
EAGER = {name: d[2] for name, d in _DEFINED.items()}


def layer(cell: Cell, x: torch.Tensor, state0: tuple, w: Weights, lengths: torch.Tensor | None = None,
          options: _bw.Options | None = None):
    """One layer through its op: ``(h [T, B, P], h_n [B, P], c_n [B, H] or None)`` from time-major ``x`` [T, B, I]
    and ``state0 = (h0, c0)`` (None: zero).  Traced (torch.compile, a dispatch mode): the custom op; eager: its
    :class:`torch.autograd.Function` twin, the same functions."""
    options = options if options is not None else _bw.Options()
    args = (x, *state0, *w.tensors(), lengths, options.backend, options.layout, options.L_m, options.slices)
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        h, h_n, _, c_n = OPS[cell.name](*args)
    else:
        h, h_n, _, c_n = EAGER[cell.name].apply(*args)
    return h, h_n, (c_n if cell.cell_state else None)
