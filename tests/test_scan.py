"""The scan core against the sequential scan (what ordinary back-propagation computes)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bppsa.scan import blelloch_scan, levels, linear_scan, num_levels


def _chain(n, B, H, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # scale keeps long products in range so relative errors stay meaningful
    J = torch.randn(n, B, H, H, generator=g, dtype=dtype) / math.sqrt(H)
    return torch.randn(B, H, generator=g, dtype=dtype), J


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 130), B=st.integers(1, 4), H=st.integers(1, 6), L_m=st.one_of(st.none(), st.integers(0, 9)),
       seed=st.integers(0, 2**16))
def test_blelloch_matches_linear(n, B, H, L_m, seed):
    g, J = _chain(n, B, H, seed=seed)
    out = blelloch_scan(g, J, L_m)
    ref = linear_scan(g, J)
    assert out.shape == (n, B, H)
    if n:
        assert _rel(out, ref) <= 1e-12


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 999, 1000])
def test_every_L_m_is_the_same_scan(n):
    g, J = _chain(n, 3, 4)
    ref = linear_scan(g, J)
    for L_m in range(0, num_levels(n + 1) + 2):
        assert _rel(blelloch_scan(g, J, L_m), ref) <= 1e-12, L_m


def test_exclusive_scan_semantics_by_hand():
    """out = [g, J1 g, J2 J1 g] for the array [g, J1, J2, J3]: J3 never touches an output."""
    g = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    J1 = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]], dtype=torch.float64)  # swap
    J2 = torch.tensor([[[2.0, 0.0], [0.0, 3.0]]], dtype=torch.float64)  # scale
    J3 = torch.full((1, 2, 2), float("nan"), dtype=torch.float64)
    out = blelloch_scan(g, torch.stack([J1, J2, J3]))
    assert torch.equal(out, torch.tensor([[[1.0, 2.0]], [[2.0, 1.0]], [[4.0, 3.0]]], dtype=torch.float64))


def test_input_is_not_modified():
    g, J = _chain(37, 2, 3)
    J0 = J.clone()
    blelloch_scan(g, J)
    blelloch_scan(g, J, 2)
    assert torch.equal(J, J0)


@pytest.mark.parametrize("N", list(range(1, 70)) + [1000, 1001, 2049])
def test_levels_cover_a_tree(N):
    """Each level pairs disjoint blocks; after all levels the root holds the whole array."""
    assert len(levels(N)) == num_levels(N) == (0 if N == 1 else math.ceil(math.log2(N)))
    span = {p: (p, p) for p in range(N)}  # node at index p covers positions [lo, p]
    for level in levels(N):
        for l, r in level.pairs():
            assert 0 <= l < r <= N - 1
            lo_l, hi_l = span[l]
            lo_r, hi_r = span[r]
            assert hi_l + 1 == lo_r, "blocks must be adjacent"
            span[r] = (lo_l, hi_r)
    assert span[N - 1] == (0, N - 1)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="expected g"):
        blelloch_scan(torch.zeros(2, 3), torch.zeros(4, 2, 3, 4))


def test_workspace_reuse_never_leaks_into_results():
    """A reused workspace gives the same answers, and a returned result is never overwritten."""
    from bppsa.scan import Workspace

    ws = Workspace()
    g1, J1 = _chain(300, 3, 5, seed=1)
    g2, J2 = _chain(300, 3, 5, seed=2)
    out1 = blelloch_scan(g1, J1, workspace=ws)
    kept = out1.clone()
    out2 = blelloch_scan(g2, J2, workspace=ws)
    assert torch.equal(out1, kept)
    assert _rel(out2, linear_scan(g2, J2)) <= 1e-12
    g3, J3 = _chain(77, 3, 5, seed=3)  # another shape through the same workspace
    assert _rel(blelloch_scan(g3, J3, 3, workspace=ws), linear_scan(g3, J3)) <= 1e-12


# -- the per-step-gradient (affine) scan -------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 16, 17, 100])
def test_affine_scan_is_the_reference_tree_bit_for_bit(n):
    """The pairs' tree of Algorithm 1 (reference_scan on (A, b) pairs) and the batched twin agree exactly,
    for every L_m, and both equal the step-by-step recurrence g_t = J g_{t+1} + c_t."""
    from bppsa.scan import affine_blelloch_scan, affine_linear_scan, affine_pair_ops, reference_scan

    g, J = _chain(n, 3, 4, seed=n)
    c = torch.randn(n, 3, 4, generator=torch.Generator().manual_seed(n + 1), dtype=torch.float64)
    ref = affine_linear_scan(g, J, c)
    mm, mv = affine_pair_ops()
    for L_m in [None] + list(range(num_levels(n + 1) + 2)):
        out = affine_blelloch_scan(g, J, c, L_m)
        assert out.shape == (n, 3, 4)
        if n:
            tree, _ = reference_scan(g, [(J[k], c[k]) for k in range(n)], L_m, matmat=mm, matvec=mv)
            assert torch.equal(out, torch.stack(tree)), L_m
            assert _rel(out, ref) <= 1e-12, L_m


def test_affine_scan_with_zero_injections_is_the_papers_scan():
    from bppsa.scan import affine_blelloch_scan

    g, J = _chain(37, 2, 3)
    for L_m in (None, 0, 2):
        assert torch.equal(affine_blelloch_scan(g, J, torch.zeros(37, 2, 3, dtype=J.dtype), L_m),
                           blelloch_scan(g, J, L_m))


def test_affine_scan_rejects_bad_injections():
    from bppsa.scan import affine_blelloch_scan

    g, J = _chain(5, 2, 3)
    with pytest.raises(ValueError, match="expected c"):
        affine_blelloch_scan(g, J, torch.zeros(4, 2, 3, dtype=J.dtype))
