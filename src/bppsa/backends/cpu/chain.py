"""The recurrent chains of the CPU fast path (:mod:`bppsa.backends.chain`), built for the compiled kernel and
scanned by it.

:func:`rnn_chain` and :func:`gru_chain` build a :class:`~bppsa.backends.chain.FactoredChain` the kernel reads
best: the RNN's from the forward's states (the kernel writes each step's factors as it scans it), the GRU's
with its gate pass left to the scan's threads.  :func:`native_chain_scan` scans one with the compiled kernel of
:mod:`.native` (``chain_scan.c``: the batch as the vector lanes, the lowest up-sweep levels fused per
block) on lane slices or block ranges spread over the threads, and can accumulate the cell's parameter
gradients as the prefixes come out; without a C compiler, :func:`rnn_chain_scan` takes the RNN's chain
(level 0 as one GEMM from the factors).
"""
from __future__ import annotations

import torch

from ... import scan as _scan
from ..chain import FactoredChain, GruChain, LstmChain, LstmStates, PaperChain, RnnChain, factor_buffer
from . import native, plan, pool
from .dense import dense_tree_scan

FACTOR_FLOP = 50  # a factor builder's cost per value written (~1 ns, a strided store), in those FLOP


def _kernel_has(h: torch.Tensor) -> bool:
    """Whether the compiled kernel takes chains over ``h``: it reads host memory (CUDA tensors, the factored GPU path,
    take torch's factors) and is built at first use for the chain's kind and sizes."""
    return h.device.type == "cpu" and native.builds(h.dtype)


def rnn_chain(cls: type[RnnChain] | type[PaperChain], h: torch.Tensor, W_hh: torch.Tensor,
              x: torch.Tensor | None = None, out=None, act: str = "tanh") -> RnnChain | PaperChain:
    """The RNN's chain of layout ``cls`` from the forward's states ``h`` [T, B, H] and inputs ``x`` [T, B, I]: with
    the kernel at hand, the states themselves (contiguous; the kernel writes each step's factors -- tanh's
    1 - h², relu's 1[h > 0] -- as it scans it, and torch only where something reads
    :attr:`~bppsa.backends.chain.FactoredChain.f`); else ``cls.from_states`` (torch; ``out``: its buffer)."""
    I = 0 if x is None else x.shape[2]
    if act not in native.ACTS or not _kernel_has(h):
        return cls.from_states(h, W_hh, x, out, act)  # (its error names an unknown nonlinearity)
    xc = x if x is not None else h[:, :, :0]
    return cls(W_hh, None, I, states=(h if h.is_contiguous() else h.contiguous(),
                                      xc if xc.is_contiguous() else xc.contiguous()), act=act)


def lstm_chain(x: torch.Tensor | None, h: torch.Tensor, gates, W_hh: torch.Tensor, out=None,
               states: LstmStates | None = None) -> LstmChain | None:
    """The LSTM's chain (no projection) for the compiled kernel, its factors in ``out`` where its shape fits: with
    ``states`` (and x), written by one compiled gate pass from the forward's states (:class:`.native.LstmFill`, left
    for the first reader: the scan's team writes it, in units of steps; ``gates`` is not called); else by torch from
    ``gates()`` (:class:`~bppsa.jacobians.lstm.LstmGates`).  ``x`` None: a chain without x (no gradients summed by
    the kernel).  None where the kernel is not at hand (no compiler, tensors off the CPU)."""
    I = 0 if x is None else x.shape[2]
    H = W_hh.shape[1]
    if not _kernel_has(h):
        return None
    if states is None or x is None:
        return LstmChain.from_states(x, gates(), W_hh, out)
    f = factor_buffer(h, 7 * H + I, out)
    x, h, c, h0, c0 = (None if t is None else t.detach().contiguous() for t in (x, h, states.c, states.h0, states.c0))
    fill = _LstmFill(x, h, c, (states.W_ih, W_hh, states.b_ih, states.b_hh), h0, c0, f)
    return LstmChain(W_hh.detach(), f, I, fill)


class _Spread:
    """A gate pass left for later: a team's scan runs it in units of steps (:meth:`~.native.Fill.units`); a reader
    of :attr:`~bppsa.backends.chain.FactoredChain.f` calls it for all steps, spread over the pool's threads."""

    def __call__(self, k0: int, k1: int) -> None:
        B, rows = self.out.shape[2], self.out.shape[1]
        fill = super().__call__
        pool.parallel(lambda a, b: fill(k0 + a, k0 + b), k1 - k0, FACTOR_FLOP * B * rows)


class _GruFill(_Spread, native.GruFill):
    pass


class _LstmFill(_Spread, native.LstmFill):
    pass


