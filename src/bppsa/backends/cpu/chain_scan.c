/* The BPPSA scan over a recurrent network's factored Jacobian chain on a CPU, for one slice of batch lanes.
 *
 * Compiled at first use by bppsa.backends.cpu.native (cc -O3 -march=native) once per chain KIND, state size
 * HID (the hidden size; the LSTM's [h; c]: twice it), lane count LANES and REAL type -- the input size is the
 * call's (chain_src.ni, the factor builders' ni), so one build serves every layer of a stack -- and called
 * through ctypes (the GIL released): one call, team_go, runs a whole scan on a team of threads (the caller and a
 * pool of pthreads), which claim its units -- ranges of a slice's blocks in the phases chain_up / chain_tree / chain_down --
 * as they come (the end of this file).
 *
 * Layout: the LANES batch elements of a slice are the vector dimension of every operation: a matrix is
 * [H][H][LANES], a vector [H][LANES], so each of the H^3 multiply-adds of a product is one vector FMA
 * across independent chains, with no horizontal sums: each lane's sums run in the order of the plain loops.
 *
 * The chains (scan order, positions s = 0 .. n-1), never stored as matrices: each is kept as its weights
 * Wt (NW matrices W^T, [NW][HC][HC]) and per-step factors f [steps][NF][HC][B] (lane-major over the whole
 * batch B; a slice reads its nw <= LANES lanes b0 .. b0 + nw - 1):
 *   KIND 0, the RNN's fused layout:  J_s = Wt diag(d_s)                     (NF = 1: d = 1 - h^2, or with
 *                                    ACT 1 relu's 1[h > 0], read from the states h themselves; n = T)
 *   KIND 1, the RNN's paper layout:  J_2k = diag(d_k), J_2k+1 = Wt          (NF = 1; n = 2T)
 *   KIND 2, the GRU (Appendix E):    J_s = sum_g Wt_g diag(c_g,s) + diag(z_s)  (NF = 5: c_r, c_z, c_n, z, e
 *                                    with e = (1 - z)(1 - n^2); Wt_g = W_hg^T for g = r, z, n)
 *   KIND 3, the LSTM without projection, over the state s = [h; c] (H = 2 HC, HC the cell's hidden size):
 *                                    J_s = [[A_s, Bm_s], [diag(f a), diag(f)]] with Bm = sum_{q=i,f,g} Wt_q diag(c_q)
 *                                    and A = Bm diag(a) + Wt_o diag(co)   (NF = 6: a, ci, cf, cg, co, f, each HC;
 *                                    Wt_q = W_hq^T [HC][HC] for q = i, f, g, o)
 *   J_s is never built whole in the fused levels: a mat-vec is dc = l_c + a l_h, l_h' = sum_{q=i,f,g} Wt_q (c_q dc)
 *   + Wt_o (co l_h), l_c' = f dc (4 HC^2 multiply-adds straight from the factors, where a dense J_s would cost
 *   ~5 HC^2 to build before its 4 HC^2), and a product M <- M J_s is [M_h A + M_c diag(f a), M_h Bm + M_c diag(f)]
 *   (M_h, M_c: M's column halves; A and Bm built per step, 5 HC^2): 4 HC^3 = H^3 / 2, not the dense H^3.
 *
 * The scan is the tree of bppsa.scan.blelloch_scan with L up-sweep levels, its lowest c of them computed
 * per block instead of level by level: the entries of level c are products of 2^c consecutive Jacobians
 * (the last one clipped at J_{n-1}; the first block starts at J_{2^c - 1}, the 2^c - 1 before it are the
 * spine), so each is accumulated in cache straight from the factors, M <- M J_s, and no lower level is
 * ever stored; the down-sweep of those c levels is, per block, the sequence of factored mat-vecs
 * out[s+1] = J_s out[s] from the block's prefix.  Levels c .. L-1 and the linear middle are the reference
 * tree on the stored level-c array.  L = 0 is the sequential backward: the spine is the whole chain.
 *
 * Where the loss reads every state, not only h_T (S.c: its direct gradients, in scan order), the backward is the
 * affine recurrence out[s+1] = J_s out[s] + c_s: each block also carries its offset (its positions replayed from 0 with the
 * gradients injected: H^2 per step beside the product's H^3), the tree combines the pairs (A2, b2) o (A1, b1) =
 * (A2 A1, A2 b1 + b2), and the spine and the down phase add each position's gradient as they pass it.  (The
 * blocks-as-lanes path of one batch element does not take it: bppsa.backends.cpu.native.Team never uses it then.)
 *
 * Each step's factors also hold what the parameter gradients need beside the step's gradient: x_t (ni rows)
 * and h' = h_{t-1} (HC rows), so f is [steps][NR][B] with NR = NF*HC + ni + HC rows.
 *
 * Output (runtime `mode`): 0 = the scan itself, out [n][B][H] in scan order; 1 = the cell's parameter
 * gradients, accumulated per lane as the prefixes come out (groups of GRP positions, register tiles), into
 * acc [NA][NBV][LANES]: rows a = the step's gradient w.r.t. the pre-activations (the RNN: grad a_t =
 * out_k * d_k, H rows, at the fused layout's every position or the paper layout's odd ones; the GRU: (dR, dZ,
 * dN, dM) = grad_h * (c_r, c_z, e, c_n), 4H rows; the LSTM: dpre = (ci dc, cf dc, cg dc, co l_h), 4 HC rows), columns
 * c = (x_t, 1, h'): so acc holds the sums over t and the lanes of the weight and bias gradients, which the caller
 * adds over lanes and slices.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define H HID /* the scan's state: every vector, matrix and prefix is H wide */
#ifndef ACT
#define ACT 0 /* the RNN's nonlinearity: 0 tanh, 1 relu */
#endif
#if KIND == 3
#define HC (HID / 2) /* the cell's hidden size: the weights, the factor rows, h' */
_Static_assert(HID % 2 == 0, "the LSTM's state [h; c] has an even size");
#else
#define HC HID
#endif
#define NL LANES
typedef REAL real;

#include "simd.h"
#define ACC (NREG - 4)
#define RVL (VREG_BYTES / (int)sizeof(real)) /* reals per register */

/* One vector of the slice's lanes (NL a power of two, at most one register; 1: a scalar). */
_Static_assert(NL >= 1 && (NL & (NL - 1)) == 0 && NL * sizeof(real) <= VREG_BYTES,
               "LANES must be a power of two whose vector fits one register of the target");
#if NL == 1
typedef real vec;
#else
typedef real vec __attribute__((vector_size(NL * sizeof(real)), aligned(sizeof(real))));
#endif
/* Column tiles of a row of H accumulators: NT tiles of CT (the last one CTL), each within ACC registers. */
#define NT ((H + ACC - 1) / ACC)
#define CT ((H + NT - 1) / NT)
#define CTL (H - (NT - 1) * CT)
/* The same for a row of HC (the LSTM's column blocks). */
#define NTC ((HC + ACC - 1) / ACC)
#define CTC ((HC + NTC - 1) / NTC)
#define CTLC (HC - (NTC - 1) * CTC)
#define LD(p) (*(const vec *)(p))
#define ST(p) (*(vec *)(p))
#define UNROLL _Pragma("GCC unroll 64")
#define MAT ((long)H * H * NL)
#define VEC ((long)H * NL)

#if KIND == 2
#define NF 5
#define NW 3
#define NA (4 * H)
#elif KIND == 3
#define NF 6
#define NW 4
#define NA (4 * HC)
#else
#define NF 1
#define NW 1
#define NA H
#endif
#define NBV (ni + 1 + HC)         /* the accumulated columns: x_t, 1, h' (ni: the call's input size, in scope) */
#define NR (NF * HC + ni + HC)    /* rows of a step's factors */
#define XROW (NF * HC)            /* where x_t starts among them, then h' */
#define GRP 16                    /* positions per accumulation group */

/* The factor step that position s reads (the paper layout's two positions per step share d_k). */
static inline long fstep(long s) {
#if KIND == 1
    return s >> 1;
#else
    return s;
#endif
}

/* -- dense lane kernels: a row's accumulators in registers, CT columns at a time --------------------- */
#define AI inline __attribute__((always_inline))

/* c[l0 .. l0+W) = x Y (x a row of H lane vectors, Y [H][H] per lane).  x may be c's row (in place, NT = 1):
 * every read comes before the stores. */
static AI void mm_tile(const real *x, const real *restrict Y, real *c, int l0, int W) {
    vec acc[CT];
    UNROLL for (int l = 0; l < W; ++l) acc[l] = (vec){0};
    for (int m = 0; m < H; ++m) {
        vec xm = LD(x + m * NL);
        const real *y = Y + (m * H + l0) * NL;
        UNROLL for (int l = 0; l < W; ++l) acc[l] += xm * LD(y + l * NL);
    }
    UNROLL for (int l = 0; l < W; ++l) ST(c + (l0 + l) * NL) = acc[l];
}

/* The same with Wt (one of the weights, broadcast to every lane) for Y, the columns then scaled by d where
 * d is given. */
static AI void wt_tile(const real *x, const real *restrict Wt, const real *restrict d, long ldd, real *c, int l0,
                       int W) {
    vec acc[CT];
    UNROLL for (int l = 0; l < W; ++l) acc[l] = (vec){0};
    for (int m = 0; m < H; ++m) {
        vec xm = LD(x + m * NL);
        UNROLL for (int l = 0; l < W; ++l) acc[l] += xm * Wt[m * H + l0 + l];
    }
    if (d) {
        UNROLL for (int l = 0; l < W; ++l) ST(c + (l0 + l) * NL) = acc[l] * LD(d + (l0 + l) * ldd);
    } else {
        UNROLL for (int l = 0; l < W; ++l) ST(c + (l0 + l) * NL) = acc[l];
    }
}

/* Row i of an in-place product reads the whole row before its first tile is written: with several tiles, from
 * a copy. */
#if NT > 1
#define ROW_SRC(Mi) real row_[H * NL] __attribute__((aligned(64))); memcpy(row_, (Mi), sizeof row_); const real *x_ = row_
#else
#define ROW_SRC(Mi) const real *x_ = (Mi)
#endif

