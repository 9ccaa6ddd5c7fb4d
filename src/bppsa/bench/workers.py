"""BPPSA with the sequence split over p processes against the pipeline on the same split: backward time and peak
memory per rank (``bppsa workers``; docs/distributed.md).

**Time** (:func:`time_rows`): one spawn of max(ps) processes on 127.0.0.1 in a gloo group, one torch thread each;
the groups of the first p ranks run each p.  Every round runs, after a barrier, every (p, method) once, the rounds'
orders a Williams design (:func:`bppsa.stats.balanced_orders`), so the methods are paired by round:

* ``bppsa``: :class:`bppsa.nn.RNN` with ``process_group`` (backend ``cpu``): its forward the layer's default, the
  Jacobi sweeps over the ranks (every slice at once from a guess, reruns until the trajectories meet; the serial
  hand-off from its next call on where they did not pay), its backward local up-sweeps, the ranks' scan, local
  down-sweeps, the weights' gradients all-reduced;
* ``bppsa-handoff`` (p > 1; at p = 1 it is ``bppsa``): the same layer with ``parallel_forward=False``, whose forward
  is always the serial hand-off (rank r waits for rank r - 1's end state), the same backward;
* ``pipeline``: the same split as the stages of ``torch.distributed.pipelining``'s GPipe schedule
  (:mod:`bppsa.bench.gpipe`): stage r is ``torch.nn.RNN`` over rank r's slice of T, the ``micro_batches``
  micro-batches split the batch (B / m sequences each), stage r runs micro-batch k while stage r + 1 runs k - 1;
  the states (and their gradients) cross the wire, each rank's slice of x stays on it; autograd back-propagates
  each stage, the weights' gradients all-reduced after the schedule's ``step()``.  ``backward_s``: from a barrier
  the schedule reaches on every rank at its first backward (all forwards done) to the all-reduce's end;
  ``fwd_bwd_s``: from a barrier before ``step()`` to the same end;
* ``threads``: one process (rank 0) running the single-process layer on the CPU kernel with ``threads`` torch
  threads (recorded at p = 1): the in-process parallel BPPSA the split is compared with;
* ``sequential``: one process, one thread, the single-process layer with ``L_m = 0``: the linear scan through the
  same kernel, back-propagation built with the care BPPSA gets (recorded at p = 1).  ``bppsa`` at p = 1 is the
  layer at its default ``L_m="auto"``, which on one thread is that linear scan too (the full tree would do ~H times
  its work), so the p = 1 rows of the two agree;
* ``scan-rounds``, ``scan-allgather`` (p > 1): :func:`bppsa.distributed.rank_scan` alone with either strategy on
  one [B, H, H] summary per rank, to choose the default per p (``ALLGATHER_UP_TO``).

Each rank records its own backward wall time, ``backward_s`` (``bppsa*``: from a barrier of the group after the
forward; ``pipeline``: as above; the one-process rivals: from the forward's end; each to the end of its backward,
the weights' gradients all-reduced), its forward's, ``forward_s`` (from a barrier before the forward, none for the
one-process rivals, to the end of this rank's forward; ``pipeline``: to the barrier at its first backward), and the
whole step's, ``fwd_bwd_s`` (from the barrier before the forward to the backward's end; the barrier between forward
and backward included; none of the three but ``backward_s`` for ``scan-*``); a step's time is the slowest rank's.
``forward_sweeps``: the sweeps the split layer's forward ran (0: the serial hand-off).

**Memory** (:func:`memory_rows`): per (p, method), BPPSA's and the pipeline's, a fresh spawn (the kernels and plans
already built and cached by the timing run); every rank resets its peak resident set (``/proc/self/clear_refs``),
runs one forward and backward, and records the peak's growth over the resident set before the forward: what that
step held.
"""
from __future__ import annotations

import os
import time

import torch

from ..stats import balanced_orders

__all__ = ["METHODS", "MICRO_BATCHES", "check_sizes", "memory_rows", "time_rows"]

