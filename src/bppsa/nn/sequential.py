"""``bppsa.nn.Sequential``: a drop-in for ``torch.nn.Sequential`` whose backward is BPPSA's scan.

::

    net = bppsa.nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1176, 10))
    loss = F.cross_entropy(net(x), y)
    loss.backward()          # the scan over the layers' transposed Jacobians, then each layer's parameter grads

It *is* an ``nn.Sequential`` (same modules, parameter names, state dict, indexing); the forward runs each layer
as torch does (recording what its Jacobian needs: pool winners, the dropout mask), and the backward:

1. builds every layer's transposed Jacobian for the whole batch, analytically, as one block-diagonal sparse CSR
   matrix (:mod:`bppsa.jacobians.operators`, the package's one registry of them);
2. runs the modified Blelloch scan of the paper (:func:`bppsa.scan.reference_scan`, with ``L_m`` up-sweep levels
   before a linear middle scan; ``None``: the full tree) over ``[∇y_n, J_nᵀ, ..., J_1ᵀ]``, each step one sparse
   product (torch.sparse, cuSPARSE on a GPU), giving every layer's output gradient ∇y_i;
3. computes each layer's parameter gradients from ∇y_i and its input, independently.

A layer without an operator is refused by name at construction (and again at the call, for layers added later),
before any work.  docs/cnn.md has the rest (the operators, the cost, the measurements).
"""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

import torch
from torch import nn

from .. import scan as _scan
from ..jacobians import operators as _ops

__all__ = ["Sequential"]


