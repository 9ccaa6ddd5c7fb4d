"""One recurrent layer with its sequence split over the ranks of a process group (``process_group=`` of
:class:`bppsa.nn.RNN`, :class:`~bppsa.nn.GRU` and :class:`~bppsa.nn.LSTM`), for any cell of :mod:`.cells`.

Each rank holds a contiguous slice of the T steps, in ``torch.tensor_split`` order (rank 0 the first steps), with
the whole batch; ``lengths`` are the global sequence lengths, the same on every rank.

**Forward** (:func:`ranks_forward`): a block Jacobi iteration over the ranks, one slice each, whose result is
the sequential forward's.  Sweep 0 runs every rank's slice at once from a guess (zero, or where the slice started in
the last call of the same layer and shapes; rank 0 from ``h0``/``c0``, exact).  Then each sweep: every rank sends
its slice's end state (h, and c for the LSTM) to the next (point-to-point), and a rank whose predecessor's end is
not the start it ran from reruns from it, each sequence until its new trajectory meets the stored one (the cell's
criterion: bitwise, or within ``Cell.meet_ulps``; the compiled CPU kernel stops there, elsewhere the slice is rerun
whole).  After sweep k the first k + 1 slices are exact, so at most p sweeps run and the last needs no vote;
after each of the others a small all-reduce says whether any rank but the last changed its end (none did: done).
At two ranks the forward is then sweep 0 and one correction with one exchange, the serial hand-off's collectives.
The worst case (a layer that remembers, or trajectories that never come within the criterion: each correction
reruns whole slices) costs about the serial hand-off's time, plus an exchange and an all-reduce per sweep.  Whether a
call did not pay (a rerun of half a slice or more, on any rank) is shared in the next call's gather of the slices'
sizes (:func:`gather`: one per call of the module, for all its layers), and the layer then runs the serial
hand-off (rank r waits for rank r - 1's end) for that shape; ``parallel_forward=False`` always does.  The common
case, a layer that forgets, ends after two sweeps at about T/p plus the meeting length.

**Backward** (BPPSA over the ranks): the adjoint ``λ_t = ∂l/∂s_t + J_{t+1}ᵀ λ_{t+1}`` is an affine recurrence
running from the last rank down.  Rank r's slice maps the gradient that enters it from the right, v (its
carry), to the one it passes left, ``J_{t0}ᵀ λ_{t0}``, by an affine map ``v -> M v + c``:

1. *local up-sweep*: the composition of the slice's pairs ``(J_k, ∂l/∂s_k)`` (:func:`slice_map`: by the backend's
   own product of the whole slice where it has one, the compiled kernel's for the RNN, else in segments composed
   side by side, then a tree, block after block), giving ``(M, c)``; only the ranks between the first and the last
   compute it: the last rank's carry is zero, so its ``c`` is its own (final) scan's output passed through its
   first step, and no rank reads its ``M``, nor anything of rank 0's;
2. *the ranks' scan*: :func:`bppsa.distributed.rank_scan` with ``reverse=True`` gives each rank its carry;
3. *local down-sweep*: the slice's own scan, the single-process layer's :class:`~.backward.Plan` with the carry
   added to its seed, then the gradients of the input and of the weights from the total ∇s_t, block by block
   (:func:`bppsa.nn.backward.grads_from_scan`), or, on rank 0 from a zero state, summed by the backend as it scans;
4. the weights' gradients are summed over the ranks (``all_reduce``); ∇s_0 is rank 0's.

Each rank keeps its slice's states, its chain and its scan's output, beside blocks of bounded size: O(T/p)
memory (at p = 2 each rank's peak is half the single process's: docs/measurements.md).  A group of one rank runs
the single-process layer's backward.  Every rank must run the backward (a loss that reads its outputs); the
exchanges wait at most ``timeout`` seconds for a peer and raise
:class:`bppsa.distributed.RankFailure` naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import distributed as _dist
from ..backends import TorchBackend
from . import backward as _bw
from . import forward as _fw
from .cells import Cell, Incoming, Needs, Saved, Weights

_summary: list = []


@dataclass(frozen=True)
class Ranks:
    """The process group a layer's sequence is split over, held weakly (:class:`bppsa.distributed.GroupRef`: the
    autograd context of the layer's outputs, which may outlive the user's ``destroy_process_group``, must not keep
    the group and its threads alive), and how long an exchange waits for a peer."""

    ref: _dist.GroupRef
    timeout: float | None = None

    @property
    def group(self):
        return self.ref()


@dataclass(frozen=True)
class Spec:
    """What a split layer's call is besides its tensors; ``memory`` is the layer's own (held by its module): per
    rank and shape, where its slice started in the last call (the next call's guess) and whether that call paid.
    ``sizes``: every rank's ``(T_r, B, S)``, ``unpaid``: whether some rank's last sliced forward of this layer and
    shape did not pay (both from :func:`gather`)."""

    cell: Cell
    lengths: torch.Tensor | None
    options: _bw.Options
    ranks: Ranks
    sizes: tuple
    unpaid: bool
    memory: dict = field(compare=False)


def _summary_backend() -> TorchBackend:
    """The torch twin that builds the dense chains of slice_map and a slice's first Jacobian (its own workspace)."""
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


def _first_step_t(cell: Cell, s: Saved, w: Weights, lam_first: torch.Tensor) -> torch.Tensor:
    """The gradient a slice passes to the rank before it: its first step's transposed Jacobian (from the state before
    the slice, ``s.h0``/``s.c0``) applied to the λ of that step, or λ itself for the sequences already past their
    end there."""
    J1 = cell.chain(_summary_backend(), s.block(0, 1), w)[0]
    out = _mv(J1, lam_first)
    return out if s.valid is None else torch.where(s.valid[0][:, None], out, lam_first)


class _Slice:
    """This rank's slice of the forward: its steps run from a start state, by the backend's own forward where it has
    one (the compiled CPU kernel, which also reruns until a stored trajectory is met), else torch's."""

    def __init__(self, cell: Cell, x, w: Weights, valid, be):
        self.cell, self.x, self.w, self.valid, self.be = cell, x, w, valid, be
        self.lengths = None if valid is None else valid.sum(0)  # each sequence's steps within the slice (0: ended)

    def run(self, start: torch.Tensor):
        cell, w = self.cell, self.w
        out = self.be.forward(cell.kernel, self.x, cell.split_state(start, w), w.tensors(), self.lengths, 1)
        return out[:2] if out is not None else _fw.torch_slice(cell, self.x, start, w, self.valid)

    def rerun(self, start: torch.Tensor, h, c) -> int:
        """h, c (in place) from a new start: the steps until each sequence meets the stored trajectory (the last
        step where one met), or all of them (T) where the backend cannot stop there."""
        cell, w = self.cell, self.w
        met = self.be.forward_until_meet(cell.kernel, self.x, cell.split_state(start, w), w.tensors(), self.lengths,
                                         (h, c), cell.meet_tol(self.x.dtype))
        if met is None:
            h_new, c_new = self.run(start)
            h.copy_(h_new)
            if c is not None:
                c.copy_(c_new)
            met = h.shape[0]
        return met


def _differs(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Whether two states [B, S] differ: bitwise, or (``tol`` > 0) for some sequence by more than tol times its
    largest unit."""
    if tol == 0:
        return not torch.equal(a, b)
    return bool(((a - b).abs().amax(-1) > tol * b.abs().amax(-1)).any())


def _key(x: torch.Tensor, r: int, p: int) -> tuple:
    """The rank and shape a slice's guess and its record of paying belong to (in the layer's ``Spec.memory``)."""
    return (r, p, *x.shape[:2], x.dtype, str(x.device))


def gather(x: torch.Tensor, S: int, memories: list[dict], ranks: Ranks) -> tuple[tuple, list[bool]]:
    """``(sizes, unpaid)`` for a module's call over the ranks, by one all-gather: every rank's ``(T_r, B, S)`` (the
    slices checked: a step at least on each, the same batch and state size), and per layer (``memories``, the
    layers' :attr:`Spec.memory` in order) whether some rank's last sliced forward of this shape reran half a slice
    or more -- the same on every rank, so every rank picks the same forward."""
    group, timeout = ranks.group, ranks.timeout
    p, r = dist.get_world_size(group), dist.get_rank(group)
    T_r, B = x.shape[:2]
    key = _key(x, r, p)
    rows = _dist.all_gather_ints([T_r, B, S, *(int(m.get(key, (None, False))[1]) for m in memories)], group,
                                 timeout)
    sizes = tuple(tuple(s[:3]) for s in rows)
    if any(s[1:] != (B, S) for s in sizes) or any(s[0] < 1 for s in sizes):
        raise ValueError(f"bppsa.nn (process group): every rank needs at least one step and the same batch and "
                         f"state size; the ranks hold [T_r, B, S] = {[list(s) for s in sizes]}")
    return sizes, [any(s[3 + i] for s in rows) for i in range(len(memories))]


def ranks_forward(cell: Cell, x, state0: torch.Tensor | None, w: Weights, valid, spec: Spec):
    """``(state_in, h, c, stats)``: this rank's slice of the layer's forward (the module's docstring), ``state_in``
    the exact state before it; ``stats`` the sweeps (None for the serial hand-off)."""
    group, timeout = spec.ranks.group, spec.ranks.timeout
    p, r = dist.get_world_size(group), dist.get_rank(group)
    T_r, B = x.shape[:2]
    sl = _Slice(cell, x, w, valid, _bw.backend_for(spec.options.backend, x.device))
    tol = cell.meet_tol(x.dtype)
    key = _key(x, r, p)
    slices = spec.options.slices  # None: where it pays (the last call of the shape says); 1: never; else always
    if p == 1 or slices == 1 or (slices is None and spec.unpaid):  # the serial hand-off
        start = state0 if r == 0 else _dist.recv_from(x.new_empty(B, cell.state_size(w)), r - 1, group, timeout)
        h, c = sl.run(start)
        if r < p - 1:
            _dist.send_to(_end(cell, h, c), r + 1, group, timeout)
        return start, h, c, None
    guess = spec.memory.get(key, (None, False))[0]
    start = state0 if r == 0 else (guess if guess is not None else x.new_zeros(B, cell.state_size(w)))
    h, c = sl.run(start)
    sweeps, meet_steps, long_reruns = 1, [], 0
    while True:  # sweep `sweeps`: the exchange of the ends, and the reruns from them
        end = _end(cell, h, c)
        if r < p - 1:
            _dist.send_to(end, r + 1, group, timeout)
        changed = False
        if r > 0:
            new = _dist.recv_from(x.new_empty(B, cell.state_size(w)), r - 1, group, timeout)
            if _differs(new, start, tol):
                start = new
                meet_steps.append(sl.rerun(start, h, c))
                long_reruns += meet_steps[-1] >= T_r // 2
                changed = r < p - 1 and _differs(_end(cell, h, c), end, tol)  # (the last rank's end feeds none)
        sweeps += 1
        if sweeps >= p:  # after sweep k the first k + 1 slices are exact: all p of them, with no vote
            break
        if not _dist.all_reduce_sum(torch.tensor([float(changed)]), group, timeout)[0]:
            break
    spec.memory[key] = (start.clone() if r > 0 else None, long_reruns > 0)
    return start, h, c, {"sweeps": sweeps, "meet_steps": meet_steps}


def _end(cell: Cell, h, c) -> torch.Tensor:
    """The slice's end state, a copy (a rerun rewrites h and c in place)."""
    return cell.state(h[-1], None if c is None else c[-1]).clone()


class SplitLayer(torch.autograd.Function):
    """One layer over this rank's slice: ``(h [T_r, B, P], h_end [B, P], c_end [B, H] or empty)`` (the module's
    docstring).  ``tensors``: x, h0, c0 and the layer's :class:`~.cells.base.Weights` in their order."""

    @staticmethod
    def forward(ctx, spec: Spec, *tensors):
        cell, group = spec.cell, spec.ranks.group
        x, h0, c0, w = tensors[0], tensors[1], tensors[2], Weights(*tensors[3:])
        p, r = dist.get_world_size(group), dist.get_rank(group)
        T_r, B, _ = x.shape
        sizes = spec.sizes
        if len(sizes) != p or sizes[r][:2] != (T_r, B) or sizes[r][2] != cell.state_size(w):
            raise ValueError(f"bppsa.nn (process group): the gathered sizes {sizes} are not this layer's: rank {r} "
                             f"of {p} holds [T_r, B, S] = {[T_r, B, cell.state_size(w)]}")
        t0 = sum(s[0] for s in sizes[:r])
        T = sum(s[0] for s in sizes)
        lengths = spec.lengths
        if lengths is not None and B and (int(lengths.min()) < 1 or int(lengths.max()) > T):
            raise ValueError(f"bppsa.nn: every length must lie in [1, T = {T}] (the whole sequence over the ranks), "
                             f"got {lengths.tolist()}")
        valid = _bw.valid_steps(lengths, T_r, x.device, t0)
        with torch.no_grad(), _bw.no_autocast(x.device):
            state0 = None
            if r == 0:
                zero_c = x.new_zeros(B, cell.hidden(w)) if cell.cell_state else None
                state0 = cell.state(h0 if h0 is not None else x.new_zeros(B, w.out_size),
                                    c0 if c0 is not None else zero_c)
            state_in, h, c, stats = ranks_forward(cell, x, state0, w, valid, spec)
            _fw.record(stats)
        ctx.save_for_backward(x, state_in, h, c, *w.tensors())
        ctx.spec, ctx.valid, ctx.where = spec, valid, (r, p, h0 is not None or c0 is not None)
        ctx.set_materialize_grads(False)
        c_end = c[-1].clone() if c is not None else x.new_empty(0)
        return h, h[-1].clone(), c_end

    @staticmethod
    def backward(ctx, grad_h, grad_h_end, grad_c_end):
        x, state_in, h, c, *wt = ctx.saved_tensors
        spec, (r, p, has_s0) = ctx.spec, ctx.where
        cell, w, need = spec.cell, Weights(*wt), ctx.needs_input_grad
        h_in, c_in = cell.split_state(state_in, w) if (r > 0 or has_s0) else (None, None)
        s = Saved(x, h, c, h_in, c_in, ctx.valid)
        inc = Incoming(grad_h, grad_h_end, grad_c_end)
        wanted = Needs(bool(need[1]), r == 0 and has_s0 and bool(need[2] or need[3]))
        with torch.no_grad(), _bw.no_autocast(x.device):
            if p == 1:  # one rank: the single-process layer's backward, its fast paths included
                dx, ds0, grads = _bw.run(cell, s, w, inc, wanted, spec.options)
            else:
                dx, ds0, grads = _slice_backward(cell, s, w, _bw.plan(cell, s, inc, wanted), wanted, spec)
                grads = _reduced(grads, cell, w, spec.ranks)
        return _returned(cell, w, dx, ds0, grads, need)


def _slice_backward(cell: Cell, s: Saved, w: Weights, plan: _bw.Plan, need: Needs, spec: Spec):
    """Steps 1-3 of the module's docstring on this rank: ``(dx, ds0, {weight: this slice's gradient})``."""
    group, timeout = spec.ranks.group, spec.ranks.timeout
    p, r = dist.get_world_size(group), dist.get_rank(group)
    be = _bw.layer_backend(spec.options.backend, s.x.device)
    ps = be.scanner(cell.kind, plan.per_step)
    # with the carry known a slice's scan needs no tree of its own (its products were the up-sweep's): across
    # ranks the local down-sweep is the linear scan (L_m = 0) unless L_m says otherwise
    local = _bw.Options(spec.options.backend, "fused", spec.options.L_m if spec.options.L_m not in (None, _bw.AUTO)
                        else 0)
    with _bw.jacobian_phase():
        J = cell.chain(ps, s, w, "fused", with_x=plan.sums)
    if r == p - 1:
        # first in the scan's order: its carry is zero, so its scan is final at once, and what it passes on is its
        # first step's Jacobian applied to its first λ (its map's matrix is never read: zeros)
        lam = _prefixes(ps, plan, J, local.L_m)
        out = _first_step_t(cell, s, w, lam[-1])
        _dist.rank_scan(torch.zeros(out.shape + out.shape[-1:], dtype=out.dtype, device=out.device), out, group,
                        reverse=True, timeout=timeout)
    else:
        if r > 0:  # 1. a middle rank's local up-sweep: its slice's map of the carry
            P, q = slice_map(cell, s, w, ps, J, plan)
        else:  # last in the scan's order: no rank reads its map
            P, q = plan.seed.new_zeros(plan.seed.shape + plan.seed.shape[-1:]), plan.seed.new_zeros(plan.seed.shape)
        # 2. the ranks' scan from the last rank down; 3. the slice's own scan, seeded with its carry
        carry = _dist.rank_scan(P, q, group, reverse=True, timeout=timeout)
        del P, q
        seeded = plan.with_seed(plan.seed + carry)
        if seeded.sums:
            def from_scan(out):
                return _bw.grads_from_scan(cell, s, w, out, Needs())[2]

            return None, None, ps.cell_grads(seeded.seed, J, local.L_m, from_scan, c=seeded.direct)
        lam = _prefixes(ps, seeded, J, local.L_m)
    del J
    return _bw.grads_from_scan(cell, s, w, lam, need)


def _prefixes(ps, plan: _bw.Plan, J, L_m):
    """The slice's scan of λ (scan order) from its plan's seed: the single seed's where no step has a gradient of its
    own, else the affine one."""
    if not plan.per_step:
        return ps.scan(plan.seed, J, L_m)
    return _bw.affine_prefixes(ps, plan.seed, J, plan.direct, L_m, plan.past)


SUMMARY_BLOCK_VALUES = 1 << 20  # values of one block of slice_map at most (the RNN's factors, a dense chain)
SEGMENTS = 32  # a block's segments, composed side by side (slice_map; its steps / SEGMENTS one after another each)


def _steps(A, chain, step, c, past):
    """The maps ``A`` [S, B, K, K'] (``(P | q)``, K' = K + 1 with ``c``) each composed with its m steps, one after
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
    """``(P, q)`` ([B, S, S], [B, S] or None without ``c``) of a block's pairs in scan order: its steps cut into
    ``SEGMENTS`` segments composed side by side (:func:`_steps`: one large product a step for all of them instead
    of one small product a segment), the segments' maps then composed by :func:`chain_summary`'s tree, the steps
    left over one after another."""
    n, B, K = chain.shape[0], chain.shape[1], chain.shape[-1]
    m = -(-n // SEGMENTS)
    S = n // m

    def seg(t, j0=0):  # the first S·m steps of t [n, ...] as [m, S, ...] (step j of segment s), from step j0
        return None if t is None else t[:S * m].reshape(S, m, *t.shape[1:]).transpose(0, 1)[j0:]

    # each segment's map starts as its first pair, (J | c), then takes the others (S >= 1: m <= n)
    A = step(seg(chain), 0, None)
    if past is not None:
        A = torch.where(seg(past)[0][..., None, None], torch.eye(K, dtype=A.dtype, device=A.device), A)
    if m == 1:  # one step a segment: the tree over the block's dense pairs as they are
        P, q = chain_summary(A, seg(c)[0] if c is not None else A.new_zeros((S, B, K)))
    else:
        if c is not None:
            A = torch.cat([A, seg(c)[0].unsqueeze(-1)], -1)
        A = _steps(A, seg(chain, 1), step, seg(c, 1), seg(past, 1))
        P, q = chain_summary(A[..., :K], A[..., K] if c is not None else A.new_zeros((S, B, K)))
    A = torch.cat([P, q.unsqueeze(-1)], -1) if c is not None else P
    if S * m < n:  # the steps left over, one after another

        def one(t):
            return None if t is None else t[S * m:].unsqueeze(1)

        A = _steps(A.unsqueeze(0), one(chain), step, one(c), one(past))[0]
    return A[..., :K], (A[..., K] if c is not None else None)


def slice_map(cell: Cell, s: Saved, w: Weights, ps, J, plan: _bw.Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, q)``: the slice's map of the gradient entering it from the right, ``v -> P v + q`` (the plan's seed
    included), identities past a sequence's end: the middle ranks' up-sweep in O(block) memory beside the states.
    The backend's own product of the whole slice where it has one (``ps.chain_product`` over the slice's chain
    ``J``: the compiled kernel's for the RNN, ~90 GFLOP/s on a Zen 4 thread); else torch, block by block
    (:func:`_block_map` over the cell's :meth:`~.cells.base.Cell.block_steps`), the plain twin the kernel is
    tested against."""
    T, B = s.h.shape[:2]
    c, past, seed = plan.direct, plan.past, plan.seed
    if past is None:
        whole = ps.chain_product(J, c)
        if whole is not None:
            P, q = whole
            return P, _mv(P, seed) + (q if q is not None else 0)
    K = seed.shape[-1]
    per_step = cell.block_values(s, w)
    step = max(1, min(SUMMARY_BLOCK_VALUES, T * B * K) // per_step)
    P = q = None
    for t1 in range(T, 0, -step):  # scan order: the slice's last steps first
        t0 = max(0, t1 - step)
        chain, apply = cell.block_steps(_summary_backend(), s.block(t0, t1), w)
        Pb, qb = _block_map(chain, apply, None if c is None else c[T - t1:T - t0],
                            None if past is None else past[T - t1:T - t0])
        if P is None:
            P, q = Pb, qb
        else:  # this block after the blocks before it (q and qb: both None without c, else both set)
            P, q = torch.matmul(Pb, P), None if qb is None else _mv(Pb, q) + qb
    return P, _mv(P, seed) + (q if q is not None else 0)


def _reduced(grads: dict, cell: Cell, w: Weights, ranks: Ranks) -> dict:
    """4. The weights' gradients summed over the ranks, in one exchange."""
    names = [n for n in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0") if w.bias or "bias" not in n]
    names += list(cell.extra_names(w))
    flat = _dist.all_reduce_sum(torch.cat([grads[n].reshape(-1) for n in names]), ranks.group, ranks.timeout)
    return {n: t.view(grads[n].shape) for n, t in zip(names, torch.split(flat, [grads[n].numel() for n in names]))}


def _returned(cell: Cell, w: Weights, dx, ds0, grads: dict, need) -> tuple:
    """The autograd return value: None for the spec, then x, h0, c0 and the weights in their order."""
    dh0, dc0 = cell.split_state(ds0, w) if ds0 is not None else (None, None)
    weights = [grads.get(n) if t is not None and need[4 + i] else None
               for i, (n, t) in enumerate(zip(("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0",
                                               "weight_hr_l0"), w.tensors()))]
    return (None, dx if need[1] else None, dh0 if need[2] else None, dc0 if need[3] else None, *weights)


def layer(cell: Cell, x, state0: tuple, w: Weights, lengths, options: _bw.Options, ranks: Ranks, sizes: tuple,
          unpaid: bool, memory: dict):
    """``(h, h_end, c_end or None)`` of one layer over this rank's slice (time-major ``x`` [T_r, B, I]);
    ``state0 = (h0, c0)`` is read on rank 0; ``sizes`` and ``unpaid``: this call's :func:`gather`; ``memory``: the
    layer's own dict, kept between calls (:class:`Spec`)."""
    _bw.check_layer(cell, x, *state0, w, None)
    if lengths is not None and (lengths.dtype != torch.int64 or tuple(lengths.shape) != (x.shape[1],)):
        raise ValueError(f"bppsa.nn: lengths must be int64 [B] = [{x.shape[1]}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    spec = Spec(cell, lengths, options, ranks, tuple(sizes), unpaid, memory)
    h, h_end, c_end = SplitLayer.apply(spec, x, *state0, *w.tensors())
    return h, h_end, (c_end if cell.cell_state else None)