METHODS = ("bppsa", "bppsa-handoff", "pipeline", "threads", "sequential")
SPLIT = ("bppsa", "bppsa-handoff")  # the split layers: the default forward (the sweeps), the serial hand-off
# The pipeline's micro-batches by default: one.  On CPUs at B = 16, H = 20 a step's cost hardly depends on how many
# sequences it carries, so m micro-batches cost ~m times one and the overlap never repays it (T = 10,000 at p = 2 on
# a Zen 4: backward 0.39 s with m = 1 against 0.99 s with m = 4; docs/measurements.md): m = 1 is the stronger
# baseline.  ``bppsa workers --micro-batches`` sets another.
MICRO_BATCHES = 1


def _jobs(ps, threads: int) -> list[tuple[int, str]]:
    """(p, method) of every step a round runs: the split methods at every p, the one-process rivals at p = 1."""
    return ([(p, m) for p in ps for m in ("bppsa", "pipeline")] + [(p, "bppsa-handoff") for p in ps if p > 1]
            + [(1, "sequential")]
            + ([(1, "threads")] if threads > 1 else [])
            + [(p, f"scan-{s}") for p in ps if p > 1 for s in ("rounds", "allgather")])


def _setup(T: int, B: int, H: int, I: int, dtype: torch.dtype, seed: int, loss: str):
    """The whole batch and the loss's gradients on the outputs, the same on every rank (each slices its own)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(T, B, I, generator=gen) < 0.5).to(dtype)  # a bitstream, as the harness's RNN task
    if loss == "steps":
        g_out = torch.randn(T, B, H, generator=gen, dtype=dtype) / (T * B)
    else:  # the paper's RNN: a loss on the last state only
        g_out = torch.zeros(T, B, H, dtype=dtype)
        g_out[-1] = torch.randn(B, H, generator=gen, dtype=dtype) / B
    return x, g_out


def _models(H: int, I: int, dtype, seed: int, group, r: int, p: int, B: int, micro_batches: int, loss: str):
    """BPPSA's split layers (the sweeps, the serial hand-off), the one-process rivals, and this rank's GPipe stage,
    all with the same weights."""
    import bppsa.nn as bnn

    from .gpipe import GPipe

    torch.manual_seed(seed)
    split = bnn.RNN(I, H, backend="cpu", dtype=dtype, process_group=group)
    handoff = bnn.RNN(I, H, backend="cpu", dtype=dtype, process_group=group, parallel_forward=False)
    handoff.load_state_dict(split.state_dict())
    single = bnn.RNN(I, H, backend="cpu", dtype=dtype)
    single.load_state_dict(split.state_dict())
    sequential = bnn.RNN(I, H, backend="cpu", dtype=dtype, L_m=0)
    sequential.load_state_dict(split.state_dict())
    pipe = GPipe(split.to_torch(), group, r, p, B, micro_batches, loss)
    return {"bppsa": split, "bppsa-handoff": handoff}, {"threads": single, "sequential": sequential}, pipe


def _bppsa_step(split, x, g_out, group, timed: dict) -> None:
    import torch.distributed as dist

    for q in split.parameters():
        q.grad = None
    dist.barrier(group)
    t_f = time.perf_counter()
    out, _ = split(x)
    t_fe = time.perf_counter()
    dist.barrier(group)
    t0 = time.perf_counter()
    torch.autograd.backward(out, g_out)
    t1 = time.perf_counter()
    timed["backward_s"], timed["fwd_bwd_s"], timed["forward_s"] = t1 - t0, t1 - t_f, t_fe - t_f
    (stats,) = split.forward_stats  # one layer, one direction: None where it ran the serial hand-off
    timed["forward_sweeps"] = 0 if stats is None else stats["sweeps"]


def _scan_step(strategy: str, B: int, H: int, dtype, group, timed: dict) -> None:
    """The ranks' scan alone (:func:`bppsa.distributed.rank_scan`, reverse) on one [B, H, H] summary per rank."""
    import torch.distributed as dist

    from ..distributed import rank_scan

    M, c = torch.full((B, H, H), 1.0 / H, dtype=dtype), torch.ones(B, H, dtype=dtype)
    dist.barrier(group)
    t0 = time.perf_counter()
    rank_scan(M, c, group, reverse=True, strategy=strategy)
    timed["backward_s"] = time.perf_counter() - t0


