"""The CUDA kernel sources run on the CPU: what ``tests/test_kernels.py`` drives with the launch plan.

The actual ``.cu`` files are compiled as host C++ with a thin shim (:data:`SHIM`): blocks run one after
the other, the threads of a block as real threads meeting at a ``std::barrier`` for ``__syncthreads``
(one set of threads per launch, reused block after block), dynamic shared memory NaN-poisoned (0xFF
bytes) with a guard band checked after every block (:data:`DRIVER`).  Global buffers (:class:`Buf`)
carry guard bands of :data:`SENTINEL` on both sides.
:func:`emulated_scan` is ``CupyBackend.scan`` with the kernels run here: the same plan, the same buffers;
:func:`emulated_factored` is ``CupyFactoredBackend``'s factored path.
"""
from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bppsa.backends.cuda import plan, runtime
from bppsa.scan import tree_levels

KERNEL_NAMES = {
    "blelloch.cu": [f"bppsa_{k}_{s}" for k in ("up_sweep", "down_sweep", "middle_scan") for s in ("f32", "f64")],
    "rnn_jacobians.cu": [f"bppsa_rnn_jacobians_{k}_{s}" for k in ("paper", "fused") for s in ("f32", "f64")],
    "factored.cu": [f"bppsa_factored_{p}_{k}_{s}" for p in ("up", "down") for k in ("rnn", "gru")
                    for s in ("f32", "f64")],
}


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
        emu_barrier->arrive_and_drop();
        gate.arrive_and_wait();  // the block is over
      }
    });
  int rc = 0;
  for (unsigned bx = 0; bx < grid && rc == 0; ++bx) {
    std::memset(buf.data(), 0xFF, buf.size());
    blockIdx = {bx, 0, 0};
    bar = std::make_unique<std::barrier<>>(block);
    emu_barrier = bar.get();
    gate.arrive_and_wait();  // start the block
    gate.arrive_and_wait();  // and wait for its end
    for (size_t i = smem; i < buf.size(); ++i)
      if (buf[i] != 0xFF) rc = 1;
  }
  done = true;
  gate.arrive_and_wait();
  for (auto& th : threads) th.join();
  return rc;
}
template <typename F> struct Emu;
template <typename... A> struct Emu<void (*)(A...)> {
  template <void (*Fn)(A...)>
  static int run(unsigned g, unsigned b, unsigned long long s, A... a) { return emu_run<A...>(Fn, g, b, s, a...); }
};
"""


@functools.cache
def build_emulator(build_dir: str):
    """The kernel sources, shim and driver as one shared library built in ``build_dir`` (once per process): each
    kernel ``k`` is exported as ``emu_k``, which :func:`emulated_launch` calls; skips the test where there is no g++."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH: cannot emulate the kernels on the CPU")
    names = [n for src in runtime.SOURCES for n in KERNEL_NAMES[src]]
    exports = "\n".join(
        f'extern "C" {{ auto emu_{n} = &Emu<decltype(&{n})>::template run<&{n}>; }}' for n in names
    )
    # Each source is its own module on the GPU; here they share one translation unit, which works
    # because they define disjoint names (and typedef idx_t identically, which C++ allows).
    body = SHIM + "".join((runtime.KERNEL_DIR / s).read_text() + "\n" for s in runtime.SOURCES) + DRIVER + exports
    src = Path(build_dir) / "emu.cpp"
    src.write_text(body)
    lib = Path(build_dir) / "emu.so"
    proc = subprocess.run(
        ["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-pthread", "-o", str(lib), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(lib))


SENTINEL = 1234.5  # in the guard bands around every global buffer: must stay, must never be read


class Buf:
    """A global-memory buffer with guard bands on both sides."""

    G = 64

    def __init__(self, arr: np.ndarray):
        self.shape = arr.shape
        self.flat = np.full(arr.size + 2 * self.G, SENTINEL, dtype=arr.dtype)
        self.flat[self.G : self.G + arr.size] = arr.ravel()

    @property
    def ptr(self) -> int:
        return self.flat.ctypes.data + self.G * self.flat.itemsize

    def value(self) -> np.ndarray:
        guards = np.concatenate([self.flat[: self.G], self.flat[-self.G :]])
        assert (guards == SENTINEL).all(), "write out of bounds"
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
    assert rc == 0, f"{name} wrote past its {smem} bytes of dynamic shared memory"


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


def emulated_factored(lib, chain, g: np.ndarray, C: int | None = None, grads: bool = False, L_m=None):
    """CupyFactoredBackend's factored path with the kernels run by the emulator: the same plan
    (:func:`bppsa.backends.cuda.plan.factored_plan`), the same buffers, each with guard bands.

    ``chain``: an RnnChain or GruChain (CPU tensors).  Returns the scan's output P [n, B, H] (``grads`` False,
    or a chain without x), else the summed parameter-gradient sums [NA, I + 1 + H] (what ``chain.param_grads``
    takes), and the chunk size used."""
    n, B, H, _ = chain.shape
    dt = g.dtype
    Wt, f = chain.Wt.numpy().astype(dt), chain.f.numpy().astype(dt)
    C, launches = plan.factored_plan(chain.kind, n, B, H, chain.I, C, grads=grads, L_m=L_m)
    K = -(-n // C)
    mode = launches[-1].kernel == "torch.sum"
    NA, NBV = (H if chain.kind == "rnn" else 4 * H), chain.I + 1 + H
    wt_b, f_b = Buf(Wt), Buf(f)
    agg = Buf(np.full((K, B, H, H), np.nan, dtype=dt))
    carries = Buf(np.full((K, B, H), np.nan, dtype=dt) if K > 1 else g[None].copy())
    P = Buf(np.full((n, B, H), np.nan, dtype=dt) if not mode else np.zeros(0, dtype=dt))
    accs = Buf(np.full((K * B, NA, NBV), np.nan, dtype=dt) if mode else np.zeros(0, dtype=dt))
    middle = [x for x in launches if plan.factored_source(x) == "blelloch.cu"]
    S = None
    if middle:
        S = np.full((tree_levels(K + 1, L_m) + 1, B, H), np.nan, dtype=dt)
        S[0] = g
        S = Buf(S)
    total = None
    for step in launches:
        src = plan.factored_source(step)
        if src is None:
            total = accs.value().sum(0)
        elif src == "blelloch.cu":
            emulated_launch(lib, step, dt.type, [agg, S, carries])
        elif "_up_" in step.kernel:
            emulated_launch(lib, step, dt.type, [wt_b, f_b, agg])
        else:
            emulated_launch(lib, step, dt.type, [wt_b, f_b, carries, P, accs])
    return (total if mode else P.value()), C


def backend_or_skip(cls_name: str):
    """``bppsa.backends.cuda.<cls_name>()`` on the GPU, or skip the test saying why it cannot run here."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"cupy not importable: {exc}")
    from bppsa.backends import cuda

    return getattr(cuda, cls_name)()
