"""Timing CNN training through BPPSA (``bppsa.nn.Sequential``) against autograd, the project's way.

* :func:`time_training`: both methods interleaved round by round (:func:`bppsa.bench.protocol.interleave`), each
  with its own copy of the network and optimizer, the same batch in a round; one iteration's phases: ``forward``,
  ``backward`` and ``optimizer``, and inside BPPSA's backward ``jacobian`` (generating the layers' transposed
  Jacobians), ``scan`` (the modified Blelloch scan's sparse products) and ``param_grads`` (each layer's parameter
  gradients), so that the phases add up to the iteration (:class:`bppsa.bench.timing.PhaseTimer`).  Pruned
  networks keep their masks after every step (and BPPSA drops the pruned zeros from its Jacobians).
* :func:`profile_steps`: a few further BPPSA iterations with every scan product timed on its own (a device
  synchronisation after each), with its level, positions and non-zeros;
* :func:`static_step_flops`: the FLOP of each of those products by the static analysis of Fig 10
  (:func:`bppsa.flops.scan_with_flops`) on the same chain for one sample, so that time per step can be set
  against FLOP per step.
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import flops as fl
from .. import nn as bnn
from ..jacobians import operators
from ..models import vgg
from ..models.cnn import lenet5, vgg11_chain
from .protocol import StopRule, interleave
from .timing import PhaseTimer

__all__ = ["METHODS", "Network", "network", "profile_steps", "static_step_flops", "time_training"]

METHODS = ("autograd", "bppsa")
SCAN_PHASES = {"jacobian": "jacobian", "scan": "scan", "params": "param_grads"}
BACKWARD_PHASES = ("backward", "jacobian", "scan", "param_grads")


class Network:
    """A chain of layers (``nn.Sequential``) and, for a pruned network, its masks keyed by the chain's names."""

    def __init__(self, chain: nn.Sequential, masks: dict[str, torch.Tensor] | None, label: str):
        self.chain, self.masks, self.label = chain, masks, label

    def copy(self) -> Network:
        return Network(copy.deepcopy(self.chain), self.masks, self.label)


def network(model: str, *, width: float = 1.0, prune: float = 0.0, scheme: str = "class-uniform",
            checkpoint: str | None = None, seed: int = 0) -> Network:
    """``lenet5``; or ``vgg11``: the pruned-retrained VGG-11 of a ``vgg11-train`` checkpoint, or (no checkpoint) a
    freshly initialised one of ``width`` pruned by magnitude to ``prune``."""
    torch.manual_seed(seed)
    if model == "lenet5":
        return Network(lenet5(), None, "LeNet-5")
    if model != "vgg11":
        raise ValueError(f"unknown model '{model}' (lenet5 or vgg11)")
    if checkpoint:
        ck = torch.load(checkpoint, map_location="cpu", weights_only=True)
        net = vgg.VGG11(width=ck["width"])
        net.load_state_dict(ck["pruned"])
        masks, width, prune = ck["masks"], ck["width"], ck["prune"]
        label = f"pruned-retrained VGG-11 (width {width:g}, {100 * prune:g} % pruned, {checkpoint})"
    else:
        net = vgg.VGG11(width=width)
        masks = vgg.magnitude_masks(net, prune, scheme)
        vgg.apply_masks(net, masks)
        label = f"VGG-11 width {width:g}, untrained, {100 * prune:g} % pruned by magnitude ({scheme})"
    chain = vgg11_chain(net)
    names = {id(p): n for n, p in chain.named_parameters()}
    own = dict(net.named_parameters())
    return Network(chain, {names[id(own[k])]: m.bool() for k, m in masks.items()} if prune else None, label)


class _Phases:
    """``bppsa.nn.Sequential.recorder`` timing the backward's parts as phases of the iteration's PhaseTimer."""

    per_product = False

    def __init__(self, timer: PhaseTimer):
        self.timer = timer

    def phase(self, like, what, **info):
        return self.timer.phase(SCAN_PHASES[what])


@torch.no_grad()
def _apply(chain: nn.Sequential, masks) -> None:
    if masks:
        params = dict(chain.named_parameters())
        for name, m in masks.items():
            params[name].mul_(m.to(params[name].device, params[name].dtype))


def _trainer(net: Network, method: str, *, device, dtype, lr: float, momentum: float, L_m, drop_zeros: bool):
    chain = net.copy().chain.to(device=device, dtype=dtype)
    if method == "bppsa":
        chain = bnn.Sequential.from_torch(chain, L_m=L_m, drop_zeros=drop_zeros)
    elif method != "autograd":
        raise ValueError(f"unknown method '{method}' ({', '.join(METHODS)})")
    opt = torch.optim.SGD(chain.parameters(), lr=lr, momentum=momentum)
    return chain, opt


