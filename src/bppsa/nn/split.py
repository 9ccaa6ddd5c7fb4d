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

1. *local up-sweep*: the composition of the slice's pairs ``(J_k, ∂l/∂h_k)`` (:func:`slice_map`: the RNN's by the
   compiled kernel in one pass, else in segments composed side by side, then a tree, block after block), giving
   ``(M, c)``; only the ranks between the first and the last compute it: the last rank's carry is zero, so its
   ``c`` is its own (final) scan's output passed through its first step, and no rank reads its ``M``, nor anything
   of rank 0's;
2. *the ranks' scan*: :func:`bppsa.distributed.rank_scan` with ``reverse=True`` gives each rank its carry;
3. *local down-sweep*: the slice's own affine scan, seeded with its last step's gradient plus the carry
   (:func:`bppsa.nn.backward.affine_prefixes`, the scan of the single-process layers), then the gradients of
   the input and of the weights from the total ∇h_t, block by block (:func:`bppsa.nn.backward.grads_from_scan`),
   or, on rank 0 from a zero state, summed by the CPU kernel as it scans; a slice whose steps before its last
   receive no gradient of their own (the paper's loss on h_T leaves every rank but the last so) takes the single
   seed's scan;
4. the weights' gradients are summed over the ranks (``all_reduce``); ∇h0 is rank 0's.

Each rank keeps its slice's states, its chain and its scan's output, beside blocks of bounded size: O(T/p)
memory (at p = 2 each rank's peak is half the single process's: docs/measurements.md).  A group of one rank runs
the single-process layer's backward.  Every rank must run the backward (a loss that reads its outputs); the
exchanges wait at most ``timeout`` seconds for a peer and raise
:class:`bppsa.distributed.RankFailure` naming it.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import distributed as _dist
from ..backends import TorchBackend
from ..backends.cpu.chain import rnn_chain_product
from . import backward as _bw

_summary: list = []


def _summary_backend() -> TorchBackend:
    """The torch twin that builds the GRU's dense chains of slice_map and a slice's first Jacobian (its own
    workspace)."""
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


def _first_step_t(twin, cell, x, h, h_in, w_ih, w_hh, b_ih, b_hh, valid, lam_first):
    """The gradient a slice passes to the rank before it: its first step's transposed Jacobian (from ``h_in``)
    applied to the λ of that step, or λ itself for the sequences already past their end there."""
    gates = None
    if cell == "gru":
        cb = _bw._gru_cell(w_ih, w_hh, b_ih, b_hh)
        g = _bw.gru_gates(x[:1], h[:1], w_ih, w_hh, cb.bias_ih_l0, cb.bias_hh_l0, h_in)
        gates = lambda: g  # noqa: E731
    J1 = _bw.layer_chain(twin, cell, x[:1], h[:1], w_ih, w_hh, b_ih, b_hh, gates, "fused")[0]
    out = _mv(J1, lam_first)
    return out if valid is None else torch.where(valid[0][:, None], out, lam_first)


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
        # the graph of the outputs may outlive the group: it must not keep it alive (distributed.GroupRef)
        ctx.options = (cell, valid, lengths, backend, L_m, _dist.GroupRef(group), timeout, r, p, h0 is not None)
        ctx.set_materialize_grads(False)
        return h, h[-1].clone()

    @staticmethod
    def backward(ctx, grad_h, grad_h_end):
        x, h_in, w_ih, w_hh, b_ih, b_hh, h = ctx.saved_tensors
        cell, valid, lengths, backend, L_m, group_ref, timeout, r, p, has_h0 = ctx.options
        group = group_ref()
        need = ctx.needs_input_grad
        if p == 1:  # one rank: the single-process layer's backward, its fast paths included
            need_h0 = has_h0 and bool(need[2])
            grads = _bw.layer_backward(cell, x, h_in if has_h0 else None, w_ih, w_hh, b_ih, b_hh, lengths, h, grad_h,
                                       grad_h_end, bool(need[1]), need_h0, backend, "fused", L_m)
            return (None, grads[0], grads[1] if need_h0 else None, *grads[2:], None, None, None, None, None)
        with torch.no_grad(), _bw.no_autocast(x.device):
            seed = grad_h[-1].clone() if grad_h is not None else h.new_zeros(h.shape[1:])
            if grad_h_end is not None:
                seed += grad_h_end
            dev = x.device
            be = _bw._step.backend if _bw._step.backend is not None else _bw.backend_for(backend, dev)
            ps = _bw.per_step_backend(be, dev)
            gates = None
            if cell == "gru":  # the twin's chain reads them; the CPU kernel's recomputes its own
                cb = _bw._gru_cell(w_ih, w_hh, b_ih, b_hh)
                gates = functools.cache(lambda: _bw.gru_gates(x, h, w_ih, w_hh, cb.bias_ih_l0, cb.bias_hh_l0, h_in))
            past = None if valid is None else ~valid.flip(0)
            # the loss's gradients on the slice's states before its last (none: a single seed, as the paper's loss
            # on h_T leaves every rank but the last; on a CPU a zero gradient is none)
            steps = grad_h is not None and (dev.type != "cpu" or bool(grad_h[:-1].any()))
            c = _bw._direct(grad_h, h) if steps or past is not None else None
            # rank 0 starting from zero, no lengths, no ∇x: the backend may accumulate the weights' gradients as it
            # scans (the CPU kernel), as the single-process layer's fast paths do; its chain then keeps x
            sums = r == 0 and valid is None and not need[1] and not has_h0
            J = _bw.layer_chain(ps, cell, x, h, w_ih, w_hh, b_ih, b_hh, gates, "fused", with_x=sums)
            # with the carry known a slice's scan needs no tree of its own (its products were the up-sweep's):
            # across ranks the local down-sweep is the linear scan (L_m = 0) unless L_m says otherwise
            local_L = L_m if L_m is not None else 0
            if r == p - 1:
                # first in the scan's order: its carry is zero, so its scan is final at once, and what it passes on
                # is its first step's Jacobian applied to its first λ (its map's matrix is never read: zeros)
                lam = _prefixes(ps, seed, J, c, local_L, past)
                out = _first_step_t(_summary_backend(), cell, x, h, h_in, w_ih, w_hh, b_ih, b_hh, valid, lam[-1])
                _dist.rank_scan(torch.zeros(out.shape + out.shape[-1:], dtype=out.dtype, device=out.device), out,
                                group, reverse=True, timeout=timeout)
            else:
                if r > 0:  # 1. a middle rank's local up-sweep: its slice's map of the carry
                    P, q = slice_map(cell, x, h, h_in, w_ih, w_hh, b_ih, b_hh, c, past, seed)
                else:  # last in the scan's order: no rank reads its map
                    P, q = seed.new_zeros(seed.shape + seed.shape[-1:]), seed.new_zeros(seed.shape)
                # 2. the ranks' scan from the last rank down; 3. the slice's own scan, seeded with its carry
                carry = _dist.rank_scan(P, q, group, reverse=True, timeout=timeout)
                del P, q
                g = (seed + carry).contiguous()
                if sums:
                    def from_scan(out):
                        return _bw.grads_from_scan(cell, x, None, w_ih, w_hh, b_ih, b_hh, h, None, out)[2]

                    grads = (ps.cell_grads(g, J, local_L, from_scan) if c is None
                             else ps.affine_cell_grads(g, J, c, local_L, from_scan))
                    return _reduced(grads, b_ih, group, timeout, None, None)
                lam = _prefixes(ps, g, J, c, local_L, past)
            del J, c
            need_h0 = r == 0 and has_h0 and bool(need[2])
            dx, dh0, grads = _bw.grads_from_scan(cell, x, h_in, w_ih, w_hh, b_ih, b_hh, h, valid, lam,
                                                 bool(need[1]), need_h0)
            return _reduced(grads, b_ih, group, timeout, dx if need[1] else None, dh0 if need_h0 else None)


def _prefixes(ps, g, J, c, L_m, past):
    """The slice's scan of λ (scan order) from its seed ``g``: the single seed's where no step has a gradient of its
    own (``c`` None), else the affine one."""
    return ps.scan(g, J, L_m) if c is None else _bw.affine_prefixes(ps, g, J, c, L_m, past)


SUMMARY_BLOCK_VALUES = 1 << 20  # values of one block of slice_map at most (the RNN's factors, the GRU's dense chain)
SEGMENTS = 32  # a block's segments, composed side by side (slice_map; its steps / SEGMENTS one after another each)


def _block_chain(cell, x, h, h_prev, w_ih, w_hh, b_ih, b_hh):
    """A block's transposed Jacobians in scan order, as ``(chain, step)``: ``step(chain, j, A)`` gives ``J_j A`` for
    maps ``A`` [..., B, H, K] (``J_j`` itself, dense, for ``A`` None) from ``chain`` (or a view of it cut as
    :func:`_block_map` cuts the steps).  The RNN's kept as factors, ``J_j = W_hhᵀ diag(d_j)`` (d = 1 - h²,
    [n, B, H]): a product costs the dense one's H³ without the dense chain; the GRU's dense
    (:func:`bppsa.nn.backward.layer_chain`: the torch twin, the gates from ``h_prev``, the state before the block),
    whose factored form would cost 3 H³."""
    if cell == "rnn":
        Wt = w_hh.t()

        def step(d, j, A):
            return Wt * d[j].unsqueeze(-2) if A is None else torch.matmul(Wt, A * d[j].unsqueeze(-1))

        return (1 - h * h).flip(0), step
    cb = _bw._gru_cell(w_ih, w_hh, b_ih, b_hh)
    g = _bw.gru_gates(x, h, w_ih, w_hh, cb.bias_ih_l0, cb.bias_hh_l0, h_prev)
    J = _bw.layer_chain(_summary_backend(), cell, x, h, w_ih, w_hh, b_ih, b_hh, lambda: g, "fused")
    # (J_j itself copied: the twin's workspace holds the chain, and the next block's overwrites it)
    return J, lambda J, j, A: J[j].clone() if A is None else torch.matmul(J[j], A)


def _steps(A, chain, step, c, past):
    """The maps ``A`` [S, B, H, K] (``(P | q)``, K = H + 1 with ``c``) each composed with its m steps, one after
    another, all the maps at once: ``A <- J_j A`` (``step``), the lanes of ``past[j]`` left unchanged, ``c[j]`` added
    to the last column.  ``chain``, ``c``: [m, S, B, ...]; ``past`` [m, S, B]."""
    for j in range(chain.shape[0]):
        new = step(chain, j, A)
        if past is not None:
            new = torch.where(past[j][..., None, None], A, new)
        if c is not None:
            new[..., -1] += c[j]
        A = new
    return A


def _block_map(chain, step, c, past):
    """``(P, q)`` ([B, H, H], [B, H] or None without ``c``) of a block's pairs in scan order: its steps cut into
    ``SEGMENTS`` segments composed side by side (:func:`_steps`: one large product a step for all of them instead
    of one small product a segment), the segments' maps then composed by :func:`chain_summary`'s tree, the steps
    left over one after another."""
    n, B, H = chain.shape[0], chain.shape[1], chain.shape[-1]
    m = -(-n // SEGMENTS)
    S = n // m

    def seg(t, j0=0):  # the first S·m steps of t [n, ...] as [m, S, ...] (step j of segment s), from step j0
        return None if t is None else t[:S * m].reshape(S, m, *t.shape[1:]).transpose(0, 1)[j0:]

    # each segment's map starts as its first pair, (J | c), then takes the others (S >= 1: m <= n)
    A = step(seg(chain), 0, None)
    if past is not None:
        A = torch.where(seg(past)[0][..., None, None], torch.eye(H, dtype=A.dtype, device=A.device), A)
    if m == 1:  # one step a segment: the tree over the block's dense pairs as they are
        P, q = chain_summary(A, seg(c)[0] if c is not None else A.new_zeros((S, B, H)))
    else:
        if c is not None:
            A = torch.cat([A, seg(c)[0].unsqueeze(-1)], -1)
        A = _steps(A, seg(chain, 1), step, seg(c, 1), seg(past, 1))
        P, q = chain_summary(A[..., :H], A[..., H] if c is not None else A.new_zeros((S, B, H)))
    A = torch.cat([P, q.unsqueeze(-1)], -1) if c is not None else P
    if S * m < n:  # the steps left over, one after another

        def one(t):
            return None if t is None else t[S * m:].unsqueeze(1)

        A = _steps(A.unsqueeze(0), one(chain), step, one(c), one(past))[0]
    return A[..., :H], (A[..., H] if c is not None else None)


def slice_map(cell, x, h, h_in, w_ih, w_hh, b_ih, b_hh, c, past, seed) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, q)``: the slice's map of the gradient entering it from the right, ``v -> P v + q`` (``seed`` included),
    identities past a sequence's end: the middle ranks' up-sweep in O(block) memory beside the states.  The RNN's
    on a CPU with all its sequences running (no ``past``): the compiled kernel's product of the whole slice
    (:func:`bppsa.backends.cpu.chain.rnn_chain_product`, ~90 GFLOP/s on a Zen 4 thread); else torch, block by block
    (:func:`_block_map`), the plain twin the kernel is tested against."""
    T, B, H = h.shape
    if cell == "rnn" and past is None:  # the compiled kernel, where it is at hand: the whole slice in one pass
        whole = rnn_chain_product(h, w_hh, x, c)
        if whole is not None:
            P, q = whole
            return P, _mv(P, seed) + (q if q is not None else 0)
    # a block's chain (the RNN's: factors and their flip, 2 H a step; the GRU's: dense, H²) no larger than the
    # slice's states (T x B x H), however short the slice, nor SUMMARY_BLOCK_VALUES
    per_step = B * (H * H if cell == "gru" else 2 * H)
    step = max(1, min(SUMMARY_BLOCK_VALUES, T * B * H) // per_step)
    P = q = None
    for t1 in range(T, 0, -step):  # scan order: the slice's last steps first
        t0 = max(0, t1 - step)
        chain, apply = _block_chain(cell, x[t0:t1], h[t0:t1], h_in if t0 == 0 else h[t0 - 1], w_ih, w_hh, b_ih,
                                    b_hh)
        Pb, qb = _block_map(chain, apply, None if c is None else c[T - t1:T - t0],
                            None if past is None else past[T - t1:T - t0])
        if P is None:
            P, q = Pb, qb
        else:  # this block after the blocks before it (q and qb: both None without c, else both set)
            P, q = torch.matmul(Pb, P), None if qb is None else _mv(Pb, q) + qb
    return P, _mv(P, seed) + (q if q is not None else 0)


def _reduced(grads: dict, b_ih, group, timeout, dx, dh0) -> tuple:
    """4. The weights' gradients summed over the ranks, in one exchange: the backward's return value."""
    names = ["weight_ih_l0", "weight_hh_l0"] + (["bias_ih_l0", "bias_hh_l0"] if b_ih is not None else [])
    flat = _dist.all_reduce_sum(torch.cat([grads[n].reshape(-1) for n in names]), group, timeout)
    parts = dict(zip(names, torch.split(flat, [grads[n].numel() for n in names])))
    out = [parts[n].view(grads[n].shape) for n in names] + ([None, None] if b_ih is None else [])
    return (None, dx, dh0, *out, None, None, None, None, None)


def layer(cell: str, x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend: str, L_m, group, timeout):
    """``(h, h_end)`` of one layer over this rank's slice (time-major ``x`` [T_r, B, I]); ``h0`` is read on rank 0."""
    _bw.check_layer(cell, x, h0, w_ih, w_hh, b_ih, b_hh, None)
    if lengths is not None and (lengths.dtype != torch.int64 or tuple(lengths.shape) != (x.shape[1],)):
        raise ValueError(f"bppsa.nn: lengths must be int64 [B] = [{x.shape[1]}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    return SplitLayer.apply(cell, x, h0, w_ih, w_hh, b_ih, b_hh, lengths, backend, L_m, group, timeout)
