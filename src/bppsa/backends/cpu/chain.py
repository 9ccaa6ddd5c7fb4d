"""The recurrent chains of the CPU fast path, never built: kept as their factors, and scanned as such.

:class:`FactoredChain` (:class:`RnnChain` and :class:`PaperChain` for the RNN's two layouts,
:class:`GruChain`) keeps a chain as its weights and per-step factors, in lane order, beside the inputs
the parameter gradients need.  :func:`native_chain_scan` scans one with the compiled kernel of
:mod:`.native` (``chain_scan.c``: the batch as the vector lanes, the lowest up-sweep levels fused per
block) on lane slices or block ranges spread over the threads, and can accumulate the cell's parameter
gradients as the prefixes come out; without a C compiler, :func:`rnn_chain_scan` takes the RNN's chain
(level 0 as one GEMM from the factors).
"""
from __future__ import annotations

import functools

import torch

from ... import scan as _scan
from ..base import grad_of
from . import native, plan, pool
from .dense import dense_tree_scan

FACTOR_FLOP = 50  # a factor builder's cost per value written (~1 ns, a strided store), in those FLOP


class FactoredChain:
    """A chain of transposed Jacobians kept as its weights ``Wt`` [NW, H, H] (transposed) and per-step
    factors ``f`` [steps, NR, B] (lane order: the compiled kernel reads each row's batch lanes side by
    side), the kinds of ``chain_scan.c``, instead of n·B dense H×H matrices: what
    :class:`~bppsa.backends.cpu.CpuBackend` builds.  The last I + H rows of a step are x_t and h' = h_{t-1},
    for the parameter gradients the kernel accumulates as it scans (zero rows where the chain was built
    without x, ``I = 0``).  It stands where a dense chain ``[n, B, H, H]`` would (``shape``, ``dim()``);
    :meth:`dense` is that chain.  ``states``, where given (the RNN's chains, the compiled kernel at hand):
    the forward's states h [T, B, H] and inputs x [T, B, I] (contiguous), from which the kernel reads each
    step's factors as it scans it; ``f`` is then None, the factors written only where :attr:`f` is read (a
    training step never does).  ``fill(k0, k1)``, where given, writes the factors of steps [k0, k1) later:
    :attr:`f` runs it on first use, or the scan's threads take it (:meth:`claim_fill`)."""

    kind: str
    NF: int  # rows of H factors per step before x and h'
    NW = 1  # weight matrices

    def __init__(self, W_hh: torch.Tensor, f: torch.Tensor | None, n: int, I: int, fill=None,
                 states: tuple[torch.Tensor, torch.Tensor] | None = None):
        H = W_hh.shape[1]
        if f is None:  # read from the states by the kernel: written only where something reads f (_written_f)
            h = states[0]
            steps, rows, B = h.shape[0], self.NF * H + I + H, h.shape[1]
            dtype, device = h.dtype, h.device
        else:
            (steps, rows, B), dtype, device = f.shape, f.dtype, f.device
        if rows != self.NF * H + I + H or W_hh.dtype != dtype or W_hh.shape[0] != self.NW * H:
            raise ValueError(f"{type(self).__name__}: factors {(steps, rows, B)} {dtype} do not fit weights "
                             f"{tuple(W_hh.shape)} {W_hh.dtype} and input size {I}")
        self._W, self._f, self._fill, self.I = W_hh, f, fill, I
        self.states = states
        self.shape = torch.Size((n, B, H, H))
        self.dtype, self.device = dtype, device

    @property
    def W_hh(self) -> torch.Tensor:
        """The recurrent weights [NW·H, H] (the compiled kernel transposes them itself)."""
        return self._W.detach()

    @functools.cached_property
    def Wt(self) -> torch.Tensor:
        """The weights transposed, [NW, H, H] (contiguous): Wt[g] = W_hg^T."""
        H = self.shape[2]
        return self.W_hh.reshape(self.NW, H, H).transpose(1, 2).contiguous()

    @property
    def f(self) -> torch.Tensor:
        """The factors [steps, NR, B], written first where they were left for later."""
        if self._f is None:
            self._f = self._written_f()
        fill = self.claim_fill()
        if fill is not None:
            steps, rows, B = self._f.shape
            pool.parallel(fill, steps, FACTOR_FLOP * B * rows)
        return self._f

    def _written_f(self) -> torch.Tensor:  # pragma: no cover - only chains built from states have no f
        raise NotImplementedError

    def claim_fill(self):
        """The writer of the factors left for later, ``fill(k0, k1)`` for steps k0 .. k1 - 1, handed to the
        caller, who must run it over every step before they are read (None: they are written)."""
        fill, self._fill = self._fill, None
        return fill

    def dim(self) -> int:
        return 4

    def synthetic_like(self):
        """A chain of this kind and shape with well-scaled random values (no subnormals in its products), built
        with x, and a ∇h_T: what a plan is measured on (:mod:`.plan`)."""
        n, B, H, _ = self.shape
        return synthetic(self.kind, n, B, H, self.I, self.dtype)

    def lanes(self, i: int) -> torch.Tensor:
        """Factor i ([steps, H, B]) of every step."""
        H = self.shape[2]
        return self.f[:, i * H:(i + 1) * H]

    def dense(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def grad_layout(self) -> list[tuple[str, tuple[int, ...], list[tuple[slice, slice]]]]:
        """The cell's parameter gradients in the kernel's sums [NA, I + 1 + H] (summed over lanes; rows: the
        gradient w.r.t. the pre-activations, columns x, 1, h'): per parameter its name, shape and the (rows,
        columns) blocks whose values, row by row and block after block, are its gradient."""
        raise NotImplementedError  # pragma: no cover - abstract

    def param_grads(self, acc: torch.Tensor) -> dict[str, torch.Tensor]:
        """The cell's parameter gradients from the kernel's sums ``acc`` (:meth:`grad_layout`)."""
        return {name: torch.cat([acc[r, c].reshape(-1) for r, c in parts]).view(shape)
                for name, shape, parts in self.grad_layout()}

    @staticmethod
    def _fill(f: torch.Tensor, NF: int, H: int, x: torch.Tensor | None, h: torch.Tensor) -> None:
        """The x and h' rows of ``f`` in torch (the compiled kernel's factor builders write them otherwise)."""
        T, _, B = f.shape
        I = 0 if x is None else x.shape[2]
        if I:
            f[:, NF * H:NF * H + I].copy_(x.flip(0).permute(0, 2, 1))
        hp = f[:, NF * H + I:]
        hp[-1].zero_()
        hp[:-1].copy_(h[:-1].flip(0).permute(0, 2, 1))


def _factor_buffer(h: torch.Tensor, rows: int, out) -> torch.Tensor:
    """``out`` where its shape fits (a callable: what it returns for the shape), else a new buffer."""
    T, B, _ = h.shape
    out = out((T, rows, B)) if callable(out) else out
    return out if out is not None and tuple(out.shape) == (T, rows, B) else h.new_empty((T, rows, B))


def _rnn_factors(h: torch.Tensor, x: torch.Tensor | None, out):
    """The RNN's factors d_k = 1 - h_{T-k}², then x and h' in scan order and lane order, [T, 2H + I, B], and
    the states the compiled kernel reads them from: with the kernel at hand, no buffer (None: written only where
    something reads :attr:`FactoredChain.f`) and the states; else the buffer written by torch and None."""
    T, B, H = h.shape
    I = 0 if x is None else x.shape[2]
    # the compiled kernel reads host memory: CUDA tensors (the factored GPU path) take torch
    if h.device.type == "cpu" and native.available() and native.library("rnn", H, I, 1, h.dtype) is not None:
        xc = x if x is not None else h[:, :, :0]
        return None, (h if h.is_contiguous() else h.contiguous(), xc if xc.is_contiguous() else xc.contiguous())
    f = _factor_buffer(h, 2 * H + I, out)
    h = h.detach()
    hf = h.flip(0)
    torch.sub(torch.ones((), dtype=h.dtype), hf * hf, out=f[:, :H].permute(0, 2, 1))  # as 1 - h * h, bit for bit
    FactoredChain._fill(f, 1, H, x, h)
    return f, None


def _steps(f: torch.Tensor | None, states) -> int:
    return (states[0] if f is None else f).shape[0]


class _RnnParams:
    """The tanh RNN's factors, written from its states where something reads them (the compiled builder), and its
    parameter gradients from the kernel's sums: rows ∇a, columns (x, 1, h')."""

    def _written_f(self) -> torch.Tensor:
        h, x = self.states
        T, B, H = h.shape
        rows = 2 * H + x.shape[2]
        f = h.new_empty((T, rows, B))
        pool.parallel(functools.partial(native.rnn_factors, h, x, f), T, FACTOR_FLOP * B * rows)
        return f

    def grad_layout(self):
        H, I = self.shape[2], self.I
        rows, bias = slice(0, H), [(slice(0, H), slice(I, I + 1))]
        return [("weight_ih_l0", (H, I), [(rows, slice(0, I))]), ("bias_ih_l0", (H,), bias),
                ("bias_hh_l0", (H,), bias), ("weight_hh_l0", (H, H), [(rows, slice(I + 1, I + 1 + H))])]


class RnnChain(_RnnParams, FactoredChain):
    """The fused-layout chain of a tanh RNN, ``J_k = W_hhᵀ diag(d_k)`` (k = 0 .. T-1, scan order, d_k =
    1 - h_{T-k}²): ``W_hh`` and ``d_lanes`` [T, H, B] (``d`` [T, B, H] is a view of it).  :meth:`dense` is
    the chain :func:`bppsa.jacobians.recurrent.rnn_jacobians_t` builds."""

    kind, NF = "rnn", 1

    def __init__(self, W_hh: torch.Tensor, f: torch.Tensor | None, I: int = 0, states=None):
        super().__init__(W_hh, f, _steps(f, states), I, states=states)

    @property
    def d_lanes(self) -> torch.Tensor:
        return self.lanes(0)

    @property
    def d(self) -> torch.Tensor:
        return self.d_lanes.permute(0, 2, 1)  # [T, B, H], a view

    @classmethod
    def from_states(cls, h: torch.Tensor, W_hh: torch.Tensor, x: torch.Tensor | None = None,
                    out=None) -> RnnChain:
        """From the forward's states ``h`` [T, B, H] and inputs ``x`` [T, B, I] (None: the scan only);
        ``out``: a buffer for the factors where torch writes them, used where its shape fits (or a callable
        that returns one for a shape: asked only then)."""
        f, states = _rnn_factors(h, x, out)
        return cls(W_hh, f, 0 if x is None else x.shape[2], states=states)

    def dense(self) -> torch.Tensor:
        return self.W_hh.t() * self.d.unsqueeze(-2)  # as rnn_jacobians_t(h, W_hh, "fused")


class PaperChain(_RnnParams, FactoredChain):
    """The paper layout of a tanh RNN, two Jacobians per step: ``J_2k = diag(d_k)``, ``J_2k+1 = W_hhᵀ``
    (the factors are the fused chain's)."""

    kind, NF = "paper", 1

    def __init__(self, W_hh: torch.Tensor, f: torch.Tensor | None, I: int = 0, states=None):
        super().__init__(W_hh, f, 2 * _steps(f, states), I, states=states)

    @classmethod
    def from_states(cls, h: torch.Tensor, W_hh: torch.Tensor, x: torch.Tensor | None = None,
                    out=None) -> PaperChain:
        f, states = _rnn_factors(h, x, out)
        return cls(W_hh, f, 0 if x is None else x.shape[2], states=states)

    def dense(self) -> torch.Tensor:
        n, B, H, _ = self.shape
        J = self.f.new_zeros((n // 2, 2, B, H, H))
        J[:, 0].diagonal(dim1=-2, dim2=-1).copy_(self.lanes(0).permute(0, 2, 1))
        J[:, 1] = self.W_hh.t()
        return J.view(n, B, H, H)  # as rnn_jacobians_t(h, W_hh, "paper")


class GruChain(FactoredChain):
    """The GRU's chain (Appendix E), ``J_k = Σ_g W_hgᵀ diag(c_g) + diag(z)`` for the gates g = r, z, n:
    ``W_hh`` and the factors (c_r, c_z, c_n, z, e = (1 - z)(1 - n²)) in scan order; ``e`` and the c's
    also turn ∇h into the gates' gradients (dR, dZ, dN, dM), the rows of the kernel's sums."""

    kind, NF, NW = "gru", 5, 3

    def __init__(self, W_hh: torch.Tensor, f: torch.Tensor, I: int = 0, fill=None):
        super().__init__(W_hh, f, f.shape[0], I, fill)

    @classmethod
    def from_states(cls, x: torch.Tensor, h: torch.Tensor, cell, out: torch.Tensor | None = None) -> GruChain:
        """From the forward's inputs ``x`` and states ``h`` (time order) and ``cell`` (its torch.nn.GRU): the
        gates recomputed and the factors written by one compiled pass (:class:`bppsa.backends.cpu.native.GruFill`),
        left for the first reader (the scan's team writes it, in units of steps), or by torch without
        the kernel; ``out``: a [T, 6H + I, B] buffer, used where its shape fits."""
        T, B, H = h.shape
        I = x.shape[2]
        f = _factor_buffer(h, 6 * H + I, out)
        h, x = h.detach().contiguous(), x.detach().contiguous()
        if h.device.type == "cpu" and native.available() and native.library("gru", H, I, 1, h.dtype) is not None:
            return cls(cell.weight_hh_l0, f, I, native.GruFill(x, h, cell, f))
        from ...jacobians.gru import gru_gates

        c = cell
        g = gru_gates(x, h, c.weight_ih_l0, c.weight_hh_l0, c.bias_ih_l0, c.bias_hh_l0)
        e = (1 - g.z) * (1 - g.n * g.n)
        for i, t in enumerate((e * g.M * g.r * (1 - g.r), (g.hp - g.n) * g.z * (1 - g.z), e * g.r, g.z, e)):
            f[:, i * H:(i + 1) * H].copy_(t.flip(0).permute(0, 2, 1))
        FactoredChain._fill(f, 5, H, x, h)
        return cls(cell.weight_hh_l0, f, I)

    def dense(self) -> torch.Tensor:
        c = [self.lanes(i).permute(0, 2, 1).unsqueeze(-2) for i in range(4)]  # [T, B, 1, H]: column scalings
        J = torch.mul(self.Wt[0], c[0])
        J.addcmul_(self.Wt[1], c[1])
        J.addcmul_(self.Wt[2], c[2])
        J.diagonal(dim1=-2, dim2=-1).add_(self.lanes(3).permute(0, 2, 1))
        return J  # as bppsa.jacobians.gru.gru_jacobians_t

    def grad_layout(self):
        H, I = self.shape[2], self.I
        rzm = (slice(0, 2 * H), slice(3 * H, 4 * H))  # (dR, dZ, dM): the recurrent affine map's gradient
        return [("weight_ih_l0", (3 * H, I), [(slice(0, 3 * H), slice(0, I))]),
                ("bias_ih_l0", (3 * H,), [(slice(0, 3 * H), slice(I, I + 1))]),
                ("weight_hh_l0", (3 * H, H), [(r, slice(I + 1, I + 1 + H)) for r in rzm]),
                ("bias_hh_l0", (3 * H,), [(r, slice(I, I + 1)) for r in rzm])]


def synthetic(kind: str, n: int, B: int, H: int, I: int, dtype: torch.dtype):
    """A chain of ``kind`` (n Jacobians, batch B, hidden H, input I) with well-scaled random values, and ∇h_T."""
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(3 * H if kind == "gru" else H, H, generator=g) * (0.9 / H ** 0.5)).to(dtype)
    T = n // 2 if kind == "paper" else n
    if kind == "gru":
        chain = GruChain(W, (torch.rand(T, 6 * H + I, B, generator=g) * 0.5).to(dtype), I)
    else:
        h = (torch.rand(T, B, H, generator=g) * 1.8 - 0.9).to(dtype)
        x = torch.rand(T, B, I, generator=g).to(dtype)
        chain = (RnnChain if kind == "rnn" else PaperChain).from_states(h, W, x)
    return chain, torch.randn(B, H, generator=g).to(dtype)


def native_chain_scan(g, chain: FactoredChain, L: int, ws: _scan.Workspace, split: str = "auto",
                      grads: bool = False, c: torch.Tensor | None = None):
    """The scan over a :class:`FactoredChain` by the compiled kernel (:mod:`.native`); None where it is
    unavailable.  ``g``: ∇h_T, or the callable that returns it.  ``grads``: instead of the scan, the cell's
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
    team = ws.memo(("cpu", "team", chain.kind, n, B, H, chain.I, chain.dtype, L, split, grads, threads, affine),
                   lambda: plan.team_for(chain, L, split, grads, threads, affine))
    if team is None:
        return None
    dtype = chain.dtype
    g = grad_of(g)
    g = g if g.is_contiguous() else g.contiguous()
    out = None if grads else torch.empty((n, B, H), dtype=dtype)
    if n == 0:
        return out
    fill = chain.claim_fill() if chain.states is None else None
    if fill is not None and not isinstance(fill, native.GruFill):
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
    [pairs·B, H] × [H, H²] GEMM (torch's BLAS on all threads: ~150 GFLOP/s per core here against
    ~50 for stacked 20×20 products), then a column scaling by b.  The levels above are the scan of
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
