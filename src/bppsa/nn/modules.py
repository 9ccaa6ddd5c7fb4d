"""``bppsa.nn.RNN``, ``bppsa.nn.GRU`` and ``bppsa.nn.LSTM``: drop-ins for torch.nn's whose backward is BPPSA.

Same constructor, call, parameter names, initialisation and state dict as torch's; each layer and direction is one
op of :mod:`.ops`, chained by autograd, with dropout between layers.  The reverse direction of a bidirectional
layer is its own scan: the same op on each sequence reversed (from its last valid step, as torch's), its states
reversed back.  They subclass ``nn.Module``, not ``nn.RNNBase``, whose flattened cuDNN weights and Python-side
checks torch.compile would break the graph on.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..backends import BACKENDS
from ..distributed import GroupRef
from . import ops, split
from .backward import AUTO, Options, no_autocast, valid_steps
from .cells import CELLS, Cell, Weights
from .forward import take_stats

HALF = (torch.float16, torch.bfloat16)


class _Recurrent(nn.Module):
    """What the RNN, the GRU and the LSTM share: options, refusals, parameters, the layer loop, conversions."""

    cell: Cell

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, device=None,
                 dtype=None, *, proj_size: int = 0, backend: str = "auto", layout: str = "fused",
                 L_m: int | str | None = "auto", parallel_forward: bool | None = None, process_group=None,
                 group_timeout: float | None = None):
        super().__init__()
        name = type(self).__name__
        if proj_size and self.cell.torch_cls is not nn.LSTM:
            raise ValueError(f"bppsa.nn.{name}: proj_size={proj_size} is not supported (torch.nn has it for LSTM "
                             "only); use proj_size=0")
        if not isinstance(proj_size, int) or proj_size < 0 or proj_size >= hidden_size > 0 and proj_size:
            raise ValueError(f"bppsa.nn.{name}: proj_size must be an int in [0, hidden_size), got {proj_size!r}")
        if dtype in HALF:
            raise TypeError(f"bppsa.nn.{name}: dtype={dtype} (half precision) is not supported: float32 and "
                            "float64 are; under autocast the layer runs in float32")
        if num_layers < 1 or hidden_size < 1 or input_size < 1:
            raise ValueError(f"bppsa.nn.{name}: input_size, hidden_size and num_layers must be >= 1 (got "
                             f"{input_size}, {hidden_size}, {num_layers})")
        if not 0 <= dropout <= 1 or isinstance(dropout, bool):
            raise ValueError(f"bppsa.nn.{name}: dropout must be a probability in [0, 1], got {dropout}")
        if backend not in BACKENDS:
            raise ValueError(f"bppsa.nn.{name}: unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")
        if layout not in self.cell.layouts:
            raise ValueError(f"bppsa.nn.{name}: unknown layout '{layout}' (choose from {', '.join(self.cell.layouts)})")
        if L_m not in (None, "auto") and (not isinstance(L_m, int) or isinstance(L_m, bool) or L_m < 0):
            raise ValueError(f"bppsa.nn.{name}: L_m must be 'auto' (the backend's choice), None (the full tree) or an "
                             f"int >= 0, got {L_m!r}")
        if process_group is not None and layout != "fused":
            raise ValueError(f"bppsa.nn.{name}: process_group runs the fused layout only, got layout='{layout}'")
        if process_group is not None and bidirectional:
            raise ValueError(f"bppsa.nn.{name}: bidirectional=True with a process_group is not supported: the reverse "
                             "direction starts at each sequence's own last step, which lies on another rank for each "
                             "length, so its slices would have to be exchanged between the ranks; split a "
                             "unidirectional layer, or run the bidirectional one in one process")
        if parallel_forward not in (None, True, False):
            raise ValueError(f"bppsa.nn.{name}: parallel_forward must be None (where it pays), True or False, got "
                             f"{parallel_forward!r}")
        if group_timeout is not None and not group_timeout > 0:
            raise ValueError(f"bppsa.nn.{name}: group_timeout must be a positive number of seconds, got "
                             f"{group_timeout}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bool(bidirectional), proj_size
        self.backend, self.layout, self.L_m = backend, layout, L_m
        # the forward split over slices of the sequence (bppsa.nn.forward; docs/library.md), and what its last call did
        self.parallel_forward, self.forward_stats = parallel_forward, []
        # the sequence split over the ranks of a torch.distributed group (bppsa.nn.split; docs/distributed.md)
        self.process_group, self.group_timeout = process_group, group_timeout
        kw = {"device": device, "dtype": dtype}
        G, P = self.cell.gates * hidden_size, proj_size or hidden_size
        for k in range(num_layers):
            size = input_size if k == 0 else P * self.directions
            for sfx in self._suffixes():  # torch.nn's order: per layer, per direction
                setattr(self, f"weight_ih_l{k}{sfx}", nn.Parameter(torch.empty(G, size, **kw)))
                setattr(self, f"weight_hh_l{k}{sfx}", nn.Parameter(torch.empty(G, P, **kw)))
                if bias:
                    setattr(self, f"bias_ih_l{k}{sfx}", nn.Parameter(torch.empty(G, **kw)))
                    setattr(self, f"bias_hh_l{k}{sfx}", nn.Parameter(torch.empty(G, **kw)))
                if proj_size:
                    setattr(self, f"weight_hr_l{k}{sfx}", nn.Parameter(torch.empty(proj_size, hidden_size, **kw)))
        self.reset_parameters()

    @property
    def directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _suffixes(self) -> tuple[str, ...]:
        return ("", "_reverse")[:self.directions]

    @property
    def process_group(self):
        """The torch.distributed group the sequence is split over (None: one process), held weakly
        (:class:`bppsa.distributed.GroupRef`): a layer kept after ``destroy_process_group`` does not keep its group,
        and the group's threads, alive into the interpreter's shutdown."""
        return None if self._group is None else self._group()

    @process_group.setter
    def process_group(self, group) -> None:
        self._group = None if group is None else GroupRef(group)

    def reset_parameters(self) -> None:
        """torch.nn's initialisation: every weight uniform in ±1/√hidden_size."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def flatten_parameters(self) -> None:
        """Nothing to do (torch.nn's cuDNN weight packing): here so that code written for torch.nn runs."""

    def layer_weights(self, k: int, reverse: bool = False) -> Weights:
        """Layer k's tensors in one direction (torch.nn's names, ``_reverse`` for the reverse direction)."""
        sfx = "_reverse" if reverse else ""

        def get(name):
            return getattr(self, f"{name}_l{k}{sfx}", None)

        return Weights(get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"), get("weight_hr"))

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        for key, default in (("bias", True), ("batch_first", False), ("dropout", 0.0), ("bidirectional", False),
                             ("proj_size", 0)):
            if getattr(self, key) != default:
                s += f", {key}={getattr(self, key)}"
        return s + f", backend={self.backend!r}, layout={self.layout!r}, L_m={self.L_m!r}, " \
                   f"parallel_forward={self.parallel_forward}"

    # -- the call ---------------------------------------------------------------------------------
    def forward(self, input, hx=None, *, lengths=None):
        """``(output, h_n)`` (the LSTM: ``(output, (h_n, c_n))``) as torch.nn returns them, for a tensor ([T, B, I],
        [B, T, I] with ``batch_first``, or unbatched [T, I]) or a PackedSequence.  ``lengths`` (a tensor or list of
        B ints in [1, T]) marks a padded batch's sequence lengths, like a PackedSequence: ``output`` is zero past
        each sequence's end and ``h_n`` holds each one's last valid state."""
        name = type(self).__name__
        packed = isinstance(input, PackedSequence)
        if packed and self.process_group is not None:
            raise ValueError(f"bppsa.nn.{name}: with a process_group, pass this rank's slice of a padded batch and "
                             "lengths= (the whole sequences' lengths), not a PackedSequence")
        if packed:
            if lengths is not None:
                raise ValueError("bppsa.nn: a PackedSequence carries its lengths; do not pass lengths= too")
            x, lengths = pad_packed_sequence(input)
        else:
            x = input
        states = self._states(hx)
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(1)
            states = tuple(s.unsqueeze(1) if s is not None else None for s in states)
        elif x.dim() != 3:
            raise ValueError(f"bppsa.nn.{name}: expected a 2-D or 3-D input, got {x.dim()}-D")
        elif self.batch_first and not packed:
            x = x.transpose(0, 1)
        if torch.is_autocast_enabled(x.device.type):  # runs in fp32, as the docs say (the weights are fp32)
            x = x.float()
            states = tuple(s.float() if s is not None else None for s in states)
        self._check_dtype(x)
        if lengths is not None:
            lengths = torch.as_tensor(lengths, dtype=torch.int64).cpu()
        self._check_states(states, x.shape[1])
        out, finals = self._layers(x, states, lengths)
        if packed:
            out = _repack(out, input)
        elif unbatched:
            out, finals = out.squeeze(1), tuple(f.squeeze(1) for f in finals)
        elif self.batch_first:
            out = out.transpose(0, 1)
        return out, (finals if self.cell.cell_state else finals[0])

    def _states(self, hx) -> tuple:
        """``(h0, c0)`` from the call's ``hx`` (None: zero)."""
        if not self.cell.cell_state:
            if isinstance(hx, (tuple, list)):
                raise ValueError(f"bppsa.nn.{type(self).__name__}: hx must be one tensor, got a {type(hx).__name__}")
            return hx, None
        if hx is None:
            return None, None
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise ValueError("bppsa.nn.LSTM: hx must be a tuple (h_0, c_0), as torch.nn.LSTM takes it")
        return tuple(hx)

    def _check_states(self, states, B: int) -> None:
        n, P = self.num_layers * self.directions, self.proj_size or self.hidden_size
        for what, s, size in (("h", states[0], P), ("c", states[1], self.hidden_size)):
            if s is not None and tuple(s.shape) != (n, B, size):
                raise ValueError(f"bppsa.nn.{type(self).__name__}: {what}_0 must be [num_layers * directions, B, "
                                 f"{'proj_size' if what == 'h' and self.proj_size else 'hidden_size'}] = "
                                 f"{[n, B, size]}, got {list(s.shape)}")

    def _check_dtype(self, x: torch.Tensor) -> None:
        w = self.weight_hh_l0
        if x.dtype in HALF or w.dtype in HALF:
            raise TypeError(f"bppsa.nn.{type(self).__name__}: half precision ({x.dtype} input, {w.dtype} weights) "
                            "is not supported: float32 and float64 are; under autocast the layer runs in float32")

    def _layers(self, x: torch.Tensor, states: tuple, lengths: torch.Tensor | None):
        T, t0, ranks = x.shape[0], 0, None
        if self.process_group is not None:  # one gather for the call: every rank's slice, each layer's record
            ranks = split.Ranks(self._group, self.group_timeout)
            memories = [self._split_memory(k) for k in range(self.num_layers)]
            sizes, unpaid = split.gather(x, self.cell.state_size(self.layer_weights(0, False)), memories, ranks)
            t0 = sum(s[0] for s in sizes[:dist.get_rank(self.process_group)])  # this rank's steps start at t0
        valid = valid_steps(lengths, T, x.device, t0)
        rev = None if not self.bidirectional else _reversal(T, lengths, x.device)
        slices = {None: None, True: 0, False: 1}[self.parallel_forward]
        options = Options(self.backend, self.layout, AUTO if self.L_m == "auto" else self.L_m, slices)
        finals: list[list] = [[], []]
        record = not torch.compiler.is_compiling()
        if record:
            calls = []
            take_stats(calls)
        with no_autocast(x.device):
            for k in range(self.num_layers):
                outs = []
                for d in range(self.directions):
                    i = k * self.directions + d
                    state0 = tuple(s[i] if s is not None else None for s in states)
                    xd = x if d == 0 else _reverse(x, rev)
                    w = self.layer_weights(k, d == 1)
                    if ranks is not None:  # (one direction: the module refuses bidirectional=True with ranks)
                        h, h_n, c_n = split.layer(self.cell, xd, state0, w, lengths, options, ranks, sizes, unpaid[k],
                                                  memories[k])
                    else:
                        h, h_n, c_n = ops.layer(self.cell, xd, state0, w, lengths, options)
                    outs.append(h if d == 0 else _reverse(h, rev))
                    finals[0].append(h_n)
                    finals[1].append(c_n)
                h = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
                x = h if valid is None else torch.where(valid.unsqueeze(-1), h, 0.0)  # zero past each end, as torch
                if self.dropout and self.training and k < self.num_layers - 1:
                    x = F.dropout(x, self.dropout, True)
        if record:  # per layer and direction, torch's order: the sliced forward's record, None for a serial one
            take_stats(None)
            self.forward_stats = calls
        stacked = tuple((f[0].unsqueeze(0) if len(f) == 1 else torch.stack(f)) for f in finals
                        if f[0] is not None)  # one layer: a view back to the op's output, no copy
        return x, stacked

    def _split_memory(self, k: int) -> dict:
        """Layer k's split forward's own memory: its slices' guesses and records, kept between calls."""
        return self.__dict__.setdefault("_split_memories", {}).setdefault(k, {})

    # -- conversions --------------------------------------------------------------------------------
    def _torch_kwargs(self) -> dict:
        w = self.weight_hh_l0
        kw = dict(num_layers=self.num_layers, bias=self.bias, batch_first=self.batch_first, dropout=self.dropout,
                  bidirectional=self.bidirectional, device=w.device, dtype=w.dtype)
        if self.proj_size:
            kw["proj_size"] = self.proj_size
        return kw

    @classmethod
    def from_torch(cls, module: nn.Module, **options):
        """This layer with ``module``'s configuration and weights (a copy); ``options``: ``backend``,
        ``layout``, ``L_m``.  Refuses what it cannot run, as the constructor does."""
        if type(module) is not cls.cell.torch_cls:
            raise TypeError(f"bppsa.nn.{cls.__name__}.from_torch takes a {cls.cell.torch_cls.__name__}, "
                            f"got {type(module).__name__}")
        extra = {"nonlinearity": module.nonlinearity} if cls.cell.torch_cls is nn.RNN else {}
        if module.proj_size:
            extra["proj_size"] = module.proj_size
        w = module.weight_hh_l0
        out = cls(module.input_size, module.hidden_size, num_layers=module.num_layers, bias=module.bias,
                  batch_first=module.batch_first, dropout=module.dropout, bidirectional=module.bidirectional,
                  device=w.device, dtype=w.dtype, **extra, **options)
        out.load_state_dict(module.state_dict())
        return out.train(module.training)

    def to_torch(self) -> nn.Module:
        """The torch.nn layer with this one's configuration and weights (a copy)."""
        out = self.cell.torch_cls(self.input_size, self.hidden_size, **self._torch_kwargs(), **self._torch_extra())
        out.load_state_dict(self.state_dict())
        return out.train(self.training)

    def _torch_extra(self) -> dict:
        return {}


class RNN(_Recurrent):
    """The Elman RNN, ``h_t = tanh(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)`` (or relu: ``nonlinearity``), as
    torch.nn.RNN, trained with the BPPSA backward."""

    cell = CELLS["rnn"]

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None, **options):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"bppsa.nn.RNN: nonlinearity='{nonlinearity}' is unknown: choose 'tanh' or 'relu'")
        self.cell = CELLS["rnn" if nonlinearity == "tanh" else "rnn_relu"]  # (before the layouts are checked)
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device,
                         dtype, **options)
        self.nonlinearity = nonlinearity

    def _torch_extra(self) -> dict:
        return {"nonlinearity": self.nonlinearity}


