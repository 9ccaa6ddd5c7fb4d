"""NVRTC through ctypes: compile the kernel sources as CuPy would, with no GPU, driver or CuPy.

NVRTC is a plain library (the ``nvidia-cuda-nvrtc`` wheel, or a CUDA toolkit's ``libnvrtc``);
compiling needs neither a GPU nor a driver.  The tests use it to check, on any machine, what a
GPU run compiles: every ``.cu`` with CuPy's effective options (:func:`cupy_options`), the PTX
parameter lists, and ptxas's register, stack and spill report.  ``bppsa doctor`` uses it to
report whether the kernels compile where CuPy cannot be tried.

A compile's result (log, PTX, cubin) is kept under ``$BPPSA_CACHE_DIR/nvrtc``, keyed by the source, the options
and the NVRTC library (its path, size and time): the same inputs give the same output, and a compile of the
package's kernels takes ~1.5 s each on a 2-vCPU machine.  An entry whose digests do not match is compiled again.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ...process import cache_root
from .runtime import CUPY_APPENDED_OPTIONS, KERNEL_DIR, NVRTC_OPTIONS, define_options, reference_constants

# wheels that ship libnvrtc: CUDA 13's (nvidia/cu13/lib) first, then CUDA 12's (nvidia/cuda_nvrtc/lib)
WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12")
_LIB = re.compile(r"libnvrtc\.so\.\d+$")
_BUILTINS = re.compile(r"libnvrtc-builtins\.so\.[\d.]+$")


class NvrtcUnavailable(RuntimeError):
    pass


class CompileError(RuntimeError):
    pass


@dataclass(frozen=True)
class Result:
    log: str
    ptx: bytes | None
    cubin: bytes | None


def cupy_options(arch: int) -> tuple[str, ...]:
    """The options CuPy's RawModule compiles our sources with on a GPU of compute capability ``arch``."""
    return NVRTC_OPTIONS + tuple(o.format(arch=arch) for o in CUPY_APPENDED_OPTIONS)


def find_library() -> tuple[Path, Path | None]:
    """(libnvrtc, libnvrtc-builtins) from an installed NVRTC wheel; raises NvrtcUnavailable."""
    for dist in WHEELS:
        try:
            files = metadata.distribution(dist).files or []
        except metadata.PackageNotFoundError:
            continue
        lib = next((f for f in files if _LIB.search(f.name)), None)
        if lib is None:
            continue
        builtins = next((f for f in files if _BUILTINS.search(f.name)), None)
        return Path(lib.locate()), Path(builtins.locate()) if builtins else None
    raise NvrtcUnavailable(f"no NVRTC wheel installed ({' or '.join(WHEELS)}; pip install -e '.[test]' brings one)")


@functools.cache
def _load():
    lib, builtins = find_library()
    if builtins is not None:
        # libnvrtc dlopens its builtins by soname; without them preloaded it cannot find them
        # outside a CUDA toolkit's library path ("failed to open libnvrtc-builtins").
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    nv = ctypes.CDLL(str(lib))
    nv.nvrtcGetErrorString.restype = ctypes.c_char_p
    return nv


