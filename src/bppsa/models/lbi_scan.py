"""The LBI model's backward as a scan over its regions (one process; across ranks: :mod:`.lbi_dist`).

What the adjoint recursion carries.  Write ``ā_k = ∂L/∂m_k`` (the loss's total derivative through the interface,
the token embeddings ``E`` held fixed).  ``m_k`` reaches the loss only through region ``k``, and region ``k < K-1``
reaches it only through ``m_{k+1}`` (only the last region's tokens feed the LM head), so

    ā_{K-1} = ∂L/∂m_{K-1}  (the last region's local backward),     ā_k = A_k ā_{k+1},   A_k = (∂m_{k+1}/∂m_k)ᵀ

with no additive term: a plain suffix product over ``K - 1`` small ``r × r`` matrices per example, BPPSA's scan
(:mod:`bppsa.scan`) over ``[ā_{K-1}, A_{K-2}, ..., A_0]``.  ``E`` is read by every region and by ``m_0``, but it
is an input, not a carried state: its gradient is the *sum* of each region's local contribution (given the
region's output adjoint) and ``m_0``'s, which no region needs before its own local backward.  Then

* ``A_k`` (per example) is built from ``r`` vector-Jacobian products with the basis vectors, re-running region
  ``k`` alone on detached copies of its inputs (``E``, ``m_k``) stacked ``r`` times along the batch
  (:func:`interface_jacobians_t`; ``chunk`` directions at a time);
* the scan runs on any backend of :mod:`bppsa.backends` (one extra position at the end, never read, makes the
  exclusive scan return ``ā_0`` too);
* each region's local backward runs from ``ā_{k+1}`` (the last: from the loss), giving its parameters' gradients
  and its share of ``∂L/∂E``; ``m_0``'s from ``ā_0``; the embedding's from the summed ``∂L/∂E``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import Backend, TorchBackend
from .lbi import LBILM, lm_loss

__all__ = ["LocalRegion", "ScanBackward", "interface_jacobians_t", "region_forward", "scan_backward", "scan_operands"]


def interface_jacobians_t(region, E: torch.Tensor, m: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``A[b] = (∂m_{k+1}/∂m_k)ᵀ`` of one region, ``[B, r, r]``: ``A[b, i, j] = ∂m_{k+1}[b, j] / ∂m_k[b, i]``.

    ``r`` vector-Jacobian products with the basis vectors ``e_j``, ``chunk`` (default all ``r``) at a time, each
    on the region re-run alone on detached ``E`` and ``m`` repeated along the batch (the region treats the
    examples of a batch independently, so copy ``j`` of example ``b`` gives row ``j`` of example ``b``'s
    Jacobian)."""
    if region.last:
        raise ValueError("the last region has no outgoing interface, so no interface Jacobian")
    B, r = m.shape
    chunk = r if chunk is None else int(chunk)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    E, m = E.detach(), m.detach()
    eye = torch.eye(r, dtype=m.dtype, device=m.device)
    rows = []
    with torch.enable_grad():
        for s in range(0, r, chunk):
            c = min(chunk, r - s)
            m_rep = m.unsqueeze(0).expand(c, B, r).reshape(c * B, r).requires_grad_(True)
            E_rep = E.unsqueeze(0).expand((c,) + tuple(E.shape)).reshape((c * B,) + tuple(E.shape[1:]))
            out = region.interface(E_rep, m_rep)
            basis = eye[s:s + c].unsqueeze(1).expand(c, B, r).reshape(c * B, r)
            (g,) = torch.autograd.grad(out, m_rep, basis)
            rows.append(g.view(c, B, r))  # [j, b, i] = ∂m'[b, s+j] / ∂m[b, i]
    return torch.cat(rows).permute(1, 2, 0).contiguous()


@dataclass
class LocalRegion:
    """One region's forward kept for its local backward: inputs as leaves, outputs with their local graph."""

    E: torch.Tensor  # a leaf (requires grad): the region's copy of the token embeddings
    m: torch.Tensor  # the incoming interface (a leaf; requires grad only for the last region)
    y: torch.Tensor  # token outputs
    m_next: torch.Tensor | None  # the outgoing interface (None for the last region)


