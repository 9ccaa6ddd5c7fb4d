"""The compiled kernels of the CPU fast path (:data:`SOURCES`: ``chain_scan.c``, the backward's scan, and
``forward.c``, the recurrent layers' forward, :mod:`.forward`): built at first use, loaded with ctypes.

A C source (with the package's headers, ``simd.h``) is compiled by the system's C compiler (``$CC``, else ``cc``)
with ``-O3 -march=<target>`` once per set of constants (:func:`build`; the scan's: chain kind, hidden size, input
size, lane count, dtype) -- constants let the compiler keep a product's rows in registers and vectorise across the
batch lanes -- into ``$BPPSA_CACHE_DIR`` (default ``~/.cache/bppsa``).

**The target** is ``$BPPSA_CPU_ISA`` (:data:`ISAS`): ``native`` (the default: this CPU), or ``x86-64-v3`` (AVX2)
or ``x86-64-v4`` (AVX-512) to build and run another x86 level on any CPU that has it.  The vector width and
register count come from the compiler's own macros for that target (:func:`target`), never from the CPU's
flags: a slice's lanes fill one vector register (:func:`lane_width`), and the kernel's static assert holds it.

**The cache** is keyed by the source, the flags, the compiler and (for ``native``) this CPU's model and flags, so
nodes of a cluster sharing a home directory each get their own build.  A build is written to a temporary name
and renamed (concurrent jobs never load half a file), jobs wanting the same one wait for the first (a lock file
beside it), and a SHA-256 written beside each build is checked before every load: a kernel cut short or garbled
in the cache (a full disk, a copy over a shared file system) is rebuilt once, and where that fails too the fast
path is unavailable and :func:`unavailable_reason` says why (the backend falls back to the torch twin) -- it is
never loaded.  With GCC the system headers every source includes are precompiled once per target and compiler
into the same cache (:data:`_SYSTEM_HEADERS`): a build then skips their parse and gives the same bytes.

Where no compiler works, :func:`unavailable_reason` says why; nothing else changes.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from importlib import resources
from pathlib import Path

import torch

from ...process import cache_root

__all__ = ["available", "builds", "unavailable_reason", "library", "any_library", "build", "build_lanes", "Team",
           "Fill", "GruFill", "LstmFill", "KINDS", "ACTS", "ISAS", "SOURCES", "target", "lane_width", "rnn_factors",
           "reset", "isa", "build_key", "hidden", "sums_shape"]

_REAL = {torch.float32: "float", torch.float64: "double"}
# The chains the kernel runs (chain_scan.c's KIND): the RNN's fused and paper layouts, the GRU, the LSTM (no
# projection; its state [h; c]).  A kernel's H is the chain's state size (chain.shape[2]: the LSTM's 2H).
KINDS = {"rnn": 0, "paper": 1, "gru": 2, "lstm": 3}
# The RNN's nonlinearity, whose derivative the kernel reads from the states (chain_scan.c's ACT).
ACTS = {"tanh": 0, "relu": 1}
# Weight matrices (NW), and the cell's hidden size from the state size.
WEIGHTS = {"rnn": 1, "paper": 1, "gru": 3, "lstm": 4}


def hidden(kind: str, S: int) -> int:
    """The cell's hidden size of a chain of ``kind`` whose state is ``S`` wide (the LSTM's state is [h; c])."""
    return S // 2 if kind == "lstm" else S


def sums_shape(kind: str, S: int, I: int) -> tuple[int, int]:
    """The kernel's parameter-gradient sums (NA rows: the gates' pre-activations; I + 1 + H columns: x, 1, h')."""
    H = hidden(kind, S)
    return (4 * H if kind in ("gru", "lstm") else H), I + 1 + H
# BPPSA_CPU_ISA: the build targets (-march values) and the CPU flags each needs to run.
ISAS = {"native": (), "x86-64-v3": ("avx2", "fma", "bmi2"),
        "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")}
_FLAGS = ["-O3", "-fPIC", "-shared", "-std=gnu11", "-pthread"]
_LIBS = ["-lm"]


SOURCES = ("chain_scan.c", "forward.c")  # the kernels built here, each a C file of this package


@functools.cache
def _files(source: str) -> dict[str, bytes]:
    """What a build of ``source`` compiles: the file and every header of this package (any of them may be
    included; a change to one rebuilds every kernel, which is cheap and never stale)."""
    root = resources.files(__package__)
    names = [source] + sorted(f.name for f in root.iterdir() if f.name.endswith(".h"))
    return {name: root.joinpath(name).read_bytes() for name in names}


