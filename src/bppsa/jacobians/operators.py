"""THE registry of transposed-Jacobian operators: one per forward module type, analytic, in torch sparse CSR.

For a layer ``y = f(x)`` run on a batch ``x`` of ``B`` samples, :meth:`Operator.jacobian_t` returns the
transposed Jacobian of the whole batch as ONE block-diagonal ``torch.sparse_csr`` matrix of shape
``[B * n_in, B * n_out]`` (``n_in``/``n_out`` the elements of one sample, C-order), so that back-propagation
through the layer is ``grad_x.reshape(-1) = M @ grad_y.reshape(-1)`` and one step of the scan over a batch is
one sparse product (on a GPU torch runs it with cuSPARSE; no CUDA source of ours).  Every value comes from the
forward's values (weights, activations, pool winners, the dropout mask), never from autograd.

This module is the only generator of analytic Jacobians in the package: ``bppsa.nn.Sequential`` scans them,
Table 1 (``bppsa jacobians-table1``) times them and the static FLOP analysis of Fig 10 (:mod:`bppsa.flops`) counts
their products (one sample, through :func:`to_scipy`).

Which zeros are stored (``drop_zeros``): *guaranteed* zeros -- fixed by the architecture, zero for every input
and weight -- are never stored.  Input- or weight-dependent zeros (an inactive ReLU, a pool input that lost its
window, a dropped unit, a pruned weight) are stored as explicit zeros by default, so that the pattern is the one
known before the data are seen and ``1 - nnz / (rows * cols)`` is Table 1's guaranteed-zero sparsity;
``drop_zeros=True`` removes them (what a sparse kernel exploiting the values, and pruning, sees).

Parameter gradients (:meth:`Operator.param_grads`) come from the layer's input and the gradient of its output
(the scanned ∇y_i), each layer on its own.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "OPERATORS",
    "Operator",
    "Unsupported",
    "block_diag_csr",
    "check_supported",
    "clear_patterns",
    "operator_for",
    "sample_jacobian_t",
    "supported_names",
    "to_scipy",
]


# torch's notice that its sparse CSR support is "beta", once per process: this module is that support's user
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


class Unsupported(ValueError):
    """A module (or a module's configuration) that has no transposed-Jacobian operator."""


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


# -- CSR assembly -------------------------------------------------------------------------------------------


def block_diag_csr(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, B: int, n_in: int, n_out: int,
                   *, drop_zeros: bool = False) -> torch.Tensor:
    """The ``[B * n_in, B * n_out]`` block-diagonal CSR whose block ``b`` holds entries ``(rows, cols)`` with
    values ``vals[b]`` (``vals`` ``[nnz]``: the same in every block).  ``rows`` must ascend, ``cols`` ascend
    within a row (one sample's pattern in row-major order); ``drop_zeros`` removes entries whose value is 0."""
    nnz = rows.numel()
    dev = vals.device
    shared = vals.dim() == 1
    vals = vals.expand(B, nnz) if shared else vals
    offs = torch.arange(B, device=dev)
    c = (cols[None, :] + (offs * n_out)[:, None]).reshape(-1)
    v = vals.reshape(-1)
    if not drop_zeros or (shared and not bool((v[:nnz] == 0).any())):
        # every block has the sample's pattern: its row pointers, shifted block by block
        counts = torch.bincount(rows, minlength=n_in)
        crow = torch.zeros(B * n_in + 1, dtype=torch.int64, device=dev)
        crow[1:] = (torch.cumsum(counts, 0)[None, :] + (offs * nnz)[:, None]).reshape(-1)
        return torch.sparse_csr_tensor(crow, c, v.contiguous(), (B * n_in, B * n_out), check_invariants=False)
    r = (rows[None, :] + (offs * n_in)[:, None]).reshape(-1)
    if drop_zeros:
        keep = v != 0
        r, c, v = r[keep], c[keep], v[keep]
    counts = torch.bincount(r, minlength=B * n_in)
    crow = torch.zeros(B * n_in + 1, dtype=torch.int64, device=dev)
    torch.cumsum(counts, 0, out=crow[1:])
    return torch.sparse_csr_tensor(crow, c, v.contiguous(), (B * n_in, B * n_out), check_invariants=False)


def _sorted_pattern(rows: torch.Tensor, cols: torch.Tensor, n_out: int, *extra: torch.Tensor):
    """``rows, cols, *extra`` reordered row-major (ascending column inside a row)."""
    order = torch.argsort(rows * n_out + cols)
    return (rows[order], cols[order], *(e[order] for e in extra))


def _diag(vals: torch.Tensor, drop_zeros: bool) -> torch.Tensor:
    """A diagonal transposed Jacobian (element-wise layers), ``vals`` ``[B, n]``."""
    B, n = vals.shape
    idx = torch.arange(n, device=vals.device)
    return block_diag_csr(idx, idx, vals, B, n, n, drop_zeros=drop_zeros)


_patterns: dict = {}  # window patterns by geometry and device: computed once, reused by every batch


def clear_patterns() -> None:
    """Forget the cached sparsity patterns, so that the next generation builds its pattern as well as its values
    (Table 1 times a generation from nothing, as the paper does)."""
    _patterns.clear()


def _windows(H: int, W: int, Ho: int, Wo: int, k, s, p, d, device) -> torch.Tensor:
    """``pix[K, Ho*Wo]``: for each window tap and output position, the flat input pixel it reads (-1: padding).

    Covers convolution and pooling with any kernel, stride, padding and dilation (and pooling's ``ceil_mode``,
    whose last window may reach past the padding: it reads padding there, as torch does)."""
    key = ("win", H, W, Ho, Wo, k, s, p, d, str(device))
    if key not in _patterns:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = k, s, p, d
        plane = torch.arange(H * W, dtype=torch.float64, device=device).reshape(1, 1, H, W)
        need_h, need_w = (Ho - 1) * sh + dh * (kh - 1) + 1, (Wo - 1) * sw + dw * (kw - 1) + 1
        extra_h, extra_w = max(0, need_h - H - 2 * ph), max(0, need_w - W - 2 * pw)
        plane = F.pad(plane, (pw, pw + extra_w, ph, ph + extra_h), value=-1.0)
        pix = F.unfold(plane, (kh, kw), dilation=(dh, dw), stride=(sh, sw))[0]
        if pix.shape[-1] != Ho * Wo:
            raise RuntimeError(f"window pattern has {pix.shape[-1]} outputs, the forward {Ho * Wo}")
        _patterns[key] = pix.round().to(torch.int64)
    return _patterns[key]


def _pool_pattern(C: int, H: int, W: int, Ho: int, Wo: int, k, s, p, d, device):
    """One sample's pooling pattern: rows (input), cols (output), and each entry's tap pixel, row-major."""
    key = ("pool", C, H, W, Ho, Wo, k, s, p, d, str(device))
    if key not in _patterns:
        pix = _windows(H, W, Ho, Wo, k, s, p, d, device)
        t, o = torch.nonzero(pix >= 0, as_tuple=True)
        px = pix[t, o]
        L = Ho * Wo
        c = torch.arange(C, device=device)[:, None]
        rows = (c * (H * W) + px[None]).reshape(-1)
        cols = (c * L + o[None]).reshape(-1)
        _patterns[key] = _sorted_pattern(rows, cols, C * L, px.expand(C, -1).reshape(-1))
    return _patterns[key]


# -- the operators ------------------------------------------------------------------------------------------


class Operator:
    """The transposed-Jacobian operator of one module type."""

    types: tuple[type, ...] = ()

    def check(self, module: nn.Module) -> None:
        """Refuse a configuration the operator does not cover (raise :class:`Unsupported`, naming it)."""

    def forward(self, module: nn.Module, x: torch.Tensor):
        """``(y, ctx)``: the module's output (bitwise torch's) and what its Jacobian needs beyond ``x`` and ``y``."""
        return module(x), None

    def jacobian_t(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx, *,
                   drop_zeros: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def param_grads(self, module: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx, gy: torch.Tensor) -> dict:
        """``{parameter name: gradient}`` from the layer's input and its output's gradient ``gy``."""
        return {}


class Conv2dOp(Operator):
    """``nn.Conv2d`` with any kernel, stride, padding (numbers or 'same'/'valid'), dilation, groups; bias or none.
    Values are the filter weights, whatever the input."""

    types = (nn.Conv2d,)

    def check(self, module):
        if module.padding_mode != "zeros":
            raise Unsupported(f"Conv2d with padding_mode='{module.padding_mode}' has no operator (only 'zeros')")
        k, d = _pair(module.kernel_size), _pair(module.dilation)
        if module.padding == "same" and any(d[i] * (k[i] - 1) % 2 for i in range(2)):
            raise Unsupported("Conv2d(padding='same') with an even dilated kernel pads one side more; give the "
                              "padding as numbers")

    def _geometry(self, module, x, y):
        B, C, H, W = x.shape
        k, s, d = _pair(module.kernel_size), _pair(module.stride), _pair(module.dilation)
        if isinstance(module.padding, str):  # 'valid' is 0; 'same' pads (total) d*(k-1), the extra on the right
            p = tuple(0 if module.padding == "valid" else (d[i] * (k[i] - 1)) // 2 for i in range(2))
        else:
            p = _pair(module.padding)
        return C, H, W, y.shape[2], y.shape[3], k, s, p, d

    def _pattern(self, module, C, H, W, Ho, Wo, k, s, p, d, device):
        Co, G = module.out_channels, module.groups
        key = ("conv", Co, G, C, H, W, Ho, Wo, k, s, p, d, str(device))
        if key not in _patterns:
            pix = _windows(H, W, Ho, Wo, k, s, p, d, device)
            K, L = pix.shape
            t, o = torch.nonzero(pix >= 0, as_tuple=True)
            px = pix[t, o]
            cig, cog = C // G, Co // G
            co = torch.arange(Co, device=device)[:, None, None]
            cil = torch.arange(cig, device=device)[None, :, None]
            ci = (co // cog) * cig + cil
            rows = (ci * (H * W) + px).reshape(-1)
            cols = (co * L + o).expand(Co, cig, -1).reshape(-1)
            widx = ((co * cig + cil) * K + t).reshape(-1)
            _patterns[key] = _sorted_pattern(rows, cols, Co * L, widx)
        return _patterns[key]

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        C, H, W, Ho, Wo, k, s, p, d = self._geometry(module, x, y)
        rows, cols, widx = self._pattern(module, C, H, W, Ho, Wo, k, s, p, d, x.device)
        vals = module.weight.detach().reshape(-1)[widx].to(x.dtype)
        if drop_zeros:  # pruned taps: the same in every sample, so filtered before the batch is laid out
            keep = vals != 0
            rows, cols, vals = rows[keep], cols[keep], vals[keep]
        return block_diag_csr(rows, cols, vals, x.shape[0], C * H * W, module.out_channels * Ho * Wo)

    def param_grads(self, module, x, y, ctx, gy):
        _, _, _, _, _, _, s, p, d = self._geometry(module, x, y)
        out = {"weight": torch.nn.grad.conv2d_weight(x, module.weight.shape, gy, s, p, d, module.groups)}
        if module.bias is not None:
            out["bias"] = gy.sum((0, 2, 3))
        return out


class ReLUOp(Operator):
    """``nn.ReLU``: diagonal, 1 where ``x > 0`` (autograd's derivative at 0 is 0)."""

    types = (nn.ReLU,)

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        return _diag((x > 0).to(x.dtype).reshape(x.shape[0], -1), drop_zeros)


class LeakyReLUOp(Operator):
    """``nn.LeakyReLU``: diagonal, 1 where ``x > 0`` else the negative slope (as torch's backward)."""

    types = (nn.LeakyReLU,)

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        one = torch.ones((), dtype=x.dtype, device=x.device)
        v = torch.where(x > 0, one, one * module.negative_slope)
        return _diag(v.reshape(x.shape[0], -1), drop_zeros)


class TanhOp(Operator):
    """``nn.Tanh``: diagonal, ``1 - y²`` from the forward's output (as torch's backward)."""

    types = (nn.Tanh,)

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        return _diag((1 - y * y).reshape(x.shape[0], -1), drop_zeros)


class MaxPool2dOp(Operator):
    """``nn.MaxPool2d`` with any window, stride, padding, dilation, ceil_mode; windows may overlap (an input then
    wins several).  Each (input, window) pair is an entry, 1 for the window's winner (torch's own indices, so ties
    go as autograd sends them), an explicit 0 for the others unless ``drop_zeros``."""

    types = (nn.MaxPool2d,)

    def check(self, module):
        if module.return_indices:
            raise Unsupported("MaxPool2d(return_indices=True) returns a tuple; a Sequential layer must return a tensor")

    def forward(self, module, x):
        return F.max_pool2d(x, module.kernel_size, module.stride, module.padding, module.dilation,
                            ceil_mode=module.ceil_mode, return_indices=True)

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        B, C, H, W = x.shape
        Ho, Wo = y.shape[2:]
        k, p, d = _pair(module.kernel_size), _pair(module.padding), _pair(module.dilation)
        s = _pair(module.stride if module.stride is not None else module.kernel_size)
        rows, cols, px = _pool_pattern(C, H, W, Ho, Wo, k, s, p, d, x.device)
        win = ctx.reshape(B, -1)  # [B, C*Ho*Wo]: the winner's pixel in its channel's plane
        vals = (win[:, cols] == px[None]).to(x.dtype)
        return block_diag_csr(rows, cols, vals, B, C * H * W, C * Ho * Wo, drop_zeros=drop_zeros)


class AvgPool2dOp(Operator):
    """``nn.AvgPool2d`` with any window, stride, padding, ceil_mode, count_include_pad, divisor_override: each
    (input, window) entry is 1 / the window's divisor, the same for every input."""

    types = (nn.AvgPool2d,)

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        B, C, H, W = x.shape
        Ho, Wo = y.shape[2:]
        k, p = _pair(module.kernel_size), _pair(module.padding)
        s = _pair(module.stride if module.stride is not None else module.kernel_size)
        rows, cols, px = _pool_pattern(C, H, W, Ho, Wo, k, s, p, (1, 1), x.device)
        # the divisor of each window, as torch counts it: pooling a plane of ones gives (inputs read) / divisor
        ones = torch.ones(1, 1, H, W, dtype=torch.float64, device=x.device)
        frac = F.avg_pool2d(ones, k, s, p, module.ceil_mode, module.count_include_pad,
                            module.divisor_override).reshape(-1)
        read = (_windows(H, W, Ho, Wo, k, s, p, (1, 1), x.device) >= 0).sum(0).to(torch.float64)
        divisor = torch.round(read / frac)
        vals = (1.0 / divisor).to(x.dtype)[cols % (Ho * Wo)]
        return block_diag_csr(rows, cols, vals, B, C * H * W, C * Ho * Wo)


class FlattenOp(Operator):
    """``nn.Flatten`` (start_dim >= 1): the identity, the elements keep their C order."""

    types = (nn.Flatten,)

    def check(self, module):
        if module.start_dim == 0:
            raise Unsupported("Flatten(start_dim=0) merges the batch dimension; only start_dim >= 1 is supported")

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        return _diag(torch.ones(x.shape[0], x[0].numel(), dtype=x.dtype, device=x.device), False)


class LinearOp(Operator):
    """``nn.Linear`` on ``[B, in]``: ``weight.T`` in every block (no guaranteed zeros; pruned weights are explicit
    zeros unless ``drop_zeros``)."""

    types = (nn.Linear,)

    def forward(self, module, x):
        if x.dim() != 2:  # refused when it runs, before the backward
            raise Unsupported(f"Linear on a {x.dim()}-D input {tuple(x.shape)}: only [batch, features] is "
                              "supported (put an nn.Flatten before it)")
        return module(x), None

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        n_out, n_in = module.weight.shape
        key = ("linear", n_in, n_out, str(x.device))
        if key not in _patterns:
            rows = torch.arange(n_in, device=x.device).repeat_interleave(n_out)
            _patterns[key] = (rows, torch.arange(n_out, device=x.device).repeat(n_in))
        rows, cols = _patterns[key]
        vals = module.weight.detach().t().reshape(-1).to(x.dtype)
        if drop_zeros:
            keep = vals != 0
            rows, cols, vals = rows[keep], cols[keep], vals[keep]
        return block_diag_csr(rows, cols, vals, x.shape[0], n_in, n_out)

    def param_grads(self, module, x, y, ctx, gy):
        out = {"weight": gy.t() @ x}
        if module.bias is not None:
            out["bias"] = gy.sum(0)
        return out


class DropoutOp(Operator):
    """``nn.Dropout``: diagonal, the mask it drew times 1/(1-p) (zeros where dropped: explicit unless
    ``drop_zeros``); the identity in eval mode.  The mask is drawn as torch.nn.Dropout draws it (on the CPU a
    Bernoulli tensor of the input's shape, on a GPU torch's fused kernel), so a seed gives torch's output."""

    types = (nn.Dropout,)

    def forward(self, module, x):
        p = float(module.p)
        if not module.training or p == 0.0:
            return x.clone(), None
        if p == 1.0:
            return torch.zeros_like(x), torch.zeros_like(x)
        if x.is_cuda:
            y, keep = torch.native_dropout(x, p, True)
            return y, keep.to(x.dtype) / (1.0 - p)
        scale = torch.empty_like(x).bernoulli_(1.0 - p).div_(1.0 - p)
        return x * scale, scale

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        scale = torch.ones_like(x) if ctx is None else ctx
        return _diag(scale.reshape(x.shape[0], -1), drop_zeros)


class BatchNorm2dOp(Operator):
    """``nn.BatchNorm2d`` in eval mode (running statistics): diagonal, ``weight / sqrt(running_var + eps)`` per
    channel.  In training mode a sample's output depends on the whole batch: refused when it runs."""

    types = (nn.BatchNorm2d,)

    def check(self, module):
        if not module.track_running_stats:
            raise Unsupported("BatchNorm2d(track_running_stats=False) normalises by the batch's statistics; only "
                              "eval mode with running statistics is supported")

    def forward(self, module, x):
        if module.training:
            raise Unsupported("BatchNorm2d in training mode normalises by the batch's statistics (every sample's "
                              "output depends on every other); only eval mode is supported: call .eval() on it")
        return module(x), None

    def _scale(self, module, x):
        s = torch.rsqrt(module.running_var.to(x.dtype) + module.eps)
        return s * module.weight.detach().to(x.dtype) if module.affine else s

    def jacobian_t(self, module, x, y, ctx, *, drop_zeros=False):
        B, C, H, W = x.shape
        v = self._scale(module, x)[:, None].expand(C, H * W).reshape(-1)
        idx = torch.arange(C * H * W, device=x.device)
        return block_diag_csr(idx, idx, v, B, C * H * W, C * H * W, drop_zeros=drop_zeros)

    def param_grads(self, module, x, y, ctx, gy):
        if not module.affine:
            return {}
        xhat = (x - module.running_mean.to(x.dtype)[:, None, None]) * torch.rsqrt(
            module.running_var.to(x.dtype) + module.eps)[:, None, None]
        return {"weight": (gy * xhat).sum((0, 2, 3)), "bias": gy.sum((0, 2, 3))}


OPERATORS: tuple[Operator, ...] = (Conv2dOp(), ReLUOp(), LeakyReLUOp(), TanhOp(), MaxPool2dOp(), AvgPool2dOp(),
                                   FlattenOp(), LinearOp(), DropoutOp(), BatchNorm2dOp())
_BY_TYPE = {t: op for op in OPERATORS for t in op.types}


def supported_names() -> list[str]:
    return [t.__name__ for op in OPERATORS for t in op.types]


def operator_for(module: nn.Module, name: str | None = None) -> Operator:
    """The operator of ``module``'s exact type (a subclass may change the forward, so it is not assumed), its
    configuration checked; :class:`Unsupported` names the layer and lists what is supported otherwise."""
    op = _BY_TYPE.get(type(module))
    where = f"layer '{name}' " if name is not None else ""
    if op is None:
        raise Unsupported(f"{where}({type(module).__name__}) has no transposed-Jacobian operator; supported: "
                          f"{', '.join(supported_names())}")
    try:
        op.check(module)
    except Unsupported as exc:
        raise Unsupported(f"{where}({type(module).__name__}): {exc}") from None
    return op


def check_supported(modules) -> list[Operator]:
    """The operators of ``modules`` (``(name, module)`` pairs), or :class:`Unsupported` naming the first without."""
    return [operator_for(m, name) for name, m in modules]


@torch.no_grad()
def sample_jacobian_t(module: nn.Module, x: torch.Tensor, *, drop_zeros: bool = False, dtype=torch.float64,
                      forward=None):
    """One sample's transposed Jacobian (``x`` without its batch dimension) and the layer's output, by the layer's
    operator: ``(torch sparse CSR [n_in, n_out], y)``.  ``forward``: the ``(y, ctx)`` of a forward already run on
    ``x[None]`` (Table 1 takes the pool indices as given, as the paper's Algorithm 8), else it is run here."""
    op = operator_for(module)
    xb = x.detach().to(dtype)[None]
    y, ctx = forward if forward is not None else op.forward(module, xb)
    return op.jacobian_t(module, xb, y, ctx, drop_zeros=drop_zeros), y[0]


def to_scipy(M: torch.Tensor):
    """A torch sparse CSR as a scipy ``csr_matrix`` (host copy), indices sorted (for the FLOP analysis)."""
    import numpy as np
    import scipy.sparse as sp

    crow, col, val = (t.detach().cpu().numpy() for t in (M.crow_indices(), M.col_indices(), M.values()))
    idx = np.int32 if max(M.shape) < 2**31 - 1 and len(val) < 2**31 - 1 else np.int64
    out = sp.csr_matrix((val, col.astype(idx), crow.astype(idx)), shape=tuple(M.shape))
    out.has_sorted_indices = True
    return out


def density(M: torch.Tensor) -> float:
    """Stored entries / all entries of one block (the batch's blocks have the same shape)."""
    return M._nnz() / max(1, math.prod(M.shape))
