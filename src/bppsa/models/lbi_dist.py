"""The LBI model with one region per rank of a ``torch.distributed`` group (gloo on CPUs, NCCL on GPUs).

Every rank holds a replica of the model but runs only its own region (rank 0 also ``m_0``, the last rank also the
LM head); the token embedding is replicated, each rank computing ``E`` from the token ids itself.

* **Forward:** ``m_{k+1}`` travels from rank ``k`` to rank ``k + 1`` by send/recv (``B · r`` numbers).
* **Backward** (:func:`step`): rank ``k < K - 1`` builds its ``A_k = (∂m_{k+1}/∂m_k)ᵀ`` (``[B, r, r]``) while the
  last rank runs its local backward from the loss (which gives ``ā_{K-1}``); the ranks then get their output
  adjoints ``ā_{k+1}`` from a scan across the ranks (:func:`interface_adjoints`), and run their local backwards
  from them.  ``mode`` says how that scan crosses the ranks:

  - ``"scan"``: issue 43's :func:`bppsa.distributed.rank_scan` of the ranks' summaries, backwards
    (``reverse=True``): rank ``k < K - 1`` is the linear map ``x -> A_k x``, the last rank the constant map
    ``x -> ā_{K-1}`` (``M = 0``, ``c = ā_{K-1}``), so the carry entering rank ``k`` is ``ā_{k+1}``;
  - ``"scan-allreduce"``: the paper's scheme (LBI.md): one all_reduce of the ``[K - 1, B, r, r]`` Jacobians (each
    rank fills its slot), one broadcast of ``ā_{K-1}`` from the last rank, then every rank runs the whole small
    suffix scan itself with a backend of :mod:`bppsa.backends`;
  - ``"pipeline"`` (the baseline on the same split): rank ``k`` waits for ``ā_{k+1}`` from rank ``k + 1``, runs
    its local backward (which gives ``ā_k`` too) and sends ``ā_k`` on: ``K`` local backwards one after another.

* All end with one all_reduce of the embedding's gradient (every region adds its share to ``∂L/∂E``); that traffic
  is a replicated parameter's, not the interface's, and :class:`Traffic` keeps it apart.

:class:`Traffic` counts the logical payload of every send, broadcast, all_reduce and all_gather a rank issues (also
those inside ``rank_scan``), the way the paper's script does (payload bytes, not wire traffic): a send its tensor's
bytes, a broadcast its tensor's bytes on the source rank, an all_reduce or an all_gather the tensor the rank puts in.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..backends import Backend, TorchBackend
from ..distributed import rank_scan
from .lbi import LBILM, lm_loss
from .lbi_scan import _accumulate, _params, interface_jacobians_t, region_forward, scan_operands

__all__ = ["MODES", "Traffic", "expected_bytes", "interface_adjoints", "rank_worker", "step"]

MODES = ("scan", "scan-allreduce", "pipeline")


@dataclass
class Traffic:
    """Logical payload bytes a rank sent, by ``(phase, what)``: phase "forward" / "backward", what "interface"
    (m_k, the Jacobians, the adjoints) or "embedding" (the replicated embedding's gradient all_reduce)."""

    bytes: dict = field(default_factory=lambda: defaultdict(int))
    calls: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, phase: str, what: str, op: str, t: torch.Tensor) -> None:
        self.bytes[(phase, what, op)] += t.numel() * t.element_size()
        self.calls[(phase, what, op)] += 1

    def total(self, phase: str | None = None, what: str | None = None) -> int:
        return sum(v for (p, w, _), v in self.bytes.items() if (phase in (None, p)) and (what in (None, w)))


class _Comm:
    """send / recv / broadcast / all_reduce on ``group``, each counted in ``traffic`` (recv sends nothing)."""

    def __init__(self, group, traffic: Traffic | None):
        self.group, self.traffic = group, traffic if traffic is not None else Traffic()

    def _g(self, r: int) -> int:  # group rank -> global rank
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def send(self, t, dst, phase, what):
        self.traffic.add(phase, what, "send", t)
        dist.send(t.contiguous(), self._g(dst), group=self.group)

    def recv(self, t, src):
        dist.recv(t, self._g(src), group=self.group)
        return t

    def broadcast(self, t, src, phase, what):
        if dist.get_rank(self.group) == src:
            self.traffic.add(phase, what, "broadcast", t)
        dist.broadcast(t, self._g(src), group=self.group)
        return t

    def all_reduce(self, t, phase, what):
        self.traffic.add(phase, what, "all_reduce", t)
        dist.all_reduce(t, group=self.group)
        return t

    @contextlib.contextmanager
    def counting(self, phase: str, what: str):
        """Count the payload of the point-to-point and collective calls made inside (by code that calls
        ``torch.distributed`` itself, such as ``rank_scan``)."""
        # name -> (the op counted, where its payload is among the positional arguments)
        ops = {"send": ("send", 0), "isend": ("send", 0), "broadcast": ("broadcast", 0),
               "all_reduce": ("all_reduce", 0), "all_gather": ("all_gather", 1),
               "all_gather_into_tensor": ("all_gather", 1)}
        saved = {name: getattr(dist, name) for name in ops}

        def wrap(name, fn):
            op, at = ops[name]

            def call(*args, **kw):
                t = args[at] if len(args) > at else kw.get("tensor", kw.get("input_tensor"))
                src = args[1] if len(args) > 1 else kw.get("src")
                if op != "broadcast" or src == dist.get_rank():
                    self.traffic.add(phase, what, op, t)
                return fn(*args, **kw)

            return call

        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)


