"""One recurrent layer's forward, for any cell: the backend's own forward kernel where it has one (the CPU's compiled
forward, serial or split over slices of the sequence), else torch's (:meth:`~.cells.base.Cell.forward`, cuDNN on a
GPU), which is also the twin the compiled one is tested against.

``slices`` (a layer's ``parallel_forward``): 1 the serial forward; None the backend's choice
(:func:`bppsa.backends.cpu.sliced.auto_slices`: where the batch leaves threads idle and the last call of the shape
paid); 0 as many slices as threads (on a GPU: :data:`GPU_SLICES`); k >= 2 that many.  What a sliced run did (its
sweeps, meeting lengths, hand-off: :func:`bppsa.backends.cpu.sliced.sliced_forward`'s ``stats``) is recorded per
thread for the layer to read (:func:`take_stats`).

**Slices on torch's kernels** (:func:`torch_sliced`: where the backend has no forward of its own, a GPU's cuDNN): the
same block Jacobi as the CPU kernel's, each slice a torch call on a CUDA stream of its own, so the slices run side
by side; a correction reruns a slice from its predecessor's end in chunks of growing length until, at a chunk's end,
every sequence's new state meets the stored one.  torch's kernels are not bitwise reproducible across calls of
different lengths (cuDNN picks its algorithm by shape; a GEMM's blocking by its rows), so two trajectories meet
within :data:`MEET_ULPS` units in the last place (relative, per sequence, h and c each) rather than bitwise: the
result differs from the serial forward by at most (slices - 1) times that, carried by the layer's own Jacobian
products (docs/library.md).  At most ``slices`` sweeps run; a slice whose rerun never meets is rerun whole, the
serial hand-off's cost.
"""
from __future__ import annotations

import threading

import torch

from .backward import Options, backend_for
from .cells import Cell, Weights

_record = threading.local()
GPU_SLICES = 4  # parallel_forward=True on a GPU: slices (streams) a sequence is cut into
MEET_ULPS = 8  # torch's kernels: two trajectories meet within this many units in the last place
CHUNK = 32  # a correction's first chunk of steps, doubled each time it has not met
_guesses: dict = {}  # the slices' start states of the last call, per shape (torch_sliced)


def layer_forward(cell: Cell, x, h0, c0, w: Weights, lengths, options: Options):
    """The states ``(h, c)`` of one layer (``c`` None but for a cell state), the steps past each sequence's end
    carrying its last state."""
    slices = options.slices
    if slices == 0:
        slices = torch.get_num_threads() if x.device.type == "cpu" else GPU_SLICES
    out = backend_for(options.backend, x.device).forward(cell.kernel, x, (h0, c0), w.tensors(), lengths, slices,
                                                         cell.meet_tol(x.dtype))
    if out is None and slices is not None and slices > 1:
        out = torch_sliced(cell, x, h0, c0, w, lengths, slices)
    if out is None:
        h, c = cell.forward(x, h0, c0, w, lengths)
        stats = None
    else:
        h, c, stats = out
    if stats is not None:
        stats = {k: v for k, v in stats.items() if k != "starts"}  # (the next call's guess: kept by the backend)
    record(stats)
    return h, c


def record(stats: dict | None) -> None:
    """One layer's forward done: what it did (None: a serial forward), for :func:`take_stats`' recorder."""
    calls = getattr(_record, "calls", None)
    if calls is not None:
        calls.append(stats)


def take_stats(calls: list | None) -> list | None:
    """Start recording this thread's forwards into ``calls`` (a list; None: stop), returning what was recorded."""
    done = getattr(_record, "calls", None)
    _record.calls = calls
    return done


def torch_slice(cell: Cell, x, start: torch.Tensor, w: Weights, valid):
    """Steps of one layer ``(h, c)`` from the state before them (the scan's state vector) by torch's own kernels,
    the steps past a sequence's end (``valid`` [T, B], None: none) carrying its last state, a sequence that ended
    before them carrying the state in throughout."""
    h_in, c_in = cell.split_state(start, w)
    h, c = cell.forward(x, h_in, c_in, w, None)
    if valid is None:
        return h, c
    T = x.shape[0]
    n = valid.sum(0)  # each sequence's valid steps here [B]
    last = torch.minimum(torch.arange(T, device=x.device)[:, None], (n - 1).clamp_min(0)[None, :])

    def carried(t, t_in):
        out = t.gather(0, last.unsqueeze(-1).expand_as(t))
        return torch.where((n == 0)[None, :, None], t_in.unsqueeze(0), out).contiguous()

    return carried(h, h_in), (None if c is None else carried(c, c_in))


