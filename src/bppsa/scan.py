"""Back-propagation as an exclusive scan (BPPSA, Algorithm 1 of the paper).

The scan array has N = n + 1 elements::

    a = [g, J_1, J_2, ..., J_n]

where ``g`` is the gradient of the loss w.r.t. the last activation (a batched *vector*) and
``J_k`` are transposed Jacobians (batched *matrices*) in back-propagation order.  The operator is
``A ◇ B = B · A`` and the exclusive scan returns ``[I, g, J_1 g, J_2 J_1 g, ...]``: every
position's gradient.

Tensor layout used throughout the package:

* ``g``: ``[B, H]`` -- position 0,
* ``J``: ``[n, B, H, H]`` -- ``J[k]`` is the element at position ``k + 1``,
* result: ``[n, B, H]`` -- ``out[k]`` is the exclusive prefix at position ``k + 1``
  (so ``out[0] == g`` and ``out[k] == J[k-1] ... J[0] g``).

Lengths need not be powers of two.  Node values live at the *last* real index of their block
(the textbook in-place layout, with the right-most block of a level clipped at N - 1), so a level
is a strided slice and one batched matmul; no padding with identities is ever materialised.

Because position 0 is a vector, the left spine of the tree (blocks that start at position 0)
carries vectors: its up-sweep products are matrix-vector, and so is every down-sweep product
(prefixes are vectors or the identity).  Only up-sweep products off the spine are matrix-matrix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Level",
    "levels",
    "num_levels",
    "blelloch_scan",
    "linear_scan",
    "exclusive_scan_reference",
]


@dataclass(frozen=True)
class Level:
    """The ◇ operations of one tree level ``d`` (shared by the up- and down-sweep).

    Pairs are ``(l, r)`` positions with ``l = 2^d - 1 + k·2^{d+1}`` and ``r = min(l + 2^d, N - 1)``.
    Pair ``k = 0`` sits on the left spine.  ``full`` pairs (``k = 0 .. full-1``) have
    ``r = l + 2^d`` exactly, so their ``l`` and ``r`` form strided slices; ``tail`` is the one
    clipped pair ``(l, N - 1)`` if the last block of the level is partial.
    """

    d: int
    first_l: int
    step: int
    full: int
    tail: tuple[int, int] | None

    def pairs(self) -> list[tuple[int, int]]:
        half = self.step // 2
        out = [(self.first_l + k * self.step, self.first_l + k * self.step + half) for k in range(self.full)]
        if self.tail is not None:
            out.append(self.tail)
        return out


def num_levels(N: int) -> int:
    """Number of tree levels of a scan over N elements: ceil(log2 N)."""
    if N < 1:
        raise ValueError(f"scan length must be >= 1, got {N}")
    return 0 if N == 1 else math.ceil(math.log2(N))


def levels(N: int) -> list[Level]:
    """The up-sweep levels of a scan over ``N`` positions, bottom (d = 0) first."""
    out = []
    for d in range(num_levels(N)):
        half, step = 1 << d, 1 << (d + 1)
        first_l = half - 1
        n_pairs = len(range(first_l, N - 1, step))
        full = len(range(first_l, N - half, step))  # pairs with l + half <= N - 1
        tail = None
        if n_pairs > full:
            tail = (first_l + full * step, N - 1)
        out.append(Level(d=d, first_l=first_l, step=step, full=full, tail=tail))
    return out


def _mv(M: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Batched matrix-vector product: M[..., H, H] @ v[..., H]."""
    return torch.matmul(M, v.unsqueeze(-1)).squeeze(-1)


