"""Transposed Jacobians of the GRU (Appendix E, Eq. 11), batched and dense, in scan order.

PyTorch stacks the gate weights as ``[r; z; n]`` (``weight_hh_l0`` is ``[3H, H]``).  With
``h'`` = h_{t-1}, ``M = W_hn h' + b_hn``, ``N = W_in x + b_in + r∘M``::

    (∂h/∂h')ᵀ = W_hrᵀ diag((1-z)(1-n²) M r(1-r)) + W_hnᵀ diag((1-z)(1-n²) r)
              + W_hzᵀ diag((h'-n) z(1-z)) + diag(z)

cuDNN keeps its gates to itself, so they are recomputed here for all t at once (two batched
matmuls), which is the forward overhead (FO) the paper measures.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Gates:
    """Per-step GRU quantities, time-major ``[T, B, H]``, t = 1..T."""

    r: torch.Tensor
    z: torch.Tensor
    n: torch.Tensor
    M: torch.Tensor  # W_hn h' + b_hn, the candidate's recurrent term before the reset gate
    hp: torch.Tensor  # h_{t-1}


def gru_gates(x: torch.Tensor, h: torch.Tensor, W_ih, W_hh, b_ih, b_hh, h0: torch.Tensor | None = None) -> Gates:
    """Recompute r, z, n for every step in parallel from ``x`` ``[T, B, I]`` and ``h`` ``[T, B, H]``: two
    GEMMs and three fused elementwise passes (r and z are views of one sigmoid, M of the recurrent map)."""
    H = h.shape[-1]
    first = torch.zeros_like(h[:1]) if h0 is None else h0.unsqueeze(0)
    hp = torch.cat([first, h[:-1]], 0)
    gi = torch.addmm(b_ih, x.reshape(-1, x.shape[-1]), W_ih.t()).view(*h.shape[:2], 3 * H)
    gh = torch.addmm(b_hh, hp.reshape(-1, H), W_hh.t()).view(*h.shape[:2], 3 * H)
    rz = torch.add(gi[..., :2 * H], gh[..., :2 * H]).sigmoid_()
    r, z, M = rz[..., :H], rz[..., H:], gh[..., 2 * H:]
    n = torch.addcmul(gi[..., 2 * H:], r, M).tanh_()
    return Gates(r=r, z=z, n=n, M=M, hp=hp)


@torch.no_grad()  # the Jacobians are the scan's data, never differentiated themselves
def gru_jacobians_t(g: Gates, W_hh: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, B, H, H]`` transposed Jacobians ``(∂h_t/∂h_{t-1})ᵀ``; ``J[k]`` belongs to t = T - k.

    ``out`` (optional) is a buffer of that shape to write into."""
    T, B, H = g.r.shape
    dN = (1 - g.z) * (1 - g.n * g.n)  # ∂h/∂N, elementwise
    coef = (  # scan order (step T first), broadcast over the rows i of each [H, H] block
        (dN * g.M * g.r * (1 - g.r)).flip(0).unsqueeze(-2),  # through R (reset gate)
        ((g.hp - g.n) * g.z * (1 - g.z)).flip(0).unsqueeze(-2),  # through Z (update gate)
        (dN * g.r).flip(0).unsqueeze(-2),  # through M (candidate's recurrent term)
    )
    Wt = W_hh.view(3, H, H).transpose(1, 2)  # Wt[g] = W_hgᵀ
    # Column j of W_hgᵀ scaled by coef_g[j]; written into a contiguous buffer because the scan's
    # strided batched matmuls are markedly slower on a transposed layout.
    J = out if out is not None else torch.empty((T, B, H, H), dtype=W_hh.dtype, device=W_hh.device)
    torch.mul(Wt[0], coef[0], out=J)
    J.addcmul_(Wt[1], coef[1])
    J.addcmul_(Wt[2], coef[2])
    J.diagonal(dim1=-2, dim2=-1).add_(g.z.flip(0))
    return J


def gru_gate_grads(g: Gates, grad_h: torch.Tensor) -> torch.Tensor:
    """The gradients of the gates' pre-activations from ∇h_t (t = 1..T, total gradients), ``[T, B, 4H]``:
    (dR, dZ, dN, dM) -- R, Z, N as in the module docstring, M = W_hn h' + b_hn."""
    dn = grad_h * (1 - g.z)
    dZ = grad_h * (g.hp - g.n) * g.z * (1 - g.z)
    dN = dn * (1 - g.n * g.n)
    dM = dN * g.r
    dR = dN * g.M * g.r * (1 - g.r)
    return torch.cat([dR, dZ, dN, dM], -1)


def gru_param_grads(x: torch.Tensor, h: torch.Tensor, G: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every GRU parameter's gradient from the gates' gradients ``G`` = (dR, dZ, dN, dM) ``[T, B, 4H]``
    (:func:`gru_gate_grads`), as GEMMs over the T·B rows; h_0 = 0 adds nothing to ∂l/∂W_hh."""
    T, B, H = h.shape
    G2 = G.reshape(T * B, 4 * H)
    Gi = G2[:, :3 * H]  # ∂l/∂(W_ih x + b_ih), gate order r, z, n
    Gp, hp = G2[B:], h[:-1].reshape((T - 1) * B, H)  # steps 2..T and their h' = h_{t-1}
    W_hh = G.new_empty((3 * H, H))
    torch.mm(Gp[:, :2 * H].t(), hp, out=W_hh[:2 * H])  # ∂l/∂(W_hh h' + b_hh): (dR, dZ, dM)
    torch.mm(Gp[:, 3 * H:].t(), hp, out=W_hh[2 * H:])
    sums = G2.sum(0)
    return {
        "weight_ih_l0": Gi.t() @ x.reshape(T * B, -1),
        "weight_hh_l0": W_hh,
        "bias_ih_l0": sums[:3 * H],
        "bias_hh_l0": torch.cat([sums[:2 * H], sums[3 * H:]]),
    }
