"""Every implementation of the scan tree held to the one reference, bppsa.scan.reference_scan.

Like accelerated-scan's ``test_eq.py``: the torch scan, the CPU fast path, the CUDA launch plan and
the FLOP analysis against the plain position-by-position walk of Algorithm 1, on random lengths
N = n + 1 that are not powers of two and random L_m.
"""
import numpy as np
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bppsa import flops, scan
from bppsa.backends import cpu
from bppsa.backends.cuda import plan


def _mv(a, v):
    return torch.matmul(a, v.unsqueeze(-1)).squeeze(-1)


def _reference(g, J, L_m):
    out, _ = scan.reference_scan(g, list(J), L_m, matmat=torch.matmul, matvec=_mv)
    return torch.stack(out) if out else g.new_empty((0,) + tuple(g.shape))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if b.numel() else 0.0


lengths = st.integers(1, 400).filter(lambda n: (n + 1) & n)  # N = n + 1 not a power of two
L_ms = st.one_of(st.none(), st.integers(0, 10))


@settings(max_examples=60, deadline=None)
@given(n=lengths, B=st.integers(1, 4), H=st.integers(1, 7), L_m=L_ms, seed=st.integers(0, 2 ** 16))
def test_torch_scan_and_cpu_fast_path_equal_the_reference(n, B, H, L_m, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(B, H, generator=gen, dtype=torch.float64)
    J = torch.randn(n, B, H, H, generator=gen, dtype=torch.float64) / H ** 0.5
    ref = _reference(g, J, L_m)
    assert _rel(scan.blelloch_scan(g, J, L_m), ref) <= 1e-12
    assert _rel(cpu.cpu_scan(g, J, L_m), ref) <= 1e-12


def _products(N, L_m):
    """(phase, d, l, r) of every product of the reference, on placeholder operands."""
    seen = []
    scan.reference_scan(None, [None] * (N - 1), L_m, matmat=lambda a, b: None, matvec=lambda a, v: None,
                        record=lambda phase, d, kind, l, r, *_: seen.append((phase, d, l, r)))
    return seen


def _blocks(launch):
    """(l, r) of each pair a sweep launch works on, by the kernels' own index formula (batch 0)."""
    N, B, H, first_l, half, step, d = launch.ints
    pairs = []
    for block in range(0, launch.grid, B):
        left = first_l + (block // B) * step
        pairs.append((left, min(left + half, N - 1)))
    return pairs


@settings(max_examples=150, deadline=None)
@given(N=st.integers(1, 5000).filter(lambda N: N & (N - 1)), L_m=L_ms, B=st.integers(1, 3))
def test_cuda_launch_plan_walks_the_reference_tree(N, L_m, B):
    L, launches = plan.scan_plan(N, B, 4, L_m)
    assert L == scan.tree_levels(N, L_m)
    products = _products(N, L_m)
    for launch in launches:
        if launch.kernel == "bppsa_middle_scan":
            size, K, m_L = launch.ints[3:6]
            ends = scan.middle_ends(N, L)
            assert (size, K, m_L) == (1 << L, len(ends), L)
            assert [(l, r) for ph, _, l, r in products if ph == "middle"] == list(zip(ends[1:-1], ends[2:]))
            continue
        phase = "up" if launch.kernel == "bppsa_up_sweep" else "down"
        d = launch.ints[-1]
        want = [(l, r) for ph, dd, l, r in products if ph == phase and dd == d]
        got = _blocks(launch)
        # the down-sweep's spine pair (pair 0) is a copy, not a product
        assert (got if phase == "up" else got[1:]) == want
    assert (len(scan.middle_ends(N, L)) > 1) == any(x.kernel == "bppsa_middle_scan" for x in launches)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 60).filter(lambda n: (n + 1) & n), H=st.integers(2, 6), L_m=L_ms,
       seed=st.integers(0, 2 ** 16))
def test_flop_analysis_is_the_reference_with_counting_products(n, H, L_m, seed):
    rng = np.random.default_rng(seed)
    dense = [(rng.standard_normal((H, H)) * (rng.random((H, H)) < 0.4)) for _ in range(n)]
    g = rng.standard_normal(H)
    out, ops = flops.scan_with_flops(g, [sp.csr_matrix(a) for a in dense], L_m)
    ref, _ = scan.reference_scan(g, dense, L_m, matmat=np.matmul, matvec=np.matmul)
    np.testing.assert_allclose(np.stack(out), np.stack(ref), rtol=1e-12, atol=1e-12)
    assert [(op.phase, op.d, op.l, op.r) for op in ops] == _products(n + 1, L_m)


def test_reference_matches_the_sequential_scan_and_handles_one_position():
    assert scan.reference_scan("g", [], None, matmat=None, matvec=None) == ([], [])
    gen = torch.Generator().manual_seed(0)
    g, J = torch.randn(2, 3, generator=gen, dtype=torch.float64), torch.randn(12, 2, 3, 3, generator=gen,
                                                                              dtype=torch.float64)
    for L_m in (None, 0, 1, 2, 3, 99):
        assert _rel(_reference(g, J, L_m), scan.linear_scan(g, J)) <= 1e-12
