"""The custom ops behind :mod:`bppsa.nn`: one recurrent layer's forward and its BPPSA backward, per cell.

``bppsa::rnn`` and ``bppsa::gru`` (the forward) return the states h_1 .. h_T and h_n; ``bppsa::rnn_backward``
and ``bppsa::gru_backward`` return the gradients of the input, h0 and every weight (:mod:`.backward`).  Each
has a fake (meta) implementation, so torch.compile traces through them without a graph break, and the forward's
autograd formula calls the backward op.  The backward op's own formula raises: BPPSA's backward is a scan, not
a differentiable graph, so there is no double backward.

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

_FWD = ("(Tensor x, Tensor? h0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? lengths, "
        "str backend, str layout, int? L_m) -> (Tensor, Tensor)")
_BWD = ("(Tensor x, Tensor? h0, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, Tensor? lengths, Tensor h, "
        "Tensor? grad_h, Tensor? grad_h_n, bool need_x, bool need_h0, str backend, str layout, int? L_m) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")

DOUBLE_BACKWARD = ("bppsa.nn: double backward is not supported: the BPPSA backward is a scan over the forward's "
                   "Jacobians, not a differentiable graph (use torch.nn.RNN/GRU for higher-order gradients)")


def _define(cell: str):
    """Register ``bppsa::<cell>`` and ``bppsa::<cell>_backward`` with their fake and autograd formulas."""

    def forward(x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend, layout, L_m):
        _bw.check_layer(cell, x, h0, w_ih, w_hh, b_ih, b_hh, lengths)
        with _bw.no_autocast(x.device):
            h = _bw.layer_forward(cell, x, h0, w_ih, w_hh, b_ih, b_hh, lengths)
        return h, h[-1].clone()

    def gradients(x, h0, w_ih, w_hh, b_ih, b_hh, lengths, h, grad_h, grad_h_n, need_x, need_h0, backend, layout,
                  L_m):
        with _bw.no_autocast(x.device):
            return _bw.layer_backward(cell, x, h0, w_ih, w_hh, b_ih, b_hh, lengths, h, grad_h, grad_h_n, need_x,
                                      need_h0, backend, layout, L_m)

    def backward(*args):
        # an op returns tensors: an empty one stands for "no gradient" (see _fake_backward)
        return tuple(t.contiguous() if t is not None else args[0].new_empty(0) for t in gradients(*args))

    fwd = torch.library.custom_op(f"bppsa::{cell}", forward, mutates_args=(), schema=_FWD)
    bwd = torch.library.custom_op(f"bppsa::{cell}_backward", backward, mutates_args=(), schema=_BWD)

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
    def _fake_forward(x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend, layout, L_m):
        T, B, _ = x.shape
        H = w_hh.shape[1]
        return x.new_empty((T, B, H)), x.new_empty((B, H))

    @bwd.register_fake
    def _fake_backward(x, h0, w_ih, w_hh, b_ih, b_hh, lengths, h, grad_h, grad_h_n, need_x, need_h0, backend,
                       layout, L_m):
        def like(t, needed=True):
            return t.new_empty(t.shape) if t is not None and needed else x.new_empty(0)
        return like(x, need_x), like(h0, need_h0), like(w_ih), like(w_hh), like(b_ih), like(b_hh)

    def setup_context(ctx, inputs, output):
        x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend, layout, L_m = inputs
        ctx.save_for_backward(x, h0, w_ih, w_hh, b_ih, b_hh, lengths, output[0])
        ctx.options = (backend, layout, L_m)
        # an output that no loss reads gets None, not zeros: a loss on h_n alone is the paper's single-seed scan
        ctx.set_materialize_grads(False)

    def backward_formula(ctx, grad_h, grad_h_n):
        need = ctx.needs_input_grad
        if grad_h is None and grad_h_n is None:
            return (None,) * 10
        x, h0, w_ih, w_hh, b_ih, b_hh, lengths, h = ctx.saved_tensors
        need_h0 = need[1] and h0 is not None
        args = (x, h0, w_ih, w_hh, b_ih, b_hh, lengths, h, grad_h, grad_h_n, need[0], need_h0, *ctx.options)
        if torch.is_grad_enabled() or is_in_torch_dispatch_mode():
            grads = bwd(*args)  # a trace (torch.compile) or a graph of the backward (whose own backward raises)
        else:  # eager: the implementation itself, without the dispatcher's layers of Python around a custom op
            grads = (gradients_on_device if x.is_cuda else gradients)(*args)  # None where no gradient
        keep = (need[0], need_h0, need[2], need[3], need[4] and b_ih is not None, need[5] and b_hh is not None)
        return (*(g if k else None for g, k in zip(grads, keep)), None, None, None, None)

    fwd.register_autograd(backward_formula, setup_context=setup_context)

    def no_double_backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD)

    bwd.register_autograd(no_double_backward, setup_context=lambda ctx, inputs, output: None)

    context, formula = setup_context, backward_formula  # a class body cannot read a name it assigns

    class Eager(torch.autograd.Function):
        """The op's forward and autograd formula without the dispatcher (see the module's docstring)."""

        @staticmethod
        def forward(*args):
            return (forward_on_device if args[0].is_cuda else forward)(*args)

        setup_context = staticmethod(context)
        backward = staticmethod(formula)

    return fwd, bwd, Eager


rnn, rnn_backward, _rnn_eager = _define("rnn")
gru, gru_backward, _gru_eager = _define("gru")
OPS = {"rnn": rnn, "gru": gru}
EAGER = {"rnn": _rnn_eager, "gru": _gru_eager}


def layer(cell: str, x: torch.Tensor, h0: torch.Tensor | None, w_ih: torch.Tensor, w_hh: torch.Tensor,
          b_ih: torch.Tensor | None, b_hh: torch.Tensor | None, lengths: torch.Tensor | None = None,
          backend: str = "auto", layout: str = "fused", L_m: int | None = None):
    """One layer through its op: ``(h [T, B, H], h_n [B, H])`` from time-major ``x`` [T, B, I].  Traced (torch.compile,
    a dispatch mode): the custom op; eager: its :class:`torch.autograd.Function` twin, the same functions."""
    args = (x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend, layout, L_m)
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return OPS[cell](*args)
    return EAGER[cell].apply(*args)
