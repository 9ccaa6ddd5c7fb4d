"""Table 1's companions of the operator registry: the guaranteed-zero sparsity, the paper's closed forms, and the
autograd baseline that builds a transposed Jacobian one column (one vector-Jacobian product) at a time.

The analytic transposed Jacobians themselves are built in one place only, the registry of
:mod:`bppsa.jacobians.operators` (Table 1, the FLOP analysis and ``bppsa.nn.Sequential`` all use it).
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

__all__ = [
    "guaranteed_sparsity",
    "sparsity_expression",
    "autograd_jacobian_t_columns",
]


def guaranteed_sparsity(m) -> float:
    """Fraction of entries not stored (exact for matrices built with ``drop_zeros=False``); a scipy matrix or a
    torch sparse CSR of one sample."""
    rows, cols = m.shape
    nnz = m._nnz() if isinstance(m, torch.Tensor) else m.nnz
    return 1.0 - nnz / (rows * cols)


def sparsity_expression(op: str, *, c: int, h: int, w: int, hf: int = 1, wf: int = 1) -> float:
    """Table 1's closed-form sparsity of guaranteed zeros (the conv form ignores padding, as the paper's ‡)."""
    if op == "conv2d":
        return 1.0 - hf * wf / (h * w)
    if op == "relu":
        return 1.0 - 1.0 / (c * h * w)
    if op == "maxpool2d":
        return 1.0 - hf * wf / (c * h * w)
    raise ValueError(f"unknown operator '{op}'")


def autograd_jacobian_t_columns(f, x: torch.Tensor) -> sp.csr_matrix:
    """The baseline of Table 1: the transposed Jacobian of ``f`` at ``x`` through autograd, one column
    (one output element, one vector-Jacobian product) at a time, gathered into the same CSR layout.

    Only the non-zeros of each column are kept, so memory stays at the CSR size (the dense
    transposed Jacobian of ReLU at 64x32x32 alone would take 16 GiB).
    """
    x = x.detach().clone().requires_grad_(True)
    y = f(x)
    flat = y.reshape(-1)
    e = torch.zeros_like(flat)
    rows, vals = [], []
    for j in range(flat.numel()):
        e[j] = 1.0
        (col,) = torch.autograd.grad(flat, x, e, retain_graph=True)
        e[j] = 0.0
        col = col.reshape(-1).cpu().numpy()
        # numpy, not torch.nonzero: torch's CPU nonzero keeps an input-sized buffer alive per result
        nz = np.flatnonzero(col)
        rows.append(nz)
        vals.append(col[nz])
    counts = np.array([len(r) for r in rows], dtype=np.int64)
    r = np.concatenate(rows)
    v = np.concatenate(vals)
    c = np.repeat(np.arange(flat.numel()), counts)
    return sp.csc_matrix((v, (r, c)), shape=(x.numel(), flat.numel())).tocsr()
