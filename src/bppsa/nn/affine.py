"""``bppsa.nn.affine_scan``: the linear recurrence ``h_t = A_t h_{t-1} + b_t`` as one differentiable op.

::

    h = bppsa.nn.affine_scan(A, b, h0)      # A [T, B, H, H] (dense) or [T, B, H] (diagonal), b [T, B, H]
    h.square().sum().backward()             # A.grad, b.grad, h0.grad

**Forward**: the parallel (Blelloch) scan of the pairs ``(A_t, b_t)``: the backend's ``affine_scan``
(:func:`bppsa.nn.backward.affine_prefixes`, the one the layers' per-step-gradient backward runs), or for a
diagonal ``A`` the elementwise tree (:func:`bppsa.scan.affine_diagonal_scan`).

**Backward**: the adjoint of a linear recurrence is the same recurrence run backwards,
``λ_t = ∂l/∂h_t + A_{t+1}ᵀ λ_{t+1}`` from ``λ_T = ∂l/∂h_T``: a *reverse* affine scan over the pairs
``(A_{t+1}ᵀ, ∂l/∂h_t)``, by the same function as the forward (the scan is not differentiated through its tree).
From it ``∂l/∂b_t = λ_t``, ``∂l/∂A_t = λ_t h_{t-1}ᵀ`` (diagonal: ``λ_t ⊙ h_{t-1}``), ``∂l/∂h0 = A_1ᵀ λ_1``.  What the
backward keeps is ``A``, the states ``h`` and ``h0``: memory linear in T, as the sequential loop's.

Both directions are custom ops (``bppsa::affine_scan``, ``bppsa::affine_scan_backward``) with fake formulas, so
torch.compile traces them without a graph break; there is no double backward.
"""
from __future__ import annotations

import torch

from . import backward as _bw

_FWD = "(Tensor A, Tensor b, Tensor? h0, str backend, int? L_m) -> Tensor"
_BWD = ("(Tensor A, Tensor h, Tensor? h0, Tensor grad_h, bool need_h0, str backend, int? L_m) "
        "-> (Tensor, Tensor, Tensor)")


def _check(A: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None) -> bool:
    """Whether ``A`` is dense; a clear error naming the argument otherwise."""
    if b.dim() != 3 or b.shape[0] == 0:
        raise ValueError(f"bppsa.nn.affine_scan: b must be [T, B, H] with T >= 1, got {tuple(b.shape)}")
    T, B, H = b.shape
    if tuple(A.shape) not in ((T, B, H, H), (T, B, H)):
        raise ValueError(f"bppsa.nn.affine_scan: A must be [T, B, H, H] = {(T, B, H, H)} (dense) or [T, B, H] "
                         f"(diagonal) for b {tuple(b.shape)}, got {tuple(A.shape)}")
    for name, t in (("A", A), ("h0", h0)):
        if t is not None and (t.dtype != b.dtype or t.device != b.device):
            raise TypeError(f"bppsa.nn.affine_scan: {name} is {t.dtype} on {t.device}, b {b.dtype} on {b.device}")
    if b.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"bppsa.nn.affine_scan: dtype {b.dtype} is not supported (float32 and float64 are)")
    if h0 is not None and tuple(h0.shape) != (B, H):
        raise ValueError(f"bppsa.nn.affine_scan: h0 must be [B, H] = {(B, H)}, got {tuple(h0.shape)}")
    return A.dim() == 4


def _apply(A, v, dense: bool):
    return torch.matmul(A, v.unsqueeze(-1)).squeeze(-1) if dense else A * v


def _backend(name: str, device):
    """The backend that scans a dense chain's affine recurrence: the layers' backend's answer
    (:meth:`~bppsa.backends.base.Backend.scanner`)."""
    return _bw.layer_backend(name, device).scanner("dense", per_step=True)


@torch.no_grad()
def _forward(A, b, h0, backend, L_m):
    dense = _check(A, b, h0)
    T = b.shape[0]
    with _bw.no_autocast(b.device):
        h1 = b[0] + (_apply(A[0], h0, dense) if h0 is not None else 0)
        if T == 1:
            return h1.unsqueeze(0).contiguous()
        # prefixes of out[k] = A[k] out[k-1] + b[k] from out[0] = h_1: h_1 .. h_{T-1}; then h_T
        pre = _bw.affine_prefixes(_backend(backend, b.device), h1.contiguous(), A[1:].contiguous(),
                                  b[1:].contiguous(), L_m)
        hT = _apply(A[-1], pre[-1], dense) + b[-1]
        return torch.cat([pre, hT.unsqueeze(0)])


