/* The BPPSA scan over a tanh RNN's factored chain on a CPU, for one slice of batch lanes.
 *
 * Compiled at first use by bppsa.kernels.native (cc -O3 -march=native) once per hidden size HID,
 * lane count LANES and REAL type, and called through ctypes (the GIL released; a thread runs a slice,
 * or a range of a slice's blocks in the phases chain_up / chain_tree / chain_down).
 *
 * Layout: the LANES batch elements of a slice are the vector dimension of every operation: a
 * matrix is [H][H][LANES], a vector [H][LANES], so each of the H^3 multiply-adds of a product is
 * one vector FMA across independent chains, with no horizontal sums: each lane's sums run in the
 * order of the plain loops.
 *
 * The chain (scan order, k = 0 .. n-1): J_k = W^T diag(d_k), kept as its factors Wt = W_hh^T and
 * d [n][H][B] (lane-major over the whole batch B; this slice reads lanes b0 .. b0 + LANES - 1).
 *
 * The scan is the tree of bppsa.scan.blelloch_scan with L up-sweep levels, its lowest c of them
 * computed per block instead of level by level: the entries of level c are products of 2^c
 * consecutive Jacobians (the last one clipped at J_{n-1}; the first block starts at J_{2^c - 1},
 * the 2^c - 1 before it are the spine), so each is accumulated in cache straight from the factors,
 * M <- M J_s = (M Wt) diag(d_s), and no lower level is ever stored; the down-sweep of those c levels
 * is, per block, the sequence of factored mat-vecs out[s+1] = Wt (d_s * out[s]) from the block's
 * prefix.  Levels c .. L-1 and the linear middle are the reference tree on the stored level-c array.
 */
#include <string.h>

#define H HID
#define NL LANES
typedef REAL real;
/* One vector of the slice's lanes (NL a power of two, at most one 64-byte register; 1: a scalar). */
#if NL == 1
typedef real vec;
#else
typedef real vec __attribute__((vector_size(NL * sizeof(real)), aligned(sizeof(real))));
#endif
#define LD(p) (*(const vec *)(p))
#define ST(p) (*(vec *)(p))
#define UNROLL _Pragma("GCC unroll 64")

/* -- lane kernels (a row's H accumulators stay in registers) --------------------------------------- */

/* C = X Y, per lane. */
static void mat_mat(const real *restrict X, const real *restrict Y, real *restrict C) {
    for (int i = 0; i < H; ++i) {
        vec acc[H];
        UNROLL for (int l = 0; l < H; ++l) acc[l] = (vec){0};
        for (int m = 0; m < H; ++m) {
            vec x = LD(X + (i * H + m) * NL);
            const real *y = Y + m * H * NL;
            UNROLL for (int l = 0; l < H; ++l) acc[l] += x * LD(y + l * NL);
        }
        UNROLL for (int l = 0; l < H; ++l) ST(C + (i * H + l) * NL) = acc[l];
    }
}

/* v = A q, per lane (v must not alias q). */
static void mat_vec(const real *restrict A, const real *restrict q, real *restrict v) {
    for (int i = 0; i < H; ++i) {
        vec acc = (vec){0};
        UNROLL for (int m = 0; m < H; ++m) acc += LD(A + (i * H + m) * NL) * LD(q + m * NL);
        ST(v + i * NL) = acc;
    }
}

/* v = J_s q = Wt (d_s * q), per lane; ds points at lane b0 of d_s, rows ldd apart. */
static void jac_vec(const real *restrict Wt, const real *restrict ds, long ldd, const real *restrict q,
                    real *restrict v) {
    vec t[H];
    UNROLL for (int m = 0; m < H; ++m) t[m] = LD(ds + m * ldd) * LD(q + m * NL);
    for (int i = 0; i < H; ++i) {
        vec acc = (vec){0};
        UNROLL for (int m = 0; m < H; ++m) acc += Wt[i * H + m] * t[m];
        ST(v + i * NL) = acc;
    }
}

/* M = J_s = Wt diag(d_s). */
static void jac_set(const real *restrict Wt, const real *restrict ds, long ldd, real *restrict M) {
    for (int i = 0; i < H; ++i)
        UNROLL for (int l = 0; l < H; ++l) ST(M + (i * H + l) * NL) = Wt[i * H + l] * LD(ds + l * ldd);
}

/* M <- M J_s = (M Wt) diag(d_s), in place row by row. */
static void mul_jac(real *restrict M, const real *restrict Wt, const real *restrict ds, long ldd) {
    for (int i = 0; i < H; ++i) {
        vec acc[H];
        UNROLL for (int l = 0; l < H; ++l) acc[l] = (vec){0};
        for (int m = 0; m < H; ++m) {
            vec x = LD(M + (i * H + m) * NL);
            UNROLL for (int l = 0; l < H; ++l) acc[l] += x * Wt[m * H + l];
        }
        UNROLL for (int l = 0; l < H; ++l) ST(M + (i * H + l) * NL) = acc[l] * LD(ds + l * ldd);
    }
}

/* -- the dense tree (bppsa.kernels.cpu._tree, per lane) ------------------------------------------ */

