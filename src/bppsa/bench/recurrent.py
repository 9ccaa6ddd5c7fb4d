"""Benchmark and training loops for any RecurrentClassifier (the RNN and the GRU share them).

A *variant* is what a line of Fig 8 stands for: ``baseline`` (autograd; cuDNN's RNN/GRU on GPU),
``baseline-packed`` (the same fed as a PackedSequence, which makes cuDNN use the per-step algorithm the
paper's 2020 baseline had) or ``bppsa-<layout>`` (the scan backward).  Phases: forward, jacobian (BPPSA
only), backward, optimizer.  Mode ``nobp`` skips everything after the forward, for the paper's
subtraction.  ``time_interleaved`` times every variant and mode of one configuration in one process,
round by round, under the shared protocol (``bench.protocol``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace

import numpy as np
import torch
from tqdm import tqdm

from ..jacobians.recurrent import LAYOUTS
from ..models import copy_model
from ..models.recurrent import no_phase
from .protocol import TOTAL, Measurement, StopRule, interleave
from .timing import GraphedStep, PhaseTimer, backward_seconds

METHODS = ("baseline", "bppsa")
BASELINES = ("baseline", "baseline-packed")
VARIANTS = BASELINES + tuple(f"bppsa-{layout}" for layout in LAYOUTS)
NOBP = "nobp"


def parse_variant(v: str) -> tuple[str, str, bool]:
    """(method, layout, packed) of a variant name; a clear error for anything else."""
    if v in BASELINES:
        return "baseline", "", v == "baseline-packed"
    if v.startswith("bppsa-") and v.split("-", 1)[1] in LAYOUTS:
        return "bppsa", v.split("-", 1)[1], False
    raise ValueError(f"unknown variant '{v}' (choose from {', '.join(VARIANTS)})")


def baseline_backend_name(device: torch.device, packed: bool = False) -> str:
    if torch.device(device).type == "cuda" and torch.backends.cudnn.is_available():
        return "cudnn-per-step" if packed else "cudnn"
    return "autograd-packed" if packed else "autograd"


def compiled_forward_here(model, x) -> bool:
    """Whether the backend's own forward (``forward="auto"``) runs a compiled kernel for ``model`` on ``x``, not
    torch's (no C compiler, another device or dtype: :meth:`bppsa.backends.cpu.CpuBackend.forward` says None)."""
    from ..nn.backward import backend_for

    w = model.cell.layer_weights(0)
    return backend_for("auto", x.device).forward(model.cell.cell.kernel, x[:1], (None, None), w.tensors()) is not None


def train_step(model, x, y, method: str, backend=None, layout: str = "fused", L_m=None,
               optimizer=None, timer: PhaseTimer | None = None, backward: bool = True,
               packed: bool = False, forward: str = "torch") -> torch.Tensor:
    """One training iteration; phases are timed when a timer is given.

    ``forward``: the BPPSA layer's forward, "torch" (the baseline's own kernels: the paper's overall speedups
    compare the backward with the same forward on both sides) or "auto" (the backend's own forward, the CPU's
    compiled kernel: the ``-compiled`` variants, measured beside the paper's comparison, never in it)."""
    phase = timer.phase if timer is not None else no_phase
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if method == "baseline":
        loss = model.baseline_step(x, y, phase=phase, backward=backward, packed=packed)
    elif method == "bppsa":
        loss = model.bppsa_step(x, y, backend, layout, L_m, phase=phase, backward=backward, forward=forward)
    else:
        raise ValueError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
    if backward and optimizer is not None:
        with phase("optimizer"):
            optimizer.step()
    return loss


def time_interleaved(make_model: Callable[[], torch.nn.Module],
                     batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]], variants: Sequence[str],
                     rule: StopRule, *, device, backend=None, L_m=None, lr: float = 1e-3, nobp: bool = True,
                     desc: str = "", graphed: bool = False) -> tuple[list[dict], Measurement]:
    """Time every variant (and its forward-only twin) of one configuration, interleaved.

    ``make_model()`` must return the same initial weights on every call; each variant trains its
    own copy with its own optimizer, and round i gives every variant ``batches(i)``.  The stop rule
    holds the backward and the whole iteration of every full-mode variant, and their paired ratios
    to the first variant (the reference, normally ``baseline``), to ``rule.rel_ci``.
    Returns tidy rows (variant, mode, iter, phase, seconds) and the Measurement.

    ``graphed``: every variant's iteration is captured phase by phase in CUDA graphs (:class:`GraphedStep`, Adam
    made ``capturable``) and replayed on static inputs that each round's batch is copied into, so the phases
    are the device's time with no host work per launch (cuDNN graphed as BPPSA is).  Each full-mode graph is
    first checked against an eager step from the same weights on the same batch (the dtype's tolerance).
    """
    if not variants:
        raise ValueError("time_interleaved: no variants")
    if graphed and torch.device(device).type != "cuda":
        raise ValueError(f"graphed timing captures CUDA graphs and needs a CUDA device, got '{device}'")
    timer = PhaseTimer(device)
    methods: dict[str, Callable[[int], dict[str, float]]] = {}
    full = []
    for v in variants:
        method, layout, packed = parse_variant(v)
        if method == "bppsa" and backend is None:
            raise ValueError(f"variant {v} needs a BPPSA backend")
        for mode in ("full", NOBP) if nobp else ("full",):
            model = make_model()
            if graphed:
                run = _graphed_run(make_model, model, batches, v, method, backend, layout or "fused", L_m, lr,
                                   mode == "full", packed)
            else:
                opt = torch.optim.Adam(model.parameters(), lr=lr)

                def run(i, model=model, opt=opt, method=method, layout=layout, packed=packed, mode=mode):
                    x, y = batches(i)
                    timer.sync()
                    # torch's forward on both sides: Fig 8/9's speedups are the paper's comparison
                    train_step(model, x, y, method, backend, layout or "fused", L_m, opt, timer,
                               backward=(mode == "full"), packed=packed, forward="torch")
                    return timer.collect()

            key = v if mode == "full" else f"{v}@{NOBP}"
            methods[key] = run
            if mode == "full":
                full.append(key)
    bar = tqdm(desc=desc or "bench", unit="round", leave=False)

    def progress(n, spent):
        bar.update(1)

    m = interleave(methods, rule, reference=full[0], metric=[backward_seconds, TOTAL], compare=full[1:],
                   progress=progress)
    bar.close()
    rows = []
    for r in m.rows:
        v, _, mode = r["method"].partition("@")
        rows.append({"variant": v, "mode": mode or "full", "iter": r["iter"], "phase": r["phase"],
                     "seconds": r["seconds"]})
    return rows, m


