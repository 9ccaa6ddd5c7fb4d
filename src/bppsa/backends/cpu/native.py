"""The compiled kernel of the CPU fast path (``chain_scan.c``): built at first use, loaded with ctypes.

The C source is compiled by the system's C compiler (``$CC``, else ``cc``) with ``-O3 -march=native``
once per (chain kind, hidden size, input size, lane count, dtype) -- constants let the compiler keep a product's row
in registers and vectorise across the batch lanes -- into ``$BPPSA_CACHE_DIR`` (default
``~/.cache/bppsa``), keyed by the source, the flags, the compiler and this CPU's model and flags, so
nodes of a cluster sharing a home directory each get their own build.  A build is written to a
temporary name and renamed: concurrent jobs never load half a file.

Where no compiler works, :func:`unavailable_reason` says why and the fast path runs on numpy
(:mod:`bppsa.backends.cpu`); nothing else changes.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

__all__ = ["available", "unavailable_reason", "library", "ChainScan", "Ready", "fused_levels", "KINDS", "lane_width",
           "rnn_factors", "gru_factors", "head_grads"]


def fused_levels(n: int) -> int:
    """Up-sweep levels the kernel computes per block in cache for a chain of ``n`` Jacobians (blocks of 2^c,
    see chain_scan.c): from 4 up to 6, the most that leave at least 8 blocks to the tree above them.  Each
    level fused saves storing and re-reading a level; the tree's products over the blocks cost as much as a
    block's, so fewer, longer blocks do less work (measured, paired, whole backward at T = 1000: 6 against 4
    levels 1.07x faster for the RNN at B = 16, 1.11x at B = 64, 1.06x for the GRU at B = 16)."""
    return max(4, min(6, n.bit_length() - 4))

_REAL = {torch.float32: "float", torch.float64: "double"}
# The chains the kernel runs (chain_scan.c's KIND): the RNN's fused and paper layouts, the GRU.
KINDS = {"rnn": 0, "paper": 1, "gru": 2}
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11"]
_LIBS = ["-lm"]


def _source() -> bytes:
    return resources.files(__package__).joinpath("chain_scan.c").read_bytes()


def cache_dir() -> Path:
    root = os.environ.get("BPPSA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "bppsa")
    return Path(root) / "native"


def _compiler() -> str | None:
    return shutil.which(compiler_name())


def compiler_name() -> str:
    return os.environ.get("CC", "cc")


@functools.cache
def _cpu_id() -> str:
    """This CPU's model and instruction-set flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


