// The factored BPPSA backward of a recurrent chain: the per-step transposed Jacobians are never stored.
//
// The chain (scan order, steps k = 0 .. n-1) is kept as the CPU path keeps it (bppsa/backends/cpu/chain.py):
// weights Wt [NW][H][H] (W_hg^T) and per-step factors f [n][NR][B] (lane order), NR = NF*H + I + H rows:
//   rnn (NW = 1, NF = 1):  J_k = Wt diag(d_k)                                   rows: d
//   gru (NW = 3, NF = 5):  J_k = sum_g Wt_g diag(c_g,k) + diag(z_k)             rows: c_r, c_z, c_n, z, e
// then x_k (I rows) and h'_k (H rows), for the parameter gradients.
//
// Three phases (bppsa/backends/cuda/plan.py: factored_plan), chunk c = steps [cC, min(cC + C, n)), block
// blockIdx.x = c * B + b for batch element b; no block ever waits for another:
//   up:     agg[c][b] = J_{last} ... J_{first} of the chunk, built from the factors: in registers by factored_up.cu
//           (compiled per H), or here in shared memory (bppsa_factored_up_smem_*) where H is too large for that;
//   middle: factored_warp.cu (one launch, compiled per H) carries g across the aggregates, carries[c][b] =
//           agg[c-1] ... agg[0] g (the Blelloch kernels of blelloch.cu where L_m bounds the tree);
//   down:   each block replays its chunk from its carry with mat-vecs: the scan's output P[k][b] = the
//           vector before step k (mode 0), or (mode & 1) the block's sums of the parameter gradients,
//           acc[block][NA][I + 1 + H] as chain_scan.c accumulates them, which the host adds over the blocks.
// The per-step-gradient (affine) scan, v_{k+1} = J_k v_k + c_k with c [n][B][H] (mode & 2: every mat-vec adds
// c_k): the down kernel first runs with mode & 4 from zero, writing each chunk's offset (its replay with the
// gradients injected, through its last step) to P[c][b]; factored_warp.cu's middle kernel (mode & 2) then carries
// across the chunks, carries[c+1] = agg[c] carries[c] + offset[c]; then the down kernel as above.
//
// Every H x H matrix in shared memory has row pitch `pitch` (odd, >= H: plan.smem_pitch), so a warp reading
// a column (thread i reads row i, the down phase's mat-vec) hits distinct banks; element-wise and row-times-
// matrix loops run over the pitched index (the pad column idles), so their warps touch consecutive words.

typedef long long idx_t;

#if !defined(__CUDACC_RTC__) && !defined(__CUDACC__)
#include <cmath>  // the CPU emulator (g++); NVRTC and nvcc have exp and tanh built in
using std::exp;
using std::tanh;
#endif

#ifndef BPPSA_SMEM
extern __shared__ double bppsa_smem_[];
#define BPPSA_SMEM bppsa_smem_
#endif

