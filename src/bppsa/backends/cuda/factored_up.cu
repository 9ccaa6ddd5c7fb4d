// The factored up phase with the chunk aggregate in registers: compiled per hidden size H (NVRTC, -DBPPSA_H=H).
//
// Block (chunk c, batch element b) of factored.cu's up kernel builds agg[c][b] = J_e ... J_s in shared memory with
// two shared loads per multiply-add and three barriers a step.  Here one thread owns NC columns of one pair's
// aggregate (pair p = c * B + b) and keeps them in registers for the whole chunk; a step is
//   rnn:  M <- W^T diag(d_k) M                           (N[i][q] = sum_m W[i][m] * (d_k[m] * M[m][q]))
//   gru:  M <- sum_g W_g^T diag(c_g,k) M + diag(z_k) M
// The 32 lanes of a warp are 32 consecutive pairs with the same column block, so every lane reads the same W^T
// value at the same time: a broadcast, 16 bytes (4 floats, 2 doubles) per shared load, each value used for NC
// columns.  W^T is staged column by column (S[g][m][i] = W_g^T[i][m], row pitch a multiple of 16 bytes) before the
// chunk starts: the only barrier.  The step's factors stream from global memory one H-vector at a time (d; or
// c_r, c_z, c_n, z), the next vector loaded while the current one is used; a load instruction's 32 lanes read the
// same factor row of 32 consecutive pairs, i.e. consecutive batch elements (coalesced where B >= 32).
// Indices are 32-bit (the plan checks n, K * B and NR * B fit); the only 64-bit arithmetic is the pointer to the
// pair's first step, its per-step stride and its aggregate, all products: there is no division but p / B (32-bit)
// and divisions by compile-time constants.
//
// Constants (plan.up_constants): BPPSA_H, and BPPSA_NC32 / BPPSA_NC64, the columns a thread owns in fp32 / fp64
// (0: the registers would not hold them, that dtype's kernels are not compiled and the plan takes factored.cu's).
// The interface is factored.cu's: (Wt, f, agg, n, B, H, I, C, pitch, G, mode); H, pitch, G and mode are unused.

#if !defined(BPPSA_H) || !defined(BPPSA_NC32) || !defined(BPPSA_NC64)
#error "factored_up.cu is compiled per hidden size: -DBPPSA_H=<H> -DBPPSA_NC32=<columns> -DBPPSA_NC64=<columns>"
#endif

typedef long long idx_t;

#ifndef BPPSA_SMEM
extern __shared__ double bppsa_smem_[];
#define BPPSA_SMEM bppsa_smem_
#endif

namespace bppsa_factored_reg {

constexpr int H = BPPSA_H;
constexpr int MAX_WARPS = 8;  // warps (column blocks) per thread block

template <typename T>
struct alignas(16) Vec {  // one 16-byte shared load (LDS.128)
  T v[16 / sizeof(T)];
};

template <typename T>
struct Layout {
  static constexpr int V = 16 / sizeof(T);        // elements a shared load brings
  static constexpr int P = (H + V - 1) / V * V;   // row pitch of the staged W^T
};

template <int NC>
struct Geometry {
  static constexpr int NJB = (H + NC - 1) / NC;                   // column blocks, one warp each
  static constexpr int JG = (NJB + MAX_WARPS - 1) / MAX_WARPS;    // thread blocks per 32 pairs
  static constexpr int WPB = (NJB + JG - 1) / JG;                 // warps per thread block
};

// N (+)= W_g^T (v ⊙ M) for the thread's columns; `first`: N is written, not accumulated.
template <typename T, int NC>
__device__ inline void apply(T (&N)[H][NC], const T (&M)[H][NC], const T (&v)[H], const Vec<T>* Sg, bool first) {
  constexpr int V = Layout<T>::V, PV = Layout<T>::P / V;
#pragma unroll
  for (int m = 0; m < H; ++m) {
    T t[NC];
#pragma unroll
    for (int q = 0; q < NC; ++q) t[q] = v[m] * M[m][q];
#pragma unroll
    for (int i4 = 0; i4 < PV; ++i4) {
      const Vec<T> w = Sg[m * PV + i4];  // W_g^T[i4*V .. i4*V+V-1][m]: the same address in every lane
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const int i = i4 * V + u;
        if (i < H) {
#pragma unroll
          for (int q = 0; q < NC; ++q) N[i][q] = (first && m == 0) ? w.v[u] * t[q] : w.v[u] * t[q] + N[i][q];
        }
      }
    }
  }
}

// Zero, opaque to the compiler: added to W^T's address every step, so that ptxas streams W^T from shared memory
// instead of hoisting all of it out of the step loop into registers (which spills).
__device__ inline unsigned opaque_zero() {
  unsigned z = 0;
#ifdef __CUDA_ARCH__
  asm volatile("mov.u32 %0, 0;" : "=r"(z));
#endif
  return z;
}

template <typename T>
__device__ inline void load_vector(T (&v)[H], const T* src, unsigned B) {
#pragma unroll
  for (int m = 0; m < H; ++m) v[m] = src[m * B];
}