def _empty_csr(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    z = torch.zeros(rows + 1, dtype=torch.int64, device=like.device)
    e = torch.zeros(0, dtype=torch.int64, device=like.device)
    return torch.sparse_csr_tensor(z, e, torch.zeros(0, dtype=like.dtype, device=like.device), (rows, cols),
                                   check_invariants=False)


def _select_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a · b`` where ``a`` has at most one entry per row (an element-wise layer, a pool, a flatten, or products
    of them): row i of the result is row ``a.col[i]`` of ``b`` times ``a.val[i]`` -- a gather, no multiply-add."""
    a_crow, a_col, a_val = a.crow_indices(), a.col_indices(), a.values()
    b_crow, b_col, b_val = b.crow_indices(), b.col_indices(), b.values()
    has = (a_crow[1:] - a_crow[:-1]).bool()
    src = torch.zeros(a.shape[0], dtype=torch.int64, device=a_col.device)
    src[has] = a_col
    lens = torch.where(has, b_crow[src + 1] - b_crow[src], 0)
    crow = torch.zeros(a.shape[0] + 1, dtype=torch.int64, device=a_col.device)
    torch.cumsum(lens, 0, out=crow[1:])
    total = int(crow[-1])
    pos = torch.repeat_interleave(b_crow[src] - crow[:-1], lens, output_size=total)
    pos += torch.arange(total, device=a_col.device)
    scale = torch.zeros(a.shape[0], dtype=a_val.dtype, device=a_val.device)
    scale[has] = a_val
    vals = b_val.index_select(0, pos).mul_(torch.repeat_interleave(scale, lens, output_size=total))
    return torch.sparse_csr_tensor(crow, b_col.index_select(0, pos), vals, (a.shape[0], b.shape[1]),
                                   check_invariants=False)


def _one_per_row(m: torch.Tensor) -> bool:
    crow = m.crow_indices()
    return m._nnz() <= m.shape[0] and bool(((crow[1:] - crow[:-1]) <= 1).all())


def _diagonal(m: torch.Tensor) -> bool:
    """Whether ``m`` is square with entries on its diagonal only (an element-wise layer's Jacobian)."""
    if m.shape[0] != m.shape[1] or not _one_per_row(m):
        return False
    crow = m.crow_indices()
    rows = torch.repeat_interleave(torch.arange(m.shape[0], device=crow.device), crow[1:] - crow[:-1],
                                   output_size=m._nnz())
    return bool(torch.equal(rows, m.col_indices()))


def _scale_columns(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``a · d`` for a diagonal ``d``: column j of ``a`` times ``d[j, j]``, the columns ``d`` has no entry for
    dropped -- a gather of the scales, no multiply-add."""
    d_crow = d.crow_indices()
    present = (d_crow[1:] - d_crow[:-1]).bool()
    scale = torch.zeros(d.shape[0], dtype=d.values().dtype, device=d_crow.device)
    scale[present] = d.values()
    a_crow, a_col = a.crow_indices(), a.col_indices()
    vals = a.values() * scale.index_select(0, a_col)
    if bool(present.all()):
        return torch.sparse_csr_tensor(a_crow, a_col, vals, a.shape, check_invariants=False)
    keep = present.index_select(0, a_col)
    kept = torch.zeros(a_col.numel() + 1, dtype=torch.int64, device=a_col.device)
    torch.cumsum(keep, 0, out=kept[1:])
    return torch.sparse_csr_tensor(kept.index_select(0, a_crow), a_col[keep], vals[keep], a.shape,
                                   check_invariants=False)


def spmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """CSR · CSR (an up-sweep product off the spine): torch's sparse product (cuSPARSE on a GPU), or, the same
    matrix (entries and explicit zeros alike) without multiply-adds, a row gather where ``a`` has at most one entry
    per row and a column scaling where ``b`` is diagonal."""
    if a._nnz() == 0 or b._nnz() == 0:
        return _empty_csr(a.shape[0], b.shape[1], a.values())
    a, b = _int64(a), _int64(b)
    if _one_per_row(a):
        return _select_rows(a, b)
    if _diagonal(b):
        return _scale_columns(a, b)
    return _int64(a @ b)


def _int64(m: torch.Tensor) -> torch.Tensor:
    """``m`` with int64 indices, as every operator builds them (cuSPARSE's SpGEMM returns int32 ones, and a CSR's
    row pointers and columns must share a dtype in the products that follow)."""
    if m.crow_indices().dtype == torch.int64:
        return m
    return torch.sparse_csr_tensor(m.crow_indices().long(), m.col_indices().long(), m.values(), m.shape,
                                   check_invariants=False)


def spmv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """CSR · vector (the spine, the middle scan, the down-sweep)."""
    if a._nnz() == 0:
        return v.new_zeros(a.shape[0])
    return a @ v


class Recorder:
    """Where the backward's time goes: the Jacobians' generation per layer and every scan product with its level,
    positions, shapes and non-zeros (``per_product``).  Each interval ends with a device synchronisation, so it is
    the device's time; it costs that synchronisation, so a recorder is attached only when measuring.

    Any object with ``phase(like, what=..., **info)`` (a context manager) can be ``Sequential.recorder``: ``what``
    is ``jacobian`` (one layer's generation), ``scan`` (the whole scan, or with ``per_product`` each product) or
    ``params`` (one layer's parameter gradients)."""

    per_product = True

    def __init__(self):
        self.rows: list[dict] = []

    def _sync(self, t: torch.Tensor) -> None:
        if t.is_cuda:
            torch.cuda.synchronize(t.device)

    @contextlib.contextmanager
    def phase(self, like: torch.Tensor, **info):
        self._sync(like)
        t0 = time.perf_counter()
        yield
        self._sync(like)
        self.rows.append(dict(info, seconds=time.perf_counter() - t0))


def _layer_forward(op, name: str, module: nn.Module, x: torch.Tensor):
    """One layer's forward by its operator; a refusal names the layer."""
    try:
        return op.forward(module, x)
    except _ops.Unsupported as exc:
        raise _ops.Unsupported(f"bppsa.nn.Sequential: layer '{name}' ({type(module).__name__}): {exc}") from None


class _ScanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, seq: Sequential, x: torch.Tensor, *params: torch.Tensor):
        ops = seq._operators()
        acts, extra = [x], []
        for op, (name, m) in zip(ops, seq.named_children()):
            y, c = _layer_forward(op, name, m, acts[-1])
            acts.append(y)
            extra.append(c)
        out = acts[-1]
        if out.data_ptr() == x.data_ptr():  # e.g. a lone Flatten: autograd wants a new tensor, not the input
            out = out.clone()
        ctx.seq, ctx.ops, ctx.mid, ctx.extra = seq, ops, acts[1:-1], extra
        ctx.save_for_backward(x, acts[-1])
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gout: torch.Tensor):
        seq, ops = ctx.seq, ctx.ops
        x, last = ctx.saved_tensors
        acts = [x, *ctx.mid, last]
        n = len(ops)
        need_x = ctx.needs_input_grad[1]
        rec = seq.recorder
        phase = rec.phase if rec is not None else (lambda like, **info: contextlib.nullcontext())
        layers = list(seq)
        J = []
        for i in reversed(range(0 if need_x else 1, n)):
            with phase(gout, what="jacobian", layer=i, kind=type(layers[i]).__name__):
                J.append(ops[i].jacobian_t(layers[i], acts[i], acts[i + 1], ctx.extra[i], drop_zeros=seq.drop_zeros))
        # the position after the last Jacobian: never part of an exclusive prefix, so an empty matrix (its
        # up-sweep products cost nothing); it makes the scan's last prefix the one the caller needs
        J.append(_empty_csr(1, J[-1].shape[0] if J else gout.numel(), gout))
        g = gout.reshape(-1).to(x.dtype).contiguous()

        record = None
        matmat, matvec = spmm, spmv
        per_product = rec is not None and getattr(rec, "per_product", False)
        if per_product:
            pending = {}

            def timed(f, kind):
                def run(a, b):
                    with phase(gout, what="scan", kind=kind):
                        out = f(a, b)
                    pending["row"] = rec.rows[-1]
                    return out
                return run

            def record(ph, d, kind, l, r, a, b, out):
                row = pending.pop("row")
                row.update(phase=ph, d=d, l=l, r=r, m=a.shape[0], k=a.shape[1], nnz_a=a._nnz(),
                           nnz_b=b._nnz() if kind == "mm" else int(b.numel()),
                           nnz_out=out._nnz() if kind == "mm" else int(out.numel()))

            matmat, matvec = timed(spmm, "mm"), timed(spmv, "mv")
        with torch.no_grad():
            with phase(gout, what="scan") if not per_product else contextlib.nullcontext():
                prefixes, _ = _scan.reference_scan(g, J, seq.L_m, matmat=matmat, matvec=matvec, record=record)
            grads = {}
            for i, m in enumerate(layers):
                names = [name for name, p in m.named_parameters(recurse=False) if p.requires_grad]
                if not names:
                    continue
                gy = prefixes[n - 1 - i].reshape(acts[i + 1].shape)
                with phase(gout, what="params", layer=i, kind=type(m).__name__):
                    got = ops[i].param_grads(m, acts[i], acts[i + 1], ctx.extra[i], gy)
                for name in names:
                    grads[id(getattr(m, name))] = got[name]
        gx = prefixes[n].reshape(x.shape) if need_x else None
        params = [grads.get(id(p)) for p in seq.parameters()]
        return (None, gx, *params)


class Sequential(nn.Sequential):
    """``torch.nn.Sequential`` trained by BPPSA: ``Sequential(*modules, L_m=None, drop_zeros=False)`` (or an
    ``OrderedDict``, as torch's).  ``L_m``: up-sweep levels of the scan before its linear middle part (the paper's
    heterogeneous scan; ``None``: the full Blelloch tree).  ``drop_zeros``: leave input- and weight-dependent
    zeros (inactive ReLUs, pruned weights) out of the Jacobians.  ``recorder``: a :class:`Recorder` to time the
    backward's phases (None: not timed)."""

    def __init__(self, *args, L_m: int | None = None, drop_zeros: bool = False):
        super().__init__(*args)
        if L_m is not None and (isinstance(L_m, bool) or not isinstance(L_m, int) or L_m < 0):
            raise ValueError(f"bppsa.nn.Sequential: L_m must be None (the full tree) or an int >= 0, got {L_m!r}")
        self.L_m, self.drop_zeros, self.recorder = L_m, bool(drop_zeros), None
        self._operators()

    @classmethod
    def from_torch(cls, module: nn.Sequential, **options) -> Sequential:
        """A BPPSA ``Sequential`` over ``module``'s own layers (shared, not copied: the same parameters)."""
        if not isinstance(module, nn.Sequential):
            raise TypeError(f"bppsa.nn.Sequential.from_torch takes a torch.nn.Sequential, got {type(module).__name__}")
        return cls(OrderedDict(module.named_children()), **options).train(module.training)

    def _operators(self) -> list[_ops.Operator]:
        try:
            return _ops.check_supported(self.named_children())
        except _ops.Unsupported as exc:
            raise _ops.Unsupported(f"bppsa.nn.Sequential: {exc}") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = list(self.parameters())
        if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
            with torch.no_grad():  # nothing to differentiate: the layers' own forward, as torch's Sequential
                y = x
                for op, (name, m) in zip(self._operators(), self.named_children()):
                    y = _layer_forward(op, name, m, y)[0]
                return y
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"bppsa.nn.Sequential: dtype {x.dtype} is not supported (float32 and float64 are)")
        return _ScanBackward.apply(self, x, *params)

    def extra_repr(self) -> str:
        return f"L_m={self.L_m}, drop_zeros={self.drop_zeros}"
