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

Lengths need not be powers of two: the right-most block of a level is clipped at N - 1 (an odd
block out is carried up unchanged); no padding with identities is ever materialised.

**Gradients at every step** (a loss on every h_t, not only on the last): back-propagation is then the
affine recurrence ``g_t = J_{t+1}ᵀ g_{t+1} + ∂l/∂h_t``, the same scan over *pairs* ``(A, b)`` combined as
``(A₂, b₂) ∘ (A₁, b₁) = (A₂A₁, A₂b₁ + b₂)`` and applied to a vector as ``A v + b``
(:func:`affine_blelloch_scan`, the same tree; :func:`affine_pair_ops` run :func:`reference_scan` on pairs).
The paper's scan is the special case ``b = 0``.

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
    "Workspace",
    "affine_blelloch_scan",
    "affine_diagonal_scan",
    "affine_linear_scan",
    "affine_pair_ops",
    "blelloch_scan",
    "levels",
    "linear_scan",
    "middle_ends",
    "num_levels",
    "reference_scan",
    "tree_levels",
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


def tree_levels(N: int, L_m: int | None) -> int:
    """How many up-sweep levels a scan over N positions runs: all of them for ``L_m = None``,
    else ``L_m`` clamped to [0, ceil(log2 N)] (the heterogeneous scan of the paper)."""
    depth = num_levels(N)
    return depth if L_m is None else max(0, min(int(L_m), depth))


def middle_ends(N: int, L: int) -> list[int]:
    """The positions the middle (linear) scan walks after ``L`` up-sweep levels: the last position of
    every block of 2^L positions, the last block clipped at N - 1.  The first is the spine's end."""
    size = 1 << L
    return list(range(size - 1, N - 1, size)) + [N - 1]


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


def reference_scan(g, J, L_m: int | None = None, *, matmat, matvec, record=None):
    """Algorithm 1 position by position: THE definition of the tree that every implementation is held to.

    ``g`` is position 0 (a vector), ``J[p - 1]`` position ``p``; the two products are passed in:
    ``matmat(a, b) = a · b`` (the up-sweep off the spine) and ``matvec(a, v) = a · v`` (everything
    else), so the same walk runs on torch tensors, on NumPy arrays or on CSR matrices that count
    their FLOP (:func:`bppsa.flops.scan_with_flops`).  ``record(phase, d, kind, l, r, a, b, out)``,
    if given, sees every product in execution order (phase "up" / "middle" / "down", ``d`` the level,
    -1 in the middle, ``kind`` "mm" or "mv", positions ``l`` and ``r``).

    Returns ``(prefixes, ups)``: ``prefixes[p - 1]`` is the exclusive prefix at position ``p`` and
    ``ups[p - 1]`` the textbook in-place array's value at ``p`` after the up-sweep (on the spine the
    vector is kept apart, so the matrix there is unchanged).  The fast paths do the same products in
    compact, batched or CUDA form.
    """
    N = len(J) + 1
    L = tree_levels(N, L_m)
    lv = levels(N)[:L]
    A = {p: J[p - 1] for p in range(1, N)}
    spine = {0: g}

    def product(phase, d, kind, l, r, a, b):
        out = matmat(a, b) if kind == "mm" else matvec(a, b)
        if record is not None:
            record(phase, d, kind, l, r, a, b, out)
        return out

    for level in lv:  # up-sweep: a[r] <- a[l] ◇ a[r] = a[r] · a[l]
        (l0, r0), *rest = level.pairs()
        spine[r0] = product("up", level.d, "mv", l0, r0, A[r0], spine[l0])
        for l, r in rest:
            A[r] = product("up", level.d, "mm", l, r, A[r], A[l])

    P = {}  # exclusive prefixes
    ends = middle_ends(N, L)
    if len(ends) > 1:  # middle: a linear scan over the blocks of level L
        P[ends[1]] = spine[ends[0]]
        for e, e2 in zip(ends[1:-1], ends[2:]):
            P[e2] = product("middle", -1, "mv", e, e2, A[e], P[e])

    for level in reversed(lv):  # down-sweep: T <- a[l]; a[l] <- a[r]; a[r] <- T ◇ a[r]
        (l0, r0), *rest = level.pairs()
        P[r0] = spine[l0]  # the spine's prefix is I: a data movement, no product
        for l, r in rest:
            P[l], P[r] = P[r], product("down", level.d, "mv", l, r, A[l], P[r])
    return [P[p] for p in range(1, N)], [A[p] for p in range(1, N)]


