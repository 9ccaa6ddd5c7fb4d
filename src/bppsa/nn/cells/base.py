"""What every recurrent cell of :mod:`bppsa.nn` is made of: the records a layer's backward passes around
(:class:`Weights`, :class:`Saved`, :class:`Incoming`) and the contract of a cell (:class:`Cell`).

A cell class owns everything that differs between cells: its gate count and its forward (torch's own kernel for
the whole sequence), its gates from the saved states, its transposed Jacobian (how each backend builds its chain:
:meth:`Cell.chain` calls the backend's method for this cell) and its gates' gradients from the states' gradients
(:meth:`Cell.preact_grads`).  The backward itself (:mod:`bppsa.nn.backward`) never asks which cell it runs.

The scan's state is ``s = h`` (P values: the hidden size, or the LSTM's ``proj_size``), or ``s = [h; c]`` for a
cell with a cell state (the LSTM: P + H values).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

NAMES = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_hr_l0")  # the gradients' keys


@dataclass(frozen=True)
class Weights:
    """One layer's tensors in one direction, as torch.nn holds them (``w_hr``: the LSTM's projection)."""

    w_ih: torch.Tensor
    w_hh: torch.Tensor
    b_ih: torch.Tensor | None = None
    b_hh: torch.Tensor | None = None
    w_hr: torch.Tensor | None = None

    @property
    def bias(self) -> bool:
        return self.b_ih is not None

    @property
    def out_size(self) -> int:
        """P: the size of h (the recurrent input)."""
        return self.w_hh.shape[1]

    def tensors(self) -> tuple:
        """In the order of :data:`NAMES` (None where there is none)."""
        return self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr

    def torch_params(self) -> list[torch.Tensor]:
        """The flat weights torch's recurrent kernels take (torch.nn's ``_flat_weights`` of one layer)."""
        return [t for t in (self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr) if t is not None]


@dataclass(frozen=True)
class Saved:
    """What the forward keeps for the backward: ``x`` [T, B, I], the states ``h`` [T, B, P] (h_1 .. h_T) and, for a
    cell with a cell state, ``c`` [T, B, H], the steps past a sequence's end carrying its state; the initial states
    (None: zero) and ``valid`` [T, B] (None: every step runs).  ``memo`` keeps what a cell recomputes from it (its
    gates) for whoever asks next."""

    x: torch.Tensor
    h: torch.Tensor
    c: torch.Tensor | None = None
    h0: torch.Tensor | None = None
    c0: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def T(self) -> int:
        return self.h.shape[0]

    def block(self, t0: int, t1: int) -> Saved:
        """Steps t0 .. t1 - 1, their initial states the states before them."""
        if t0 == 0:
            h0, c0 = self.h0, self.c0
        else:
            h0, c0 = self.h[t0 - 1], None if self.c is None else self.c[t0 - 1]
        return Saved(self.x[t0:t1], self.h[t0:t1], None if self.c is None else self.c[t0:t1], h0, c0,
                     None if self.valid is None else self.valid[t0:t1])

    def prev_h(self) -> torch.Tensor:
        """h_{t-1} for every step, [T, B, P]."""
        first = self.h.new_zeros(self.h.shape[1:]) if self.h0 is None else self.h0
        return torch.cat([first.unsqueeze(0), self.h[:-1]])


@dataclass(frozen=True)
class Incoming:
    """The gradients of a layer's outputs (None: no loss reads it): ∂l/∂h_t [T, B, P], ∂l/∂h_n [B, P] and, for a
    cell with a cell state, ∂l/∂c_n [B, H]."""

    h: torch.Tensor | None = None
    h_n: torch.Tensor | None = None
    c_n: torch.Tensor | None = None


@dataclass(frozen=True)
class Needs:
    """Which gradients besides the weights' are asked for: the input's, the initial states'."""

    x: bool = False
    state0: bool = False