def gru_chain(x: torch.Tensor, h: torch.Tensor, cell, out: torch.Tensor | None = None) -> GruChain:
    """The GRU's chain from the forward's inputs ``x``, states ``h`` and ``cell``: with the kernel at hand, the gates
    recomputed and the factors written by one compiled pass (:class:`_GruFill`), left for the first reader (the
    scan's team writes it, in units of steps); else ``GruChain.from_states`` (torch).  ``out``: a [T, 6H + I, B]
    buffer, used where its shape fits."""
    I = x.shape[2]
    if not _kernel_has(h):
        return GruChain.from_states(x, h, cell, out)
    f = factor_buffer(h, 6 * h.shape[2] + I, out)
    return GruChain(cell.weight_hh_l0, f, I, _GruFill(x.detach().contiguous(), h.detach().contiguous(), cell, f))


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _product(kind, T, B, S, I, dtype, Wt, f, h, x, c, act="tanh"):
    """``chain_scan.c``'s ``chain_product`` over the whole chain, a call per slice of batch lanes (one register's)."""
    P = torch.empty((B, S, S), dtype=dtype)
    q = None if c is None else torch.empty((B, S), dtype=dtype)
    vl = native.lane_width(kind, dtype)
    lib = native.library(kind, S, vl, dtype, act)  # one build: a last slice narrower than it has spare lanes
    if lib is None:
        return None
    for b0 in range(0, B, vl):
        w = min(vl, B - b0)
        M = torch.empty((S, S, vl), dtype=dtype)
        qv = None if c is None else torch.empty((S, vl), dtype=dtype)
        lib.chain_product(Wt.data_ptr(), _ptr(f), _ptr(h), _ptr(x), _ptr(c), I, T, B, b0, w, 0, T, M.data_ptr(),
                          _ptr(qv))
        P[b0:b0 + w] = M.permute(2, 0, 1)[:w]
        if qv is not None:
            q[b0:b0 + w] = qv.t()[:w]
    return P, q


