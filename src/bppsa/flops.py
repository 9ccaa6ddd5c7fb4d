"""Static FLOP analysis of BPPSA over CSR transposed Jacobians (Sec 4.3, 5.3, Fig 10).

For one sample, the chain of transposed Jacobians of a network's conv part (conv, ReLU, max-pool; any layer of
the operator registry :mod:`bppsa.jacobians.operators`) is scanned by :func:`bppsa.scan.reference_scan`
itself -- the one definition of the tree that the torch scan and the CUDA launch plan are held to
(node values at the last index of their block, the
left spine carrying vectors, a linear scan over the blocks of level ``L_m`` in the middle, then the
matching matrix-vector down-sweep) -- with sparse products that count their FLOP.  Every product
is carried out for real with scipy CSR operands (so the next step sees the product's true structure
and the final gradients can be checked against autograd), and its cost is counted as

    FLOP(A @ B) = 2 * sum_k nnz(A[:, k]) * nnz(B[k, :])

(a multiply and an add per pair of non-zeros that meet), with a gradient vector counted as a
one-column matrix of its non-zeros.  The baseline is ordinary back-propagation: each layer's
transposed Jacobian times the incoming gradient vector, in sequence.

Which zeros count: the Jacobians are built with ``drop_zeros=True`` by default -- pruned weights,
inactive ReLUs and losing pool inputs are not stored, and scipy drops exact zeros from every product
-- i.e. the FLOP a sparse kernel that skips every zero value would perform.  ``drop_zeros=False``
keeps the input-dependent zeros (only guaranteed zeros skipped; pruned weights still count).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from . import scan as _scan
from .jacobians import operators

__all__ = [
    "product_flop",
    "spgemm",
    "Op",
    "scan_with_flops",
    "baseline_with_flops",
    "layer_chain",
    "analyse_sample",
    "level_label",
]


def _col_nnz(A: sp.csr_matrix) -> np.ndarray:
    return np.bincount(A.indices, minlength=A.shape[1]).astype(np.int64)


def _row_nnz(B) -> np.ndarray:
    if isinstance(B, np.ndarray):  # a gradient vector: a one-column matrix
        return (B != 0).astype(np.int64)
    return np.diff(B.indptr).astype(np.int64)


def product_flop(A: sp.csr_matrix, B) -> int:
    """2 * sum_k nnz(A[:, k]) * nnz(B[k, :]); ``B`` is a CSR matrix or a dense vector."""
    if A.shape[1] != B.shape[0]:
        raise ValueError(f"shapes {A.shape} and {B.shape} do not chain")
    return 2 * int(np.dot(_col_nnz(A), _row_nnz(B)))


def spgemm(A: sp.csr_matrix, B: sp.csr_matrix, *, dense_limit_bytes: int = 1 << 30,
           dense_min_flop: float = 2e9) -> sp.csr_matrix:
    """``A @ B`` as CSR with exact zeros removed.

    Large, dense-ish products (an unpruned network's deep up-sweep levels) are far faster as one
    BLAS GEMM over the rows, inner indices and columns that actually carry non-zeros; the result
    is the same matrix (an entry with no contributing pair is an exact 0 either way).
    """
    ca, rb = _col_nnz(A), _row_nnz(B)
    flop = 2 * int(np.dot(ca, rb))
    if flop >= dense_min_flop:
        live = np.flatnonzero((ca > 0) & (rb > 0))
        Ak, Bk = A[:, live].tocsr(), B[live].tocsr()
        rows = np.flatnonzero(np.diff(Ak.indptr))
        cols = np.unique(Bk.indices)
        m, k, n = len(rows), len(live), len(cols)
        if (m * k + k * n + m * n) * A.dtype.itemsize <= dense_limit_bytes:
            Ad = torch.from_numpy(Ak[rows].toarray())
            Bd = torch.from_numpy(Bk[:, cols].toarray())
            Cd = (Ad @ Bd).numpy()
            del Ad, Bd
            r, c = np.nonzero(Cd)
            C = sp.csr_matrix((Cd[r, c], (rows[r], cols[c])), shape=(A.shape[0], B.shape[1]))
            C.sort_indices()
            return C
    C = A @ B
    C.sort_indices()
    return C


@dataclass
class Op:
    """One ◇ product of the scan (or one baseline gradient operator)."""

    phase: str  # up | middle | down | baseline
    d: int  # tree level (-1 for the middle scan and the baseline)
    level: str  # the paper's level name (L0, L1, ...), 'linear' or 'BP'
    kind: str  # mm | mv
    l: int  # scan positions combined (baseline: the layer's position)
    r: int
    m: int
    k: int
    n: int
    flop: int
    nnz_a: int
    nnz_b: int
    nnz_out: int
    layer: str = ""
    critical: bool = False

    @property
    def dense_size(self) -> int:
        return self.m * self.n * self.k


def level_label(phase: str, d: int, D: int) -> str:
    """Level names of the paper's Fig 3 for a tree of ``D`` levels.

    Fig 3 (VGG-11's conv part: 21 Jacobians and the gradient, so ``D = 5``) names the input array
    L0, the up-sweep levels d = 0..D-2 of Algorithm 1 L1..L_{D-1} ("L0-L4 up-sweep"), the root
    set to I L_D and the down-sweep levels d = D-1..0 L_{D+1}..L_{2D} ("L5-L10 down-sweep").
    Hence up-sweep d -> L_{d+1} and down-sweep d -> L_{2D-d}.
    """
    if phase == "up":
        return f"L{d + 1}"
    if phase == "down":
        return f"L{2 * D - d}"
    return "linear" if phase == "middle" else "BP"


def _mv(A: sp.csr_matrix, v: np.ndarray) -> np.ndarray:
    return np.asarray(A @ v).reshape(-1)


def scan_with_flops(g: np.ndarray, J: list[sp.csr_matrix], L_m: int | None = None, names: list[str] | None = None,
                    **gemm_kw):
    """The exclusive scan of ``[g, J[0], ..., J[n-1]]`` on CSR operands, recording every product.

    It is :func:`bppsa.scan.reference_scan` with sparse products (:func:`spgemm`, :func:`_mv`) and a
    recorder.  Returns ``(out, ops)``: ``out[p-1]`` is the prefix at position ``p`` (``out[0] == g``,
    ``out[k] == J[k-1] ... J[0] g``) and ``ops`` the products in execution order.  ``J`` is not modified.
    """
    n = len(J)
    if n == 0:
        return [], []
    names = names or [""] * n
    N = n + 1
    D, L = _scan.num_levels(N), _scan.tree_levels(N, L_m)
    ops: list[Op] = []

    def covered(p, size):  # the layers a workspace entry covers, earliest layer first
        lo = max(1, p - size + 1)
        return names[p - 1] if lo == p else f"{names[p - 1]}..{names[lo - 1]}"

    def record(phase, d, kind, l, r, a, b, out):
        if phase == "up":  # the entry at r now covers its own block, and the left block too for mm
            layers = covered(r, (r - l if kind == "mm" else 0) + (1 << d))
        else:  # middle: the block ending at l; down: the left sibling's block
            layers = covered(l, 1 << (L if phase == "middle" else d))
        m, k = a.shape
        cols = 1 if kind == "mv" else b.shape[1]
        nnz_b = int(np.count_nonzero(b)) if kind == "mv" else b.nnz
        nnz_out = int(np.count_nonzero(out)) if kind == "mv" else out.nnz
        ops.append(Op(phase, d, level_label(phase, d, D), kind, l, r, m, k, cols, product_flop(a, b), a.nnz,
                      nnz_b, nnz_out, layers))

    out, _ = _scan.reference_scan(np.asarray(g).reshape(-1), J, L_m, matmat=lambda a, b: spgemm(a, b, **gemm_kw),
                                  matvec=_mv, record=record)
    _mark_critical(ops)
    return out, ops


def _mark_critical(ops: list[Op]) -> None:
    """Ops of one level run in parallel, so the level lasts as long as its costliest op (the one on
    the critical path); the middle scan and the baseline are sequential, every op is critical."""
    groups: dict[tuple[str, int], list[Op]] = {}
    for op in ops:
        groups.setdefault((op.phase, op.d), []).append(op)
    for (phase, _), group in groups.items():
        if phase in ("middle", "baseline"):
            for op in group:
                op.critical = True
        else:
            max(group, key=lambda o: o.flop).critical = True


def baseline_with_flops(g: np.ndarray, J: list[sp.csr_matrix], names: list[str] | None = None):
    """Ordinary back-propagation: ``v <- J[i] @ v`` for i = 0 .. n-2 (the last Jacobian would only
    give the gradient of the network's input, which autograd does not compute)."""
    names = names or [""] * len(J)
    v = np.asarray(g).reshape(-1)
    out, ops = [v], []
    for i in range(len(J) - 1):
        w = _mv(J[i], v)
        ops.append(Op("baseline", -1, "BP", "mv", i + 1, i + 2, J[i].shape[0], J[i].shape[1], 1,
                      product_flop(J[i], v), J[i].nnz, int(np.count_nonzero(v)), int(np.count_nonzero(w)), names[i],
                      True))
        v = w
        out.append(v)
    return out, ops


KIND = {"Conv2d": "conv", "ReLU": "relu", "MaxPool2d": "pool"}  # Fig 10's layer names


def layer_chain(features: nn.Sequential, x: torch.Tensor, *, drop_zeros: bool = True, dtype=np.float64):
    """Transposed Jacobians of a layer chain at one sample ``x`` (C, H, W), in back-propagation order (last layer
    first), with their layer names (conv1, relu1, pool1, ...); also the activations (``acts[i]`` is the input of
    layer i, ``acts[-1]`` the output).  Each comes from the operator registry
    (:func:`bppsa.jacobians.operators.sample_jacobian_t`), as scipy CSR for the FLOP-counting products."""
    tdtype = torch.float64 if np.dtype(dtype) == np.float64 else torch.float32
    acts = [x.detach().to(tdtype)]
    J, names = [], []
    counters: dict[str, int] = {}
    try:  # every layer has an operator, before any work
        operators.check_supported((str(i), layer) for i, layer in enumerate(features))
    except operators.Unsupported as exc:
        raise ValueError(f"FLOP analysis: {exc}") from None
    for layer in features:
        m, y = operators.sample_jacobian_t(layer, acts[-1], drop_zeros=drop_zeros, dtype=tdtype)
        acts.append(y)
        kind = KIND.get(type(layer).__name__, type(layer).__name__.lower())
        counters[kind] = counters.get(kind, 0) + 1
        J.append(operators.to_scipy(m))
        names.append(f"{kind}{counters[kind]}")
    return J[::-1], names[::-1], acts


def analyse_sample(features: nn.Sequential, x: torch.Tensor, g: torch.Tensor, L_m: int | None, *,
                   drop_zeros: bool = True, dtype=np.float64, **gemm_kw) -> dict:
    """The scan and the baseline for one sample; ``g`` is the loss gradient at the features' output.

    Returns a dict with ``ops`` (records of the scan and the baseline) and both gradient lists.
    """
    J, names, _ = layer_chain(features, x, drop_zeros=drop_zeros, dtype=dtype)
    gv = g.detach().cpu().numpy().reshape(-1).astype(dtype)
    scan_out, scan_ops = scan_with_flops(gv, J, L_m, names, **gemm_kw)
    base_out, base_ops = baseline_with_flops(gv, J, names)
    return {"ops": scan_ops + base_ops, "scan": scan_out, "baseline": base_out, "names": names}


def flop_summary(ops: list[Op]) -> dict:
    """One sample's totals: BPPSA's FLOP on the critical path (a level lasts as long as its costliest
    product), in all and in its largest step, and its number of steps (levels, plus each middle
    product); the same for back-propagation (the baseline ops)."""
    scan_ops = [o for o in ops if o.phase != "baseline"]
    base = [o for o in ops if o.phase == "baseline"]
    levels = {(o.phase, o.d) for o in scan_ops if o.phase != "middle"}
    return dict(bppsa_critical_flop=sum(o.flop for o in scan_ops if o.critical),
                bppsa_total_flop=sum(o.flop for o in scan_ops),
                bppsa_max_step_flop=max(o.flop for o in scan_ops),
                baseline_total_flop=sum(o.flop for o in base),
                baseline_max_step_flop=max(o.flop for o in base),
                bppsa_steps=len(levels) + sum(o.phase == "middle" for o in scan_ops),
                baseline_steps=len(base))


def ops_records(ops: list[Op], **extra) -> list[dict]:
    return [dict(asdict(op), dense_size=op.dense_size, **extra) for op in ops]
