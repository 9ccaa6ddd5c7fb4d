"""The CPU emulator's warp primitives (``tests/cuda_emulator.py``): ``__shfl_sync``, ``__shfl_up_sync``,
``__shfl_down_sync``, ``__shfl_xor_sync`` and ``__syncwarp``, held to the CUDA Programming Guide's definitions
(written out here in Python, independently of the shim's PTX formulation), across ``width`` segments, partial
warps, several warps and blocks, and the element types a kernel shuffles; and the errors a GPU would hang or
misbehave on (a lane of the mask that never arrives, a mask leaving the caller out, mismatched masks) reported
instead of hanging.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_emulator import build_source, launch

SOURCE = r"""
typedef long long idx_t;
template <typename T>
__device__ T shfl(idx_t op, T v, int b, int width) {
  switch (op) {
    case 0: return __shfl_sync(0xffffffffu, v, b, width);
    case 1: return __shfl_up_sync(0xffffffffu, v, (unsigned)b, width);
    case 2: return __shfl_down_sync(0xffffffffu, v, (unsigned)b, width);
    default: return __shfl_xor_sync(0xffffffffu, v, b, width);
  }
}
// out[b][t] = the shuffle `op` of in[t] with operand b = 0 .. 31, every thread of the grid (t = global index).
#define SHFL_KERNEL(T, NAME)                                                                         \
  extern "C" __global__ void NAME(const T* in, T* out, idx_t op, idx_t width, idx_t n) {             \
    const idx_t t = (idx_t)blockIdx.x * blockDim.x + threadIdx.x;                                    \
    for (int b = 0; b < 32; ++b) out[b * n + t] = shfl<T>(op, in[t], b, (int)width);                \
  }
SHFL_KERNEL(int, shfl_i32)
SHFL_KERNEL(long long, shfl_i64)
SHFL_KERNEL(float, shfl_f32)
SHFL_KERNEL(double, shfl_f64)

