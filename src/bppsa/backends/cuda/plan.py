"""The launch plan of the CUDA kernels, in pure Python: which kernels, on what grid, with which integers.

:func:`scan_plan` computes the scan's launch schedule from :func:`bppsa.scan.levels`; tests hold it, the
torch scan and the FLOP analysis to :func:`bppsa.scan.reference_scan`, and drive the kernel sources
through it on a machine without a GPU.
"""
from __future__ import annotations

import functools
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

    ``consts`` are the compile-time constants its source is compiled with (``-DNAME=value``; the runtime keys the
    compiled module by them): the register up kernel's hidden size and columns per thread (:func:`up_constants`).

    ``moved`` and ``flop`` are what the launch costs, counted from what its kernel does: elements of
    the dtype read from and written to global memory (logical traffic: each operand a block stages
    counted once per block, whether or not a cache serves it) and floating-point operations (a
    multiply-add is two).  The cost model (:mod:`.cost_model`) and the memory-bound benchmark sum them."""

    kernel: str
    grid: int
    block: int
    smem_elems: int
    ints: tuple[int, ...]
    moved: int = 0
    flop: int = 0
    consts: tuple[tuple[str, int], ...] = ()


def block_threads(H: int) -> int:
    """Threads per scan block: one per output element of an H x H product, whole warps, capped."""
    return min(MAX_THREADS, max(32, -(-H * H // 32) * 32))


@functools.lru_cache(maxsize=256)  # a training step asks for the same plan every iteration (~0.1 ms of Python)
def scan_plan(N: int, B: int, H: int, L_m: int | None = None) -> tuple[int, tuple[Launch, ...]]:
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
    return L, tuple(launches)


def rnn_jacobians_launch(T: int, B: int, H: int, layout: str) -> Launch:
    """The Jacobian fill: every element of ``[n, B, H, H]`` written; h read once per value it scales (a
    cache serves the repeats; counted once) and W_hh once.  FLOP: 1 - h² and the product with W_hh per
    fused element (3), 1 - h² per diagonal element of the paper layout (2)."""
    total = num_jacobians(T, layout) * B * H * H
    grid = max(1, min(FILL_MAX_BLOCKS, -(-total // FILL_THREADS)))
    flop = 3 * total if layout == "fused" else 2 * T * B * H
    return Launch(f"bppsa_rnn_jacobians_{layout}", grid, FILL_THREADS, 0, (T, B, H),
                  moved=total + T * B * H + H * H, flop=flop)


GRU_FACTOR_THREADS = 128


def gru_factors_launch(T: int, B: int, H: int, I: int) -> Launch:
    """The GRU's factors in one kernel (``factored.cu``'s ``bppsa_gru_factors``): a thread per (step, batch element)
    recomputes the gates from x_t and h_{t-1} and writes the step's 6H + I factor rows; the weights and biases staged
    per block.  Counts: x_t (I) and h_{t-1} (H) read, 6H + I rows written per pair, the weights once per block; two
    multiply-add FLOP per weight a pair, ~20 per gate element."""
    pairs = T * B
    grid = max(1, -(-pairs // GRU_FACTOR_THREADS))
    weights = 3 * H * (I + H) + 6 * H
    return Launch("bppsa_gru_factors", grid, GRU_FACTOR_THREADS, weights, (T, B, H, I),
                  moved=pairs * (I + H + 6 * H + I) + grid * weights, flop=pairs * (2 * 3 * H * (I + H) + 20 * H))


def max_hidden(dtype: torch.dtype, smem_optin: int) -> int:
    """Largest H whose matrix-matrix block (two H x H operands) fits in ``smem_optin`` bytes."""
    return math.isqrt(smem_optin // (2 * dtype.itemsize))


# -- the factored path (CupyFactoredBackend): the chain kept as its factors, never as per-step Jacobians --------

FACTORED_KINDS = {"rnn": (1, 1), "gru": (3, 5)}  # kind -> (NW weight matrices, NF factor rows of H per step)
FACTORED_GROUP = 8       # positions whose gradient rows and columns the down kernel stages before accumulating
MIN_CHUNKS = 8           # the backward stays a scan: at least this many chunks (all n steps when n < 8)
CHUNK_MAX = 512
INT32_MAX = 2**31 - 1    # the register up kernel indexes with 32-bit integers


def chunk_candidates(n: int) -> list[int]:
    """The chunk sizes a factored plan may take for a chain of ``n`` steps: the powers of two up to CHUNK_MAX that
    leave at least MIN_CHUNKS = 8 chunks (C <= n // 8), so the backward stays a scan and no chunk becomes the
    sequential limit; [1] below 8 steps (one chunk per step).  The cost model picks among them
    (:func:`.cost_model.chunk_size`)."""
    top = min(CHUNK_MAX, n // MIN_CHUNKS)
    return [1 << e for e in range(max(top, 1).bit_length())]


UP_REGISTER_WORDS = 160  # 32-bit registers a thread of the register up kernel may give its arrays


def up_columns(H: int, itemsize: int) -> int:
    """Columns of a chunk aggregate one thread of the register up kernel (``factored_up.cu``) owns: the largest
    NC of 4, 2, 1 whose arrays fit UP_REGISTER_WORDS registers: the NC columns and their next value (2·H·NC
    elements) and the streamed factor vector and the next one (2·H).  0: not even one column fits (H > 40 in
    fp32, H > 20 in fp64); factored.cu's shared-memory up kernel takes those."""
    words = itemsize // 4
    return next((nc for nc in (4, 2, 1) if (2 * H * nc + 2 * H) * words <= UP_REGISTER_WORDS), 0)


def up_constants(H: int) -> tuple[tuple[str, int], ...]:
    """The compile-time constants of ``factored_up.cu`` for hidden size H (one module per H, both dtypes)."""
    return (("BPPSA_H", H), ("BPPSA_NC32", up_columns(H, 4)), ("BPPSA_NC64", up_columns(H, 8)))


def up_geometry(H: int, itemsize: int, pairs: int) -> tuple[int, int]:
    """(grid, threads per block) of the register up kernel over ``pairs`` = K·B (chunk, batch element) pairs: a
    warp is 32 consecutive pairs and one block of NC columns; up to 8 warps (column blocks) share a thread block,
    the ceil(H / NC) column blocks split over JG thread blocks per 32 pairs (the kernel's Geometry)."""
    nc = up_columns(H, itemsize)
    njb = -(-H // nc)
    jg = -(-njb // 8)
    wpb = -(-njb // jg)
    return -(-pairs // 32) * jg, 32 * wpb


def up_reg_smem(kind: str, H: int, itemsize: int) -> int:
    """Shared memory (elements) of the register up kernel: W^T column by column, rows padded to 16 bytes."""
    v = 16 // itemsize
    return FACTORED_KINDS[kind][0] * H * (-(-H // v) * v)


MIDDLE_MAX_WARPS = 8  # warps (segments) of the one-launch middle phase: <= 8 x 256 registers a block
MIDDLE_SMEM_BYTES = 48 * 1024  # its shared memory stays under the static limit (no opt-in, any GPU)


DOWN_WARP_WORDS = 180  # 32-bit registers a lane of the warp down kernel may give its arrays
DOWN_WARPS = 8  # warps (pairs) per thread block of the warp down kernel
GRADS_WARPS = 8  # warps of the gradients' reduction (bppsa_factored_grads), each adding every 8th block's sums


def down_warp_words(kind: str, H: int, I: int, itemsize: int) -> int:
    """32-bit registers of a lane's arrays in the warp down kernel (``factored_warp.cu``): its row of each W_g^T
    (NW·H), the gradient rows' sums (rnn: NBV = I + 1 + H; gru: dR, dZ NBV each, dN I + 1, dM 1 + H), and the step's
    factors and column values with the next step's, 2·(NFL + ceil(NBV / 32))."""
    nbv = I + 1 + H
    nw, nfl = (1, 1) if kind == "rnn" else (3, 5)
    nacc = nbv if kind == "rnn" else 2 * nbv + (I + 1) + (1 + H)
    return (itemsize // 4) * (nw * H + nacc + 2 * (nfl + -(-nbv // 32)))


def down_warp_fits(kind: str, H: int, I: int, itemsize: int) -> bool:
    """Whether the warp down kernel takes this chain: a lane per row (H <= 32) and its arrays within DOWN_WARP_WORDS
    registers (at H = 20 every case but the GRU in fp64); factored.cu's shared-memory down kernel takes the others."""
    return H <= 32 and down_warp_words(kind, H, I, itemsize) <= DOWN_WARP_WORDS


def down_warp_smem(kind: str, H: int, I: int, itemsize: int, grads: bool) -> int:
    """Shared memory (elements) of the warp down kernel: with the sums the block's [NA, I + 1 + H], then per warp two
    step buffers of its t_g (NW rows at H rounded up to 16 bytes) and column values, each 16-byte aligned."""
    v = 16 // itemsize
    up = lambda x: -(-x // v) * v  # noqa: E731
    nw, na, nbv = (1, H, I + 1 + H) if kind == "rnn" else (3, 4 * H, I + 1 + H)
    return (up(na * nbv) if grads else 0) + DOWN_WARPS * 2 * (nw * up(H) + up(nbv))


def warp_constants(H: int, I: int) -> tuple[tuple[str, int], ...]:
    """The compile-time constants of ``factored_warp.cu`` (one module per H and I, both dtypes): BPPSA_DOWN_WARP has
    bit 1 for the RNN's fp32 down kernel, 2 its fp64, 4 the GRU's fp32, 8 its fp64, where :func:`down_warp_fits`."""
    mask = sum(bit for bit, kind, item in ((1, "rnn", 4), (2, "rnn", 8), (4, "gru", 4), (8, "gru", 8))
               if down_warp_fits(kind, H, I, item))
    return (("BPPSA_H", H), ("BPPSA_I", I), ("BPPSA_DOWN_WARP", mask))


def grad_total(kind: str, H: int, I: int) -> int:
    """Elements of the cell's parameter gradients (weight_ih, bias_ih, bias_hh, weight_hh)."""
    g = 1 if kind == "rnn" else 3
    return g * H * (I + 2 + H)


def grad_index(layout, NBV: int) -> tuple[list[int], list[tuple[str, tuple[int, ...], int]]]:
    """The flat parameter gradients from the kernel's sums [NA, NBV]: for each flat element the sums' entry
    (row·NBV + column), parameter after parameter as ``layout`` (a chain's ``grad_layout()``) lists them, each block
    row by row; and per parameter its name, shape and first flat element."""
    index: list[int] = []
    params = []
    for name, shape, parts in layout:
        params.append((name, tuple(shape), len(index)))
        for rows, cols in parts:
            for r in range(rows.start, rows.stop):
                index.extend(r * NBV + c for c in range(cols.start, cols.stop))
    return index, params


def grad_views(flat, layout, NBV: int) -> dict:
    """The parameters' gradients as views of the flat buffer ``flat`` (:func:`grad_index`'s order)."""
    _, params = grad_index(layout, NBV)
    out = {}
    for name, shape, start in params:
        size = 1
        for d in shape:
            size *= d
        out[name] = flat[start:start + size].view(shape)
    return out


def middle_smem(H: int, itemsize: int, warps: int) -> int:
    """Shared memory (elements) of the one-launch middle phase (``factored_warp.cu``) with ``warps`` warps: each its
    staged aggregate (H rows at a pitch of 16 bytes' multiple, H <= 32); with more than one warp also each its composed
    map [H + 1][H] and its segment's starting carry [H]."""
    v = 16 // itemsize
    mat = H * (-(-H // v) * v) if H <= 32 else 0
    return warps * mat + (warps * (H * (H + 1) + H) if warps > 1 else 0)


def middle_max_warps(H: int, itemsize: int) -> int:
    """The most warps the middle phase may take: 1 where a warp cannot hold a composed map's H + 1 columns (H > 31),
    else up to MIDDLE_MAX_WARPS within MIDDLE_SMEM_BYTES of shared memory."""
    if H > 31:
        return 1
    return max(1, min(MIDDLE_MAX_WARPS, max(w for w in range(1, MIDDLE_MAX_WARPS + 1)
                                            if middle_smem(H, itemsize, w) * itemsize <= MIDDLE_SMEM_BYTES)))


def middle_depth(H: int, itemsize: int) -> int:
    """Aggregates the middle phase's warp streams ahead in registers (``factored_warp.cu``'s Layout::D): up to 4 within
    64 32-bit registers of ceil(H² / 32) elements each."""
    ns = -(-H * H // 32) if H <= 32 else 1
    return max(1, min(4, 64 // (ns * (itemsize // 4))))


def middle_segments(K: int, warps: int) -> tuple[int, int]:
    """(segment length L, non-empty segments Wn) of the middle phase's K - 1 transitions over ``warps`` warps."""
    nt = K - 1
    L = -(-nt // warps)
    return L, -(-nt // L)


def smem_pitch(H: int) -> int:
    """The row pitch (elements) of every H x H matrix the factored kernels keep in shared memory: the
    smallest odd number >= H.  A warp that reads a column (thread i reads row i, as the down phase's
    mat-vec does with W^T) then touches 32 (fp32) or, per half-warp, 16 (fp64) distinct banks; an even pitch
    such as H = 20 folds rows onto the same banks (:func:`bank_conflicts`)."""
    return H | 1


def bank_conflicts(addresses, itemsize: int) -> int:
    """The worst bank conflict of one shared-memory instruction: ``addresses`` are the element indices the
    32 threads of a warp touch (None: an inactive thread), ``itemsize`` 4 or 8 bytes.  Returns the most
    distinct addresses that fall into one bank (1: conflict-free; threads reading the same address are a
    broadcast, not a conflict).  Shared memory has 32 banks of 4 bytes; an 8-byte access is served per
    half-warp (16 threads x 8 bytes = one pass over the 32 banks), so conflicts count within each half."""
    if itemsize not in (4, 8):
        raise ValueError(f"itemsize must be 4 or 8, got {itemsize}")
    addrs = list(addresses)
    if len(addrs) > 32:
        raise ValueError(f"a warp has 32 threads, got {len(addrs)} addresses")
    words = itemsize // 4
    groups = [addrs] if itemsize == 4 else [addrs[:16], addrs[16:]]
    worst = 0
    for grp in groups:
        banks: dict[int, set[int]] = {}
        for a in grp:
            if a is None:
                continue
            for w in range(words):  # an 8-byte element spans two consecutive 4-byte words (two banks)
                word = a * words + w
                banks.setdefault(word % 32, set()).add(word // words)
        worst = max([worst] + [len(s) for s in banks.values()])
    return worst


def up_threads(H: int) -> int:
    """Threads of a factored up block: one per element of a pitched H x H matrix, whole warps, capped."""
    return min(MAX_THREADS, max(32, -(-H * smem_pitch(H) // 32) * 32))


def down_threads(H: int, grads: bool) -> int:
    """Threads of a factored down block: one per row of the mat-vec (whole warps); with the parameter
    gradients at least 128, which share the accumulation of the [NA, I + 1 + H] sums."""
    return min(MAX_THREADS, max(128 if grads else 32, -(-H // 32) * 32))


def grad_entries(kind: str, H: int, I: int) -> int:
    """The entries of the [NA, I + 1 + H] sums the down kernel accumulates (the GRU's dN rows take only x and 1,
    its dM rows only 1 and h', as in chain_scan.c; the others stay zero)."""
    if kind == "rnn":
        return H * (I + 1 + H)
    return 2 * H * (I + 1 + H) + H * (I + 1) + H * (1 + H)


def factored_smem(kind: str, H: int, I: int, grads: bool) -> tuple[int, int]:
    """Dynamic shared memory (elements) of the (up, down) kernels.  Up: W^T (NW matrices), the step's
    Jacobian, the aggregate and its next value, all at :func:`smem_pitch`, and the step's factors.  Down: W^T,
    the carried vector and its next value, the step's factors, their products with the vector (NW rows);
    with the gradients the group's rows [G, NA] and columns [G, I + 1 + H] and the block's sums [NA, I + 1 + H]."""
    NW, NF = FACTORED_KINDS[kind]
    P = smem_pitch(H)
    nfu = 1 if kind == "rnn" else 4
    nfd = 1 if kind == "rnn" else (5 if grads else 4)
    up = (NW + 3) * H * P + nfu * H
    down = NW * H * P + 2 * H + nfd * H + NW * H
    if grads:
        NA, NBV = (H if kind == "rnn" else 4 * H), I + 1 + H
        down += FACTORED_GROUP * (NA + NBV) + NA * NBV
    return up, down


@functools.lru_cache(maxsize=256)
def factored_plan(kind: str, n: int, B: int, H: int, I: int, C: int, *, grads: bool = True,
                  L_m: int | None = None, itemsize: int = 4, register_up: bool = True,
                  affine: bool = False, warps: int = 1, warp_down: bool = True) -> tuple[int, tuple[Launch, ...]]:
    """The launches of the factored backward over a chain of ``n`` steps (``kind`` "rnn": J_k = W^T diag(d_k);
    "gru": J_k = sum_g W_hg^T diag(c_g,k) + diag(z_k)): (chunk size C, launches in order).

    * up, ``bppsa_factored_up_<kind>`` (``factored_up.cu``, compiled for this H): chunk c's aggregate
      M_c = J_{cC+C-1} ... J_{cC} of batch element b built in registers, each thread NC of its columns
      (:func:`up_columns`, :func:`up_geometry`), and written, [K, B, H, H] (the last chunk's too, although the scan
      never uses it: one pair of K·B).  Where NC columns do not fit the registers (H > 40 in fp32, H > 20 in fp64
      for ``itemsize`` 4 or 8), ``bppsa_factored_up_smem_<kind>`` (``factored.cu``): block c * B + b builds the
      aggregate in shared memory;
    * middle, ``bppsa_factored_middle`` (``factored_warp.cu``, compiled for this H), one launch: block b (batch
      element b) writes the carries [K, B, H], carry_{c+1} = M_c carry_c from carry_0 = g, its ``warps`` warps (at
      most :func:`middle_max_warps`) a two-level tree over the K - 1 transitions (:func:`middle_segments`: warp 0 walks
      the first segment while the others compose theirs into one map each, warp 0 applies the maps, every warp walks
      its segment); the cost model picks ``warps`` (:func:`.cost_model.middle_warps`).  Where ``L_m`` is given, the
      paper's heterogeneous Blelloch scan of :func:`scan_plan` over (g, M_0 .. M_{K-1}) instead (``L_m`` bounds its
      tree, as for any scan);
    * down, ``bppsa_factored_down_<kind>``: block c * B + b replays chunk c from its carry with mat-vecs and
      writes the scan's output P [n, B, H] (``grads`` False, or I = 0), or accumulates the block's sums of the
      parameter gradients [NA, I + 1 + H] (the CPU kernel's ``acc``) for every block, [K·B, NA, I + 1 + H];
    * with the gradients, ``bppsa_factored_grads`` (``factored.cu``): the pairs' sums added in a fixed order into the
      flat parameter gradients (:func:`grad_index`; pointers ``(accs, map, grads)``, integers ``(K·B, NA·NBV, total)``).

    ``affine``: the per-step-gradient scan, v_{k+1} = J_k v_k + c_k (the down kernels' mode & 2: each mat-vec adds
    c_k).  The middle scan is then, after the up kernel, the down kernel from zero (mode & 4) writing each chunk's
    offset [K, B, H] (its replay with the c_k injected), and the middle kernel with mode & 2: carry_{c+1} =
    M_c carry_c + offset_c (its pointers are ``(aggregates, offsets, carries)``; the single seed's offsets: a stand-in).

    ``warp_down`` False: factored.cu's down kernel even where the warp kernel fits (the first GPU runs' plan).

    C is the caller's: the cost model's :func:`.cost_model.chunk_size` picks it where none is given (it evaluates
    this plan, so the plan cannot ask it back).  K = 1 (n <= C) is the down launch alone, from g.  Every kernel takes
    the pointers ``(Wt, f, carries, c, P, acc)`` (up: ``(Wt, f, aggregates)``) and the integers
    ``(n, B, H, I, C, pitch, G, mode)``: mode & 1 the gradients' sums, & 2 the c_k injected, & 4 the offsets."""
    if kind not in FACTORED_KINDS:
        raise ValueError(f"unknown chain kind {kind!r} (choose from {', '.join(FACTORED_KINDS)})")
    if n < 1:
        raise ValueError(f"a factored plan needs n >= 1 steps, got {n}")
    if C is None or C < 1:
        raise ValueError(f"chunk size must be >= 1, got {C}")
    if itemsize not in (4, 8):
        raise ValueError(f"itemsize must be 4 or 8, got {itemsize}")
    grads = grads and I > 0
    NW, NF = FACTORED_KINDS[kind]
    HH, P = H * H, smem_pitch(H)
    K = -(-n // C)
    last = n - (K - 1) * C  # the steps of the last chunk (it may be short); the K - 1 others have C

    def chunks(per_chunk) -> int:  # a count summed over the chunks, each an affine function of its length
        return (K - 1) * per_chunk(C) + per_chunk(last)
    mode = (1 if grads else 0) | (2 if affine else 0)
    ints = (n, B, H, I, C, P, FACTORED_GROUP, mode)
    smem_up, smem_down = factored_smem(kind, H, I, grads)
    launches: list[Launch] = []
    if K > 1:
        nfu = 1 if kind == "rnn" else 4  # factor rows the Jacobian needs: d, or c_r, c_z, c_n, z
        build = HH if kind == "rnn" else 5 * HH + H  # W^T d (one product per element), or 3 products, 2 sums, + z
        # Per block: W^T staged once, nfu·H factors per step read, the aggregate written; the first step's
        # Jacobian is the aggregate, every later one costs its build and a matrix-matrix product.
        moved = B * chunks(lambda L: NW * HH + L * nfu * H + HH)
        flop = B * chunks(lambda L: L * build + (L - 1) * 2 * HH * H)
        if register_up and up_columns(H, itemsize):  # register_up=False: the shared-memory kernel (the first GPU run's)
            NR = NF * H + I + H
            for what, value in (("n", n), ("K * B", K * B), ("NR * B", NR * B)):
                if value > INT32_MAX:  # the register kernel's 32-bit indices (its pointers advance in 64 bits)
                    raise ValueError(f"factored up kernel: {what} = {value} exceeds its 32-bit indices")
            grid, block = up_geometry(H, itemsize, K * B)
            # W^T is staged once per thread block; moved counts it once per pair as the shared-memory kernel does
            launches.append(Launch(f"bppsa_factored_up_{kind}", grid, block, up_reg_smem(kind, H, itemsize), ints,
                                   moved=moved, flop=flop, consts=up_constants(H)))
        else:
            launches.append(Launch(f"bppsa_factored_up_smem_{kind}", K * B, up_threads(H), smem_up, ints,
                                   moved=moved, flop=flop))
        if affine:
            _, smem_off = factored_smem(kind, H, I, False)
            nfo = 1 if kind == "rnn" else 4
            launches.append(_down(kind, n, B, H, I, K, itemsize, smem_off, down_threads(H, False), ints[:-1] + (2 | 4,),
                                  moved=B * chunks(lambda L: NW * HH + L * (nfo + 1) * H + H),
                                  flop=B * chunks(lambda L: L * (NW * H + _matvec_flop(kind, H) + H)), warp=warp_down))
        if L_m is not None and not affine:
            launches.extend(scan_plan(K + 1, B, H, L_m)[1])
        else:
            launches.append(middle_launch(n, B, H, I, C, itemsize, affine, warps))
    nfd = 1 if kind == "rnn" else (5 if grads else 4)
    # t = factors ⊙ v every step (NW·H products); the mat-vec to the next step (all but the chunk's last):
    # RNN 2H² (W^T t), GRU 6H² + H (three W^T t and z ⊙ v).
    t_flop = NW * H
    mv = _matvec_flop(kind, H)
    moved = B * chunks(lambda L: NW * HH + H + L * nfd * H)
    flop = B * chunks(lambda L: L * t_flop + (L - 1) * mv)
    if grads:
        NA, NBV = (H if kind == "rnn" else 4 * H), I + 1 + H
        entries = grad_entries(kind, H, I)
        # per step the x and h' columns read, the NA gradient rows formed (one product each) and every
        # accumulated entry updated (a multiply-add); per block the sums written
        moved += B * chunks(lambda L: L * (I + H) + NA * NBV)
        flop += B * chunks(lambda L: L * (NA + 2 * entries))
    else:
        moved += n * B * H  # P written
    if affine:
        moved, flop = moved + n * B * H, flop + n * B * H  # c read, added
    down = _down(kind, n, B, H, I, K, itemsize, smem_down, down_threads(H, grads), ints, moved, flop, grads, warp_down)
    launches.append(down)
    if grads:
        total = grad_total(kind, H, I)
        parts = down.grid if down.consts else K * B  # the warp kernel's sums per block, the other's per pair
        launches.append(Launch("bppsa_factored_grads", -(-total // 32), 32 * GRADS_WARPS, 32 * GRADS_WARPS,
                               (parts, NA * NBV, total), moved=parts * total + 2 * total, flop=(parts - 1) * total))
    return C, tuple(launches)


def _down(kind, n, B, H, I, K, itemsize, smem, threads, ints, moved, flop, grads=False, warp=True) -> Launch:
    """A down launch: the warp kernel (``factored_warp.cu``: a warp per pair, DOWN_WARPS pairs a block, shared memory
    only for the block's sums [NA, I + 1 + H]) where :func:`down_warp_fits`, else factored.cu's (a block per pair)."""
    if warp and down_warp_fits(kind, H, I, itemsize):
        return Launch(f"bppsa_factored_down_warp_{kind}", -(-K * B // DOWN_WARPS), 32 * DOWN_WARPS,
                      down_warp_smem(kind, H, I, itemsize, grads), ints, moved=moved, flop=flop,
                      consts=warp_constants(H, I))
    return Launch(f"bppsa_factored_down_{kind}", K * B, threads, smem, ints, moved=moved, flop=flop)


def middle_launch(n: int, B: int, H: int, I: int, C: int, itemsize: int, affine: bool, warps: int) -> Launch:
    """The one-launch middle phase over the K = ceil(n / C) chunks (``factored_plan``'s middle): ``warps`` clamped to
    [1, min(:func:`middle_max_warps`, K - 1)].  Counts, per batch element: every transition's aggregate read by the walk
    that writes its carry, the composed segments' read once more, the carries written and g read (and each offset read
    as often as its aggregate); a mat-vec per walked transition, (H + 1) columns of an H x H product per composed one
    after a segment's first, and a map (H x (H + 1)) applied per segment start."""
    K = -(-n // C)
    W = max(1, min(warps, middle_max_warps(H, itemsize), K - 1))
    L, Wn = middle_segments(K, W)
    nt = K - 1
    composed = L * max(0, Wn - 2) if W > 1 else 0  # the transitions composed (segments 1 .. Wn - 2)
    HH = H * H
    moved = B * ((nt + composed) * HH + nt * H + H + ((nt + composed) * H if affine else 0))
    flop = B * (nt * 2 * HH + max(0, composed - max(0, Wn - 2)) * 2 * HH * (H + 1) + max(0, Wn - 2) * (2 * HH + H)
                + (nt * H if affine else 0))
    mode = 2 if affine else 0
    return Launch("bppsa_factored_middle", B, 32 * W, middle_smem(H, itemsize, W),
                  (n, B, H, I, C, smem_pitch(H), FACTORED_GROUP, mode), moved=moved, flop=flop,
                  consts=warp_constants(H, I))


def _matvec_flop(kind: str, H: int) -> int:
    """FLOP of one step's mat-vec in the down kernel: RNN 2H² (W^T t), GRU 6H² + H (three W^T t and z ⊙ v)."""
    return 2 * H * H if kind == "rnn" else 6 * H * H + H


def factored_source(launch: Launch) -> str:
    """The source a factored plan's launch runs from."""
    if launch.kernel == "bppsa_factored_middle" or launch.kernel.startswith("bppsa_factored_down_warp_"):
        return "factored_warp.cu"
    if launch.consts:
        return "factored_up.cu"
    return "factored.cu" if launch.kernel.startswith("bppsa_factored_") else "blelloch.cu"


def factored_buffers(kind: str, n: int, B: int, H: int, I: int, C: int, launches: tuple[Launch, ...],
                     L_m: int | None) -> dict[str, tuple[int, ...] | None]:
    """The work buffers of a factored plan (``C, launches`` from :func:`factored_plan`) by name, and their shapes;
    None where no launch of the plan touches one (a one-element stand-in then gives the kernel a real address).
    ``carries`` [K, B, H]: with one chunk, ∇h_T itself; with a middle scan (``S``: ∇h_T, then one vector per level)
    its output; else (the middle kernel) ∇h_T first.  ``P``: the scan's output; ``accs``: the
    parameter-gradient sums per pair; ``gmap`` (int32) and ``grads``: the flat gradients' entries of the sums
    (:func:`grad_index`) and the flat gradients, which the plan's last launch writes; ``agg``: the chunks' aggregates;
    ``offsets``: the affine scan's per-chunk offsets.  The operands a caller brings (``Wt``, ``f``, ``c``) are not
    among them (:func:`factored_operands`)."""
    K = -(-n // C)
    sums = launches[-1].kernel == "bppsa_factored_grads"
    middle = any(factored_source(x) == "blelloch.cu" for x in launches)
    NA, NBV = (H if kind == "rnn" else 4 * H), I + 1 + H
    return {"carries": (K, B, H), "agg": (K, B, H, H) if K > 1 else None, "P": None if sums else (n, B, H),
            "accs": (launches[-1].ints[0], NA, NBV) if sums else None,
            "gmap": (launches[-1].ints[2],) if sums else None, "grads": (launches[-1].ints[2],) if sums else None,
            "S": (_scan.tree_levels(K + 1, L_m) + 1, B, H) if middle else None,
            "offsets": (K, B, H) if any(x.ints[-1] & 4 for x in launches if x.kernel.startswith("bppsa_factored_down"))
            else None}


def factored_operands(launch: Launch, bufs: dict) -> tuple:
    """The operands of one launch of a factored plan, in the kernel's order, from ``bufs``: the work buffers of
    :func:`factored_buffers` (or their pointers) and ``Wt``, ``f``, ``c`` (the affine scan's per-step gradients; None
    where there are none) and ``unused`` (the stand-in every None is given as)."""
    b = {k: (bufs["unused"] if v is None else v) for k, v in bufs.items()}
    src = factored_source(launch)
    if src == "blelloch.cu":
        return b["agg"], b["S"], b["carries"]
    if "_up_" in launch.kernel:
        return b["Wt"], b["f"], b["agg"]
    if launch.kernel == "bppsa_factored_middle":
        return b["agg"], b["offsets"], b["carries"]
    if launch.kernel == "bppsa_factored_grads":
        return b["accs"], b["gmap"], b["grads"]
    if launch.ints[-1] & 4:  # the affine scan's offsets, from zero: no output of P or sums
        return b["Wt"], b["f"], b["carries"], b["c"], b["offsets"], b["unused"]
    return b["Wt"], b["f"], b["carries"], b["c"], b["P"], b["accs"]
