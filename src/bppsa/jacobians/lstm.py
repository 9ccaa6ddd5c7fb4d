"""The LSTM's gates, its transposed Jacobians over the state (h, c) and its gates' gradients, batched and dense.

torch.nn.LSTM stacks the gate weights as ``[i; f; g; o]`` (``weight_ih_l0`` is ``[4H, I]``, ``weight_hh_l0``
``[4H, P]``), with ``P = proj_size`` where the output is projected (``h = W_hr m``, ``W_hr`` ``[P, H]``) and
``P = H`` otherwise (``h = m``)::

    i, f, o = σ(W_i· x + b_i· + W_h· h' + b_h·),   g = tanh(W_ig x + b_ig + W_hg h' + b_hg)
    c = f c' + i g,   m = o tanh(c),   h = m  (or W_hr m)

The scan's state is ``s = [h; c]`` (P + H values).  From the total gradients (λ_h, λ_c) of a step,
with ``λ_m = λ_h`` (or ``W_hrᵀ λ_h``) and ``dc = λ_c + a λ_m``::

    dpre_i = ci dc,  dpre_f = cf dc,  dpre_g = cg dc,  dpre_o = co λ_m          (the gates' pre-activations)
    λ_h' = W_hhᵀ dpre,   λ_c' = f dc

with the per-step factors ``a = o (1 - tanh²c)``, ``ci = g i (1 - i)``, ``cf = c' f (1 - f)``,
``cg = i (1 - g²)``, ``co = tanh(c) o (1 - o)`` and ``f``: so the transposed Jacobian is, in blocks over
(h', c') x (h, c)::

    Jᵀ = [ Σ_{q=i,f,g} W_hqᵀ diag(c_q a) W_hrᵀ + W_hoᵀ diag(co) W_hrᵀ    Σ_{q=i,f,g} W_hqᵀ diag(c_q) ]
         [ diag(f a) W_hrᵀ                                               diag(f)                     ]

(``W_hrᵀ`` the identity without projection): ∂c_t/∂c_{t-1} = diag(f_t), the other blocks diagonals times weight
blocks.  The forward (torch's, oneDNN on a CPU, cuDNN on a GPU) keeps no gates: they are recomputed here for
every step at once from the states, as the GRU's are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LstmGates:
    """Per-step LSTM quantities, time-major ``[T, B, H]`` (``hp`` ``[T, B, P]``), t = 1..T."""

    i: torch.Tensor
    f: torch.Tensor
    g: torch.Tensor
    o: torch.Tensor
    tc: torch.Tensor  # tanh(c_t)
    cp: torch.Tensor  # c_{t-1}
    hp: torch.Tensor  # h_{t-1}


def lstm_gates(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, W_ih, W_hh, b_ih, b_hh,
               h0: torch.Tensor | None = None, c0: torch.Tensor | None = None) -> LstmGates:
    """Recompute the gates of every step in parallel from ``x`` [T, B, I] and the states ``h`` [T, B, P],
    ``c`` [T, B, H] (h_1 .. h_T, c_1 .. c_T): two GEMMs and a few elementwise passes."""
    T, B, P = h.shape
    H = c.shape[-1]
    hp = torch.cat([h.new_zeros((1, B, P)) if h0 is None else h0.unsqueeze(0), h[:-1]])
    cp = torch.cat([c.new_zeros((1, B, H)) if c0 is None else c0.unsqueeze(0), c[:-1]])
    pre = torch.mm(x.reshape(T * B, -1), W_ih.t())
    pre.addmm_(hp.reshape(T * B, P), W_hh.t())
    if b_ih is not None:
        pre += b_ih + b_hh
    pre = pre.view(T, B, 4 * H)
    ifo = pre[..., :2 * H].sigmoid(), pre[..., 3 * H:].sigmoid()
    return LstmGates(i=ifo[0][..., :H], f=ifo[0][..., H:], g=pre[..., 2 * H:3 * H].tanh(), o=ifo[1], tc=c.tanh(),
                     cp=cp, hp=hp)


def lstm_factors(g: LstmGates) -> tuple[torch.Tensor, ...]:
    """The per-step factors of the transposed Jacobian (the module's docstring), time order:
    ``(a, ci, cf, cg, co, f)``, each [T, B, H]."""
    a = g.o * (1 - g.tc * g.tc)
    return a, g.g * g.i * (1 - g.i), g.cp * g.f * (1 - g.f), g.i * (1 - g.g * g.g), g.tc * g.o * (1 - g.o), g.f


@torch.no_grad()  # the Jacobians are the scan's data, never differentiated themselves
def lstm_jacobians_t(g: LstmGates, W_hh: torch.Tensor, W_hr: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, B, S, S]`` transposed Jacobians ``(∂s_t/∂s_{t-1})ᵀ`` of the state ``s = [h; c]`` (S = P + H);
    ``J[k]`` belongs to t = T - k.  ``out`` (optional) is a buffer of that shape to write into."""
    T, B, H = g.f.shape
    P = W_hh.shape[1]
    a, ci, cf, cg, co, f = (t.flip(0).unsqueeze(-2) for t in lstm_factors(g))  # scan order, column scalings
    Wt = W_hh.view(4, H, P).transpose(1, 2)  # Wt[q] = W_hqᵀ [P, H]
    J = out if out is not None else torch.empty((T, B, P + H, P + H), dtype=W_hh.dtype, device=W_hh.device)
    # Σ_{q=i,f,g} W_hqᵀ diag(c_q): the top-right block, and (times diag(a)) the top-left's first term
    top_right = torch.mul(Wt[0], ci)
    top_right.addcmul_(Wt[1], cf)
    top_right.addcmul_(Wt[2], cg)
    top_left = torch.mul(top_right, a)
    top_left.addcmul_(Wt[3], co)
    if W_hr is None:
        J[..., :P, :P] = top_left
        J[..., P:, :P] = 0
        J[..., P:, :P].diagonal(dim1=-2, dim2=-1).copy_((f * a).squeeze(-2))
    else:
        Wr = W_hr.t()  # W_hrᵀ [H, P]
        J[..., :P, :P] = torch.matmul(top_left, Wr)
        J[..., P:, :P] = Wr * (f * a).transpose(-1, -2)  # diag(f a) W_hrᵀ: W_hrᵀ's rows scaled
    J[..., :P, P:] = top_right
    J[..., P:, P:] = 0
    J[..., P:, P:].diagonal(dim1=-2, dim2=-1).copy_(f.squeeze(-2))
    return J


def lstm_gate_grads(g: LstmGates, lam_h: torch.Tensor, lam_c: torch.Tensor, W_hr: torch.Tensor | None = None):
    """From the total gradients λ_h [T, B, P] and λ_c [T, B, H] (time order): the gates' pre-activation
    gradients ``dpre`` [T, B, 4H] (i, f, g, o), λ_m [T, B, H] (the gradient of m = o tanh(c)) and ``dc`` [T, B, H]
    (the gradient of c_t through every path), from which λ_c' = f dc."""
    lam_m = lam_h if W_hr is None else lam_h @ W_hr
    dc = torch.addcmul(lam_c, lam_m, g.o * (1 - g.tc * g.tc))
    dpre = torch.cat([dc * g.g * g.i * (1 - g.i), dc * g.cp * g.f * (1 - g.f), dc * g.i * (1 - g.g * g.g),
                      lam_m * g.tc * g.o * (1 - g.o)], -1)
    return dpre, lam_m, dc