/* C = X Y, per lane. */
static void mat_mat(const real *restrict X, const real *restrict Y, real *restrict C) {
    for (int i = 0; i < H; ++i) {
        for (int t = 0; t + 1 < NT; ++t) mm_tile(X + i * H * NL, Y, C + i * H * NL, t * CT, CT);
        mm_tile(X + i * H * NL, Y, C + i * H * NL, (NT - 1) * CT, CTL);
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

#if KIND < 2
/* M <- M Wt (one of the weights, broadcast to every lane), in place row by row; then scaled by the
 * columns' d where d is given. */
static void mul_wt(real *restrict M, const real *restrict Wt, const real *restrict d, long ldd) {
    for (int i = 0; i < H; ++i) {
        real *Mi = M + i * H * NL;
        ROW_SRC(Mi);
        for (int t = 0; t + 1 < NT; ++t) wt_tile(x_, Wt, d, ldd, Mi, t * CT, CT);
        wt_tile(x_, Wt, d, ldd, Mi, (NT - 1) * CT, CTL);
    }
}
#endif

/* -- the chain: J_s from the factors fs of its step (row r of the step's factors at fs + r * ld) ------ */

#if KIND == 3
/* Row l of the LSTM's factor r (0 .. 5: a, ci, cf, cg, co, f), every lane. */
#define FROW(r, l) LD(fs + ((r) * HC + (l)) * ld)

/* The top blocks of J_s, per lane: Bm = sum_{q=i,f,g} Wt_q diag(c_q) and A = Bm diag(a) + Wt_o diag(co), in the
 * order of bppsa.jacobians.lstm.lstm_jacobians_t; element (i, l) of each at (i * pitch + l) * NL (Bm: none where
 * NULL). */
static void lstm_blocks(const real *restrict Wt, const real *restrict fs, long ld, real *A, real *Bm, int pitch) {
    const real *W0 = Wt, *W1 = Wt + HC * HC, *W2 = Wt + 2 * HC * HC, *W3 = Wt + 3 * HC * HC;
    for (int i = 0; i < HC; ++i)
        UNROLL for (int l = 0; l < HC; ++l) {
            vec b = W0[i * HC + l] * FROW(1, l);
            b += W1[i * HC + l] * FROW(2, l);
            b += W2[i * HC + l] * FROW(3, l);
            vec a = b * FROW(0, l);
            a += W3[i * HC + l] * FROW(4, l);
            ST(A + ((long)i * pitch + l) * NL) = a;
            if (Bm) ST(Bm + ((long)i * pitch + l) * NL) = b;
        }
}

/* c[l0 .. l0+W) = x Y + y * dg over those columns (x: a row's HC lane vectors; Y [HC][HC] per lane; y, dg: HC lane
 * vectors).  y may be c (each column is read before it is written). */
static AI void lc_tile(const real *restrict x, const real *restrict Y, const real *y, const real *restrict dg,
                       real *c, int l0, int W) {
    vec acc[CTC];
    UNROLL for (int l = 0; l < W; ++l) acc[l] = LD(y + (l0 + l) * NL) * LD(dg + (l0 + l) * NL);
    for (int m = 0; m < HC; ++m) {
        vec xm = LD(x + m * NL);
        const real *yr = Y + (m * HC + l0) * NL;
        UNROLL for (int l = 0; l < W; ++l) acc[l] += xm * LD(yr + l * NL);
    }
    UNROLL for (int l = 0; l < W; ++l) ST(c + (l0 + l) * NL) = acc[l];
}

/* A row block's HC columns: c = x Y + y * dg. */
static AI void lc_row(const real *restrict x, const real *restrict Y, const real *y, const real *restrict dg,
                      real *c) {
    for (int t = 0; t + 1 < NTC; ++t) lc_tile(x, Y, y, dg, c, t * CTC, CTC);
    lc_tile(x, Y, y, dg, c, (NTC - 1) * CTC, CTLC);
}
#endif

/* M = J_s */
static void jac_set(const real *restrict Wt, long s, const real *restrict fs, long ld, real *restrict M) {
#if KIND == 0
    (void)s;
    for (int i = 0; i < H; ++i)
        UNROLL for (int l = 0; l < H; ++l) ST(M + (i * H + l) * NL) = Wt[i * H + l] * LD(fs + l * ld);
#elif KIND == 1
    for (int i = 0; i < H; ++i)
        UNROLL for (int l = 0; l < H; ++l) {
            if (s & 1) ST(M + (i * H + l) * NL) = (vec){0} + Wt[i * H + l];
            else ST(M + (i * H + l) * NL) = i == l ? LD(fs + l * ld) : (vec){0};
        }
#elif KIND == 2
    const real *W0 = Wt, *W1 = Wt + H * H, *W2 = Wt + 2 * H * H;
    (void)s;
    for (int i = 0; i < H; ++i)
        UNROLL for (int l = 0; l < H; ++l) {
            vec a = W0[i * H + l] * LD(fs + l * ld);
            a += W1[i * H + l] * LD(fs + (H + l) * ld);
            a += W2[i * H + l] * LD(fs + (2 * H + l) * ld);
            if (i == l) a += LD(fs + (3 * H + l) * ld);
            ST(M + (i * H + l) * NL) = a;
        }
#else
    (void)s;
    lstm_blocks(Wt, fs, ld, M, M + HC * NL, H);
    for (int i = 0; i < HC; ++i) {
        real *Mi = M + (HC + i) * H * NL;
        UNROLL for (int l = 0; l < H; ++l) ST(Mi + l * NL) = (vec){0};
        ST(Mi + i * NL) = FROW(5, i) * FROW(0, i);  /* diag(f a) */
        ST(Mi + (HC + i) * NL) = FROW(5, i);        /* diag(f) */
    }
#endif
}

/* M <- M J_s */
static void mul_jac(real *restrict M, const real *restrict Wt, long s, const real *restrict fs, long ld) {
#if KIND == 0
    (void)s;
    mul_wt(M, Wt, fs, ld);
#elif KIND == 1
    if (s & 1) {
        mul_wt(M, Wt, 0, 0);
    } else {
        for (int i = 0; i < H; ++i)
            UNROLL for (int l = 0; l < H; ++l) ST(M + (i * H + l) * NL) = LD(M + (i * H + l) * NL) * LD(fs + l * ld);
    }
#elif KIND == 3
    /* [M_h A + M_c diag(f a), M_h Bm + M_c diag(f)]: the two HC x HC blocks of J_s built in L1, its bottom half
     * (two diagonals) applied as column scalings: 4 HC^3 multiply-adds, half a dense product's */
    real A[HC * HC * NL] __attribute__((aligned(64))), Bm[HC * HC * NL] __attribute__((aligned(64)));
    real fa[HC * NL] __attribute__((aligned(64))), fv[HC * NL] __attribute__((aligned(64)));
    (void)s;
    lstm_blocks(Wt, fs, ld, A, Bm, HC);
    for (int l = 0; l < HC; ++l) {
        ST(fv + l * NL) = FROW(5, l);
        ST(fa + l * NL) = FROW(5, l) * FROW(0, l);
    }
    for (int i = 0; i < H; ++i) {
        real *Mi = M + i * H * NL, mh[HC * NL] __attribute__((aligned(64)));
        memcpy(mh, Mi, sizeof mh); /* M_h's row: the first block overwrites it, the second still reads it */
        lc_row(mh, A, Mi + HC * NL, fa, Mi);
        lc_row(mh, Bm, Mi + HC * NL, fv, Mi + HC * NL);
    }
#else
    real J[H * H * NL] __attribute__((aligned(64)));
    jac_set(Wt, s, fs, ld, J);
    for (int i = 0; i < H; ++i) {
        real *Mi = M + i * H * NL;
        ROW_SRC(Mi);
        for (int t = 0; t + 1 < NT; ++t) mm_tile(x_, J, Mi, t * CT, CT);
        mm_tile(x_, J, Mi, (NT - 1) * CT, CTL);
    }
#endif
}

#if NL == 1
/* One lane (one chain: B = 1, the sequential scan of a single batch element): a mat-vec has no lanes to
 * vectorise across, so its rows are the vector instead: the weights transposed once per call into columns
 * padded to whole registers (Wc[g*HC + m] = column m of Wt_g), each step the sum over m of a column times a
 * scalar, in two independent halves: the critical path is ~HC/2 multiply-adds, not HC. */
#define RV RVL
#define RC ((HC + RV - 1) / RV)
#define RCT (RC < ACC / 2 ? RC : ACC / 2) /* registers of a column tile: two halves of RCT accumulators */
typedef real rvec __attribute__((vector_size(VREG_BYTES), aligned(sizeof(real))));
typedef struct { rvec c[NW * HC][RC]; } wcols;

static void wt_columns(const real *Wt, wcols *w) {
    memset(w, 0, sizeof(*w));
    for (int g = 0; g < NW; ++g)
        for (int i = 0; i < HC; ++i)
            for (int m = 0; m < HC; ++m) ((real *)w->c[g * HC + m])[i] = Wt[(g * HC + i) * HC + m];
}

/* out's registers c0 .. c0 + W - 1 of the sum over the nt columns of col_j * t[j]. */
static AI void cols_tile(const wcols *w, const real *t, int nt, real *out, int c0, int W) {
    rvec a[RCT], b[RCT];
    for (int c = 0; c < W; ++c) a[c] = b[c] = (rvec){0};
    int j = 0;
    for (; j + 1 < nt; j += 2)
        for (int c = 0; c < W; ++c) {
            a[c] += w->c[j][c0 + c] * t[j];
            b[c] += w->c[j + 1][c0 + c] * t[j + 1];
        }
    if (j < nt)
        for (int c = 0; c < W; ++c) a[c] += w->c[j][c0 + c] * t[j];
    for (int c = 0; c < W; ++c) *(rvec *)(out + (c0 + c) * RV) = a[c] + b[c];
}

/* v[0 .. HC) = sum over the nt columns of col_j * t[j], plus diag * q where diag is given. */
static void cols_vec(const wcols *w, const real *t, int nt, const real *diag, const real *q, real *v) {
    real out[RC * RV] __attribute__((aligned(64)));
    for (int c0 = 0; c0 + RCT <= RC; c0 += RCT) cols_tile(w, t, nt, out, c0, RCT);
    if (RC % RCT) cols_tile(w, t, nt, out, RC - RC % RCT, RC % RCT);
    for (int i = 0; i < HC; ++i) v[i] = diag ? out[i] + diag[i] * q[i] : out[i];
}
#define WCOLS(name) wcols name##_store, *name = &name##_store; wt_columns(Wt, name)
#else
typedef void wcols;
#define WCOLS(name) const wcols *name = 0
#endif

#if KIND == 3
/* The LSTM's mat-vec, up to the weights: from q = [l_h; l_c], dc = l_c + a l_h and the gates' terms
 * t = (ci dc, cf dc, cg dc, co l_h) [4][HC] (which are also the gates' gradients dpre, mode 1). */
static AI void lstm_terms(const real *restrict fs, long ld, const real *restrict q, real *restrict t,
                          real *restrict dc) {
    for (int m = 0; m < HC; ++m) {
        vec lh = LD(q + m * NL), d = LD(q + (HC + m) * NL) + FROW(0, m) * lh;
        ST(dc + m * NL) = d;
        ST(t + m * NL) = FROW(1, m) * d;
        ST(t + (HC + m) * NL) = FROW(2, m) * d;
        ST(t + (2 * HC + m) * NL) = FROW(3, m) * d;
        ST(t + (3 * HC + m) * NL) = FROW(4, m) * lh;
    }
}
#endif

#if NL > 1
/* Rows i0 .. i0 + W - 1 of v = J_s q (the paper layout: an odd position's Wt), per lane: W accumulators, each
 * summing its terms in the order of the plain loops (m ascending, gate by gate, after the GRU's diagonal). */
static AI void jv_tile(const real *restrict Wt, const real *restrict fs, long ld, const real *restrict q,
                       real *restrict v, int i0, int W) {
    vec acc[CT > CTC ? CT : CTC];
#if KIND < 2
    UNROLL for (int i = 0; i < W; ++i) acc[i] = (vec){0};
    for (int m = 0; m < H; ++m) {
        vec t = KIND == 0 ? LD(fs + m * ld) * LD(q + m * NL) : LD(q + m * NL);
        UNROLL for (int i = 0; i < W; ++i) acc[i] += Wt[(i0 + i) * H + m] * t;
    }
#elif KIND == 3
    /* q: the gates' terms t [4][HC] (lstm_terms), fs unused: rows i0 .. of l_h' = sum_q Wt_q t_q */
    (void)fs, (void)ld;
    UNROLL for (int i = 0; i < W; ++i) acc[i] = (vec){0};
    for (int g = 0; g < 4; ++g)
        for (int m = 0; m < HC; ++m) {
            vec t = LD(q + (g * HC + m) * NL);
            UNROLL for (int i = 0; i < W; ++i) acc[i] += Wt[(g * HC + i0 + i) * HC + m] * t;
        }
#else
    UNROLL for (int i = 0; i < W; ++i) acc[i] = LD(fs + (3 * H + i0 + i) * ld) * LD(q + (i0 + i) * NL);
    for (int g = 0; g < 3; ++g)
        for (int m = 0; m < H; ++m) {
            vec t = LD(fs + (g * H + m) * ld) * LD(q + m * NL);
            UNROLL for (int i = 0; i < W; ++i) acc[i] += Wt[(g * H + i0 + i) * H + m] * t;
        }
#endif
    UNROLL for (int i = 0; i < W; ++i) ST(v + (i0 + i) * NL) = acc[i];
}
#endif

/* v = J_s q (v must not alias q).  With lanes, the H rows of v are H independent accumulators in registers,
 * each summing its terms in the order of the plain loops (m ascending, gate by gate): one dependent chain
 * per row would make the mat-vec latency-bound (measured: docs/measurements.md, "Measurements the code cites"). */
static void jac_vec(const real *restrict Wt, const wcols *wc, long s, const real *restrict fs, long ld,
                    const real *restrict q, real *restrict v) {
#if NL == 1
    (void)Wt;
#if KIND != 1
    real t[NW * HC];
#endif
#if KIND == 0
    (void)s;
    for (int m = 0; m < H; ++m) t[m] = fs[m * ld] * q[m];
    cols_vec(wc, t, H, 0, q, v);
#elif KIND == 1
    if (s & 1) {
        cols_vec(wc, q, H, 0, q, v);
    } else {
        for (int m = 0; m < H; ++m) v[m] = fs[m * ld] * q[m];
    }
#elif KIND == 2
    (void)s;
    real z[H];
    for (int m = 0; m < 3 * H; ++m) t[m] = fs[m * ld] * q[m % H];
    for (int i = 0; i < H; ++i) z[i] = fs[(3 * H + i) * ld];
    cols_vec(wc, t, 3 * H, z, q, v);
#else
    (void)s;
    real dc[HC];
    lstm_terms(fs, ld, q, t, dc);
    cols_vec(wc, t, 4 * HC, 0, q, v);
    for (int i = 0; i < HC; ++i) v[HC + i] = fs[(5 * HC + i) * ld] * dc[i];
#endif
#else
    (void)wc;
#if KIND == 1
    if (!(s & 1)) {
        UNROLL for (int m = 0; m < H; ++m) ST(v + m * NL) = LD(fs + m * ld) * LD(q + m * NL);
        return;
    }
#endif
    (void)s;
#if KIND == 3
    real t[4 * HC * NL] __attribute__((aligned(64))), dc[HC * NL] __attribute__((aligned(64)));
    lstm_terms(fs, ld, q, t, dc);
    for (int u = 0; u + 1 < NTC; ++u) jv_tile(Wt, fs, ld, t, v, u * CTC, CTC);
    jv_tile(Wt, fs, ld, t, v, (NTC - 1) * CTC, CTLC);
    UNROLL for (int i = 0; i < HC; ++i) ST(v + (HC + i) * NL) = FROW(5, i) * LD(dc + i * NL);
#else
    for (int t = 0; t + 1 < NT; ++t) jv_tile(Wt, fs, ld, q, v, t * CT, CT);
    jv_tile(Wt, fs, ld, q, v, (NT - 1) * CT, CTL);
#endif
#endif
}

/* -- the parameter gradients (mode 1) --------------------------------------------------------------- */

/* A group of up to GRP positions: each position's gradient rows A [NA][NL] and columns Bv [NBV][NL] (Bv: the
 * storage GROUP declares beside it, NBV of the call's input size ni). */
typedef struct {
    int np, ni;
    real A[GRP][NA * NL] __attribute__((aligned(64)));
    real *Bv;
} group;
#define GROUP(ni_)                                                                                           \
    real gp_bv[GRP * ((ni_) + 1 + HC) * NL] __attribute__((aligned(64)));                                     \
    group gp;                                                                                                \
    gp.np = 0, gp.ni = (ni_), gp.Bv = gp_bv

/* The register tile of the sums: TR rows x TW columns of accumulators, beside TW column values and a row value
 * (4 x 6 + 7 = 31 of AVX-512's or NEON's 32 registers; 3 x 3 + 4 = 13 of AVX2's 16). */
#if NREG >= 32
#define TR 4
#define TW 6
#else
#define TR 3
#define TW 3
#endif

/* acc[a .. a+R)[c .. c+W) += sum_p A_p[a] Bv_p[c]: one register tile, R x W accumulators (constants once
 * inlined), each summing the group's positions in order. */
static AI void acc_tile(real *restrict acc, const group *restrict gp, long a, long c, int R, int W) {
    const int ni = gp->ni;
    vec t[TR][TW];
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < W; ++j) t[i][j] = LD(acc + ((a + i) * NBV + c + j) * NL);
    for (int p = 0; p < gp->np; ++p) {
        vec b[TW];
        for (int j = 0; j < W; ++j) b[j] = LD(gp->Bv + p * NBV * NL + (c + j) * NL);
        for (int i = 0; i < R; ++i) {
            vec x = LD(gp->A[p] + (a + i) * NL);
            for (int j = 0; j < W; ++j) t[i][j] += x * b[j];
        }
    }
    for (int i = 0; i < R; ++i)
        for (int j = 0; j < W; ++j) ST(acc + ((a + i) * NBV + c + j) * NL) = t[i][j];
}

/* One column strip c .. c+W of rows [a0, a1): tiles of TR rows, then single rows. */
static AI void acc_strip(real *restrict acc, const group *restrict gp, int a0, int a1, int c, int W) {
    int tiles = (a1 - a0) / TR;
    for (int k = 0; k < tiles; ++k) acc_tile(acc, gp, a0 + k * TR, c, TR, W);
    for (int a = a0 + tiles * TR; a < a1; ++a) acc_tile(acc, gp, a, c, 1, W);
}

/* acc[a][c] += sum_p A_p[a] Bv_p[c] for a in [a0, a1), c in [c0, c1): strips of TW columns, the last
 * narrower (every tile independent chains in registers: no sum waits on the one before). */
static void acc_range(real *restrict acc, const group *restrict gp, int a0, int a1, int c0, int c1) {
    int c = c0;
    for (; c + TW <= c1; c += TW) acc_strip(acc, gp, a0, a1, c, TW);
    switch (c1 - c) {
#if TW > 5
    case 5: acc_strip(acc, gp, a0, a1, c, 5); break;
    case 4: acc_strip(acc, gp, a0, a1, c, 4); break;
    case 3: acc_strip(acc, gp, a0, a1, c, 3); break;
#endif
    case 2: acc_strip(acc, gp, a0, a1, c, 2); break;
    case 1: acc_strip(acc, gp, a0, a1, c, 1); break;
    default: break;
    }
}

static void grp_flush(group *gp, real *acc) {
    if (!gp->np) return;
    const int ni = gp->ni;
#if KIND == 2
    acc_range(acc, gp, 0, 2 * H, 0, NBV);          /* dR, dZ: with x, 1 and h' */
    acc_range(acc, gp, 2 * H, 3 * H, 0, ni + 1);   /* dN: with x and 1 */
    acc_range(acc, gp, 3 * H, 4 * H, ni, NBV);     /* dM: with 1 and h' */
#elif KIND == 3
    acc_range(acc, gp, 0, 4 * HC, 0, NBV);         /* dpre (i, f, g, o): with x, 1 and h' */
#else
    acc_range(acc, gp, 0, H, 0, NBV);
#endif
    gp->np = 0;
}

/* The prefix v at position k (fs, ld: position k's factors; mask: 1 in the lanes that count, 0 in spare
 * ones), written as out[k] (mode 0, the first `lanes` lanes) or added to the group (mode 1). */
static void take(real *out, int mode, group *gp, real *acc, long B, long b0, long k, const real *v, const real *fs,
                 long ld, int lanes, vec mask) {
    if (mode == 0) {
        real *o = out + (k * B + b0) * H;
        for (int b = 0; b < lanes; ++b)
            for (int i = 0; i < H; ++i) o[b * H + i] = v[i * NL + b];
        return;
    }
#if KIND == 1
    if (!(k & 1)) return; /* grad of h_t; the odd position after it is grad of a_t */
#endif
    const int ni = gp->ni;
    real *A = gp->A[gp->np], *Bv = gp->Bv + gp->np * NBV * NL;
#if KIND == 3
    real q[H * NL] __attribute__((aligned(64))), dc[HC * NL] __attribute__((aligned(64)));
    for (int i = 0; i < H; ++i) ST(q + i * NL) = LD(v + i * NL) * mask;
    lstm_terms(fs, ld, q, A, dc); /* dpre = (ci dc, cf dc, cg dc, co l_h) */
#else
    for (int i = 0; i < H; ++i) {
        vec q = LD(v + i * NL) * mask;
#if KIND == 0
        ST(A + i * NL) = q * LD(fs + i * ld);
#elif KIND == 1
        ST(A + i * NL) = q;
#else
        ST(A + i * NL) = q * LD(fs + i * ld);                    /* dR = grad_h c_r */
        ST(A + (H + i) * NL) = q * LD(fs + (H + i) * ld);        /* dZ = grad_h c_z */
        ST(A + (2 * H + i) * NL) = q * LD(fs + (4 * H + i) * ld); /* dN = grad_h e */
        ST(A + (3 * H + i) * NL) = q * LD(fs + (2 * H + i) * ld); /* dM = grad_h c_n */
#endif
    }
#endif
    for (int j = 0; j < ni; ++j) ST(Bv + j * NL) = LD(fs + (XROW + j) * ld);
    ST(Bv + ni * NL) = (vec){0} + 1;
    for (int j = 0; j < HC; ++j) ST(Bv + (ni + 1 + j) * NL) = LD(fs + (XROW + ni + j) * ld);
    if (++gp->np == GRP) grp_flush(gp, acc);
}

/* A thread's heartbeat: bumped at every step of a unit, so that a thread waiting for the unit can tell a
 * thread that is running it from one the host has taken off its core (the team: re-executable units). */
static inline void beat_once(long *beat) {
    if (beat) __atomic_store_n(beat, *beat + 1, __ATOMIC_RELAXED);
}

/* -- the dense tree above the fused levels (bppsa.backends.cpu.dense._tree, per lane) -------------- */

/* Scratch a tree over n entries with L levels uses (reals). */
static long tree_work(long n, int L) {
    if (L == 0 || n == 0) return 0;
    long m = n / 2; /* pairs + carry */
    return m * MAT + VEC + 2 * m * VEC + tree_work(m, L - 1);
}

/* v += u, per lane. */
static void add_vec(real *restrict v, const real *restrict u) {
    for (int i = 0; i < H; ++i) ST(v + i * NL) = LD(v + i * NL) + LD(u + i * NL);
}

/* out[k] = A[k-1] out[k-1] (+ Bo[k-1], the affine maps' offsets, where Bo is given) from out[0] = spine, for
 * k = 0 .. n-1, with L up-sweep levels, then the linear middle.  The pairs combine as (A2, b2) o (A1, b1) =
 * (A2 A1, A2 b1 + b2): the scan of the affine recurrence out[k+1] = A[k] out[k] + Bo[k]. */
static void tree(const real *spine, const real *A, const real *Bo, real *out, long n, int L, real *work, long *beat) {
    if (n == 0) return;
    memcpy(out, spine, sizeof(real) * VEC);
    if (L == 0) {
        for (long k = 1; k < n; ++k) {
            mat_vec(A + (k - 1) * MAT, out + (k - 1) * VEC, out + k * VEC);
            if (Bo) add_vec(out + k * VEC, Bo + (k - 1) * VEC);
            beat_once(beat);
        }
        return;
    }
    long pairs = (n - 1) / 2, carry = (n - 1) % 2, m = pairs + carry;
    real *nxt = work, *sp = nxt + m * MAT, *Q = sp + VEC, *nb = Bo ? Q + m * VEC : 0;
    /* the level's last entry, like A's, is never read: the prefixes out[k] reach A[n - 2] at most */
    for (long j = 0; j + 1 < m; ++j) {
        mat_mat(A + (2 * j + 2) * MAT, A + (2 * j + 1) * MAT, nxt + j * MAT);
        beat_once(beat);
        if (Bo) {
            mat_vec(A + (2 * j + 2) * MAT, Bo + (2 * j + 1) * VEC, nb + j * VEC);
            add_vec(nb + j * VEC, Bo + (2 * j + 2) * VEC);
        }
    }
    if (m) {
        mat_vec(A, spine, sp);
        if (Bo) add_vec(sp, Bo);
    }
    tree(sp, nxt, nb, Q, m, L - 1, Q + 2 * m * VEC, beat);
    for (long j = 0; j < pairs; ++j) {
        memcpy(out + (2 * j + 1) * VEC, Q + j * VEC, sizeof(real) * VEC);
        mat_vec(A + (2 * j + 1) * MAT, Q + j * VEC, out + (2 * j + 2) * VEC);
        if (Bo) add_vec(out + (2 * j + 2) * VEC, Bo + (2 * j + 1) * VEC);
        beat_once(beat);
    }
    if (carry) memcpy(out + (n - 1) * VEC, Q + pairs * VEC, sizeof(real) * VEC);
}

/* -- the entry points ---------------------------------------------------------------------------- */

#define ALL ((vec){0} + 1)

/* Where the steps' factor rows come from: f [steps][NR][B], built before the scan (the GRU's: gru_factors);
 * or, where h is given (the RNN's), nothing built: each step's rows (rnn_factors': d = 1 - h_t^2, x_t and
 * h_{t-1}, 0 at t = 0) are read from the forward's states h [T][B][H] and inputs x [T][B][ni] into a tile of
 * the lanes, [NR][NL], as the step is scanned. */
typedef struct {
    const real *f, *h, *x;
    const real *c; /* the loss's direct gradients in scan order [n][B][H], c[s] entering after J_s (position s+1),
                    * or NULL: only h_T's, g */
    long ni;       /* the input size: x_t's rows among the factors (0: none, a scan without parameter gradients) */
} chain_src;

/* A slice's lanes: batch elements b0 .. b0 + nw - 1 (nw <= NL) in its first nw lanes.  A slice narrower than the
 * build (nw < NL) reads zeros into its spare lanes -- a zero gradient through zero Jacobians, exact zeros throughout,
 * adding nothing to the sums -- and never writes them out. */

/* A narrower slice's n values (its nw elements', consecutive in memory), zero-padded to all NL lanes' total */
static inline const real *padded(real *dst, const real *src, long n, long total) {
    memcpy(dst, src, sizeof(real) * n);
    memset(dst + n, 0, sizeof(real) * (total - n));
    return dst;
}

/* v += c[s], in the lanes that hold batch elements. */
static void add_direct(const chain_src *S, long B, long b0, int nw, long s, real *v) {
    const real *c = S->c + (s * B + b0) * H;
    for (int q = 0; q < nw; ++q)
        for (int i = 0; i < H; ++i) v[i * NL + q] += c[q * H + i];
}

#if KIND < 2
/* The square, rounded before the subtraction that follows it (as torch's 1 - h * h): the empty asm takes and
 * gives back the value (a vector of the lanes, or one real) in a register, so no compiler fuses the two into
 * one multiply-add. */
#if (defined(__x86_64__) || defined(__i386__)) && NL * REALBITS / 8 <= VREG_BYTES
#define ROUNDED(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__) && NL * REALBITS / 8 <= VREG_BYTES
#define ROUNDED(v) __asm__("" : "+w"(v))
#else /* a vector wider than a register (or another CPU): through memory */
#define ROUNDED(v)                                                                                           \
    do {                                                                                                     \
        volatile __typeof__(v) r_ = (v);                                                                     \
        (v) = r_;                                                                                            \
    } while (0)
#endif

/* Lane q's value p[q * stride], every lane (one gather instruction where the CPU has them). */
static inline vec lanes_at(const real *p, int stride) {
#if NL == 1
    (void)stride;
    return *p;
#elif defined(__AVX512F__) && NL * REALBITS == 512 && REALBITS == 32
    const __m512i q = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (vec)_mm512_i32gather_ps(_mm512_mullo_epi32(q, _mm512_set1_epi32(stride)), p, 4);
#elif defined(__AVX512F__) && NL * REALBITS == 512 && REALBITS == 64
    const __m256i q = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return (vec)_mm512_i32gather_pd(_mm256_mullo_epi32(q, _mm256_set1_epi32(stride)), p, 8);
#elif defined(__AVX2__) && NL * REALBITS == 256 && REALBITS == 32
    const __m256i q = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return (vec)_mm256_i32gather_ps(p, _mm256_mullo_epi32(q, _mm256_set1_epi32(stride)), 4);
#elif defined(__AVX2__) && NL * REALBITS == 256 && REALBITS == 64
    const __m128i q = _mm_setr_epi32(0, 1, 2, 3);
    return (vec)_mm256_i32gather_pd(p, _mm_mullo_epi32(q, _mm_set1_epi32(stride)), 8);
#else
    real g[NL] __attribute__((aligned(64)));
    for (int q = 0; q < NL; ++q) g[q] = p[q * stride];
    return LD(g);
#endif
}

/* The nonlinearity's derivative read from the state itself, as torch's rnn_factors writes it (bit for bit):
 * tanh's d = 1 - h * h, the square rounded before the subtraction; relu's (ACT 1) d = 1[h > 0], 1 or +0 (h = relu(a)
 * is positive exactly where a is; NaN gives 0, as (h > 0).to(dtype) does).  Every lane; deriv_one: one value. */
static inline vec deriv(vec h) {
#if ACT == 1 && NL == 1
    return h > 0 ? (real)1 : (real)0;
#elif ACT == 1
    return (vec)((__typeof__(h > h))((vec){0} + 1) & (h > (vec){0})); /* 1.0's bits where the compare is true */
#else
    vec sq = h * h;
    ROUNDED(sq);
    return ((vec){0} + 1) - sq;
#endif
}

static inline real deriv_one(real h) {
#if ACT == 1
    return h > 0 ? (real)1 : (real)0;
#else
    real sq = h * h;
    ROUNDED(sq);
    return 1 - sq;
#endif
}

/* dst [rows][NL] (rows: H, d only; or NR, all): lane q's rows of step k[q] of batch element b[q] of a chain
 * of T steps (step k is t = T - 1 - k of h and x). */
static void rnn_tile(const chain_src *S, long T, long B, const long *k, const long *b, int rows, real *dst) {
    const int ni = (int)S->ni;
    real hv[H * NL] __attribute__((aligned(64)));
    for (int q = 0; q < NL; ++q) {
        long t = T - 1 - k[q];
        const real *ht = S->h + (t * B + b[q]) * H;
        for (int i = 0; i < H; ++i) hv[i * NL + q] = ht[i];
        if (rows == H) continue;
        const real *xt = S->x + (t * B + b[q]) * ni;
        for (int j = 0; j < ni; ++j) dst[(XROW + j) * NL + q] = xt[j];
        if (t) {
            const real *hp = S->h + ((t - 1) * B + b[q]) * H;
            for (int i = 0; i < H; ++i) dst[(XROW + ni + i) * NL + q] = hp[i];
        } else {
            for (int i = 0; i < H; ++i) dst[(XROW + ni + i) * NL + q] = 0;
        }
    }
    for (int i = 0; i < H; ++i) ST(dst + i * NL) = deriv(LD(hv + i * NL));
}

#if defined(__AVX2__) && REALBITS == 32 && (NL == 8 || NL == 16)
#define LANE_ROWS 1
/* dst[i][q] = src[q][i] (rows i < H, lanes q < NL; src rows H apart): the lanes' H values, consecutive in memory,
 * transposed 8 x 8 in registers instead of gathered one row at a time (a gather per row cost ~5 % of a scan). */
static void lane_rows(const real *src, real *dst) {
    const __m256i tail = _mm256_setr_epi32(-1, -1, -1, -1, (H % 8) > 4 ? -1 : 0, (H % 8) > 5 ? -1 : 0,
                                           (H % 8) > 6 ? -1 : 0, 0);
    for (int q0 = 0; q0 < NL; q0 += 8)
        for (int c = 0; c < H; c += 8) {
            __m256 r[8];
            for (int q = 0; q < 8; ++q) {
                const float *p = src + (q0 + q) * H + c;
                r[q] = c + 8 <= H ? _mm256_loadu_ps(p)
                                  : _mm256_maskload_ps(p, H % 8 >= 4 ? tail : _mm256_setr_epi32(
                                        H % 8 > 0 ? -1 : 0, H % 8 > 1 ? -1 : 0, H % 8 > 2 ? -1 : 0, 0, 0, 0, 0, 0));
            }
            __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
            __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
            __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
            __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
            __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
            __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
            __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
            __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
            __m256 o[8] = {_mm256_permute2f128_ps(b0, b4, 0x20), _mm256_permute2f128_ps(b1, b5, 0x20),
                           _mm256_permute2f128_ps(b2, b6, 0x20), _mm256_permute2f128_ps(b3, b7, 0x20),
                           _mm256_permute2f128_ps(b0, b4, 0x31), _mm256_permute2f128_ps(b1, b5, 0x31),
                           _mm256_permute2f128_ps(b2, b6, 0x31), _mm256_permute2f128_ps(b3, b7, 0x31)};
            for (int i = 0; i < 8 && c + i < H; ++i) _mm256_store_ps(dst + (c + i) * NL + q0, o[i]);
        }
}
#endif

/* The same for the slice's lanes b0 .. b0 + nw - 1 at one step k; where the tile holds step k - 1's rows (the down
 * phase's order), its h_{t-1} is this step's h_t.  A slice narrower than the build reads its rows zero-padded, and
 * its spare lanes' d are zeroed after (tanh's deriv(0) is 1): zero Jacobians there. */
static void rnn_lanes(const chain_src *S, long T, long B, long b0, int nw, long k, int rows, int next, real *dst) {
    const int ni = (int)S->ni;
    long t = T - 1 - k;
    const real *ht = S->h + (t * B + b0) * H;
    const real *xt = S->x + (t * B + b0) * ni, *hp = t ? S->h + ((t - 1) * B + b0) * H : 0;
    real hb[NL * H], pb[NL * H], xb[NL * ni + 1];
    if (nw < NL) {
        ht = padded(hb, ht, (long)nw * H, NL * H);
        if (rows > H) {
            xt = padded(xb, xt, (long)nw * ni, (long)NL * ni);
            if (hp) hp = padded(pb, hp, (long)nw * H, NL * H);
        }
    }
#ifdef LANE_ROWS
    if (next) {
        for (int i = 0; i < H; ++i) ST(dst + i * NL) = deriv(LD(dst + (XROW + ni + i) * NL));
    } else {
        lane_rows(ht, dst);
        for (int i = 0; i < H; ++i) ST(dst + i * NL) = deriv(LD(dst + i * NL));
    }
#else
    for (int i = 0; i < H; ++i)
        ST(dst + i * NL) = deriv(next ? LD(dst + (XROW + ni + i) * NL) : lanes_at(ht + i, H));
#endif
    if (nw < NL) {
        real m[NL] __attribute__((aligned(64)));
        for (int q = 0; q < NL; ++q) m[q] = q < nw;
        const vec mask = LD(m);
        for (int i = 0; i < H; ++i) ST(dst + i * NL) = LD(dst + i * NL) * mask;
    }
    if (rows == H) return;
    for (int j = 0; j < ni; ++j) ST(dst + (XROW + j) * NL) = lanes_at(xt + j, ni);
#ifdef LANE_ROWS
    if (hp) {
        lane_rows(hp, dst + (XROW + ni) * NL);
        return;
    }
#endif
    for (int i = 0; i < H; ++i) ST(dst + (XROW + ni + i) * NL) = hp ? lanes_at(hp + i, H) : (vec){0};
}
#endif

/* The rows of position s's step for lanes b0 .. b0 + nw - 1 (row r at the result + r * *ld), at least `rows`
 * of them (H or NR): the GRU's in f; the RNN's built into tile (which holds step *k, all rows if *full). */
static inline const real *step_rows(const chain_src *S, long n, long B, long b0, int nw, long s, int rows,
                                    real *tile, long *k, int *full, long *ld) {
    const int ni = (int)S->ni;
#if KIND < 2
    if (S->h) {
        long ks = fstep(s);
        if (ks != *k || (rows > H && !*full)) {
            rnn_lanes(S, KIND == 1 ? n / 2 : n, B, b0, nw, ks, rows, ks == *k + 1 && *full, tile);
            *k = ks;
            *full = rows > H;
        }
        *ld = NL;
        return tile;
    }
#endif
    (void)n, (void)rows, (void)full;
    const real *f = S->f + fstep(s) * (long)NR * B + b0;
    *ld = B;
    if (nw == NL) return f;
    /* a slice narrower than the build: the step's rows into the tile, zeros in the spare lanes */
    if (fstep(s) != *k) {
        for (int r = 0; r < NR; ++r) padded(tile + r * NL, f + r * B, nw, NL);
        *k = fstep(s);
    }
    *ld = NL;
    return tile;
}
/* In an entry point: the tile, and the rows of position s. */
#define TILE                                                                                             \
    const int ni = (int)S->ni;                                                                           \
    real tile[NR * NL] __attribute__((aligned(64)));                                                     \
    long tk = -1, ld;                                                                                    \
    int tfull = 0
#define ROWS(s, rows) step_rows(S, n, B, b0, nw, (s), (rows), tile, &tk, &tfull, &ld)

/* The blocks of level c (0 where the tree has no levels); block j holds J_lo .. J_hi. */
long chain_blocks(long n, int L, int c) { return L == 0 ? 0 : n >> (c < L ? c : L); }

static void block_range(long j, long n, int c, long *lo, long *hi) {
    long size = 1L << c;
    *lo = (j + 1) * size - 1;
    *hi = *lo + size - 1 < n - 1 ? *lo + size - 1 : n - 1;
}

/* The scan runs in three phases over one lane slice b0 .. b0 + nw - 1 of the batch; the first and
 * the last split into independent ranges of blocks [j0, j1) (the team's units), the middle is serial.
 * work (chain_scan_work reals) holds the blocks' products A, their prefixes Q and the tree's scratch. */

/* Up: A[j] = J_hi ... J_lo for the blocks j0 .. j1 - 1, accumulated in cache from the factors, into
 * A[(j - j0) * MAT] (and the affine offsets into Bo[(j - j0) * VEC]).  The last block's product is never read
 * (an exclusive scan needs no total: the tree's prefixes reach only the blocks before it), so it is not
 * computed. */
void chain_up(const real *Wt, const chain_src *S, long n, long B, long b0, int nw, int L, int c, long j0, long j1,
              real *A, real *Bo, long *beat) {
    if (c > L) c = L;
    TILE;
    WCOLS(wc);
    long nc = chain_blocks(n, L, c);
    if (j1 > nc - 1) j1 = nc - 1;
    for (long j = j0; j < j1; ++j) {
        long lo, hi;
        block_range(j, n, c, &lo, &hi);
        real *M = A + (j - j0) * MAT;
        const real *fs = ROWS(hi, H);
        jac_set(Wt, hi, fs, ld, M);
        for (long s = hi - 1; s >= lo; --s) {
            fs = ROWS(s, H);
            mul_jac(M, Wt, s, fs, ld);
            beat_once(beat);
        }
        if (S->c) { /* the block's offset: its positions replayed from 0 with the direct gradients injected */
            real vu[2][H * NL] __attribute__((aligned(64))), *v = vu[0], *u = vu[1], *t;
            memset(v, 0, sizeof(real) * VEC);
            add_direct(S, B, b0, nw, lo, v);
            for (long s = lo + 1; s <= hi; ++s) {
                fs = ROWS(s, H);
                jac_vec(Wt, wc, s, fs, ld, v, u);
                add_direct(S, B, b0, nw, s, u);
                t = v, v = u, u = t;
                beat_once(beat);
            }
            memcpy(Bo + (j - j0) * VEC, v, sizeof(real) * VEC);
        }
    }
}

/* -- the floating-point mode of a call ----------------------------------------------------------------
 * A scan call (team_go, chain_product) and a gate pass called on its own (gru_factors, lstm_factors) run with
 * subnormal results flushed to zero (x86's MXCSR.FTZ; AArch64's FPCR.FZ, which reads subnormal inputs as zero too),
 * whatever the caller's mode, and give the caller's mode back on return.  Its long products of Jacobians underflow, and x86 takes a subnormal result up to ~100x slower: in
 * the caller's mode a training step's backward took 2.8x (RNN), 3.3x (GRU) and 4.7x (LSTM) as long at T = 1000,
 * B = 16, H = 20 (docs/measurements.md).  A result below the normal range becomes 0, an absolute change of at most
 * 1.2e-38 (fp32) or 2.3e-308 (fp64); every thread of the call runs in the same mode, so a unit gives the same bits
 * on any thread. */
#define FP_FLUSH_X86 0x8000u      /* MXCSR.FTZ */
#define FP_FLUSH_ARM (1u << 24)   /* FPCR.FZ */

/* The call's mode (the caller's, subnormal results flushed), set on this thread; returns the caller's. */
static inline unsigned fp_enter(unsigned *call) {
    unsigned caller = fp_get();
#if defined(__SSE__) || defined(__x86_64__)
    *call = caller | FP_FLUSH_X86;
#elif defined(__aarch64__)
    *call = caller | FP_FLUSH_ARM;
#else
    *call = caller;
#endif
    fp_set(*call);
    return caller;
}

/* The map of positions s0 .. s1 - 1 (s0 < s1 <= n) for lanes b0 .. b0 + nw - 1, whole: M = J_{s1-1} ... J_{s0}
 * ([H][H][NL], accumulated in cache from the factors as chain_up's blocks are) and, where c is given, its offset q
 * ([H][NL]: the positions replayed from 0 with the direct gradients injected), so that the (affine) recurrence
 * takes out[s0] to out[s1] = M out[s0] + q.  One thread; the middle ranks' up-sweep of bppsa.nn.split. */
void chain_product(const real *Wt, const real *f, const real *h, const real *x, const real *c, long nx, long n,
                   long B, long b0, int nw, long s0, long s1, real *M, real *q) {
    chain_src src = {f, h, x, c, nx}, *S = &src;
    unsigned mode, caller = fp_enter(&mode);
    TILE;
    WCOLS(wc);
    const real *fs = ROWS(s1 - 1, H);
    jac_set(Wt, s1 - 1, fs, ld, M);
    for (long s = s1 - 2; s >= s0; --s) {
        fs = ROWS(s, H);
        mul_jac(M, Wt, s, fs, ld);
    }
    if (c) {
        real vu[2][H * NL] __attribute__((aligned(64))), *v = vu[0], *u = vu[1], *t;
        memset(v, 0, sizeof(real) * VEC);
        add_direct(S, B, b0, nw, s0, v);
        for (long s = s0 + 1; s < s1; ++s) {
            fs = ROWS(s, H);
            jac_vec(Wt, wc, s, fs, ld, v, u);
            add_direct(S, B, b0, nw, s, u);
            t = v, v = u, u = t;
        }
        memcpy(q, v, sizeof(real) * VEC);
    }
    fp_set(caller);
}

/* Middle: positions 0 .. 2^c - 1 (g, then the spine's mat-vecs) and the tree above level c over the blocks'
 * products A (and offsets Bo): Q[j], the prefix at each block's first position; twork: the spine's prefix and
 * the tree's scratch (chain_scan_work's layout puts them after Bo).  Without blocks the spine is the whole
 * (sequential) scan. */
void chain_tree(const real *Wt, const chain_src *S, const real *g, real *out, int mode, long n, long B, long b0,
                int nw, int L, int c, const real *A, const real *Bo, real *Q, real *twork, real *acc, long *beat) {
    if (n <= 0) return;
    if (c > L) c = L;
    TILE;
    GROUP(ni);
    WCOLS(wc);
    real vu[2][H * NL] __attribute__((aligned(64))), *v = vu[0], *u = vu[1], *t;
    for (int i = 0; i < H; ++i)
        for (int b = 0; b < NL; ++b) v[i * NL + b] = b < nw ? g[(b0 + b) * H + i] : 0;
    long nc = chain_blocks(n, L, c), spine_end = nc ? (1L << c) - 1 : n - 1;
    for (long s = 0; s < spine_end; ++s) {
        const real *fs = ROWS(s, NR);
        take(out, mode, &gp, acc, B, b0, s, v, fs, ld, nw, ALL);
        jac_vec(Wt, wc, s, fs, ld, v, u);
        if (S->c) add_direct(S, B, b0, nw, s, u);
        t = v, v = u, u = t; /* the next position's prefix: the buffers swap, nothing copied */
        beat_once(beat);
    }
    if (nc == 0) {
        const real *fs = ROWS(n - 1, NR);
        take(out, mode, &gp, acc, B, b0, n - 1, v, fs, ld, nw, ALL);
    }
    grp_flush(&gp, acc);
    if (nc == 0) return;
    real *sp = twork;
    memcpy(sp, v, sizeof(real) * VEC); /* the prefix at position 2^c - 1, the first block's, taken by chain_down */
    tree(sp, A, S->c ? Bo : 0, Q, nc, L - c, sp + VEC, beat);
}

/* Down: each block j0 .. j1 - 1 from its prefix, by the factored mat-vecs out[s+1] = J_s out[s]. */
void chain_down(const real *Wt, const chain_src *S, real *out, int mode, long n, long B, long b0, int nw, int L,
                int c, long j0, long j1, const real *work, real *acc, long *beat) {
    if (c > L) c = L;
    TILE;
    const real *Q = work + chain_blocks(n, L, c) * MAT;
    GROUP(ni);
    WCOLS(wc);
    real vu[2][H * NL] __attribute__((aligned(64))), *v, *u, *t;
    for (long j = j0; j < j1; ++j) {
        long lo, hi;
        block_range(j, n, c, &lo, &hi);
        v = vu[0], u = vu[1];
        memcpy(v, Q + j * VEC, sizeof(real) * VEC);
        for (long s = lo; s < hi; ++s) {
            const real *fs = ROWS(s, NR);
            take(out, mode, &gp, acc, B, b0, s, v, fs, ld, nw, ALL);
            jac_vec(Wt, wc, s, fs, ld, v, u);
            if (S->c) add_direct(S, B, b0, nw, s, u);
            t = v, v = u, u = t;
            beat_once(beat);
        }
        const real *fs = ROWS(hi, NR);
        take(out, mode, &gp, acc, B, b0, hi, v, fs, ld, nw, ALL);
    }
    grp_flush(&gp, acc);
}

/* Scratch (in reals) for n Jacobians, L levels, c of them fused. */
long chain_scan_work(long n, int L, int c) {
    if (c > L) c = L;
    long nc = chain_blocks(n, L, c);
    return nc ? nc * MAT + 2 * nc * VEC + VEC + tree_work(nc, L - c) : 0; /* A, Q, Bo, the spine, the tree */
}

/* -- one batch element, its blocks as the lanes ---------------------------------------------------
 * For a slice of a single batch element (B = 1, say) the lanes would hold one chain and the vector
 * units idle; these run LANES full blocks (2^c Jacobians each) of batch element b0 side by side
 * instead, reading and writing the one-lane layout ([H][H] and [H] per block) of the kernel built
 * for LANES = 1: work1 is that kernel's scratch, j0 .. j1 - 1 full blocks (a last group of fewer
 * than LANES repeats its last block in the spare lanes and drops their results).  Blocks have an even
 * size, so every lane is at a position of the same parity (the paper layout's diag or Wt). */

/* The lanes' factor rows at offset off of their blocks: dst[r][q] = row r of the factors of position
 * lo + off of batch element b0, for block min(j + q, last). */
static void gather_f(const chain_src *S, long n, long B, long b0, long j, long last, int c, long off, real *dst) {
    const int ni = (int)S->ni;
    long kq[NL], bq[NL];
    for (int q = 0; q < NL; ++q) {
        long jq = j + q < last ? j + q : last;
        kq[q] = fstep((jq + 1) * (1L << c) - 1 + off), bq[q] = b0;
    }
    (void)bq;
#if KIND < 2
    if (S->h) {
        rnn_tile(S, KIND == 1 ? n / 2 : n, B, kq, bq, NR, dst);
        return;
    }
#endif
    (void)n;
    for (int q = 0; q < NL; ++q)
        for (int r = 0; r < NR; ++r) dst[r * NL + q] = S->f[(kq[q] * NR + r) * B + b0];
}

void chain_up_lanes(const real *Wt, const chain_src *f, long n, long B, long b0, int L, int c, long j0, long j1,
                    real *A1, long *beat) {
    const int ni = (int)f->ni;
    if (c > L) c = L;
    real M[H * H * NL] __attribute__((aligned(64))), fs[NR * NL] __attribute__((aligned(64)));
    long size = 1L << c, nc = chain_blocks(n, L, c);
    if (j1 > nc - 1) j1 = nc - 1; /* the last block's product is never read (chain_up) */
    for (long j = j0; j < j1; j += NL) {
        /* position lo + off has the parity of size - 1 + off (blocks start at odd positions, size is even) */
        gather_f(f, n, B, b0, j, j1 - 1, c, size - 1, fs);
        jac_set(Wt, 2 * size - 2, fs, NL, M);
        for (long off = size - 2; off >= 0; --off) {
            gather_f(f, n, B, b0, j, j1 - 1, c, off, fs);
            mul_jac(M, Wt, size - 1 + off, fs, NL);
            beat_once(beat);
        }
        for (int q = 0; q < NL && j + q < j1; ++q) /* A1: the one-lane layout's blocks from j0 on */
            for (int e = 0; e < H * H; ++e) A1[(j - j0 + q) * H * H + e] = M[e * NL + q];
    }
}

void chain_down_lanes(const real *Wt, const chain_src *f, real *out, int mode, long n, long B, long b0, int L, int c,
                      long j0, long j1, const real *work1, real *acc, long *beat) {
    const int ni = (int)f->ni;
    if (c > L) c = L;
    long nc = chain_blocks(n, L, c), size = 1L << c;
    const real *Q = work1 + nc * H * H; /* the one-lane kernel's prefixes, [nc][H] */
    GROUP(ni);
    WCOLS(wc);
    real vu[2][H * NL] __attribute__((aligned(64))), *v, *u, *t, fs[NR * NL] __attribute__((aligned(64)));
    for (long j = j0; j < j1; j += NL) {
        int valid = j1 - j < NL ? (int)(j1 - j) : NL;
        real m[NL] __attribute__((aligned(64)));
        for (int q = 0; q < NL; ++q) m[q] = q < valid;
        vec mask = LD(m);
        v = vu[0], u = vu[1];
        for (int q = 0; q < NL; ++q)
            for (int i = 0; i < H; ++i) v[i * NL + q] = Q[(j + (q < valid ? q : valid - 1)) * H + i];
        for (long off = 0; off < size; ++off) {
            gather_f(f, n, B, b0, j, j1 - 1, c, off, fs);
            if (mode == 0) { /* lane q is block j + q's position lo + off of the one-lane layout */
                for (int q = 0; q < valid; ++q) {
                    real *o = out + (((j + q + 1) * size - 1 + off) * B + b0) * H;
                    for (int i = 0; i < H; ++i) o[i] = v[i * NL + q];
                }
            } else {
                take(out, mode, &gp, acc, B, b0, size - 1 + off, v, fs, NL, NL, mask); /* k: the parity */
            }
            if (off + 1 < size) {
                jac_vec(Wt, wc, size - 1 + off, fs, NL, v, u);
                t = v, v = u, u = t;
            }
            beat_once(beat);
        }
    }
    grp_flush(&gp, acc);
}

/* A chain of n dependent multiply-adds: times one multiply-add's latency (the sequential scan's roof). */
real fma_chain(long n) {
    volatile real seed = 1;
    real a = seed, b = (real)0.999999, c = (real)1e-7;
    for (long k = 0; k < n; ++k) a = a * b + c;
    return a;
}

/* -- the factors, from the forward's states ------------------------------------------------------- */

/* The RNN's factors [T][NR][B] in scan order (step T first) from h and x ([T][B][H], [T][B][ni]): rows
 * d_k = 1 - h_{T-k}^2 (relu: 1[h_{T-k} > 0]; rounded as torch rounds it, so that the factors equal the dense
 * chains' bit for bit), then x_{T-k} and h_{T-k-1} (0 for the first step); steps k0 .. k1 - 1.  What the scan
 * reads from h and x itself (rnn_tile, rnn_lanes), written for other readers.  Loops run along the output rows
 * (contiguous stores; faster than along the inputs': docs/measurements.md, "Measurements the code cites"). */
#if KIND < 2
void rnn_factors(const real *h, const real *x, long T, long B, long ni, long k0, long k1, real *f) {
    for (long k = k0; k < k1; ++k) {
        long t = T - 1 - k;
        const real *ht = h + t * B * H, *hp = h + (t - 1) * B * H, *xt = x + t * B * ni;
        real *fk = f + k * NR * B;
        for (int i = 0; i < H; ++i)
            for (long b = 0; b < B; ++b) fk[i * B + b] = deriv_one(ht[b * H + i]);
        for (int j = 0; j < ni; ++j)
            for (long b = 0; b < B; ++b) fk[(XROW + j) * B + b] = xt[b * ni + j];
        for (int i = 0; i < H; ++i)
            for (long b = 0; b < B; ++b) fk[(XROW + ni + i) * B + b] = t ? hp[b * H + i] : 0;
    }
}

#else
/* -- the GRU's and the LSTM's gates, recomputed (the forward keeps none), with simd.h's vector exp ------------ */
#define FV RVL /* lanes of the builder's vectors: one register */
/* A gate pass writes a chain's factors [T][NR][B] in scan order for steps k0 .. k1 - 1 straight from the layer's
 * inputs x ([T][B][ni]), its states and the cell's weights: per step and block of FV lanes, x_t and h' go to lane
 * order, the gates' pre-activations and activations are computed in registers, and the step's rows (the factors,
 * then x_t and h') written: one pass over memory, where torch's gate recomputation and factors make some twenty. */
typedef struct {
    const real *x, *h;
#if KIND == 3
    const real *c;
#endif
    const real *Wi, *Wh, *bi, *bh;
#if KIND == 3
    const real *h0, *c0;
#endif
    real *f;
    long T, B, ni;
} fill_args; /* the pass's operands (native.py's _FillArgs, _LstmFillArgs) */

/* dst[0 .. nb) = src[0 .. nb): one vector store when the block is whole (a constant-size copy the compiler
 * inlines; a library call per row took about a sixth of the pass); with `stream` (whole_lines) past the caches:
 * the factors (8.7 MB at set L, B = 16) outgrow L2, and an ordinary store would first read every line it
 * overwrites (measured: docs/measurements.md, "Measurements the code cites"). */
static inline void store_lanes(real *dst, const real *src, int nb, int stream) {
#if defined(__AVX512F__) || defined(__AVX__)
    if (stream && nb == FV) {
#if VREG_BYTES == 64 && REALBITS == 32
        _mm512_stream_ps(dst, *(const __m512 *)src);
#elif VREG_BYTES == 64
        _mm512_stream_pd(dst, *(const __m512d *)src);
#elif REALBITS == 32
        _mm256_stream_ps(dst, *(const __m256 *)src);
#else
        _mm256_stream_pd(dst, *(const __m256d *)src);
#endif
        return;
    }
#else
    (void)stream;
#endif
    if (nb == FV) memcpy(dst, src, sizeof(fvec));
    else memcpy(dst, src, nb * sizeof(real));
}

/* Lanes q < nb of rows [n][FV] from src's batch elements b0 + q (rows `stride` apart, row r at + r), or 0 where src is
 * NULL (h_0, c_0 not given; the GRU's h_0). */
static inline void lanes_of(const real *src, long stride, int n, int nb, real (*dst)[FV]) {
    if (!src) {
        memset(dst, 0, sizeof(real) * n * FV);
    } else if (nb == FV) { /* a whole block: the transposes without a test per element */
        for (int i = 0; i < n; ++i)
            UNROLL for (int q = 0; q < FV; ++q) dst[i][q] = src[q * stride + i];
    } else {
        for (int i = 0; i < n; ++i)
            for (int q = 0; q < FV; ++q) dst[i][q] = q < nb ? src[q * stride + i] : 0;
    }
}

#define DT (NREG / 2) /* rows of a dot_tile: DT accumulators, beside the operand and a weight */

/* out[k] = bias[k] (+ bias2[k]) + sum_j W1[k][j] v1[j] + sum_i W2[k][i] v2[i] for k < m (W1 [m][n1], W2 [m][n2]):
 * each sum one chain in that order, m chains side by side. */
static AI void dot_tile(int m, const real *bias, const real *bias2, const real *W1, long n1, const real (*v1)[FV],
                        const real *W2, int n2, const real (*v2)[FV], fvec *out) {
    fvec a[m];
    EACH(k, m) a[k] = SPLAT(bias2 ? bias[k] + bias2[k] : bias[k]);
    for (long j = 0; j < n1; ++j) {
        fvec v = *(const fvec *)v1[j];
        EACH(k, m) a[k] += W1[k * n1 + j] * v;
    }
    UNROLL for (int i = 0; i < n2; ++i) {
        fvec v = *(const fvec *)v2[i];
        EACH(k, m) a[k] += W2[k * n2 + i] * v;
    }
    EACH(k, m) out[k] = a[k];
}

/* dot_tile over n rows, DT at a time.  One row at a time, each sum is a chain of n1 + n2 dependent multiply-adds,
 * and too few of them fit the out-of-order window to keep the FMA units busy (the LSTM's pass on AVX2: 1.14x
 * slower so). */
static AI void dots(int n, const real *bias, const real *bias2, const real *W1, long n1, const real (*v1)[FV],
                    const real *W2, int n2, const real (*v2)[FV], fvec *out) {
    int g = 0;
    for (; g + DT <= n; g += DT)
        dot_tile(DT, bias + g, bias2 ? bias2 + g : 0, W1 + g * n1, n1, v1, W2 + g * n2, n2, v2, out + g);
    if (g < n)
        dot_tile(n - g, bias + g, bias2 ? bias2 + g : 0, W1 + g * n1, n1, v1, W2 + g * n2, n2, v2, out + g);
}

/* Blocks of FV lanes whose rows fill a 64-byte line together: a pass computes that many blocks of a step before it
 * stores their rows, so each line of the factors is written whole, by consecutive stores. */
#define LB (64 / (int)sizeof(fvec) > 1 ? 64 / (int)sizeof(fvec) : 1)

/* Whether the factors may be streamed: every row starts a line, and a step's LB blocks fill its lines (B reals a
 * whole number of lines).  A streamed store into part of a line leaves the write-combining buffer to write that
 * part alone: on AVX2, 32-byte streams, one block's half of each line, made the LSTM's pass 1.2x slower than
 * ordinary stores. */
static inline int whole_lines(const real *f, long B) {
    return !((uintptr_t)f % 64) && !((B * (long)sizeof(real)) % 64);
}

/* One block of a pass: step t's rows for the nb lanes from batch element b0, the factors into fr [NF * HC][FV],
 * x_t into xs [ni][FV] and h' into hs [HC][FV]. */
typedef void (*block_fn)(const fill_args *a, long t, long b0, int nb, real (*fr)[FV], real (*xs)[FV],
                         real (*hs)[FV]);

/* The pass over steps k0 .. k1 - 1 with `block` (a constant where this is inlined): per step, LB blocks into
 * registers and the stack, then their rows stored, the blocks of a row one after the other. */
static AI void pass(block_fn block, const fill_args *a, long k0, long k1) {
    const long B = a->B, ni = a->ni;
    const int stream = whole_lines(a->f, B);
    for (long k = k0; k < k1; ++k) {
        long t = a->T - 1 - k;
        real *fk = a->f + k * NR * B;
        for (long g0 = 0; g0 < B; g0 += LB * FV) {
            int ns = (int)((B - g0 + FV - 1) / FV) < LB ? (int)((B - g0 + FV - 1) / FV) : LB, nb[LB];
            real fr[LB][NF * HC][FV] __attribute__((aligned(64))), hs[LB][HC][FV] __attribute__((aligned(64)));
            real xs[LB][ni > 0 ? ni : 1][FV] __attribute__((aligned(64)));
            for (int s = 0; s < ns; ++s) {
                nb[s] = B - g0 - s * FV < FV ? (int)(B - g0 - s * FV) : FV;
                block(a, t, g0 + s * FV, nb[s], fr[s], xs[s], hs[s]);
            }
            for (int r = 0; r < NF * HC; ++r)
                for (int s = 0; s < ns; ++s) store_lanes(fk + r * B + g0 + s * FV, fr[s][r], nb[s], stream);
            for (long j = 0; j < ni; ++j)
                for (int s = 0; s < ns; ++s) store_lanes(fk + (XROW + j) * B + g0 + s * FV, xs[s][j], nb[s], stream);
            for (int i = 0; i < HC; ++i)
                for (int s = 0; s < ns; ++s)
                    store_lanes(fk + (XROW + ni + i) * B + g0 + s * FV, hs[s][i], nb[s], stream);
        }
    }
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence(); /* the streaming stores are weakly ordered: visible before the threads that read f are told */
#endif
}

#if KIND == 2
/* The GRU (Appendix E; h_0 = 0; W_ih [3H][ni], W_hh [3H][H], biases [3H]; gate order r, z, n): the gates' two affine
 * maps, r = sigmoid(R), z = sigmoid(Z), n = tanh(N) (Eq. 10), the rows c_r, c_z, c_n, z, e. */
static AI void gru_block(const fill_args *a, long t, long b0, int nb, real (*rows)[FV], real (*xs)[FV],
                         real (*hs)[FV]) {
    const long B = a->B, ni = a->ni;
    lanes_of(a->x + (t * B + b0) * ni, ni, ni, nb, xs);
    lanes_of(t ? a->h + ((t - 1) * B + b0) * H : 0, H, H, nb, hs);
    fvec gi[3 * H], gh[3 * H];
    dots(3 * H, a->bi, 0, a->Wi, ni, (const real (*)[FV])xs, a->Wh, 0, (const real (*)[FV])hs, gi);
    dots(3 * H, a->bh, 0, a->Wi, 0, (const real (*)[FV])xs, a->Wh, H, (const real (*)[FV])hs, gh);
    for (int i = 0; i < H; ++i) {
        fvec r, r1, z, z1, n, ns, M = gh[2 * H + i];
        vsigmoid(gi[i] + gh[i], &r, &r1);
        vsigmoid(gi[H + i] + gh[H + i], &z, &z1);
        vtanh(gi[2 * H + i] + r * M, &n, &ns);
        fvec e = z1 * ns;
        *(fvec *)rows[i] = e * M * r * r1;
        *(fvec *)rows[H + i] = (*(fvec *)hs[i] - n) * z * z1;
        *(fvec *)rows[2 * H + i] = e * r;
        *(fvec *)rows[3 * H + i] = z;
        *(fvec *)rows[4 * H + i] = e;
    }
}

static void gru_pass(const fill_args *a, long k0, long k1) { pass(gru_block, a, k0, k1); }

/* The GRU's gate pass called from outside a team (a reader of the factors, on the caller's threads): in the mode
 * the team's threads run it in (fp_enter: subnormal results flushed), so the factors are the same bits on either
 * path, and the caller's mode is given back. */
void gru_factors(const real *x, const real *h, const real *Wi, const real *Wh, const real *bi, const real *bh,
                 long T, long B, long ni, long k0, long k1, real *f) {
    fill_args a = {x, h, Wi, Wh, bi, bh, f, T, B, ni};
    unsigned mode, caller = fp_enter(&mode);
    gru_pass(&a, k0, k1);
    fp_set(caller);
}

#else
/* The LSTM (as bppsa.backends.chain.LstmChain.from_states writes its factors from lstm_factors(lstm_gates(...))):
 * from the states h and c ([T][B][HC]: h_1 .. h_T, c_1 .. c_T), h_0 and c_0 ([B][HC], NULL: zero) and the cell's
 * weights (W_ih [4HC][ni], W_hh [4HC][HC], biases [4HC]; gate order i, f, g, o): i, f, o = sigmoid (with 1 - p to
 * a few ulp, not from the rounded gate), g = tanh and tanh(c_t) from the state as the forward computes them
 * (float: simd.h's rational function, 1 - tanh^2 from it; double: vtanh), the rows a, ci, cf, cg, co, f. */
static AI void lstm_block(const fill_args *a, long t, long b0, int nb, real (*rows)[FV], real (*xs)[FV],
                          real (*hs)[FV]) {
    const long B = a->B, ni = a->ni;
    const real *x = a->x, *h = a->h, *c = a->c, *h0 = a->h0, *c0 = a->c0;
    real cp[HC][FV] __attribute__((aligned(64))), ct[HC][FV] __attribute__((aligned(64)));
    lanes_of(x + (t * B + b0) * ni, ni, ni, nb, xs);
    lanes_of(t ? h + ((t - 1) * B + b0) * HC : h0 ? h0 + b0 * HC : 0, HC, HC, nb, hs);
    lanes_of(t ? c + ((t - 1) * B + b0) * HC : c0 ? c0 + b0 * HC : 0, HC, HC, nb, cp);
    lanes_of(c + (t * B + b0) * HC, HC, HC, nb, ct);
    fvec pre[4 * HC];
    dots(4 * HC, a->bi, a->bh, a->Wi, ni, (const real (*)[FV])xs, a->Wh, HC, (const real (*)[FV])hs, pre);
    for (int i = 0; i < HC; ++i) {
        fvec ip, iq, fp, fq, gn, gs, op, oq, tc, ts;
        vsigmoid(pre[i], &ip, &iq);
        vsigmoid(pre[HC + i], &fp, &fq);
        vsigmoid(pre[3 * HC + i], &op, &oq);
#if REALBITS == 32 /* the forward's tanh (simd.h's rational function): 1 - n^2 from it, as torch's autograd */
        gn = pre[2 * HC + i], tc = *(fvec *)ct[i];
        vtanh1_n(&gn, 1);
        vtanh1_n(&tc, 1);
        gs = SPLAT(1) - gn * gn, ts = SPLAT(1) - tc * tc;
#else
        vtanh(pre[2 * HC + i], &gn, &gs);
        vtanh(*(fvec *)ct[i], &tc, &ts);
#endif
        *(fvec *)rows[i] = op * ts;                          /* a = o (1 - tanh^2 c) */
        *(fvec *)rows[HC + i] = gn * ip * iq;                /* ci = g i (1 - i) */
        *(fvec *)rows[2 * HC + i] = *(fvec *)cp[i] * fp * fq; /* cf = c' f (1 - f) */
        *(fvec *)rows[3 * HC + i] = ip * gs;                 /* cg = i (1 - g^2) */
        *(fvec *)rows[4 * HC + i] = tc * op * oq;            /* co = tanh(c) o (1 - o) */
        *(fvec *)rows[5 * HC + i] = fp;                      /* f */
    }
}

static void lstm_pass(const fill_args *a, long k0, long k1) { pass(lstm_block, a, k0, k1); }

/* The LSTM's gate pass from outside a team, in the team's mode (as gru_factors). */
void lstm_factors(const real *x, const real *h, const real *c, const real *Wi, const real *Wh, const real *bi,
                  const real *bh, const real *h0, const real *c0, long T, long B, long ni, long k0, long k1,
                  real *f) {
    fill_args a = {x, h, c, Wi, Wh, bi, bh, h0, c0, f, T, B, ni};
    unsigned mode, caller = fp_enter(&mode);
    lstm_pass(&a, k0, k1);
    fp_set(caller);
}
#endif
#endif

/* -- the team: every thread of one scan over claimable units -----------------------------------------------
 * A scan is a list of slices (lane slices of the batch, or one slice whose blocks the threads share).  Each
 * slice runs an up phase of units (ranges of blocks), a middle (one unit), and a down phase of units (each
 * with its own parameter-gradient sums, part u); before them all, the team may have units of the factors to
 * write (the GRU's gate pass).  Units are claimed by whichever thread comes: a thread takes its own slices'
 * units first, then those left in the others', so a thread that starts late (a wake-up) costs the team a share
 * of its work, not all of it.  A slice's middle runs on the first thread free once the slice's up units are done.
 *
 * No thread waits for one the host has taken off its core.  A unit of the up phase, a middle or (for the
 * parameter gradients) a down unit computes into its thread's own scratch and is *published*: the first
 * thread to finish it copies its result into place (a compare-and-swap on the unit's state picks it).  So a
 * unit can be run again: a thread that would wait for a unit another thread claimed watches that thread's
 * heartbeat (bumped at every step), and where it has not moved for the team's stall time (the host took the
 * thread away: its slices are milliseconds, a unit 0.05-0.15 ms) it runs the unit itself; the other's run,
 * when it resumes, finds it published and is dropped.  The call returns as soon as every unit is published,
 * without waiting for such a straggler: it touches only its own scratch and what the caller keeps alive until
 * the team's next call (which first waits for it).  Units that write the caller's output directly (the scan's
 * down phase and middle, mode 0; the GRU's gate pass) are not run twice: their waiters spin, then park.
 * Which thread runs a unit, and how often, changes no result: each runs in the same order on any thread, and a
 * published result is a run's whole result.  The calling thread leads (team_go): it wakes the pool's threads,
 * takes its share, waits for every slice and adds the sums into the parameter gradients.  The pool's threads are plain pthreads parked on a condition variable, each
 * scan in the call's floating-point mode (fp_enter: the caller's, subnormal results flushed). */
#include <limits.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

/* A unit's function: compute units j0 .. j1 - 1 into priv (the running thread's scratch; NULL for a unit that
 * writes its results in place), bumping beat at every step; and where priv was given, its publisher: copy the
 * run's results from priv into place. */
typedef void (*team_fn)(const void *args, long j0, long j1, long part, real *priv, long *beat);
typedef void (*team_pub)(const void *args, long j0, long j1, long part, const real *priv);

/* One call's operands, shared by its slices: the weights, where the factors come from, ∇h_T and the scan's
 * output (mode 0). */
typedef struct {
    const real *Wt;
    chain_src S;
    const real *g;
    real *out;
} team_call;

/* What the functions of a slice read: the call's operands, the slice's scratch (chain_scan_work) and its sums
 * [parts][NA][NBV][lanes] of this build's and of the wide build's down units (acc, wacc). */
typedef struct {
    const team_call *call;
    real *work, *acc, *wacc;
    long n, B, b0, nw, acc_size, wacc_size; /* nw: the slice's lanes (elements b0 .. b0 + nw - 1) */
    int L, c, mode;
} slice_args;

static inline long nblocks(const slice_args *a) { return chain_blocks(a->n, a->L, a->c); }
static inline long up_end(const slice_args *a, long j1) { return j1 < nblocks(a) - 1 ? j1 : nblocks(a) - 1; }

/* Up: the blocks' products into priv ([j1 - j0][MAT], then their offsets [j1 - j0][VEC]), or in place. */
void team_up(const void *args, long j0, long j1, long part, real *priv, long *beat) {
    const slice_args *a = args;
    (void)part;
    long nc = nblocks(a);
    real *A = priv ? priv : a->work + j0 * MAT, *Bo = priv ? priv + (j1 - j0) * MAT : a->work + nc * (MAT + VEC) + j0 * VEC;
    chain_up(a->call->Wt, &a->call->S, a->n, a->B, a->b0, (int)a->nw, a->L, a->c, j0, j1, A, Bo, beat);
}

void team_up_pub(const void *args, long j0, long j1, long part, const real *priv) {
    const slice_args *a = args;
    (void)part;
    long nc = nblocks(a), m = up_end(a, j1) - j0;
    if (m <= 0) return;
    memcpy(a->work + j0 * MAT, priv, sizeof(real) * m * MAT);
    if (a->call->S.c) memcpy(a->work + nc * (MAT + VEC) + j0 * VEC, priv + (j1 - j0) * MAT, sizeof(real) * m * VEC);
}

/* The wide build's up units of a one-lane slice: its blocks in the one-lane layout ([H][H] each). */
void team_up_lanes(const void *args, long j0, long j1, long part, real *priv, long *beat) {
    const slice_args *a = args;
    (void)part;
    chain_up_lanes(a->call->Wt, &a->call->S, a->n, a->B, a->b0, a->L, a->c, j0, j1,
                   priv ? priv : a->work + j0 * H * H, beat);
}

void team_up_lanes_pub(const void *args, long j0, long j1, long part, const real *priv) {
    const slice_args *a = args;
    (void)part;
    long m = up_end(a, j1) - j0;
    if (m > 0) memcpy(a->work + j0 * H * H, priv, sizeof(real) * m * H * H);
}

/* The middle.  In place (mode 0: it writes the spine's outputs): first the slice's sums zeroed.  Into priv (mode
 * 1): [the prefixes Q: nc][the spine's prefix and the tree's scratch][the spine's sums: NA * NBV * NL]. */
void team_mid(const void *args, long j0, long j1, long part, real *priv, long *beat) {
    const slice_args *a = args;
    const int ni = (int)a->call->S.ni;
    (void)j0, (void)j1, (void)part;
    long nc = nblocks(a);
    real *A = a->work, *Q = A + nc * MAT, *Bo = Q + nc * VEC, *acc = a->acc, *tw = Bo + nc * VEC;
    if (priv) {
        Q = priv, tw = priv + nc * VEC, acc = tw + VEC + tree_work(nc, a->L - (a->c < a->L ? a->c : a->L));
        if (a->mode) memset(acc, 0, sizeof(real) * NA * NBV * NL);
    } else {
        if (a->mode && a->acc_size) memset(a->acc, 0, sizeof(real) * a->acc_size);
        if (a->mode && a->wacc_size) memset(a->wacc, 0, sizeof(real) * a->wacc_size);
    }
    chain_tree(a->call->Wt, &a->call->S, a->call->g, a->call->out, a->mode, a->n, a->B, a->b0, (int)a->nw, a->L, a->c,
               A, Bo, Q, tw, acc, beat);
}

void team_mid_pub(const void *args, long j0, long j1, long part, const real *priv) {
    const slice_args *a = args;
    const int ni = (int)a->call->S.ni;
    (void)j0, (void)j1, (void)part;
    long nc = nblocks(a), sz = (long)NA * NBV * NL;
    memcpy(a->work + nc * MAT, priv, sizeof(real) * nc * VEC);
    if (!a->mode) return;
    const real *acc = priv + nc * VEC + VEC + tree_work(nc, a->L - (a->c < a->L ? a->c : a->L));
    if (a->acc_size) {
        memcpy(a->acc, acc, sizeof(real) * sz);
        memset(a->acc + sz, 0, sizeof(real) * (a->acc_size - sz));
    }
    if (a->wacc_size) memset(a->wacc, 0, sizeof(real) * a->wacc_size);
}

/* Down: its part's sums, as the middle left them, added into in priv (mode 1) or in place. */
static void down_run(const slice_args *a, long j0, long j1, real *sums, real *priv, long *beat, int wide) {
    const int ni = (int)a->call->S.ni;
    long sz = (long)NA * NBV * NL;
    if (priv && a->mode) memcpy(priv, sums, sizeof(real) * sz);
    real *acc = !a->mode ? 0 : priv ? priv : sums;
    if (wide)
        chain_down_lanes(a->call->Wt, &a->call->S, a->call->out, a->mode, a->n, a->B, a->b0, a->L, a->c, j0, j1,
                         a->work, acc, beat);
    else
        chain_down(a->call->Wt, &a->call->S, a->call->out, a->mode, a->n, a->B, a->b0, (int)a->nw, a->L, a->c, j0, j1,
                   a->work, acc, beat);
}

void team_down(const void *args, long j0, long j1, long part, real *priv, long *beat) {
    const slice_args *a = args;
    const int ni = (int)a->call->S.ni;
    down_run(a, j0, j1, a->acc ? a->acc + part * (long)NA * NBV * NL : 0, priv, beat, 0);
}

void team_down_lanes(const void *args, long j0, long j1, long part, real *priv, long *beat) {
    const slice_args *a = args;
    const int ni = (int)a->call->S.ni;
    down_run(a, j0, j1, a->wacc ? a->wacc + part * (long)NA * NBV * NL : 0, priv, beat, 1);
}

void team_down_pub(const void *args, long j0, long j1, long part, const real *priv) {
    const slice_args *a = args;
    const int ni = (int)a->call->S.ni;
    (void)j0, (void)j1;
    memcpy(a->acc + part * (long)NA * NBV * NL, priv, sizeof(real) * NA * NBV * NL);
}

void team_down_lanes_pub(const void *args, long j0, long j1, long part, const real *priv) {
    const slice_args *a = args;
    const int ni = (int)a->call->S.ni;
    (void)j0, (void)j1;
    memcpy(a->wacc + part * (long)NA * NBV * NL, priv, sizeof(real) * NA * NBV * NL);
}

/* The scratch (reals) one thread needs for any unit of a slice of this build: an up unit's products (one block,
 * or the wide build's NL one-lane blocks) and offsets, a middle's, a down unit's sums. */
long team_scratch(long n, int L, int c, long ni) {
    if (c > L) c = L;
    long nc = chain_blocks(n, L, c), sums = (long)NA * NBV * NL;
    long up = MAT + VEC, mid = nc * VEC + VEC + tree_work(nc, L - c) + sums;
    return up > mid ? (up > sums ? up : sums) : (mid > sums ? mid : sums);
}

#if KIND >= 2
/* The gate pass over steps j0 .. j1 - 1 (gru_factors', lstm_factors' operands), in place. */
void team_fill(const void *args, long j0, long j1, long part, real *priv, long *beat) {
    (void)part, (void)priv, (void)beat;
#if KIND == 2
    gru_pass(args, j0, j1);
#else
    lstm_pass(args, j0, j1);
#endif
}
#endif

/* Units u = 0 .. n - 1 of a phase: fn(args, lo + u * per, min(lo + (u + 1) * per, hi), part0 + u); pub NULL: they
 * write in place (never run twice).  st[2u]: the thread that runs unit u last claimed it (+1); st[2u + 1]: 0,
 * 1 while its first finisher publishes it, 2 once it is published. */
typedef struct {
    team_fn fn;
    team_pub pub;
    const void *args;
    long lo, hi, per, n, part0;
    long *st;
    long next, done; /* claimed, published */
} team_units;

#define TEAM_PHASES 2 /* a phase's units: up to two lists (a wide slice: the wide build's, then the tail's) */

typedef struct {
    team_units up[TEAM_PHASES], mid, down[TEAM_PHASES];
    long owner;
} team_slice;

/* The parameter gradients: dst[out] + off .. = the segment's values (rows a0 .. a1 - 1, columns c0 .. c1 - 1 of
 * the sums, row by row), each the sum over the sum blocks (in order) of their parts and lanes (in order). */
typedef struct {
    const real *p;
    long parts, lanes;
} team_acc;

typedef struct {
    long a0, a1, c0, c1, out, off;
} team_seg;

#define BEAT_STRIDE 16 /* a thread's heartbeat on a cache line of its own (longs) */

typedef struct {
    team_call call;     /* call.Wt: the weights transposed here from W [NW * H][H], before any thread starts */
    const real *W;
    team_units pre;     /* before every up unit */
    team_slice *sl;
    long ns, nthreads;
    const team_acc *acc;
    long nacc;
    const team_seg *seg;
    long nseg;
    real **dst;         /* the parameters' gradients (NULL: none) */
    real *scratch;      /* [nthreads][scratch_size]: each thread's units' results before they are published */
    long scratch_size;
    long *beat;         /* [nthreads][BEAT_STRIDE]: each thread's heartbeat */
    long stall_ns;      /* a heartbeat unmoved this long: the thread is off its core */
    long reruns;        /* units run again for such a thread, over the team's calls */
    /* state, reset by team_go */
    int stop, closed, inside;
    int ev, parked;     /* the event word (bumped by every change a thread may wait for), its sleepers */
    unsigned csr;
    long gen;
} team;

/* -- waiting: spin for a bounded time, then park ---------------------------------------------------------
 * A thread that waits for another (a unit that writes in place, the threads of the last call leaving) spins with the CPU's pause hint for at most SPIN_NS of wall-clock time, then parks on the
 * team's event word (a futex on Linux; elsewhere short sleeps) until something changes: every change a thread
 * may wait for bumps the word and wakes the sleepers, if any.  Spinning covers a quiet machine's waits (the
 * tree between the phases: tens of microseconds); parking gives the core back on a busy one, where a spinning
 * waiter would take turns with the very thread it waits for.  No sched_yield: it neither sleeps nor lets a
 * thread of this process run first.  A unit that can be run again is never waited for this way (finish). */
#define SPIN_NS 50000L
#define PARK_NS 2000000L /* a sleeper re-checks at least this often (a wake-up that cannot be lost, bounded) */

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void park(int *word, int seen) {
#ifdef __linux__
    struct timespec to = {0, PARK_NS};
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, &to, 0, 0);
#else
    struct timespec to = {0, 20000};
    if (__atomic_load_n(word, __ATOMIC_SEQ_CST) == seen) nanosleep(&to, 0);
#endif
}

