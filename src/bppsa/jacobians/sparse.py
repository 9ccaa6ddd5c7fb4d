"""Analytic transposed Jacobians of conv2d, ReLU, max-pool and linear layers in CSR (Appendix D).

Every function describes ONE sample.  The result ``M`` has one row per flattened input element and
one column per flattened output element (C-order over ``(C, H, W)``), so that back-propagation
through the layer is ``grad_in = M @ grad_out`` -- the layout of the scan array in :mod:`bppsa.scan`.

Which zeros are stored
----------------------
* *Guaranteed* (structural) zeros -- entries that are zero for every input and every weight value,
  fixed by the architecture (Table 1's sparsity) -- are never stored.
* *Input- or weight-dependent* zeros -- a ReLU unit that is inactive, an input of a pooling window
  that did not win, a pruned (exactly zero) weight -- are stored as explicit zeros by default
  (``drop_zeros=False``), so that the stored pattern is the one known before the data are seen and
  ``1 - nnz / (rows * cols)`` is the guaranteed-zero sparsity.  ``drop_zeros=True`` removes them,
  which is what a sparse kernel exploiting the actual values (and pruning) would see; the static
  FLOP analysis (:mod:`bppsa.flops`) uses that mode.

Everything is vectorised index arithmetic: nothing loops over rows or non-zeros in Python.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

__all__ = [
    "conv2d_jacobian_t",
    "relu_jacobian_t",
    "maxpool2d_jacobian_t",
    "linear_jacobian_t",
    "guaranteed_sparsity",
    "sparsity_expression",
    "autograd_jacobian_t_columns",
]

MAX_KERNEL = 7
MAX_PADDING = 3


def _np(a, dtype=None) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    return a.astype(dtype, copy=False) if dtype is not None else a


def _csr(data, indices, indptr, shape, drop_zeros: bool) -> sp.csr_matrix:
    idx_dtype = np.int32 if max(shape) < 2**31 - 1 and len(data) < 2**31 - 1 else np.int64
    m = sp.csr_matrix(
        (data, indices.astype(idx_dtype, copy=False), indptr.astype(idx_dtype, copy=False)), shape=shape
    )
    # Entries are produced row-major with ascending columns and no duplicates, so the matrix is
    # already canonical; telling scipy spares it a sort when products are formed later.
    m.has_sorted_indices = True
    if drop_zeros:
        m.eliminate_zeros()
    return m


def _taps_1d(size: int, k: int, p: int) -> tuple[np.ndarray, np.ndarray, int]:
    """For each input coordinate, the filter taps that read it, ordered by ascending output coordinate.

    Returns ``valid[size, k]`` and ``out[size, k]``: slot ``j`` is tap ``u = k - 1 - j`` and output
    coordinate ``o = i + p - u``; ``valid`` says whether ``0 <= o < out_size``.
    """
    out_size = size + 2 * p - k + 1
    i = np.arange(size)[:, None]
    u = (k - 1 - np.arange(k))[None, :]
    o = i + p - u
    return (o >= 0) & (o < out_size), o, out_size


def conv2d_jacobian_t(weight, input_shape, padding: int = 0, *, drop_zeros: bool = False,
                      dtype=np.float64) -> sp.csr_matrix:
    """Transposed Jacobian of ``y = conv2d(x, weight, stride=1, padding=padding)`` for one sample.

    ``weight``: ``[C_o, C_i, k_h, k_w]`` (torch or numpy), ``input_shape = (C_i, H, W)``.  Row
    ``(c_i, h, w)`` holds, for every output channel and every output pixel whose receptive field
    covers ``(h, w)``, the filter weight that multiplies it -- the values depend on the weights
    only, never on the input.  Stored: every (input, output) pair joined by a filter tap, including
    taps whose weight is zero unless ``drop_zeros`` (pruned weights are then dropped).
    """
    w = _np(weight, dtype)
    if w.ndim != 4:
        raise ValueError(f"conv weight must be [C_o, C_i, k_h, k_w], got shape {w.shape}")
    co, ci, kh, kw = w.shape
    if len(input_shape) != 3:
        raise ValueError(f"input_shape must be (C, H, W), got {tuple(input_shape)}")
    c_in, H, W = (int(s) for s in input_shape)
    if c_in != ci:
        raise ValueError(f"input has {c_in} channels but the weight expects {ci}")
    if not (1 <= kh <= MAX_KERNEL and 1 <= kw <= MAX_KERNEL):
        raise ValueError(f"kernel size must be 1..{MAX_KERNEL}, got {kh}x{kw}")
    if not 0 <= padding <= MAX_PADDING:
        raise ValueError(f"padding must be 0..{MAX_PADDING}, got {padding}")
    vh, oh, Ho = _taps_1d(H, kh, padding)
    vw, ow, Wo = _taps_1d(W, kw, padding)
    if Ho < 1 or Wo < 1:
        raise ValueError(f"a {kh}x{kw} kernel with padding {padding} does not fit a {H}x{W} input")

    # Spatial template S: (input pixel, tap) pairs in row-major order of (h, w, j_h, j_w); since the
    # tap slots are ordered by output coordinate, output pixels ascend inside each input pixel.
    mask = vh[:, None, :, None] & vw[None, :, None, :]  # [H, W, kh, kw]
    h_i, w_i, jh, jw = np.nonzero(mask)
    s_out = oh[h_i, jh] * Wo + ow[w_i, jw]
    s_u, s_v = kh - 1 - jh, kw - 1 - jw
    n_s = mask.reshape(H * W, -1).sum(1)  # taps per input pixel
    s_start = np.concatenate(([0], np.cumsum(n_s)[:-1]))

    # One input channel's rows: for each input pixel, all output channels, each with that pixel's taps.
    row_len = co * n_s
    t = np.arange(row_len.sum())
    pix = np.repeat(np.arange(H * W), row_len)
    off = t - np.repeat(np.cumsum(row_len) - row_len, row_len)
    t_co = off // n_s[pix]
    e = s_start[pix] + off % n_s[pix]
    cols = t_co * (Ho * Wo) + s_out[e]
    flat = (t_co * kh + s_u[e]) * kw + s_v[e]
    # [C_i, len]: one pattern, each channel's weights
    vals = np.take(w.transpose(1, 0, 2, 3).reshape(ci, -1), flat, axis=1)

    indptr = np.concatenate(([0], np.cumsum(np.tile(row_len, ci))))
    return _csr(vals.reshape(-1), np.tile(cols, ci), indptr, (ci * H * W, co * Ho * Wo), drop_zeros)


def relu_jacobian_t(x, *, drop_zeros: bool = False, dtype=np.float64) -> sp.csr_matrix:
    """Transposed Jacobian of ReLU at ``x`` (any shape, one sample): diagonal, 1 where ``x > 0``.

    Off-diagonal entries are guaranteed zeros (never stored).  The diagonal of an inactive unit
    (``x <= 0``; autograd's derivative at 0 is 0 too) is stored as an explicit 0 unless ``drop_zeros``
    -- as in the paper's Algorithm 7.
    """
    v = _np(x).reshape(-1)
    d = v.size
    data = (v > 0).astype(dtype)
    idx = np.arange(d)
    return _csr(data, idx, np.arange(d + 1), (d, d), drop_zeros)


def _pool_indices(x: np.ndarray | torch.Tensor, k: int) -> np.ndarray:
    """Winner of each window as a flat index into its channel's H*W plane (PyTorch's tie-breaking)."""
    xt = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    with torch.no_grad():
        _, idx = torch.nn.functional.max_pool2d(xt.detach().unsqueeze(0), k, stride=k, return_indices=True)
    return idx[0].cpu().numpy()


def maxpool2d_jacobian_t(x, kernel_size: int, *, indices=None, drop_zeros: bool = False,
                         dtype=np.float64) -> sp.csr_matrix:
    """Transposed Jacobian of ``max_pool2d(x, kernel_size, stride=kernel_size)`` at ``x = (C, H, W)``.

    Each input element inside a window has exactly one possible non-zero, in the column of its
    window's output; it is 1 for the window's winner.  Stored: the winner's 1, plus the other
    window members as explicit zeros unless ``drop_zeros`` (then one entry per output, the paper's
    Algorithms 8-10).  Inputs that fall in no window (``H`` or ``W`` not a multiple of the kernel)
    have empty rows.  ``indices`` (the ``return_indices`` of PyTorch's max_pool2d, ``[C, Ho, Wo]``)
    is computed from ``x`` when not given, so ties are broken exactly as autograd breaks them.
    """
    k = int(kernel_size)
    shape = tuple(x.shape)
    if len(shape) != 3:
        raise ValueError(f"max-pool input must be (C, H, W), got shape {shape}")
    C, H, W = shape
    Ho, Wo = H // k, W // k
    if k < 1 or Ho < 1 or Wo < 1:
        raise ValueError(f"pool window {k} does not fit a {H}x{W} input")
    win = _pool_indices(x, k) if indices is None else _np(indices)
    if win.shape != (C, Ho, Wo):
        raise ValueError(f"pool indices must be {(C, Ho, Wo)}, got {win.shape}")
    hh, ww = np.arange(H)[:, None], np.arange(W)[None, :]
    inside = np.broadcast_to((hh < Ho * k) & (ww < Wo * k), (C, H, W))
    out_idx = (np.arange(C)[:, None, None] * Ho + np.minimum(hh // k, Ho - 1)) * Wo + np.minimum(ww // k, Wo - 1)
    out_idx = np.broadcast_to(out_idx, (C, H, W))
    winner = np.zeros((C, H * W), dtype=bool)
    np.put_along_axis(winner, win.reshape(C, -1).astype(np.int64), True, axis=1)
    keep = inside & (winner.reshape(C, H, W) | (not drop_zeros))
    keep = keep.reshape(-1)
    indptr = np.concatenate(([0], np.cumsum(keep)))
    data = winner.reshape(-1)[keep].astype(dtype)
    return _csr(data, out_idx.reshape(-1)[keep], indptr, (C * H * W, C * Ho * Wo), False)


def linear_jacobian_t(weight, *, drop_zeros: bool = False, dtype=np.float64) -> sp.csr_matrix:
    """Transposed Jacobian of ``y = x @ weight.T (+ b)``: ``weight.T``, ``[in, out]``.

    A linear layer has no guaranteed zeros; pruned (zero) weights are stored unless ``drop_zeros``.
    """
    w = _np(weight, dtype)
    if w.ndim != 2:
        raise ValueError(f"linear weight must be [out, in], got shape {w.shape}")
    n_out, n_in = w.shape
    data = np.ascontiguousarray(w.T).reshape(-1)
    indices = np.tile(np.arange(n_out), n_in)
    indptr = np.arange(n_in + 1) * n_out
    return _csr(data, indices, indptr, (n_in, n_out), drop_zeros)


def guaranteed_sparsity(m: sp.spmatrix) -> float:
    """Fraction of entries not stored (exact for matrices built with ``drop_zeros=False``)."""
    rows, cols = m.shape
    return 1.0 - m.nnz / (rows * cols)


def sparsity_expression(op: str, *, c: int, h: int, w: int, hf: int = 1, wf: int = 1) -> float:
    """Table 1's closed-form sparsity of guaranteed zeros (the conv form ignores padding, as the paper's ‡)."""
    if op == "conv2d":
        return 1.0 - hf * wf / (h * w)
    if op == "relu":
        return 1.0 - 1.0 / (c * h * w)
    if op == "maxpool2d":
        return 1.0 - hf * wf / (c * h * w)
    raise ValueError(f"unknown operator '{op}'")


def autograd_jacobian_t_columns(f, x: torch.Tensor) -> sp.csr_matrix:
    """The baseline of Table 1: the transposed Jacobian of ``f`` at ``x`` through autograd, one column
    (one output element, one vector-Jacobian product) at a time, gathered into the same CSR layout.

    Only the non-zeros of each column are kept, so memory stays at the CSR size (the dense
    transposed Jacobian of ReLU at 64x32x32 alone would take 16 GiB).
    """
    x = x.detach().clone().requires_grad_(True)
    y = f(x)
    flat = y.reshape(-1)
    e = torch.zeros_like(flat)
    rows, vals = [], []
    for j in range(flat.numel()):
        e[j] = 1.0
        (col,) = torch.autograd.grad(flat, x, e, retain_graph=True)
        e[j] = 0.0
        col = col.reshape(-1).cpu().numpy()
        # numpy, not torch.nonzero: torch's CPU nonzero keeps an input-sized buffer alive per result
        nz = np.flatnonzero(col)
        rows.append(nz)
        vals.append(col[nz])
    counts = np.array([len(r) for r in rows], dtype=np.int64)
    r = np.concatenate(rows)
    v = np.concatenate(vals)
    c = np.repeat(np.arange(flat.numel()), counts)
    return sp.csc_matrix((v, (r, c)), shape=(x.numel(), flat.numel())).tocsr()
