"""Timing like a systems paper: the device is synchronised around every timed region.

The one timer of the harness, in four sizes: :func:`timed` (one call on the host), :class:`PhaseTimer`
(the phases of one iteration), :class:`GraphedStep` (the phases of one iteration captured as CUDA graphs and
replayed) and :func:`backward_seconds` (the backward metric every benchmark reports).
On CUDA each phase is bracketed by CUDA events on the current stream (the kernels' own time,
unaffected by Python-side queueing); on CPU by ``time.perf_counter`` (torch CPU ops are synchronous).
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


def timed(fn):
    """``(seconds, fn())``: the wall-clock seconds of one call of ``fn`` on the host and what it returned (CPU
    work; a caller timing CUDA work synchronises around it, as :class:`PhaseTimer` does)."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def backward_seconds(phases) -> float | None:
    """The backward as the paper counts it, from one iteration's phases: BPPSA's includes its Jacobian
    generation (phase ``jacobian``); None for an iteration without a backward (a forward-only run)."""
    if "backward" not in phases:
        return None
    return phases["backward"] + phases.get("jacobian", 0.0)


class PhaseTimer:
    """Seconds per phase of one iteration (:meth:`phase`, read by :meth:`collect`).

    Phases nest, and each counts only its own time: a phase opened inside another (the layers' ``jacobian``
    inside the step's ``backward``, :func:`bppsa.nn.backward.stepping`) is subtracted from it, so the phases of an
    iteration add up to its time."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._spans: list[tuple[str, str | None, object]] = []  # (name, enclosing phase, seconds or CUDA events)
        self._open: list[str] = []

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str):
        outer = self._open[-1] if self._open else None
        self._open.append(name)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._open.pop()
                self._spans.append((name, outer, (start, end)))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                t = time.perf_counter() - t0
                self._open.pop()
                self._spans.append((name, outer, t))

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect (synchronises the device)."""
        self.sync()
        out: dict[str, float] = defaultdict(float)
        for name, outer, t in self._spans:
            secs = t[0].elapsed_time(t[1]) / 1e3 if isinstance(t, tuple) else t
            out[name] += secs
            if outer is not None:
                out[outer] -= secs
        self._spans.clear()
        return dict(out)


class GraphedStep:
    """One training iteration whose phases are each captured as a CUDA graph, then replayed phase by phase.

    ``step(phase)`` runs the iteration on static inputs, opening ``phase(name)`` around its top-level phases (as
    :class:`PhaseTimer` is opened); nested phases (the layers' ``jacobian``) stay inside their parent's graph.
    ``step`` is warmed up ``warmup`` times on a side stream (kernels compiled and loaded, the allocator's pools
    and an optimizer's state settled), then run once more with every top-level phase captured into its own graph,
    all graphs in one memory pool, in phase order.  Nothing may run on the device between two phases.  Each
    :meth:`replay` runs the graphs in that order and returns each phase's device seconds (CUDA events around each
    graph): no host work per launch, so what is left is the device's time.  What the capture allocated (the
    gradients in ``.grad``, an output) is rewritten in place by every replay."""

    def __init__(self, step, warmup: int = 3):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep captures CUDA graphs and needs a CUDA device")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step(_no_phase)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graphs: list[tuple[str, torch.cuda.CUDAGraph]] = []
        pool, depth = torch.cuda.graph_pool_handle(), []

        @contextlib.contextmanager
        def capture(name: str):
            depth.append(name)
            try:
                if len(depth) > 1:  # a phase inside a phase: part of the outer one's graph
                    yield
                    return
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=pool)
                try:
                    yield
                finally:
                    graph.capture_end()
                self.graphs.append((name, graph))
            finally:
                depth.pop()

        with torch.cuda.stream(torch.cuda.Stream()):  # capture needs a stream other than the legacy default
            step(capture)
        torch.cuda.synchronize()
        if not self.graphs:
            raise RuntimeError("GraphedStep: the step opened no phase, so nothing was captured")
        self._events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        for _ in self.graphs]

    def replay(self) -> dict[str, float]:
        """Every phase's graph once, in order; seconds per phase (the device synchronised)."""
        stream = torch.cuda.current_stream()
        for (_, graph), (start, end) in zip(self.graphs, self._events):
            start.record(stream)
            graph.replay()
            end.record(stream)
        self._events[-1][1].synchronize()
        out: dict[str, float] = defaultdict(float)
        for (name, _), (start, end) in zip(self.graphs, self._events):
            out[name] += start.elapsed_time(end) / 1e3
        return dict(out)


@contextlib.contextmanager
def _no_phase(name: str):
    yield
