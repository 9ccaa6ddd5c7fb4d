"""The compiled kernel of the CPU fast path (``chain_scan.c``): built at first use, loaded with ctypes.

The C source is compiled by the system's C compiler (``$CC``, else ``cc``) with ``-O3 -march=native``
once per (hidden size, lane count, dtype) -- constants let the compiler keep a product's row in
registers and vectorise across the batch lanes -- into ``$BPPSA_CACHE_DIR`` (default
``~/.cache/bppsa``), keyed by the source, the flags, the compiler and this CPU's model and flags, so
nodes of a cluster sharing a home directory each get their own build.  A build is written to a
temporary name and renamed: concurrent jobs never load half a file.

Where no compiler works, :func:`unavailable_reason` says why and the fast path runs on numpy
(:mod:`bppsa.kernels.cpu`); nothing else changes.
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
from importlib import resources
from pathlib import Path

import torch

__all__ = ["available", "unavailable_reason", "library", "ChainScan", "FUSED_LEVELS"]

# Up-sweep levels computed per block in cache (blocks of 2^FUSED_LEVELS Jacobians), see chain_scan.c.
FUSED_LEVELS = 4

_REAL = {torch.float32: "float", torch.float64: "double"}
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11"]


def _source() -> bytes:
    return resources.files("bppsa.kernels").joinpath("chain_scan.c").read_bytes()


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
def library(H: int, lanes: int, dtype: torch.dtype) -> ctypes.CDLL | None:
    """The kernel for hidden size H, ``lanes`` batch lanes and ``dtype``; None where it cannot be built
    (why: :func:`unavailable_reason`)."""
    try:
        return _build(H, lanes, dtype)
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, compiler killed, bad .so ...
        _errors["cc"] = f"{type(e).__name__}: {e}"
        return None


def _build(H: int, lanes: int, dtype: torch.dtype) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        _errors["cc"] = f"no C compiler ({compiler_name()!r} not on PATH)"
        return None
    real = _REAL.get(dtype)
    if real is None:  # e.g. half precision: the numpy path takes it
        return None
    defs = [f"-DHID={H}", f"-DLANES={lanes}", f"-DREAL={real}"]
    src = _source()
    key = hashlib.sha256(b"\0".join([src, " ".join(_FLAGS + defs).encode(), _compiler_id(cc).encode(),
                                     _cpu_id().encode()])).hexdigest()[:20]
    out = cache_dir() / f"chain_scan_{real}_H{H}_L{lanes}_{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            c_file, so_file = Path(tmp) / "chain_scan.c", Path(tmp) / out.name
            c_file.write_bytes(src)
            r = subprocess.run([cc, *_FLAGS, *defs, "-o", str(so_file), str(c_file)], capture_output=True,
                               text=True, timeout=300)
            if r.returncode != 0:
                _errors["cc"] = f"{cc} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}"
                return None
            os.replace(so_file, out)
    lib = ctypes.CDLL(str(out))
    p, i, l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    for name, args in {"chain_up": [p, p, l, l, l, i, i, l, l, p],
                       "chain_tree": [p, p, p, p, l, l, l, i, i, p], "chain_down": [p, p, p, l, l, l, i, i, l, l, p],
                       "chain_up_lanes": [p, p, l, l, l, i, i, l, l, p],
                       "chain_down_lanes": [p, p, p, l, l, l, i, i, l, l, p],
                       "chain_scan_work": [l, i, i], "chain_blocks": [l, i, i]}.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, {"chain_scan_work": l, "chain_blocks": l}.get(name)
    return lib


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernel builds here and agrees with the reference scan on a small case, else why not."""
    if library(3, 2, torch.float64) is None:
        return _errors.get("cc", "the kernel could not be built")
    from .. import scan as _scan

    gen = torch.Generator().manual_seed(0)
    n, B, H, L = 11, 2, 3, 4
    W = torch.randn(H, H, generator=gen, dtype=torch.float64)
    d = torch.rand(n, B, H, generator=gen, dtype=torch.float64)
    g = torch.randn(B, H, generator=gen, dtype=torch.float64)
    out = torch.empty(n, B, H, dtype=torch.float64)
    ChainScan(W.t().contiguous(), d.permute(0, 2, 1).contiguous(), g, out, L, 0, B,
              lambda size: torch.empty(size, dtype=torch.float64)).run()
    ref = _scan.blelloch_scan(g, W.t() * d.unsqueeze(-2))
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    return None if err <= 1e-12 else f"the compiled kernel disagrees with the reference scan (rel. err {err:.1e})"


def available() -> bool:
    return unavailable_reason() is None


class ChainScan:
    """The compiled scan of one lane slice ``[b0, b0 + lanes)`` of a factored chain: ``Wt`` [H, H] (W_hhᵀ),
    ``d_lanes`` [n, H, B], ``g`` [B, H] and ``out`` [n, B, H], all contiguous, ``L`` tree levels, ``fused``
    of them per block; ``scratch(size)`` gives a contiguous tensor of d's dtype with ``size`` elements.
    :meth:`run` is the whole scan on this thread; :meth:`up`, :meth:`middle` and :meth:`down` are its
    three phases, the first and last over any split of ``range(blocks)``.

    A one-lane slice (B = 1) runs the up and down phases of its full blocks ``VL`` at a time as the
    lanes of the kernel built for ``VL`` lanes (a vector register's worth), where that builds; only a
    clipped last block takes the one-lane kernel."""

    def __init__(self, Wt, d_lanes, g, out, L: int, b0: int, lanes: int, scratch, fused: int = FUSED_LEVELS):
        n, H, B = d_lanes.shape
        self.lib = library(H, lanes, d_lanes.dtype)
        self.blocks = int(self.lib.chain_blocks(n, L, fused))
        work = scratch(int(self.lib.chain_scan_work(n, L, fused)))
        self.tensors = (Wt, d_lanes, g, out, work)  # kept alive while the kernel holds their addresses
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.shape = (n, B, b0, L, fused)
        self.vl = 64 // d_lanes.element_size()
        self.wide = library(H, self.vl, d_lanes.dtype) if lanes == 1 and self.blocks > 1 else None
        size = 1 << min(fused, L)  # blocks hold `size` Jacobians; the last one may be clipped at J_{n-1}
        clipped = self.blocks > 0 and n - (self.blocks * size - 1) < size
        self.full = self.blocks - clipped

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

    def up(self, j0: int, j1: int) -> None:
        Wt, d, _, _, work = self.ptrs
        a = self._wide_end(j0, j1)
        if a > j0:
            self.wide.chain_up_lanes(Wt, d, *self.shape, j0, a, work)
        if j1 > a:
            self.lib.chain_up(Wt, d, *self.shape, a, j1, work)

    def middle(self) -> None:
        Wt, d, g, out, work = self.ptrs
        self.lib.chain_tree(Wt, d, g, out, *self.shape, work)

    def down(self, j0: int, j1: int) -> None:
        Wt, d, _, out, work = self.ptrs
        a = self._wide_end(j0, j1)
        if a > j0:
            self.wide.chain_down_lanes(Wt, d, out, *self.shape, j0, a, work)
        if j1 > a:
            self.lib.chain_down(Wt, d, out, *self.shape, a, j1, work)