@torch.no_grad()
def _backward(A, h, h0, grad_h, need_h0, backend, L_m):
    dense = A.dim() == 4
    T = h.shape[0]
    with _bw.no_autocast(h.device):
        lam_T = grad_h[-1].contiguous()
        if T == 1:
            lam = grad_h.clone()
        else:
            # the adjoint in reverse order: out[0] = λ_T, out[k] = A_{T-k+1}ᵀ out[k-1] + ∂l/∂h_{T-k}: λ_T .. λ_2
            At = A[1:].flip(0)
            At = At.transpose(-1, -2).contiguous() if dense else At.contiguous()
            rev = _bw.affine_prefixes(_backend(backend, h.device), lam_T, At, grad_h[:-1].flip(0).contiguous(), L_m)
            lam_1 = _apply(At[-1], rev[-1], dense) + grad_h[0]
            lam = torch.cat([lam_1.unsqueeze(0), rev.flip(0)])
        hp = torch.cat([(h0 if h0 is not None else h.new_zeros(h.shape[1:])).unsqueeze(0), h[:-1]])
        dA = lam.unsqueeze(-1) * hp.unsqueeze(-2) if dense else lam * hp
        dh0 = (_apply(A[0].transpose(-1, -2) if dense else A[0], lam[0], dense) if need_h0
               else h.new_empty(0))
        return dA, lam, dh0


DOUBLE_BACKWARD = ("bppsa.nn.affine_scan: double backward is not supported: the backward is a reverse scan, not a "
                   "differentiable graph")

affine_scan_op = torch.library.custom_op("bppsa::affine_scan", _forward, mutates_args=(), schema=_FWD)
affine_scan_backward_op = torch.library.custom_op("bppsa::affine_scan_backward", _backward, mutates_args=(),
                                                  schema=_BWD)


@affine_scan_op.register_fake
def _fake_forward(A, b, h0, backend, L_m):
    return b.new_empty(b.shape)


@affine_scan_backward_op.register_fake
def _fake_backward(A, h, h0, grad_h, need_h0, backend, L_m):
    return A.new_empty(A.shape), h.new_empty(h.shape), (h.new_empty(h.shape[1:]) if need_h0 else h.new_empty(0))


def _setup_context(ctx, inputs, output):
    A, b, h0, backend, L_m = inputs
    ctx.save_for_backward(A, h0, output)
    ctx.options = (backend, L_m)


def _backward_formula(ctx, grad_h):
    A, h0, h = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_h0 = bool(need[2]) and h0 is not None
    dA, db, dh0 = affine_scan_backward_op(A, h, h0, grad_h.contiguous(), need_h0, *ctx.options)
    return (dA if need[0] else None, db if need[1] else None, dh0 if need_h0 else None, None, None)


affine_scan_op.register_autograd(_backward_formula, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD)


affine_scan_backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def affine_scan(A: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None = None, *, backend: str = "auto",
                L_m: int | None = None) -> torch.Tensor:
    """The states ``h`` [T, B, H] of ``h_t = A_t h_{t-1} + b_t`` (t = 1 .. T, ``h_0 = h0`` or zero): ``A`` [T, B, H, H]
    (dense) or [T, B, H] (diagonal), ``b`` [T, B, H], ``h0`` [B, H] or None.  Differentiable in ``A``, ``b`` and
    ``h0``; forward and backward are parallel scans (the module's docstring).  ``backend``: where a dense scan
    runs (:data:`bppsa.backends.BACKENDS`); ``L_m``: the heterogeneous scan's up-sweep levels (None: all)."""
    from ..backends import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"bppsa.nn.affine_scan: unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")
    if L_m is not None and (not isinstance(L_m, int) or L_m < 0):
        raise ValueError(f"bppsa.nn.affine_scan: L_m must be None (the full tree) or an int >= 0, got {L_m!r}")
    _check(A, b, h0)
    return affine_scan_op(A, b, h0, backend, L_m)
