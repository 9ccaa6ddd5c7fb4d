"""The sliced forward: a recurrent layer's T steps as contiguous slices run side by side, then corrected.

A recurrent forward is a chain: step t needs step t - 1.  Where the batch alone cannot keep every thread busy (fewer
lane slices than threads: a batch of one vector register or less), the sequence itself is split into ``slices``
contiguous slices, and the slices' chains are solved as a block Jacobi (fixed-point) iteration:

- **sweep 0** runs every slice at once from a guessed start state (zeros, or ``guess``: the start states of the
  last call, :data:`stats`'s ``starts``); slice 0 starts from h0 and is exact;
- **each later sweep** reruns, at once, every slice k whose start state changed -- the end state of slice k - 1 as
  it now stands, against the start the slice last ran from -- from that new start, each batch element until its
  new trajectory meets the stored one (:func:`.forward.forward_until_meet`): a layer that forgets reaches the same
  state from any start within tens to hundreds of steps, after which the stored rest is kept;
- sweeps stop when no slice's start changed.  After sweep j the first j + 1 slices are exact (each started from its
  exact predecessor), so at most ``slices`` - 1 corrections are ever needed; after ``max_sweeps`` sweeps the
  slices still changing are finished by the **serial hand-off**: in order, each from its predecessor's end (exact
  by then), until it meets.

**The meeting criterion.**  ``tol`` = 0: bitwise.  The result is then the serial compiled forward's bit for bit, by
construction: a state and x_t determine the next state (the same operations in every job and lane), so a
trajectory that equals the stored one at a step equals it at every step after.  Bitwise meetings need the two
trajectories to become identical: the GRU's, the LSTM's and a relu RNN's do within a few hundred steps at torch's
default init; a tanh RNN's come within an ulp in ~100 steps but can stay an ulp apart for thousands (its rounded
map has many states it cycles among), so at tol = 0 its slices rarely meet (exact all the same, just not faster).
``tol`` > 0: an element meets where max|new - stored| <= tol · max|stored| over its units (h and c each), and its
stored rest is kept although it differs from the exact one by up to that much.  **The error bound:** each meeting
(and each start that changed by less than tol, so was not rerun) puts a perturbation of at most tol · max|state|
into its slice, carried forward by the layer's own Jacobian products J_t ⋯ J_s; with K slices at most K - 1 of
them lie along any step's history, so the error at a step is at most (K - 1) · tol · max|state| · max ‖J_t ⋯ J_s‖
(∞-norm).  For a layer that forgets those products shrink within a few steps; for one that remembers they do not
(but such a layer also rarely meets).

**Time.**  In units of one slice of one lane slice (T / K steps), with L lane slices and p threads: sweep 0 takes
⌈K L / p⌉, sweep j ⌈(K - j) L / p⌉ at most, the hand-off ⌈L / p⌉ per slice; against K ⌈L / p⌉ for the serial
compiled forward on the same threads.  A rerun whose jobs would leave threads idle (one slice of a batch of one
register: each job a whole register) narrows its lanes as the serial forward does for these threads, so a correction
or a hand-off of one slice still uses them all.  ``stats['bound']`` is the worst case (a layer that never meets) as a
multiple of the serial forward: 1.0 at K = p = 2 with one lane slice, 1.5 at K = 4 there (max_sweeps = 3).  With a
layer that forgets, sweep 0 dominates: ~⌈K L / p⌉ / (K ⌈L / p⌉) of the serial time, 1 / p with one lane slice.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from . import forward

__all__ = ["sliced_forward", "MAX_SWEEPS", "worst_case"]

MAX_SWEEPS = 3  # sweep 0 and two corrections: at K <= 3 slices every run converges before the hand-off
_last: dict = {}  # guess="last": the start states of the last call, per shape
# The shortest slice worth running apart: its corrections rerun a layer's meeting length (tens to hundreds of steps
# for the layers that forget), which must stay a small share of the slice.
SLICE_MIN_STEPS = 512
_paid: dict = {}  # (kernel, T, B, dtype) -> whether the last automatic sliced call of that shape paid


def auto_slices(kernel: str, x: torch.Tensor, lengths=None) -> int:
    """The slices the layers' ``parallel_forward=None`` runs: as many as the threads the batch leaves idle (the
    compiled forward gives the threads the batch's lane slices first), where each has at least
    :data:`SLICE_MIN_STEPS` steps and the last such call of this shape paid (:func:`remember`); else 1, the serial
    compiled forward."""
    T, B = x.shape[:2]
    p = torch.get_num_threads()
    jobs = -(-B // forward.plan_lanes(B, x.dtype, p))
    K = p // jobs
    if K < 2 or T // K < SLICE_MIN_STEPS or not _paid.get((kernel, T, B, x.dtype), True):
        return 1
    return K


def remember(kernel: str, x: torch.Tensor, stats: dict) -> None:
    """Whether an automatic sliced call paid: no hand-off, and its corrections ran less than half a slice (a layer
    that remembers, or a tanh RNN whose trajectories stay an ulp apart, reruns whole slices): if not, this shape's
    later calls run serially."""
    T, B = x.shape[:2]
    K = len(stats["starts"][0])
    steps = [m for sweep in stats["meet_steps"] for m in sweep.values()]
    _paid[(kernel, T, B, x.dtype)] = not stats["fallback"] and all(m < T // K // 2 for m in steps)


def worst_case(K: int, L: int, p: int, max_sweeps: int) -> float:
    """The sliced forward's time where no slice ever meets, as a multiple of the serial forward's (module doc)."""
    m, L = max(1, min(max_sweeps, K)), max(1, L)
    units = math.ceil(K * L / p) + sum(math.ceil((K - j) * L / p) for j in range(1, m)) + (K - m) * math.ceil(L / p)
    return units / (K * math.ceil(L / p))


def _differs(new: np.ndarray, old: np.ndarray, tol: float) -> np.ndarray:
    """[..., B] bool: whether a batch element's state [..., B, H] changed: bitwise, or by more than tol · max|old|
    (numpy: on these few hundred numbers torch's per-operation cost would be most of the check's)."""
    if tol == 0:
        return (new.view(_int[new.dtype]) != old.view(_int[old.dtype])).any(-1)
    return np.abs(new - old).max(-1) > tol * np.abs(old).max(-1)


_int = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}


@torch.no_grad()
def sliced_forward(cell: str, x, h0, c0, weights, lengths=None, slices: int = 2, guess=None, tol: float = 0.0,
                   max_sweeps: int | None = None, threads: int | None = None):
    """The states of every step of one layer, ``(h, c, stats)`` -- h and c as :func:`.forward.compiled_forward`
    returns them -- by ``slices`` contiguous slices of the sequence run side by side on the threads (module doc).
    ``weights``: ``(w_ih, w_hh, b_ih, b_hh)`` as torch.nn holds them.  ``guess``: the slices' start states for
    sweep 0, ``(h, c)`` [slices, B, H] (c None but for the LSTM; row 0 is ignored: h0 is known), "last" for the
    start states of this process's last call with the same shapes, or None for zeros.  ``tol``: the meeting
    criterion (0: bitwise, the result then the serial forward's bit for bit).  ``stats``: ``sweeps`` (run in
    parallel, sweep 0 included), ``meet_steps`` (per correction sweep, per slice rerun: the steps its slowest
    element ran before it met, the slice's length where one never did), ``handoff`` (the slices the serial hand-off
    ran), ``fallback`` (whether it ran any), ``bound`` (:func:`worst_case`) and ``starts`` ((h, c): every slice's
    true start state, a guess for the next call).  None where the kernel cannot run the case (the caller runs
    torch's forward)."""
    w_ih, w_hh, b_ih, b_hh = weights
    p = max(1, torch.get_num_threads() if threads is None else threads)
    # the slices are the threads' work: lanes as wide as the register, whatever the batch
    pb = forward.problem(cell, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, tol=tol, threads=1)
    if pb is None:
        return None
    T, B, H, lstm = pb.T, pb.B, pb.H, cell == "lstm"
    K = max(1, min(int(slices), T))
    m_sweeps = MAX_SWEEPS if max_sweeps is None else max(1, int(max_sweeps))
    bounds = [T * k // K for k in range(K + 1)]
    lanes = pb.slices()
    key = (cell, T, B, H, K, x.dtype)
    if isinstance(guess, str):
        if guess != "last":
            raise ValueError(f"guess must be None, (h, c) or 'last' (got {guess!r})")
        guess = _last.get(key)

    def states(g):
        s = torch.zeros(K, B, H, dtype=x.dtype)
        if g is not None:
            if tuple(g.shape) != (K, B, H):
                raise ValueError(f"a guess must be [{K}, {B}, {H}] (got {tuple(g.shape)})")
            s.copy_(g)
        return s

    S = states(None if guess is None else guess[0])
    Sc = states(None if guess is None or not lstm else guess[1]) if lstm else None
    S[0] = 0 if pb.h0 is None else pb.h0
    if lstm:
        Sc[0] = 0 if pb.c0 is None else pb.c0
    met = torch.empty(K, B, dtype=torch.int64)
    h, c = pb.h, pb.c
    ends = [b - 1 for b in bounds[1:K]]  # the steps whose states are slices 1 .. K - 1's true starts
    h_np, c_np, S_np, Sc_np, met_np = (None if t is None else t.numpy() for t in (h, c, S, Sc, met))

    def job_list(ks, stale, meet, lanes=lanes):
        return [(b0, nb, bounds[k], bounds[k + 1], S[k], Sc[k] if lstm else None, meet, met[k])
                for k in ks for b0, nb in lanes if stale is None or bool(stale[k, b0:b0 + nb].any())]

    # the serial forward's lanes for these threads, and a rerun's problem with them (made at the first that wants it)
    rerun_lanes = forward.plan_lanes(B, x.dtype, p)
    narrow = functools.cache(lambda: forward.problem(cell, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, h, c,
                                                     tol=tol, lanes=rerun_lanes))

    def rerun_jobs(ks, stale):
        """A rerun's problem and jobs: fewer slices than sweep 0's, so where whole registers leave threads idle
        (one slice of a batch of one register) its lanes narrow to the serial forward's for these threads.  A
        batch element's bits do not depend on its lanes: the same result."""
        jobs = job_list(ks, stale, True)
        if len(jobs) < p and rerun_lanes < pb.lanes and narrow() is not None:
            return narrow(), job_list(ks, stale, True, narrow().slices())
        return pb, jobs

    def stale_now():
        """[K, B]: the elements whose slice start is no longer their predecessor's end (slice 0: never)."""
        st = np.zeros((K, B), dtype=bool)
        st[1:] = _differs(h_np[ends], S_np[1:], tol)
        if lstm:
            st[1:] |= _differs(c_np[ends], Sc_np[1:], tol)
        return st

    def rerun(ks, stale):
        """Slices ks' lane slices with a stale element, from their predecessors' ends, until they meet.  The new
        starts are copied before any job runs (a predecessor's rerun may rewrite its end), and only for the lanes
        that rerun: S holds the start each element's stored trajectory was computed from."""
        run_pb, jobs = rerun_jobs(ks, stale)
        for b0, nb, t0, *_ in jobs:
            S[bounds.index(t0), b0:b0 + nb] = h[t0 - 1, b0:b0 + nb]
            if lstm:
                Sc[bounds.index(t0), b0:b0 + nb] = c[t0 - 1, b0:b0 + nb]
        forward.run(run_pb, jobs, run_pb.threads(len(jobs), T // K, p))
        return {k: int((met_np[k][stale[k]] - bounds[k]).max()) for k in ks}

    jobs = job_list(range(K), None, False)
    forward.run(pb, jobs, pb.threads(len(jobs), T // K, p))
    sweeps, meet_steps, handoff = 1, [], []
    stale = stale_now()
    while stale.any() and sweeps < m_sweeps:
        ks = [k for k in range(K) if stale[k].any()]
        meet_steps.append(rerun(ks, stale))
        sweeps += 1
        stale = stale_now()
    for k in range(1, K) if stale.any() else ():  # the serial hand-off, in order: each from its exact predecessor
        st = _differs(h_np[bounds[k] - 1], S_np[k], tol)
        if lstm:
            st |= _differs(c_np[bounds[k] - 1], Sc_np[k], tol)
        if not st.any():
            continue
        mask = np.zeros((K, B), dtype=bool)
        mask[k] = st
        meet_steps.append(rerun([k], mask))
        handoff.append(k)
    starts = (torch.stack([h[b - 1] if b else S[0] for b in bounds[:-1]]),
              torch.stack([c[b - 1] if b else Sc[0] for b in bounds[:-1]]) if lstm else None)
    _last[key] = starts
    stats = {"sweeps": sweeps, "meet_steps": meet_steps, "handoff": handoff, "fallback": bool(handoff),
             "bound": worst_case(K, len(lanes), p, m_sweeps), "starts": starts}
    return h, c, stats