def _source(source: str = "chain_scan.c") -> bytes:
    return b"\0".join(name.encode() + b"\0" + text for name, text in _files(source).items())


def cache_dir() -> Path:
    return cache_root() / "native"


def _compiler() -> str | None:
    return _which(compiler_name())


@functools.cache
def _which(name: str) -> str | None:
    """``shutil.which``, once per name and process: every forward call asks for the target (a PATH scan, ~0.1 ms)."""
    return shutil.which(name)


def compiler_name() -> str:
    return os.environ.get("CC", "cc")


def isa() -> str:
    """The build target asked for (``$BPPSA_CPU_ISA``, default ``native``)."""
    name = os.environ.get("BPPSA_CPU_ISA", "").strip() or "native"
    if name not in ISAS:
        raise ValueError(f"BPPSA_CPU_ISA={name!r} is not a build target here; use one of {', '.join(ISAS)}")
    return name


def _march(name: str) -> list[str]:
    return [f"-march={name}"]


@functools.cache
def _cpu_id() -> str:
    """This CPU's model and instruction-set flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _cpu_lacks(name: str) -> list[str]:
    """The CPU flags a target needs that this CPU does not report (none where /proc/cpuinfo is unreadable)."""
    flags = set(re.findall(r"[\w.]+", " ".join(ln.split(":", 1)[-1] for ln in _cpu_id().splitlines()
                                               if ln.startswith(("flags", "Features")))))
    return [f for f in ISAS[name] if flags and f not in flags]


@functools.cache
def _compiler_id(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cc


@functools.cache
def _target(cc: str, name: str) -> dict:
    macros = subprocess.run([cc, *_march(name), "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                            timeout=60)
    if macros.returncode:
        raise OSError(f"{cc} {' '.join(_march(name))} failed: {(macros.stderr or macros.stdout).strip()[-300:]}")
    defined = set(re.findall(r"#define (\w+)", macros.stdout))
    # the widest vector register and the register file of the target (chain_scan.c reads the same macros)
    avx = "AVX2" if "__AVX2__" in defined else "AVX"
    for macro, simd, vbytes, regs in (("__AVX512F__", "AVX-512", 64, 32), ("__AVX__", avx, 32, 16),
                                      ("__aarch64__", "NEON", 16, 32), ("", "SSE2/other", 16, 16)):
        if not macro or macro in defined:
            return {"isa": name, "flags": _march(name), "simd": simd, "vector_bytes": vbytes, "registers": regs,
                    "machine": platform.machine(), "compiler": cc}
    raise AssertionError("unreachable")


def target() -> dict | None:
    """The build target: ``isa``, the compiler ``flags``, its SIMD extension, ``vector_bytes`` (one register) and
    ``registers`` (the vector register file), as the compiler defines them; None without a working compiler."""
    cc = _compiler()
    if cc is None:
        return None
    try:
        return _target(cc, isa())
    except (OSError, subprocess.SubprocessError) as e:
        _errors["cc"] = f"{type(e).__name__}: {e}"
        return None


_errors: dict = {}
_any: dict = {}  # (kind, H, dtype, act) -> the first build of that key loaded in this process (any_library)
_loaded: list = []  # other modules' caches of loaded builds (forward.py's), forgotten by reset() too


def reset() -> None:
    """Forget this process's target, builds and their errors (after ``BPPSA_CPU_ISA`` or ``CC`` changed)."""
    for f in (_which, _target, library, unavailable_reason, _precompiled_in, *_loaded):
        f.cache_clear()
    _errors.clear()
    _any.clear()


@functools.cache
def library(kind: str, H: int, lanes: int, dtype: torch.dtype, act: str = "tanh") -> ctypes.CDLL | None:
    """The kernel for a chain ``kind`` (:data:`KINDS`), state size H (the hidden size; the LSTM's 2H), ``lanes``
    batch lanes and ``dtype`` (``act``: the RNN's nonlinearity, :data:`ACTS`), for every input size (the call's:
    ``team_call.S.ni``, the factor builders' ``ni``); None where it cannot be built (why:
    :func:`unavailable_reason`)."""
    if kind == "lstm" and H % 2:
        raise ValueError(f"the LSTM's state [h; c] has an even size, not {H}")
    try:
        lib = _build(KINDS[kind], H, lanes, dtype, ACTS[act] if kind in ("rnn", "paper") else 0)
    except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, compiler killed, bad .so ...
        _errors["cc"] = f"{type(e).__name__}: {e}"
        return None
    if lib is not None:
        _any.setdefault((kind, H, dtype, act), lib)
    return lib


