"""The launch plan of the CUDA kernels, in pure Python: which kernels, on what grid, with which integers.

:func:`scan_plan` computes the scan's launch schedule from :func:`bppsa.scan.levels`; tests hold it, the
torch scan and the FLOP analysis to :func:`bppsa.scan.reference_scan`, and drive the kernel sources
through it on a machine without a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ... import scan as _scan
from ...jacobians.recurrent import num_jacobians

MAX_THREADS = 256       # enough to stage a 64x64 operand in 16 coalesced sweeps
FILL_THREADS = 256
FILL_MAX_BLOCKS = 1 << 16  # the fill kernels are grid-stride; more blocks only add scheduling


@dataclass(frozen=True)
class Launch:
    """One kernel launch: base kernel name (dtype suffix added at launch), 1-D grid and block,
    dynamic shared memory in *elements* of the scan's dtype, and the integer arguments that follow
    the pointer arguments, in the order of the C signature.

    ``moved`` and ``flop`` are what the launch costs, counted from what its kernel does: elements of
    the dtype read from and written to global memory (logical traffic: each operand a block stages
    counted once per block, whether or not a cache serves it) and floating-point operations (a
    multiply-add is two).  The cost model (:mod:`.model`) and the memory-bound benchmark sum them."""

    kernel: str
    grid: int
    block: int
    smem_elems: int
    ints: tuple[int, ...]
    moved: int = 0
    flop: int = 0


def block_threads(H: int) -> int:
    """Threads per scan block: one per output element of an H x H product, whole warps, capped."""
    return min(MAX_THREADS, max(32, -(-H * H // 32) * 32))


def scan_plan(N: int, B: int, H: int, L_m: int | None = None) -> tuple[int, list[Launch]]:
    """The launches of a scan over ``N`` positions: (number of up-sweep levels run, launches).

    Scan kernels all take ``(J, S, P, N, B, H, a, b, c, d)``; for the sweeps ``(a, b, c, d) =
    (first_l, half, step, level)`` and block ``pair * B + b`` handles pair ``pair`` of the level
    (``levels(N)[d].pairs()`` in order, the spine pair first); for the middle scan they are
    ``(size, K, L, 0)`` with one block per batch element.
    """
    lv = _scan.levels(N)
    L = _scan.tree_levels(N, L_m)
    HH = H * H
    threads = block_threads(H)
    ups, downs = [], []
    mv, mm = 2 * HH, 2 * HH * H  # FLOP of a matrix-vector and a matrix-matrix product
    for level in lv[:L]:
        n_pairs = level.full + (level.tail is not None)
        ints = (N, B, H, level.first_l, level.step // 2, level.step, level.d)
        # Matrix-matrix blocks stage both operands; the spine block's H*H + H fits in the same.
        # Up: the spine block reads M and v and writes v, every other block reads two M and writes one.
        ups.append(Launch("bppsa_up_sweep", n_pairs * B, threads, 2 * HH, ints,
                          moved=B * ((HH + 2 * H) + (n_pairs - 1) * 3 * HH), flop=B * (mv + (n_pairs - 1) * mm)))
        # Down: the spine block copies a vector, every other block reads M and v and writes two vectors.
        downs.append(Launch("bppsa_down_sweep", n_pairs * B, threads, HH + H, ints,
                            moved=B * (2 * H + (n_pairs - 1) * (HH + 3 * H)), flop=B * (n_pairs - 1) * mv))
    launches = ups
    size = 1 << L
    K = len(_scan.middle_ends(N, L))  # the blocks of level L the middle scan walks
    if K >= 2:
        # K block ends: the first prefix copied, then K - 2 products reading M and v and writing v.
        launches.append(Launch("bppsa_middle_scan", B, threads, HH + 2 * H, (N, B, H, size, K, L, 0),
                               moved=B * (2 * H + (K - 2) * (HH + 2 * H)), flop=B * (K - 2) * mv))
    launches.extend(reversed(downs))
    return L, launches


def rnn_jacobians_launch(T: int, B: int, H: int, layout: str) -> Launch:
    """The Jacobian fill: every element of ``[n, B, H, H]`` written; h read once per value it scales (a
    cache serves the repeats; counted once) and W_hh once.  FLOP: 1 - h² and the product with W_hh per
    fused element (3), 1 - h² per diagonal element of the paper layout (2)."""
    total = num_jacobians(T, layout) * B * H * H
    grid = max(1, min(FILL_MAX_BLOCKS, -(-total // FILL_THREADS)))
    flop = 3 * total if layout == "fused" else 2 * T * B * H
    return Launch(f"bppsa_rnn_jacobians_{layout}", grid, FILL_THREADS, 0, (T, B, H),
                  moved=total + T * B * H + H * H, flop=flop)


def max_hidden(dtype: torch.dtype, smem_optin: int) -> int:
    """Largest H whose matrix-matrix block (two H x H operands) fits in ``smem_optin`` bytes."""
    return math.isqrt(smem_optin // (2 * dtype.itemsize))