#define MAT ((long)H * H * NL)
#define VEC ((long)H * NL)

/* Scratch a tree over n entries with L levels uses (reals). */
static long tree_work(long n, int L) {
    if (L == 0 || n == 0) return 0;
    long m = n / 2; /* pairs + carry */
    return m * MAT + VEC + m * VEC + tree_work(m, L - 1);
}

/* out[k] = A[k-1] ... A[0] spine for k = 0 .. n-1, with L up-sweep levels, then the linear middle. */
static void tree(const real *spine, const real *A, real *out, long n, int L, real *work) {
    if (n == 0) return;
    memcpy(out, spine, sizeof(real) * VEC);
    if (L == 0) {
        for (long k = 1; k < n; ++k) mat_vec(A + (k - 1) * MAT, out + (k - 1) * VEC, out + k * VEC);
        return;
    }
    long pairs = (n - 1) / 2, carry = (n - 1) % 2, m = pairs + carry;
    real *nxt = work, *sp = nxt + m * MAT, *Q = sp + VEC;
    for (long j = 0; j < pairs; ++j) mat_mat(A + (2 * j + 2) * MAT, A + (2 * j + 1) * MAT, nxt + j * MAT);
    if (carry) memcpy(nxt + pairs * MAT, A + (n - 1) * MAT, sizeof(real) * MAT);
    mat_vec(A, spine, sp);
    tree(sp, nxt, Q, m, L - 1, Q + m * VEC);
    for (long j = 0; j < pairs; ++j) {
        memcpy(out + (2 * j + 1) * VEC, Q + j * VEC, sizeof(real) * VEC);
        mat_vec(A + (2 * j + 1) * MAT, Q + j * VEC, out + (2 * j + 2) * VEC);
    }
    if (carry) memcpy(out + (n - 1) * VEC, Q + pairs * VEC, sizeof(real) * VEC);
}

/* -- the entry points ---------------------------------------------------------------------------- */

/* Write v (lanes) as out[k][b0 + b][i] of the [n][B][H] output. */
static void put(real *out, long k, long B, long b0, const real *v) {
    real *o = out + (k * B + b0) * H;
    for (int b = 0; b < NL; ++b)
        for (int i = 0; i < H; ++i) o[b * H + i] = v[i * NL + b];
}

/* The blocks of level c (0 where the tree has no levels); block j holds J_lo .. J_hi. */
long chain_blocks(long n, int L, int c) { return L == 0 ? 0 : n >> (c < L ? c : L); }

static void block_range(long j, long n, int c, long *lo, long *hi) {
    long size = 1L << c;
    *lo = (j + 1) * size - 1;
    *hi = *lo + size - 1 < n - 1 ? *lo + size - 1 : n - 1;
}

/* The scan runs in three phases over one lane slice b0 .. b0 + LANES - 1 of the batch; the first and
 * the last split into independent ranges of blocks [j0, j1) (one per thread), the middle is serial.
 * work (chain_scan_work reals) holds the blocks' products A, their prefixes Q and the tree's scratch. */

/* Up: A[j] = J_hi ... J_lo for the blocks j0 .. j1 - 1, accumulated in cache from the factors. */
void chain_up(const real *Wt, const real *d, long n, long B, long b0, int L, int c, long j0, long j1, real *work) {
    if (c > L) c = L;
    const long dstep = (long)H * B;
    const real *dl = d + b0;
    for (long j = j0; j < j1; ++j) {
        long lo, hi;
        block_range(j, n, c, &lo, &hi);
        real *M = work + j * MAT;
        jac_set(Wt, dl + hi * dstep, B, M);
        for (long s = hi - 1; s >= lo; --s) mul_jac(M, Wt, dl + s * dstep, B);
    }
}

/* Middle: out[0 .. 2^c - 1] (g, then the spine's mat-vecs) and the tree above level c: Q[j], the
 * prefix at each block's first position.  Without blocks the spine is the whole (sequential) scan. */
void chain_tree(const real *Wt, const real *d, const real *g, real *out, long n, long B, long b0, int L, int c,
                real *work) {
    if (n <= 0) return;
    if (c > L) c = L;
    const long dstep = (long)H * B;
    const real *dl = d + b0;
    real v[H * NL] __attribute__((aligned(64))), u[H * NL] __attribute__((aligned(64)));
    for (int i = 0; i < H; ++i)
        for (int b = 0; b < NL; ++b) v[i * NL + b] = g[(b0 + b) * H + i];
    put(out, 0, B, b0, v);
    long nc = chain_blocks(n, L, c), spine_end = nc ? (1L << c) - 1 : n - 1;
    for (long s = 0; s < spine_end; ++s) {
        jac_vec(Wt, dl + s * dstep, B, v, u);
        memcpy(v, u, sizeof(v));
        put(out, s + 1, B, b0, v);
    }
    if (nc == 0) return;
    real *A = work, *Q = A + nc * MAT, *sp = Q + nc * VEC;
    memcpy(sp, v, sizeof(v)); /* = out[2^c - 1], the first block's prefix */
    tree(sp, A, Q, nc, L - c, sp + VEC);
}