static inline int stopped(team *t) { return __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE); }

/* Something a thread may wait for has happened (after the change itself is stored). */
static inline void notify(team *t) {
    __atomic_add_fetch(&t->ev, 1, __ATOMIC_SEQ_CST);
#ifdef __linux__
    if (__atomic_load_n(&t->parked, __ATOMIC_SEQ_CST)) syscall(SYS_futex, &t->ev, FUTEX_WAKE_PRIVATE, INT_MAX, 0, 0, 0);
#endif
}

/* Wait until ready(t, arg); 1 then, 0 where the team stopped first (unless `always`: then only ready counts).  A
 * sleeper reads the word before it counts itself parked and checks the condition once more, so a change made
 * meanwhile either is seen or bumps the word the futex compares (or wakes it: the notifier sees it parked). */
typedef int (*ready_fn)(team *t, const void *arg);
static int await(team *t, ready_fn ready, const void *arg, int always) {
    uint64_t t0 = 0;
    for (long spin = 0;; ++spin) {
        if (ready(t, arg)) return 1;
        if (!always && stopped(t)) return 0;
        if ((spin & 31) == 31) {
            uint64_t now = now_ns();
            if (!t0) t0 = now;
            if (now - t0 > SPIN_NS) {
                int seen = __atomic_load_n(&t->ev, __ATOMIC_SEQ_CST);
                __atomic_add_fetch(&t->parked, 1, __ATOMIC_SEQ_CST);
                if (!ready(t, arg) && (always || !stopped(t))) park(&t->ev, seen);
                __atomic_sub_fetch(&t->parked, 1, __ATOMIC_SEQ_CST);
                continue;
            }
        }
        cpu_relax();
    }
}