def region_forward(region, E: torch.Tensor, m: torch.Tensor, m_grad: bool | None = None) -> LocalRegion:
    """Run one region on detached copies of its inputs, building only its local graph (through ``m`` too where
    ``m_grad``; by default for the last region alone, whose local backward gives ``ā_{K-1}``)."""
    E_leaf = E.detach().requires_grad_(True)
    m_leaf = m.detach().requires_grad_(region.last if m_grad is None else m_grad)
    with torch.enable_grad():
        y, m_next = region(E_leaf, m_leaf)
    return LocalRegion(E_leaf, m_leaf, y, m_next)


def scan_operands(A: list[torch.Tensor]) -> torch.Tensor:
    """``[A_{K-2}, ..., A_0, 0]``: the matrices of the exclusive scan in back-propagation order, ``[K, B, r, r]``
    (the last position never reaches an output; it makes the scan's ``K`` outputs end with ``ā_0``)."""
    J = torch.stack(list(reversed(A)) + [torch.zeros_like(A[0])])
    return J


def _params(module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _accumulate(params, grads) -> None:
    for p, g in zip(params, grads):
        if g is None:
            continue
        p.grad = g.detach().clone() if p.grad is None else p.grad + g


@dataclass
class ScanBackward:
    """What :func:`scan_backward` computed: the loss, and the interface adjoints ``ā_0 .. ā_{K-1}`` ([B, r] each)."""

    loss: torch.Tensor
    adjoints: list[torch.Tensor]


def scan_backward(model: LBILM, x: torch.Tensor, y: torch.Tensor, backend: Backend | None = None,
                  L_m: int | None = None, chunk: int | None = None) -> ScanBackward:
    """Forward and backward of ``model`` on ``(x, y)`` with the interface adjoints from a scan; accumulates every
    parameter's gradient into ``.grad`` as ``lm_loss(model(x), y).backward()`` would.

    ``backend``: the scan's (default the torch twin); ``L_m``: its up-sweep levels (None: the full tree);
    ``chunk``: basis directions per Jacobian re-run (:func:`interface_jacobians_t`)."""
    backend = TorchBackend() if backend is None else backend
    regions = list(model.regions)
    K = len(regions)
    # forward: the embedding, m_0 and each region on its own local graph; only m_k (and E) pass between them
    E = model.embed(x)
    E0 = E.detach().requires_grad_(True)
    m0 = model.m0(E0.mean(1))
    local, m = [], m0
    for region in regions:
        local.append(region_forward(region, E, m))
        m = local[-1].m_next
    last = local[-1]
    loss = lm_loss(model.head(last.y), y)

    # the last region's local backward from the loss: its parameters, the LM head, its share of dL/dE, and ā_{K-1}
    head_params = _params(model.head) + _params(regions[-1])
    grads = torch.autograd.grad(loss, head_params + [last.E, last.m])
    _accumulate(head_params, grads[:-2])
    gE, g = grads[-2], grads[-1]

    # the interface Jacobians (independent per region) and the suffix scan over them
    if K > 1:
        A = [interface_jacobians_t(regions[k], E, local[k].m, chunk) for k in range(K - 1)]
        prefixes = backend.scan(g.detach(), scan_operands(A), L_m)  # prefixes[i] = ā_{K-1-i}
        adjoints = [prefixes[K - 1 - k] for k in range(K)]
    else:
        adjoints = [g.detach()]

    # each region's local backward from its output adjoint, then m_0's, then the embedding's
    for k in range(K - 1):
        params = _params(regions[k])
        grads = torch.autograd.grad(local[k].m_next, params + [local[k].E], adjoints[k + 1])
        _accumulate(params, grads[:-1])
        gE = gE + grads[-1]
    params = _params(model.m0)
    grads = torch.autograd.grad(m0, params + [E0], adjoints[0])
    _accumulate(params, grads[:-1])
    gE = gE + grads[-1]
    params = _params(model.embed)
    _accumulate(params, torch.autograd.grad(E, params, gE))
    return ScanBackward(loss.detach(), adjoints)
