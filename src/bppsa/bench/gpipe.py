"""The pipeline baseline of ``bppsa workers``: ``torch.distributed.pipelining``'s GPipe schedule
(:class:`~torch.distributed.pipelining.ScheduleGPipe`) over the RNN's sequence split into p contiguous slices of T
(``torch.tensor_split`` order, as BPPSA's split), one stage per rank (docs/distributed.md).

**Stages and micro-batches.** Stage r is the recurrent layer over its slice of the time steps (:class:`SliceStage`,
a ``torch.nn.RNN`` with the weights of BPPSA's layer).  The micro-batches split the *batch*: with B sequences and
m micro-batches, micro-batch k holds b = B/m whole sequences, and stage r runs micro-batch k while stage r + 1 runs
k - 1: GPipe's fill and drain, over time slices.  A stage needs, for micro-batch k, the state at the end of the
slice before it and its own slice of x for those sequences: the state crosses the wire; x does not.  Every rank
passes its own slice of x (and of the loss's weights ``g``) to its ``step()`` as keyword arguments, which the
schedule splits into micro-batches along the batch on every stage (``forward_one_chunk`` hands ``kwargs`` to
every stage, ``args`` to the first only).

**What crosses the wire.** Per micro-batch and stage boundary: forward, the state h [b, H]; backward, ∇h [b, H].
With ``loss="steps"`` also a per-sequence running loss [b] (the loss of the slices so far, so that the last
stage's ``loss_fn`` sees the whole sum) and its gradient (ones): b values more each way.  In all, per step,
m(p - 1) messages each way of b H values (b (H + 1) with ``steps``), against the p - 1 messages of [B, H] each
way of a pipeline without micro-batches: the same bytes, m times the messages (and their latency).  The stages'
shapes are declared up front (static stage metadata: no forward or backward runs at the first step to infer
them).

**The loss** is BPPSA's: ``Σ_t Σ_{b,h} g_t ⊙ h_t`` with the same ``g`` (``loss="last"``: g is zero but at the last
step; ``"steps"``: every step), summed over micro-batches (``scale_grads=False``), so the weights' gradients,
summed over the ranks (the all-reduce after ``step()``), are autograd's on the whole sequence.

**Memory.** Each stage keeps autograd's activations of every micro-batch from its forward to its backward (GPipe
runs all forwards, then all backwards): the whole batch's slice.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from ..distributed import all_reduce_sum

__all__ = ["GPipe", "SliceStage", "slice_loss"]


class SliceStage(nn.Module):
    """Stage ``r`` of ``p``: the recurrent layer over its slice of T, batch-first.  Its positional inputs are what
    the stage before sends (none on the first stage): the state at the end of the previous slice [b, H] and, with
    ``steps``, the running per-sequence loss [b].  ``x`` [b, T_r, I] and ``g`` [b, T_r, H] are this rank's own
    slices, passed to every stage as keyword arguments.  Returns what the next stage needs, or, on the last stage,
    its states [b, T_r, H] (and the running loss) for :func:`slice_loss`."""

    def __init__(self, rnn: nn.RNN, r: int, p: int, steps: bool):
        super().__init__()
        if not rnn.batch_first:
            raise ValueError("SliceStage: the layer must be batch-first (the schedule splits dimension 0)")
        self.rnn, self.first, self.last, self.steps = rnn, r == 0, r == p - 1, steps

    def forward(self, *carry: torch.Tensor, x: torch.Tensor, g: torch.Tensor):
        h0 = None if self.first else carry[0].unsqueeze(0)
        acc = carry[1] if self.steps and not self.first else None
        out, h_n = self.rnn(x, h0)
        if self.last:
            return out if acc is None else (out, acc)
        if not self.steps:
            return h_n[0]
        term = (out * g).sum(dim=(1, 2))
        return h_n[0], term if acc is None else acc + term


def slice_loss(output, g: torch.Tensor) -> torch.Tensor:
    """The last stage's ``loss_fn``: ``Σ g ⊙ h`` over its slice, plus the running loss of the slices before it."""
    if isinstance(output, tuple):
        out, acc = output
        return (out * g).sum() + acc.sum()
    return (output * g).sum()


