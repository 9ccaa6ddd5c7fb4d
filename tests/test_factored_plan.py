"""The factored path's plan in pure Python: launches, their ``moved`` and ``flop`` counted by hand on tiny shapes,
the chunk size, shared memory, and the bank conflicts of the kernels' shared-memory access patterns."""
from __future__ import annotations

import pytest

from bppsa.backends.cuda import cost_model, plan


@pytest.mark.parametrize("B", [1, 3, 16, 256])
@pytest.mark.parametrize("H", [7, 20])
def test_chunk_size_leaves_at_least_eight_chunks(H, B):
    """C is the power of two that minimises the cost model's estimate among those leaving >= 8 chunks; below 8 steps,
    C = 1."""
    for n in (1, 2, 5, 7, 8, 9, 15, 16, 37, 100, 1000, 1034, 30000, 10**6):
        for kind in ("rnn", "gru"):
            C = cost_model.chunk_size(kind, n, B, H)
            assert C >= 1 and C & (C - 1) == 0, (n, B, C)
            if n < plan.MIN_CHUNKS:
                assert C == 1, (n, C)
                continue
            assert -(-n // C) >= plan.MIN_CHUNKS and C <= n // plan.MIN_CHUNKS, (n, B, C)
            cands = [1 << e for e in range(20) if 1 << e <= min(plan.CHUNK_MAX, n // plan.MIN_CHUNKS)]
            assert plan.chunk_candidates(n) == cands
            best = min(cost_model.chunk_cost(kind, n, B, H, 1, c) for c in cands)
            assert cost_model.chunk_cost(kind, n, B, H, 1, C) == best, (n, B, C)
    assert cost_model.chunk_size("rnn", 7, B, H) == 1  # 7 chunks of 1


def test_chunk_cost_balances_the_phases():
    """At the paper's T = 30000, B = 16, H = 20 neither end is best: C = 1 makes the middle scan as long as a full
    Blelloch scan, C = n / 8 makes a chunk's chain the sequential limit."""
    n, B, H = 30000, 16, 20
    C = cost_model.chunk_size("rnn", n, B, H)
    assert 1 < C < n // 8
    cost = lambda c: cost_model.chunk_cost("rnn", n, B, H, 1, c)  # noqa: E731
    assert cost(C) < cost(1) and cost(C) < cost(2048)
    # more sequences spread the same work over more pairs: the chunks may grow
    assert (cost_model.chunk_size("rnn", 1000, 256, H) >= cost_model.chunk_size("rnn", 1000, 16, H)
            >= cost_model.chunk_size("rnn", 1000, 1, H))
    # the backend's plan uses it, for the GPU it runs on
    assert cost_model.factored_plan("rnn", n, B, H, 1)[0] == C
    h200 = cost_model.GPUS["h200"]
    assert cost_model.factored_plan("rnn", n, B, H, 1, gpu=h200)[0] == cost_model.chunk_size("rnn", n, B, H, 1, 4, h200)
    with pytest.raises(ValueError, match="chunk size"):
        plan.factored_plan("rnn", n, B, H, 1, None)


def test_up_columns_and_geometry():
    # 2·H·NC + 2·H elements within UP_REGISTER_WORDS 32-bit registers
    assert [plan.up_columns(H, 4) for H in (7, 16, 20, 26, 40, 41, 64)] == [4, 4, 2, 2, 1, 0, 0]
    assert [plan.up_columns(H, 8) for H in (7, 13, 20, 21)] == [4, 2, 1, 0]
    assert plan.up_constants(20) == (("BPPSA_H", 20), ("BPPSA_NC32", 2), ("BPPSA_NC64", 1))
    # H = 20, fp32: 10 column blocks -> two thread blocks of 5 warps per 32 pairs
    assert plan.up_geometry(20, 4, 33) == (2 * 2, 160)
    # fp64: 20 column blocks -> three thread blocks of 7 warps (the 21st warp idles)
    assert plan.up_geometry(20, 8, 32) == (3, 224)
    assert plan.up_geometry(7, 4, 1) == (1, 64)
    assert plan.up_reg_smem("rnn", 20, 4) == 20 * 20 and plan.up_reg_smem("gru", 7, 8) == 3 * 7 * 8
    for H, itemsize, kernel in ((20, 4, "bppsa_factored_up_rnn"), (41, 4, "bppsa_factored_up_smem_rnn"),
                                (20, 8, "bppsa_factored_up_rnn"), (21, 8, "bppsa_factored_up_smem_rnn")):
        up = plan.factored_plan("rnn", 100, 2, H, 1, 8, itemsize=itemsize)[1][0]
        assert up.kernel == kernel
        assert plan.factored_source(up) == ("factored_up.cu" if up.consts else "factored.cu")
        assert up.consts == (plan.up_constants(H) if kernel == "bppsa_factored_up_rnn" else ())


def test_up_kernel_indices_fit_32_bits():
    B = (2**31) // 41 + 1  # H = 20, I = 1: NR = 41 factor rows of B lanes a step
    with pytest.raises(ValueError, match=r"NR \* B = \d+ exceeds its 32-bit indices"):
        plan.factored_plan("rnn", 16, B, 20, 1, 2, grads=False)
    plan.factored_plan("rnn", 16, B - 1000, 20, 1, 2, grads=False)


def test_rnn_plan_counts_by_hand():
    # n = 5 steps, B = 1, H = 2, I = 1, C = 2: chunks of 2, 2 and 1 steps (K = 3)
    C, launches = plan.factored_plan("rnn", 5, 1, 2, 1, 2)
    assert C == 2
    up, mid, down, red = launches
    # the middle phase in one launch, one warp: g carried across M_0 and M_1 (two mat-vecs of 2 x 2)
    assert (mid.kernel, mid.grid, mid.block, mid.consts) == ("bppsa_factored_middle", 1, 32, plan.warp_constants(2, 1))
    assert plan.factored_source(mid) == "factored_warp.cu" and mid.ints[-1] == 0
    assert (mid.moved, mid.flop) == (2 * 4 + 2 * 2 + 2, 2 * 8)  # two aggregates read, two carries written, g read
    # with L_m the paper's heterogeneous Blelloch scan over (g, M_0, M_1, M_2) instead
    assert plan.factored_plan("rnn", 5, 1, 2, 1, 2, L_m=1)[1][1:-2] == plan.scan_plan(4, 1, 2, 1)[1]
    assert (up.kernel, up.grid, up.block, down.kernel, down.grid, down.block, red.kernel) == (
        "bppsa_factored_up_rnn", 1, 32, "bppsa_factored_down_warp_rnn", 1, 256, "bppsa_factored_grads")  # 3 pairs
    assert up.ints == down.ints == (5, 1, 2, 1, 2, 3, plan.FACTORED_GROUP, 1)
    # up, per block: W^T (4) read, d (2 per step) read, the aggregate (4) written: 4+4+4, 4+4+4, 4+2+4
    assert up.moved == 12 + 12 + 10
    # d scaling W^T: 4 products per step; a 2x2 matrix product (8 multiply-adds = 16) per step after the first
    assert up.flop == (8 + 16) + (8 + 16) + 4
    # down, per block: W^T 4 + carry 2 + d 2 per step; x and h' (1 + 2) per step; the 2 x 4 sums written (8)
    assert down.moved == (4 + 2 + 4 + 6 + 8) * 2 + (4 + 2 + 2 + 3 + 8)
    # per step: t = d v (2), the rows d ⊙ v (2), 8 entries updated (16); per step but the chunk's last: W^T t (8)
    assert down.flop == 5 * (2 + 2 + 16) + 2 * 8
    # the reduction: the one block's sums (8 entries, all of them gradients: W_ih 2, b_ih 2, b_hh 2, W_hh 4 -> 10
    # flat elements) read through the map (10) and written (10); one part: no additions
    assert plan.grad_total("rnn", 2, 1) == 10 and red.ints == (1, 8, 10)
    assert (red.moved, red.flop) == (30, 0)


def test_gru_plan_counts_by_hand():
    # n = 3, B = 1, H = 1, I = 1, C = 2: chunks of 2 and 1 steps; W^T is 3 matrices of 1
    C, launches = plan.factored_plan("gru", 3, 1, 1, 1, 2)
    up, mid, down, red = launches
    assert mid == plan.middle_launch(3, 1, 1, 1, 2, 4, False, 1)
    # up: W^T 3, c_r c_z c_n z (4) per step, aggregate 1: (3 + 8 + 1) + (3 + 4 + 1)
    assert up.moved == 12 + 8
    # the Jacobian: 3 products and 2 sums per element, + z on the diagonal (6); a 1x1 product (2) after the first
    assert up.flop == (2 * 6 + 2) + 6
    # down: W^T 3 + carry 1 + five factor rows per step; x and h' (2) per step; the 4 x 3 sums written
    assert down.moved == (3 + 1 + 10 + 4 + 12) + (3 + 1 + 5 + 2 + 12)
    # per step: t (3), the rows dR dZ dN dM (4), 10 entries (dN: x and 1, dM: 1 and h') updated (20);
    # per step but the last of its chunk: three W^T t and z v (7)
    assert plan.grad_entries("gru", 1, 1) == 10
    assert down.flop == 3 * (3 + 4 + 20) + 7
    # the reduction: one block of the warp kernel; 3 (W_ih) + 3 + 3 (biases) + 3 (W_hh) flat elements
    assert red.ints == (1, 12, 12) and (red.moved, red.flop) == (3 * 12, 0)


def test_scan_only_plan_and_one_chunk():
    _, launches = plan.factored_plan("rnn", 5, 2, 2, 1, 2, grads=False)
    assert launches[-1].kernel == "bppsa_factored_down_warp_rnn" and launches[-1].ints[-1] == 0
    # down without gradients: W^T, carry and d as before, and P written (H per step)
    assert launches[-1].moved == 2 * ((4 + 2 + 4) * 2 + (4 + 2 + 2)) + 5 * 2 * 2
    C, launches = plan.factored_plan("gru", 5, 2, 3, 4, 8)  # n < C: the down phase alone, from g
    assert C == 8 and [x.kernel for x in launches] == ["bppsa_factored_down_warp_gru", "bppsa_factored_grads"]
    _, launches = plan.factored_plan("rnn", 16, 2, 3, 0, 16)  # n == C, no x: down alone, writing P
    assert [x.kernel for x in launches] == ["bppsa_factored_down_warp_rnn"]
    with pytest.raises(ValueError, match="unknown chain kind"):
        plan.factored_plan("lstm", 5, 1, 2, 1, 2)


def test_shared_memory_fits_without_opt_in_at_the_papers_sizes():
    for kind, I in (("rnn", 1), ("gru", 12)):
        for itemsize in (4, 8):
            _, launches = cost_model.factored_plan(kind, 30000, 16, 20, I, itemsize=itemsize)
            assert max(x.smem_elems for x in launches) * itemsize <= 48 * 1024, (kind, itemsize)
    up, down = plan.factored_smem("rnn", 20, 1, True)
    P = plan.smem_pitch(20)
    assert up == 4 * 20 * P + 20 and down == 20 * P + 4 * 20 + plan.FACTORED_GROUP * (20 + 22) + 20 * 22


# ---------------------------------------------------------------------------------------------
# bank conflicts
# ---------------------------------------------------------------------------------------------
def test_bank_conflicts_counts_distinct_words_per_bank():
    assert plan.bank_conflicts(range(32), 4) == 1
    assert plan.bank_conflicts([0] * 32, 4) == 1  # a broadcast
    assert plan.bank_conflicts([i * 32 for i in range(32)], 4) == 32
    assert plan.bank_conflicts([i * 2 for i in range(32)], 4) == 2
    assert plan.bank_conflicts([None] * 31 + [5], 4) == 1
    assert plan.bank_conflicts(range(32), 8) == 1  # per half-warp: 16 x 8 bytes, every bank once
    assert plan.bank_conflicts([i * 16 for i in range(32)], 8) == 16
    assert plan.bank_conflicts([0, 16] + [None] * 14 + [0, 16] + [None] * 14, 8) == 2


def _warps(threads: int, length: int, active, addr):
    """The addresses of every warp in every iteration of a kernel loop ``for (p = threadIdx.x; p < length; p +=
    blockDim.x)`` (blockDim a multiple of 32, so warps stay aligned), for the threads where ``active(p)``."""
    it = 0
    while it * threads < length:
        for w in range(threads // 32):
            ps = [it * threads + w * 32 + lane for lane in range(32)]
            yield [addr(p) if p < length and active(p) else None for p in ps]
        it += 1


def _worst(threads, length, active, addr, itemsize) -> int:
    return max(plan.bank_conflicts(a, itemsize) for a in _warps(threads, length, active, addr))


def kernel_patterns(H: int, NBV: int, itemsize: int) -> dict[str, int]:
    """The worst conflict of each shared-memory access of factored.cu at H (formulas as in the kernel)."""
    P = plan.smem_pitch(H)
    HP = H * P
    tu, td = plan.up_threads(H), plan.down_threads(H, True)
    pad = lambda p: p % P < H  # noqa: E731 - the pitched loops skip the pad column
    ms = range(H)
    return {
        # stage_wt, build_jacobian, the product's store, the aggregate's load: dst[p], W[p], J[p], Mn[p], M[p]
        "pitched element-wise": _worst(tu, HP, pad, lambda p: p, itemsize),
        # build_jacobian: fac[m], m = p % P
        "up: factor by column": _worst(tu, HP, pad, lambda p: p % P, itemsize),
        # the product: J[i * P + m] and M[m * P + j] for each m
        "up: J row": max(_worst(tu, HP, pad, lambda p, m=m: (p // P) * P + m, itemsize) for m in ms),
        "up: M column": max(_worst(tu, HP, pad, lambda p, m=m: m * P + p % P, itemsize) for m in ms),
        # the down mat-vec: thread i reads W[g * HP + i * P + m] (a column across the warp), t[m] (broadcast)
        "down: W^T column": max(_worst(td, H, lambda i: True, lambda i, m=m: i * P + m, itemsize) for m in ms),
        "down: vectors": _worst(td, H, lambda i: True, lambda i: i, itemsize),
        # the flush: acc[q], A[p * NA + q / NBV], Bv[p * NBV + q % NBV]
        "flush: sums": _worst(td, 4 * H * NBV, lambda q: True, lambda q: q, itemsize),
        "flush: rows": _worst(td, 4 * H * NBV, lambda q: True, lambda q: q // NBV, itemsize),
        "flush: columns": _worst(td, 4 * H * NBV, lambda q: True, lambda q: q % NBV, itemsize),
    }


def test_padding_removes_the_column_read_conflicts():
    H = 20
    td = plan.down_threads(H, True)
    unpadded = max(_worst(td, H, lambda i: True, lambda i, m=m: i * H + m, 4) for m in range(H))
    padded = max(_worst(td, H, lambda i: True, lambda i, m=m: i * plan.smem_pitch(H) + m, 4) for m in range(H))
    assert unpadded == 3 and padded == 1  # rows 0, 8, 16 of pitch 20 share a bank
    assert max(_worst(td, H, lambda i: True, lambda i, m=m: i * H + m, 8) for m in range(H)) == 4
    for H in (7, 20, 32, 33, 48, 64):
        td, P = plan.down_threads(H, True), plan.smem_pitch(H)
        for itemsize in (4, 8):
            assert max(_worst(td, H, lambda i: True, lambda i, m=m, P=P: i * P + m, itemsize) for m in range(H)) == 1


@pytest.mark.parametrize("H", [7, 20, 32, 64])
def test_kernel_access_patterns_are_conflict_free_in_fp32(H):
    """fp32 at H <= 32 and H = 64: every access conflict-free, except the flush's column read where a warp's 32
    entries wrap a row of NBV > 32 (cols c and c + 32 of one row: ≤ 2-way, unavoidable with entries in rows)."""
    for NBV in (22, 33):
        got = kernel_patterns(H, NBV, 4)
        assert got.pop("flush: columns") == (1 if NBV <= 32 else 2)
        assert set(got.values()) == {1}, (H, NBV, got)


@pytest.mark.parametrize("H", [7, 20, 32, 64])
def test_kernel_access_patterns_in_fp64(H):
    """fp64 is served per half-warp (16 banks of 8 bytes): a half-warp whose 16 entries wrap a row of the pitched
    H x H loops (H not a multiple of 16, H > 16) touches columns j and j + 16: ≤ 2-way there; the column read of
    W^T, the contiguous accesses and the flush's rows stay conflict-free."""
    got = kernel_patterns(H, 22, 8)
    assert max(got.values()) <= 2
    assert got["down: W^T column"] == got["pitched element-wise"] == got["flush: sums"] == got["flush: rows"] == 1
    assert got["up: J row"] == 1
    if H % 16 == 0 or H < 16:
        assert got["up: M column"] == got["up: factor by column"] == 1


def test_middle_plan_counts_and_warps():
    """The one-launch middle phase: warps clamped (K - 1 transitions; one warp where a map's H + 1 columns do not fit a
    warp; shared memory under 48 KiB), its segments, its counts by hand with a composed segment, and the cost model's
    choice of warps."""
    assert plan.middle_segments(19, 4) == (5, 4) and plan.middle_segments(10, 3) == (3, 3)
    assert plan.middle_segments(10, 8) == (2, 5)  # 9 transitions over 8 warps: segments of 2, five of them
    assert [plan.middle_max_warps(H, 4) for H in (7, 20, 31, 32, 64)] == [8, 8, 6, 1, 1]
    assert plan.middle_max_warps(20, 8) == 7 and plan.middle_max_warps(31, 8) == 3
    for H, item in ((20, 4), (20, 8), (31, 8), (7, 8)):
        assert plan.middle_smem(H, item, plan.middle_max_warps(H, item)) * item <= plan.MIDDLE_SMEM_BYTES
    assert plan.middle_launch(100, 2, 20, 1, 50, 4, False, 8).block == 32  # K = 2: one transition, one warp
    # n = 7, C = 1, H = 2, B = 1, 3 warps: 6 transitions in segments of 2; warp 1 composes 2 (one 2 x 2 by 2 x 3
    # product), warp 0 applies one map (2 x 3: 2·4 + 2 FLOP)
    m = plan.middle_launch(7, 1, 2, 1, 1, 8, True, 3)
    assert (m.block, m.ints[-1], m.smem_elems) == (96, 2, 3 * 2 * 2 + 3 * (2 * 3 + 2))
    assert m.moved == (6 + 2) * 4 + 6 * 2 + 2 + (6 + 2) * 2
    assert m.flop == 6 * 8 + 1 * 2 * 4 * 3 + 1 * (8 + 2) + 6 * 2
    h200 = cost_model.GPUS["h200"]
    assert cost_model.middle_warps(2, 20, 4, h200) == 1
    W = cost_model.middle_warps(125, 20, 4, h200)
    assert 1 < W <= plan.MIDDLE_MAX_WARPS
    clocks = [cost_model._middle_clocks(125, 20, 4, w, h200) for w in range(1, 9)]
    assert clocks[W - 1] == min(clocks) and clocks[0] > clocks[W - 1]
    # what the backend runs: the cost model's warps for its chunk size
    C, launches = cost_model.factored_plan("rnn", 1000, 16, 20, 1, gpu=h200)
    assert launches[1].block == 32 * cost_model.middle_warps(-(-1000 // C), 20, 4, h200)
