// The factored backward's middle phase in one launch: compiled per hidden size H (NVRTC, -DBPPSA_H=H).
//
// After the up kernel, agg[c][b] (row-major H x H) is chunk c's aggregate; the middle phase writes the carries
//   carries[c + 1][b] = agg[c][b] carries[c][b] (+ off[c][b] in the per-step-gradient scan, mode & 2)
// for c = 0 .. K - 2, from carries[0][b] = g (written by the host).  Block b is batch element b; its W = blockDim.x / 32
// warps split the NT = K - 1 transitions into W segments of L = ceil(NT / W) (plan.middle_geometry):
//   1. warp 0 walks segment 0 from g with mat-vecs, writing its carries; each warp 1 .. Wn - 2 (Wn: the non-empty
//      segments) composes its segment into one affine map [H][H + 1] (lane q < H owns column q of the product, lane H
//      the offset column), kept in shared memory;
//   2. warp 0 applies those maps one after the other: the carry at each segment's start (shared memory);
//   3. each warp 1 .. Wn - 1 walks its segment from that carry with mat-vecs, writing its carries.
// A two-level tree: W = 1 is the plain walk.  Every carry is written once, by one walk, in a fixed order.
// A mat-vec: lane i owns rows i, i + 32, ... of the vector; v_j reaches every lane by __shfl_sync.  Each warp stages
// each aggregate (coalesced loads into registers, D transitions ahead) into its own shared buffer, transposed
// (S[j][i] = M[i][j], pitch P a multiple of 16 bytes): a mat-vec's lanes read consecutive words, a composition reads
// one row of S for all lanes (a broadcast, 16 bytes a load).  Barriers: __syncwarp around each staging, and three
// __syncthreads between the phases.  H > 32: no staging (rows read from global memory) and W = 1 (plan).
//
// The interface is factored.cu's: (agg, off, carries, n, B, H, I, C, pitch, G, mode); H, I, pitch and G are unused.

#if !defined(BPPSA_H)
#error "factored_warp.cu is compiled per hidden size: -DBPPSA_H=<H>"
#endif

typedef long long idx_t;

#ifndef BPPSA_SMEM
extern __shared__ double bppsa_smem_[];
#define BPPSA_SMEM bppsa_smem_
#endif