class _TimedStage(PipelineStage):
    """A :class:`PipelineStage` that marks where the schedule turns from forwards to backwards: at the first
    backward's receive (every stage's forwards are done by then), a barrier of the stage's group, then the time
    (``t_backward``)."""

    t_backward = float("nan")

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if bwd_chunk_id == 0:
            dist.barrier(self.group)
            self.t_backward = time.perf_counter()
        return super().get_bwd_recv_ops(bwd_chunk_id)


class GPipe:
    """This rank's stage of the GPipe pipeline over the split, its schedule, and one timed step.

    ``ref``: the single-process ``torch.nn.RNN`` with BPPSA's weights (copied into a batch-first layer, whose
    gradients :meth:`step` leaves all-reduced in ``.grad``); ``r``/``p``: this rank and the group's size;
    ``micro_batches`` must divide ``B``."""

    def __init__(self, ref: nn.RNN, group, r: int, p: int, B: int, micro_batches: int, loss: str):
        if micro_batches < 1 or B % micro_batches:
            raise ValueError(f"--micro-batches {micro_batches} must divide --batch {B} (GPipe's stages exchange "
                             "micro-batches of one shape)")
        if loss not in ("last", "steps"):
            raise ValueError(f"--loss must be 'last' or 'steps', got {loss!r}")
        self.rnn = nn.RNN(ref.input_size, ref.hidden_size, nonlinearity=ref.nonlinearity, bias=ref.bias,
                          batch_first=True, dtype=ref.weight_hh_l0.dtype)
        self.rnn.load_state_dict(ref.state_dict())
        self.module = SliceStage(self.rnn, r, p, loss == "steps")
        self.group, self.r, self.p, self.B, self.m, self.steps = group, r, p, B, micro_batches, loss == "steps"
        self._schedules: dict[int, tuple] = {}

    def _schedule(self, T_r: int):
        """The stage and schedule for a slice of ``T_r`` steps (the last stage's declared output depends on it)."""
        if T_r not in self._schedules:
            b, H = self.B // self.m, self.rnn.hidden_size
            dtype = self.rnn.weight_hh_l0.dtype

            def carry():
                return (torch.zeros(b, H, dtype=dtype, requires_grad=True),) + (
                    (torch.zeros(b, dtype=dtype, requires_grad=True),) if self.steps else ())

            inputs = () if self.r == 0 else carry()
            if self.r < self.p - 1:
                outputs = carry()
            else:
                outputs = (torch.zeros(b, T_r, H, dtype=dtype, requires_grad=True),) + inputs[1:]
            stage = _TimedStage(self.module, self.r, self.p, torch.device("cpu"), input_args=inputs,
                                output_args=outputs, group=self.group)
            self._schedules[T_r] = (stage, ScheduleGPipe(stage, self.m, loss_fn=slice_loss, scale_grads=False))
        return self._schedules[T_r]

    def step(self, x: torch.Tensor, g: torch.Tensor, timed: dict) -> None:
        """One forward and backward of this rank's slice ``x`` [T_r, B, I], loss weights ``g`` [T_r, B, H]
        (time-major, as BPPSA's), the weights' gradients all-reduced over the group.  ``timed``: ``backward_s``,
        from the barrier at the schedule's first backward to the all-reduce's end; ``fwd_bwd_s``, from a barrier
        before ``step()`` to the same end; ``forward_s``, from that barrier to the one at the first backward (every
        stage's forwards done: the fill) (all include the schedule's waits on the other stages)."""
        stage, schedule = self._schedule(x.shape[0])
        xb, gb = x.transpose(0, 1).contiguous(), g.transpose(0, 1).contiguous()  # batch-first: split on dim 0
        for q in self.rnn.parameters():
            q.grad = None
        dist.barrier(self.group)
        t0 = time.perf_counter()
        if self.r == self.p - 1:
            schedule.step(x=xb, g=gb, target=gb, return_outputs=False)
        else:
            schedule.step(x=xb, g=gb)
        flat = all_reduce_sum(torch.cat([q.grad.reshape(-1) for q in self.rnn.parameters()]), self.group)
        t1 = time.perf_counter()
        timed["backward_s"], timed["fwd_bwd_s"] = t1 - stage.t_backward, t1 - t0
        timed["forward_s"] = stage.t_backward - t0
        i = 0
        for q in self.rnn.parameters():
            q.grad.copy_(flat[i:i + q.numel()].view_as(q))
            i += q.numel()