class Workspace:
    """Scratch tensors reused from call to call while the shapes stay the same.

    On the CPU a fresh multi-megabyte tensor comes from ``mmap`` and is page-faulted and zeroed
    by the kernel at first touch, every iteration (glibc hands large blocks back to the OS on
    free); at T = 1000, B = 16 that doubled the BPPSA backward.  A workspace belongs to one caller
    at a time.  On a GPU :meth:`get` allocates afresh (CUDA's caching allocator makes that cheap):
    a CUDA graph keeps the addresses it captured, and a buffer shared with later calls would be
    overwritten by them, or freed when their shape differs.
    """

    def __init__(self):
        self._bufs: dict = {}
        self._objs: dict = {}

    def memo(self, key, build):
        """The object ``build()`` made for ``key`` the first time (a compiled scan's plan), reused after."""
        if key not in self._objs:
            self._objs[key] = build()
        return self._objs[key]

    def get(self, key, shape, like: torch.Tensor) -> torch.Tensor:
        shape = tuple(shape)
        if like.is_cuda:
            return like.new_empty(shape)
        t = self._bufs.get(key)
        if t is None or tuple(t.shape) != shape or t.dtype != like.dtype or t.device != like.device:
            t = self._bufs[key] = like.new_empty(shape)
        return t