@functools.cache
def _compiler_id(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc


_errors: dict = {}


@functools.cache
def library(kind: str, H: int, I: int, lanes: int, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The kernel for a chain ``kind`` (:data:`KINDS`), hidden size H, input size I, ``lanes`` batch lanes
    and ``dtype``; None where it cannot be built (why: :func:`unavailable_reason`)."""
    try:
        return _build(KINDS[kind], H, I, lanes, dtype)
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, compiler killed, bad .so ...
        _errors["cc"] = f"{type(e).__name__}: {e}"
        return None


def _build(kind: int, H: int, I: int, lanes: int, dtype: torch.dtype) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        _errors["cc"] = f"no C compiler ({compiler_name()!r} not on PATH)"
        return None
    real = _REAL.get(dtype)
    if real is None:  # e.g. half precision: the numpy path takes it
        return None
    defs = [f"-DKIND={kind}", f"-DHID={H}", f"-DINP={I}", f"-DLANES={lanes}", f"-DREAL={real}",
            f"-DREALBITS={8 * dtype.itemsize}"]
    src = _source()
    key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS + defs + _LIBS).encode(), _compiler_id(cc).encode(),
                                     _cpu_id().encode()])).hexdigest()[:20]
    out = cache_dir() / f"chain_scan_k{kind}_{real}_H{H}_I{I}_L{lanes}_{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            c_file, so_file = Path(tmp) / "chain_scan.c", Path(tmp) / out.name
            c_file.write_bytes(src)
            r = subprocess.run([cc, *_FLAGS, *defs, "-o", str(so_file), str(c_file), *_LIBS], capture_output=True,
                               text=True, timeout=300)
            if r.returncode != 0:
                _errors["cc"] = f"{cc} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}"
                return None
            os.replace(so_file, out)
    lib = ctypes.CDLL(str(out))
    p, i, l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    factors = ({"gru_factors": [p, p, p, p, p, p, l, l, l, l, p]} if kind == KINDS["gru"]
               else {"rnn_factors": [p, p, l, l, l, l, p]})
    for name, args in {"chain_up": [p, p, l, l, l, i, i, l, l, p],
                       "chain_tree": [p, p, p, p, i, l, l, l, i, i, p, p],
                       "chain_down": [p, p, p, i, l, l, l, i, i, l, l, p, p],
                       "chain_up_lanes": [p, p, l, l, l, i, i, l, l, p],
                       "chain_down_lanes": [p, p, p, i, l, l, l, i, i, l, l, p, p],
                       "chain_slice": [p, p, p, p, i, l, l, l, i, i, p, p, p, i], "chain_signal": [p, i],
                       "chain_count": [p], "xent_head_grads": [p, p, p, p, l, l, l, p, p, p],
                       "chain_scan_work": [l, i, i], "chain_blocks": [l, i, i], "fma_chain": [l], **factors}.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, {"chain_scan_work": l, "chain_blocks": l, "chain_slice": i, "xent_head_grads": i,
                                       "fma_chain": ctypes.c_float if real == "float" else ctypes.c_double}.get(name)
    return lib


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernel builds here and agrees with the reference scan on a small case, else why not."""
    if library("rnn", 3, 0, 2, torch.float64) is None:
        return _errors.get("cc", "the kernel could not be built")
    from ... import scan as _scan

    gen = torch.Generator().manual_seed(0)
    n, B, H, L = 11, 2, 3, 4
    W = torch.randn(H, H, generator=gen, dtype=torch.float64)
    h = torch.rand(n, B, H, generator=gen, dtype=torch.float64)  # states, time order: step k reads h[n - 1 - k]
    g = torch.randn(B, H, generator=gen, dtype=torch.float64)
    out = torch.empty(n, B, H, dtype=torch.float64)
    ChainScan("rnn", W.t().contiguous()[None], (h, h[:, :, :0]), 0, g, out, L, 0, B,
              lambda size: torch.empty(size, dtype=torch.float64)).run()
    ref = _scan.blelloch_scan(g, W.t() * (1 - h.flip(0) ** 2).unsqueeze(-2))
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    return None if err <= 1e-12 else f"the compiled kernel disagrees with the reference scan (rel. err {err:.1e})"


def available() -> bool:
    return unavailable_reason() is None


def lane_width(kind: str, dtype: torch.dtype) -> int:
    """Batch lanes per slice: one 64-byte vector register, except for the GRU: 32 bytes, so that a block's
    product and the Jacobian it is multiplied by (2·H²·lanes values) stay in a 32 KiB L1 cache at H = 20
    (measured: 1.4x faster per lane than 64 bytes on a Zen 4 core)."""
    return (32 if kind == "gru" else 64) // dtype.itemsize


def rnn_factors(h: torch.Tensor, x: torch.Tensor, out: torch.Tensor, k0: int, k1: int) -> None:
    """``out`` [T, H + I + H, B] = the RNN's d_k = 1 - h_{T-k}^2, x_{T-k} and h_{T-k-1} (scan order, lane
    order; steps k0 .. k1 - 1) from ``h`` [T, B, H] and ``x`` [T, B, I], all contiguous: what the kernel
    reads from ``h`` and ``x`` itself, written for other readers."""
    T, B, H = h.shape
    library("rnn", H, x.shape[2], 1, h.dtype).rnn_factors(h.data_ptr(), x.data_ptr(), T, B, k0, k1, out.data_ptr())


def head_grads(logits: torch.Tensor, y: torch.Tensor, W: torch.Tensor, h: torch.Tensor):
    """The compiled twin of :meth:`bppsa.backends.twin.TorchBackend.head_grads` (contiguous CPU tensors of one
    dtype, int64 labels): one call where torch's handful of small ops took ~0.2 ms inside a training step."""
    B, C = logits.shape
    gW, gb, gh = W.new_empty(W.shape), W.new_empty((C,)), h.new_empty(h.shape)
    lib = library("rnn", W.shape[1], 0, 1, W.dtype)
    if lib.xent_head_grads(logits.data_ptr(), y.data_ptr(), W.data_ptr(), h.data_ptr(), B, C, W.shape[1],
                           gW.data_ptr(), gb.data_ptr(), gh.data_ptr()):
        raise IndexError(f"a label is out of range for {C} classes")
    return gW, gb, gh


class Ready:
    """What the slices of one scan wait for (:meth:`ChainScan.run_slice`), in two ints the kernel reads: ∇h_T
    (0, then 1 to go on or 2 to stop) and how many of the threads have written their range of the steps'
    factors; set through ``lib`` (any of the kernel's builds).  An event mirrors the first for waits in Python."""

    def __init__(self, lib: ctypes.CDLL):
        self._flags = (ctypes.c_int * 2)(0, 0)
        self.ptr = ctypes.addressof(self._flags)
        self._event = threading.Event()
        self._lib = lib

    def set(self, ok: bool = True) -> None:
        """∇h_T is in g (ok), or a thread failed and the others stop (which no later call undoes)."""
        self._lib.chain_signal(self.ptr, 1 if ok else 2)
        self._event.set()

    def wait(self) -> bool:
        self._event.wait()
        return self._flags[0] == 1

    def written(self) -> None:
        """This thread's range of the factors is written."""
        self._lib.chain_count(self.ptr + ctypes.sizeof(ctypes.c_int))


def gru_factors(x: torch.Tensor, h: torch.Tensor, cell, out: torch.Tensor, k0: int, k1: int) -> None:
    """``out`` [T, 5H + I + H, B] = the GRU's (c_r, c_z, c_n, z, e), x and h' in scan order and lane order
    (steps k0 .. k1 - 1), its gates recomputed from ``x`` [T, B, I] and ``h`` [T, B, H] (contiguous) and the
    weights of ``cell`` (a one-layer torch.nn.GRU of their dtype)."""
    T, B, H = h.shape
    w = [t.detach().contiguous() for t in (cell.weight_ih_l0, cell.weight_hh_l0, cell.bias_ih_l0, cell.bias_hh_l0)]
    library("gru", H, x.shape[2], 1, h.dtype).gru_factors(x.data_ptr(), h.data_ptr(), *(t.data_ptr() for t in w),
                                                           T, B, k0, k1, out.data_ptr())


class _Source(ctypes.Structure):
    """chain_scan.c's chain_src: where the steps' factor rows come from."""
    _fields_ = [("f", ctypes.c_void_p), ("h", ctypes.c_void_p), ("x", ctypes.c_void_p)]


class ChainScan:
    """The compiled scan of one lane slice ``[b0, b0 + lanes)`` of a factored chain of ``kind``: ``Wt``
    [NW, H, H] (the weights, transposed); ``source`` the steps' factors: the GRU's ``f`` [steps, NR, B] (the
    per-step factors, then x_t and h' over ``I`` + H rows), or the RNN's ``(h, x)``, the forward's states
    [T, B, H] and inputs [T, B, I], from which the kernel reads each step's rows as it scans them; ``g``
    [B, H]; all contiguous; ``L`` tree levels, ``fused`` of them per block (default :func:`fused_levels`);
    ``scratch(size)`` gives a contiguous tensor of g's dtype with ``size`` elements.  ``out`` is the scan
    [n, B, H] (mode 0) or None: then each part of the down phase (and the middle, with part 0) accumulates
    the parameter gradients into its own sums (mode 1, :meth:`grad_sums`).  :meth:`run` is the
    whole scan on this thread; :meth:`up`, :meth:`middle` and :meth:`down` are its three phases, the first
    and last over any split of ``range(blocks)``.

    A one-lane slice (B = 1) runs the up and down phases of its full blocks ``VL`` at a time as the
    lanes of the kernel built for ``VL`` lanes (a vector register's worth), where that builds; only a
    clipped last block takes the one-lane kernel."""

    def __init__(self, kind: str, Wt, source, I: int, g, out, L: int, b0: int, lanes: int, scratch,
                 parts: int = 1, fused: int | None = None):
        B, H = g.shape
        dtype = g.dtype
        sources = (source,) if isinstance(source, torch.Tensor) else tuple(source)
        n = sources[0].shape[0] * (2 if kind == "paper" else 1)
        fused = fused_levels(n) if fused is None else fused
        self.lib = library(kind, H, I, lanes, dtype)
        self.blocks = int(self.lib.chain_blocks(n, L, fused))
        work = scratch(int(self.lib.chain_scan_work(n, L, fused)))
        self.vl = lane_width(kind, dtype)
        self.wide = library(kind, H, I, self.vl, dtype) if lanes == 1 and self.blocks > 1 else None
        self.mode = int(out is None)
        na = 4 * H if kind == "gru" else H
        # mode 1: per part, the sums of this slice's kernel and, where it runs, of the wide one
        self.acc = [g.new_zeros((parts, na, I + 1 + H, w)) if self.mode and lib is not None else None
                    for lib, w in ((self.lib, lanes), (self.wide, self.vl))]
        self.tensors = (Wt, *sources, g, out if out is not None else g, work)  # kept alive while the kernel holds them
        ptrs = [t.data_ptr() for t in sources]
        self._src = _Source(*(ptrs if len(ptrs) == 1 else [None, *ptrs]))  # kept alive, as the tensors
        self.ptrs = [Wt.data_ptr(), ctypes.addressof(self._src), g.data_ptr(), self.tensors[-2].data_ptr(),
                     work.data_ptr()]
        self.shape = (n, B, b0, L, fused)
        size = 1 << min(fused, L)  # blocks hold `size` Jacobians; the last one may be clipped at J_{n-1}
        clipped = self.blocks > 0 and n - (self.blocks * size - 1) < size
        self.full = self.blocks - clipped

    def grad_sums(self) -> torch.Tensor:
        """Mode 1: the parameter gradients' sums over this slice's parts and lanes, [NA, I + 1 + H]."""
        sums = [a.sum((0, 3)) for a in self.acc if a is not None]
        return sums[0] if len(sums) == 1 else sums[0] + sums[1]

    def _acc(self, part: int, wide: bool = False) -> int | None:
        a = self.acc[wide]
        return None if a is None else a[part].data_ptr()

    def _wide_end(self, j0: int, j1: int) -> int:
        """Where the full blocks among [j0, j1), the wide kernel's, end."""
        return j0 if self.wide is None else max(j0, min(j1, self.full))

    def cuts(self, p: int) -> list[int]:
        """Split points of range(blocks) into p parts (whole lane groups where the wide kernel runs)."""
        unit = self.vl if self.wide is not None else 1
        groups = -(-self.blocks // unit)
        return [min(self.blocks, unit * (groups * i // p)) for i in range(p + 1)]

    def run(self) -> None:
        self.up(0, self.blocks)
        self.middle()
        self.down(0, self.blocks)

    def run_slice(self, ready: Ready | None = None, parts: int = 0) -> None:
        """This slice's whole scan on this thread, in one call into the kernel (a worker thread then takes
        the interpreter lock only to start): once ``parts`` threads have said :meth:`Ready.written`, the up
        phase; then, once ``ready`` (where given) says ∇h_T is in ``g``, the middle and the down phase (none if
        it never comes).  A slice that runs the wide kernel waits for nothing but ∇h_T."""
        if self.wide is None:
            Wt, src, g, out, work = self.ptrs
            self.lib.chain_slice(Wt, src, g, out, self.mode, *self.shape, work, self._acc(0),
                                 None if ready is None else ready.ptr, parts)
            return
        self.up(0, self.blocks)
        if ready is None or ready.wait():
            self.middle()
            self.down(0, self.blocks)

    def up(self, j0: int, j1: int) -> None:
        Wt, f, _, _, work = self.ptrs
        a = self._wide_end(j0, j1)
        if a > j0:
            self.wide.chain_up_lanes(Wt, f, *self.shape, j0, a, work)
        if j1 > a:
            self.lib.chain_up(Wt, f, *self.shape, a, j1, work)

    def middle(self) -> None:
        Wt, f, g, out, work = self.ptrs
        self.lib.chain_tree(Wt, f, g, out, self.mode, *self.shape, work, self._acc(0))

    def down(self, j0: int, j1: int, part: int = 0) -> None:
        Wt, f, _, out, work = self.ptrs
        a = self._wide_end(j0, j1)
        if a > j0:
            self.wide.chain_down_lanes(Wt, f, out, self.mode, *self.shape, j0, a, work, self._acc(part, True))
        if j1 > a:
            self.lib.chain_down(Wt, f, out, self.mode, *self.shape, a, j1, work, self._acc(part))