def blelloch_scan(g: torch.Tensor, J: torch.Tensor, L_m: int | None = None, *, inplace: bool = False) -> torch.Tensor:
    """Modified Blelloch exclusive scan (Algorithm 1), optionally heterogeneous.

    ``L_m`` is the number of up-sweep levels run before a linear scan over what is left, followed
    by the matching ``L_m`` down-sweep levels.  ``None`` (or any value >= ceil(log2 N)) is the full
    Blelloch scan; ``0`` degenerates to the linear scan.

    ``J`` is used as workspace (up-sweep partial products overwrite it) when ``inplace`` is true;
    otherwise it is cloned first.
    """
    if g.dim() != 2 or J.dim() != 4 or J.shape[1:3] != g.shape or J.shape[2] != J.shape[3]:
        raise ValueError(f"expected g [B, H] and J [n, B, H, H], got {tuple(g.shape)} and {tuple(J.shape)}")
    n = J.shape[0]
    N = n + 1
    if n == 0:
        return g.new_empty((0,) + tuple(g.shape))
    if not inplace:
        J = J.clone()
    lv = levels(N)
    L = len(lv) if L_m is None else max(0, min(int(L_m), len(lv)))

    # Position p >= 1 is J[p - 1]; spine vectors are kept apart, keyed by position.
    spine: dict[int, torch.Tensor] = {0: g}

    # ---- up-sweep: a[r] <- a[l] ◇ a[r] = a[r] · a[l] -------------------------------------------
    for level in lv[:L]:
        half, step = level.step // 2, level.step
        l0 = level.first_l
        r0 = l0 + half if level.full > 0 else level.tail[1]
        spine[r0] = _mv(J[r0 - 1], spine[l0])  # k = 0: spine, matrix-vector
        if level.full > 1:  # k >= 1 full pairs: strided slices, one batched matmul
            ls = slice(l0 + step - 1, l0 + step * (level.full - 1) + step - 1, step)  # J index = pos - 1
            rs = slice(l0 + half + step - 1, l0 + half + step * (level.full - 1) + step - 1, step)
            J[rs] = torch.matmul(J[rs], J[ls])
        if level.tail is not None and level.full > 0:
            tl, tr = level.tail
            J[tr - 1] = torch.matmul(J[tr - 1], J[tl - 1])

    # ---- middle: linear exclusive scan over the blocks of level L --------------------------------
    P = g.new_empty((N,) + tuple(g.shape))  # P[p]: prefix (a vector) at position p; P[0] is I
    size = 1 << L
    ends = list(range(size - 1, N - 1, size)) + [N - 1]  # last index of each block (spine first)
    if len(ends) > 1:
        P[ends[1]] = spine[ends[0]]
        for k in range(1, len(ends) - 1):
            P[ends[k + 1]] = _mv(J[ends[k] - 1], P[ends[k]])

    # ---- down-sweep: T <- a[l]; a[l] <- a[r]; a[r] <- a[r] ◇ T = T · a[r] ------------------------
    for level in reversed(lv[:L]):
        half, step = level.step // 2, level.step
        l0 = level.first_l
        r0 = l0 + half if level.full > 0 else level.tail[1]
        P[r0] = spine[l0]  # k = 0: the prefix of the spine is I, so a[r] = T and a[l] = I
        if level.full > 1:
            ls = slice(l0 + step, l0 + step * (level.full - 1) + step, step)
            rs = slice(l0 + half + step, l0 + half + step * (level.full - 1) + step, step)
            Pr = P[rs].clone()
            P[rs] = _mv(J[ls.start - 1 : ls.stop - 1 : step], Pr)
            P[ls] = Pr
        if level.tail is not None and level.full > 0:
            tl, tr = level.tail
            Pr = P[tr].clone()
            P[tr] = _mv(J[tl - 1], Pr)
            P[tl] = Pr
    return P[1:]


def linear_scan(g: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    """The sequential exclusive scan: what ordinary back-propagation computes, one step at a time."""
    n = J.shape[0]
    out = g.new_empty((n,) + tuple(g.shape))
    if n == 0:
        return out
    out[0] = g
    for k in range(1, n):
        out[k] = _mv(J[k - 1], out[k - 1])
    return out


def exclusive_scan_reference(g: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    """Alias kept for symmetry with the kernels' reference twins."""
    return linear_scan(g, J)