def any_library(kind: str, H: int, dtype: torch.dtype, act: str = "tanh") -> ctypes.CDLL | None:
    """A build of ``kind``, H, ``dtype`` and ``act`` for what every lane count's build holds alike (the factor
    builders, whose vectors are one register wide whatever ``LANES`` is): the first one this process loaded, else
    the one of :func:`lane_width` lanes -- so a gate pass costs no build of its own beside its scan's."""
    return _any.get((kind, H, dtype, act)) or library(kind, H, lane_width(kind, dtype), dtype, act)


def build_lanes(groups: list[list[tuple[int, int]]]) -> int:
    """The lanes of the one build that runs every lane slice of ``groups`` (lists of ``(b0, lanes)``): the power of
    two the widest slice fills or is narrower than; narrower slices run on it with spare lanes."""
    return 1 << (max(w for gr in groups for _, w in gr) - 1).bit_length()


def builds(dtype: torch.dtype) -> bool:
    """Whether the kernel is at hand here (:func:`available`) and takes ``dtype``; what it is built for is built at
    first use, not asked for here."""
    return dtype in _REAL and available()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(so: Path) -> bool:
    """Whether the build exists and matches the checksum written beside it after its build."""
    try:
        return so.with_suffix(".sha256").read_text().strip() == _digest(so)
    except OSError:
        return False


def build_key(extra: str = "", source: str = "chain_scan.c") -> str | None:
    """What every build of ``source`` for the current target depends on besides its constants (the source and its
    headers, flags, compiler, and this CPU where the target is ``native``), hashed; ``extra`` is mixed in.  None
    without a target."""
    tg = target()
    if tg is None:
        return None
    cpu = _cpu_id() if tg["isa"] == "native" else ""
    return hashlib.sha256(b"\0".join([_source(source), " ".join(_FLAGS + tg["flags"] + _LIBS).encode(),
                                       _compiler_id(tg["compiler"]).encode(), cpu.encode(),
                                       extra.encode()])).hexdigest()[:20]


# The system headers of every source (chain_scan.c, forward.c, simd.h), precompiled once per target and compiler
# (GCC's .gch, about 25 MB) and included first: each build then skips their parse (immintrin.h alone is 0.3-0.4 s
# of a 1.5-2.5 s build) and gives the same bytes (tests/test_cpu_fast_path.py).  A source includes them again
# itself, so a compiler that cannot use the file (not GCC, another version) reads the headers as text.
_SYSTEM_HEADERS = b"""/* bppsa: the system headers of the CPU kernels, precompiled (native.py) */
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
"""


def _built(out: Path, compile_to) -> str | None:
    """``out`` in the cache whole: there already, or made by ``compile_to(tmp_path)`` (None on success, else why it
    failed) under a lock beside it -- processes that want the same file (test workers, cluster jobs starting together
    on a shared cache) wait for the first instead of compiling it again -- then renamed into place with its SHA-256
    beside it.  None where it is there whole, else why not."""
    if _intact(out):
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _intact(out):
            if out.exists():  # cut short or garbled since its build: never used, rebuilt
                warnings.warn(f"the cached CPU kernel {out} does not match its checksum (damaged); rebuilding it",
                              stacklevel=6)
            with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                made = Path(tmp) / out.name
                why = compile_to(made)
                if why is not None:
                    return why
                sum_file = Path(tmp) / "sum"
                sum_file.write_text(_digest(made) + "\n")
                os.replace(made, out)
                os.replace(sum_file, out.with_suffix(".sha256"))
        if not _intact(out):  # the rebuild itself did not land whole (the disk is still full, say)
            return f"the kernel {out} is damaged in the cache and its rebuild failed the checksum"
    return None


def _precompiled(cc: str, flags: list[str], isa_name: str) -> list[str]:
    """``-include`` of :data:`_SYSTEM_HEADERS` precompiled for ``cc`` and ``flags`` (built into the cache at first
    use), or nothing where ``cc`` is not GCC or the header does not build (the sources then parse them as text).
    Once per process and cache: a later build of the process takes the answer without hashing the 25 MB again."""
    args = (cc, tuple(flags), isa_name, str(cache_dir()))
    got = _precompiled_in(*args)
    if got and not Path(got[1] + ".gch").exists():  # the cache emptied under this process: build it again
        _precompiled_in.cache_clear()
        got = _precompiled_in(*args)
    return got


