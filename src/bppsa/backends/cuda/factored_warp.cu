// The factored backward's middle and down phases with one warp per batch element or (chunk, batch element) pair:
// compiled per hidden size H and input size I (NVRTC, -DBPPSA_H=H -DBPPSA_I=I; plan.warp_constants).
//
// MIDDLE (bppsa_factored_middle_*), in one launch.
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

#if !defined(BPPSA_H) || !defined(BPPSA_I) || !defined(BPPSA_DOWN_WARP)
#error "factored_warp.cu is compiled per H and I: -DBPPSA_H=<H> -DBPPSA_I=<I> -DBPPSA_DOWN_WARP=<mask>"
#endif

typedef long long idx_t;

#ifndef BPPSA_SMEM
extern __shared__ double bppsa_smem_[];
#define BPPSA_SMEM bppsa_smem_
#endif

namespace bppsa_factored_warp {

constexpr int H = BPPSA_H;
constexpr int I = BPPSA_I;
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

// out = M v (+ o): M's element (i, j) read as at(i, j); o: nullptr or the offset.  out may be v itself: every lane
// reads all of v (shuffles) before any writes
template <typename T, typename At>
__device__ inline void matvec_at(T (&out)[R], const T (&v)[R], At at, const T* o, unsigned lane) {
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
      if (i < unsigned(H)) a[r] += at(i, j) * vj;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[r] = a[r];
}

// out = M v (+ o): M staged in S (STAGE) or read from global memory at Mg
template <typename T>
__device__ inline void matvec(T (&out)[R], const T (&v)[R], const T* S, const T* Mg, const T* o, unsigned lane) {
  matvec_at(out, v, [&](unsigned i, int j) { return STAGE ? S[j * Layout<T>::P + i] : Mg[size_t(i) * H + j]; }, o,
            lane);
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
  matvec_at(v, v, [&](unsigned i, int j) { return A[j * H + i]; }, A + H * H, lane);
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

// DOWN (bppsa_factored_down_warp_{rnn,gru}_*): warp p = blockIdx.x * (blockDim.x / 32) + warp is pair (chunk c,
// batch element b), p = c * B + b, and replays chunk c from carries[c][b] as factored.cu's down kernel does (the same
// modes: 0 the scan's output P, & 1 the pair's sums of the parameter gradients, & 2 c_k injected, & 4 the chunk's
// offset from zero), with no barrier in a step: lane i owns row i (H <= 32) of the vector, of each W_g^T (registers,
// loaded once) and of the gradient rows, whose sums over the chunk it keeps in registers, NBV = I + 1 + H columns each
// (x, 1, h'; the GRU's dN rows x and 1 only, its dM rows 1 and h' only).  A step: t_g = c_g ⊙ v (rnn: d ⊙ v), the
// rows' sums += row ⊙ column; then v <- J_k v (+ c_k).  t_g and the column values (each loaded by one lane) reach every
// lane through the warp's shared buffer, one __syncwarp a step (two buffers, by the step's parity), read as 16-byte
// broadcasts.  The lane's factors, columns and c_k are loaded one step
// ahead.  With the sums, the block's W warps add theirs into shared memory [NA][NBV] one warp after the other (W
// barriers), and the block writes them to accs[blockIdx.x]; bppsa_factored_grads (factored.cu) adds the blocks' sums
// in a fixed order into the flat parameter gradients.
constexpr int NBV = I + 1 + H;
constexpr int NCR = (NBV + 31) / 32;  // column values a lane loads

template <int KIND>
struct Cell {
  static constexpr int NW = KIND == 0 ? 1 : 3, NF = KIND == 0 ? 1 : 5;
  static constexpr int NFL = KIND == 0 ? 1 : 5;  // factor rows a lane reads: d; c_r, c_z, c_n, z, e
  static constexpr int NR = NF * H + I + H;
  static constexpr int NACC = KIND == 0 ? NBV : 2 * NBV + (I + 1) + (1 + H);  // dR, dZ all; dN x, 1; dM 1, h'
  static constexpr int NA = KIND == 0 ? H : 4 * H;
};

// Shared memory of the warp down kernel (elements; plan.down_warp_smem): the block's sums [NA][NBV] (mode & 1), then
// per warp two buffers (the step's parity) of its t_g (NW rows at pitch HP) and column values, 16-byte aligned.
template <typename T, int KIND>
struct DownSmem {
  static constexpr int V = 16 / sizeof(T);
  static constexpr int HP = (H + V - 1) / V * V;
  static constexpr int SUMS = (Cell<KIND>::NA * NBV + V - 1) / V * V;
  static constexpr int TP = Cell<KIND>::NW * HP + (NBV + V - 1) / V * V;  // one buffer
};

// Warp `warp` of the block: pair p; with the sums, added into the block's bsum warp after warp (W barriers).
template <typename T, int KIND>
__device__ void down_pair(const T* Wt, const T* f, const T* carries, const T* cin, T* P, T* bsum, T* wbuf,
                          unsigned n, unsigned B, unsigned C, unsigned mode, unsigned p, unsigned lane, unsigned warp,
                          unsigned W) {
  using Cl = Cell<KIND>;
  constexpr int NW = Cl::NW, NF = Cl::NF, NFL = Cl::NFL;
  const bool sums = mode & 1, inject = mode & 2, offset = mode & 4;
  const unsigned c = p / B, b = p - c * B;
  const unsigned s = c * C, e = (s + C < n ? s + C : n) - 1;
  const bool row = lane < unsigned(H);
  const unsigned i = row ? lane : 0;
  const T one = row ? T(1) : T(0);
  T w[NW][H];  // row i of each W_g^T
#pragma unroll
  for (int g = 0; g < NW; ++g)
#pragma unroll
    for (int m = 0; m < H; ++m) w[g][m] = Wt[(size_t(g) * H + i) * H + m] * one;
  T v = offset ? T(0) : carries[size_t(p) * H + i] * one;
  T acc[Cl::NACC];
#pragma unroll
  for (int q = 0; q < Cl::NACC; ++q) acc[q] = T(0);
  const size_t stride = size_t(Cl::NR) * B;
  // the step's factors, column values and c_k, and the next step's
  T fac[NFL], col[NCR], ck = T(0), facN[NFL], colN[NCR], ckN = T(0);
  auto load = [&](unsigned k, T (&fa)[NFL], T (&co)[NCR], T& cv) {
    const T* fk = f + size_t(k) * stride + b;
#pragma unroll
    for (int g = 0; g < NFL; ++g) fa[g] = fk[size_t(g * H + i) * B];
#pragma unroll
    for (int r = 0; r < NCR; ++r) {
      const unsigned q = lane + 32 * r;
      co[r] = q < unsigned(I) ? fk[size_t(NF * H + q) * B]
              : q == unsigned(I) ? T(1)
              : q < unsigned(NBV) ? fk[size_t(NF * H + q - 1) * B] : T(0);
    }
    cv = inject ? cin[(size_t(k) * B + b) * H + i] : T(0);
  };
  load(s, facN, colN, ckN);
  for (unsigned k = s; k <= e; ++k) {
#pragma unroll
    for (int g = 0; g < NFL; ++g) fac[g] = facN[g];
#pragma unroll
    for (int r = 0; r < NCR; ++r) col[r] = colN[r];
    ck = ckN;
    if (k < e) load(k + 1, facN, colN, ckN);
    if (!sums && !offset && row) P[(size_t(k) * B + b) * H + i] = v;
    T t[NW];
    if (KIND == 0) {
      t[0] = v * fac[0];  // the pre-activation's gradient d ⊙ v, and the mat-vec's operand
    } else {
      t[0] = v * fac[0];  // dR = v ⊙ c_r
      t[1] = v * fac[1];  // dZ = v ⊙ c_z
      t[2] = v * fac[2];  // dM = v ⊙ c_n
    }
    // this step's buffer (by parity): t_g at g * HP, the column values after; one __syncwarp: a lane reaches the
    // next step's writes into this buffer only after every lane has passed the next step's __syncwarp
    using Sm = DownSmem<T, KIND>;
    using Vec = struct alignas(16) { T v[Sm::V]; };
    T* tb = wbuf + (k & 1) * Sm::TP;
    if (row) {
#pragma unroll
      for (int g = 0; g < NW; ++g) tb[g * Sm::HP + i] = t[g];
    }
    if (sums) {
#pragma unroll
      for (int r = 0; r < NCR; ++r)
        if (lane + 32 * r < unsigned(NBV)) tb[NW * Sm::HP + lane + 32 * r] = col[r];
    }
    __syncwarp();
    if (sums) {
      const T dn = KIND == 0 ? T(0) : v * fac[NFL - 1];  // dN = v ⊙ e
      const Vec* cv = reinterpret_cast<const Vec*>(tb + NW * Sm::HP);
#pragma unroll
      for (int q4 = 0; q4 < (NBV + Sm::V - 1) / Sm::V; ++q4) {
        const Vec c4 = cv[q4];  // the same 16 bytes in every lane
#pragma unroll
        for (int u = 0; u < Sm::V; ++u) {
          const int q = q4 * Sm::V + u;
          if (q >= NBV) continue;
          const T cq = c4.v[u];
          if (KIND == 0) {
            acc[q] += t[0] * cq;
          } else {
            acc[q] += t[0] * cq;
            acc[NBV + q] += t[1] * cq;
            if (q <= I) acc[2 * NBV + q] += dn * cq;
            if (q >= I) acc[2 * NBV + (I + 1) + (q - I)] += t[2] * cq;
          }
        }
      }
    }
    if (k < e || offset) {  // v <- J_k v (+ c_k)
      T a[NW];
#pragma unroll
      for (int g = 0; g < NW; ++g) a[g] = T(0);
#pragma unroll
      for (int g = 0; g < NW; ++g) {
        const Vec* tv = reinterpret_cast<const Vec*>(tb + g * Sm::HP);
#pragma unroll
        for (int m4 = 0; m4 < Sm::HP / Sm::V; ++m4) {
          const Vec t4 = tv[m4];
#pragma unroll
          for (int u = 0; u < Sm::V; ++u)
            if (m4 * Sm::V + u < H) a[g] += w[g][m4 * Sm::V + u] * t4.v[u];
        }
      }
      T nv = KIND == 0 ? a[0] : (fac[3] * v + a[0]) + (a[1] + a[2]);
      nv = (nv + ck) * one;
      if (offset && k == e && row) P[size_t(p) * H + i] = nv;  // the chunk's offset
      v = nv;
    }
  }
  if (!sums) return;
  for (unsigned w = 0; w < W; ++w) {  // the warps' sums into the block's, in warp order
    __syncthreads();
    if (w != warp || !row) continue;
#pragma unroll
    for (int q = 0; q < NBV; ++q) bsum[i * NBV + q] += acc[q];
    if (KIND == 1) {
#pragma unroll
      for (int q = 0; q < NBV; ++q) bsum[(H + i) * NBV + q] += acc[NBV + q];
#pragma unroll
      for (int q = 0; q <= I; ++q) bsum[(2 * H + i) * NBV + q] += acc[2 * NBV + q];
#pragma unroll
      for (int q = I; q < NBV; ++q) bsum[(3 * H + i) * NBV + q] += acc[2 * NBV + (I + 1) + (q - I)];
    }
  }
}


template <typename T, int KIND>
__device__ void down_warp(const T* Wt, const T* f, const T* carries, const T* cin, T* P, T* accs, unsigned n,
                          unsigned B, unsigned C, unsigned mode) {
  const bool sums = mode & 1;
  constexpr int NA = KIND == 0 ? H : 4 * H;
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, W = blockDim.x / 32;
  const unsigned K = (n + C - 1) / C;
  using Sm = DownSmem<T, KIND>;
  T* bsum = reinterpret_cast<T*>(BPPSA_SMEM);  // the block's sums [NA][NBV] (mode & 1)
  T* wbuf = bsum + (sums ? Sm::SUMS : 0) + warp * 2 * Sm::TP;  // this warp's two step buffers
  if (sums)
    for (unsigned q = threadIdx.x; q < unsigned(NA * NBV); q += blockDim.x) bsum[q] = T(0);
  const unsigned p = blockIdx.x * W + warp;
  if (p < K * B) down_pair<T, KIND>(Wt, f, carries, cin, P, bsum, wbuf, n, B, C, mode, p, lane, warp, W);
  else if (sums) for (unsigned w = 0; w < W; ++w) __syncthreads();  // the barriers of the block's sums
  if (sums) {
    __syncthreads();
    T* out = accs + size_t(blockIdx.x) * NA * NBV;
    for (unsigned q = threadIdx.x; q < unsigned(NA * NBV); q += blockDim.x) out[q] = bsum[q];
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

#define BPPSA_FACTORED_DOWN_WARP(T, SUFFIX, KIND, NAME)                                                        \
  extern "C" __global__ void bppsa_factored_down_warp_##NAME##_##SUFFIX(                                      \
      const T* Wt, const T* f, const T* carry, const T* cin, T* P, T* acc, idx_t n, idx_t B, idx_t H, idx_t I,  \
      idx_t C, idx_t pitch, idx_t G, idx_t mode) {                                                            \
    (void)H;                                                                                                  \
    (void)I;                                                                                                  \
    (void)pitch;                                                                                              \
    (void)G;                                                                                                  \
    bppsa_factored_warp::down_warp<T, KIND>(Wt, f, carry, cin, P, acc, (unsigned)n, (unsigned)B, (unsigned)C, \
                                            (unsigned)mode);                                                  \
  }

// BPPSA_DOWN_WARP: which down kernels fit their registers (plan.down_warp_fits): 1 rnn f32, 2 rnn f64, 4 gru f32,
// 8 gru f64; the plan takes factored.cu's down kernel for the others.
#if BPPSA_DOWN_WARP & 1
BPPSA_FACTORED_DOWN_WARP(float, f32, 0, rnn)
#endif
#if BPPSA_DOWN_WARP & 2
BPPSA_FACTORED_DOWN_WARP(double, f64, 0, rnn)
#endif
#if BPPSA_DOWN_WARP & 4
BPPSA_FACTORED_DOWN_WARP(float, f32, 1, gru)
#endif
#if BPPSA_DOWN_WARP & 8
BPPSA_FACTORED_DOWN_WARP(double, f64, 1, gru)
#endif
