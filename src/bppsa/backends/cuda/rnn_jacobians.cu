// Transposed Jacobians of the tanh RNN, in the scan order of bppsa/jacobians/recurrent.py
// (element k belongs to time step T-k).  h is [T][B][H] holding h_1..h_T, W is W_hh [H][H].
//   paper: out [2T][B][H][H], out[2k] = diag(1 - h_{T-k}^2), out[2k+1] = W_hh^T
//   fused: out [T][B][H][H],  out[k]  = W_hh^T diag(1 - h_{T-k}^2)
// One thread per output element, grid-stride.  The explicitly rounded multiply and subtract stop
// the compiler from contracting 1 - h*h into an FMA, so the result is bit-identical to the torch
// twin, which rounds h*h, 1 - h*h and the final product separately.
//
// CuPy appends -ftz=true to every compile, which turns fp32 arithmetic into its flush-to-zero
// form; torch's twin keeps subnormals.  The fp32 operations are therefore written as PTX
// instructions without .ftz, which that flag does not change (tests/test_nvrtc.py checks the PTX).

typedef long long idx_t;

#ifdef __CUDA_ARCH__
__device__ inline float rn_mul(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ inline float rn_sub(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
#else  // host compilation (the CPU emulation in tests/test_kernels.py)
__device__ inline float rn_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ inline float rn_sub(float a, float b) { return __fsub_rn(a, b); }
#endif
__device__ inline double rn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ inline double rn_sub(double a, double b) { return __dsub_rn(a, b); }

template <typename T>
__device__ inline T tanh_slope(T hv) {
  return rn_sub(T(1), rn_mul(hv, hv));
}

template <typename T>
__device__ void rnn_fill(const T* h, const T* W, T* out, idx_t Tn, idx_t B, idx_t H, bool fused) {
  const idx_t HH = H * H;
  const idx_t slots = fused ? Tn : 2 * Tn;
  const idx_t total = slots * B * HH;
  const idx_t stride = (idx_t)gridDim.x * blockDim.x;
  for (idx_t e = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
    const idx_t j = e % H;
    const idx_t i = (e / H) % H;
    const idx_t b = (e / HH) % B;
    const idx_t s = e / (HH * B);
    const idx_t k = fused ? s : s / 2;
    const T* hk = h + ((Tn - 1 - k) * B + b) * H;
    T val;
    if (fused) {
      val = rn_mul(W[j * H + i], tanh_slope(hk[j]));
    } else if (s % 2 == 0) {
      val = i == j ? tanh_slope(hk[i]) : T(0);
    } else {
      val = W[j * H + i];
    }
    out[e] = val;
  }
}

#define BPPSA_RNN_KERNELS(T, SUFFIX)                                                             \
  extern "C" __global__ void bppsa_rnn_jacobians_paper_##SUFFIX(const T* h, const T* W, T* out, \
                                                                idx_t Tn, idx_t B, idx_t H) {    \
    rnn_fill<T>(h, W, out, Tn, B, H, false);                                                     \
  }                                                                                              \
  extern "C" __global__ void bppsa_rnn_jacobians_fused_##SUFFIX(const T* h, const T* W, T* out, \
                                                                idx_t Tn, idx_t B, idx_t H) {    \
    rnn_fill<T>(h, W, out, Tn, B, H, true);                                                      \
  }

BPPSA_RNN_KERNELS(float, f32)
BPPSA_RNN_KERNELS(double, f64)