@functools.cache
def _precompiled_in(cc: str, flags: tuple[str, ...], isa_name: str, cache: str) -> list[str]:
    cc_id = _compiler_id(cc)
    if "Free Software Foundation" not in cc_id or "clang" in cc_id.lower():
        return []
    key = hashlib.sha256(b"\0".join([_SYSTEM_HEADERS, " ".join(flags).encode(), cc_id.encode(),
                                     (_cpu_id() if isa_name == "native" else "").encode()])).hexdigest()[:20]
    header = Path(cache) / f"system_{isa_name}_{key}.h"

    def compile_to(gch: Path) -> str | None:
        text = gch.with_name(header.name)
        text.write_bytes(_SYSTEM_HEADERS)
        r = subprocess.run([cc, *[f for f in flags if f != "-shared"], "-x", "c-header", str(text), "-o", str(gch)],
                           capture_output=True, text=True, timeout=300)
        return None if r.returncode == 0 else r.stderr

    if not header.exists() or header.read_bytes() != _SYSTEM_HEADERS:
        header.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=header.parent, delete=False) as f:
            f.write(_SYSTEM_HEADERS)
        os.chmod(f.name, 0o644)
        os.replace(f.name, header)
    # a header that did not build is no reason to call the kernels unavailable: they build without it
    return ["-include", str(header)] if _built(header.with_name(header.name + ".gch"), compile_to) is None else []


def build(source: str, defs: list[str], stem: str) -> ctypes.CDLL | None:
    """``source`` (:data:`SOURCES`) compiled for the current target with the ``-D`` definitions ``defs`` into the
    cache (``<stem>_<isa>_<key>.so``) where it is not there whole already, and loaded; None where it cannot be
    built (why: :func:`unavailable_reason`'s ``_errors``).  Every kernel of the package is built here."""
    tg = target()
    if tg is None:
        _errors.setdefault("cc", f"no C compiler ({compiler_name()!r} not on PATH)")
        return None
    lacks = _cpu_lacks(tg["isa"])
    if lacks:
        _errors["cc"] = f"BPPSA_CPU_ISA={tg['isa']} needs CPU features this CPU lacks ({', '.join(lacks)})"
        return None
    cc, flags = tg["compiler"], _FLAGS + tg["flags"]
    key = build_key(" ".join(defs), source)
    out = cache_dir() / f"{stem}_{tg['isa']}_{key}.so"

    def compile_to(so_file: Path) -> str | None:
        tmp = so_file.parent
        for name, text in _files(source).items():
            (tmp / name).write_bytes(text)
        r = subprocess.run([cc, *flags, *_precompiled(cc, flags, tg["isa"]), *defs, "-o", str(so_file),
                            str(tmp / source), *_LIBS], capture_output=True, text=True, timeout=300)
        return None if r.returncode == 0 else f"{cc} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-500:]}"

    why = _built(out, compile_to)
    if why is not None:
        _errors["cc"] = why
        return None
    return ctypes.CDLL(str(out))


