"""Timing like a systems paper: the device is synchronised around every timed region.

The one timer of the harness, in three sizes: :func:`timed` (one call on the host), :class:`PhaseTimer`
(the phases of one iteration) and :func:`backward_seconds` (the backward metric every benchmark reports).
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
