// Modified Blelloch scan of BPPSA (Algorithm 1) on batched dense transposed Jacobians.
//
// Layout and schedule are those of bppsa/scan.py, so the two paths can be compared element by
// element:
//   J [n][B][H][H]  position p >= 1 is J[p-1]; up-sweep products overwrite it (workspace)
//   S [L+1][B][H]   the left spine: S[d] is the (vector) node value at position 2^d - 1, S[0] = g
//   P [n][B][H]     the result; position p's exclusive prefix is P[p-1]
// One launch per tree level and sweep; one thread block per (pair, batch element), with
// blockIdx.x = pair * B + b.  Pair k of level d is l = first_l + k*step, r = min(l + half, N-1).
// Pair 0 is on the spine (matrix-vector); every other up-sweep pair is matrix-matrix, every
// down-sweep pair matrix-vector.  Operands are staged in dynamic shared memory (the host opts in
// beyond 48 KB where needed) because the matrix-matrix product reads each element H times and a
// row-per-thread matrix-vector product would otherwise read global memory with stride H.

typedef long long idx_t;

// Declared as double so that the buffer is aligned for either dtype without compiler-specific
// alignment attributes.  The CPU emulation in tests/test_kernels.py supplies its own buffer here.
#ifndef BPPSA_SMEM
extern __shared__ double bppsa_smem_[];
#define BPPSA_SMEM bppsa_smem_
#endif

__device__ inline idx_t bppsa_min(idx_t a, idx_t b) { return a < b ? a : b; }

template <typename T>
__device__ inline void stage(T* dst, const T* src, idx_t count) {
  for (idx_t i = threadIdx.x; i < count; i += blockDim.x) dst[i] = src[i];
}

// y[i] = sum_k M[i][k] v[k]; M and v in shared memory, y anywhere (it may alias v's source).
template <typename T>
__device__ inline void matvec(T* y, const T* M, const T* v, idx_t H) {
  for (idx_t i = threadIdx.x; i < H; i += blockDim.x) {
    T acc = T(0);
    for (idx_t k = 0; k < H; ++k) acc += M[i * H + k] * v[k];
    y[i] = acc;
  }
}

// Up-sweep, level d: a[r] <- a[l] ◇ a[r] = a[r] · a[l].
template <typename T>
__device__ void up_sweep(T* J, T* S, idx_t N, idx_t B, idx_t H, idx_t first_l, idx_t half,
                         idx_t step, idx_t d) {
  const idx_t pair = (idx_t)blockIdx.x / B;
  const idx_t b = (idx_t)blockIdx.x % B;
  const idx_t l = first_l + pair * step;
  const idx_t r = bppsa_min(l + half, N - 1);
  const idx_t HH = H * H;
  T* sm = reinterpret_cast<T*>(BPPSA_SMEM);
  T* Jr = J + ((r - 1) * B + b) * HH;
  if (pair == 0) {  // block-uniform branch, so the barrier below is reached by all threads
    T* v = sm;
    T* M = sm + H;
    stage(v, S + (d * B + b) * H, H);
    stage(M, Jr, HH);
    __syncthreads();
    matvec(S + ((d + 1) * B + b) * H, M, v, H);
    return;
  }
  T* A = sm;        // a[l]
  T* R = sm + HH;   // a[r]; both staged before any thread overwrites a[r] in place
  stage(A, J + ((l - 1) * B + b) * HH, HH);
  stage(R, Jr, HH);
  __syncthreads();
  for (idx_t e = threadIdx.x; e < HH; e += blockDim.x) {
    const idx_t i = e / H, j = e % H;
    T acc = T(0);
    for (idx_t k = 0; k < H; ++k) acc += R[i * H + k] * A[k * H + j];
    Jr[e] = acc;
  }
}