def _threads_step(single, x, g_out, threads: int, timed: dict) -> None:
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for q in single.parameters():
            q.grad = None
        t_f = time.perf_counter()
        out, _ = single(x)
        t0 = time.perf_counter()
        torch.autograd.backward(out, g_out)
        t1 = time.perf_counter()
        timed["backward_s"], timed["fwd_bwd_s"], timed["forward_s"] = t1 - t0, t1 - t_f, t0 - t_f
    finally:
        torch.set_num_threads(prev)


def _slice(t: torch.Tensor, p: int, r: int) -> torch.Tensor:
    return torch.tensor_split(t, p)[r].contiguous()


def _time_worker(rank: int, world: int, ps, T, B, H, I, dtype, rounds, seed, loss, threads, micro_batches):
    import torch.distributed as dist

    torch.set_num_threads(1)
    x, g_out = _setup(T, B, H, I, dtype, seed, loss)
    groups = {p: (dist.new_group(list(range(p))) if p < world else dist.group.WORLD) for p in sorted(set(ps) | {1})}
    models = {p: _models(H, I, dtype, seed, groups[p], rank, p, B, micro_batches, loss) for p in set(ps) | {1}
              if rank < p}
    jobs = _jobs(ps, threads)
    orders = balanced_orders(len(jobs))
    rows = []
    for rnd in range(-1, rounds):  # round -1 warms up (kernels, plans, buffers) and is not recorded
        for p, method in (jobs[j] for j in orders[max(rnd, 0) % len(orders)]):
            dist.barrier()
            if rank >= p:
                continue
            timed: dict = {}
            splits, singles, pipe = models[p]
            _run(method, splits, singles, pipe, _slice(x, p, rank), _slice(g_out, p, rank), groups[p], rank, p,
                 threads, timed)
            if rnd >= 0:
                rows.append({"round": rnd, "p": p, "method": method, "rank": rank,
                             "threads": threads if method == "threads" else 1, "backward_s": timed["backward_s"],
                             "forward_s": timed.get("forward_s", float("nan")),
                             "fwd_bwd_s": timed.get("fwd_bwd_s", float("nan")),
                             "forward_sweeps": timed.get("forward_sweeps", float("nan"))})
    dist.barrier()
    return rows


def time_rows(ps, T: int, B: int, H: int, I: int = 1, dtype=torch.float32, rounds: int = 10, seed: int = 0,
              loss: str = "last", threads: int = 2, timeout: float = 3600,
              micro_batches: int = MICRO_BATCHES) -> list[dict]:
    """Every rank's backward time per (round, p, method): the module's docstring."""
    from ..distributed.launch import run_local

    check_sizes(ps, T, B, micro_batches)
    out = run_local(_time_worker, max(ps), (tuple(ps), T, B, H, I, dtype, rounds, seed, loss, threads,
                                            micro_batches), timeout=timeout)
    return [row for rank_rows in out for row in rank_rows]


def check_sizes(ps, T: int, B: int, micro_batches: int) -> None:
    """The run's sizes, refused with the option they came from before any process starts."""
    if not ps or min(ps) < 1:
        raise ValueError(f"--ps: every process count must be >= 1, got {list(ps)}")
    if T < max(ps):
        raise ValueError(f"--seq-len {T} is shorter than the largest p = {max(ps)}: every rank needs a step")
    if micro_batches < 1 or B % micro_batches:
        raise ValueError(f"--micro-batches {micro_batches} must divide --batch {B} (the pipeline's stages exchange "
                         "micro-batches of one shape)")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set (VmHWM) to the current one (Linux >= 4.0)
        return True
    except OSError:
        return False