namespace bppsa_factored {

// W^T from global [NW][H][H] into shared memory at the pitch.
template <typename T>
__device__ inline void stage_wt(T* dst, const T* Wt, idx_t NW, idx_t H, idx_t pitch) {
  const idx_t HP = H * pitch;
  for (idx_t p = threadIdx.x; p < NW * HP; p += blockDim.x) {
    const idx_t g = p / HP, r = p % HP, i = r / pitch, m = r % pitch;
    if (m < H) dst[p] = Wt[(g * H + i) * H + m];
  }
}

// Rows r0 .. r0 + count - 1 of step k's factors (batch element b) into dst.
template <typename T>
__device__ inline void stage_rows(T* dst, const T* f, idx_t k, idx_t NR, idx_t B, idx_t b, idx_t r0, idx_t count) {
  for (idx_t r = threadIdx.x; r < count; r += blockDim.x) dst[r] = f[(k * NR + r0 + r) * B + b];
}

// J = the step's Jacobian from W^T and its factors fac (rnn: d; gru: c_r, c_z, c_n, z).
template <typename T, int KIND>
__device__ inline void build_jacobian(T* J, const T* W, const T* fac, idx_t H, idx_t pitch) {
  const idx_t HP = H * pitch;
  for (idx_t p = threadIdx.x; p < HP; p += blockDim.x) {
    const idx_t i = p / pitch, m = p % pitch;
    if (m >= H) continue;
    if (KIND == 0) {
      J[p] = W[p] * fac[m];
    } else {
      T a = W[p] * fac[m];
      a += W[HP + p] * fac[H + m];
      a += W[2 * HP + p] * fac[2 * H + m];
      if (i == m) a += fac[3 * H + m];
      J[p] = a;
    }
  }
}

// Block (chunk c, batch element b): agg[c][b] = J_{e} ... J_{s}.
template <typename T, int KIND>
__device__ void up(const T* Wt, const T* f, T* agg, idx_t n, idx_t B, idx_t H, idx_t I, idx_t C, idx_t pitch) {
  const idx_t NW = KIND == 0 ? 1 : 3, NF = KIND == 0 ? 1 : 5, NFU = KIND == 0 ? 1 : 4;
  const idx_t NR = NF * H + I + H;
  const idx_t c = (idx_t)blockIdx.x / B, b = (idx_t)blockIdx.x % B;
  const idx_t s = c * C, e = (s + C < n ? s + C : n) - 1;
  const idx_t HP = H * pitch;
  T* sm = reinterpret_cast<T*>(BPPSA_SMEM);
  T* W = sm;                 // NW * HP
  T* J = W + NW * HP;        // HP: the step's Jacobian
  T* M = J + HP;             // HP: the aggregate so far
  T* Mn = M + HP;            // HP: its next value
  T* fac = Mn + HP;          // NFU * H: the step's factors
  stage_wt(W, Wt, NW, H, pitch);
  stage_rows(fac, f, s, NR, B, b, 0, NFU * H);
  __syncthreads();
  build_jacobian<T, KIND>(M, W, fac, H, pitch);
  __syncthreads();
  for (idx_t k = s + 1; k <= e; ++k) {
    stage_rows(fac, f, k, NR, B, b, 0, NFU * H);
    __syncthreads();
    build_jacobian<T, KIND>(J, W, fac, H, pitch);
    __syncthreads();
    // Mn = J M: thread (i, j) reads row i of J (a few rows per warp: distinct banks for an odd pitch)
    // and column j of M (consecutive words)
    for (idx_t p = threadIdx.x; p < HP; p += blockDim.x) {
      const idx_t i = p / pitch, j = p % pitch;
      if (j >= H) continue;
      T acc = T(0);
      for (idx_t m = 0; m < H; ++m) acc += J[i * pitch + m] * M[m * pitch + j];
      Mn[p] = acc;
    }
    __syncthreads();
    T* t = M;
    M = Mn;
    Mn = t;
  }
  T* out = agg + (c * B + b) * H * H;
  for (idx_t p = threadIdx.x; p < HP; p += blockDim.x) {
    const idx_t i = p / pitch, j = p % pitch;
    if (j < H) out[i * H + j] = M[p];
  }
}

// Whether entry (a, col) of the sums is accumulated (the GRU's dN rows take x and 1, its dM rows 1 and h').
template <int KIND>
__device__ inline bool needed(idx_t a, idx_t col, idx_t H, idx_t I) {
  if (KIND == 0 || a < 2 * H) return true;
  return a < 3 * H ? col <= I : col >= I;
}

// Block (chunk c, batch element b): replay the chunk from carry[c][b].
template <typename T, int KIND>
__device__ void down(const T* Wt, const T* f, const T* carry, const T* cin, T* P, T* accs, idx_t n, idx_t B,
                     idx_t H, idx_t I, idx_t C, idx_t pitch, idx_t G, idx_t mode) {
  const bool sums = mode & 1, inject = mode & 2, offset = mode & 4;
  const idx_t NW = KIND == 0 ? 1 : 3, NF = KIND == 0 ? 1 : 5;
  const idx_t NFD = KIND == 0 ? 1 : (sums ? 5 : 4);
  const idx_t NR = NF * H + I + H;
  const idx_t NA = KIND == 0 ? H : 4 * H, NBV = I + 1 + H;
  const idx_t c = (idx_t)blockIdx.x / B, b = (idx_t)blockIdx.x % B;
  const idx_t s = c * C, e = (s + C < n ? s + C : n) - 1;
  const idx_t HP = H * pitch;
  T* sm = reinterpret_cast<T*>(BPPSA_SMEM);
  T* W = sm;              // NW * HP
  T* v = W + NW * HP;     // H: the vector before step k (the scan's output at k)
  T* w = v + H;           // H: J_k v
  T* fac = w + H;         // NFD * H: the step's factors
  T* t = fac + NFD * H;   // NW * H: c_g ⊙ v (rnn: d ⊙ v)
  T* A = t + NW * H;      // sums: G * NA gradient rows of the group's positions
  T* Bv = A + G * NA;     // sums: G * NBV columns (x, 1, h')
  T* acc = Bv + G * NBV;  // sums: NA * NBV, the block's sums
  stage_wt(W, Wt, NW, H, pitch);
  for (idx_t i = threadIdx.x; i < H; i += blockDim.x) v[i] = offset ? T(0) : carry[(c * B + b) * H + i];
  if (sums)
    for (idx_t q = threadIdx.x; q < NA * NBV; q += blockDim.x) acc[q] = T(0);
  idx_t gp = 0;
  for (idx_t k = s; k <= e; ++k) {
    stage_rows(fac, f, k, NR, B, b, 0, NFD * H);
    if (sums) {
      T* col = Bv + gp * NBV;
      for (idx_t q = threadIdx.x; q < NBV; q += blockDim.x)
        col[q] = q < I ? f[(k * NR + NF * H + q) * B + b] : q == I ? T(1) : f[(k * NR + NF * H + q - 1) * B + b];
    }
    __syncthreads();
    for (idx_t i = threadIdx.x; i < H; i += blockDim.x) {
      const T q = v[i];
      if (!sums && !offset) P[(k * B + b) * H + i] = q;
      if (KIND == 0) {
        t[i] = fac[i] * q;
        if (sums) A[gp * NA + i] = q * fac[i];  // the pre-activation's gradient, d ⊙ grad h
      } else {
        t[i] = fac[i] * q;
        t[H + i] = fac[H + i] * q;
        t[2 * H + i] = fac[2 * H + i] * q;
        if (sums) {
          T* row = A + gp * NA;
          row[i] = q * fac[i];                  // dR = grad h ⊙ c_r
          row[H + i] = q * fac[H + i];          // dZ = grad h ⊙ c_z
          row[2 * H + i] = q * fac[4 * H + i];  // dN = grad h ⊙ e
          row[3 * H + i] = q * fac[2 * H + i];  // dM = grad h ⊙ c_n
        }
      }
    }
    __syncthreads();
    if (k < e || offset) {  // w = J_k v (+ c_k); thread i reads row i of each W^T (a column across the warp)
      for (idx_t i = threadIdx.x; i < H; i += blockDim.x) {
        T a = KIND == 0 ? T(0) : fac[3 * H + i] * v[i];
        for (idx_t g = 0; g < NW; ++g) {
          const T* Wg = W + g * HP + i * pitch;
          const T* tg = t + g * H;
          for (idx_t m = 0; m < H; ++m) a += Wg[m] * tg[m];
        }
        if (inject) a += cin[(k * B + b) * H + i];
        w[i] = a;
        if (offset && k == e) P[(c * B + b) * H + i] = a;  // the chunk's offset
      }
    }
    ++gp;
    if (sums && (gp == G || k == e)) {  // the group's rows times its columns into the sums
      for (idx_t q = threadIdx.x; q < NA * NBV; q += blockDim.x) {
        const idx_t a = q / NBV, col = q % NBV;
        if (!needed<KIND>(a, col, H, I)) continue;
        T sum = acc[q];
        for (idx_t p = 0; p < gp; ++p) sum += A[p * NA + a] * Bv[p * NBV + col];
        acc[q] = sum;
      }
      gp = 0;
    }
    __syncthreads();
    T* tmp = v;
    v = w;
    w = tmp;
  }
  if (sums) {
    T* out = accs + (idx_t)blockIdx.x * NA * NBV;
    for (idx_t q = threadIdx.x; q < NA * NBV; q += blockDim.x) out[q] = acc[q];
  }
}

// The parameter gradients from the sums of `parts` blocks (accs [parts][entries]; either down kernel, mode & 1):
// out[j] = the sum over the parts, in a fixed order, of accs[part][map[j]], for the flat gradient j (map:
// plan.grad_index, the chain's grad_layout).  Block: 32 consecutive j (the lanes) and W warps; warp w adds the parts
// w, w + W, ... in order, then the warps' partial sums are added in warp order.  Deterministic: the same order in
// every run, whatever the timing.
template <typename T>
__device__ void grads(const T* accs, const int* map, T* out, idx_t parts, idx_t entries, idx_t total) {
  T* part = reinterpret_cast<T*>(BPPSA_SMEM);  // [W][32]
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, W = blockDim.x / 32;
  const idx_t j = (idx_t)blockIdx.x * 32 + lane;
  T s0 = T(0), s1 = T(0);
  if (j < total) {
    const T* a = accs + map[j];
    idx_t p = warp;
    for (; p + W < parts; p += 2 * W) {
      s0 += a[p * entries];
      s1 += a[(p + W) * entries];
    }
    if (p < parts) s0 += a[p * entries];
  }
  part[warp * 32 + lane] = s0 + s1;
  __syncthreads();
  if (warp == 0 && j < total) {
    T s = T(0);
    for (unsigned w = 0; w < W; ++w) s += part[w * 32 + lane];
    out[j] = s;
  }
}

// The GRU's factors from the forward's saved states, in one pass (replacing torch's gate recomputation and ~30 ops):
// thread p = t * B + b (time step t, batch element b) recomputes the gates of step t, r, z = sigmoid(W_i x_t + b_i +
// W_h h_{t-1} + b_h), M = W_hn h_{t-1} + b_hn, n = tanh(W_in x_t + b_in + r ⊙ M) (h_{-1} = 0), and writes scan step
// k = T - 1 - t of f [T][6H + I][B] (lane order) as GruChain.from_states does: c_r = e M r (1 - r),
// c_z = (h_{t-1} - n) z (1 - z), c_n = e r, z, e = (1 - z)(1 - n²), then x_t and h_{t-1}.  The weights and biases are
// staged in shared memory once per block and read as broadcasts (every thread the same address).
template <typename T>
__device__ void gru_factors(const T* x, const T* h, const T* Wih, const T* Whh, const T* bih, const T* bhh, T* f,
                            idx_t Tn, idx_t B, idx_t H, idx_t I) {
  T* sm = reinterpret_cast<T*>(BPPSA_SMEM);
  T* wi = sm;                 // [3H][I]
  T* wh = wi + 3 * H * I;     // [3H][H]
  T* bi = wh + 3 * H * H;     // [3H]
  T* bh = bi + 3 * H;         // [3H]
  for (idx_t q = threadIdx.x; q < 3 * H * I; q += blockDim.x) wi[q] = Wih[q];
  for (idx_t q = threadIdx.x; q < 3 * H * H; q += blockDim.x) wh[q] = Whh[q];
  for (idx_t q = threadIdx.x; q < 3 * H; q += blockDim.x) {
    bi[q] = bih[q];
    bh[q] = bhh[q];
  }
  __syncthreads();
  const idx_t p = (idx_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= Tn * B) return;
  const idx_t t = p / B, b = p % B, k = Tn - 1 - t, NR = 6 * H + I;
  const T* xt = x + p * I;
  const T* hp = t > 0 ? h + (p - B) * H : nullptr;
  T* fk = f + k * NR * B + b;
  for (idx_t i = 0; i < H; ++i) {
    T gr = bi[i], gz = bi[H + i], gn = bi[2 * H + i];
    for (idx_t m = 0; m < I; ++m) {
      const T xm = xt[m];
      gr += wi[i * I + m] * xm;
      gz += wi[(H + i) * I + m] * xm;
      gn += wi[(2 * H + i) * I + m] * xm;
    }
    T hr = bh[i], hz = bh[H + i], M = bh[2 * H + i];
    if (hp != nullptr) {
      for (idx_t m = 0; m < H; ++m) {
        const T hm = hp[m];
        hr += wh[i * H + m] * hm;
        hz += wh[(H + i) * H + m] * hm;
        M += wh[(2 * H + i) * H + m] * hm;
      }
    }
    const T r = T(1) / (T(1) + exp(-(gr + hr)));
    const T z = T(1) / (T(1) + exp(-(gz + hz)));
    const T n = tanh(gn + r * M);
    const T hpi = hp != nullptr ? hp[i] : T(0);
    const T e = (T(1) - z) * (T(1) - n * n);
    fk[i * B] = e * M * r * (T(1) - r);
    fk[(H + i) * B] = (hpi - n) * z * (T(1) - z);
    fk[(2 * H + i) * B] = e * r;
    fk[(3 * H + i) * B] = z;
    fk[(4 * H + i) * B] = e;
    fk[(5 * H + I + i) * B] = hpi;
  }
  for (idx_t m = 0; m < I; ++m) fk[(5 * H + m) * B] = xt[m];
}

}  // namespace bppsa_factored