// The butterfly sum every lane ends with, in registers only.
extern "C" __global__ void warp_sum(const long long* in, long long* out) {
  long long v = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

// Each lane writes its slot of shared memory, the warp meets at __syncwarp, each reads its neighbour's slot
// (round after round, so a lane running ahead into the next round would overwrite what a slow one still reads).
extern "C" __global__ void syncwarp_neighbours(const double* in, double* out, idx_t rounds) {
  double* sm = reinterpret_cast<double*>(BPPSA_SMEM);
  const unsigned lane = threadIdx.x % 32, base = threadIdx.x - lane;
  double v = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (idx_t r = 0; r < rounds; ++r) {
    sm[threadIdx.x] = v;
    __syncwarp();
    v = v + sm[base + (lane + 1) % 32];
    __syncwarp();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

// Only the low half-warp takes part (mask 0xffff); the high half never calls a warp primitive.
extern "C" __global__ void half_warp(const float* in, float* out) {
  const unsigned lane = threadIdx.x % 32;
  float v = in[threadIdx.x];
  if (lane < 16) {
    __syncwarp(0xffffu);
    v = __shfl_down_sync(0xffffu, v, 1, 16);
  }
  out[threadIdx.x] = v;
}

// Reading a lane outside the mask: the value is undefined on a GPU, poison here.
extern "C" __global__ void read_outside_mask(const float* in, float* out) {
  const unsigned lane = threadIdx.x % 32;
  float v = in[threadIdx.x];
  if (lane < 16) v = __shfl_sync(0xffffu, v, 20);
  out[threadIdx.x] = v;
}

// Lane 0 waits at the block barrier while the others wait for it at a full-mask shuffle: a GPU hangs.
extern "C" __global__ void divergent_deadlock(float* out) {
  float v = (float)threadIdx.x;
  if (threadIdx.x % 32 != 0) v = __shfl_down_sync(0xffffffffu, v, 1);
  __syncthreads();
  out[threadIdx.x] = v;
}

extern "C" __global__ void mask_without_caller(float* out) {
  out[threadIdx.x] = __shfl_sync(0xfffffffeu, (float)threadIdx.x, 0);
}

// Lanes 0 and 1 each wait for the other, under different masks (whichever arrives first, neither round can
// complete without the other lane); the rest of the warp returns.
extern "C" __global__ void mismatched_masks(float* out) {
  const unsigned lane = threadIdx.x % 32;
  if (lane == 0) __syncwarp(0x3u);
  else if (lane == 1) __syncwarp(0xffffffffu);
  out[threadIdx.x] = (float)lane;
}
"""
NAMES = ("shfl_i32", "shfl_i64", "shfl_f32", "shfl_f64", "warp_sum", "syncwarp_neighbours", "half_warp",
         "read_outside_mask", "divergent_deadlock", "mask_without_caller", "mismatched_masks")
OPS = {"idx": 0, "up": 1, "down": 2, "xor": 3}
DTYPES = {np.int32: "shfl_i32", np.int64: "shfl_i64", np.float32: "shfl_f32", np.float64: "shfl_f64"}


@pytest.fixture(scope="module")
def lib():
    return build_source(SOURCE, NAMES)


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def source_lane(op: str, lane: int, b: int, width: int) -> int:
    """The lane whose value ``lane`` receives, as the CUDA Programming Guide defines each shuffle: lanes form
    segments of ``width``; idx reads lane ``b mod width`` of its own segment; up and down read ``lane -/+ b`` unless
    that leaves the segment (then their own value); xor reads ``lane ^ b`` unless that is in a later segment."""
    seg = lane // width
    if op == "idx":
        return seg * width + b % width
    if op == "up":
        return lane - b if lane % width >= b else lane
    if op == "down":
        return lane + b if lane % width + b < width else lane
    src = lane ^ b
    return lane if src // width > seg else src


def _poison(dtype) -> np.ndarray:
    return np.frombuffer(b"\xff" * np.dtype(dtype).itemsize, dtype=dtype)[0]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("width", [32, 16, 8, 4, 2, 1])
@pytest.mark.parametrize("op", list(OPS))
def test_shuffles_match_the_programming_guide(lib, op, width, dtype):
    grid, block = 2, 50  # the second warp of each block has lanes 0-17 only
    n = grid * block
    rng = np.random.default_rng(width * 10 + OPS[op])
    x = (rng.standard_normal(n) * 1e6).astype(dtype) if np.dtype(dtype).kind == "f" else \
        rng.integers(-(2**30), 2**30, n).astype(dtype)
    if dtype == np.int64:
        x = x * (2**31) + 7  # values that need all 64 bits
    out = np.zeros(32 * n, dtype=dtype)
    launch(lib, DTYPES[dtype], grid, block, 0, _ptr(x), _ptr(out), ctypes.c_longlong(OPS[op]),
           ctypes.c_longlong(width), ctypes.c_longlong(n))
    out = out.reshape(32, n)
    for t in range(n):
        lane = t % block % 32
        warp_start = t - lane
        lanes_here = min(32, block - (t % block - lane))
        for b in range(32):
            src = source_lane(op, lane, b, width)
            want = x[warp_start + src] if src < lanes_here else _poison(dtype)
            got = out[b, t]
            assert got.tobytes() == np.asarray(want, dtype=dtype).tobytes(), (op, width, b, t, lane, src, got, want)


def test_butterfly_sum_reaches_every_lane(lib):
    x = np.random.default_rng(1).integers(-(2**40), 2**40, 96).astype(np.int64)
    out = np.zeros_like(x)
    launch(lib, "warp_sum", 1, 96, 0, _ptr(x), _ptr(out))
    assert (out == np.repeat(x.reshape(3, 32).sum(1), 32)).all()


def test_syncwarp_orders_shared_memory_round_after_round(lib):
    block, rounds = 64, 25
    x = np.arange(2 * block, dtype=np.float64) * 0.5
    out = np.zeros_like(x)
    launch(lib, "syncwarp_neighbours", 2, block, block * 8, _ptr(x), _ptr(out), ctypes.c_longlong(rounds))
    want = x.reshape(-1, 32).copy()
    for _ in range(rounds):
        want = want + np.roll(want, -1, axis=1)
    assert np.array_equal(out, want.ravel())


def test_a_partial_mask_takes_only_its_lanes(lib):
    x = np.arange(64, dtype=np.float32)
    out = np.zeros_like(x)
    launch(lib, "half_warp", 1, 64, 0, _ptr(x), _ptr(out))
    want = x.copy()
    for t in range(64):
        if t % 32 < 16:
            want[t] = x[t + 1] if t % 16 < 15 else x[t]
    assert np.array_equal(out, want)


def test_a_lane_outside_the_mask_reads_poison(lib):
    x = np.arange(32, dtype=np.float32)
    out = np.zeros_like(x)
    launch(lib, "read_outside_mask", 1, 32, 0, _ptr(x), _ptr(out))
    assert np.isnan(out[:16]).all() and np.array_equal(out[16:], x[16:])


@pytest.mark.parametrize("name,message", [
    ("divergent_deadlock", "never reached the warp primitive"),
    ("mask_without_caller", "leaves itself out"),
    ("mismatched_masks", "different masks"),
])
def test_warp_errors_fail_the_launch_instead_of_hanging(lib, name, message):
    lib.emu_set_warp_timeout_ms(ctypes.c_longlong(300))
    try:
        out = np.zeros(32, dtype=np.float32)
        with pytest.raises(AssertionError, match=message):
            launch(lib, name, 1, 32, 0, _ptr(out))
    finally:
        lib.emu_set_warp_timeout_ms(ctypes.c_longlong(20000))
