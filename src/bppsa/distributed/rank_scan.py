"""The exclusive scan of the ranks' chunk summaries over a torch.distributed process group.

An affine recurrence ``x_t = A_t x_{t-1} + b_t`` split into p contiguous chunks, one per rank, is summarised on
each rank by its chunk's map ``x -> M x + c`` (``M`` the product of the chunk's A's, ``c`` its offset: the state the
chunk ends in when it starts from zero).  The ranks then need one number each: the **carry**, the state entering
their chunk, which the maps of the chunks before them produce.  That is an exclusive scan of p maps under
composition, ``(M₂, c₂) ∘ (M₁, c₁) = (M₂M₁, M₂c₁ + c₂)``; :func:`rank_scan` runs it across the ranks.

API::

    carry = rank_scan(M, c, group=None, *, reverse=False, strategy=None, initial=None, timeout=None)

* ``M``: this rank's chunk product, dense ``[..., H, H]`` or diagonal ``[..., H]`` (the diagonal of a diagonal
  product, as Mamba-like recurrences have); ``c``: its offset ``[..., H]``.  The leading dimensions (a batch)
  are free but the same on every rank, as are dtype and the kind of ``M``.
* ``group``: the process group (None: the default group).  Ranks are ordered by their rank *in the group*.
* ``reverse``: False scans from group rank 0 upwards (the forward recurrence); True from the last rank down
  (back-propagation: the gradient enters at the end of the sequence, on the last rank).
* ``strategy``: ``"rounds"`` (⌈log₂ p⌉ rounds of point-to-point exchanges, Hillis-Steele: in round k a rank sends
  its aggregate 2^k ranks on and composes the one it receives; each round one matrix product) or ``"allgather"``
  (one ``all_gather`` of the p summaries, then a local sequential scan of at most p - 1 matrix-vector
  products); None: :func:`default_strategy` for p.
* ``initial``: the state entering the first chunk (group rank 0, or the last one with ``reverse``), read on that
  rank only; None: zero.
* ``timeout``: seconds to wait for any one exchange (None: the process group's own timeout).  A peer that does not
  answer in time, or whose connection drops, raises :class:`RankFailure` naming the rank, where the strategy
  knows it (``"rounds"``: the peer of the exchange; ``"allgather"``: whichever ranks never checked in, read
  from the group's store where there is one).

Returns the carry ``[..., H]``: ``initial`` (or zeros) on the first rank, else the maps of the chunks before
this one applied in order to ``initial``.  Exact: the same products as the sequential scan
:func:`local_carries`, in a different association (equal to it in fp64 to rounding, which the tests hold to
1e-12).

gloo carries CPU tensors (CUDA tensors are staged through the host); NCCL carries CUDA tensors only (a CPU tensor
on an NCCL group is refused before anything is sent).
"""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

__all__ = ["STRATEGIES", "RankFailure", "all_gather_ints", "all_reduce_sum", "compose", "default_strategy",
           "local_carries", "rank_scan", "recv_from", "send_to"]

STRATEGIES = ("rounds", "allgather")

# Up to this many ranks one all_gather of the p summaries, then p - 1 local mat-vecs, beats ⌈log₂ p⌉ rounds
# of exchanges each followed by a matrix product (two latencies vs one per round); beyond, the rounds.  A
# placeholder until `bppsa workers` measures both on a quiet machine (docs/distributed.md).
ALLGATHER_UP_TO = 8


class RankFailure(RuntimeError):
    """A rank of the group did not take part in an exchange in time (dead, hung, or its connection dropped).
    ``rank``: its rank in the group (None where the failed collective cannot say)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def default_strategy(p: int) -> str:
    """The strategy :func:`rank_scan` runs for a group of ``p`` ranks when none is named."""
    return "allgather" if p <= ALLGATHER_UP_TO else "rounds"


def _dense(M: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether ``M`` is a dense product [..., H, H] (else the diagonal [..., H]); a clear error otherwise."""
    if not isinstance(M, torch.Tensor) or not isinstance(c, torch.Tensor):
        raise TypeError(f"rank_scan: M and c must be tensors, got {type(M).__name__} and {type(c).__name__}")
    if c.dim() < 1:
        raise ValueError(f"rank_scan: c must be [..., H], got shape {tuple(c.shape)}")
    if M.dtype != c.dtype or M.device != c.device:
        raise ValueError(f"rank_scan: M is {M.dtype} on {M.device}, c {c.dtype} on {c.device}; they must agree")
    if tuple(M.shape) == tuple(c.shape):
        return False
    if tuple(M.shape) == tuple(c.shape) + (c.shape[-1],):
        return True
    raise ValueError(f"rank_scan: M must be [..., H, H] (dense) or [..., H] (diagonal) for c [..., H] = "
                     f"{tuple(c.shape)}, got {tuple(M.shape)}")


def _apply(M, v, dense: bool):
    return torch.matmul(M, v.unsqueeze(-1)).squeeze(-1) if dense else M * v