namespace bppsa_factored_warp {

constexpr int H = BPPSA_H;
constexpr bool STAGE = H <= 32;           // the aggregates go through shared memory
constexpr int R = (H + 31) / 32;          // vector rows a lane owns
constexpr int NS = STAGE ? (H * H + 31) / 32 : 1;  // aggregate elements a lane stages
constexpr bool COMPOSE = H + 1 <= 32;     // a warp can hold a map's H + 1 columns, one a lane
constexpr unsigned FULL = 0xffffffffu;

template <typename T>
struct Layout {
  static constexpr int V = 16 / sizeof(T);
  static constexpr int P = (H + V - 1) / V * V;     // pitch of a staged (transposed) aggregate
  static constexpr int MAT = STAGE ? H * P : 0;     // per warp: the staged aggregate
  static constexpr int MAP = H * (H + 1);           // per composing warp (W > 1): its map, column by column
  // register buffers of the aggregates' stream: up to 4, within 64 32-bit registers (plan.middle_depth)
  static constexpr int D0 = 64 / (NS * int(sizeof(T) / 4));
  static constexpr int D = D0 < 1 ? 1 : (D0 > 4 ? 4 : D0);
};

template <typename T>
__device__ inline void stage_load(T (&buf)[NS], const T* M, unsigned lane) {
#pragma unroll
  for (int r = 0; r < NS; ++r) {
    const unsigned e = r * 32 + lane;
    buf[r] = e < unsigned(H * H) ? M[e] : T(0);
  }
}

// S[j][i] = M[i][j]: the staged aggregate, transposed, at pitch P
template <typename T>
__device__ inline void stage_store(T* S, const T (&buf)[NS], unsigned lane) {
#pragma unroll
  for (int r = 0; r < NS; ++r) {
    const unsigned e = r * 32 + lane;
    if (e < unsigned(H * H)) S[(e % H) * Layout<T>::P + e / H] = buf[r];
  }
}

// out = M v (+ o): M staged in S (STAGE) or read from global memory at Mg; o: nullptr or the offset
template <typename T>
__device__ inline void matvec(T (&out)[R], const T (&v)[R], const T* S, const T* Mg, const T* o, unsigned lane) {
  T a[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const unsigned i = lane + 32 * r;
    a[r] = o != nullptr && i < unsigned(H) ? o[i] : T(0);
  }
#pragma unroll
  for (int j = 0; j < H; ++j) {
    const T vj = __shfl_sync(FULL, v[j / 32], j % 32);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned i = lane + 32 * r;
      if (i < unsigned(H)) a[r] += (STAGE ? S[j * Layout<T>::P + i] : Mg[size_t(i) * H + j]) * vj;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[r] = a[r];
}

// Transitions [t0, t1) of batch element b, one after the other: each one's aggregate staged into S (transposed),
// then body(t).  The aggregates stream through D register buffers, loaded D transitions ahead (the loads' latency
// spread over D steps); the unrolled ring keeps every buffer index a constant.
template <typename T, typename F>
__device__ inline void stream(const T* agg, unsigned t0, unsigned t1, unsigned B, unsigned b, T* S, unsigned lane,
                              F&& body) {
  constexpr int D = Layout<T>::D;
  const size_t HH = size_t(H) * H;
  T buf[D][NS];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (t0 + d < t1) stage_load(buf[d], agg + (size_t(t0 + d) * B + b) * HH, lane);
  for (unsigned t = t0; t < t1; t += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const unsigned u = t + d;
      if (u < t1) {  // the same in every lane
        __syncwarp();  // the previous step's reads of S are done
        stage_store(S, buf[d], lane);
        __syncwarp();
        if (u + D < t1) stage_load(buf[d], agg + (size_t(u + D) * B + b) * HH, lane);
        body(u);
      }
    }
  }
}

// The walk over transitions [t0, t1) from v: carries[t + 1] = agg[t] carries[t] (+ off[t]), each written.
template <typename T>
__device__ void walk(T (&v)[R], const T* agg, const T* off, T* carries, unsigned t0, unsigned t1, unsigned B,
                     unsigned b, T* S, unsigned lane) {
  const size_t HH = size_t(H) * H;
  auto step = [&](unsigned t) {
    const size_t tb = size_t(t) * B + b;
    T w[R];
    matvec(w, v, S, agg + tb * HH, off != nullptr ? off + tb * H : nullptr, lane);
    T* dst = carries + (tb + B) * H;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned i = lane + 32 * r;
      if (i < unsigned(H)) dst[i] = w[r];
      v[r] = w[r];
    }
  };
  if (STAGE) {
    stream(agg, t0, t1, B, b, S, lane, step);
  } else {
    for (unsigned t = t0; t < t1; ++t) step(t);
  }
}

// Transitions [t0, t1) composed into one affine map: lane q < H holds column q of agg[t1-1] ... agg[t0], lane H the
// offset column (zero without offsets); written to A column by column (A[q][i]).  STAGE and COMPOSE only.
template <typename T>
__device__ void compose(T* A, const T* agg, const T* off, unsigned t0, unsigned t1, unsigned B, unsigned b, T* S,
                        unsigned lane) {
  constexpr int P = Layout<T>::P, V = Layout<T>::V;
  struct alignas(16) Vec { T v[V]; };
  T Q[H];
  stream(agg, t0, t1, B, b, S, lane, [&](unsigned t) {
    const size_t tb = size_t(t) * B + b;
    const bool ofs = lane == unsigned(H) && off != nullptr;
    if (t == t0) {  // the first transition: its own columns (S[q][i] = M[i][q]), its offset in lane H
#pragma unroll
      for (int i = 0; i < H; ++i) Q[i] = lane < unsigned(H) ? S[lane * P + i] : (ofs ? off[tb * H + i] : T(0));
      return;
    }
    T N[H];
#pragma unroll
    for (int i = 0; i < H; ++i) N[i] = ofs ? off[tb * H + i] : T(0);
#pragma unroll
    for (int m = 0; m < H; ++m) {  // N += M[:, m] Q[m]: row m of S, the same 16 bytes in every lane
      const Vec* Sm = reinterpret_cast<const Vec*>(S + m * P);
#pragma unroll
      for (int i4 = 0; i4 < P / V; ++i4) {
        const Vec w = Sm[i4];
#pragma unroll
        for (int u = 0; u < V; ++u)
          if (i4 * V + u < H) N[i4 * V + u] += w.v[u] * Q[m];
      }
    }
#pragma unroll
    for (int i = 0; i < H; ++i) Q[i] = N[i];
  });
  if (lane <= unsigned(H)) {
#pragma unroll
    for (int i = 0; i < H; ++i) A[lane * H + i] = Q[i];
  }
}