class Cell:
    """One kind of recurrent cell: the contract (see the module's docstring).  Subclasses are stateless and used as
    instances (:data:`bppsa.nn.cells.CELLS`)."""

    name: str  # the op's name (bppsa::<name>) and the key of CELLS
    kind: str  # the chain kind a backend scans ("rnn", "gru", "lstm": Backend.scanner)
    kernel: str  # the forward kernel's name: torch's (torch.<kernel>) and a backend's (Backend.forward)
    gates: int  # gate blocks of H rows in weight_ih / weight_hh
    torch_cls: type  # the torch.nn module it stands in for
    layouts = ("fused",)  # the chains' layouts it has (the RNN also the paper's)
    cell_state = False  # whether the state carries a cell state c beside h (the LSTM)
    # The sliced forward's meeting criterion (bppsa.nn.forward): two trajectories from different starts meet where
    # they agree within this many units in the last place (relative to the state's largest unit), 0 bitwise, which
    # the GRU's, the LSTM's and a relu RNN's reach within a few hundred steps
    meet_ulps = 0

    def meet_tol(self, dtype: torch.dtype) -> float:
        return self.meet_ulps * torch.finfo(dtype).eps

    def hidden(self, w: Weights) -> int:
        """H, the size of the gates."""
        return w.w_ih.shape[0] // self.gates

    def state_size(self, w: Weights) -> int:
        return w.out_size + (self.hidden(w) if self.cell_state else 0)

    # -- the forward --------------------------------------------------------------------------------
    def torch_run(self, x, state0: tuple, w: Weights, batch_sizes=None):
        """``(output, finals)`` of one layer by torch's own recurrent kernel (cuDNN on a GPU), as torch.nn calls it:
        ``x`` [T, B, I] (or a PackedSequence's data with its ``batch_sizes``), ``state0``: ``(hx,)`` or
        ``(hx, cx)``, each [1, B, ·]; ``finals`` the same.  Differentiable by autograd: the harness's baseline
        trains through it, the layers' forward runs it without a graph.  cuDNN keeps what its backward needs only
        in training mode, so that is the mode wherever autograd records (no dropout here: the same numbers)."""
        raise NotImplementedError  # pragma: no cover - abstract

    @torch.no_grad()
    def forward(self, x: torch.Tensor, h0, c0, w: Weights, lengths) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The states h [T, B, P] (and c [T, B, H] for a cell state) from h0 (and c0; None: zero), by torch's own
        kernels (cuDNN on a GPU), the steps past each sequence's end carrying its last state: the twin a backend's
        own forward (:func:`bppsa.nn.forward.layer_forward`) is held to."""
        T, B, _ = x.shape
        state0 = self.initial_states(x, h0, c0, w)
        if lengths is None or bool((lengths == T).all()):
            out, finals = self.torch_run(x, state0, w)
            return out.contiguous(), self.cell_states(x, out, state0, w, None)
        # the packed path, as torch.nn runs a PackedSequence: the same kernels, the same numbers
        nn_rnn = torch.nn.utils.rnn
        packed = nn_rnn.pack_padded_sequence(x, lengths.cpu(), enforce_sorted=False)
        data, _ = self.torch_run(packed.data, tuple(s.index_select(1, packed.sorted_indices) for s in state0), w,
                                 packed.batch_sizes)
        out, _ = nn_rnn.pad_packed_sequence(packed._replace(data=data), total_length=T)
        last = torch.minimum(torch.arange(T, device=x.device)[:, None], (lengths.to(x.device) - 1)[None, :])
        h = out.gather(0, last.unsqueeze(-1).expand(T, B, out.shape[-1])).contiguous()
        valid = torch.arange(T, device=x.device)[:, None] < lengths.to(x.device)[None, :]
        return h, self.cell_states(x, h, state0, w, valid)

    def initial_states(self, x, h0, c0, w: Weights) -> tuple:
        """``(hx,)`` or ``(hx, cx)`` as torch's kernels take them ([1, B, ·] each), zero where None."""
        B = x.shape[1]
        hx = (h0 if h0 is not None else x.new_zeros(B, w.out_size)).unsqueeze(0).contiguous()
        if not self.cell_state:
            return (hx,)
        return hx, (c0 if c0 is not None else x.new_zeros(B, self.hidden(w))).unsqueeze(0).contiguous()

    def cell_states(self, x, h, state0: tuple, w: Weights, valid) -> torch.Tensor | None:
        """The cell states c_1 .. c_T a cell state's backward needs and torch's kernels do not return (None for a
        cell without one)."""
        return None

    # -- the backward's pieces ----------------------------------------------------------------------
    def saved_gates(self, s: Saved, w: Weights):
        """The cell's gates recomputed from the saved states, once per :class:`Saved` (None: it has none)."""
        if "gates" not in s.memo:
            s.memo["gates"] = self._gates(s, w)
        return s.memo["gates"]

    def _gates(self, s: Saved, w: Weights):
        return None

    def chain(self, be, s: Saved, w: Weights, layout: str = "fused", with_x: bool = False):
        """``be``'s transposed Jacobians of the steps in scan order (dense ``[T, B, S, S]``, or kept as factors by
        a fast path; ``with_x``: a factored chain also keeps the inputs, for the weights' gradients summed as it
        scans).  The first step's Jacobian, which the exclusive scan never applies, may assume zero initial
        states."""
        raise NotImplementedError  # pragma: no cover - abstract

    def block_values(self, s: Saved, w: Weights) -> int:
        """Values a step of :meth:`block_steps`' chain holds (a dense Jacobian: S² a batch element)."""
        S = self.state_size(w)
        return s.h.shape[1] * S * S

    def block_steps(self, twin, s: Saved, w: Weights):
        """The steps' transposed Jacobians in scan order as ``(chain, step)``: ``step(chain, j, A)`` gives ``J_j A``
        for maps ``A`` [..., B, S, K] (``J_j`` itself, dense, for ``A`` None) from ``chain`` or a view of it cut
        along its steps.  Here the twin's dense chain (its Jacobians exact from the state before the block);
        a cell whose Jacobian factors more cheaply says so."""
        J = self.chain(twin, s, w)
        # (J_j itself copied: the twin's workspace holds the chain, and the next block's overwrites it)
        return J, lambda J, j, A: J[j].clone() if A is None else torch.matmul(J[j], A)

    def states_grads(self, scan: torch.Tensor, layout: str) -> torch.Tensor:
        """The states' total gradients in scan order ([T, B, S]: λ at step T - k) from a scan's output (the RNN's
        paper layout interleaves ∇a_t)."""
        return scan

    def preact_grads(self, s: Saved, w: Weights, lam: torch.Tensor):
        """From the states' total gradients ``lam`` [T, B, S] (time order): ``(gi, gh, direct0, extra)`` -- the
        gradients of ``W_ih x + b_ih`` and of ``W_hh h' + b_hh`` [T, B, G·H] (zero past a sequence's end is the
        caller's), the gradient of the initial state that does not pass through W_hh ([B, S]; None: none), and
        the gradients of any other weight (``{name: tensor}``).  ``lam`` is zero past each sequence's end, so these
        are too (they are linear in it)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def grads(self, s: Saved, w: Weights, lam: torch.Tensor, need: Needs):
        """``(dx, dstate0, {weight: gradient})`` from the states' total gradients ``lam`` (time order): the gates'
        gradients (:meth:`preact_grads`), zero past each sequence's end, then GEMMs over the T·B rows.  ``dstate0``
        is the initial state's gradient [B, S] where ``need.state0`` asks for it."""
        T, B = s.h.shape[:2]
        if s.valid is not None:  # a step past a sequence's end only carries its state: no gate gets a gradient
            lam = lam * s.valid.unsqueeze(-1)
        gi, gh, direct0, extra = self.preact_grads(s, w, lam)
        gi2, gh2 = gi.reshape(T * B, -1), gh.reshape(T * B, -1)
        grads = {"weight_ih_l0": gi2.t() @ s.x.reshape(T * B, -1),
                 "weight_hh_l0": gh2.t() @ s.prev_h().reshape(T * B, -1),
                 "bias_ih_l0": gi2.sum(0), "bias_hh_l0": gh2.sum(0), **extra}
        dx = (gi2 @ w.w_ih).view(s.x.shape) if need.x else None
        dstate0 = None
        if need.state0:
            dh0 = gh[0] @ w.w_hh
            if self.cell_state:
                dh0 = torch.cat([dh0, dh0.new_zeros((B, self.hidden(w)))], -1)
            dstate0 = dh0 if direct0 is None else dh0 + direct0
        return dx, dstate0, grads

    def extra_names(self, w: Weights) -> tuple[str, ...]:
        """The weights beyond W_ih, W_hh and the biases whose gradients :meth:`preact_grads` gives."""
        return ()

    # -- the state vector -------------------------------------------------------------------------------
    def state(self, h_part: torch.Tensor, c_part: torch.Tensor | None) -> torch.Tensor:
        """The scan's state vector from its parts (``c_part``: None for a cell without a cell state)."""
        return h_part if not self.cell_state else torch.cat([h_part, c_part], -1)

    def split_state(self, s: torch.Tensor, w: Weights) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(h part, c part or None)`` of a state vector."""
        if not self.cell_state:
            return s, None
        P = w.out_size
        return s[..., :P], s[..., P:]

    def saved_states(self, s: Saved) -> torch.Tensor:
        """Every step's state vector [T, B, S]."""
        return self.state(s.h, s.c)


def replace(s: Saved, **changes) -> Saved:
    """``s`` with some fields changed and nothing remembered (its memo belongs to the old one)."""
    return dataclasses.replace(s, memo={}, **changes)