def version() -> tuple[int, int]:
    nv = _load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(nv, nv.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def library_path() -> str:
    return str(find_library()[0])


def _check(nv, rc: int, what: str) -> None:
    if rc != 0:
        raise CompileError(f"{what}: {nv.nvrtcGetErrorString(rc).decode()}")


def _get(nv, prog, size_fn, get_fn) -> bytes:
    n = ctypes.c_size_t()
    _check(nv, getattr(nv, size_fn)(prog, ctypes.byref(n)), size_fn)
    buf = ctypes.create_string_buffer(n.value)
    _check(nv, getattr(nv, get_fn)(prog, buf), get_fn)
    return buf.raw[: n.value]


def _cache_key(source: str, options: tuple[str, ...], name: str) -> str:
    lib = find_library()[0]
    st = lib.stat()
    ident = json.dumps([str(lib), st.st_size, st.st_mtime_ns, name, list(options), source])
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _digest(b: bytes | None) -> str | None:
    return None if b is None else hashlib.sha256(b).hexdigest()


def _cached(key: str) -> Result | None:
    """The cached result of ``key``, or None where there is none or it is damaged."""
    entry = cache_root() / "nvrtc" / f"{key}.json"
    try:
        meta = json.loads(entry.read_text())
        blobs = {k: (entry.with_suffix(f".{k}").read_bytes() if meta[k] is not None else None)
                 for k in ("ptx", "cubin")}
    except (OSError, ValueError, KeyError):
        return None
    if any(_digest(blobs[k]) != meta[k] for k in blobs):
        return None
    return Result(log=meta["log"], ptx=blobs["ptx"], cubin=blobs["cubin"])


def _store(key: str, res: Result) -> None:
    """Keep ``res`` under ``key``: the blobs first, the index (with their digests) last, each written whole."""
    d = cache_root() / "nvrtc"
    try:
        d.mkdir(parents=True, exist_ok=True)
        meta = {"log": res.log, "ptx": _digest(res.ptx), "cubin": _digest(res.cubin)}
        for suffix, data in (("ptx", res.ptx), ("cubin", res.cubin), ("json", json.dumps(meta).encode())):
            if data is None:
                continue
            fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{key}.")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, d / f"{key}.{suffix}")
    except OSError:
        pass  # a cache that cannot be written costs the next compile, nothing else


def compile_source(source: str, options: tuple[str, ...], name: str = "kernel.cu") -> Result:
    """Compile ``source`` (or take the cached result of the same inputs); PTX for ``-arch=compute_XX``, a cubin
    (and its ptxas log) for ``sm_XX``."""
    key = _cache_key(source, tuple(options), name)
    res = _cached(key)
    if res is None:
        res = _compile(source, options, name)
        _store(key, res)
    return res


def _compile(source: str, options: tuple[str, ...], name: str) -> Result:
    nv = _load()
    prog = ctypes.c_void_p()
    _check(nv, nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        rc = nv.nvrtcCompileProgram(prog, len(options), opts)
        log = _get(nv, prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog").rstrip(b"\0").decode(errors="replace")
        if rc != 0:
            raise CompileError(f"{name} with {' '.join(options)}: {nv.nvrtcGetErrorString(rc).decode()}\n{log}")
        ptx = _get(nv, prog, "nvrtcGetPTXSize", "nvrtcGetPTX")
        cubin = None
        if any(o.startswith("-arch=sm_") for o in options):
            cubin = _get(nv, prog, "nvrtcGetCUBINSize", "nvrtcGetCUBIN")
        return Result(log=log, ptx=ptx.rstrip(b"\0"), cubin=cubin)
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_kernel(source: str, arch: int, *extra: str, consts=None) -> Result:
    """One of the package's ``.cu`` files with CuPy's options for ``arch`` (and ``extra`` ones), and its compile-time
    constants ``consts`` as the runtime passes them (default: :func:`.runtime.reference_constants`)."""
    consts = reference_constants(source) if consts is None else consts
    defines = define_options(consts)
    options = NVRTC_OPTIONS + defines + cupy_options(arch)[len(NVRTC_OPTIONS):]  # as RawModule(options=ours + -D)
    return compile_source((KERNEL_DIR / source).read_text(), options + extra, source)


_ENTRY = re.compile(r"\.visible\s+\.entry\s+(\w+)\s*\(([^)]*)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+(?:\.ptr\s+\S+\s+)?(?:\.align\s+\d+\s+)?(\w+)")


def ptx_entries(ptx: bytes | str) -> dict[str, list[str]]:
    """Kernel name -> the PTX types of its parameters, in order (e.g. ['u64', 'u64', ...])."""
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    return {m.group(1): [p.group(1) for p in _PARAM.finditer(m.group(2))] for m in _ENTRY.finditer(text)}


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """Per kernel, from ``-Xptxas=-v``'s log: registers, stack frame and spill bytes (-1 where the log does not
    say), and static shared memory in bytes (``smem``: 0 where the log names none)."""
    out: dict[str, dict[str, int]] = {}
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", log):
        m = re.search(r"Compiling entry function '(\w+)'", block)
        if not m:
            continue
        stats = {"registers": r"Used (\d+) registers", "stack": r"(\d+) bytes stack frame",
                 "spill_stores": r"(\d+) bytes spill stores", "spill_loads": r"(\d+) bytes spill loads"}
        out[m.group(1)] = {k: int(x.group(1)) if (x := re.search(p, block)) else -1 for k, p in stats.items()}
        smem = re.search(r"(\d+) bytes smem", block)
        out[m.group(1)]["smem"] = int(smem.group(1)) if smem else 0
    return out