def _step(chain, opt, xb, yb, timer: PhaseTimer, masks) -> torch.Tensor:
    with timer.phase("forward"):
        loss = F.cross_entropy(chain(xb), yb)
    with timer.phase("backward"):
        opt.zero_grad(set_to_none=True)
        loss.backward()
    with timer.phase("optimizer"):
        opt.step()
        _apply(chain, masks)  # momentum would revive pruned weights
    return loss.detach()


def backward_total(phases) -> float | None:
    """The backward as the paper counts it: autograd's, or BPPSA's with its Jacobian generation and parameter
    gradients (None for an iteration without one)."""
    if "backward" not in phases:
        return None
    return float(sum(phases.get(p, 0.0) for p in BACKWARD_PHASES))


def time_training(net: Network, batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]], rule: StopRule, *,
                  device, dtype=torch.float32, lr: float, momentum: float = 0.9, L_m=None, drop_zeros: bool = True,
                  methods=METHODS, progress=None):
    """Autograd and BPPSA training steps interleaved until ``rule`` stops them (``batches(i)``: round i's batch).

    Returns ``(rows, measurement, losses)``: tidy rows (method, iter, phase, seconds), the protocol's
    :class:`~bppsa.bench.protocol.Measurement` (reference: autograd; stable: the iteration and the backward), and
    each method's training loss per timed round."""
    timer = PhaseTimer(device)
    losses: dict[str, list[float]] = {m: [] for m in methods}
    fns = {}
    for method in methods:
        chain, opt = _trainer(net, method, device=device, dtype=dtype, lr=lr, momentum=momentum, L_m=L_m,
                              drop_zeros=drop_zeros)
        if method == "bppsa":
            chain.recorder = _Phases(timer)

        def fn(i, chain=chain, opt=opt, method=method):
            xb, yb = batches(i)
            loss = _step(chain, opt, xb, yb, timer, net.masks)
            phases = timer.collect()
            losses[method].append(float(loss))
            return phases

        fns[method] = fn
    m = interleave(fns, rule, reference=methods[0], metric=("total", backward_total), progress=progress)
    for method in methods:  # the warm-up rounds' losses are not the timed rounds'
        losses[method] = losses[method][-m.iters:]
    return m.rows, m, losses


def profile_steps(net: Network, batches, iterations: int, *, device, dtype=torch.float32, lr: float,
                  momentum: float = 0.9, L_m=None, drop_zeros: bool = True) -> list[dict]:
    """``iterations`` BPPSA training steps with every Jacobian generation, scan product and parameter gradient
    timed on its own (a synchronisation after each: slower than :func:`time_training`'s iterations, which is why
    these are separate).  One row per timed part and iteration."""
    chain, opt = _trainer(net, "bppsa", device=device, dtype=dtype, lr=lr, momentum=momentum, L_m=L_m,
                          drop_zeros=drop_zeros)
    rows = []
    for it in range(iterations):
        rec = bnn.Recorder()
        chain.recorder = rec
        xb, yb = batches(it)
        loss = F.cross_entropy(chain(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        _apply(chain, net.masks)
        rows += [dict(r, iteration=it) for r in rec.rows]
    return rows


def static_step_flops(net: Network, x: torch.Tensor, y: torch.Tensor, *, L_m=None, drop_zeros: bool = True,
                      dtype=torch.float64) -> list[dict]:
    """The static analysis of Fig 10 for the chain ``bppsa.nn.Sequential`` scans (layers 1..n-1, then the empty
    last position), at one sample ``x`` with its label ``y``: one row per scan product (phase, d, l, r, kind,
    flop, nnz of the operands and the result).  FLOP as :func:`bppsa.flops.product_flop` counts them."""
    chain = net.copy().chain.to(dtype=dtype)
    with torch.no_grad():
        acts = [x.to(dtype)[None]]
        ops = operators.check_supported(chain.named_children())
        extra = []
        for op, m in zip(ops, chain):
            out, c = op.forward(m, acts[-1])
            acts.append(out)
            extra.append(c)
    out = acts[-1].detach().requires_grad_(True)
    (g,) = torch.autograd.grad(F.cross_entropy(out, y.reshape(1)), out)
    J = [operators.to_scipy(ops[i].jacobian_t(chain[i], acts[i], acts[i + 1], extra[i], drop_zeros=drop_zeros))
         for i in reversed(range(1, len(chain)))]
    import scipy.sparse as sp

    J.append(sp.csr_matrix((1, J[-1].shape[0] if J else g.numel())))
    _, ops_rec = fl.scan_with_flops(g.detach().numpy().reshape(-1).astype(np.float64), J, L_m)
    return [dict(phase=o.phase, d=o.d, l=o.l, r=o.r, kind=o.kind, flop=o.flop, nnz_a=o.nnz_a, nnz_b=o.nnz_b,
                 nnz_out=o.nnz_out, m=o.m, k=o.k, n=o.n) for o in ops_rec]
