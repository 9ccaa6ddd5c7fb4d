"""The compiled forward of one recurrent layer on a CPU (``forward.c``): every step's state in one call.

torch runs a recurrent layer's forward as a loop of small ops whose dispatch is most of its time (~20-40 µs a step
at H = 20, three quarters of a training step); this kernel runs all T steps in one call, the batch as the vector
lanes, the lane slices spread over ``torch.get_num_threads()`` threads.  It computes what torch.nn.RNN (tanh or
relu), torch.nn.GRU and torch.nn.LSTM compute, on their weights as they hold them, to a few ulp a step (the
summation order and the vector sigmoid/tanh differ): tested against torch's own forward, fp64 within 1e-12 and
fp32 within 1e-6 relative (``tests/test_cpu_forward.py``).

- :func:`compiled_forward`: the states of every step, ``(h, c)`` (c: the LSTM's cells, the backward needs them),
  or None where the kernel cannot run the case (no C compiler, a dtype other than fp32/fp64, a tensor off the CPU,
  an LSTM with ``proj_size`` > 0): the caller then runs torch's forward.
- :func:`forward_until_meet`: steps t0 .. t1 - 1 from a given state, stopping where the new trajectory meets a
  stored one: the building block of the sliced forward (:mod:`.sliced`).

Inputs are time-major: x [T, B, I], h0 and c0 [B, H] (None: zeros), ``lengths`` [B] (optional): a step t >=
lengths[b] carries b's state (h and c), as :func:`bppsa.nn.backward.layer_forward` does.
"""
from __future__ import annotations

import ctypes
import functools
import subprocess

import torch

from . import native

__all__ = ["CELLS", "compiled_forward", "forward_until_meet", "library", "lanes", "plan_lanes", "Problem", "problem",
           "run"]

CELLS = {"rnn_tanh": 0, "rnn_relu": 1, "gru": 2, "lstm": 3}
GATES = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4}
_REAL = {torch.float32: "float", torch.float64: "double"}
# A thread's share of a call must repay waking it (~20-50 µs): a job of fewer vector multiply-adds than this
# (T·G·H·(H + I) per lane slice; ~40 µs at the ~1 a cycle measured on a Zen 2) runs on the calling thread alone.
MIN_JOB_FMA = 100_000

_p, _l = ctypes.c_void_p, ctypes.c_long


class _Call(ctypes.Structure):
    """forward.c's fw_call."""
    _fields_ = [("x", _p), ("Wi", _p), ("Wh", _p), ("bi", _p), ("bh", _p), ("len", _p), ("h", _p), ("c", _p),
                ("T", _l), ("B", _l), ("ni", _l), ("tol", ctypes.c_double)]


class _Job(ctypes.Structure):
    """forward.c's fw_job."""
    _fields_ = [("b0", _l), ("nb", _l), ("t0", _l), ("t1", _l), ("h0", _p), ("c0", _p), ("meet", _l), ("met", _p),
                ("s", _l)]


