"""The analytic CSR transposed Jacobians against torch.func.jacrev, on random shapes."""
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import jacrev

from bppsa.jacobians import sparse as sj


def jac_t(f, x):
    """Dense transposed Jacobian [inputs, outputs] of f at x from autograd."""
    J = jacrev(f)(x)
    n_out = J.numel() // x.numel()
    return J.reshape(n_out, x.numel()).T.numpy()


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 7), p=st.integers(0, 3), ci=st.integers(1, 3), co=st.integers(1, 3),
    h=st.integers(1, 9), w=st.integers(1, 9), seed=st.integers(0, 2**16),
)
def test_conv2d_matches_jacrev(k, p, ci, co, h, w, seed):
    if h + 2 * p - k + 1 < 1 or w + 2 * p - k + 1 < 1:
        with pytest.raises(ValueError):
            sj.conv2d_jacobian_t(torch.zeros(co, ci, k, k), (ci, h, w), p)
        return
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(co, ci, k, k, generator=g, dtype=torch.float64)
    x = torch.randn(ci, h, w, generator=g, dtype=torch.float64)
    M = sj.conv2d_jacobian_t(weight, (ci, h, w), p)
    ref = jac_t(lambda t: torch.nn.functional.conv2d(t[None], weight, padding=p)[0], x)
    assert isinstance(M, sp.csr_matrix) and M.shape == ref.shape
    np.testing.assert_allclose(M.toarray(), ref, atol=1e-6, rtol=0)
    assert M.has_canonical_format
    # exactly the guaranteed non-zeros: with random weights no tap is zero, so the pattern is autograd's
    assert M.nnz == int((ref != 0).sum())


@pytest.mark.parametrize("k", range(1, 8))
def test_conv2d_rectangular_kernel_and_pruned_weights(k):
    g = torch.Generator().manual_seed(k)
    weight = torch.randn(2, 2, k, max(1, 8 - k), generator=g, dtype=torch.float64)
    weight[weight.abs() < 0.7] = 0.0  # "pruned"
    x = torch.randn(2, 8, 9, generator=g, dtype=torch.float64)
    ref = jac_t(lambda t: torch.nn.functional.conv2d(t[None], weight, padding=min(3, k // 2))[0], x)
    kept = sj.conv2d_jacobian_t(weight, (2, 8, 9), min(3, k // 2))
    dropped = sj.conv2d_jacobian_t(weight, (2, 8, 9), min(3, k // 2), drop_zeros=True)
    np.testing.assert_allclose(kept.toarray(), ref, atol=1e-6)
    np.testing.assert_allclose(dropped.toarray(), ref, atol=1e-6)
    assert dropped.nnz == int((ref != 0).sum()) < kept.nnz  # pruned taps stored only when asked


@settings(max_examples=25, deadline=None)
@given(c=st.integers(1, 4), h=st.integers(1, 7), w=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_relu_matches_jacrev(c, h, w, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, h, w, generator=g, dtype=torch.float64)
    x[0, 0, 0] = 0.0  # autograd's derivative at exactly 0 is 0
    ref = jac_t(torch.relu, x)
    M = sj.relu_jacobian_t(x)
    np.testing.assert_allclose(M.toarray(), ref, atol=1e-6)
    assert M.nnz == x.numel()  # the whole diagonal: inactive units are explicit zeros
    D = sj.relu_jacobian_t(x, drop_zeros=True)
    assert D.nnz == int((x > 0).sum())
    np.testing.assert_allclose(D.toarray(), ref, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 4), c=st.integers(1, 3), h=st.integers(1, 9), w=st.integers(1, 9),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_maxpool_matches_jacrev(k, c, h, w, ties, seed):
    if h < k or w < k:
        with pytest.raises(ValueError):
            sj.maxpool2d_jacobian_t(torch.zeros(c, h, w), k)
        return
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, h, w, generator=g, dtype=torch.float64)
    if ties:
        x = x.round()  # many ties: the winner must be autograd's
    ref = jac_t(lambda t: torch.nn.functional.max_pool2d(t[None], k, stride=k)[0], x)
    M = sj.maxpool2d_jacobian_t(x, k)
    np.testing.assert_allclose(M.toarray(), ref, atol=1e-6)
    n_out = c * (h // k) * (w // k)
    assert M.nnz == n_out * k * k  # every window member: the winner's 1 and explicit zeros
    D = sj.maxpool2d_jacobian_t(x.numpy(), k, drop_zeros=True)
    assert D.nnz == n_out
    np.testing.assert_allclose(D.toarray(), ref, atol=1e-6)


def test_linear_matches_jacrev():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(5, 7, generator=g, dtype=torch.float64)
    W[0, :3] = 0
    x = torch.randn(7, generator=g, dtype=torch.float64)
    ref = jac_t(lambda t: t @ W.T, x)
    np.testing.assert_allclose(sj.linear_jacobian_t(W).toarray(), ref, atol=1e-6)
    assert sj.linear_jacobian_t(W).nnz == 35 and sj.linear_jacobian_t(W, drop_zeros=True).nnz == 32


def test_table1_sparsities():
    """The measured guaranteed-zero sparsity of VGG-11's first layers is the paper's Table 1 example."""
    conv = sj.conv2d_jacobian_t(torch.randn(64, 3, 3, 3), (3, 32, 32), 1)
    assert round(sj.guaranteed_sparsity(conv), 5) == 0.99157  # exact, padding included (94^2 / 1024^2)
    relu = sj.relu_jacobian_t(torch.randn(64, 32, 32))
    assert round(sj.guaranteed_sparsity(relu), 5) == round(1 - 1 / 65536, 5)
    pool = sj.maxpool2d_jacobian_t(torch.randn(64, 32, 32), 2)
    assert round(sj.guaranteed_sparsity(pool), 5) == 0.99994
    assert sj.sparsity_expression("conv2d", c=3, h=32, w=32, hf=3, wf=3) == pytest.approx(1 - 9 / 1024)


def test_autograd_columns_baseline_equals_analytic():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 2, 3, 3, generator=g)
    x = torch.randn(2, 6, 5, generator=g)
    A = sj.autograd_jacobian_t_columns(lambda t: torch.nn.functional.conv2d(t[None], w, padding=1)[0], x)
    M = sj.conv2d_jacobian_t(w, (2, 6, 5), 1, dtype=np.float32)
    assert abs(A - M).max() < 1e-6 and A.nnz == M.nnz


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="channels"):
        sj.conv2d_jacobian_t(torch.zeros(2, 3, 3, 3), (4, 8, 8), 1)
    with pytest.raises(ValueError, match="kernel size"):
        sj.conv2d_jacobian_t(torch.zeros(1, 1, 9, 9), (1, 12, 12), 1)
    with pytest.raises(ValueError, match="padding"):
        sj.conv2d_jacobian_t(torch.zeros(1, 1, 3, 3), (1, 12, 12), 4)
