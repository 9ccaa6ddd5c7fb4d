"""One recurrent layer with its sequence split over the ranks of a process group (``process_group=`` of
:class:`bppsa.nn.RNN`/:class:`bppsa.nn.GRU`).

Each rank holds a contiguous slice of the T steps, in ``torch.tensor_split`` order (rank 0 the first steps), with
the whole batch; ``lengths`` are the global sequence lengths, the same on every rank.

**Forward** (sequential, as any recurrence's forward is): rank r waits for the state h_{t0-1} at the end of rank
r - 1's slice, runs its steps with torch's own kernel, and sends its last state to rank r + 1.  Rank 0 starts
from ``h0`` (zero by default).

**Backward** (BPPSA over the ranks): the adjoint ``λ_t = ∂l/∂h_t + J_{t+1}ᵀ λ_{t+1}`` is an affine recurrence
running from the last rank down.  Rank r's slice maps the gradient that enters it from the right, v (its
carry), to the one it passes left, ``J_{t0}ᵀ λ_{t0}``, by an affine map ``v -> M v + c``:

1. *local up-sweep*: the composition of the slice's pairs ``(J_k, ∂l/∂h_k)`` (a tree of batched products),
   giving ``(M, c)``;
2. *the ranks' scan*: :func:`bppsa.distributed.rank_scan` with ``reverse=True`` gives each rank its carry;
3. *local down-sweep*: the slice's own affine scan, seeded with its last step's gradient plus the carry
   (:func:`bppsa.nn.backward.affine_prefixes`, the scan of the single-process layers), then the gradients of
   the input and of the weights from the total ∇h_t (:func:`bppsa.nn.backward._grads`);
4. the weights' gradients are summed over the ranks (``all_reduce``); ∇h0 is rank 0's.

Each rank keeps its slice's states and chain only: O(T/p) memory.  Every rank must run the backward (a loss
that reads its outputs); the exchanges wait at most ``timeout`` seconds for a peer and raise
:class:`bppsa.distributed.RankFailure` naming it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import distributed as _dist
from ..backends import TorchBackend
from . import backward as _bw

_summary: list = []


def _summary_backend() -> TorchBackend:
    """The torch twin that builds the dense chains the slices' maps are composed from (its own workspace)."""
    if not _summary:
        _summary.append(TorchBackend())
    return _summary[0]


def _mv(M, v):
    return torch.matmul(M, v.unsqueeze(-1)).squeeze(-1)


def chain_summary(J: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, q)``: the composition of the pairs ``(J[k], c[k])`` in scan order (pair 0 applied first), by a tree of
    batched products: the up-sweep's root, ``v -> P v + q`` being ``v -> J[n-1](... (J[0] v + c[0]) ...) + c[n-1]``."""
    A, b = J, c
    while A.shape[0] > 1:
        m = A.shape[0] // 2
        later, earlier = A[1:2 * m:2], A[0:2 * m:2]
        nA = torch.matmul(later, earlier)
        nb = _mv(later, b[0:2 * m:2]) + b[1:2 * m:2]
        if A.shape[0] % 2:
            nA, nb = torch.cat([nA, A[-1:]]), torch.cat([nb, b[-1:]])
        A, b = nA, nb
    return A[0], b[0]


def _local_forward(cell, x, h_in, w_ih, w_hh, b_ih, b_hh, valid):
    """The slice's states from ``h_in``, the steps past a sequence's end carrying its last state (a sequence that
    ended before the slice carries ``h_in`` throughout)."""
    h = _bw.torch_layer(cell, x, h_in.unsqueeze(0).contiguous(), w_ih, w_hh, b_ih, b_hh)[0]
    if valid is None:
        return h.contiguous()
    T = x.shape[0]
    n = valid.sum(0)  # each sequence's valid steps in this slice [B]
    last = torch.minimum(torch.arange(T, device=x.device)[:, None], (n - 1).clamp_min(0)[None, :])
    out = h.gather(0, last.unsqueeze(-1).expand_as(h))
    return torch.where((n == 0)[None, :, None], h_in.unsqueeze(0), out).contiguous()