def _memory_worker(rank: int, p: int, methods, T, B, H, I, dtype, seed, loss, threads, micro_batches):
    import gc

    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.group.WORLD
    splits, singles, pipe = _models(H, I, dtype, seed, group, rank, p, B, micro_batches, loss)
    x, g_out = _setup(T, B, H, I, dtype, seed, loss)
    xs, gs = _slice(x, p, rank), _slice(g_out, p, rank)
    xw, gw = _setup(max(8, p), B, H, I, dtype, seed, loss)
    del x, g_out
    rows = []
    for method in methods:
        timed: dict = {}
        # warm up on a short sequence: libraries, kernels (the plan of the measured shape is cached on disk)
        _run(method, splits, singles, pipe, _slice(xw, p, rank), _slice(gw, p, rank), group, rank, p, threads, timed)
        gc.collect()
        dist.barrier()
        ok = _reset_peak()
        rss0 = _status_kb("VmRSS")
        _run(method, splits, singles, pipe, xs, gs, group, rank, p, threads, timed)
        peak = (_status_kb("VmHWM") - rss0) * 1024 if ok else float("nan")
        rows.append({"p": p, "method": method, "rank": rank, "threads": threads if method == "threads" else 1,
                     "peak_bytes": peak, "backward_s": timed["backward_s"]})
        for q in list(pipe.rnn.parameters()) + [q for m in (*splits.values(), *singles.values())
                                                 for q in m.parameters()]:
            q.grad = None
        gc.collect()
        dist.barrier()
    return rows


def _run(method, splits, singles, pipe, x, g, group, rank, p, threads, timed):
    """One forward and backward of ``method`` on this rank's slice (the one-process rivals: p = 1, the whole)."""
    if method.startswith("scan-"):
        _scan_step(method[len("scan-"):], x.shape[1], splits["bppsa"].hidden_size, x.dtype, group, timed)
    elif method in SPLIT:
        _bppsa_step(splits[method], x, g, group, timed)
    elif method == "pipeline":
        pipe.step(x, g, timed)
    else:
        _threads_step(singles[method], x, g, threads if method == "threads" else 1, timed)


def memory_rows(ps, T: int, B: int, H: int, I: int = 1, dtype=torch.float32, seed: int = 0, loss: str = "last",
                threads: int = 2, timeout: float = 3600, micro_batches: int = MICRO_BATCHES) -> list[dict]:
    """Every rank's peak memory growth over one forward and backward of BPPSA and of the pipeline at each p, each
    in a fresh spawn (a second step in the same process reuses what the first left mapped, and reads as nothing)."""
    from ..distributed.launch import run_local

    check_sizes(ps, T, B, micro_batches)
    rows = []
    for p in ps:
        for method in ("bppsa", "pipeline"):
            for rank_rows in run_local(_memory_worker, p, ((method,), T, B, H, I, dtype, seed, loss, threads,
                                                           micro_batches), timeout=timeout):
                rows += rank_rows
    return rows


def launched_rows(ps, T: int, B: int, H: int, I: int = 1, dtype=torch.float32, rounds: int = 10, seed: int = 0,
                  loss: str = "last", threads: int = 2, memory: bool = True,
                  micro_batches: int = MICRO_BATCHES) -> tuple[list[dict], list[dict]]:
    """:func:`time_rows` and the memory of the largest p in processes a launcher started (torchrun, srun), in the
    default group, which must have max(ps) ranks: every rank's rows, gathered on every rank."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    check_sizes(ps, T, B, micro_batches)
    if max(ps) != world:
        raise ValueError(f"--ps: the largest process count ({max(ps)}) must be the launcher's ({world} processes)")
    # one method only: a second step in the same process reuses what the first left mapped
    mem = (_memory_worker(rank, world, ("bppsa",), T, B, H, I, dtype, seed, loss, threads, micro_batches)
           if memory else [])
    rows = _time_worker(rank, world, tuple(ps), T, B, H, I, dtype, rounds, seed, loss, threads, micro_batches)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (rows, mem))
    return [r for rr, _ in gathered for r in rr], [m for _, mm in gathered for m in mm]


def peak_supported() -> bool:
    """Whether this OS lets a process reset its peak resident set (Linux's /proc/self/clear_refs)."""
    return os.path.exists("/proc/self/clear_refs")