// v = A v + a: A a composed map, column by column (A[q][i], pitch H), its offset column a = A[H][.]
template <typename T>
__device__ inline void apply_map(T (&v)[R], const T* A, unsigned lane) {
  T a[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const unsigned i = lane + 32 * r;
    a[r] = i < unsigned(H) ? A[H * H + i] : T(0);
  }
#pragma unroll
  for (int j = 0; j < H; ++j) {
    const T vj = __shfl_sync(FULL, v[j / 32], j % 32);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned i = lane + 32 * r;
      if (i < unsigned(H)) a[r] += A[j * H + i] * vj;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = a[r];
}

template <typename T>
__device__ void middle(const T* agg, const T* off, T* carries, unsigned n, unsigned B, unsigned C, bool affine) {
  using Lt = Layout<T>;
  const unsigned b = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, W = blockDim.x / 32;
  const unsigned K = (n + C - 1) / C, NT = K - 1;
  if (NT == 0) return;  // one chunk: nothing to carry (the plan launches no middle phase then)
  const unsigned L = (NT + W - 1) / W, Wn = (NT + L - 1) / L;  // segment length, non-empty segments
  const T* o = affine ? off : nullptr;
  T* sm = reinterpret_cast<T*>(BPPSA_SMEM);
  T* S = sm + warp * Lt::MAT;                 // this warp's staged aggregate
  T* maps = sm + W * Lt::MAT;                 // [W][H + 1][H] (W > 1)
  T* starts = maps + (W > 1 ? W * Lt::MAP : 0);  // [W][H]: the carry at each segment's start
  T v[R];
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned i = lane + 32 * r;
      v[r] = i < unsigned(H) ? carries[size_t(b) * H + i] : T(0);
    }
    walk(v, agg, o, carries, 0, L < NT ? L : NT, B, b, S, lane);
  } else if (COMPOSE && STAGE && warp + 1 < Wn) {
    compose(maps + warp * Lt::MAP, agg, o, warp * L, (warp + 1) * L, B, b, S, lane);
  }
  if (W == 1) return;
  __syncthreads();
  if (warp == 0) {  // the segments' starting carries, one map after the other
    for (unsigned w = 1; w < Wn; ++w) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const unsigned i = lane + 32 * r;
        if (i < unsigned(H)) starts[w * H + i] = v[r];
      }
      if (w + 1 < Wn) apply_map(v, maps + w * Lt::MAP, lane);
    }
  }
  __syncthreads();
  if (warp > 0 && warp < Wn) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned i = lane + 32 * r;
      v[r] = i < unsigned(H) ? starts[warp * H + i] : T(0);
    }
    const unsigned t1 = (warp + 1) * L < NT ? (warp + 1) * L : NT;
    walk(v, agg, o, carries, warp * L, t1, B, b, S, lane);
  }
}

}  // namespace bppsa_factored_warp

#define BPPSA_FACTORED_MIDDLE(T, SUFFIX)                                                                      \
  extern "C" __global__ void bppsa_factored_middle_##SUFFIX(const T* agg, const T* off, T* carries, idx_t n,    \
                                                           idx_t B, idx_t H, idx_t I, idx_t C, idx_t pitch,    \
                                                           idx_t G, idx_t mode) {                              \
    (void)H;                                                                                                  \
    (void)I;                                                                                                  \
    (void)pitch;                                                                                              \
    (void)G;                                                                                                  \
    bppsa_factored_warp::middle<T>(agg, off, carries, (unsigned)n, (unsigned)B, (unsigned)C, (mode & 2) != 0); \
  }

BPPSA_FACTORED_MIDDLE(float, f32)
BPPSA_FACTORED_MIDDLE(double, f64)