def _graphed_run(make_model, model, batches, variant: str, method: str, backend, layout: str, L_m, lr: float,
                 backward: bool, packed: bool) -> Callable[[int], dict[str, float]]:
    """``run(i)`` for :func:`time_interleaved`'s graphed timing: ``model``'s iteration captured (a full one checked
    against an eager step first), each round's batch copied into the static inputs, the graphs replayed."""
    from ..precision import TOLERANCE

    x0, y0 = batches(0)
    sx, sy = x0.clone(), y0.clone()
    opt = torch.optim.Adam(model.parameters(), lr=lr, capturable=True)
    timer = SimpleNamespace(phase=None)  # what train_step reads: the phase of the capture (or of the warm-up)

    def step(phase):
        timer.phase = phase
        train_step(model, sx, sy, method, backend, layout, L_m, opt, timer, backward=backward, packed=packed)

    try:
        graphs = GraphedStep(step)
    except Exception as exc:
        raise RuntimeError(f"variant {variant}: its training step could not be captured in CUDA graphs: "
                           f"{exc}") from exc
    if backward:  # the graph against an eager step from the same weights, on the same batch
        weights = {k: t.detach().clone() for k, t in model.state_dict().items()}
        graphs.replay()
        got = [p.grad.detach().clone() for p in model.parameters()]
        eager = make_model()
        eager.load_state_dict(weights)
        train_step(eager, sx, sy, method, backend, layout, L_m, backward=True, packed=packed)
        err = max(float((a - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30))
                  for a, b in zip(got, eager.parameters()))
        tol = TOLERANCE[str(got[0].dtype).removeprefix("torch.")]
        if not err <= tol:
            raise RuntimeError(f"variant {variant}: the graphed step's gradients differ from an eager step's by "
                               f"{err:.2e} (relative), beyond {tol:.0e}")

    def run(i: int) -> dict[str, float]:
        x, y = batches(i)
        sx.copy_(x)
        sy.copy_(y)
        return graphs.replay()

    return run


def warm_up(model, batch: tuple[torch.Tensor, torch.Tensor], method: str, *, lr: float, steps: int = 2,
            backend=None, layout: str = "fused", L_m=None, device=None, forward: str = "torch") -> None:
    """Untimed training steps on a throw-away copy of the model and optimizer.

    The first iterations of a process pay one-time costs (lazy initialisation, allocator growth, kernel
    selection, code paths JIT-compiled on first use); charged to whichever method's first epoch ran
    first, they made Fig 13's first baseline epoch 20x its others.  The copy leaves the model's
    weights, and so both methods' starting point, untouched.
    """
    scratch = copy_model(model)
    opt = torch.optim.Adam(scratch.parameters(), lr=lr)
    x, y = batch
    for _ in range(steps):
        train_step(scratch, x, y, method, backend, layout, L_m, opt, forward=forward)
    PhaseTimer(device or x.device).sync()
    del scratch, opt


def train_epochs(model, n_samples: int, batch_size: int, get_batch: Callable[[np.ndarray], tuple],
                 method: str, *, device, epochs: int, lr: float, seed: int = 0, backend=None,
                 layout: str = "fused", L_m=None, desc: str = "", forward: str = "torch") -> Iterator[dict]:
    """Train for ``epochs``; yield one row per epoch with the training loss/accuracy and wall-clock.

    ``wall_clock_s`` is the cumulative time spent in training steps (device-synchronised), the
    x-axis of Fig 7 / Fig 13; the loss/accuracy are the means over the epoch's batches.  ``forward``: BPPSA's
    forward (:func:`train_step`); the epoch's accuracy is always the baseline forward's, which is not timed.
    """
    rng = np.random.default_rng(seed)  # the same batch order for both methods
    warm_up(model, get_batch(np.arange(min(batch_size, n_samples))), method, lr=lr, backend=backend,
            layout=layout, L_m=L_m, device=device, forward=forward)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
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
            loss = train_step(model, x, y, method, backend, layout, L_m, optimizer, forward=forward)
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