def rnn_chain_product(h: torch.Tensor, W_hh: torch.Tensor, x: torch.Tensor, c: torch.Tensor | None = None,
                      act: str = "tanh") -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The RNN's whole fused chain over the states ``h`` [T, B, H] (inputs ``x`` [T, B, I]) as one map, by the
    compiled kernel (``chain_scan.c``'s ``chain_product``, one thread; a call per slice of batch lanes):
    ``P`` [B, H, H] = J_{T-1} ... J_0 (scan order, J_k = W_hhᵀ diag(1 - h_{T-1-k}²), relu's 1[h > 0] for ``act``
    "relu") and, with ``c`` [T, B, H] (scan order, c[k] entering after J_k), the offset ``q`` [B, H] with which
    the affine recurrence maps v to ``P v + q``.  None where the kernel is not at hand (no compiler, or tensors off
    the CPU)."""
    T, B, H = h.shape
    I = x.shape[2]
    if T == 0 or not _kernel_has(h):
        return None
    Wt = W_hh.detach().t().contiguous()
    h, x = h.detach().contiguous(), x.detach().contiguous()
    c = None if c is None else c.detach().contiguous()
    return _product("rnn", T, B, H, I, h.dtype, Wt, None, h, x, c, act)


def chain_product(chain: FactoredChain, c: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A chain of written factors (the GRU's, the LSTM's; not the paper layout) as one map by the compiled kernel, as
    :func:`rnn_chain_product` does the RNN's states: ``P`` [B, S, S] = J_{n-1} ... J_0 and, with ``c`` [n, B, S],
    the offset ``q`` [B, S].  None where the kernel is not at hand."""
    n, B, S, _ = chain.shape
    if n == 0 or chain.kind == "paper" or not _kernel_has(chain.f):
        return None
    c = None if c is None else c.detach().contiguous()
    return _product(chain.kind, n, B, S, chain.I, chain.dtype, chain.Wt, chain.f, None, None, c)


def synthetic(kind: str, n: int, B: int, H: int, I: int, dtype: torch.dtype):
    """A chain of ``kind`` (n Jacobians, batch B, hidden H, input I) with well-scaled random values (no subnormals
    in its products), built with x as the fast path builds it, and ∇h_T: what a plan is measured on (:mod:`.plan`)."""
    g = torch.Generator().manual_seed(0)
    hc = native.hidden(kind, H)
    W = (torch.randn(native.WEIGHTS[kind] * hc, hc, generator=g) * (0.9 / hc ** 0.5)).to(dtype)
    T = n // 2 if kind == "paper" else n
    if kind == "gru":
        chain = GruChain(W, (torch.rand(T, 6 * H + I, B, generator=g) * 0.5).to(dtype), I)
    elif kind == "lstm":
        f = torch.rand(T, 7 * hc + I, B, generator=g) * 0.5
        f[:, 5 * hc:6 * hc] += 0.5  # forget gates in [0.5, 1): products of 2^c steps stay normal numbers
        chain = LstmChain(W, f.to(dtype), I)
    else:
        h = (torch.rand(T, B, H, generator=g) * 1.8 - 0.9).to(dtype)
        x = torch.rand(T, B, I, generator=g).to(dtype)
        chain = rnn_chain(RnnChain if kind == "rnn" else PaperChain, h, W, x)
    return chain, torch.randn(B, H, generator=g).to(dtype)


def native_chain_scan(g, chain: FactoredChain, L: int, ws: _scan.Workspace, split: str = "auto",
                      grads: bool = False, c: torch.Tensor | None = None):
    """The scan over a :class:`FactoredChain` by the compiled kernel (:mod:`.native`); None where it is
    unavailable.  ``g``: ∇h_T.  ``grads``: instead of the scan, the cell's
    parameter gradients (a dict), accumulated by the kernel as the prefixes come out (the chain must have been
    built with x).

    One call into the kernel (:class:`.native.Team`, built once per shape and kept in ``ws``) runs the whole
    scan on a team of threads, shared as :mod:`.plan` chooses for the shape (lane slices owned by threads, or
    the blocks of each slice shared): either way a thread that is done takes work left in the others' slices,
    and the factors the chain left for later (the GRU's gate pass, :meth:`FactoredChain.claim_fill`) are
    written by the team first.  ``split`` "slices" (the sequential rival, whose chain cannot be split by
    blocks) takes whole slices only.  ``c``: the loss's direct gradients in scan order [n, B, H], ``c[k]``
    entering after ``J_k`` (``g`` holding h_T's whole gradient): the scan of the affine recurrence
    out[k+1] = J_k out[k] + c[k] (g_t = J_{t+1}ᵀ g_{t+1} + ∂l/∂h_t) instead of the single seed's."""
    n, B, H, _ = chain.shape
    threads = pool.threads()
    affine = c is not None
    act = getattr(chain, "act", "tanh")
    team = ws.memo(("cpu", "team", chain.kind, act, n, B, H, chain.I, chain.dtype, L, split, grads, threads, affine),
                   lambda: plan.team_for(chain, L, split, grads, threads, affine, synthetic))
    if team is None:
        return None
    dtype = chain.dtype
    g = g if g.is_contiguous() else g.contiguous()
    out = None if grads else torch.empty((n, B, H), dtype=dtype)
    if n == 0:
        return out
    fill = chain.claim_fill() if chain.states is None else None
    if fill is not None and not isinstance(fill, native.Fill):
        fill(0, chain._f.shape[0])  # a writer the kernel cannot run: here, first
        fill = None
    if affine:
        if tuple(c.shape) != (n, B, H) or c.dtype != dtype or c.device.type != "cpu":
            raise ValueError(f"per-step gradients: expected [{n}, {B}, {H}] {dtype} on the CPU, got "
                             f"{list(c.shape)} {c.dtype} on {c.device}")
        c = c if c.is_contiguous() else c.contiguous()
    sums = team.go(chain._W, chain.states if chain.states is not None else chain._f, g, out, fill, c)
    return sums if grads else out


def rnn_chain_scan(g: torch.Tensor, chain: RnnChain, L: int, ws: _scan.Workspace) -> torch.Tensor:
    """The scan over an :class:`RnnChain` with ``L >= 1`` levels, its level 0 straight from the factors.

    Up: the level's products J_{2j+2} J_{2j+1} = Wᵀ D_a Wᵀ D_b (a = d_{2j+2}, b = d_{2j+1}) need no
    chain: vec(Wᵀ D_a Wᵀ) = K a with K[(i, l), m] = Wᵀ[i, m] Wᵀ[m, l], so all of them are ONE
    [pairs·B, H] × [H, H²] GEMM (torch's BLAS: about 3x the rate of stacked 20×20 products, docs/measurements.md,
    "Measurements the code cites"), then a column scaling by b.  The levels above are the scan of
    that level's array (:func:`.dense.dense_tree_scan` on ``L - 1`` levels).  Down: a right child's prefix is
    J_{2j+1} Q_j = Wᵀ (d_{2j+1} ⊙ Q_j), as rows one GEMM with W_hh.
    """
    W, d = chain.W_hh, chain.d.contiguous()
    n, B, H = d.shape
    pairs, carry = (n - 1) // 2, (n - 1) % 2
    level = ws.get(("cpu", "chain-level0"), (pairs + carry, B, H, H), d)
    if pairs:
        pair_d = d[1:1 + 2 * pairs].view(pairs, 2, B, H)  # [j, 0] = d_{2j+1} (right), [j, 1] = d_{2j+2} (left)
        left = ws.get(("cpu", "chain-left"), (pairs * B, H), d)
        left.view(pairs, B, H).copy_(pair_d[:, 1])
        K = torch.einsum("mi,lm->mil", W, W).reshape(H, H * H)  # K[m, (i, l)] = Wᵀ[i, m] Wᵀ[m, l]
        torch.mm(left, K, out=level[:pairs].view(pairs * B, H * H))
        level[:pairs].mul_(pair_d[:, 0].unsqueeze(-2))
    if carry:
        level[pairs] = W.t() * d[n - 1].unsqueeze(-2)  # J_{n-1}, the odd one out
    Q = dense_tree_scan((d[0] * g) @ W, level, L - 1, ws)  # the spine after level 0: J_0 g

    out = g.new_empty((n, B, H))
    out[0] = g
    kids = out[1:1 + 2 * pairs].view(pairs, 2, B, H)
    kids[:, 0] = Q[:pairs]  # a left child inherits its parent's prefix
    kids[:, 1] = (d[1:2 * pairs:2] * Q[:pairs]) @ W
    if carry:
        out[n - 1] = Q[pairs]
    return out
