"""The recurrent chains kept as their factors, never built: what the CPU's and the GPU's factored kernels scan.

:class:`FactoredChain` (:class:`RnnChain` and :class:`PaperChain` for the RNN's two layouts, :class:`GruChain`)
keeps a chain as its weights and per-step factors, in lane order, beside the inputs the parameter gradients
need; :meth:`~FactoredChain.dense` is the chain of per-step Jacobians it stands for.  Here the factors are
written by torch; a backend with a kernel of its own may instead hand the chain the forward's states
(``states``, read by the kernel as it scans) or a writer left for later (``fill``):
:mod:`bppsa.backends.cpu.chain` does both.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..jacobians.gru import gru_gates
from ..jacobians.lstm import LstmGates, lstm_factors
from ..jacobians.recurrent import derivative


class FactoredChain:
    """A chain of transposed Jacobians kept as its weights ``Wt`` [NW, H, H] (transposed) and per-step
    factors ``f`` [steps, NR, B] (lane order: the compiled kernel reads each row's batch lanes side by
    side), the kinds of ``chain_scan.c``, instead of n·B dense H×H matrices: what
    :class:`~bppsa.backends.cpu.CpuBackend` builds.  The last I + H rows of a step are x_t and h' = h_{t-1},
    for the parameter gradients the kernel accumulates as it scans (zero rows where the chain was built
    without x, ``I = 0``).  It stands where a dense chain ``[n, B, H, H]`` would (``shape``, ``dim()``);
    :meth:`dense` is that chain (the LSTM's state is [h; c]: ``shape`` [n, B, 2H, 2H], :attr:`hidden` H).
    ``states``, where given (the RNN's chains, the compiled kernel at hand): the forward's states h [T, B, H]
    and inputs x [T, B, I] (contiguous), from which the kernel reads each step's factors as it scans it; ``f``
    is then None, the factors written only where :attr:`f` is read (a training step never does).
    ``fill(k0, k1)``, where given, writes the factors of steps [k0, k1) later:
    :attr:`f` runs it on first use, or the scan's threads take it (:meth:`claim_fill`)."""

    kind: str
    NF: int  # rows of H factors per step before x and h'
    NW = 1  # weight matrices
    STATE = 1  # the scan's state in hidden sizes: the LSTM's is [h; c]

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
        self.hidden = H  # the cell's hidden size; the state (shape[2]) is STATE times it
        self.shape = torch.Size((n, B, self.STATE * H, self.STATE * H))
        self.dtype, self.device = dtype, device

    @property
    def W_hh(self) -> torch.Tensor:
        """The recurrent weights [NW·H, H] (the compiled kernel transposes them itself)."""
        return self._W.detach()

    @functools.cached_property
    def Wt(self) -> torch.Tensor:
        """The weights transposed, [NW, H, H] (contiguous): Wt[g] = W_hg^T."""
        H = self.hidden
        return self.W_hh.reshape(self.NW, H, H).transpose(1, 2).contiguous()

    @property
    def f(self) -> torch.Tensor:
        """The factors [steps, NR, B], written first where they were left for later (``fill(0, steps)``: a
        backend's writer may spread the steps over its threads itself)."""
        if self._f is None:
            self._f = self._written_f()
        fill = self.claim_fill()
        if fill is not None:
            fill(0, self._f.shape[0])
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

    def lanes(self, i: int) -> torch.Tensor:
        """Factor i ([steps, H, B]) of every step."""
        H = self.hidden
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


def factor_buffer(h: torch.Tensor, rows: int, out) -> torch.Tensor:
    """``out`` where its shape fits (a callable: what it returns for the shape), else a new buffer."""
    T, B, _ = h.shape
    out = out((T, rows, B)) if callable(out) else out
    return out if out is not None and tuple(out.shape) == (T, rows, B) else h.new_empty((T, rows, B))


def rnn_factors(h: torch.Tensor, x: torch.Tensor | None, out=None, act: str = "tanh") -> torch.Tensor:
    """The RNN's factors d_k = 1 - h_{T-k}² (relu: 1[h_{T-k} > 0]), then x and h' in scan order and lane order,
    [T, 2H + I, B], written by torch into ``out`` where its shape fits (or a callable that returns a buffer for a
    shape)."""
    T, B, H = h.shape
    I = 0 if x is None else x.shape[2]
    f = factor_buffer(h, 2 * H + I, out)
    h = h.detach()
    hf = h.flip(0)
    d = f[:, :H].permute(0, 2, 1)
    if act == "tanh":
        torch.sub(torch.ones((), dtype=h.dtype), hf * hf, out=d)  # as 1 - h * h, bit for bit
    else:
        d.copy_(derivative(hf, act))
    FactoredChain._fill(f, 1, H, x, h)
    return f


def _steps(f: torch.Tensor | None, states) -> int:
    return (states[0] if f is None else f).shape[0]


class _RnnParams:
    """The tanh RNN's factors, written from its states where something reads them, and its parameter gradients
    from a kernel's sums: rows ∇a, columns (x, 1, h')."""

    act = "tanh"  # the nonlinearity whose derivative the factors d hold ("relu": 1[h > 0])

    def _written_f(self) -> torch.Tensor:
        h, x = self.states
        return rnn_factors(h, x, act=self.act)

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

    def __init__(self, W_hh: torch.Tensor, f: torch.Tensor | None, I: int = 0, states=None, act: str = "tanh"):
        super().__init__(W_hh, f, _steps(f, states), I, states=states)
        self.act = act

    @property
    def d_lanes(self) -> torch.Tensor:
        return self.lanes(0)

    @property
    def d(self) -> torch.Tensor:
        return self.d_lanes.permute(0, 2, 1)  # [T, B, H], a view

    @classmethod
    def from_states(cls, h: torch.Tensor, W_hh: torch.Tensor, x: torch.Tensor | None = None,
                    out=None, act: str = "tanh") -> RnnChain:
        """From the forward's states ``h`` [T, B, H] and inputs ``x`` [T, B, I] (None: the scan only), the
        factors written by torch (:func:`rnn_factors`; ``out``: their buffer where its shape fits, or a callable
        that returns one for a shape).  A backend whose kernel reads the states itself passes ``states``."""
        return cls(W_hh, rnn_factors(h, x, out, act), 0 if x is None else x.shape[2], act=act)

    def dense(self) -> torch.Tensor:
        return self.W_hh.t() * self.d.unsqueeze(-2)  # as rnn_jacobians_t(h, W_hh, "fused")


class PaperChain(_RnnParams, FactoredChain):
    """The paper layout of a tanh RNN, two Jacobians per step: ``J_2k = diag(d_k)``, ``J_2k+1 = W_hhᵀ``
    (the factors are the fused chain's)."""

    kind, NF = "paper", 1

    def __init__(self, W_hh: torch.Tensor, f: torch.Tensor | None, I: int = 0, states=None, act: str = "tanh"):
        super().__init__(W_hh, f, 2 * _steps(f, states), I, states=states)
        self.act = act

    @classmethod
    def from_states(cls, h: torch.Tensor, W_hh: torch.Tensor, x: torch.Tensor | None = None,
                    out=None, act: str = "tanh") -> PaperChain:
        return cls(W_hh, rnn_factors(h, x, out, act), 0 if x is None else x.shape[2], act=act)

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
    def from_states(cls, x: torch.Tensor, h: torch.Tensor, cell, out=None) -> GruChain:
        """From the forward's inputs ``x`` and states ``h`` (time order) and ``cell`` (its torch.nn.GRU): the gates
        recomputed and the factors written by torch; ``out``: a [T, 6H + I, B] buffer, used where its shape fits."""
        T, B, H = h.shape
        I = x.shape[2]
        f = factor_buffer(h, 6 * H + I, out)
        h, x = h.detach().contiguous(), x.detach().contiguous()
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


class LstmStates(NamedTuple):
    """What a compiled LSTM gate pass reads beside x and h (:class:`bppsa.backends.cpu.native.LstmFill`): the cell
    states ``c`` [T, B, H] (c_1 .. c_T), the cell's ``W_ih`` [4H, I] and biases [4H] (None: none), and h_0, c_0
    [B, H] (None: zero)."""

    c: torch.Tensor
    W_ih: torch.Tensor
    b_ih: torch.Tensor | None = None
    b_hh: torch.Tensor | None = None
    h0: torch.Tensor | None = None
    c0: torch.Tensor | None = None


class LstmChain(FactoredChain):
    """The LSTM's chain without projection (:mod:`bppsa.jacobians.lstm`), over the state s = [h; c] (2H wide)::

        J_k = [[Σ_{q=i,f,g} W_hqᵀ diag(c_q a) + W_hoᵀ diag(co),   Σ_{q=i,f,g} W_hqᵀ diag(c_q)],
               [diag(f a),                                         diag(f)                    ]]

    ``W_hh`` [4H, H] (Wt[q] = W_hqᵀ, q = i, f, g, o) and the factors (a, ci, cf, cg, co, f) in scan order (step k is
    t = T - k), then x_t and h' = h_{t-1} (h_0 at the first step, whatever it is).  The gates' gradients are
    ``dpre_{i,f,g} = c_{i,f,g} ⊙ dc`` with ``dc = λ_c + a ⊙ λ_h``, and ``dpre_o = co ⊙ λ_h``: the rows of the
    kernel's sums, whose columns (x, 1, h') give every parameter's gradient."""

    kind, NF, NW, STATE = "lstm", 6, 4, 2

    def __init__(self, W_hh: torch.Tensor, f: torch.Tensor, I: int = 0, fill=None):
        super().__init__(W_hh, f, f.shape[0], I, fill)

    @classmethod
    def from_states(cls, x: torch.Tensor | None, gates: LstmGates, W_hh: torch.Tensor, out=None) -> LstmChain:
        """From the forward's inputs ``x`` [T, B, I] (None: the scan only, no x kept) and the recomputed ``gates``
        (:func:`bppsa.jacobians.lstm.lstm_gates`, time order; their ``hp`` holds h_0), the factors written by
        torch (:func:`~bppsa.jacobians.lstm.lstm_factors`); ``out``: a [T, 7H + I, B] buffer (or a callable that
        returns one for a shape), used where its shape fits."""
        T, B, H = gates.f.shape
        if tuple(W_hh.shape) != (4 * H, H) or gates.hp.shape[-1] != H:
            raise ValueError(f"LstmChain: weight_hh {tuple(W_hh.shape)} and h' {tuple(gates.hp.shape)} do not fit "
                             f"hidden size {H} without projection")
        I = 0 if x is None else x.shape[2]
        f = factor_buffer(gates.f, 7 * H + I, out)
        for i, t in enumerate(lstm_factors(gates)):
            f[:, i * H:(i + 1) * H].copy_(t.detach().flip(0).permute(0, 2, 1))
        if I:
            f[:, 6 * H:6 * H + I].copy_(x.detach().flip(0).permute(0, 2, 1))
        f[:, 6 * H + I:].copy_(gates.hp.detach().flip(0).permute(0, 2, 1))
        return cls(W_hh.detach(), f, I)

    def dense(self) -> torch.Tensor:
        n, B, S, _ = self.shape
        H = self.hidden
        a, ci, cf, cg, co, f = (self.lanes(i).permute(0, 2, 1).unsqueeze(-2) for i in range(6))  # column scalings
        Wt = self.Wt
        J = self.f.new_zeros((n, B, S, S))
        top_right = torch.mul(Wt[0], ci)  # in the order of bppsa.jacobians.lstm.lstm_jacobians_t: the same bits
        top_right.addcmul_(Wt[1], cf)
        top_right.addcmul_(Wt[2], cg)
        top_left = torch.mul(top_right, a)
        top_left.addcmul_(Wt[3], co)
        J[..., :H, :H] = top_left
        J[..., :H, H:] = top_right
        J[..., H:, :H].diagonal(dim1=-2, dim2=-1).copy_((f * a).squeeze(-2))
        J[..., H:, H:].diagonal(dim1=-2, dim2=-1).copy_(f.squeeze(-2))
        return J

    def grad_layout(self):
        H, I = self.hidden, self.I
        rows = slice(0, 4 * H)  # dpre (i, f, g, o): both biases take its sums
        bias = [(rows, slice(I, I + 1))]
        return [("weight_ih_l0", (4 * H, I), [(rows, slice(0, I))]), ("bias_ih_l0", (4 * H,), bias),
                ("bias_hh_l0", (4 * H,), bias), ("weight_hh_l0", (4 * H, H), [(rows, slice(I + 1, I + 1 + H))])]
