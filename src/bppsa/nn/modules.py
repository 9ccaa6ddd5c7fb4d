"""``bppsa.nn.RNN`` and ``bppsa.nn.GRU``: drop-ins for torch.nn.RNN/GRU whose backward is BPPSA.

Same constructor, call, parameter names and state dict as torch's; each layer is one op of :mod:`.ops`,
chained by autograd, with dropout between layers.  They subclass ``nn.Module``, not ``nn.RNNBase``, whose
flattened cuDNN weights and Python-side checks torch.compile would break the graph on.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..backends import BACKENDS
from ..distributed import GroupRef, all_gather_ints
from ..jacobians.recurrent import LAYOUTS
from . import ops, split
from .backward import no_autocast

HALF = (torch.float16, torch.bfloat16)


class _Recurrent(nn.Module):
    """What the RNN and the GRU share: options, refusals, parameters, the layer loop, conversions."""

    cell: str
    gates: int
    torch_cls: type

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, device=None,
                 dtype=None, *, proj_size: int = 0, backend: str = "auto", layout: str = "fused",
                 L_m: int | None = None, process_group=None, group_timeout: float | None = None):
        super().__init__()
        name = type(self).__name__
        if bidirectional:
            raise ValueError(f"bppsa.nn.{name}: bidirectional=True is not supported (the BPPSA backward scans one "
                             "direction); use bidirectional=False, or torch.nn for a bidirectional layer")
        if proj_size:
            raise ValueError(f"bppsa.nn.{name}: proj_size={proj_size} is not supported (torch.nn has it for LSTM "
                             "only); use proj_size=0")
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
        layouts = LAYOUTS if self.cell == "rnn" else ("fused",)
        if layout not in layouts:
            raise ValueError(f"bppsa.nn.{name}: unknown layout '{layout}' (choose from {', '.join(layouts)})")
        if L_m is not None and (not isinstance(L_m, int) or L_m < 0):
            raise ValueError(f"bppsa.nn.{name}: L_m must be None (the full tree) or an int >= 0, got {L_m!r}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = False, 0
        self.backend, self.layout, self.L_m = backend, layout, L_m
        if process_group is not None and layout != "fused":
            raise ValueError(f"bppsa.nn.{name}: process_group runs the fused layout only, got layout='{layout}'")
        if group_timeout is not None and not group_timeout > 0:
            raise ValueError(f"bppsa.nn.{name}: group_timeout must be a positive number of seconds, got "
                             f"{group_timeout}")
        # the sequence split over the ranks of a torch.distributed group (bppsa.nn.split; docs/distributed.md)
        self.process_group, self.group_timeout = process_group, group_timeout
        kw = {"device": device, "dtype": dtype}
        G = self.gates * hidden_size
        for k in range(num_layers):
            size = input_size if k == 0 else hidden_size
            setattr(self, f"weight_ih_l{k}", nn.Parameter(torch.empty(G, size, **kw)))
            setattr(self, f"weight_hh_l{k}", nn.Parameter(torch.empty(G, hidden_size, **kw)))
            if bias:
                setattr(self, f"bias_ih_l{k}", nn.Parameter(torch.empty(G, **kw)))
                setattr(self, f"bias_hh_l{k}", nn.Parameter(torch.empty(G, **kw)))
        self.reset_parameters()

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
        """torch.nn.RNN/GRU's initialisation: every weight uniform in ±1/√hidden_size."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def flatten_parameters(self) -> None:
        """Nothing to do (torch.nn's cuDNN weight packing): here so that code written for torch.nn runs."""

    def layer_weights(self, k: int):
        b = (getattr(self, f"bias_ih_l{k}"), getattr(self, f"bias_hh_l{k}")) if self.bias else (None, None)
        return getattr(self, f"weight_ih_l{k}"), getattr(self, f"weight_hh_l{k}"), *b

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        for key, default in (("bias", True), ("batch_first", False), ("dropout", 0.0)):
            if getattr(self, key) != default:
                s += f", {key}={getattr(self, key)}"
        return s + f", backend={self.backend!r}, layout={self.layout!r}, L_m={self.L_m}"

    # -- the call ---------------------------------------------------------------------------------
    def forward(self, input, hx: torch.Tensor | None = None, *, lengths=None):
        """``(output, h_n)`` as torch.nn.RNN/GRU return them, for a tensor ([T, B, I], [B, T, I] with
        ``batch_first``, or unbatched [T, I]) or a PackedSequence.  ``lengths`` (a tensor or list of B ints in
        [1, T]) marks a padded batch's sequence lengths, like a PackedSequence: ``output`` is zero past each
        sequence's end and ``h_n`` holds each one's last valid state."""
        packed = isinstance(input, PackedSequence)
        if packed and self.process_group is not None:
            raise ValueError(f"bppsa.nn.{type(self).__name__}: with a process_group, pass this rank's slice of a "
                             "padded batch and lengths= (the whole sequences' lengths), not a PackedSequence")
        if packed:
            if lengths is not None:
                raise ValueError("bppsa.nn: a PackedSequence carries its lengths; do not pass lengths= too")
            x, lengths = pad_packed_sequence(input)
        else:
            x = input
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(1)
            hx = hx.unsqueeze(1) if hx is not None else None
        elif x.dim() != 3:
            raise ValueError(f"bppsa.nn.{type(self).__name__}: expected a 2-D or 3-D input, got {x.dim()}-D")
        elif self.batch_first and not packed:
            x = x.transpose(0, 1)
        if torch.is_autocast_enabled(x.device.type):  # runs in fp32, as the docs say (the weights are fp32)
            x = x.float()
            hx = hx.float() if hx is not None else None
        self._check_dtype(x)
        if lengths is not None:
            lengths = torch.as_tensor(lengths, dtype=torch.int64).cpu()
        if hx is not None and tuple(hx.shape) != (self.num_layers, x.shape[1], self.hidden_size):
            raise ValueError(f"bppsa.nn.{type(self).__name__}: hx must be [num_layers, B, hidden_size] = "
                             f"{[self.num_layers, x.shape[1], self.hidden_size]}, got {list(hx.shape)}")
        out, h_n = self._layers(x, hx, lengths)
        if packed:
            return _repack(out, input), h_n
        if unbatched:
            return out.squeeze(1), h_n.squeeze(1)
        return (out.transpose(0, 1) if self.batch_first else out), h_n

    def _check_dtype(self, x: torch.Tensor) -> None:
        w = self.weight_hh_l0
        if x.dtype in HALF or w.dtype in HALF:
            raise TypeError(f"bppsa.nn.{type(self).__name__}: half precision ({x.dtype} input, {w.dtype} weights) "
                            "is not supported: float32 and float64 are; under autocast the layer runs in float32")

    def _layers(self, x: torch.Tensor, hx: torch.Tensor | None, lengths: torch.Tensor | None):
        T, t0 = x.shape[0], 0
        if self.process_group is not None and lengths is not None:  # this rank's steps start at t0
            t0 = sum(s[0] for s in all_gather_ints([T], self.process_group, self.group_timeout)
                     [:dist.get_rank(self.process_group)])
        valid = None if lengths is None else (torch.arange(t0, t0 + T, device=x.device)[:, None]
                                              < lengths.to(x.device)[None, :]).unsqueeze(-1)
        with no_autocast(x.device):
            finals = []
            for k in range(self.num_layers):
                if self.process_group is not None:
                    h, h_n = split.layer(self.cell, x, hx[k] if hx is not None else None, *self.layer_weights(k),
                                         lengths, self.backend, self.L_m, self.process_group, self.group_timeout)
                else:
                    h, h_n = ops.layer(self.cell, x, hx[k] if hx is not None else None, *self.layer_weights(k),
                                       lengths, self.backend, self.layout, self.L_m)
                x = h if valid is None else torch.where(valid, h, 0.0)  # zero past each end, as torch pads
                if self.dropout and self.training and k < self.num_layers - 1:
                    x = F.dropout(x, self.dropout, True)
                finals.append(h_n)
        return x, (finals[0].unsqueeze(0) if len(finals) == 1 else torch.stack(finals))  # a view: no copy back

    # -- conversions --------------------------------------------------------------------------------
    def _torch_kwargs(self) -> dict:
        w = self.weight_hh_l0
        return dict(num_layers=self.num_layers, bias=self.bias, batch_first=self.batch_first, dropout=self.dropout,
                    device=w.device, dtype=w.dtype)

    @classmethod
    def from_torch(cls, module: nn.Module, **options):
        """This layer with ``module``'s configuration and weights (a copy); ``options``: ``backend``,
        ``layout``, ``L_m``.  Refuses what it cannot run, as the constructor does."""
        if not isinstance(module, cls.torch_cls):
            raise TypeError(f"bppsa.nn.{cls.__name__}.from_torch takes a {cls.torch_cls.__name__}, "
                            f"got {type(module).__name__}")
        extra = {"nonlinearity": module.nonlinearity} if cls.torch_cls is nn.RNN else {}
        w = module.weight_hh_l0
        out = cls(module.input_size, module.hidden_size, num_layers=module.num_layers, bias=module.bias,
                  batch_first=module.batch_first, dropout=module.dropout, bidirectional=module.bidirectional,
                  device=w.device, dtype=w.dtype, proj_size=module.proj_size, **extra, **options)
        out.load_state_dict(module.state_dict())
        return out.train(module.training)

    def to_torch(self) -> nn.Module:
        """The torch.nn layer with this one's configuration and weights (a copy)."""
        out = self.torch_cls(self.input_size, self.hidden_size, **self._torch_kwargs(), **self._torch_extra())
        out.load_state_dict(self.state_dict())
        return out.train(self.training)

    def _torch_extra(self) -> dict:
        return {}