def interface_adjoints(g: torch.Tensor | None, A: torch.Tensor | None, K: int, B: int, r: int, comm: _Comm,
                       mode: str = "scan", backend: Backend | None = None, L_m: int | None = None,
                       strategy: str | None = None, like: torch.Tensor | None = None) -> tuple:
    """This rank's ``(ā_{k+1}, ā_k)`` (``ā_{k+1}`` None on the last rank) from its piece: ``g = ā_{K-1}`` on the
    last rank, ``A = A_k`` on rank ``k < K - 1`` (None elsewhere), by a scan across the ranks (``mode`` "scan":
    :func:`bppsa.distributed.rank_scan`, ``strategy`` its; "scan-allreduce": the paper's all_reduce, broadcast and
    a local scan on ``backend`` with ``L_m``)."""
    rank = dist.get_rank(comm.group)
    last = rank == K - 1
    if mode == "scan":
        M = like.new_zeros((B, r, r)) if last else A
        c = g.detach() if last else like.new_zeros((B, r))
        with comm.counting("backward", "interface"):
            carry = rank_scan(M, c, comm.group, reverse=True, strategy=strategy)
        a_out = None if last else carry
    elif mode == "scan-allreduce":
        gbuf = g.detach().contiguous() if last else like.new_empty((B, r))
        comm.broadcast(gbuf, K - 1, "backward", "interface")
        if K > 1:
            Abuf = like.new_zeros((K - 1, B, r, r))
            if not last:
                Abuf[rank] = A
            comm.all_reduce(Abuf, "backward", "interface")
            backend = TorchBackend() if backend is None else backend
            prefixes = backend.scan(gbuf, scan_operands(list(Abuf.unbind(0))), L_m)  # prefixes[i] = ā_{K-1-i}
        a_out = None if last else prefixes[K - 2 - rank]
    else:
        raise ValueError(f"interface_adjoints: mode must be scan or scan-allreduce, got {mode!r}")
    a_in = g.detach() if last else torch.matmul(A, a_out.unsqueeze(-1)).squeeze(-1)
    return a_out, a_in


