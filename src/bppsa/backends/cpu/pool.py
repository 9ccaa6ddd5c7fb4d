"""Threads for the CPU backend's numpy paths (the dense tree, the factor writers read outside a scan): one pool
of workers beside the calling thread, in its subnormal mode.  The compiled scan has its own threads
(chain_scan.c's team), which flush subnormal results whatever the caller's mode.

Threads: ``torch.get_num_threads()`` (set by ``--threads``).  Worker threads are started in the
calling thread's subnormal mode (``torch.set_flush_denormal``, on by default in the commands: the long
Jacobian products underflow) and re-started if it changes.
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import plan

_pool: ThreadPoolExecutor | None = None
_pool_key: tuple | None = None
_pool_lock = threading.Lock()


def threads() -> int:
    return max(1, torch.get_num_threads())


def flushing() -> bool:
    """Whether this thread flushes subnormals (``torch.set_flush_denormal``): a subnormal input reads as 0."""
    return float(np.float32(1e-39) * np.float32(1.0)) == 0.0


def executor(p: int) -> ThreadPoolExecutor:
    """The pool of p - 1 workers, in the calling thread's subnormal mode (re-made when either changes)."""
    global _pool, _pool_key
    key = (p, flushing())
    with _pool_lock:
        if _pool is None or _pool_key != key:
            if _pool is not None:
                _pool.shutdown(wait=True)
            _pool = ThreadPoolExecutor(max_workers=p - 1, thread_name_prefix="bppsa-cpu",
                                       initializer=torch.set_flush_denormal, initargs=(key[1],))
            _pool_key = key
        return _pool


@functools.cache
def _numpy_blas_single_threaded() -> bool:
    """Make numpy's own OpenBLAS single-threaded (once): this pool is the parallelism, and
    OpenBLAS's threads on top of it oversubscribe the cores -- and they were started before
    ``torch.set_flush_denormal``, so they would run the chain's subnormal products at the slow rate."""
    try:
        from threadpoolctl import ThreadpoolController

        libs = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas" and "numpy" in c.filepath]
        for c in libs:
            c.set_num_threads(1)
        return bool(libs)
    except Exception:  # noqa: BLE001 - without threadpoolctl the scan is still right, only slower
        return False


def spread(tasks) -> None:
    """Run the callables, the first on this thread and the others on the pool's workers."""
    if len(tasks) > 1:
        _numpy_blas_single_threaded()
    futures = [executor(threads()).submit(t) for t in tasks[1:]]
    try:
        tasks[0]()
    finally:  # the workers finish (or fail) before anything they write to is handed back
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


def parallel(fn, n: int, flop_per_item: float) -> None:
    """Run ``fn(a, b)`` over [0, n) in contiguous chunks, one per thread (the caller takes the first)."""
    _numpy_blas_single_threaded()
    p = min(threads(), max(1, int(n * flop_per_item // plan.MIN_CHUNK_FLOP)), n)
    if p <= 1:
        if n:
            fn(0, n)
        return
    bounds = [n * i // p for i in range(p + 1)]
    spread([functools.partial(fn, bounds[i], bounds[i + 1]) for i in range(p)])


def serial(fn, n: int, flop_per_item: float) -> None:
    """Run ``fn(0, n)`` on this thread (what :func:`parallel` does with one chunk)."""
    if n:
        fn(0, n)