// Down-sweep, level d: T <- a[l]; a[l] <- a[r]; a[r] <- a[r] ◇ T = T · a[r].
// On the spine the prefix a[r] is the identity, so a[r] becomes the spine vector itself and the
// identity at a[l] is never stored (a lower level overwrites that position).
template <typename T>
__device__ void down_sweep(const T* J, const T* S, T* P, idx_t N, idx_t B, idx_t H,
                           idx_t first_l, idx_t half, idx_t step, idx_t d) {
  const idx_t pair = (idx_t)blockIdx.x / B;
  const idx_t b = (idx_t)blockIdx.x % B;
  const idx_t l = first_l + pair * step;
  const idx_t r = bppsa_min(l + half, N - 1);
  T* Pr = P + ((r - 1) * B + b) * H;
  if (pair == 0) {
    stage(Pr, S + (d * B + b) * H, H);
    return;
  }
  const idx_t HH = H * H;
  T* sm = reinterpret_cast<T*>(BPPSA_SMEM);
  T* v = sm;      // old a[r], kept in shared memory because a[r] is overwritten below
  T* M = sm + H;  // a[l]: the up-sweep product of the left block
  stage(v, Pr, H);
  stage(M, J + ((l - 1) * B + b) * HH, HH);
  __syncthreads();
  matvec(Pr, M, v, H);
  stage(P + ((l - 1) * B + b) * H, v, H);
}

// The middle of the heterogeneous variant: a sequential exclusive scan over the K blocks of
// level L (block ends e_k = min((k+1)*size - 1, N-1)), one thread block per batch element.
// It replaces the up-sweep levels >= L and their down-sweep levels; P[e_k] for k >= 1 is what
// the down-sweep of level L-1 then reads.
template <typename T>
__device__ void middle_scan(const T* J, const T* S, T* P, idx_t N, idx_t B, idx_t H, idx_t size,
                            idx_t K, idx_t L) {
  const idx_t b = (idx_t)blockIdx.x;
  const idx_t HH = H * H;
  T* sm = reinterpret_cast<T*>(BPPSA_SMEM);
  T* v = sm;          // running prefix
  T* w = sm + H;      // next prefix
  T* M = sm + 2 * H;  // the block product being applied
  stage(v, S + (L * B + b) * H, H);
  __syncthreads();
  stage(P + ((bppsa_min(2 * size - 1, N - 1) - 1) * B + b) * H, v, H);
  for (idx_t k = 1; k + 1 < K; ++k) {
    const idx_t ek = (k + 1) * size - 1;  // k < K-1, so never clipped
    const idx_t enext = bppsa_min((k + 2) * size - 1, N - 1);
    stage(M, J + ((ek - 1) * B + b) * HH, HH);
    __syncthreads();
    matvec(w, M, v, H);
    __syncthreads();
    stage(P + ((enext - 1) * B + b) * H, w, H);
    T* t = v;
    v = w;
    w = t;
  }
}

#define BPPSA_SCAN_KERNELS(T, SUFFIX)                                                            \
  extern "C" __global__ void bppsa_up_sweep_##SUFFIX(T* J, T* S, T* P, idx_t N, idx_t B,         \
                                                     idx_t H, idx_t first_l, idx_t half,         \
                                                     idx_t step, idx_t d) {                      \
    up_sweep<T>(J, S, N, B, H, first_l, half, step, d);                                          \
  }                                                                                              \
  extern "C" __global__ void bppsa_down_sweep_##SUFFIX(T* J, T* S, T* P, idx_t N, idx_t B,       \
                                                       idx_t H, idx_t first_l, idx_t half,       \
                                                       idx_t step, idx_t d) {                    \
    down_sweep<T>(J, S, P, N, B, H, first_l, half, step, d);                                     \
  }                                                                                              \
  extern "C" __global__ void bppsa_middle_scan_##SUFFIX(T* J, T* S, T* P, idx_t N, idx_t B,      \
                                                        idx_t H, idx_t size, idx_t K, idx_t L,   \
                                                        idx_t unused) {                          \
    middle_scan<T>(J, S, P, N, B, H, size, K, L);                                                \
  }

BPPSA_SCAN_KERNELS(float, f32)
BPPSA_SCAN_KERNELS(double, f64)
