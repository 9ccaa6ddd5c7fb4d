"""Starting a process group: from torchrun's or SLURM's environment, or as p local processes (tests, benchmarks).

* :func:`init_from_env` joins the group a launcher describes: torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
  ``MASTER_PORT``, or an ``srun`` task's ``SLURM_PROCID``/``SLURM_STEP_NUM_TASKS`` (the first node of the job is the
  master; ``MASTER_PORT`` or a port derived from the job id).
* :func:`run_local` spawns p processes on 127.0.0.1, runs ``fn(rank, p, *args)`` in each inside a gloo group and
  returns their results in rank order; a rank that raises, dies or outlives ``timeout`` makes it raise, naming the
  rank.
"""
from __future__ import annotations

import atexit
import datetime
import io
import os
import queue as _queue
import socket
import time
import traceback

import torch
import torch.distributed as dist

__all__ = ["LaunchError", "free_port", "init_from_env", "launcher_env", "run_local"]


class LaunchError(RuntimeError):
    """A local rank failed: raised, exited or timed out (``rank``: which; ``message`` its error)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(env=None) -> dict | None:
    """``{via, rank, world_size, local_rank, master_addr, master_port}`` from torchrun's or SLURM's variables (``via``:
    ``torchrun`` or ``srun``), or None
    when neither launched this process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return {"via": "torchrun", "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0)), "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
                "master_port": int(env.get("MASTER_PORT", 29500))}
    # an srun step's task (SLURM_STEP_NUM_TASKS: srun sets it, a batch script does not, which would otherwise
    # read as rank 0 of --ntasks and wait for ranks that were never started)
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return {"via": "srun", "rank": int(env["SLURM_PROCID"]), "world_size": int(env["SLURM_STEP_NUM_TASKS"]),
                "local_rank": int(env.get("SLURM_LOCALID", 0)), "master_addr": env.get("MASTER_ADDR",
                                                                                       _first_node(nodes)),
                "master_port": port}
    return None


def _first_node(nodelist: str) -> str:
    """The first host of a SLURM node list (``node[01-04],gpu7`` -> ``node01``) without calling scontrol."""
    head, bracket, rest = nodelist.partition("[")
    if not bracket or "," in head:
        return nodelist.split(",")[0]
    return head + rest.split("]")[0].split(",")[0].split("-")[0]


def init_from_env(backend: str = "gloo", timeout: float = 300.0) -> dict:
    """Join the process group the launcher describes (:func:`launcher_env`); a single process where none did.
    Returns the launcher's description (``world_size`` 1 without one).  The group it starts is destroyed when the
    process exits (:func:`torch.distributed.destroy_process_group` earlier is fine too)."""
    info = launcher_env() or {"via": "local", "rank": 0, "world_size": 1, "local_rank": 0, "master_addr": "127.0.0.1",
                              "master_port": free_port()}
    if not dist.is_initialized():
        url = f"tcp://{info['master_addr']}:{info['master_port']}"
        dist.init_process_group(backend, init_method=url, rank=info["rank"], world_size=info["world_size"],
                                timeout=datetime.timedelta(seconds=timeout))
        # a group left for the interpreter's finalizer aborts the process (gloo's worker threads outlive Python:
        # "terminate called without an active exception", SIGABRT), so the group this call made is destroyed at
        # exit, while Python is still whole, unless the script destroyed it first
        atexit.register(_destroy_at_exit)
    return info


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing is left to tear down in order
            pass


def _child(rank, p, port, fn, args, results, threads, timeout):
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p,
                                timeout=datetime.timedelta(seconds=timeout))
        buf = io.BytesIO()  # by value: tensors put as they are cross as shared memory, gone when this rank exits
        torch.save(fn(rank, p, *args), buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises naming this rank
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        # a peer may be gone: tearing the group down could wait on it, so leave once the report is out
        results.close()
        results.join_thread()
        os._exit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer already gone
                pass


def _loaded(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)  # a rank of this run wrote it


def run_local(fn, p: int, args: tuple = (), *, timeout: float = 120.0, threads: int = 1,
              group_timeout: float | None = None, allow_failure: bool = False) -> list:
    """``[fn(0, p, *args), ..., fn(p - 1, p, *args)]``, each in its own spawned process in one gloo group on
    127.0.0.1 (``threads`` torch threads each).  ``fn`` must be importable by the children (a module-level
    function); its result crosses back by value (``torch.save``), so it may hold tensors.  A rank that raises,
    exits without a result or outlives ``timeout`` seconds raises :class:`LaunchError` naming it (the others are
    ended); ``allow_failure``: return the error text in its place instead (a fault test).  ``group_timeout``: the
    process group's own timeout (default ``timeout``)."""
    import torch.multiprocessing as mp

    if p < 1:
        raise ValueError(f"run_local: p must be >= 1, got {p}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    gt = timeout if group_timeout is None else group_timeout
    procs = [ctx.Process(target=_child, args=(r, p, port, fn, args, results, threads, gt), daemon=True)
             for r in range(p)]
    for proc in procs:
        proc.start()
    got: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < p:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, out = results.get(timeout=min(left, 0.5))
                got[rank] = (ok, out)
            except _queue.Empty:
                dead = [r for r, proc in enumerate(procs) if r not in got and proc.exitcode is not None]
                if dead:  # give a result in flight a moment, then call it dead
                    time.sleep(0.5)
                    while not results.empty():
                        rank, ok, out = results.get()
                        got[rank] = (ok, out)
                    for r in dead:
                        got.setdefault(r, (False, f"rank {r} exited (code {procs[r].exitcode}) without a result"))
    finally:
        for proc in procs:
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    for r in range(p):
        got.setdefault(r, (False, f"rank {r} gave no result within {timeout:g} s"))
    if allow_failure:
        return [_loaded(out) if ok else out for ok, out in (got[r] for r in range(p))]
    for r in range(p):
        ok, out = got[r]
        if not ok:
            raise LaunchError(f"rank {r} of {p} failed: {out}", r)
    return [_loaded(got[r][1]) for r in range(p)]