/* Run unit i of u on thread me (claimed, or found stalled elsewhere) and publish it unless another run did. */
static void run_unit(team *t, team_units *u, long i, int me) {
    long j0 = u->lo + i * u->per, j1 = j0 + u->per < u->hi ? j0 + u->per : u->hi, *beat = t->beat + me * BEAT_STRIDE;
    __atomic_store_n(&u->st[2 * i], me + 1, __ATOMIC_RELAXED);
    real *priv = u->pub ? t->scratch + me * t->scratch_size : 0;
    u->fn(u->args, j0, j1, u->part0 + i, priv, beat);
    long zero = 0;
    if (priv) {
        if (!__atomic_compare_exchange_n(&u->st[2 * i + 1], &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return; /* another run published it first: this one is dropped */
        u->pub(u->args, j0, j1, u->part0 + i, priv);
    }
    __atomic_store_n(&u->st[2 * i + 1], 2, __ATOMIC_RELEASE);
    if (__atomic_add_fetch(&u->done, 1, __ATOMIC_RELEASE) == u->n) notify(t); /* only the last one is awaited */
}

/* Claim and run the units of u until none is left. */
static void run_units(team *t, team_units *u, int me) {
    for (long i; (i = __atomic_fetch_add(&u->next, 1, __ATOMIC_RELAXED)) < u->n;) run_unit(t, u, i, me);
}

static int units_done(team *t, const void *u) {
    (void)t;
    return __atomic_load_n(&((team_units *)u)->done, __ATOMIC_ACQUIRE) >= ((const team_units *)u)->n;
}

/* Which threads the host has taken off their cores, as one waiter sees their heartbeats. */
typedef struct {
    long seen[64];
    uint64_t since[64];
} watch;

static int is_stalled(team *t, watch *w, long k, uint64_t now) {
    if (k < 0 || k >= 64 || k >= t->nthreads) return 0;
    if (t->stall_ns <= 0) return 1; /* every thread taken as held up: each wait runs the unit again (the tests) */
    long b = __atomic_load_n(&t->beat[k * BEAT_STRIDE], __ATOMIC_RELAXED);
    if (!w->since[k] || b != w->seen[k]) {
        w->seen[k] = b, w->since[k] = now;
        return 0;
    }
    return now - w->since[k] > (uint64_t)t->stall_ns;
}

/* Until every unit of u is published: spin while their threads run; run again (thread me) a unit whose thread
 * is off its core.  Units that write in place are awaited (spin, then park).  0 where the team stopped. */
static int finish(team *t, team_units *u, int me) {
    if (!u->pub) return await(t, units_done, u, 0);
    watch w;
    memset(w.since, 0, sizeof w.since);
    for (long spin = 0;; ++spin) {
        if (units_done(t, u)) return 1;
        if (stopped(t)) return 0;
        if ((spin & 31) != 31) {
            cpu_relax();
            continue;
        }
        uint64_t now = now_ns();
        for (long i = 0; i < u->n; ++i) {
            if (__atomic_load_n(&u->st[2 * i + 1], __ATOMIC_ACQUIRE)) continue;
            long k = __atomic_load_n(&u->st[2 * i], __ATOMIC_RELAXED) - 1;
            if (k != me && is_stalled(t, &w, k, now)) {
                __atomic_add_fetch(&t->reruns, 1, __ATOMIC_RELAXED);
                run_unit(t, u, i, me);
                break;
            }
        }
    }
}

static int finish_all(team *t, team_units *u, int nu, int me) {
    for (int k = 0; k < nu; ++k)
        if (!finish(t, u + k, me)) return 0;
    return 1;
}

static int nobody_inside(team *t, const void *arg) {
    (void)arg;
    return !__atomic_load_n(&t->inside, __ATOMIC_SEQ_CST);
}

static int run_slices_up(team *t, int me, int own) {
    for (long i = 0; i < t->ns; ++i) {
        team_slice *s = t->sl + i;
        if ((s->owner == me) != own) continue;
        for (int k = 0; k < TEAM_PHASES; ++k) {
            if (stopped(t)) return 0;
            run_units(t, s->up + k, me);
        }
    }
    return 1;
}

/* Thread me's share: the units before the scan, every up unit it can claim (its slices' first), then per slice
 * (its own first) the middle once the up units are done, and the down units.  Every wait is for units another
 * thread claimed, which it runs itself where that thread is off its core. */
static int team_work(team *t, int me) {
    run_units(t, &t->pre, me);
    if (!finish(t, &t->pre, me)) return 0;
    if (!run_slices_up(t, me, 1) || !run_slices_up(t, me, 0)) return 0;
    for (int own = 1; own >= 0; --own)
        for (long i = 0; i < t->ns; ++i) {
            team_slice *s = t->sl + i;
            if ((s->owner == me) != own) continue;
            if (__atomic_load_n(&s->mid.done, __ATOMIC_ACQUIRE) < 1) {
                if (!finish_all(t, s->up, TEAM_PHASES, me)) return 0;
                run_units(t, &s->mid, me);
                if (!finish(t, &s->mid, me)) return 0;
            }
            for (int k = 0; k < TEAM_PHASES; ++k) run_units(t, s->down + k, me);
        }
    return !stopped(t);
}

/* -- the pool -- */
static pthread_mutex_t pool_mx = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static long pool_threads, pool_gen;
static pid_t pool_pid;
static team *pool_job;

/* Thread me's share of t, which it took from the pool's slot with inside counted (so t outlives it). */
static void team_join(team *t, int me, long gen) {
    if (!__atomic_load_n(&t->closed, __ATOMIC_SEQ_CST) && __atomic_load_n(&t->gen, __ATOMIC_SEQ_CST) == gen &&
        me < t->nthreads) {
        fp_set(t->csr);
        team_work(t, me);
    }
    __atomic_sub_fetch(&t->inside, 1, __ATOMIC_SEQ_CST);
    notify(t);
}

static void *pool_main(void *arg) {
    int me = (int)(long)arg;
    long seen = 0;
    for (;;) {
        long gen;
        /* a short spin (SPIN_NS) for a scan that follows at once, then sleep */
        uint64_t t0 = now_ns();
        for (long spin = 1; (gen = __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE)) == seen; ++spin) {
            if (!(spin & 31) && now_ns() - t0 > SPIN_NS) break;
            cpu_relax();
        }
        pthread_mutex_lock(&pool_mx);
        while (pool_gen == seen) pthread_cond_wait(&pool_cv, &pool_mx);
        team *t = pool_job; /* the slot is emptied, under this lock, when its scan closes */
        seen = gen = pool_gen;
        if (t) __atomic_add_fetch(&t->inside, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&pool_mx);
        if (t) team_join(t, me, gen);
    }
    return 0;
}

/* Start pool threads up to n - 1 (again in a forked child, which has none). */
static int pool_ensure(long n) {
    if (pool_pid != getpid()) pool_threads = 0, pool_pid = getpid();
    for (; pool_threads < n - 1; ++pool_threads) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &at, pool_main, (void *)(pool_threads + 1));
        pthread_attr_destroy(&at);
        if (rc) return 0;
    }
    return 1;
}

