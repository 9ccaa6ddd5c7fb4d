"""Benchmark and training loops for any RecurrentClassifier (the RNN and the GRU share them).

``method`` is ``baseline`` (autograd; cuDNN's RNN/GRU on GPU) or ``bppsa`` (the scan backward).
Rows are tidy: one per (iteration, phase).  Phases: forward, jacobian (bppsa only), backward,
optimizer.  ``mode='nobp'`` skips everything after the forward, for the paper's subtraction.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from ..models.recurrent import no_phase
from .timing import PhaseTimer

METHODS = ("baseline", "bppsa")


def baseline_backend_name(device: torch.device) -> str:
    return "cudnn" if torch.device(device).type == "cuda" and torch.backends.cudnn.is_available() else "autograd"


def train_step(model, x, y, method: str, backend=None, layout: str = "fused", L_m=None,
               optimizer=None, timer: PhaseTimer | None = None, backward: bool = True) -> torch.Tensor:
    """One training iteration; phases are timed when a timer is given."""
    phase = timer.phase if timer is not None else no_phase
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if method == "baseline":
        loss = model.baseline_step(x, y, phase=phase, backward=backward)
    elif method == "bppsa":
        loss = model.bppsa_step(x, y, backend, layout, L_m, phase=phase, backward=backward)
    else:
        raise ValueError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
    if backward and optimizer is not None:
        with phase("optimizer"):
            optimizer.step()
    return loss


def time_iterations(model, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]], method: str, *,
                    device, backend=None, layout="fused", L_m=None, lr=1e-3, warmup=3, iters=10,
                    mode: str = "full", desc: str = "") -> list[dict]:
    """Time ``iters`` iterations after ``warmup`` untimed ones; ``batches(i)`` gives batch i."""
    if mode not in ("full", "nobp"):
        raise ValueError(f"unknown mode '{mode}'")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    timer = PhaseTimer(device)
    rows = []
    for i in tqdm(range(warmup + iters), desc=desc or f"{method} {mode}", leave=False):
        x, y = batches(i)
        timer.sync()
        train_step(model, x, y, method, backend, layout, L_m, optimizer, timer, backward=(mode == "full"))
        seconds = timer.collect()
        if i >= warmup:
            rows += [{"iter": i - warmup, "phase": p, "seconds": s} for p, s in seconds.items()]
    return rows


def train_epochs(model, n_samples: int, batch_size: int, get_batch: Callable[[np.ndarray], tuple],
                 method: str, *, device, epochs: int, lr: float, seed: int = 0, backend=None,
                 layout: str = "fused", L_m=None, desc: str = "") -> Iterator[dict]:
    """Train for ``epochs``; yield one row per epoch with the training loss/accuracy and wall-clock.

    ``wall_clock_s`` is the cumulative time spent in training steps (device-synchronised), the
    x-axis of Fig 7 / Fig 13; the loss/accuracy are the means over the epoch's batches.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)  # the same batch order for both methods
    timer = PhaseTimer(device)
    wall = 0.0
    for epoch in tqdm(range(1, epochs + 1), desc=desc or f"train {method}"):
        order = rng.permutation(n_samples)
        losses = []
        for s in range(0, n_samples - batch_size + 1, batch_size):
            x, y = get_batch(order[s:s + batch_size])
            timer.sync()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(model, x, y, method, backend, layout, L_m, optimizer)
            timer.sync()
            wall += time.perf_counter() - t0
            losses.append(loss.item())
        # accuracy of the epoch's final weights over the training set (not timed)
        acc_correct, chunk = 0, max(batch_size, 256)
        with torch.no_grad():
            for s in range(0, n_samples, chunk):
                x, y = get_batch(np.arange(s, min(s + chunk, n_samples)))
                acc_correct += (model(x).argmax(-1) == y).sum().item()
        yield {"epoch": epoch, "wall_clock_s": wall, "loss": float(np.mean(losses)),
               "accuracy": acc_correct / n_samples, "steps": len(losses)}
