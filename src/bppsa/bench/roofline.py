"""A roofline for the scan on this CPU: measured peak FLOP/s and copy bandwidth against the scan's work.

* **Compute roof**: a large GEMM (``torch.mm`` on ``gemm_n`` x ``gemm_n`` matrices of the scan's
  dtype, all threads) -- what this machine's BLAS achieves, not a datasheet number.
* **Memory roof**: ``dst.copy_(src)`` of ``copy_mib`` MiB, counted as read + write bytes.
* **The scan's work** (:func:`scan_cost`): the FLOP and the compulsory bytes of the compact tree of
  :func:`bppsa.scan.blelloch_scan` (levels of pairs, odd block carried, spine mat-vecs, linear middle,
  mat-vec down-sweep): every product's operands read once and its result written once, with no
  reuse between products assumed.
* **The factored RNN scan** (:func:`chain_scan_cost`, method ``scan-cpu-chain``): what the compiled
  kernel does for the RNN's chain (``bppsa.kernels.chain_scan.c``): the spine's and the blocks'
  factored mat-vecs, each block's product accumulated from ``W_hh`` and ``d``, then the tree above
  the fused levels as counted by :func:`scan_cost`; bytes: ``d`` read twice (up and down), the output
  written once, the level-``c`` array written once, plus that tree's.
* The bound is ``max(FLOP / peak, bytes / bandwidth)``; a scan's ``x_bound`` is its measured median
  time over that bound (1 = at the roof).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .. import scan as _scan
from .protocol import median_ci


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


def chain_scan_cost(n: int, B: int, H: int, L_m: int | None = None, itemsize: int = 4,
                    fused: int | None = None) -> dict:
    """FLOP and compulsory bytes of the compiled scan over a factored RNN chain of ``n`` Jacobians."""
    from ..kernels.native import FUSED_LEVELS

    L = _scan.tree_levels(n + 1, L_m)
    c = min(FUSED_LEVELS if fused is None else fused, L)
    nc = n >> c if L else 0
    jv = (2 * H * H + H) * B                          # one factored mat-vec Wᵀ (d ⊙ q)
    byt = 3 * n * H * B * itemsize                    # d read going up and coming down, the output written
    if not nc:                                        # no tree: the spine's mat-vecs are the whole scan
        return {"flop": int((n - 1) * jv), "bytes": int(byt)}
    in_blocks = n - ((1 << c) - 1)                    # the Jacobians the nc blocks hold
    flop = (n - nc) * jv + (in_blocks - nc) * (2 * H ** 3 + H * H) * B + nc * H * H * B
    upper = scan_cost(nc, B, H, L - c, itemsize)      # the stored tree over the blocks' products
    flop, byt = flop + upper["flop"], byt + nc * H * H * B * itemsize + upper["bytes"]
    return {"flop": int(flop), "bytes": int(byt)}


def _median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def peak_gemm_flops(dtype=torch.float32, n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n ** 3 / _median_time(lambda: torch.mm(a, b, out=out), reps)


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Bytes per second of a large copy, read + write."""
    src = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), reps)


def roofline_rows(scan_seconds: dict[str, list[float]], n: int, B: int, H: int, L_m, dtype, peak: float,
                  bandwidth: float, conf: float = 0.95) -> list[dict]:
    """One row per timed scan (a name containing 'linear' is the sequential scan, ``L_m = 0``; one ending in
    '-chain' the compiled scan of the factored chain): its median time and interval against both bounds
    of its own work."""
    rows = []
    for method, secs in scan_seconds.items():
        L = 0 if "linear" in method else L_m
        cost = (chain_scan_cost if method.endswith("-chain") else scan_cost)(n, B, H, L, torch.finfo(dtype).bits // 8)
        t_c, t_m = cost["flop"] / peak, cost["bytes"] / bandwidth
        bound = max(t_c, t_m)
        med, lo, hi = median_ci(secs, conf)
        rows.append({"method": method, "seq_len": n, "batch": B, "hidden": H, "L_m": L, **cost,
                     "peak_gflops": peak / 1e9, "copy_gbs": bandwidth / 1e9, "t_compute_s": t_c, "t_memory_s": t_m,
                     "bound_s": bound, "bound": "compute" if t_c >= t_m else "memory", "scan_s": med,
                     "scan_ci_low": lo, "scan_ci_high": hi, "n": len(secs), "x_bound": med / bound,
                     "achieved_gflops": cost["flop"] / med / 1e9, "achieved_gbs": cost["bytes"] / med / 1e9})
    return rows