static void reduce(team *t) {
    const int ni = (int)t->call.S.ni;
    for (long k = 0; k < t->nseg; ++k) {
        const team_seg *sg = t->seg + k;
        real *o = t->dst[sg->out] + sg->off;
        for (long a = sg->a0; a < sg->a1; ++a)
            for (long c = sg->c0; c < sg->c1; ++c) {
                real v = 0;
                for (long m = 0; m < t->nacc; ++m) {
                    const team_acc *ac = t->acc + m;
                    for (long q = 0; q < ac->parts; ++q) {
                        const real *p = ac->p + ((q * NA + a) * NBV + c) * ac->lanes;
                        for (long l = 0; l < ac->lanes; ++l) v += p[l];
                    }
                }
                *o++ = v;
            }
    }
}

static void reset_units(team_units *u) {
    u->next = u->done = 0;
    if (u->n > 0) memset(u->st, 0, sizeof(long) * 2 * u->n);
}

/* Wait until no thread of the team's last call is inside it (a straggler, off its core when the call
 * returned): before its scratch, its units' states or its operands are used again or freed. */
void team_drain(team *t) {
    if (t->nthreads <= 1) return;
    if (pool_pid && pool_pid != getpid()) /* a forked child: the parent's threads, stragglers included, are not here */
        __atomic_store_n(&t->inside, 0, __ATOMIC_SEQ_CST);
    else
        await(t, nobody_inside, 0, 1);
}

