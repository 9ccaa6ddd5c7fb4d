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
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._pending: list[tuple[str, object, object]] = []
        self.seconds: dict[str, float] = defaultdict(float)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[name] += time.perf_counter() - t0

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect (synchronises the device)."""
        self.sync()
        for name, start, end in self._pending:
            self.seconds[name] += start.elapsed_time(end) / 1e3
        self._pending.clear()
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out
