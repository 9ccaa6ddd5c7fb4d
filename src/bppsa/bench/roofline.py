"""A roofline for the scan on this CPU: measured peak FLOP/s and copy bandwidth against the scan's work.

* **Compute roof**: a large GEMM (``torch.mm`` on ``gemm_n`` x ``gemm_n`` matrices of the scan's
  dtype, all threads) -- what this machine's BLAS achieves, not a datasheet number.
* **Memory roof**: ``dst.copy_(src)`` of ``copy_mib`` MiB, counted as read + write bytes.
* **The scan's work** (:func:`scan_cost`): the FLOP and the compulsory bytes of the compact tree of
  :func:`bppsa.scan.blelloch_scan` (levels of pairs, odd block carried, spine mat-vecs, linear middle,
  mat-vec down-sweep): every product's operands read once and its result written once, with no
  reuse between products assumed.
* **The factored chains' scan** (:func:`chain_scan_cost`, method ``scan-cpu-chain``): what the compiled
  kernel does for a chain of ``kind`` (``bppsa/backends/cpu/chain_scan.c``: the RNN's fused or paper layout,
  the GRU): the spine's and the blocks' factored mat-vecs, each block's product accumulated from the
  weights and factors, then the tree above the fused levels as counted by :func:`scan_cost`; bytes: the
  factors read twice (up and down), the output written once, the level-``c`` array written once, plus
  that tree's.
* **The sequential scan** (method ``scan-sequential``: ``L_m = 0`` through the same kernel) is a chain of
  n dependent mat-vecs, so besides its FLOP (on the cores its batch can use: one chain per batch element)
  and bytes it has a **latency roof**: each step's critical path, ``2 + ceil(log2(terms))`` dependent
  multiply-adds (a scaling, the products, a balanced sum of a row's terms), at this CPU's measured
  latency of one multiply-add (:func:`fma_latency`).
* The bound is the largest of these times; a scan's ``x_bound`` is its measured median time over that
  bound (1 = at the roof).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import scan as _scan
from ..stats import median_ci
from .timing import timed


def scan_cost(n: int, B: int, H: int, L_m: int | None = None, itemsize: int = 4) -> dict:
    """FLOP and compulsory bytes of the scan over ``n`` Jacobians (N = n + 1 positions)."""
    L = _scan.tree_levels(n + 1, L_m)
    mm, mv = 2 * H ** 3 * B, 2 * H * H * B             # FLOP per batched product
    M, V = H * H * B * itemsize, H * B * itemsize      # bytes per batched matrix / vector
    flop = byt = 0
    K = n + 1
    pairs_per_level = []
    for _ in range(L):
        pairs, carry = (K - 2) // 2, (K - 2) % 2
        flop += pairs * mm + mv                          # off-spine mat-mat, the spine's mat-vec
        byt += pairs * 3 * M + carry * 2 * M + (M + 2 * V)
        pairs_per_level.append((pairs, carry))
        K = (K + 1) // 2
    if K > 1:                                            # linear middle over the K blocks left
        flop += (K - 2) * mv
        byt += (K - 2) * (M + 2 * V) + V
    for pairs, carry in reversed(pairs_per_level):        # down-sweep: right children, mat-vec
        flop += pairs * mv
        byt += pairs * (M + 3 * V) + (1 + carry) * 2 * V
    return {"flop": int(flop), "bytes": int(byt)}


def _chain_ops(kind: str, H: int) -> tuple:
    """FLOP per lane of one position's mat-vec, product step (M <- M J_s) and first product (M = J_s), as
    functions of the position s, and the terms a row's sum adds (its latency)."""
    if kind == "gru":
        jac = 6 * H * H + H  # J_s from the three gates' weights and the diagonal
        return (lambda s: 6 * H * H + 5 * H, lambda s: 2 * H ** 3 + jac, lambda s: jac, lambda s: 3 * H + 1)
    if kind == "paper":  # even positions diag(d), odd ones W_hh^T
        return (lambda s: 2 * H * H if s % 2 else H, lambda s: 2 * H ** 3 if s % 2 else H * H,
                lambda s: 0, lambda s: H if s % 2 else 1)
    return (lambda s: 2 * H * H + H, lambda s: 2 * H ** 3 + H * H, lambda s: H * H, lambda s: H)