def _met(new: torch.Tensor, old: torch.Tensor, ulps: int) -> bool:
    """Whether every sequence's state [B, S] is within ``ulps`` of the stored one (relative to its largest unit)."""
    tol = ulps * torch.finfo(new.dtype).eps
    return bool(((new - old).abs().amax(-1) <= tol * old.abs().amax(-1)).all())


@torch.no_grad()
def torch_sliced(cell: Cell, x, h0, c0, w: Weights, lengths, slices: int):
    """``(h, c, stats)``: the layer's states by ``slices`` slices of the sequence on torch's kernels, side by side
    (CUDA streams on a GPU; one after another on a CPU, where the tests hold it to the serial forward), corrected
    until they meet (the module's docstring).  ``stats``: the sweeps and each correction's steps."""
    T, B = x.shape[:2]
    K = max(1, min(int(slices), T))
    bounds = [T * k // K for k in range(K + 1)]
    valid = None
    if lengths is not None:
        valid = torch.arange(T, device=x.device)[:, None] < lengths.to(x.device)[None, :]
    zero_c = x.new_zeros(B, cell.hidden(w)) if cell.cell_state else None
    S0 = cell.state(h0 if h0 is not None else x.new_zeros(B, w.out_size), c0 if c0 is not None else zero_c)
    key = (cell.name, T, B, K, x.dtype, str(x.device), tuple(t.data_ptr() for t in w.tensors() if t is not None))
    starts = [t.clone() for t in _guesses.get(key, [S0.new_zeros(S0.shape)] * K)]
    starts[0] = S0
    h = x.new_empty((T, B, w.out_size))
    c = x.new_empty((T, B, cell.hidden(w))) if cell.cell_state else None
    streams = [torch.cuda.Stream(x.device) for _ in range(K)] if x.is_cuda else None

    def on(k):
        return torch.cuda.stream(streams[k]) if streams else _Null()

    def write(t0, t1, start):
        hs, cs = torch_slice(cell, x[t0:t1], start, w, None if valid is None else valid[t0:t1])
        h[t0:t1] = hs
        if c is not None:
            c[t0:t1] = cs
        return cell.state(hs[-1], None if cs is None else cs[-1])

    def stored(t):
        return cell.state(h[t], None if c is None else c[t])

    def correct(k):
        """Slice k from its new start, in chunks, until its states meet the stored ones: the steps it ran."""
        t, state, m = bounds[k], starts[k], CHUNK
        while t < bounds[k + 1]:
            t1 = min(bounds[k + 1], t + m)
            old = stored(t1 - 1).clone()
            state = write(t, t1, state)
            t, m = t1, 2 * m
            if _met(state, old, max(MEET_ULPS, cell.meet_ulps)):
                break
        return t - bounds[k]

    if streams:
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(x.device))
    for k in range(K):  # sweep 0: every slice from its guess
        with on(k):
            write(bounds[k], bounds[k + 1], starts[k])
    _join(streams, x)
    sweeps, meet_steps = 1, []
    while sweeps < K:
        ends = [stored(bounds[k] - 1).clone() for k in range(1, K)]
        stale = [k for k in range(1, K) if not torch.equal(ends[k - 1], starts[k])]
        if not stale:
            break
        steps = {}
        for k in stale:
            starts[k] = ends[k - 1]
            with on(k):
                steps[k] = correct(k)
        _join(streams, x)
        meet_steps.append(steps)
        sweeps += 1
    _guesses[key] = starts
    return h, c, {"sweeps": sweeps, "meet_steps": meet_steps, "handoff": [], "fallback": False}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _join(streams, x) -> None:
    if streams:
        for s in streams:
            torch.cuda.current_stream(x.device).wait_stream(s)