/* The whole scan, led by the calling thread.  Returns 0; 2 where a pool thread could not be started. */
int team_go(team *t) {
    team_drain(t);
    real *Wt = (real *)t->call.Wt;
    for (int g = 0; g < NW; ++g)
        for (int i = 0; i < HC; ++i)
            for (int j = 0; j < HC; ++j) Wt[(g * HC + i) * HC + j] = t->W[(g * HC + j) * HC + i];
    reset_units(&t->pre);
    for (long i = 0; i < t->ns; ++i) {
        team_slice *s = t->sl + i;
        for (int k = 0; k < TEAM_PHASES; ++k) reset_units(s->up + k), reset_units(s->down + k);
        reset_units(&s->mid);
    }
    long nt = t->nthreads < 64 ? t->nthreads : 64;
    t->stop = 0;
    t->inside = t->parked = 0;
    unsigned caller = fp_enter(&t->csr);
    if (nt > 1) {
        pthread_mutex_lock(&pool_mx);
        int ok = pool_ensure(nt);
        if (ok) {
            pool_job = t;
            t->gen = ++pool_gen;
            __atomic_store_n(&t->closed, 0, __ATOMIC_SEQ_CST);
            pthread_cond_broadcast(&pool_cv);
        }
        pthread_mutex_unlock(&pool_mx);
        if (!ok) {
            fp_set(caller);
            return 2;
        }
    } else {
        t->closed = 0;
    }
    team_work(t, 0);
    /* every slice's down units published: those another thread claimed may still run, or be run here */
    for (long i = 0; i < t->ns; ++i) finish_all(t, t->sl[i].down, TEAM_PHASES, 0);
    pthread_mutex_lock(&pool_mx); /* no thread takes t after this; those that did are counted in inside */
    __atomic_store_n(&t->closed, 1, __ATOMIC_SEQ_CST);
    if (pool_job == t) pool_job = 0;
    pthread_mutex_unlock(&pool_mx);
    if (t->dst) reduce(t);
    fp_set(caller);
    return 0;
}