class SplitLayer(torch.autograd.Function):
    """One layer over this rank's slice: ``(h [T_r, B, H], h_end [B, H])`` (the module's docstring)."""

    @staticmethod
    def forward(ctx, cell, x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend, L_m, group, timeout):
        p, r = dist.get_world_size(group), dist.get_rank(group)
        T_r, B, _ = x.shape
        H = w_hh.shape[1]
        sizes = _dist.all_gather_ints([T_r, B, H], group, timeout)
        if any(s[1:] != [B, H] for s in sizes) or any(s[0] < 1 for s in sizes):
            raise ValueError(f"bppsa.nn (process group): every rank needs at least one step and the same batch and "
                             f"hidden size; the ranks hold [T_r, B, H] = {sizes}")
        t0 = sum(s[0] for s in sizes[:r])
        T = sum(s[0] for s in sizes)
        if lengths is not None and B and (int(lengths.min()) < 1 or int(lengths.max()) > T):
            raise ValueError(f"bppsa.nn: every length must lie in [1, T = {T}] (the whole sequence over the ranks), "
                             f"got {lengths.tolist()}")
        valid = None
        if lengths is not None:
            valid = (torch.arange(t0, t0 + T_r)[:, None] < lengths[None, :]).to(x.device)
        with torch.no_grad(), _bw.no_autocast(x.device):
            if r == 0:
                h_in = h0 if h0 is not None else x.new_zeros(B, H)
            else:
                h_in = _dist.recv_from(x.new_empty(B, H), r - 1, group, timeout)
            h = _local_forward(cell, x, h_in, w_ih, w_hh, b_ih, b_hh, valid)
            if r < p - 1:
                _dist.send_to(h[-1], r + 1, group, timeout)
        ctx.save_for_backward(x, h_in, w_ih, w_hh, b_ih, b_hh, h)
        ctx.options = (cell, valid, backend, L_m, group, timeout, r, p, h0 is not None)
        ctx.set_materialize_grads(False)
        return h, h[-1].clone()

    @staticmethod
    def backward(ctx, grad_h, grad_h_end):
        x, h_in, w_ih, w_hh, b_ih, b_hh, h = ctx.saved_tensors
        cell, valid, backend, L_m, group, timeout, r, p, has_h0 = ctx.options
        need = ctx.needs_input_grad
        with torch.no_grad(), _bw.no_autocast(x.device):
            seed = grad_h[-1].clone() if grad_h is not None else h.new_zeros(h.shape[1:])
            if grad_h_end is not None:
                seed += grad_h_end
            dev = x.device
            be = _bw._step.backend if _bw._step.backend is not None else _bw.backend_for(backend, dev)
            ps = _bw.per_step_backend(be, dev)
            gates = None
            if cell == "gru":
                cb = _bw._gru_cell(w_ih, w_hh, b_ih, b_hh)
                g = _bw.gru_gates(x, h, w_ih, w_hh, cb.bias_ih_l0, cb.bias_hh_l0, h_in)
                gates = lambda: g  # noqa: E731 - what layer_chain and _grads call
            J = _bw.layer_chain(ps, cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, "fused")
            c = _bw._direct(grad_h, h)
            past = None if valid is None else ~valid.flip(0)
            carry = torch.zeros_like(seed)
            if p > 1:
                # 1. the slice's map of the carry: the composition of its pairs, identities past a sequence's end.
                # Dense, by the torch twin: the chain's last Jacobian (the slice's first step, which passes the
                # gradient to the rank before) depends on h_in, which the factored chains take as zero (the
                # single-process scan never reads it)
                Jd = _bw.layer_chain(_summary_backend(), cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, "fused")
                if past is not None:
                    eye = torch.eye(Jd.shape[-1], dtype=Jd.dtype, device=Jd.device)
                    Jd = torch.where(past[..., None, None], eye, Jd)
                P, q = chain_summary(Jd, c)
                del Jd
                # 2. the ranks' scan from the last rank down
                carry = _dist.rank_scan(P, _mv(P, seed) + q, group, reverse=True, timeout=timeout)
            # 3. the slice's own scan, seeded with its carry
            lam = _bw.affine_prefixes(ps, (seed + carry).contiguous(), J, c, L_m, past)
            dh = lam.flip(0)
            need_h0 = r == 0 and has_h0 and bool(need[2])
            dx, dh0, grads = _bw._grads(cell, x, h_in, w_ih, w_hh, h, gates, valid, dh, "fused", None,
                                        bool(need[1]), need_h0)
            # 4. the weights' gradients summed over the ranks, in one exchange
            names = ["weight_ih_l0", "weight_hh_l0"] + (["bias_ih_l0", "bias_hh_l0"] if b_ih is not None else [])
            flat = _dist.all_reduce_sum(torch.cat([grads[n].reshape(-1) for n in names]), group, timeout)
            parts = dict(zip(names, torch.split(flat, [grads[n].numel() for n in names])))
            out = [parts[n].view(grads[n].shape) for n in names] + ([None, None] if b_ih is None else [])
        return (None, dx if need[1] else None, dh0 if need_h0 else None, *out, None, None, None, None, None)


def layer(cell: str, x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend: str, L_m, group, timeout):
    """``(h, h_end)`` of one layer over this rank's slice (time-major ``x`` [T_r, B, I]); ``h0`` is read on rank 0."""
    _bw.check_layer(cell, x, h0, w_ih, w_hh, b_ih, b_hh, None)
    if lengths is not None and (lengths.dtype != torch.int64 or tuple(lengths.shape) != (x.shape[1],)):
        raise ValueError(f"bppsa.nn: lengths must be int64 [B] = [{x.shape[1]}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    return SplitLayer.apply(cell, x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend, L_m, group, timeout)