def _build(kind: int, H: int, lanes: int, dtype: torch.dtype, act: int = 0) -> ctypes.CDLL | None:
    real = _REAL.get(dtype)
    if real is None:  # e.g. half precision: the numpy path takes it
        return None
    defs = [f"-DKIND={kind}", f"-DHID={H}", f"-DLANES={lanes}", f"-DREAL={real}",
            f"-DREALBITS={8 * dtype.itemsize}", f"-DACT={act}"]
    tag = f"k{kind}" + (f"a{act}" if act else "")  # act: relu's RNN
    lib = build("chain_scan.c", defs, f"chain_scan_{tag}_{real}_H{H}_L{lanes}")
    if lib is None:
        return None
    p, i, l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    factors = ({"gru_factors": [p, p, p, p, p, p, l, l, l, l, l, p]} if kind == KINDS["gru"]
               else {"lstm_factors": [p] * 9 + [l, l, l, l, l, p]} if kind == KINDS["lstm"]
               else {"rnn_factors": [p, p, l, l, l, l, l, p]})
    for name, args in {"team_go": [p], "team_drain": [p], "team_scratch": [l, i, i, l],
                       "chain_scan_work": [l, i, i], "chain_blocks": [l, i, i], "fma_chain": [l],
                       "chain_product": [p, p, p, p, p, l, l, l, l, i, l, l, p, p], **factors}.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, {"chain_scan_work": l, "chain_blocks": l, "team_go": i,
                                       "team_scratch": l, "team_drain": None, "chain_product": None,
                                       "fma_chain": ctypes.c_float if real == "float" else ctypes.c_double}.get(name)
    return lib


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernel builds here and agrees with the reference scan on a small case, else why not."""
    n, B, H, L = 11, 2, 3, 4
    if library("rnn", H, build_lanes([[(0, B)]]), torch.float64) is None:
        return _errors.get("cc", "the kernel could not be built")
    from ... import scan as _scan

    gen = torch.Generator().manual_seed(0)
    W = torch.randn(H, H, generator=gen, dtype=torch.float64)
    h = torch.rand(n, B, H, generator=gen, dtype=torch.float64)  # states, time order: step k reads h[n - 1 - k]
    g = torch.randn(B, H, generator=gen, dtype=torch.float64)
    out = torch.empty(n, B, H, dtype=torch.float64)
    team = Team("rnn", n, B, H, 0, torch.float64, L, [[(0, B)]], True, 1, 1, 0, fused=4)
    team.go(W, (h, h[:, :, :0]), g, out)
    ref = _scan.blelloch_scan(g, W.t() * (1 - h.flip(0) ** 2).unsqueeze(-2))
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    return None if err <= 1e-12 else f"the compiled kernel disagrees with the reference scan (rel. err {err:.1e})"


def available() -> bool:
    return unavailable_reason() is None


def lane_width(kind: str, dtype: torch.dtype) -> int:
    """Batch lanes in one vector register of the build target (:func:`target`; 16 bytes without a compiler): the
    widest slice a kernel is built for.  (The GRU's plan may pick narrower ones: :mod:`.plan`.)"""
    tg = target()
    return max(1, (tg["vector_bytes"] if tg else 16) // dtype.itemsize)


def rnn_factors(h: torch.Tensor, x: torch.Tensor, out: torch.Tensor, k0: int, k1: int, act: str = "tanh") -> None:
    """``out`` [T, H + I + H, B] = the RNN's d_k = 1 - h_{T-k}^2 (relu: 1[h_{T-k} > 0]), x_{T-k} and h_{T-k-1}
    (scan order, lane order; steps k0 .. k1 - 1) from ``h`` [T, B, H] and ``x`` [T, B, I], all contiguous: what
    the kernel reads from ``h`` and ``x`` itself, written for other readers."""
    T, B, H = h.shape
    any_library("rnn", H, h.dtype, act).rnn_factors(h.data_ptr(), x.data_ptr(), T, B, x.shape[2], k0, k1,
                                                   out.data_ptr())


_p, _l, _i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class _Call(ctypes.Structure):
    """chain_scan.c's team_call: one call's operands."""
    _fields_ = [("Wt", _p), ("f", _p), ("h", _p), ("x", _p), ("c", _p), ("ni", _l), ("g", _p), ("out", _p)]


class _SliceArgs(ctypes.Structure):
    _fields_ = [("call", _p), ("work", _p), ("acc", _p), ("wacc", _p), ("n", _l), ("B", _l), ("b0", _l), ("nw", _l),
                ("acc_size", _l), ("wacc_size", _l), ("L", _i), ("c", _i), ("mode", _i)]


class _Units(ctypes.Structure):
    _fields_ = [("fn", _p), ("pub", _p), ("args", _p), ("lo", _l), ("hi", _l), ("per", _l), ("n", _l),
                ("part0", _l), ("st", _p), ("next", _l), ("done", _l)]


class _Slice(ctypes.Structure):
    _fields_ = [("up", _Units * 2), ("mid", _Units), ("down", _Units * 2), ("owner", _l)]


class _Acc(ctypes.Structure):
    _fields_ = [("p", _p), ("parts", _l), ("lanes", _l)]


class _Seg(ctypes.Structure):
    _fields_ = [("a0", _l), ("a1", _l), ("c0", _l), ("c1", _l), ("out", _l), ("off", _l)]


class _Team(ctypes.Structure):
    _fields_ = [("call", _Call), ("W", _p), ("pre", _Units), ("sl", _p), ("ns", _l), ("nthreads", _l),
                ("acc", _p), ("nacc", _l), ("seg", _p), ("nseg", _l), ("dst", _p), ("scratch", _p),
                ("scratch_size", _l), ("beat", _p), ("stall_ns", _l), ("reruns", _l), ("stop", _i),
                ("closed", _i), ("inside", _i), ("ev", _i), ("parked", _i), ("csr", ctypes.c_uint),
                ("gen", _l)]


class _FillArgs(ctypes.Structure):
    _fields_ = [("x", _p), ("h", _p), ("Wi", _p), ("Wh", _p), ("bi", _p), ("bh", _p), ("f", _p), ("T", _l), ("B", _l),
                ("ni", _l)]


class _LstmFillArgs(ctypes.Structure):
    _fields_ = [("x", _p), ("h", _p), ("c", _p), ("Wi", _p), ("Wh", _p), ("bi", _p), ("bh", _p), ("h0", _p),
                ("c0", _p), ("f", _p), ("T", _l), ("B", _l), ("ni", _l)]




def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _units(u: _Units, lib, fn: str, args, lo: int, hi: int, per: int, part0: int = 0, pub: str | None = None):
    """Units of [lo, hi), ``per`` at a time (none where the range is empty); ``pub``: their publisher (they run
    into a thread's scratch and may run again where their thread is held up), else they write in place.
    Returns their state array, which must live as long as ``u``."""
    per = max(1, per)
    u.fn, u.args = ctypes.cast(getattr(lib, fn), _p).value, ctypes.addressof(args)
    u.pub = ctypes.cast(getattr(lib, pub), _p).value if pub else None
    u.lo, u.hi, u.per, u.n, u.part0 = lo, hi, per, max(0, _ceil(hi - lo, per)), part0
    st = (_l * (2 * max(1, u.n)))()
    u.st = ctypes.addressof(st)
    return st


def stall_ns(kind: str, H: int, lanes: int) -> int:
    """How long a thread's heartbeat (bumped at every step of a unit) may stand still before the team takes the
    thread as held up by the host and runs its unit again: 20 µs, plus 8 of the longest steps at a pessimistic
    16 lane multiply-adds per ns (an up step is NW·H³ of them per lane; the LSTM's H³/2 with H its state, and a
    product of the tree's H³) -- far above any step of a running thread, far below the host's time slices
    (milliseconds)."""
    return int(20_000 + 8 * (3 if kind == "gru" else 1) * H ** 3 * lanes / 16)


class Fill:
    """A chain's gate pass left for the scan (the kernel's ``<kind>_factors`` over steps k0 .. k1 - 1 when called):
    the units of a team's scan write it in its threads instead (:meth:`units`: ``team_fill``)."""

    lib: ctypes.CDLL
    out: torch.Tensor

    def _args(self) -> ctypes.Structure:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def lib(self) -> ctypes.CDLL:
        """A build with the gate pass, where it is called outside a team's scan."""
        lib = any_library(*self.key)
        if lib is None:
            raise RuntimeError(f"the compiled CPU kernel ({self.key[0]}, state {self.key[1]}) could not be built: "
                               f"{_errors.get('cc', 'no reason recorded')}")
        return lib

    def units(self, u: _Units, threads: int, lib: ctypes.CDLL) -> None:
        """The gate pass as units of steps for ``threads``, run by the team of the build ``lib``."""
        T = self.out.shape[0]
        self.args = self._args()
        self.st = _units(u, lib, "team_fill", self.args, 0, T, _ceil(T, 4 * threads))


class GruFill(Fill):
    """The GRU's gate pass (``gru_factors``) from x, h and the cell's weights."""

    def __init__(self, x: torch.Tensor, h: torch.Tensor, cell, out: torch.Tensor):
        self.x, self.h, self.out = x, h, out
        self.w = [t.detach().contiguous() for t in (cell.weight_ih_l0, cell.weight_hh_l0, cell.bias_ih_l0,
                                                    cell.bias_hh_l0)]
        self.key = ("gru", h.shape[2], h.dtype)

    def __call__(self, k0: int, k1: int) -> None:
        T, B, _ = self.h.shape
        self.lib.gru_factors(self.x.data_ptr(), self.h.data_ptr(), *(t.data_ptr() for t in self.w), T, B,
                             self.x.shape[2], k0, k1, self.out.data_ptr())

    def _args(self):
        T, B, _ = self.h.shape
        return _FillArgs(self.x.data_ptr(), self.h.data_ptr(), *(t.data_ptr() for t in self.w), self.out.data_ptr(),
                         T, B, self.x.shape[2])


class LstmFill(Fill):
    """The LSTM's gate pass (``lstm_factors``) from x [T, B, I], the states h and c [T, B, H], the cell's weights
    ``(W_ih, W_hh, b_ih, b_hh)`` (biases None: zero) and h_0, c_0 [B, H] (None: zero), all contiguous."""

    def __init__(self, x, h, c, weights, h0, c0, out: torch.Tensor):
        T, B, H = h.shape
        self.x, self.h, self.c, self.h0, self.c0, self.out = x, h, c, h0, c0, out
        zero = h.new_zeros(4 * H)
        self.w = [zero if t is None else t.detach().contiguous() for t in weights]
        self.key = ("lstm", 2 * H, h.dtype)

    def _ptrs(self):
        return ([t.data_ptr() for t in (self.x, self.h, self.c, *self.w)]
                + [None if t is None else t.data_ptr() for t in (self.h0, self.c0)])

    def __call__(self, k0: int, k1: int) -> None:
        T, B, _ = self.h.shape
        self.lib.lstm_factors(*self._ptrs(), T, B, self.x.shape[2], k0, k1, self.out.data_ptr())

    def _args(self):
        T, B, _ = self.h.shape
        return _LstmFillArgs(*self._ptrs(), self.out.data_ptr(), T, B, self.x.shape[2])


class Team:
    """The compiled scan of a factored chain by a team of threads (chain_scan.c's ``team_go``), built once per
    shape and reused from call to call: the lane slices ``groups`` (lists of ``(b0, lanes)``: thread t owns
    ``groups[t]``; with ``by_slice`` False one list, whose slices every thread shares block by block), the down
    phase of each slice in ``parts`` units (each with its own sums), their scratch and sums, and the units of
    each phase.  ``mode`` 0: the scan, 1:
    the parameter gradients (``layout``: the chain's :meth:`~.chain.FactoredChain.grad_layout`).  ``H`` is the
    chain's state (``chain.shape[2]``: the LSTM's 2H), ``act`` the RNN's nonlinearity (:data:`ACTS`).

    A one-lane slice (B = 1) runs the up and down phases of its full blocks ``VL`` at a time as the lanes of the
    kernel built for ``VL`` lanes (a vector register's worth), where that builds; only a clipped last block
    takes the one-lane kernel.  ``affine``: the team also takes the loss's direct gradients at every step
    (:meth:`go`'s ``e``), which that path does not, so it is not used."""

    def __init__(self, kind: str, n: int, B: int, H: int, I: int, dtype: torch.dtype, L: int,
                 groups: list[list[tuple[int, int]]], by_slice: bool, threads: int, parts: int, mode: int,
                 layout=None, *, fused: int, affine: bool = False, act: str = "tanh"):
        self.t = t = _Team()
        self.call, self.mode, self.dtype, self.affine = t.call, mode, dtype, affine
        self.call.ni = I
        t.closed = 1
        vl = lane_width(kind, dtype)
        na, nbv = sums_shape(kind, H, I)
        owned = [(o if by_slice else 0, b0, w) for o, gr in enumerate(groups) for b0, w in gr]
        self.sl = (_Slice * len(owned))()
        self.keep, accs, scratch = [], [], 0
        nl = build_lanes(groups)  # one build runs every slice, narrower ones with spare lanes
        self.lib = lib = library(kind, H, nl, dtype, act)
        for e, (owner, b0, w) in zip(self.sl, owned):
            blocks = int(lib.chain_blocks(n, L, fused))
            wide = library(kind, H, vl, dtype, act) if nl == 1 and blocks > 1 and not affine else None
            size = 1 << min(fused, L)  # blocks hold `size` Jacobians; the last one may be clipped at J_{n-1}
            full = blocks - (blocks > 0 and n - (blocks * size - 1) < size) if wide is not None else 0
            p = parts
            work = torch.empty(int(lib.chain_scan_work(n, L, fused)), dtype=dtype)
            acc = torch.zeros((p, na, nbv, nl), dtype=dtype) if mode else None
            wacc = torch.zeros((p, na, nbv, vl), dtype=dtype) if mode and wide is not None else None
            a = _SliceArgs(ctypes.addressof(self.call), work.data_ptr(), *(0 if t_ is None else t_.data_ptr()
                                                                            for t_ in (acc, wacc)),
                           n, B, b0, w, *(0 if t_ is None else t_.numel() for t_ in (acc, wacc)), L, fused, mode)
            self.keep += [a, work, acc, wacc]
            accs += [(t_, p, ln) for t_, ln in ((acc, nl), (wacc, vl)) if t_ is not None]
            # up: a block per unit (the wide kernel's: VL blocks); the last block's product is never computed.
            # Every unit but those that write the scan's output (mode 0) runs into a thread's scratch.
            pub = (lambda name: name + "_pub") if mode else (lambda name: None)
            if wide is not None:
                self.keep += [_units(e.up[0], wide, "team_up_lanes", a, 0, full, vl, pub="team_up_lanes_pub"),
                              _units(e.down[0], wide, "team_down_lanes", a, 0, full, vl * _ceil(_ceil(full, vl), p),
                                     pub=pub("team_down_lanes")),
                              _units(e.down[1], lib, "team_down", a, full, blocks, blocks, pub=pub("team_down"))]
                scratch = max(scratch, int(wide.team_scratch(n, L, fused, I)))
            else:
                self.keep += [_units(e.up[0], lib, "team_up", a, 0, blocks - 1, 1, pub="team_up_pub"),
                              _units(e.down[0], lib, "team_down", a, 0, blocks, _ceil(blocks, p),
                                     pub=pub("team_down"))]
            self.keep.append(_units(e.mid, lib, "team_mid", a, 0, 1, 1, pub=pub("team_mid")))
            scratch = max(scratch, int(lib.team_scratch(n, L, fused, I)))
            e.owner = owner
        t.sl, t.ns, t.nthreads = ctypes.addressof(self.sl), len(owned), len(groups) if by_slice else threads
        # each thread's scratch (a unit's results until they are published) and heartbeat (its own cache line)
        self.scratch_size = _ceil(scratch, 16) * 16
        self.scratch = torch.empty(max(1, t.nthreads * self.scratch_size), dtype=dtype)
        self.beat = torch.zeros(max(1, t.nthreads) * 16, dtype=torch.int64)
        t.scratch, t.scratch_size, t.beat = self.scratch.data_ptr(), self.scratch_size, self.beat.data_ptr()
        t.stall_ns = stall_ns(kind, H, vl)
        self.live = None  # the last call's operands: a thread held up in it may still read them
        self.acc = (_Acc * max(1, len(accs)))(*[(a_.data_ptr(), p, ln) for a_, p, ln in accs])
        t.acc, t.nacc = ctypes.addressof(self.acc), len(accs)
        hc = hidden(kind, H)
        self.Wt = torch.empty(WEIGHTS[kind] * hc * hc, dtype=dtype)
        self.call.Wt = self.Wt.data_ptr()
        self.layout = [] if not mode else [shape for _, shape, _ in layout]
        self.names = [] if not mode else [name for name, _, _ in layout]
        if mode:
            segs = []
            for k, (_, _, blocks_) in enumerate(layout):  # blocks_: (rows, cols) of the sums, one after another
                off = 0
                for r, c in blocks_:
                    segs.append((r.start, r.stop, c.start, c.stop, k, off))
                    off += (r.stop - r.start) * (c.stop - c.start)
            self.seg = (_Seg * len(segs))(*segs)
            t.seg, t.nseg = ctypes.addressof(self.seg), len(segs)
            self.dst = (_p * len(layout))()

    def go(self, W: torch.Tensor, src, g: torch.Tensor, out: torch.Tensor | None = None,
           fill: Fill | None = None, direct: torch.Tensor | None = None):
        """One scan: the recurrent weights ``W`` [NW·H, H] (transposed here), ``src`` (the factors f, or the RNN's
        states (h, x)), ∇h_T in ``g``, ``out`` [n, B, H] (mode 0), ``fill``: the factors' writer left to
        the team; ``direct``: the loss's direct gradients c [n, B, H] in scan order, c[k] entering after J_k
        (contiguous; a team built ``affine``), making the scan the affine recurrence out[k+1] = J_k out[k] + c[k].
        Returns the parameter gradients (mode 1: a dict of new tensors)."""
        c, t, dtype = self.call, self.t, self.dtype
        if direct is not None and not self.affine:
            raise ValueError("this team was built without affine=True: it cannot take per-step gradients")
        c.c = None if direct is None else direct.data_ptr()
        t.W, c.g = (W if W.is_contiguous() else W.contiguous()).data_ptr(), g.data_ptr()
        if isinstance(src, torch.Tensor):
            c.f, c.h, c.x = src.data_ptr(), None, None
        else:
            c.f, c.h, c.x = None, src[0].data_ptr(), src[1].data_ptr()
        c.out = None if out is None else out.data_ptr()
        if fill is not None:
            fill.units(t.pre, t.nthreads, self.lib)
        else:
            t.pre.n = 0
        grads = [torch.empty(shape, dtype=dtype) for shape in self.layout]
        if grads:
            self.dst[:] = [a.data_ptr() for a in grads]
        t.dst = ctypes.addressof(self.dst) if grads else None
        self.lib.team_drain(ctypes.byref(t))  # the last call's stragglers gone: its operands may go too
        # a thread held up by the host may still run a unit of this call when it returns (its result is dropped):
        # what it reads lives until the next call -- its memory only, not the autograd graph the tensors came from
        # (a layer's states carry their op's backward node, and through it the whole last step's graph)
        def bare(t):
            return t.detach() if isinstance(t, torch.Tensor) else tuple(bare(u) for u in t) if isinstance(t, tuple) \
                else t

        self.live = (bare(W), bare(src), bare(g), bare(direct), fill)
        if self.lib.team_go(ctypes.byref(t)):
            raise RuntimeError("the scan could not start its threads")
        return dict(zip(self.names, grads)) if self.mode else None

    def __del__(self, _byref=ctypes.byref):  # bound here: at exit the module's globals may be gone first
        lib = getattr(self, "lib", None)
        if lib is not None and getattr(self, "live", None) is not None:
            lib.team_drain(_byref(self.t))
