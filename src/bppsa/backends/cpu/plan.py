"""How the CPU fast path's team of threads shares one scan: the plan, chosen per shape on the user's CPU.

A plan (:class:`Plan`) says how wide the lane slices are, whether each thread owns whole slices or the threads
share each slice's blocks, how many threads and down-phase parts, and how many up-sweep levels each block fuses.
It is chosen the way FFTW's planner and Triton's autotuner choose: :func:`candidates` lists a few plans,
pruned by a FLOP model of the team (:func:`predict`); at first use for a shape, :func:`choose` times them on
synthetic chains of that shape in this process (paired rounds, the fastest median wins) and stores the winner
beside the kernels (``<cache>/plans/<build key>.json``: the key of the kernel builds -- source, flags, compiler,
CPU -- plus the shape and the thread count), so later processes reuse it.  ``BPPSA_PLAN=estimate`` skips the
measuring and takes the model's rules (:func:`estimate`: deterministic, the same on every machine of one ISA).

Which plan runs changes no scan result but the fused levels' (a different tree): the parameter gradients' sums
over slices and parts are added in another order, within the exactness bounds every plan is tested to.
The CUDA side's counterpart is :mod:`bppsa.backends.cuda.plan`.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ...stats import balanced_orders
from . import native

__all__ = ["Plan", "MIN_CHUNK_FLOP", "KERNEL_SPEEDUP", "MAX_THREADS", "fused_levels", "lane_slices", "estimate",
           "candidates", "predict", "choose", "team_for", "mode", "auto_levels"]

# A chunk handed to another thread must carry enough work to repay the hand-off (~20-50 us), at the rate of
# numpy's small GEMMs (~50 GFLOP/s); the compiled kernel runs ~KERNEL_SPEEDUP times faster.
MIN_CHUNK_FLOP = 2_000_000
KERNEL_SPEEDUP = 5
MAX_THREADS = 64  # a team's threads at most (chain_scan.c's team_go)
GRU_LANE_BYTES = 32  # the GRU's estimated slice: a block's product and its Jacobian (2 H^2 lanes) stay in L1
# The LSTM's too: each row of a block's product reads the step's two HC x HC blocks (A, Bm: 2 HC^2 lanes, 25.6 KB at
# HC = 20 with 8 fp32 lanes), which stay in a 32 KiB L1 only at 32 bytes.
LSTM_LANE_BYTES = 32
# An up step's multiply-adds per lane in units of H^3 (H the chain's state): the GRU's three weight products, the
# LSTM's [M_h A + M_c diag(f a), M_h Bm + M_c diag(f)] of 4 HC^3 = H^3 / 2 (its tree's products are dense, H^3).
UP_WORK = {"rnn": 1, "paper": 1, "gru": 3, "lstm": 0.5}
# A slice's down phase in this many units, each with its own gradient sums: where the slice's owner is held up
# (a busy host), another thread takes a share of it instead of waiting.
SLICE_PARTS = 4
MODES = ("measure", "estimate")
MEASURE_SECONDS = 0.4  # time spent measuring one shape's candidates, at most (after three rounds)
MEASURE_ROUNDS = (3, 15)
HANDOFF_FMA = 20_000  # a thread's start and hand-offs, in the model's vector multiply-adds (~10 us at ~2 per ns)
KEEP_ESTIMATE = 1.03  # a measured plan replaces the estimate only where it is faster than this, not by noise
# The chains whose team also writes their factors (the gate pass, in units of steps on every thread of the team):
# the synthetic chains the plans are timed on hold no gate pass, so a plan of fewer threads is no candidate for them
# (one thread beat two by 7 % on synthetic GRU chains, T = 1000, B = 16, and made the layer's backward 1.35x slower).
GATE_PASS = ("gru", "lstm")
STORE_VERSION = 2  # part of every stored plan's key: a plan chosen under other rules is measured again


@dataclass(frozen=True)
class Plan:
    """``lanes``: the widest slice; ``by_slice``: each thread owns whole slices (else the threads share every
    slice's blocks); ``threads`` of the team; ``parts``: the units of each slice's down phase;
    ``fused``: up-sweep levels fused per block; ``source``: ``estimate`` or ``measured``."""

    lanes: int
    by_slice: bool
    threads: int
    parts: int
    fused: int
    source: str = "estimate"

    def groups(self, B: int) -> list[list[tuple[int, int]]]:
        """The lane slices ``(b0, lanes)`` of each thread (by slice), or the one list every thread shares."""
        return lane_slices(B, self.threads if self.by_slice else 1, self.lanes)

    def describe(self) -> str:
        split = "slices" if self.by_slice else "blocks"
        return (f"{self.lanes} lanes, {split}, {self.threads} thread{'s' * (self.threads > 1)}, "
                f"{self.parts} down part{'s' * (self.parts > 1)}, {self.fused} fused levels ({self.source})")


def mode() -> str:
    """``$BPPSA_PLAN``: ``measure`` (the default) or ``estimate``."""
    m = os.environ.get("BPPSA_PLAN", "").strip() or "measure"
    if m not in MODES:
        raise ValueError(f"BPPSA_PLAN={m!r}: use one of {', '.join(MODES)}")
    return m


def fused_levels(n: int) -> int:
    """Up-sweep levels the kernel computes per block in cache for a chain of ``n`` Jacobians (blocks of 2^c,
    see chain_scan.c): from 4 up to 6, the most that leave at least 8 blocks to the tree above them.  Each
    level fused saves storing and re-reading a level; the tree's products over the blocks cost as much as a
    block's, so fewer, longer blocks do less work (measured: docs/measurements.md, "Measurements the code
    cites")."""
    return max(4, min(6, n.bit_length() - 4))


def lane_slices(B: int, p: int, max_lanes: int) -> list[list[tuple[int, int]]]:
    """Split the batch into slices ``(b0, lanes)`` of one power-of-two width, the last one narrower where the width
    does not divide B (the kernel built for the width runs it with spare lanes: one build serves every slice),
    grouped into at most p lists of about equal lanes.  The width is the least that gives each of the p threads
    one slice (a vector operation costs the same however many of its lanes are used), at most ``max_lanes``."""
    cap = 1
    while cap < min(max_lanes, -(-B // p)):
        cap *= 2
    slices = [(b0, min(cap, B - b0)) for b0 in range(0, B, cap)]
    groups: list[list[tuple[int, int]]] = [[] for _ in range(min(p, len(slices)))]
    for s in sorted(slices, key=lambda s: -s[1]):  # largest first, each to the least loaded thread
        min(groups, key=lambda gr: sum(w for _, w in gr)).append(s)
    return groups


def _widest(kind: str, dtype: torch.dtype) -> int:
    return native.lane_width(kind, dtype)


def estimate(kind: str, n: int, B: int, H: int, dtype: torch.dtype, split: str, threads: int) -> Plan:
    """The plan by rule, without measuring.  Slices for every thread where each gets a whole vector register of
    lanes, or one batch element (whose blocks then fill the lanes); narrower ones waste the vector units, so the
    threads share the blocks of full-width slices instead (measured: docs/measurements.md, "Measurements the code
    cites").  The sequential rival's chains cannot share blocks: it takes
    slices of at least 32 bytes, or one thread.  ``split``: ``auto``, or ``slices`` / ``blocks`` only."""
    min_flop = KERNEL_SPEEDUP * MIN_CHUNK_FLOP  # the same hand-off, repaid only by more of the kernel's FLOP
    threads = min(threads, MAX_THREADS)
    up = H ** 3 * (UP_WORK["lstm"] if kind == "lstm" else 1)  # (the GRU's rule predates UP_WORK: kept as measured)
    p = threads if split == "slices" else min(threads, max(1, int(n * B * 2 * up // min_flop)))
    vl = _widest(kind, dtype)
    if kind in ("gru", "lstm"):
        vl = min(vl, max(1, (GRU_LANE_BYTES if kind == "gru" else LSTM_LANE_BYTES) // dtype.itemsize))
    wide_enough = B <= p or B >= p * (vl if split == "auto" else max(1, 32 // dtype.itemsize))
    by_slice = split == "slices" or (split == "auto" and wide_enough)
    if split == "slices" and not wide_enough:
        p = 1  # narrower slices would cost more than the second thread brings (the same measurements)
    # the down phase is ~H times lighter than the up phase: split only where it repays a hand-off
    parts = SLICE_PARTS if by_slice else min(p, max(1, int(n * B * (2 * H * H + H) // min_flop)))
    return Plan(vl, by_slice, p, parts, fused_levels(n))


def predict(kind: str, n: int, B: int, H: int, L: int, plan: Plan) -> float:
    """The plan's time by the FLOP model, in vector multiply-adds on the busiest thread (a vector op costs the
    same however many of its lanes are used): the up phase's UP_WORK H^3 per step and slice (H the chain's state),
    the tree's dense products over the blocks, the down phase's H^2, the serial spine and middle, and a hand-off per
    thread."""
    groups = plan.groups(B)
    slices = sum(len(g) for g in groups)
    per_slice_up = n * H ** 3 * UP_WORK[kind]
    c = min(plan.fused, L)
    blocks = n >> c if L else 0
    tree = 2 * blocks * H ** 3
    down = n * H * H * (3 if kind == "gru" else 1)
    serial = ((1 << c) + blocks) * H * H if L else n * H * H
    if plan.by_slice:
        busiest = max(len(g) for g in groups)
        t = busiest * (per_slice_up + tree + down + serial) if L else busiest * serial
    else:
        t = slices * ((per_slice_up + tree) / plan.threads + down / plan.parts + serial)
    return t + HANDOFF_FMA * (plan.threads - 1)


def candidates(kind: str, n: int, B: int, H: int, L: int, dtype: torch.dtype, split: str, threads: int,
               keep: float = 1.6, most: int = 6) -> list[Plan]:
    """The plans worth timing: the estimate, then every slice width (one register, half of one), split, thread
    count (all, one; all only for the chains with a gate pass, :data:`GATE_PASS`) and fused depth (the estimate's,
    one less) whose predicted time is within ``keep`` of the best prediction, the ``most`` best-predicted of them."""
    base = estimate(kind, n, B, H, dtype, split, threads)
    threads = min(threads, MAX_THREADS)
    widest = _widest(kind, dtype)
    widths = sorted({w for w in (widest, widest // 2, base.lanes) if w >= 1}, reverse=True)
    fused = sorted({base.fused, max(4, base.fused - 1)}, reverse=True) if L else [base.fused]
    splits = {"slices": (True,), "blocks": (False,)}.get(split, (True, False))
    plans = {base}
    for w in widths:
        for by_slice in splits:
            for p in sorted({threads} if kind in GATE_PASS else {threads, 1}, reverse=True):
                for c in fused:
                    parts = SLICE_PARTS if by_slice else p
                    plans.add(Plan(w, by_slice, p, parts, c))
    # plans that run the same slices on the same threads are one plan
    unique: dict = {}
    for pl in sorted(plans, key=lambda pl: pl != base):
        sig = (tuple(map(tuple, pl.groups(B))), pl.by_slice or pl.threads == 1, pl.threads, pl.parts, pl.fused)
        unique.setdefault(sig, pl)
    scored = sorted(unique.values(), key=lambda pl: (predict(kind, n, B, H, L, pl), pl != base))
    best = predict(kind, n, B, H, L, scored[0])
    kept = [pl for pl in scored if predict(kind, n, B, H, L, pl) <= keep * best][:most]
    kept = [pl for pl in kept if pl != base]
    return [base] + kept[:most - 1]  # the estimate first (_measure keeps it unless another is clearly faster)


# -- the measured plans, kept beside the kernels ------------------------------------------------------------

_chosen: dict = {}


def _store_path() -> str | None:
    key = native.build_key()
    return None if key is None else str(native.cache_dir() / "plans" / f"{key}.json")


def _shape_key(kind, n, B, H, I, dtype, L, split, grads, threads) -> str:
    return f"{kind} n={n} B={B} H={H} I={I} {str(dtype).removeprefix('torch.')} L={L} {split} grads={int(grads)} " \
           f"threads={threads} v{STORE_VERSION}"


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or damaged: measured again and rewritten


def _save(path: str, key: str, entry: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _load(path)
        data[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def _measure(make, L, grads, plans: list[Plan]) -> tuple[Plan, dict]:
    """Time each plan's team on the synthetic chain ``make()`` returns (with its ∇h_T), in interleaved rounds
    (a Williams design: each plan at every place, and after every other, equally often); the fastest median wins."""
    chain, g = make()
    n, B, H, _ = chain.shape
    dtype = chain.dtype
    teams = [_team(chain, L, pl, grads) for pl in plans]
    src = chain.states if chain.states is not None else chain._f
    out = None if grads else torch.empty((n, B, H), dtype=dtype)
    times: list[list[float]] = [[] for _ in plans]
    orders = balanced_orders(len(plans))
    t_end = time.perf_counter() + MEASURE_SECONDS
    for r in range(MEASURE_ROUNDS[1]):
        for i in orders[r % len(orders)]:
            if teams[i] is None:
                continue
            t0 = time.perf_counter()
            teams[i].go(chain._W, src, g, out)
            if r:  # the first round warms the kernels and caches up
                times[i].append(time.perf_counter() - t0)
        if r >= MEASURE_ROUNDS[0] and time.perf_counter() > t_end:
            break
    med = [statistics.median(ts) if ts else float("inf") for ts in times]
    best = min(range(len(plans)), key=lambda i: med[i])
    if med[0] <= KEEP_ESTIMATE * med[best]:  # plans[0] is the estimate: kept unless another is clearly faster
        best = 0
    return dataclasses.replace(plans[best], source="measured"), {
        "candidates": [{**dataclasses.asdict(pl), "median_ms": round(m * 1e3, 4), "rounds": len(ts)}
                       for pl, m, ts in zip(plans, med, times)]}


def choose(kind: str, n: int, B: int, H: int, I: int, dtype: torch.dtype, L: int, split: str, grads: bool,
           threads: int, make=None) -> Plan:
    """The plan for scans of this shape: measured once per build key and shape (``BPPSA_PLAN=measure``, the
    default) and reused, within this process and from the store beside the kernels; or :func:`estimate`.
    ``make()``: a synthetic chain of the shape and its ∇h_T, to measure on (a chain's
    :func:`.chain.synthetic`; None: nothing to measure on, the estimate)."""
    threads = min(threads, MAX_THREADS)
    if mode() == "estimate" or make is None:
        return estimate(kind, n, B, H, dtype, split, threads)
    key = _shape_key(kind, n, B, H, I, dtype, L, split, grads, threads)
    path = _store_path()
    if (path, key) in _chosen:
        return _chosen[(path, key)]
    entry = _load(path).get(key) if path else None
    plan = None
    if entry:
        try:
            plan = Plan(**{f.name: entry["plan"][f.name] for f in dataclasses.fields(Plan)})
        except (KeyError, TypeError):
            plan = None  # an entry of another version: measured again
    if plan is None:
        plans = candidates(kind, n, B, H, L, dtype, split, threads)
        if len(plans) == 1:
            plan = plans[0]
        else:
            plan, record = _measure(make, L, grads, plans)
            if path:
                try:
                    _save(path, key, {"plan": dataclasses.asdict(plan), **record})
                except OSError:
                    pass  # an unwritable cache: the plan holds for this process
    _chosen[(path, key)] = plan
    return plan


def _team(chain, L: int, plan: Plan, grads: bool, affine: bool = False):
    n, B, H, _ = chain.shape
    groups = plan.groups(B)
    act = getattr(chain, "act", "tanh")
    if native.library(chain.kind, H, native.build_lanes(groups), chain.dtype, act) is None:
        return None
    return native.Team(chain.kind, n, B, H, chain.I, chain.dtype, L, groups, plan.by_slice, plan.threads,
                       plan.parts, int(grads), chain.grad_layout() if grads else None, fused=plan.fused,
                       affine=affine, act=getattr(chain, "act", "tanh"))


def team_for(chain, L: int, split: str, grads: bool, threads: int, affine: bool = False, synthetic=None):
    """The kernel's team (:class:`.native.Team`) for scans of chains like ``chain`` under the plan
    :func:`choose` picks (``affine``: one that takes the loss's per-step gradients, under the same plan;
    ``synthetic(kind, n, B, H, I, dtype)``: the chain and ∇h_T a plan is measured on); None where the kernel is
    unavailable."""
    if not native.available():
        return None
    n, B, H, _ = chain.shape
    example = None if synthetic is None else functools.partial(synthetic, chain.kind, n, B, H, chain.I, chain.dtype)
    plan = choose(chain.kind, n, B, H, chain.I, chain.dtype, L, split, grads, threads, example)
    return _team(chain, L, plan, grads, affine)


# -- the tree's depth for L_m = "auto" ---------------------------------------------------------------------------

def auto_levels(kind: str, B: int, dtype: torch.dtype, threads: int) -> int | None:
    """``L_m = "auto"``'s depth, by rule: the linear scan (0) where its lane slices give every thread one, else the
    full tree (None), whose blocks the threads the batch leaves idle can share.  Measured on two threads of an
    AVX-512 Xeon, T = 1000, H = 20, fp32 (docs/cpu-fast-path.md, "The depth, L_m auto"): wherever the batch fills the
    threads the linear scan's backward is 1.0-4.4x faster than the full tree's; at B = 1 on two threads the tree is
    1.4x faster for the GRU, 1.3x slower for the RNN, even for the LSTM.  (Not timed at first use as the plans are:
    the synthetic chains they are timed on hold no gate pass, which is what the tree's threads share at B = 1.)"""
    threads = min(threads, MAX_THREADS)
    return 0 if len(lane_slices(B, threads, _widest(kind, dtype))) >= threads else None