#define BPPSA_GRU_FACTORS(T, SUFFIX)                                                                          \
  extern "C" __global__ void bppsa_gru_factors_##SUFFIX(const T* x, const T* h, const T* Wih, const T* Whh,    \
                                                        const T* bih, const T* bhh, T* f, idx_t Tn, idx_t B,  \
                                                        idx_t H, idx_t I) {                                   \
    bppsa_factored::gru_factors<T>(x, h, Wih, Whh, bih, bhh, f, Tn, B, H, I);                                 \
  }

BPPSA_GRU_FACTORS(float, f32)
BPPSA_GRU_FACTORS(double, f64)

#define BPPSA_FACTORED_KERNELS(T, SUFFIX, KIND, NAME)                                                         \
  extern "C" __global__ void bppsa_factored_up_smem_##NAME##_##SUFFIX(const T* Wt, const T* f, T* agg,          \
                                                                      idx_t n, idx_t B, idx_t H, idx_t I,       \
                                                                      idx_t C, idx_t pitch, idx_t G,            \
                                                                      idx_t mode) {                             \
    (void)G;                                                                                                  \
    (void)mode;                                                                                               \
    bppsa_factored::up<T, KIND>(Wt, f, agg, n, B, H, I, C, pitch);                                            \
  }                                                                                                           \
  extern "C" __global__ void bppsa_factored_down_##NAME##_##SUFFIX(const T* Wt, const T* f, const T* carry,    \
                                                                   const T* cin, T* P, T* acc, idx_t n,         \
                                                                   idx_t B, idx_t H, idx_t I, idx_t C,          \
                                                                   idx_t pitch, idx_t G, idx_t mode) {          \
    bppsa_factored::down<T, KIND>(Wt, f, carry, cin, P, acc, n, B, H, I, C, pitch, G, mode);                  \
  }

BPPSA_FACTORED_KERNELS(float, f32, 0, rnn)
BPPSA_FACTORED_KERNELS(double, f64, 0, rnn)
BPPSA_FACTORED_KERNELS(float, f32, 1, gru)
BPPSA_FACTORED_KERNELS(double, f64, 1, gru)

#define BPPSA_FACTORED_GRADS(T, SUFFIX)                                                                       \
  extern "C" __global__ void bppsa_factored_grads_##SUFFIX(const T* accs, const int* map, T* out, idx_t parts,  \
                                                           idx_t entries, idx_t total) {                       \
    bppsa_factored::grads<T>(accs, map, out, parts, entries, total);                                          \
  }

BPPSA_FACTORED_GRADS(float, f32)
BPPSA_FACTORED_GRADS(double, f64)
