"""The CUDA kernel sources run on the CPU: what ``tests/test_kernels.py`` drives with the launch plan.

The actual ``.cu`` files are compiled as host C++ with a thin shim (:data:`SHIM`): blocks run one after
the other, the threads of a block as real threads meeting at a ``std::barrier`` for ``__syncthreads``
(one set of threads per launch, reused block after block), dynamic shared memory NaN-poisoned (0xFF
bytes) with a guard band checked after every block (:data:`DRIVER`).  Global buffers (:class:`Buf`)
carry guard bands of :data:`SENTINEL` on both sides.

Warps: lanes are ``threadIdx.x % 32`` of a 1-D block.  ``__syncwarp`` and the ``__shfl*_sync`` family meet at a
per-warp rendezvous (:data:`WARP_SHIM`) with PTX's ``shfl.sync`` semantics: each lane in ``mask`` deposits its
value, and once every lane of ``mask`` that still runs has arrived, each reads its source lane (its own value
where the source falls outside its ``width`` segment).  Reading a lane that is outside ``mask``, exited or absent
(a block of 50 threads has no lanes 18-31 in its second warp) gives poison (0xFF bytes: NaN, or -1), as shared
memory does.  A lane calling with a mask that leaves itself out, lanes of one warp at rendezvous with different
masks, and a lane of ``mask`` that never arrives (divergence or deadlock on a GPU) are errors: the launch
returns non-zero and :func:`emulated_launch` / :func:`launch` fail naming the error instead of hanging.
:func:`emulated_scan` is ``CupyBackend.scan`` with the kernels run here: the same plan, the same buffers;
:func:`emulated_factored` is ``CupyFactoredBackend``'s factored path.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bppsa.backends.cuda import cost_model, plan, runtime
from bppsa.process import cache_root

KERNEL_NAMES = {
    "blelloch.cu": [f"bppsa_{k}_{s}" for k in ("up_sweep", "down_sweep", "middle_scan") for s in ("f32", "f64")],
    "rnn_jacobians.cu": [f"bppsa_rnn_jacobians_{k}_{s}" for k in ("paper", "fused") for s in ("f32", "f64")],
    "factored.cu": [f"bppsa_factored_{p}_{k}_{s}" for p in ("up_smem", "down") for k in ("rnn", "gru")
                    for s in ("f32", "f64")],
    # compiled per hidden size (plan.up_constants); at the reference H = 20 both dtypes' kernels exist
    "factored_up.cu": [f"bppsa_factored_up_{k}_{s}" for k in ("rnn", "gru") for s in ("f32", "f64")],
    "factored_warp.cu": ["bppsa_factored_middle_f32", "bppsa_factored_middle_f64"]
    + [f"bppsa_factored_down_warp_{k}_{s}" for k in ("rnn", "gru") for s in ("f32", "f64")],
}
KERNEL_NAMES["factored.cu"] += ["bppsa_factored_grads_f32", "bppsa_factored_grads_f64", "bppsa_gru_factors_f32",
                                 "bppsa_gru_factors_f64"]


def kernels_for(source: str, consts) -> list[str]:
    """The kernels ``source`` defines when compiled with ``consts`` (factored_up.cu: none for a dtype whose columns
    do not fit, BPPSA_NC32 / BPPSA_NC64 = 0; factored_warp.cu: the down kernels of BPPSA_DOWN_WARP's bits)."""
    values = dict(consts)
    names = KERNEL_NAMES[source]
    if source == "factored_up.cu":
        return [n for n in names if values["BPPSA_NC" + ("32" if n.endswith("f32") else "64")] > 0]
    if source == "factored_warp.cu":
        bits = {("rnn", "f32"): 1, ("rnn", "f64"): 2, ("gru", "f32"): 4, ("gru", "f64"): 8}
        return [n for n in names if "_down_warp_" not in n
                or values["BPPSA_DOWN_WARP"] & bits[(n.split("_")[-2], n.split("_")[-1])]]
    return list(names)


SHIM = r"""
#include <barrier>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
struct emu_uint3 { unsigned x, y, z; };
static thread_local emu_uint3 threadIdx;
static emu_uint3 blockIdx, blockDim, gridDim;
static std::barrier<>* emu_barrier;
static unsigned char* emu_smem;
#define BPPSA_SMEM emu_smem
#define __global__
#define __device__
#define __syncthreads() emu_barrier->arrive_and_wait()
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
""" + r"""
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <type_traits>
static const int warpSize = 32;
// A failure that must not hang the launch: recorded once, reported by emu_run's return code.
static std::atomic<int> emu_failed{0};
static char emu_message[512];
static void emu_fail(const char* what, unsigned warp, unsigned lane, unsigned mask, unsigned other) {
  int expected = 0;
  if (emu_failed.compare_exchange_strong(expected, 1))
    std::snprintf(emu_message, sizeof emu_message, "%s (block %u, warp %u, lane %u, mask 0x%08x, other 0x%08x)",
                  what, blockIdx.x, warp, lane, mask, other);
}
// One warp's rendezvous: lanes of `mask` deposit 8 bytes each; the round completes when every lane of the
// mask that still runs (`live`) has arrived; they read the deposits, and the last to leave resets the round.
struct EmuWarp {
  std::mutex m;
  std::condition_variable cv;
  unsigned live = 0;      // lanes that exist in this block and have not returned
  unsigned mask = 0;      // the current round's mask
  unsigned arrived = 0;   // lanes that deposited in the current round
  unsigned leaving = 0;   // lanes that have read the current round's deposits
  bool reading = false;   // the round is complete: its lanes are reading
  unsigned char val[32][8];
};
static EmuWarp* emu_warps;
static std::chrono::milliseconds EMU_WARP_TIMEOUT{20000};
extern "C" void emu_set_warp_timeout_ms(long long ms) { EMU_WARP_TIMEOUT = std::chrono::milliseconds(ms); }
// Deposit `bytes` (size <= 8) for this lane; returns the round's deposits in `out` and the lanes that deposited.
static unsigned emu_rendezvous(unsigned mask, const void* bytes, unsigned size, unsigned char (*out)[8]) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, me = 1u << lane;
  EmuWarp& w = emu_warps[warp];
  std::unique_lock<std::mutex> lk(w.m);
  if (!(mask & me)) emu_fail("a lane called a warp primitive with a mask that leaves itself out", warp, lane, mask, 0);
  mask |= me;
  // a lane may run ahead into the next round only after the previous one has been read by all its lanes
  if (!w.cv.wait_for(lk, EMU_WARP_TIMEOUT, [&] { return !w.reading; })) {
    emu_fail("warp rendezvous: the previous round never drained", warp, lane, mask, w.mask);
    w.reading = false;
  }
  if (w.arrived == 0) {
    w.mask = mask;
  } else if (w.mask != mask) {
    emu_fail("lanes of one warp met at a warp primitive with different masks", warp, lane, mask, w.mask);
    w.mask |= mask;
  }
  std::memset(w.val[lane], 0xFF, 8);
  if (size) std::memcpy(w.val[lane], bytes, size);
  w.arrived |= me;
  auto complete = [&] { return (w.mask & w.live & ~w.arrived) == 0; };
  if (complete()) {
    w.reading = true;
    w.cv.notify_all();
  } else if (!w.cv.wait_for(lk, EMU_WARP_TIMEOUT, [&] { return w.reading; })) {
    emu_fail("lanes of the mask never reached the warp primitive (divergence or deadlock on a GPU)", warp, lane,
             w.mask, w.mask & w.live & ~w.arrived);
    w.reading = true;
    w.cv.notify_all();
  }
  const unsigned present = w.arrived;
  for (unsigned l = 0; l < 32; ++l) {
    if (present >> l & 1) std::memcpy(out[l], w.val[l], 8);
    else std::memset(out[l], 0xFF, 8);
  }
  w.leaving |= me;
  if (w.leaving == w.arrived) {  // the last reader resets the round
    w.arrived = w.leaving = 0;
    w.mask = 0;
    w.reading = false;
    w.cv.notify_all();
  }
  return present;
}
// A returning thread leaves its warp: a round waiting only for it completes without it.
static void emu_lane_exit() {
  const unsigned lane = threadIdx.x % 32;
  EmuWarp& w = emu_warps[threadIdx.x / 32];
  std::lock_guard<std::mutex> lk(w.m);
  w.live &= ~(1u << lane);
  if (w.arrived && !w.reading && (w.mask & w.live & ~w.arrived) == 0) w.reading = true;
  w.cv.notify_all();
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
  unsigned char vals[32][8];
  emu_rendezvous(mask, nullptr, 0, vals);
}
// PTX shfl.sync: c = (segmask << 8) | clamp; maxLane = (lane & segmask) | (clamp & ~segmask), minLane = lane & segmask.
enum EmuShfl { EMU_IDX, EMU_UP, EMU_DOWN, EMU_BFLY };
template <typename T>
static T emu_shfl(unsigned mask, T var, int b, int width, EmuShfl mode) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type wider than 8 bytes");
  const int lane = threadIdx.x % 32;
  unsigned char vals[32][8];
  const unsigned present = emu_rendezvous(mask, &var, sizeof(T), vals);
  const int seg = (32 - width) & 31, clamp = mode == EMU_UP ? 0 : 31;
  const int maxLane = (lane & seg) | (clamp & ~seg), minLane = lane & seg, bv = b & 31;
  int j;
  bool ok;
  switch (mode) {
    case EMU_UP: j = lane - bv; ok = j >= maxLane; break;
    case EMU_DOWN: j = lane + bv; ok = j <= maxLane; break;
    case EMU_BFLY: j = lane ^ bv; ok = j <= maxLane; break;
    default: j = minLane | (bv & ~seg); ok = j <= maxLane; break;
  }
  if (!ok) j = lane;
  T out;
  std::memcpy(&out, vals[j], sizeof(T));
  (void)present;
  return out;
}
template <typename T> static T __shfl_sync(unsigned mask, T var, int src, int width = 32) {
  return emu_shfl(mask, var, src, width, EMU_IDX);
}
template <typename T> static T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return emu_shfl(mask, var, (int)delta, width, EMU_UP);
}
template <typename T> static T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return emu_shfl(mask, var, (int)delta, width, EMU_DOWN);
}
template <typename T> static T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return emu_shfl(mask, var, lane_mask, width, EMU_BFLY);
}
"""

DRIVER = r"""
static const size_t EMU_GUARD = 256;
// Shared memory starts as 0xFF bytes (NaN in either dtype), so reading anything a block did not
// stage poisons its result; bytes past the requested size must still be 0xFF afterwards.
// The block's threads live for the whole launch and run the blocks one after the other: `gate` releases
// them into a block and collects them after it.  Each block gets a fresh barrier for __syncthreads,
// which a thread leaves (arrive_and_drop) when it returns, like an exited GPU thread.
template <typename... A>
static int emu_run(void (*fn)(A...), unsigned grid, unsigned block, unsigned long long smem, A... args) {
  std::vector<unsigned char> buf(smem + EMU_GUARD);
  emu_smem = buf.data();
  blockDim = {block, 1, 1};
  gridDim = {grid, 1, 1};
  std::barrier<> gate(block + 1);
  std::unique_ptr<std::barrier<>> bar;
  bool done = false;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < block; ++t)
    threads.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      for (;;) {
        gate.arrive_and_wait();  // into the next block, or told to stop
        if (done) return;
        fn(args...);
        emu_lane_exit();
        emu_barrier->arrive_and_drop();
        gate.arrive_and_wait();  // the block is over
      }
    });
  int rc = 0;
  emu_failed = 0;
  std::vector<EmuWarp> warps((block + 31) / 32);
  emu_warps = warps.data();
  for (unsigned bx = 0; bx < grid && rc == 0; ++bx) {
    std::memset(buf.data(), 0xFF, buf.size());
    blockIdx = {bx, 0, 0};
    for (unsigned wi = 0; wi < warps.size(); ++wi) {
      const unsigned lanes = block - 32 * wi < 32 ? block - 32 * wi : 32;
      warps[wi].live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
      warps[wi].mask = warps[wi].arrived = warps[wi].leaving = 0;
      warps[wi].reading = false;
    }
    bar = std::make_unique<std::barrier<>>(block);
    emu_barrier = bar.get();
    gate.arrive_and_wait();  // start the block
    gate.arrive_and_wait();  // and wait for its end
    for (size_t i = smem; i < buf.size(); ++i)
      if (buf[i] != 0xFF) rc = 1;
    if (emu_failed) rc = 2;
  }
  done = true;
  gate.arrive_and_wait();
  for (auto& th : threads) th.join();
  return rc;
}
extern "C" const char* emu_error() { return emu_message; }
template <typename F> struct Emu;
template <typename... A> struct Emu<void (*)(A...)> {
  template <void (*Fn)(A...)>
  static int run(unsigned g, unsigned b, unsigned long long s, A... a) { return emu_run<A...>(Fn, g, b, s, a...); }
};
"""


_FLAGS = ["-std=c++20", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-pthread"]


@functools.cache
def _compiler_id() -> str:
    return subprocess.run(["g++", "--version"], capture_output=True, text=True, timeout=60).stdout


@functools.cache
def _std_header() -> list[str]:
    """``-include`` of the shim's standard headers, precompiled once per flags and compiler into the cache (their
    parse is ~0.35 s of every build: 0.87 s -> 0.52 s for a factored_up library).  Every build still includes them
    itself, so a precompiled header g++ cannot use (``g++ -Winvalid-pch`` would say why) leaves the same translation
    unit, only slower; and where the header does not compile, no ``-include``."""
    text = "".join(sorted({ln + "\n" for ln in (SHIM + DRIVER).splitlines() if ln.startswith("#include <")}))
    key = hashlib.sha256("\0".join([text, *_FLAGS, _compiler_id()]).encode()).hexdigest()[:20]
    folder = cache_root() / "emulator" / f"std_{key}"
    header = folder / "emu_std.h"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "emu_std.h.gch").exists():
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                gch = Path(tmp) / "emu_std.h.gch"
                (Path(tmp) / "emu_std.h").write_text(text)
                flags = [f for f in _FLAGS if f != "-shared"]
                proc = subprocess.run(["g++", *flags, "-x", "c++-header", "-o", str(gch), str(Path(tmp) / "emu_std.h")],
                                      capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    return []
                header.write_text(text)
                os.replace(gch, folder / "emu_std.h.gch")
    return ["-include", str(header)]


def _build(sources: str, names: list[str], stem: str):
    """``sources`` (CUDA C++) with the shim and driver as one shared library, each kernel ``k`` of ``names`` exported
    as ``emu_k``; skips the test where there is no g++.  Built once per text, flags and compiler into the package's
    cache (``$BPPSA_CACHE_DIR/emulator``, beside the CPU kernels), which every file and worker of a suite, and the
    suites after it, share: a second builder waits on the first's lock, and a build is renamed into place whole."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH: cannot emulate the kernels on the CPU")
    exports = "\n".join(
        f'extern "C" {{ auto emu_{n} = &Emu<decltype(&{n})>::template run<&{n}>; }}' for n in names
    )
    text = SHIM + sources + DRIVER + exports
    key = hashlib.sha256("\0".join([text, *_FLAGS, _compiler_id()]).encode()).hexdigest()[:20]
    folder = cache_root() / "emulator"
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / f"{stem}_{key}.so"
    with open(lib.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src, out = Path(tmp) / f"{stem}.cpp", Path(tmp) / f"{stem}.so"
                src.write_text(text)
                proc = subprocess.run(["g++", *_FLAGS, *_std_header(), "-o", str(out), str(src)], capture_output=True,
                                      text=True, timeout=300)
                assert proc.returncode == 0, proc.stderr[-4000:]
                os.replace(out, lib)
    return ctypes.CDLL(str(lib))


@functools.cache
def build_emulator():
    """The package's kernel sources as one shared library (once per process): each kernel ``k`` is exported as
    ``emu_k``, which :func:`emulated_launch` calls."""
    sources = [s for s in runtime.SOURCES if not runtime.reference_constants(s)]
    names = [n for src in sources for n in KERNEL_NAMES[src]]
    # Each source is its own module on the GPU; here they share one translation unit, which works
    # because they define disjoint names (and typedef idx_t identically, which C++ allows).  The sources compiled
    # per constants (factored_up.cu) are built per constants by :func:`build_with_constants`.
    body = "".join((runtime.KERNEL_DIR / s).read_text() + "\n" for s in sources)
    return _build(body, names, "emu")


@functools.cache
def build_with_constants(source: str, consts: tuple, text: str | None = None):
    """``source`` compiled with its compile-time constants ``consts`` (the ``#define`` lines NVRTC's ``-D`` gives),
    as its own library; exports the kernels that exist for these constants (factored_up.cu: a dtype whose
    BPPSA_NC32 / BPPSA_NC64 is 0 has none).  ``text``: the source's text instead of the file's (a mutant)."""
    names = kernels_for(source, consts)
    defines = "".join(f"#define {k} {int(v)}\n" for k, v in consts)
    text = (runtime.KERNEL_DIR / source).read_text() if text is None else text
    return _build(defines + text, names, "c_" + Path(source).stem)


def library_for(lib, step):
    """The library that runs ``step``: ``lib`` (:func:`build_emulator`), or for a launch with compile-time constants
    its source built with them."""
    if not step.consts:
        return lib
    return build_with_constants(plan.factored_source(step), step.consts)


@functools.cache
def build_source(source: str, names: tuple[str, ...]):
    """A CUDA source of the tests' own (extern "C" kernels ``names``) built like :func:`build_emulator`."""
    return _build(source, list(names), "src")


def _check_rc(lib, rc: int, name: str, smem: int) -> None:
    if rc == 2:
        raise AssertionError(f"{name}: {lib.emu_error().decode()}")
    assert rc == 0, f"{name} wrote past its {smem} bytes of dynamic shared memory"


def launch(lib, name: str, grid: int, block: int, smem: int, *args):
    """Launch kernel ``name`` of a library of :func:`build_source`; ``args`` are ctypes values (c_void_p for
    pointers, c_longlong, c_int, c_float, ...) in the kernel's parameter order."""
    lib.emu_error.restype = ctypes.c_char_p
    addr = ctypes.c_void_p.in_dll(lib, f"emu_{name}").value
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_ulonglong, *(type(a) for a in args))
    _check_rc(lib, proto(addr)(grid, block, smem, *args), name, smem)


SENTINEL = 1234.5  # in the guard bands around every global buffer: must stay, must never be read


class Buf:
    """A global-memory buffer with guard bands on both sides."""

    G = 64

    def __init__(self, arr: np.ndarray):
        self.shape = arr.shape
        self.sentinel = np.array(SENTINEL if arr.dtype.kind == "f" else -12345).astype(arr.dtype)  # int32: the map
        self.flat = np.full(arr.size + 2 * self.G, self.sentinel, dtype=arr.dtype)
        self.flat[self.G : self.G + arr.size] = arr.ravel()

    @property
    def ptr(self) -> int:
        return self.flat.ctypes.data + self.G * self.flat.itemsize

    def value(self) -> np.ndarray:
        guards = np.concatenate([self.flat[: self.G], self.flat[-self.G :]])
        assert (guards == self.sentinel).all(), "write out of bounds"
        return self.flat[self.G : -self.G].reshape(self.shape).copy()


def emulated_launch(lib, step, dtype, bufs):
    """Run the plan's launch ``step`` for numpy ``dtype`` on the global buffers ``bufs`` (:class:`Buf`)."""
    name = f"{step.kernel}_{'f32' if dtype == np.float32 else 'f64'}"
    addr = ctypes.c_void_p.in_dll(lib, f"emu_{name}").value
    proto = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_ulonglong,
        *([ctypes.c_void_p] * len(bufs)), *([ctypes.c_longlong] * len(step.ints)),
    )
    smem = step.smem_elems * np.dtype(dtype).itemsize
    rc = proto(addr)(step.grid, step.block, smem, *(b.ptr for b in bufs), *step.ints)
    lib.emu_error.restype = ctypes.c_char_p
    _check_rc(lib, rc, name, smem)


def emulated_scan(lib, g: np.ndarray, J: np.ndarray, L_m):
    """CupyBackend.scan with the kernels run by the emulator: same plan, same buffers."""
    n, B, H, _ = J.shape
    L, launches = plan.scan_plan(n + 1, B, H, L_m)
    S = np.full((L + 1, B, H), np.nan, dtype=g.dtype)
    S[0] = g
    bufs = [Buf(J), Buf(S), Buf(np.full((n, B, H), np.nan, dtype=g.dtype))]
    for step in launches:
        emulated_launch(lib, step, g.dtype.type, bufs)
    return bufs[2].value(), bufs[0].value()


def emulated_factored(lib, chain, g: np.ndarray, C: int | None = None, grads: bool = False, L_m=None,
                      c: np.ndarray | None = None, warps: int | None = None):
    """CupyFactoredBackend's factored path with the kernels run by the emulator: the same plan
    (:func:`bppsa.backends.cuda.plan.factored_plan`), the same buffers, each with guard bands.

    ``chain``: an RnnChain or GruChain (CPU tensors); ``c`` [n, B, H]: the affine scan's per-step gradients; ``warps``:
    the middle phase's warps (None: the cost model's choice).
    Returns the scan's output P [n, B, H] (``grads`` False, or a chain without x), else the flat parameter gradients
    (:func:`bppsa.backends.cuda.plan.grad_index`; ``plan.grad_views`` gives them per parameter), and the chunk size."""
    n, B, H, _ = chain.shape
    dt = g.dtype
    C, launches = cost_model.factored_plan(chain.kind, n, B, H, chain.I, C, grads=grads, L_m=L_m,
                                           itemsize=dt.itemsize, affine=c is not None, warps=warps)
    shapes = plan.factored_buffers(chain.kind, n, B, H, chain.I, C, launches, L_m)
    arrs = {name: np.full(shape, np.nan, dtype=dt) for name, shape in shapes.items() if shape is not None}
    if shapes["carries"][0] == 1:
        arrs["carries"] = g[None].copy()  # one chunk: the down launch alone, from g
    elif "S" not in arrs:
        arrs["carries"][0] = g  # the affine scan's carry kernel starts from g
    if "S" in arrs:
        arrs["S"][0] = g  # the middle scan's spine starts from g
    if "gmap" in arrs:
        arrs["gmap"] = np.array(plan.grad_index(chain.grad_layout(), chain.I + 1 + H)[0], dtype=np.int32)
    # the backend's own buffers (plan.factored_buffers/factored_operands), each with guard bands; where the GPU
    # passes a one-element stand-in, an empty one: a kernel that wrote it fails the guard check
    bufs = {name: Buf(a) for name, a in arrs.items()}
    bufs.update({name: None for name, shape in shapes.items() if shape is None})
    bufs.update(Wt=Buf(chain.Wt.numpy().astype(dt)), f=Buf(chain.f.numpy().astype(dt)),
                c=None if c is None else Buf(c.astype(dt)), unused=Buf(np.zeros(0, dtype=dt)))
    for step in launches:
        emulated_launch(library_for(lib, step), step, dt.type, list(plan.factored_operands(step, bufs)))
    for b in bufs.values():
        if b is not None:
            b.value()  # every guard band intact, the stand-in's included
    return (bufs["grads"] if shapes["P"] is None else bufs["P"]).value(), C


def backend_or_skip(cls_name: str):
    """``bppsa.backends.cuda.<cls_name>()`` on the GPU, or skip the test saying why it cannot run here."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"cupy not importable: {exc}")
    from bppsa.backends import cuda

    return getattr(cuda, cls_name)()
