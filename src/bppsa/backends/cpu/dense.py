"""The scan of a dense chain ``[n, B, H, H]`` on the CPU, in numpy: the tree of :func:`bppsa.scan.blelloch_scan`.

The same tree, the same ``L_m`` semantics, the same numbers.  Each level's products are stacked
``numpy.matmul`` calls (OpenBLAS's small-GEMM kernels, GIL released) writing into the level's output;
level d's input array is kept as is: its odd entries are the left operands the down-sweep needs.
Threads split the batch (each runs the whole tree on its slice: one hand-off per scan) or, for a batch
smaller than the thread count, each level's products.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ... import scan as _scan
from . import plan, pool


@torch.no_grad()
def dense_tree_scan(g: torch.Tensor, J: torch.Tensor, L_m: int | None = None,
                    workspace: _scan.Workspace | None = None) -> torch.Tensor:
    """The exclusive scan of ``g`` [B, H] over the dense chain ``J`` [n, B, H, H] (operands checked by the
    caller, :func:`bppsa.backends.check_operands`) with ``L_m`` tree levels, multi-threaded: with a batch of at
    least one element per thread, each thread runs the whole tree on its own batch slice (one hand-off per
    scan); otherwise the threads share each level's products."""
    n, B, H = J.shape[0], g.shape[0], g.shape[1]
    L = _scan.tree_levels(n + 1, L_m)
    ws = workspace if workspace is not None else _scan.Workspace()
    out = g.new_empty((n, B, H))
    if n == 0:
        return out
    A, gn, on = as_numpy(J), as_numpy(g), out.numpy()
    if L == 0:
        dense_linear_scan(A, gn, on)
        return out
    p = min(pool.threads(), B, max(1, int(n * B * 2 * H ** 3 // plan.MIN_CHUNK_FLOP)))
    if p <= 1:
        _tree(gn, A, on, L, ws, ("all",), pool.parallel, g)
        return out
    bounds = [B * i // p for i in range(p + 1)]

    def run(i):
        b0, b1 = bounds[i], bounds[i + 1]
        _tree(gn[b0:b1], A[:, b0:b1], on[:, b0:b1], L, ws, ("slice", i), pool.serial, g)

    pool.spread([functools.partial(run, i) for i in range(p)])
    return out




def dense_linear_scan(A: np.ndarray, first: np.ndarray, Q: np.ndarray) -> None:
    """Q[0] = first, Q[k] = A[k-1] Q[k-1] (the dense chain's sequential middle)."""
    Q[0] = first
    for k in range(1, Q.shape[0]):
        np.matmul(A[k - 1], Q[k - 1][..., None], out=Q[k][..., None])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"the cpu backend runs on CPU tensors only (got one on {t.device}); use --device cpu")
    return t.detach().contiguous().numpy()


def _tree(spine: np.ndarray, A: np.ndarray, out: np.ndarray, L: int, ws: _scan.Workspace, key: tuple, par,
          like: torch.Tensor) -> None:
    """The scan of ``spine`` [B, H] over the chain ``A`` [n, B, H, H] with ``L >= 1`` tree levels, into
    ``out`` [n, B, H]; ``par`` spreads a level's products (:func:`.pool.parallel`) or not (:func:`.pool.serial`);
    scratch comes from ``ws`` under ``key``."""
    n, B, H = out.shape
    buf = lambda name, shape: ws.get(("cpu", name, *key), shape, like).numpy()  # noqa: E731
    K = n + 1
    saved = []  # per level: (spine vector, the level's block array -- odd entries are the left operands, pairs, carry)
    for d in range(L):
        pairs, carry = (K - 2) // 2, (K - 2) % 2 == 1
        nxt = buf(("up", d), (pairs + carry, B, H, H))
        X, Y = A[2:2 * pairs + 1:2], A[1:2 * pairs:2]  # block pair j: A[2j+2] @ A[2j+1]

        def up(a, b, X=X, Y=Y, nxt=nxt):
            np.matmul(X[a:b], Y[a:b], out=nxt[a:b])

        par(up, pairs, 2 * B * H ** 3)
        if carry:
            nxt[pairs] = A[K - 2]
        new_spine = np.matmul(A[0], spine[..., None])[..., 0]
        saved.append((spine, A, pairs, carry))
        spine, A, K = new_spine, nxt, (K + 1) // 2

    Q = buf(("prefix", L), (K - 1, B, H))
    if K > 1:
        dense_linear_scan(A, spine, Q)

    for d in reversed(range(L)):
        spine_d, A_d, pairs, carry = saved[d]
        Qn = out if d == 0 else buf(("prefix", d), (1 + 2 * pairs + carry, B, H))
        Qn[0] = spine_d
        kids = Qn[1:1 + 2 * pairs].reshape((pairs, 2, B, H))
        Y = A_d[1:2 * pairs:2]

        def down(a, b, Y=Y, Q=Q, kids=kids):  # left child inherits the prefix; right child: left sibling · prefix
            kids[a:b, 0] = Q[a:b]
            np.matmul(Y[a:b], Q[a:b, ..., None], out=kids[a:b, 1, ..., None])

        par(down, pairs, 2 * B * H * H)
        if carry:
            Qn[-1] = Q[pairs]
        Q = Qn