class RNN(_Recurrent):
    """The Elman tanh RNN, ``h_t = tanh(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, as torch.nn.RNN, trained
    with the BPPSA backward.  ``nonlinearity`` is 'tanh' only (the paper's RNN)."""

    cell, gates, torch_cls = "rnn", 1, nn.RNN

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None, **options):
        if nonlinearity != "tanh":
            what = "is not supported" if nonlinearity == "relu" else "is unknown"
            raise ValueError(f"bppsa.nn.RNN: nonlinearity='{nonlinearity}' {what}: only 'tanh' is (the paper's "
                             "Elman RNN); use torch.nn.RNN for 'relu'")
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, device,
                         dtype, **options)
        self.nonlinearity = nonlinearity

    def _torch_extra(self) -> dict:
        return {"nonlinearity": "tanh"}


class GRU(_Recurrent):
    """The GRU of torch.nn.GRU (gates r, z, n; Eq. 10 of the paper), trained with the BPPSA backward."""

    cell, gates, torch_cls = "gru", 3, nn.GRU


def _repack(out: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """``out`` [T, B, H] (original batch order) as a PackedSequence with ``like``'s batch sizes and order."""
    bs = like.batch_sizes
    steps = torch.repeat_interleave(torch.arange(bs.shape[0]), bs)
    first = torch.cumsum(bs, 0) - bs  # where each step's rows start in the packed data
    rows = torch.arange(int(bs.sum())) - first[steps]
    order = like.sorted_indices.cpu() if like.sorted_indices is not None else torch.arange(int(bs[0]))
    dev = out.device
    return PackedSequence(out[steps.to(dev), order[rows].to(dev)], bs, like.sorted_indices, like.unsorted_indices)