template <typename T, int KIND, int NC>
__device__ void up(const T* Wt, const T* f, T* agg, unsigned n, unsigned B, unsigned I, unsigned C) {
  constexpr int NW = KIND == 0 ? 1 : 3, NF = KIND == 0 ? 1 : 5, NFU = KIND == 0 ? 1 : 4;
  constexpr int P = Layout<T>::P, PV = P / Layout<T>::V;
  using G = Geometry<NC>;
  T* S = reinterpret_cast<T*>(BPPSA_SMEM);  // S[g][m][i] = W_g^T[i][m], pitch P, zero past H
  for (unsigned q = threadIdx.x; q < unsigned(NW * H * P); q += blockDim.x) {
    const unsigned g = q / (H * P), r = q % (H * P), m = r / P, i = r % P;
    S[q] = i < unsigned(H) ? Wt[(g * H + i) * H + m] : T(0);
  }
  __syncthreads();
  const Vec<T>* Sv = reinterpret_cast<const Vec<T>*>(S);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned jb = (blockIdx.x % G::JG) * G::WPB + warp;
  const unsigned p = (blockIdx.x / G::JG) * 32 + lane;
  const unsigned K = (n + C - 1) / C;
  if (jb >= unsigned(G::NJB) || p >= K * B) return;
  const unsigned c = p / B, b = p - c * B;
  const unsigned s = c * C, e = (s + C < n ? s + C : n) - 1;
  const unsigned NR = NF * H + I + H;
  const size_t stride = size_t(NR) * B;  // elements from one step's factors to the next's
  const T* fs = f + size_t(s) * stride + b;
  const unsigned j0 = jb * NC;

  // the chunk's first step: M = J_s's columns j0 .. j0 + NC - 1 (zero past H)
  T M[H][NC];
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    const unsigned j = j0 + q < unsigned(H) ? j0 + q : H - 1;
    const T keep = j0 + q < unsigned(H) ? T(1) : T(0);
    T fac[NW];
#pragma unroll
    for (int g = 0; g < NW; ++g) fac[g] = fs[(g * H + j) * B] * keep;
    const T z = KIND == 0 ? T(0) : fs[(3 * H + j) * B] * keep;
#pragma unroll
    for (int i4 = 0; i4 < PV; ++i4) {
      Vec<T> w[NW];
#pragma unroll
      for (int g = 0; g < NW; ++g) w[g] = Sv[(g * H + j) * PV + i4];  // W_g^T[.][j]: column j
#pragma unroll
      for (int u = 0; u < Layout<T>::V; ++u) {
        const int i = i4 * Layout<T>::V + u;
        if (i < H) {
          T a = w[0].v[u] * fac[0];
#pragma unroll
          for (int g = 1; g < NW; ++g) a = w[g].v[u] * fac[g] + a;
          if (KIND == 1 && unsigned(i) == j) a += z;
          M[i][q] = a;
        }
      }
    }
  }

  // the chunk's other steps, the factors streamed one H-vector ahead
  T cur[H], nxt[H];
  const T* fk = fs + stride;  // step k = s + 1
  if (s < e) load_vector(cur, fk, B);
  for (unsigned k = s + 1; k <= e; ++k) {
    T N[H][NC];
    const Vec<T>* Sk = Sv + opaque_zero();
#pragma unroll
    for (int u = 0; u < NFU; ++u) {
      // the next vector: (k, u + 1), or the next step's first (at the chunk's end: this step's again, unused)
      load_vector(nxt, u + 1 < NFU ? fk + (u + 1) * H * B : (k < e ? fk + stride : fk), B);
      if (u < NW) {
        apply<T, NC>(N, M, cur, Sk + u * H * PV, u == 0);
      } else {  // gru: + diag(z_k) M
#pragma unroll
        for (int i = 0; i < H; ++i)
#pragma unroll
          for (int q = 0; q < NC; ++q) N[i][q] = cur[i] * M[i][q] + N[i][q];
      }
#pragma unroll
      for (int m = 0; m < H; ++m) cur[m] = nxt[m];
    }
#pragma unroll
    for (int i = 0; i < H; ++i)
#pragma unroll
      for (int q = 0; q < NC; ++q) M[i][q] = N[i][q];
    fk += stride;
  }

  T* out = agg + size_t(p) * (H * H);
#pragma unroll
  for (int q = 0; q < NC; ++q) {
    if (j0 + q < unsigned(H)) {
#pragma unroll
      for (int i = 0; i < H; ++i) out[i * H + j0 + q] = M[i][q];
    }
  }
}

}  // namespace bppsa_factored_reg

#define BPPSA_FACTORED_UP_REG(T, SUFFIX, KIND, NAME, NC)                                                       \
  extern "C" __global__ void bppsa_factored_up_##NAME##_##SUFFIX(const T* Wt, const T* f, T* agg, idx_t n,      \
                                                                 idx_t B, idx_t H, idx_t I, idx_t C,            \
                                                                 idx_t pitch, idx_t G, idx_t mode) {            \
    (void)H;                                                                                                  \
    (void)pitch;                                                                                              \
    (void)G;                                                                                                  \
    (void)mode;                                                                                               \
    bppsa_factored_reg::up<T, KIND, NC>(Wt, f, agg, (unsigned)n, (unsigned)B, (unsigned)I, (unsigned)C);     \
  }

#if BPPSA_NC32 > 0
BPPSA_FACTORED_UP_REG(float, f32, 0, rnn, BPPSA_NC32)
BPPSA_FACTORED_UP_REG(float, f32, 1, gru, BPPSA_NC32)
#endif
#if BPPSA_NC64 > 0
BPPSA_FACTORED_UP_REG(double, f64, 0, rnn, BPPSA_NC64)
BPPSA_FACTORED_UP_REG(double, f64, 1, gru, BPPSA_NC64)
#endif