def plan_lanes(B: int, dtype: torch.dtype, threads: int) -> int:
    """A job's lanes: one vector register of the target, halved where that gives the threads more jobs (an
    AVX-512 register holds 16 fp32: B = 16 would be one job), down to 32 bytes (narrower fp64 vectors' exponent
    conversions are built piecewise on x86).  A batch element's bits do not depend on it (simd.h)."""
    L = native.lane_width("forward", dtype)
    while L * dtype.itemsize > 32 and -(-B // L) < threads:
        L //= 2
    return L


@functools.cache
def library(cell: str, H: int, dtype: torch.dtype, lanes: int | None = None) -> ctypes.CDLL | None:
    """The forward kernel of ``cell`` (:data:`CELLS`) for hidden size H, ``dtype`` and ``lanes`` (a power of two,
    default one vector register), for every input size (the call's); None where it cannot be built (why:
    :func:`bppsa.backends.cpu.native.unavailable_reason`)."""
    real = _REAL.get(dtype)
    if real is None:
        return None
    lanes = lanes or native.lane_width("forward", dtype)
    defs = [f"-DCELL={CELLS[cell]}", f"-DHID={H}", f"-DLANES={lanes}", f"-DREAL={real}",
            f"-DREALBITS={8 * dtype.itemsize}"]
    try:
        lib = native.build("forward.c", defs, f"forward_{cell}_{real}_H{H}_L{lanes}")
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, compiler killed, bad .so ...
        native._errors["cc"] = f"{type(e).__name__}: {e}"
        return None
    if lib is None:
        return None
    lib.fw_run.argtypes, lib.fw_run.restype = [_p, _p, _l, _l], ctypes.c_int
    lib.fw_lanes.argtypes, lib.fw_lanes.restype = [], _l
    return lib


native._loaded.append(library)


def lanes(lib) -> int:
    """Batch elements a job of this build runs side by side."""
    return int(lib.fw_lanes())


class Problem:
    """One layer's forward as the kernel takes it: contiguous operands, the call's struct, its lane slices.  Holds
    every tensor the kernel reads or writes, so they live as long as the call."""

    def __init__(self, cell, lib, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, h, c, tol=0.0):
        self.cell, self.lib = cell, lib
        self.T, self.B, I = x.shape
        self.H = w_hh.shape[1]
        self.keep = [t.contiguous() if t is not None else None for t in (x, w_ih, w_hh, b_ih, b_hh, lengths)]
        xc, wi, wh, bi, bh, ln = self.keep
        self.h, self.c = h, c
        self.h0, self.c0 = h0, c0
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.call = _Call(ptr(xc), ptr(wi), ptr(wh), ptr(bi), ptr(bh), ptr(ln), ptr(h), ptr(c), self.T, self.B, I, tol)
        self.lanes = lanes(lib)

    def slices(self) -> list[tuple[int, int]]:
        """The lane slices ``(b0, nb)``: the build's lanes of batch elements each, the last one what is left."""
        L = self.lanes
        return [(b0, min(L, self.B - b0)) for b0 in range(0, self.B, L)]

    def threads(self, n_jobs: int, steps: int, threads: int | None = None) -> int:
        """How many threads ``n_jobs`` jobs of ``steps`` steps each take: up to ``threads`` (default torch's), where
        a job repays the hand-off."""
        p = max(1, torch.get_num_threads() if threads is None else threads)
        G, I = GATES[self.cell], self.keep[0].shape[2]
        if steps * G * self.H * (self.H + I) < MIN_JOB_FMA:
            return 1
        return max(1, min(p, n_jobs))


def problem(cell: str, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, h=None, c=None, tol: float = 0.0,
            threads: int | None = None, lanes: int | None = None):
    """The :class:`Problem` of a layer (``h``, ``c``: the outputs [T, B, H], new where None; its jobs' lanes
    :func:`plan_lanes` for ``threads``, or ``lanes``), or None where the kernel cannot run it.  Raises ValueError for
    operands that are not a layer of ``cell``."""
    if cell not in CELLS:
        raise ValueError(f"cell {cell!r} is not one of {', '.join(CELLS)}")
    tensors = [t for t in (x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, h, c) if t is not None]
    if any(t.device.type != "cpu" for t in tensors) or x.dtype not in _REAL:
        return None
    if x.dim() != 3:
        raise ValueError(f"x must be [T, B, I] (got {tuple(x.shape)})")
    T, B, I = x.shape
    G = GATES[cell]
    if w_hh.dim() != 2 or w_hh.shape[0] % G:
        raise ValueError(f"w_hh must be [{G}·H, H] for {cell} (got {tuple(w_hh.shape)})")
    H = w_hh.shape[0] // G
    if w_hh.shape[1] != H or I == 0:  # an LSTM with proj_size > 0 (W_hh [4H, P]), a layer without inputs
        return None
    if tuple(w_ih.shape) != (G * H, I):
        raise ValueError(f"w_ih must be [{G * H}, {I}] (got {tuple(w_ih.shape)})")
    for name, b in (("b_ih", b_ih), ("b_hh", b_hh)):
        if b is not None and tuple(b.shape) != (G * H,):
            raise ValueError(f"{name} must be [{G * H}] (got {tuple(b.shape)})")
    for name, s in (("h0", h0), ("c0", c0)):
        if s is not None and tuple(s.shape) != (B, H):
            raise ValueError(f"{name} must be [{B}, {H}] (got {tuple(s.shape)})")
    if any(t.dtype != x.dtype for t in (h0, c0, w_ih, w_hh, b_ih, b_hh, h, c) if t is not None):
        return None
    if lengths is not None:
        if tuple(lengths.shape) != (B,):
            raise ValueError(f"lengths must be [{B}] (got {tuple(lengths.shape)})")
        if x.dtype == torch.float32 and T >= 1 << 24:  # the kernel compares t with the lengths as reals
            return None
        lengths = lengths.to(torch.int64)
    p = max(1, torch.get_num_threads() if threads is None else threads)
    lib = library(cell, H, x.dtype, lanes or plan_lanes(B, x.dtype, p))
    if lib is None:
        return None
    for name, out in (("h", h), ("c", c)):
        if out is not None and (tuple(out.shape) != (T, B, H) or not out.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [{T}, {B}, {H}] tensor")
    h = torch.empty(T, B, H, dtype=x.dtype) if h is None else h
    c = (torch.empty(T, B, H, dtype=x.dtype) if c is None else c) if cell == "lstm" else None
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0 (got {tol!r})")
    h0 = None if h0 is None else h0.contiguous()
    c0 = None if c0 is None or cell != "lstm" else c0.contiguous()
    return Problem(cell, lib, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, h, c, float(tol))


def _met_tensor(met, B: int):
    if met is not None and (met.dtype != torch.int64 or tuple(met.shape) != (B,) or not met.is_contiguous()):
        raise ValueError(f"met must be a contiguous int64 [{B}] tensor")
    return met


def run(pb: Problem, jobs: list[tuple], threads: int) -> list[int]:
    """Run ``jobs`` -- ``(b0, nb, t0, t1, h0, c0, meet, met)``: h0/c0 [B, H] tensors or None, ``met`` an int64 [B]
    tensor for its elements' meeting steps or None -- on ``threads`` threads; each job's last meeting step (t1
    where it ran to the end).  The caller keeps the tensors alive across the call."""
    arr = (_Job * len(jobs))()
    for a, (b0, nb, t0, t1, h0, c0, meet, met) in zip(arr, jobs):
        a.b0, a.nb, a.t0, a.t1, a.meet, a.s = b0, nb, t0, t1, int(meet), t1
        a.h0 = None if h0 is None else h0.data_ptr()
        a.c0 = None if c0 is None else c0.data_ptr()
        a.met = None if met is None else _met_tensor(met, pb.B).data_ptr()
    if jobs and pb.lib.fw_run(ctypes.byref(pb.call), arr, len(jobs), threads):
        raise RuntimeError("the compiled forward could not start its threads")
    return [a.s for a in arr]


@torch.no_grad()
def compiled_forward(cell: str, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths=None, *, threads: int | None = None,
                     lanes: int | None = None):
    """The states of every step of one layer, ``(h, c)`` [T, B, H] each (c None but for the LSTM), as torch.nn's
    ``cell`` computes them from x [T, B, I], h0 (and c0) [B, H] (None: zeros) and its weights as torch.nn holds
    them (biases None: none); ``lengths`` [B]: past its end a sequence keeps its state.  None where the kernel
    cannot run it (no compiler, another dtype or device, an LSTM with ``proj_size``): the caller runs torch's.
    ``lanes`` (tests): the jobs' width instead of :func:`plan_lanes`'s."""
    pb = problem(cell, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, threads=threads, lanes=lanes)
    if pb is None:
        return None
    sl = pb.slices()
    run(pb, [(b0, nb, 0, pb.T, pb.h0, pb.c0, False, None) for b0, nb in sl], pb.threads(len(sl), pb.T, threads))
    return pb.h, pb.c


@torch.no_grad()
def forward_until_meet(cell: str, x, h0, c0, w_ih, w_hh, b_ih, b_hh, t0: int, t1: int, h, c=None, *,
                       stored: bool = True, tol: float = 0.0, lengths=None, met: torch.Tensor | None = None,
                       threads: int | None = None) -> int | None:
    """Steps t0 .. t1 - 1 of one layer from the state (h0, c0) [B, H] before step t0 (None: zeros), into h (and the
    LSTM's c) [T, B, H].  With ``stored``, h[t0:t1] (and c) hold a stored trajectory of those steps, and each batch
    element b stops at the first step s_b where its new state meets the stored one -- bitwise at ``tol`` = 0, else
    max|new - stored| <= tol · max|stored| over its H units (h and c each) -- keeping s_b and the steps after it as
    stored; a sequence that ends without meeting gets its carried state written to t1 (s_b = t1).  ``met`` [B]
    (int64, optional) receives the s_b.  Returns their last, max s_b: from it on every batch element is as stored
    (t1: some never met).  None where the kernel cannot run the case (as :func:`compiled_forward`)."""
    T = x.shape[0]
    if not 0 <= t0 <= t1 <= T:
        raise ValueError(f"the steps [{t0}, {t1}) are not within [0, {T}]")
    pb = problem(cell, x, h0, c0, w_ih, w_hh, b_ih, b_hh, lengths, h, c, tol, threads)
    if pb is None:
        return None
    sl = pb.slices()
    s = run(pb, [(b0, nb, t0, t1, pb.h0, pb.c0, stored, met) for b0, nb in sl], pb.threads(len(sl), t1 - t0, threads))
    return max(s, default=t0)