def step(model: LBILM, x: torch.Tensor, y: torch.Tensor, group=None, mode: str = "scan",
         backend: Backend | None = None, L_m: int | None = None, chunk: int | None = None,
         strategy: str | None = None, traffic: Traffic | None = None,
         timings: dict | None = None) -> torch.Tensor | None:
    """One forward and backward of ``model`` on ``(x, y)``, region ``k`` on rank ``k`` of ``group`` (whose size must
    be the model's number of regions).  Accumulates into ``.grad`` this rank's parameters' gradients: its region's,
    the embedding's (all of them, all-reduced), ``m_0``'s on rank 0 and the LM head's on the last rank; returns the
    loss on the last rank (None elsewhere).  ``traffic`` counts what this rank sends; ``timings`` (a dict) gets
    this rank's ``forward`` and ``backward`` wall seconds."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    K = model.K
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    if p != K:
        raise ValueError(f"the model has {K} regions but the process group has {p} ranks (one region per rank)")
    comm = _Comm(group, traffic)
    region = model.regions[rank]
    B, r = x.shape[0], model.r
    t0 = time.perf_counter()

    # forward: E on every rank, m_0 on rank 0, m_k from the previous rank
    E = model.embed(x)
    if rank == 0:
        E0 = E.detach().requires_grad_(True)
        m0 = model.m0(E0.mean(1))
        m_in = m0.detach()
    else:
        m_in = comm.recv(E.new_empty((B, r)), rank - 1)
    local = region_forward(region, E, m_in, m_grad=mode == "pipeline" or rank == K - 1)  # pipeline: it gives ā_k
    if rank < K - 1:
        comm.send(local.m_next.detach(), rank + 1, "forward", "interface")
        loss = None
    else:
        loss = lm_loss(model.head(local.y), y)
    t1 = time.perf_counter()

    params = _params(region) + (_params(model.head) if rank == K - 1 else [])
    if rank == K - 1:
        grads = torch.autograd.grad(loss, params + [local.E, local.m])
        _accumulate(params, grads[:-2])
        gE, g = grads[-2], grads[-1].detach()
    if mode != "pipeline":
        A = interface_jacobians_t(region, E, local.m, chunk) if rank < K - 1 else None
        a_out, a_in = interface_adjoints(g if rank == K - 1 else None, A, K, B, r, comm, mode, backend, L_m,
                                         strategy, E.detach())
        if rank < K - 1:
            grads = torch.autograd.grad(local.m_next, params + [local.E], a_out)
            _accumulate(params, grads[:-1])
            gE = grads[-1]
    else:  # pipeline: ā_{k+1} from the next rank, ā_k to the previous one
        if rank < K - 1:
            a_out = comm.recv(E.new_empty((B, r)), rank + 1)
            grads = torch.autograd.grad(local.m_next, params + [local.E, local.m], a_out)
            _accumulate(params, grads[:-2])
            gE, g = grads[-2], grads[-1].detach()
        a_in = g
        if rank > 0:
            comm.send(g, rank - 1, "backward", "interface")
    if rank == 0:
        m0_params = _params(model.m0)
        grads = torch.autograd.grad(m0, m0_params + [E0], a_in)
        _accumulate(m0_params, grads[:-1])
        gE = gE + grads[-1]
    emb = _params(model.embed)
    flat = torch.cat([t.reshape(-1) for t in torch.autograd.grad(E, emb, gE)])
    comm.all_reduce(flat, "backward", "embedding")
    _accumulate(emb, [c.view_as(q) for c, q in zip(flat.split([q.numel() for q in emb]), emb)])
    if timings is not None:
        timings["forward"], timings["backward"] = t1 - t0, time.perf_counter() - t1
    return None if loss is None else loss.detach()


def expected_bytes(K: int, B: int, r: int, itemsize: int, mode: str = "scan",
                   strategy: str | None = None) -> dict[str, list[int]]:
    """The interface payload each rank sends per step, by formula (what :class:`Traffic` must count), in bytes:

    * forward: ``B r`` on ranks ``0 .. K-2``;
    * backward by ``scan`` (``rank_scan``; one summary is ``B r² + B r`` numbers): with the ``allgather`` strategy
      every rank puts in its summary once; with ``rounds`` a rank sends it in each round whose peer exists;
    * by ``scan-allreduce``: ``(K-1) B r²`` (the all_reduce) on every rank, plus ``B r`` (the broadcast) on the last;
    * by ``pipeline``: ``B r`` on ranks ``1 .. K-1``."""
    from ..distributed import default_strategy

    fwd = [B * r * itemsize if k < K - 1 else 0 for k in range(K)]
    summary = (B * r * r + B * r) * itemsize
    if K == 1:
        bwd = [B * r * itemsize if mode == "scan-allreduce" else 0]
    elif mode == "scan" and (strategy or default_strategy(K)) == "allgather":
        bwd = [summary] * K
    elif mode == "scan":  # rounds: position pos = K-1-k sends in the round of distance d while pos + d < K
        bwd = [summary * sum(1 for j in range(math.ceil(math.log2(K))) if (K - 1 - k) + (1 << j) < K)
               for k in range(K)]
    elif mode == "scan-allreduce":
        bwd = [(K - 1) * B * r * r * itemsize + (B * r * itemsize if k == K - 1 else 0) for k in range(K)]
    elif mode == "pipeline":
        bwd = [B * r * itemsize if k > 0 else 0 for k in range(K)]
    else:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    return {"forward": fwd, "backward": bwd}


def rank_worker(rank: int, p: int, sizes: dict, state: dict, x: torch.Tensor, y: torch.Tensor,
                modes: tuple[str, ...] = ("scan",), backend: str = "torch", repeats: int = 1, warmup: int = 0,
                strategy: str | None = None) -> dict:
    """Build the model of ``sizes`` (:class:`LBILM`'s arguments) with ``state`` and run :func:`step` ``warmup``
    untimed then ``repeats`` timed rounds, each round every mode once (interleaved); per mode: its gradients and
    traffic of its last step, its timings (one per timed round) and the loss (last rank)."""
    from ..backends import get_backend

    model = LBILM(**sizes).to(next(iter(state.values())).dtype)
    model.load_state_dict(state)
    be = get_backend(backend, torch.device("cpu"))
    out = {mode: {"times": []} for mode in modes}
    for i in range(warmup + repeats):
        for mode in modes:
            model.zero_grad(set_to_none=True)
            traffic, timing = Traffic(), {}
            dist.barrier(group=None)
            loss = step(model, x, y, mode=mode, backend=be, strategy=strategy, traffic=traffic, timings=timing)
            if i >= warmup:
                out[mode]["times"].append(timing)
            out[mode].update(grads={n: q.grad for n, q in model.named_parameters() if q.grad is not None},
                             loss=loss, bytes=dict(traffic.bytes), calls=dict(traffic.calls))
    return out
