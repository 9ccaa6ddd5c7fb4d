"""Transposed Jacobians of recurrent cells, batched and dense, in the scan order of bppsa.scan.

Time-major throughout: hidden states ``h`` are ``[T, B, H]`` holding h_1 .. h_T.  The scan runs
from the loss backwards, so element k of the result belongs to time step T - k.
"""
from __future__ import annotations

import torch

from . import LAYOUTS

ACTIVATIONS = ("tanh", "relu")


def derivative(h: torch.Tensor, act: str = "tanh") -> torch.Tensor:
    """dh_t/da_t from the state itself, elementwise: 1 - h² for tanh, 1[h > 0] for relu (h = relu(a) > 0 exactly
    where a > 0)."""
    if act == "tanh":
        return 1 - h * h
    if act == "relu":
        return (h > 0).to(h.dtype)
    raise ValueError(f"unknown nonlinearity '{act}' (choose from {', '.join(ACTIVATIONS)})")


def num_jacobians(T: int, layout: str) -> int:
    """How many transposed Jacobians a T-step RNN has in ``layout``: one per step (fused) or two (paper)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout '{layout}' (choose from {', '.join(LAYOUTS)})")
    return T if layout == "fused" else 2 * T


def rnn_jacobians_t(h: torch.Tensor, W_hh: torch.Tensor, layout: str, out: torch.Tensor | None = None,
                    act: str = "tanh") -> torch.Tensor:
    """Transposed Jacobians of the Elman RNN ``h_t = tanh(a_t)`` (or ``relu(a_t)``: ``act``),
    ``a_t = W_ih x_t + W_hh h_{t-1} + b``; below for tanh, relu's ``1[h_t > 0]`` in place of ``1 - h_t²``.

    * ``paper``: two per step, as in the paper -- ``(∂h_t/∂a_t)ᵀ = diag(1 - h_t²)`` then
      ``(∂a_t/∂h_{t-1})ᵀ = W_hhᵀ``; result ``[2T, B, H, H]``; the scan then yields
      ``[∇h_T, ∇a_T, ∇h_{T-1}, ∇a_{T-1}, ...]``.
    * ``fused``: one per step, ``(∂h_t/∂h_{t-1})ᵀ = W_hhᵀ diag(1 - h_t²)``; result ``[T, B, H, H]``;
      the scan yields ``[∇h_T, ..., ∇h_1]``.

    ``out`` (optional) is a buffer of the result's shape to write into.
    """
    T, B, H = h.shape
    shape = (num_jacobians(T, layout), B, H, H)
    d = derivative(h, act).flip(0)  # [T, B, H], step T first
    Wt = W_hh.t()
    if layout == "fused":
        return torch.mul(Wt, d.unsqueeze(-2), out=out)  # scale column j of W_hhᵀ by d_j
    if layout == "paper":
        J = (out if out is not None else h.new_empty(shape)).view(T, 2, B, H, H)
        J[:, 0].zero_()
        J[:, 0].diagonal(dim1=-2, dim2=-1).copy_(d)
        J[:, 1] = Wt
        return J.view(shape)


def rnn_grad_preact(scan_out: torch.Tensor, h: torch.Tensor, layout: str, act: str = "tanh") -> torch.Tensor:
    """∇a_t for t = 1..T (time-major, ``[T, B, H]``) from the scan's output."""
    if layout == "paper":
        return scan_out[1::2].flip(0)
    return (scan_out.flip(0)) * derivative(h, act)