class GRU(_Recurrent):
    """The GRU of torch.nn.GRU (gates r, z, n; Eq. 10 of the paper), trained with the BPPSA backward."""

    cell = CELLS["gru"]


class LSTM(_Recurrent):
    """The LSTM of torch.nn.LSTM (gates i, f, g, o; ``proj_size`` projects h), trained with the BPPSA backward: the
    scan runs over the transposed Jacobians of its state (h, c).  Called as torch.nn.LSTM is: ``hx = (h_0, c_0)``
    in, ``(output, (h_n, c_n))`` out."""

    cell = CELLS["lstm"]

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
                 device=None, dtype=None, **options):
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device,
                         dtype, proj_size=proj_size, **options)


def _reversal(T: int, lengths: torch.Tensor | None, device) -> torch.Tensor | None:
    """[T, B] step indices that reverse each sequence within its own length (its own inverse); None: the whole
    sequence, ``flip(0)``."""
    if lengths is None:
        return None
    t = torch.arange(T, device=device)[:, None]
    n = lengths.to(device)[None, :]
    return torch.where(t < n, n - 1 - t, t)


def _reverse(x: torch.Tensor, rev: torch.Tensor | None) -> torch.Tensor:
    """``x`` [T, B, ·] with each sequence reversed (:func:`_reversal`), differentiably."""
    if rev is None:
        return x.flip(0)
    return x.gather(0, rev.unsqueeze(-1).expand_as(x))


def _repack(out: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """``out`` [T, B, H] (original batch order) as a PackedSequence with ``like``'s batch sizes and order."""
    bs = like.batch_sizes
    steps = torch.repeat_interleave(torch.arange(bs.shape[0]), bs)
    first = torch.cumsum(bs, 0) - bs  # where each step's rows start in the packed data
    rows = torch.arange(int(bs.sum())) - first[steps]
    order = like.sorted_indices.cpu() if like.sorted_indices is not None else torch.arange(int(bs[0]))
    dev = out.device
    return PackedSequence(out[steps.to(dev), order[rows].to(dev)], bs, like.sorted_indices, like.unsorted_indices)