/* Down: each block j0 .. j1 - 1 from its prefix, by the factored mat-vecs out[s+1] = Wt (d_s * out[s]). */
void chain_down(const real *Wt, const real *d, real *out, long n, long B, long b0, int L, int c, long j0, long j1,
                real *work) {
    if (c > L) c = L;
    const long dstep = (long)H * B;
    const real *dl = d + b0, *Q = work + chain_blocks(n, L, c) * MAT;
    real v[H * NL] __attribute__((aligned(64))), u[H * NL] __attribute__((aligned(64)));
    for (long j = j0; j < j1; ++j) {
        long lo, hi;
        block_range(j, n, c, &lo, &hi);
        memcpy(v, Q + j * VEC, sizeof(v));
        if (j > 0) put(out, lo, B, b0, v); /* block 0's prefix is the spine's end, written already */
        for (long s = lo; s < hi; ++s) {
            jac_vec(Wt, dl + s * dstep, B, v, u);
            memcpy(v, u, sizeof(v));
            put(out, s + 1, B, b0, v);
        }
    }
}

/* Scratch (in reals) for n Jacobians, L levels, c of them fused. */
long chain_scan_work(long n, int L, int c) {
    if (c > L) c = L;
    long nc = chain_blocks(n, L, c);
    return nc ? nc * MAT + nc * VEC + VEC + tree_work(nc, L - c) : 0;
}

/* -- one batch element, its blocks as the lanes ---------------------------------------------------
 * For a slice of a single batch element (B = 1, say) the lanes would hold one chain and the vector
 * units idle; these run LANES full blocks (2^c Jacobians each) of batch element b0 side by side
 * instead, reading and writing the one-lane layout ([H][H] and [H] per block) of the kernel built
 * for LANES = 1: work1 is that kernel's scratch, j0 .. j1 - 1 full blocks (a last group of fewer
 * than LANES repeats its last block in the spare lanes and drops their results). */

/* The lanes' d rows at offset off of their blocks: dst[m][q] = d_{lo + off}[m] of batch element b0
 * for block min(j + q, last). */
static void gather_d(const real *d, long B, long b0, long j, long last, int c, long off, real *dst) {
    for (int q = 0; q < NL; ++q) {
        long jq = j + q < last ? j + q : last;
        const real *src = d + (((jq + 1) * (1L << c) - 1 + off) * H) * B + b0;
        for (int m = 0; m < H; ++m) dst[m * NL + q] = src[m * B];
    }
}

void chain_up_lanes(const real *Wt, const real *d, long n, long B, long b0, int L, int c, long j0, long j1,
                    real *work1) {
    if (c > L) c = L;
    real M[H * H * NL] __attribute__((aligned(64))), ds[H * NL] __attribute__((aligned(64)));
    long size = 1L << c;
    for (long j = j0; j < j1; j += NL) {
        gather_d(d, B, b0, j, j1 - 1, c, size - 1, ds);
        jac_set(Wt, ds, NL, M);
        for (long off = size - 2; off >= 0; --off) {
            gather_d(d, B, b0, j, j1 - 1, c, off, ds);
            mul_jac(M, Wt, ds, NL);
        }
        for (int q = 0; q < NL && j + q < j1; ++q)
            for (int e = 0; e < H * H; ++e) work1[(j + q) * H * H + e] = M[e * NL + q];
    }
}

void chain_down_lanes(const real *Wt, const real *d, real *out, long n, long B, long b0, int L, int c, long j0,
                      long j1, real *work1) {
    if (c > L) c = L;
    long nc = chain_blocks(n, L, c), size = 1L << c;
    const real *Q = work1 + nc * H * H; /* the one-lane kernel's prefixes, [nc][H] */
    real v[H * NL] __attribute__((aligned(64))), u[H * NL] __attribute__((aligned(64))),
        ds[H * NL] __attribute__((aligned(64)));
    for (long j = j0; j < j1; j += NL) {
        int valid = j1 - j < NL ? (int)(j1 - j) : NL;
        for (int q = 0; q < NL; ++q)
            for (int i = 0; i < H; ++i) v[i * NL + q] = Q[(j + (q < valid ? q : valid - 1)) * H + i];
        for (long off = 0; off < size - 1; ++off) {
            gather_d(d, B, b0, j, j1 - 1, c, off, ds);
            jac_vec(Wt, ds, NL, v, u);
            memcpy(v, u, sizeof(v));
            for (int q = 0; q < valid; ++q) {
                real *o = out + (((j + q + 1) * size - 1 + off + 1) * B + b0) * H;
                for (int i = 0; i < H; ++i) o[i] = v[i * NL + q];
            }
        }
        for (int q = 0; q < valid; ++q) { /* each block's own first position: its prefix */
            if (j + q == 0) continue;     /* block 0's is the spine's end, written already */
            real *o = out + (((j + q + 1) * size - 1) * B + b0) * H;
            for (int i = 0; i < H; ++i) o[i] = Q[(j + q) * H + i];
        }
    }
}