def chain_scan_cost(n: int, B: int, H: int, L_m: int | None = None, itemsize: int = 4,
                    fused: int | None = None, kind: str = "rnn") -> dict:
    """FLOP and compulsory bytes of the compiled scan over a factored chain of ``n`` Jacobians of ``kind``
    (``L_m = 0``: the sequential scan), and ``depth``: the dependent multiply-adds on its critical path
    when it is sequential."""
    from ..backends.cpu.plan import fused_levels

    mv, mul, first, terms = _chain_ops(kind, H)
    rows = 5 * H if kind == "gru" else H             # factor rows per step the scan reads
    steps = n // 2 if kind == "paper" else n
    L = _scan.tree_levels(n + 1, L_m)
    c = min(fused_levels(n) if fused is None else fused, L)
    nc = n >> c if L else 0
    byt = (2 * steps * rows + n * H) * B * itemsize  # factors read going up and coming down, the output written
    if not nc:                                       # no tree: the spine's mat-vecs are the whole scan
        depth = sum(2 + math.ceil(math.log2(terms(s))) for s in range(n - 1))
        return {"flop": int(sum(mv(s) for s in range(n - 1)) * B), "bytes": int(byt), "depth": depth}
    size = 1 << c
    flop = sum(mv(s) for s in range(size - 1))       # the spine
    for j in range(nc):                              # the blocks: up (products) and down (mat-vecs)
        lo, hi = (j + 1) * size - 1, min((j + 2) * size - 2, n - 1)
        flop += first(hi) + sum(mul(s) for s in range(lo, hi)) + sum(mv(s) for s in range(lo, hi))
    upper = scan_cost(nc, B, H, L - c, itemsize)      # the stored tree over the blocks' products
    flop, byt = flop * B + upper["flop"], byt + nc * H * H * B * itemsize + upper["bytes"]
    return {"flop": int(flop), "bytes": int(byt), "depth": None}


def _median_time(fn, reps: int) -> float:
    fn()
    return float(np.median([timed(fn)[0] for _ in range(reps)]))


def peak_gemm_flops(dtype=torch.float32, n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n ** 3 / _median_time(lambda: torch.mm(a, b, out=out), reps)


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes per second of a large copy, read + write."""
    src = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), reps)


def fma_latency(dtype=torch.float32, n: int = 20_000_000) -> float | None:
    """Seconds per dependent multiply-add on this core (a chain of n, compiled); None without the kernel."""
    from ..backends.cpu import native

    lib = native.library("rnn", 1, 1, dtype) if native.available() else None
    if lib is None:
        return None
    lib.fma_chain(1000)
    return min(timed(lambda: lib.fma_chain(n))[0] for _ in range(3)) / n


def roofline_rows(scan_seconds: dict[str, list[float]], n: int, B: int, H: int, L_m, dtype, peak: float,
                  bandwidth: float, conf: float = 0.95, kind: str = "rnn", t_fma: float | None = None,
                  threads: int = 1) -> list[dict]:
    """One row per timed scan: its median time and interval against the bounds of its own work.  A name
    containing 'linear' or 'sequential' is the sequential scan (``L_m = 0``; 'sequential' the compiled one
    over the factored chain, with its latency roof from ``t_fma``, on at most B of the ``threads`` cores
    ``peak`` counts); one ending in '-chain' the compiled scan of the factored chain; the rest the dense tree."""
    rows = []
    itemsize = torch.finfo(dtype).bits // 8
    for method, secs in scan_seconds.items():
        sequential = "linear" in method or "sequential" in method
        L = 0 if sequential else L_m
        compiled = method.endswith("-chain") or method.endswith("sequential")
        cost = chain_scan_cost(n, B, H, L, itemsize, kind=kind) if compiled else scan_cost(n, B, H, L, itemsize)
        cores = min(threads, B) if sequential else threads
        t_c, t_m = cost["flop"] / (peak * cores / threads), cost["bytes"] / bandwidth
        t_l = cost["depth"] * t_fma if cost.get("depth") and t_fma else 0.0
        bound = max(t_c, t_m, t_l)
        kinds = {"compute": t_c, "memory": t_m, "latency": t_l}
        med, lo, hi = median_ci(secs, conf)
        rows.append({"method": method, "model": "gru" if kind == "gru" else "rnn", "seq_len": n, "batch": B,
                     "hidden": H, "L_m": L, "flop": cost["flop"], "bytes": cost["bytes"],
                     "peak_gflops": peak / 1e9, "copy_gbs": bandwidth / 1e9, "t_compute_s": t_c, "t_memory_s": t_m,
                     "t_latency_s": t_l, "bound_s": bound, "bound": max(kinds, key=kinds.get), "scan_s": med,
                     "scan_ci_low": lo, "scan_ci_high": hi, "n": len(secs), "x_bound": med / bound,
                     "achieved_gflops": cost["flop"] / med / 1e9, "achieved_gbs": cost["bytes"] / med / 1e9})
    return rows