def compose(later: tuple[torch.Tensor, torch.Tensor], earlier: tuple[torch.Tensor, torch.Tensor],
            dense: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``later ∘ earlier``: the map that applies ``earlier`` first, ``(M₂M₁, M₂c₁ + c₂)`` (diagonal: elementwise)."""
    (M2, c2), (M1, c1) = later, earlier
    return (M2 @ M1 if dense else M2 * M1), _apply(M2, c1, dense) + c2


def local_carries(M: torch.Tensor, c: torch.Tensor, initial: torch.Tensor | None = None,
                  reverse: bool = False) -> torch.Tensor:
    """The sequential reference of :func:`rank_scan` in one process: ``M`` [p, ...] and ``c`` [p, ..., H] stacked
    over the ranks; returns the carries [p, ..., H] (``out[r]`` is what rank r receives)."""
    dense = _dense(M[0], c[0])
    p = c.shape[0]
    order = range(p - 1, -1, -1) if reverse else range(p)
    out = torch.empty_like(c)
    x = torch.zeros_like(c[0]) if initial is None else initial.to(c.dtype)
    for r in order:
        out[r] = x
        x = _apply(M[r], x, dense) + c[r]
    return out


def _timedelta(timeout: float | None):
    if timeout is None:
        return None
    if timeout <= 0:
        raise ValueError(f"rank_scan: timeout must be a positive number of seconds, got {timeout}")
    return datetime.timedelta(seconds=float(timeout))


def _transport(group, t: torch.Tensor) -> torch.device:
    """The device the group's backend carries ``t`` on; refuses a CPU tensor on NCCL before any exchange."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        if not t.is_cuda:
            raise ValueError(f"rank_scan: the group's backend is NCCL, which carries CUDA tensors only; M and c are "
                             f"on {t.device} (use a gloo group for CPU tensors)")
        return t.device
    return torch.device("cpu") if t.is_cuda else t.device  # gloo: stage CUDA tensors through the host


def _wait(work, timeout, peer: int | None, what: str, group=None) -> None:
    try:
        ok = work.wait(timeout) if timeout is not None else work.wait()
    except Exception as exc:  # noqa: BLE001 - gloo reports a dead peer as a RuntimeError (connection closed)
        raise _failure(what, peer, group, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from exc
    if ok is False:
        raise _failure(what, peer, group, "timed out")


def _failure(what: str, peer: int | None, group, why: str) -> RankFailure:
    if peer is None:
        peer = _missing_rank(group)
    who = f"rank {peer}" if peer is not None else "a rank of the group"
    return RankFailure(f"rank_scan: {who} did not complete the {what} ({why}); it died, hung or dropped its "
                       "connection", peer)


def _missing_rank(group) -> int | None:
    """The lowest group rank that has not checked in for the current all_gather (:func:`_check_in`), or None."""
    store, key = _CHECKIN.get("store"), _CHECKIN.get("key")
    if store is None or key is None:
        return None
    p = dist.get_world_size(group)
    for r in range(p):
        try:
            store.wait([f"{key}/{r}"], datetime.timedelta(seconds=0.5))
        except Exception:  # noqa: BLE001 - a missing key times out
            return r
    return None


_CHECKIN: dict = {}
_CALLS = [0]


def _check_in(group) -> None:
    """Mark in the group's store that this rank reached this all_gather, so that a rank left waiting can name the
    one that never came (a collective's own error does not say).  No store (a custom group): no name."""
    try:
        store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the rendezvous store, if any
    except Exception:  # noqa: BLE001
        _CHECKIN.clear()
        return
    _CALLS[0] += 1
    key = f"bppsa/rank_scan/{id(group) if group is not None else 'world'}/{_CALLS[0]}"
    store.set(f"{key}/{dist.get_rank(group)}", "1")
    _CHECKIN.update(store=store, key=key)


def _global(group, r: int) -> int:
    return r if group is None or group is dist.group.WORLD else dist.get_global_rank(group, r)


def rank_scan(M: torch.Tensor, c: torch.Tensor, group=None, *, reverse: bool = False, strategy: str | None = None,
              initial: torch.Tensor | None = None, timeout: float | None = None) -> torch.Tensor:
    """This rank's carry: the exclusive scan of the ranks' chunk maps ``(M, c)`` (the module's docstring)."""
    dense = _dense(M, c)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("rank_scan: torch.distributed is not initialised (call init_process_group, or launch "
                           "with torchrun)")
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if r < 0:
        raise ValueError("rank_scan: this process is not a member of the group it was given")
    strategy = default_strategy(p) if strategy is None else strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"rank_scan: unknown strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")
    td = _timedelta(timeout)
    pos = p - 1 - r if reverse else r  # this rank's place in the scan's order
    if pos == 0 and initial is not None:
        if tuple(initial.shape) != tuple(c.shape):
            raise ValueError(f"rank_scan: initial must be shaped as c, {tuple(c.shape)}, got {tuple(initial.shape)}")
        initial = initial.to(c)
        c = _apply(M, initial, dense) + c
    zero = initial.clone() if (pos == 0 and initial is not None) else torch.zeros_like(c)
    if p == 1:
        return zero
    dev = _transport(group, c)
    M_, c_ = M.detach().to(dev).contiguous(), c.detach().to(dev).contiguous()
    rank_of = (lambda q: p - 1 - q) if reverse else (lambda q: q)  # noqa: E731 - scan position -> group rank
    if strategy == "allgather":
        carry = _allgather(M_, c_, group, p, pos, rank_of, dense, td)
    else:
        carry = _rounds(M_, c_, group, p, pos, rank_of, dense, td)
    return zero if carry is None else carry.to(c.device)


def _pack(M: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.cat([M.reshape(-1), c.reshape(-1)])


def _unpack(buf: torch.Tensor, M: torch.Tensor, c: torch.Tensor):
    return buf[:M.numel()].view(M.shape), buf[M.numel():].view(c.shape)


def _allgather(M, c, group, p, pos, rank_of, dense, td):
    """One all_gather of the p packed summaries, then the carry by p - 1 local mat-vecs at most."""
    mine = _pack(M, c)
    bufs = [torch.empty_like(mine) for _ in range(p)]
    _check_in(group)
    work = dist.all_gather(bufs, mine, group=group, async_op=True)
    _wait(work, td, None, "all_gather of the summaries", group)
    if pos == 0:
        return None
    x = None
    for q in range(pos):
        Mq, cq = _unpack(bufs[rank_of(q)], M, c)
        x = cq.clone() if x is None else _apply(Mq, x, dense) + cq
    return x


def _rounds(M, c, group, p, pos, rank_of, dense, td):
    """⌈log₂ p⌉ rounds: in the round of distance d, a rank sends its aggregate S (the maps of positions
    pos - 2d + 1 .. pos, clipped at 0) to position pos + d and receives from pos - d, which it composes into S
    and into its exclusive aggregate E (positions pos - 2d + 1 .. pos - 1 after the round)."""
    S, E = (M, c), None
    buf = torch.empty_like(_pack(M, c))
    d = 1
    for _ in range(math.ceil(math.log2(p))):
        sends = pos + d < p
        recvs = pos - d >= 0
        works, out = [], _pack(*S)  # kept referenced until the send completes
        if sends:
            works.append((dist.isend(out, _global(group, rank_of(pos + d)), group=group), rank_of(pos + d), "send"))
        if recvs:
            works.append((dist.irecv(buf, _global(group, rank_of(pos - d)), group=group), rank_of(pos - d),
                          "receive"))
        for work, peer, what in works:
            _wait(work, td, peer, f"exchange of round d = {d} ({what})", group)
        if recvs:
            R = tuple(t.clone() for t in _unpack(buf, M, c))
            E = R if E is None else compose(E, R, dense)
            if pos + 2 * d < p:  # S is sent again next round
                S = compose(S, R, dense)
        d *= 2
    return None if E is None else E[1]


# -- the other exchanges of a sequence split over the ranks, with the same failure reporting ----------------------


def send_to(t: torch.Tensor, dst: int, group=None, timeout: float | None = None) -> None:
    """Send ``t`` to group rank ``dst`` and wait for it to be taken; :class:`RankFailure` naming ``dst`` if not."""
    dev = _transport(group, t)
    buf = t.detach().to(dev).contiguous()
    _wait(dist.isend(buf, _global(group, dst), group=group), _timedelta(timeout), dst, "receive of the state", group)


def recv_from(like: torch.Tensor, src: int, group=None, timeout: float | None = None) -> torch.Tensor:
    """A tensor shaped as ``like`` from group rank ``src``; :class:`RankFailure` naming ``src`` if it never comes."""
    buf = torch.empty_like(like, device=_transport(group, like))
    _wait(dist.irecv(buf, _global(group, src), group=group), _timedelta(timeout), src, "send of the state", group)
    return buf.to(like.device)


def all_reduce_sum(t: torch.Tensor, group=None, timeout: float | None = None) -> torch.Tensor:
    """The sum of ``t`` over the group's ranks (a new tensor); :class:`RankFailure` naming the rank that never
    reached the reduction, where the group's store can say."""
    buf = t.detach().to(_transport(group, t)).contiguous().clone()
    _check_in(group)
    _wait(dist.all_reduce(buf, group=group, async_op=True), _timedelta(timeout), None, "all_reduce of the gradients",
          group)
    return buf.to(t.device)


def all_gather_ints(values: list[int], group=None, timeout: float | None = None) -> list[list[int]]:
    """Every rank's list of ints (the same length on every rank), in group rank order."""
    mine = torch.tensor(values, dtype=torch.int64)
    if str(dist.get_backend(group)).lower() == "nccl":
        mine = mine.cuda()
    bufs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    _check_in(group)
    _wait(dist.all_gather(bufs, mine, group=group, async_op=True), _timedelta(timeout), None,
          "all_gather of the slices' sizes", group)
    return [b.tolist() for b in bufs]
