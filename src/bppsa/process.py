"""Process settings the CPU fast path needs, applied before torch loads its OpenMP runtime.

:func:`openmp_policy` runs when :mod:`bppsa` is imported (so for a library user, the tests and every ``bppsa``
command alike): after each parallel region torch's OpenMP workers spin-wait for the next one (GNU libgomp:
300,000 rounds by default; Intel's and LLVM's runtimes: 200 ms), holding cores the fast path's own team of
threads needs (measured: docs/measurements.md, "Measurements the code cites").  A short spin removes it.
The runtimes read these variables once, when they load: where torch was imported before bppsa, they come too late and
:func:`openmp_report` (``bppsa doctor``) says so.  A value the user set wins.

:func:`keep_large_blocks` (the ``bppsa`` commands only) tunes glibc's allocator for the benchmarks.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_root() -> Path:
    """Where the package keeps what it builds (CPU kernels, NVRTC results): ``$BPPSA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/bppsa`` (default ``~/.cache/bppsa``)."""
    root = os.environ.get("BPPSA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "bppsa")
    return Path(root)


# GNU OpenMP (torch's Linux wheels): spin rounds before sleeping; Intel/LLVM OpenMP: milliseconds before sleeping.
OPENMP_WAIT = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "0"}
_applied: dict = {}


def openmp_policy() -> None:
    """Set :data:`OPENMP_WAIT` where the user has not (once; records whether torch had loaded already)."""
    if _applied:
        return
    _applied["torch_loaded_first"] = "torch" in sys.modules
    for name, value in OPENMP_WAIT.items():
        if name in os.environ:
            _applied[name] = (os.environ[name], "set by the user")
        else:
            os.environ[name] = value
            _applied[name] = (value, "set by bppsa")


def openmp_runtime() -> str | None:
    """The OpenMP runtime this process has loaded (its file), from the process's memory map; None if none/unknown."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    hits = sorted(p for p in libs if any(k in os.path.basename(p) for k in ("libgomp", "libiomp", "libomp")))
    return hits[0] if hits else None


def openmp_report() -> dict:
    """What :func:`openmp_policy` set, the runtime loaded, and whether the settings took effect."""
    rt = openmp_runtime()
    name = os.path.basename(rt) if rt else None
    var = "GOMP_SPINCOUNT" if name and "gomp" in name else "KMP_BLOCKTIME" if name else None
    value, who = _applied.get(var, (os.environ.get(var), "set by the user")) if var else (None, None)
    late = bool(_applied.get("torch_loaded_first")) and who == "set by bppsa"
    return {"runtime": rt, "variable": var, "value": value, "set_by": who, "effective": bool(var) and not late,
            "note": ("torch was imported before bppsa, so its OpenMP runtime had already read its settings: import "
                     "bppsa first, or set the variable in the environment") if late else ""}


def keep_large_blocks() -> None:
    """Let glibc keep freed blocks of up to 32 MiB in the heap instead of returning them to the kernel.

    By default a block above ~128 KiB-32 MiB (a dynamic threshold) is mmap'd and unmapped on free, so a
    tensor of that size made every iteration is page-faulted and zeroed anew (measured: docs/measurements.md,
    "Measurements the code cites").  Every method in a process gets the same allocator, so comparisons stay
    fair."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(M_TOP_PAD, 64 << 20)
    except (OSError, AttributeError):  # not glibc: its allocator's defaults
        pass
