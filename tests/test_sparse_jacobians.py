"""The operator registry's transposed Jacobians (one sample, as scipy CSR) against torch.func.jacrev."""
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import jacrev

from bppsa.jacobians import operators as ops
from bppsa.jacobians import sparse as sj


def jac_t(f, x):
    """Dense transposed Jacobian [inputs, outputs] of f at x from autograd."""
    J = jacrev(f)(x)
    n_out = J.numel() // x.numel()
    return J.detach().reshape(n_out, x.numel()).T.numpy()


def conv_t(weight, shape, p, *, drop_zeros=False, dtype=torch.float64):
    """One sample's conv transposed Jacobian from the registry, as scipy CSR."""
    co, ci, kh, kw = weight.shape
    conv = torch.nn.Conv2d(ci, co, (kh, kw), padding=p, bias=False).to(dtype)
    with torch.no_grad():
        conv.weight.copy_(weight)
    M, _ = ops.sample_jacobian_t(conv, torch.zeros(shape, dtype=dtype), drop_zeros=drop_zeros, dtype=dtype)
    return ops.to_scipy(M)


def layer_t(module, x, *, drop_zeros=False):
    M, _ = ops.sample_jacobian_t(module, x, drop_zeros=drop_zeros, dtype=x.dtype)
    return ops.to_scipy(M)


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 9), p=st.integers(0, 4), s=st.integers(1, 3), ci=st.integers(1, 3), co=st.integers(1, 3),
    h=st.integers(1, 9), w=st.integers(1, 9), seed=st.integers(0, 2**16),
)
def test_conv2d_matches_jacrev(k, p, s, ci, co, h, w, seed):
    if h + 2 * p - k + 1 < 1 or w + 2 * p - k + 1 < 1:
        return  # torch's conv refuses it too
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(co, ci, k, k, generator=g, dtype=torch.float64)
    x = torch.randn(ci, h, w, generator=g, dtype=torch.float64)
    conv = torch.nn.Conv2d(ci, co, k, stride=s, padding=p, bias=False).double()
    with torch.no_grad():
        conv.weight.copy_(weight)
    M = layer_t(conv, x)
    ref = jac_t(lambda t: conv(t[None])[0], x)
    assert isinstance(M, sp.csr_matrix) and M.shape == ref.shape
    np.testing.assert_allclose(M.toarray(), ref, atol=1e-12, rtol=0)
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
    kept = conv_t(weight, (2, 8, 9), min(3, k // 2))
    dropped = conv_t(weight, (2, 8, 9), min(3, k // 2), drop_zeros=True)
    np.testing.assert_allclose(kept.toarray(), ref, atol=1e-12)
    np.testing.assert_allclose(dropped.toarray(), ref, atol=1e-12)
    assert dropped.nnz == int((ref != 0).sum()) < kept.nnz  # pruned taps stored only when asked


@settings(max_examples=25, deadline=None)
@given(c=st.integers(1, 4), h=st.integers(1, 7), w=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_relu_matches_jacrev(c, h, w, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, h, w, generator=g, dtype=torch.float64)
    x[0, 0, 0] = 0.0  # autograd's derivative at exactly 0 is 0
    ref = jac_t(torch.relu, x)
    M = layer_t(torch.nn.ReLU(), x)
    np.testing.assert_allclose(M.toarray(), ref, atol=1e-12)
    assert M.nnz == x.numel()  # the whole diagonal: inactive units are explicit zeros
    D = layer_t(torch.nn.ReLU(), x, drop_zeros=True)
    assert D.nnz == int((x > 0).sum())
    np.testing.assert_allclose(D.toarray(), ref, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 4), c=st.integers(1, 3), h=st.integers(1, 9), w=st.integers(1, 9),
       ties=st.booleans(), seed=st.integers(0, 2**16))
def test_maxpool_matches_jacrev(k, c, h, w, ties, seed):
    if h < k or w < k:
        return  # torch's pool refuses it too
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c, h, w, generator=g, dtype=torch.float64)
    if ties:
        x = x.round()  # many ties: the winner must be autograd's
    ref = jac_t(lambda t: torch.nn.functional.max_pool2d(t[None], k, stride=k)[0], x)
    pool = torch.nn.MaxPool2d(k, k)
    M = layer_t(pool, x)
    np.testing.assert_allclose(M.toarray(), ref, atol=1e-12)
    n_out = c * (h // k) * (w // k)
    assert M.nnz == n_out * k * k  # every window member: the winner's 1 and explicit zeros
    D = layer_t(pool, x, drop_zeros=True)
    assert D.nnz == n_out
    np.testing.assert_allclose(D.toarray(), ref, atol=1e-12)


def test_linear_matches_jacrev():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(7, 5, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(5, 7, generator=g, dtype=torch.float64))
        lin.weight[0, :3] = 0
    x = torch.randn(7, generator=g, dtype=torch.float64)
    ref = jac_t(lambda t: lin(t), x)
    np.testing.assert_allclose(layer_t(lin, x).toarray(), ref, atol=1e-12)
    assert layer_t(lin, x).nnz == 35 and layer_t(lin, x, drop_zeros=True).nnz == 32


def test_table1_sparsities():
    """The measured guaranteed-zero sparsity of VGG-11's first layers is the paper's Table 1 example."""
    conv = conv_t(torch.randn(64, 3, 3, 3, dtype=torch.float64), (3, 32, 32), 1)
    assert round(sj.guaranteed_sparsity(conv), 5) == 0.99157  # exact, padding included (94^2 / 1024^2)
    relu = layer_t(torch.nn.ReLU(), torch.randn(64, 32, 32, dtype=torch.float64))
    assert round(sj.guaranteed_sparsity(relu), 5) == round(1 - 1 / 65536, 5)
    pool = layer_t(torch.nn.MaxPool2d(2), torch.randn(64, 32, 32, dtype=torch.float64))
    assert round(sj.guaranteed_sparsity(pool), 5) == 0.99994
    assert sj.sparsity_expression("conv2d", c=3, h=32, w=32, hf=3, wf=3) == pytest.approx(1 - 9 / 1024)


def test_autograd_columns_baseline_equals_analytic():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 2, 3, 3, generator=g)
    x = torch.randn(2, 6, 5, generator=g)
    A = sj.autograd_jacobian_t_columns(lambda t: torch.nn.functional.conv2d(t[None], w, padding=1)[0], x)
    M = conv_t(w, (2, 6, 5), 1, dtype=torch.float32)
    assert abs(A - M).max() < 1e-6 and A.nnz == M.nnz


def test_batched_is_block_diagonal_of_samples():
    """A batch's operator is one CSR whose blocks are the samples' own (so one scan step is one product)."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 6, 5, dtype=torch.float64)
    for layer in (torch.nn.Conv2d(2, 3, 3, stride=2).double(), torch.nn.MaxPool2d(3, 2), torch.nn.ReLU()):
        op = ops.operator_for(layer)
        with torch.no_grad():
            y, ctx = op.forward(layer, x)
        M = op.jacobian_t(layer, x, y, ctx).to_dense()
        n_in, n_out = x[0].numel(), y[0].numel()
        assert M.shape == (3 * n_in, 3 * n_out)
        for b in range(3):
            block = layer_t(layer, x[b]).toarray()
            np.testing.assert_array_equal(M[b * n_in:(b + 1) * n_in, b * n_out:(b + 1) * n_out].numpy(), block)
            M[b * n_in:(b + 1) * n_in, b * n_out:(b + 1) * n_out] = 0
        assert not M.any()  # nothing off the diagonal blocks


def test_unsupported_modules_are_named():
    with pytest.raises(ValueError, match="GELU"):
        ops.operator_for(torch.nn.GELU())
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        ops.operator_for(torch.nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"))