def _mv(M: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Batched matrix-vector product: M[..., H, H] @ v[..., H]."""
    return torch.matmul(M, v.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()  # the scan *is* a backward pass; it is never differentiated itself
def blelloch_scan(g: torch.Tensor, J: torch.Tensor, L_m: int | None = None,
                  workspace: Workspace | None = None) -> torch.Tensor:
    """Modified Blelloch exclusive scan (Algorithm 1), optionally heterogeneous.

    ``L_m`` is the number of up-sweep levels run before a linear scan over what is left, followed
    by the matching ``L_m`` down-sweep levels.  ``None`` (or any value >= ceil(log2 N)) is the full
    Blelloch scan; ``0`` degenerates to the linear scan.  ``J`` is not modified.

    The tree is the one of :func:`reference_scan` (blocks of 2^d positions, the right-most one
    clipped), which tests hold this function to; each level's block values are kept *compact* -- a
    contiguous ``[blocks, B, H, H]`` tensor -- so every product is one batched matmul on contiguous
    operands.  (The in-place textbook
    layout, which the CUDA kernels use, needs strided gathers and scatters on the CPU.)  The left
    operands of each level are exactly the ``T`` of the down-sweep, so they are kept for it.
    Intermediate levels live in ``workspace`` when one is given; the result is always a new tensor.
    """
    if g.dim() != 2 or J.dim() != 4 or J.shape[1:3] != g.shape or J.shape[2] != J.shape[3]:
        raise ValueError(f"expected g [B, H] and J [n, B, H, H], got {tuple(g.shape)} and {tuple(J.shape)}")
    n = J.shape[0]
    L = tree_levels(n + 1, L_m)
    ws = workspace if workspace is not None else Workspace()
    vec = tuple(g.shape)

    # Level d has K blocks: block 0 is the spine (a vector), blocks 1..K-1 are matrices in A.
    # Up-sweep a[r] <- a[l] ◇ a[r] = a[r] · a[l] pairs blocks (2j, 2j+1); an odd last block carries.
    spine, A, K = g, J, n + 1
    saved = []  # per level: (spine value, left operands, whether the last block carried)
    for d in range(L):
        pairs = (K - 2) // 2  # pairs j >= 1 (block 2j is A[2j-1], block 2j+1 is A[2j])
        carry = (K - 2) % 2 == 1
        left = ws.get(("left", d), (pairs,) + tuple(A.shape[1:]), A)
        left.copy_(A[1:2 * pairs:2])
        nxt = ws.get(("up", d), (pairs + carry,) + tuple(A.shape[1:]), A)  # written in place: no cat
        torch.matmul(A[2:2 * pairs + 1:2], left, out=nxt[:pairs])
        if carry:
            nxt[pairs] = A[-1]
        saved.append((spine, left, carry))
        spine = _mv(A[0], spine)  # the spine's pair is matrix-vector
        A, K = nxt, (K + 1) // 2

    # Middle: linear exclusive scan over the K blocks left; Q[k-1] is the prefix of block k.
    Q = g.new_empty((K - 1,) + vec) if L == 0 else ws.get(("prefix", L), (K - 1,) + vec, g)
    if K > 1:
        Q[0] = spine
        for k in range(1, K - 1):
            Q[k] = _mv(A[k - 1], Q[k - 1])

    # Down-sweep T <- a[l]; a[l] <- a[r]; a[r] <- a[r] ◇ T = T · a[r]: a left child inherits its
    # parent's prefix, a right child gets (left sibling's value) · (parent's prefix): matrix-vector.
    for d in reversed(range(L)):
        spine_d, left, carry = saved[d]
        pairs = left.shape[0]
        shape = (1 + 2 * pairs + carry,) + vec
        Qn = g.new_empty(shape) if d == 0 else ws.get(("prefix", d), shape, g)
        # block 1's prefix is block 0's value (the spine's prefix is I); a carried block keeps its own
        Qn[0] = spine_d
        kids = Qn[1:1 + 2 * pairs].view((pairs, 2) + vec)
        kids[:, 0] = Q[:pairs]
        kids[:, 1] = _mv(left, Q[:pairs])
        if carry:
            Qn[-1] = Q[pairs]
        Q = Qn
    return Q


@torch.no_grad()
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


# -- the per-step-gradient (affine) scan ------------------------------------------------------------------


def affine_pair_ops():
    """``(matmat, matvec)`` for :func:`reference_scan` over pairs ``(A, b)``: the affine scan's tree is that
    tree, position by position, with ``J[p - 1] = (A, b)`` (b added after A is applied)."""
    def matmat(right, left):
        (A2, b2), (A1, b1) = right, left
        return A2 @ A1, _mv(A2, b1) + b2

    def matvec(pair, v):
        A, b = pair
        return _mv(A, v) + b

    return matmat, matvec


def _check_affine(g: torch.Tensor, J: torch.Tensor, c: torch.Tensor) -> None:
    if g.dim() != 2 or J.dim() != 4 or J.shape[1:3] != g.shape or J.shape[2] != J.shape[3]:
        raise ValueError(f"expected g [B, H] and J [n, B, H, H], got {tuple(g.shape)} and {tuple(J.shape)}")
    if tuple(c.shape) != (J.shape[0],) + tuple(g.shape):
        raise ValueError(f"expected c [n, B, H] = {(J.shape[0],) + tuple(g.shape)}, got {tuple(c.shape)}")


@torch.no_grad()
def affine_linear_scan(g: torch.Tensor, J: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The per-step-gradient recurrence one step at a time (what back-propagation computes):
    ``out[0] = g``, ``out[k] = J[k-1] out[k-1] + c[k-1]``; ``c[n-1]`` never reaches an output, as ``J[n-1]``."""
    _check_affine(g, J, c)
    n = J.shape[0]
    out = g.new_empty((n,) + tuple(g.shape))
    if n == 0:
        return out
    out[0] = g
    for k in range(1, n):
        out[k] = _mv(J[k - 1], out[k - 1]) + c[k - 1]
    return out


@torch.no_grad()
def affine_blelloch_scan(g: torch.Tensor, J: torch.Tensor, c: torch.Tensor, L_m: int | None = None,
                         workspace: Workspace | None = None) -> torch.Tensor:
    """:func:`blelloch_scan` over the pairs ``(J[k], c[k])``: the exclusive prefixes of the affine recurrence
    of :func:`affine_linear_scan`, in Θ(log n) steps, with the same tree and ``L_m`` semantics.

    Each product of the paper's scan gains its vector part: an up-sweep pair off the spine is
    ``(A₂A₁, A₂b₁ + b₂)`` (one matrix-vector product more per matrix-matrix one, ~1/H of its work), the spine,
    the middle and a right child of the down-sweep ``A v + b``.  ``J`` and ``c`` are not modified."""
    _check_affine(g, J, c)
    n = J.shape[0]
    L = tree_levels(n + 1, L_m)
    ws = workspace if workspace is not None else Workspace()
    vec = tuple(g.shape)

    spine, A, b, K = g, J, c, n + 1  # block 0 is the spine (a vector); block k >= 1 is the pair (A[k-1], b[k-1])
    saved = []
    for d in range(L):
        pairs = (K - 2) // 2
        carry = (K - 2) % 2 == 1
        left = ws.get(("affine-left", d), (pairs,) + tuple(A.shape[1:]), A)
        left.copy_(A[1:2 * pairs:2])
        left_b = ws.get(("affine-left-b", d), (pairs,) + vec, b)
        left_b.copy_(b[1:2 * pairs:2])
        right = A[2:2 * pairs + 1:2]
        nxt = ws.get(("affine-up", d), (pairs + carry,) + tuple(A.shape[1:]), A)
        nxt_b = ws.get(("affine-up-b", d), (pairs + carry,) + vec, b)
        torch.matmul(right, left, out=nxt[:pairs])
        torch.add(_mv(right, left_b), b[2:2 * pairs + 1:2], out=nxt_b[:pairs])
        if carry:
            nxt[pairs] = A[-1]
            nxt_b[pairs] = b[-1]
        saved.append((spine, left, left_b, carry))
        spine = _mv(A[0], spine) + b[0]
        A, b, K = nxt, nxt_b, (K + 1) // 2

    Q = g.new_empty((K - 1,) + vec) if L == 0 else ws.get(("affine-prefix", L), (K - 1,) + vec, g)
    if K > 1:
        Q[0] = spine
        for k in range(1, K - 1):
            Q[k] = _mv(A[k - 1], Q[k - 1]) + b[k - 1]

    for d in reversed(range(L)):
        spine_d, left, left_b, carry = saved[d]
        pairs = left.shape[0]
        shape = (1 + 2 * pairs + carry,) + vec
        Qn = g.new_empty(shape) if d == 0 else ws.get(("affine-prefix", d), shape, g)
        Qn[0] = spine_d
        kids = Qn[1:1 + 2 * pairs].view((pairs, 2) + vec)
        kids[:, 0] = Q[:pairs]
        kids[:, 1] = _mv(left, Q[:pairs]) + left_b
        if carry:
            Qn[-1] = Q[pairs]
        Q = Qn
    return Q


@torch.no_grad()
def affine_diagonal_scan(g: torch.Tensor, D: torch.Tensor, c: torch.Tensor, L_m: int | None = None) -> torch.Tensor:
    """:func:`affine_blelloch_scan` where every ``J[k]`` is diagonal, given as its diagonal ``D`` [n, B, H]: the same
    tree, each product elementwise (``(D₂, b₂) ∘ (D₁, b₁) = (D₂D₁, D₂b₁ + b₂)``), Θ(log n) steps of O(n·B·H) work.
    ``out[0] = g``, ``out[k] = D[k-1] * out[k-1] + c[k-1]``."""
    if g.dim() != 2 or D.dim() != 3 or D.shape[1:] != g.shape or tuple(c.shape) != tuple(D.shape):
        raise ValueError(f"expected g [B, H], D [n, B, H] and c [n, B, H], got {tuple(g.shape)}, {tuple(D.shape)} "
                         f"and {tuple(c.shape)}")
    n = D.shape[0]
    L = tree_levels(n + 1, L_m)
    vec = tuple(g.shape)
    spine, A, b, K = g, D, c, n + 1
    saved = []
    for _ in range(L):
        pairs = (K - 2) // 2
        carry = (K - 2) % 2 == 1
        left, left_b = A[1:2 * pairs:2], b[1:2 * pairs:2]
        right = A[2:2 * pairs + 1:2]
        nxt, nxt_b = right * left, torch.addcmul(b[2:2 * pairs + 1:2], right, left_b)
        if carry:
            nxt, nxt_b = torch.cat([nxt, A[-1:]]), torch.cat([nxt_b, b[-1:]])
        saved.append((spine, left, left_b, carry))
        spine = torch.addcmul(b[0], A[0], spine)
        A, b, K = nxt, nxt_b, (K + 1) // 2

    Q = g.new_empty((K - 1,) + vec)
    if K > 1:
        Q[0] = spine
        for k in range(1, K - 1):
            Q[k] = torch.addcmul(b[k - 1], A[k - 1], Q[k - 1])

    for spine_d, left, left_b, carry in reversed(saved):
        pairs = left.shape[0]
        Qn = g.new_empty((1 + 2 * pairs + carry,) + vec)
        Qn[0] = spine_d
        kids = Qn[1:1 + 2 * pairs].view((pairs, 2) + vec)
        kids[:, 0] = Q[:pairs]
        kids[:, 1] = torch.addcmul(left_b, left, Q[:pairs])
        if carry:
            Qn[-1] = Q[pairs]
        Q = Qn
    return Q
