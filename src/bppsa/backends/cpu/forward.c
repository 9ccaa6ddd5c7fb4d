/* The forward of one recurrent layer on a CPU: torch.nn.RNN (tanh, relu), torch.nn.GRU and torch.nn.LSTM cells,
 * torch.nn's weight layouts and gate orders, every step's state written out (the backward reads them all).
 *
 * Compiled at first use by bppsa.backends.cpu.native.build once per CELL (0 tanh RNN, 1 relu RNN, 2 GRU, 3 LSTM),
 * hidden size HID, lane count LANES (one vector register of the target, simd.h, or half of an AVX-512 one) and REAL
 * type, and called through ctypes (the GIL released) by bppsa.backends.cpu.forward.  The input size is the call's
 * (fw_call.ni): one build serves every layer of a hidden size, the first of a stack and the ones above it alike.
 *
 * Why it is fast.  torch runs a recurrent layer's forward step by step, each step a few small GEMMs and elementwise
 * ops whose dispatch (~20-40 us a step at H = 20) is most of its time.  Here one call runs every step, and
 *  - the batch is the vector: LANES batch elements side by side (a register's reals), so every operation of a step
 *    is one vector operation across independent sequences and no lanes are ever mixed;
 *  - a step's G*H pre-activations are accumulated in registers, a tile of ACC rows at a time: each row is its own
 *    chain of multiply-adds, so ACC chains are in flight at once and the FMA units, not their latency, bound the
 *    mat-vec (one chain at a time made a plain loop latency-bound: 2.1 ms for the RNN at T = 1000, B = 16);
 *  - the input projection W_ih x_t of each step is accumulated in the same registers, before the recurrent part it
 *    does not depend on (no [T][B][G*H] intermediate written and read back);
 *  - sigmoid and tanh are simd.h's vector functions (a few ulp; tanh in float a rational function), one division
 *    each, four units side by side (one unit's dependent chain alone leaves the out-of-order window short of work);
 *  - the lane slices (jobs) are spread over a pool of threads (the end of this file).
 *
 * Layout: x [T][B][ni], the states h (and the LSTM's cells c) [T][B][H] (time-major, as torch.nn's own), the start
 * state [B][H]; W_ih [G*H][ni], W_hh [G*H][H] and the biases [G*H] as torch.nn holds them (gates r, z, n for the
 * GRU; i, f, g, o for the LSTM).  Sequence lengths (optional): a step t >= len[b] carries b's state (h_t = h_{t-1},
 * and c), the convention of bppsa.nn.backward.layer_forward.
 *
 * A job runs the steps t0 .. t1 - 1 of its lanes from a given state.  With `meet`, h (and c) already hold a stored
 * trajectory of those steps (a slice of the sliced forward, run from a guessed start): each batch element stops at
 * the first step whose new state meets the stored one (bitwise where the call's tol is 0; else max|new - stored| <=
 * tol * max|stored| over its H units, h and c each) and keeps that step and the ones after it as stored.  At tol = 0
 * nothing changes from then on: the step is a function of the state and x_t alone, computed in the same operations
 * in every job and lane, so the stored rest is what the new run would write.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#define H HID
typedef REAL real;
#define NL LANES /* the lanes: a power of two, one register or less (simd.h refuses more) */
#define SIMD_BYTES (LANES * REALBITS / 8)
#include "simd.h"

typedef fvec vec;
#define ACC (NREG - 4)                      /* accumulators of a tile; the rest hold an operand and a weight */
#define AI inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 64")
#define ALIGN __attribute__((aligned(64)))
#ifndef ACT
#define ACT 4 /* units whose activations run side by side */
#endif

_Static_assert(H >= 1, "a layer has hidden units");
_Static_assert(ACT >= 1 && ACT <= NMAX, "simd.h's _n forms take at most NMAX vectors");

#if CELL == 0 || CELL == 1
#define G 1
#elif CELL == 2
#define G 3
#elif CELL == 3
#define G 4
#else
#error "CELL: 0 tanh RNN, 1 relu RNN, 2 GRU, 3 LSTM"
#endif
/* The pre-activations of a step: G*H rows; the GRU keeps its n gate's two parts apart (n = tanh(i_n + r * h_n)):
 * rows 2H .. 3H - 1 hold h_n = W_hn h + b_hn, rows 3H .. 4H - 1 i_n = W_in x + b_in. */
#if CELL == 2
#define NPRE (4 * H)
#else
#define NPRE (G * H)
#endif

typedef struct {
    const real *x;                 /* [T][B][ni] */
    const real *Wi, *Wh, *bi, *bh; /* [G*H][ni], [G*H][H], [G*H], [G*H] (a bias NULL: none) */
    const int64_t *len;            /* [B], or NULL: every sequence T steps */
    real *h, *c;                   /* [T][B][H]: the state after each step (c: the LSTM's cells) */
    long T, B, ni;                 /* ni: the input size (>= 1) */
    double tol;                    /* the meeting's tolerance (0: bitwise) */
} fw_call;

typedef struct {
    long b0, nb;         /* batch elements b0 .. b0 + nb - 1 (nb <= LANES) as the lanes */
    long t0, t1;         /* the steps */
    const real *h0, *c0; /* the state before step t0, [B][H] (rows b0 ..); NULL: zeros */
    long meet;           /* h (and c) hold a stored trajectory of steps t0 .. t1 - 1 to meet */
    int64_t *met;        /* [B] or NULL, out: each of its batch elements' meeting step (run_job) */
    long s;              /* out: the last of its elements' meeting steps (run_job): from it on all are as stored */
} fw_job;

long fw_lanes(void) { return NL; }

/* -- moving lanes: rows of batch elements [nb][ld] <-> lane vectors [n] ------------------------------ */

/* dst[j] = (src[q * ld + j])_q for j < n, lanes past nb 0; src NULL: zeros. */
static AI void lanes_in(const real *restrict src, long ld, int n, int nb, vec *restrict dst) {
    if (!src) {
        for (int j = 0; j < n; ++j) dst[j] = SPLAT(0);
    } else if (nb == NL && n == 1 && ld == 1) {
        memcpy(dst, src, sizeof(vec));
    } else if (nb == NL) {
        real buf[n][NL] ALIGN;
        for (int q = 0; q < NL; ++q)
            for (int j = 0; j < n; ++j) buf[j][q] = src[q * ld + j];
        memcpy(dst, buf, sizeof(vec) * n);
    } else {
        real buf[n][NL] ALIGN;
        memset(buf, 0, sizeof buf);
        for (int q = 0; q < nb; ++q)
            for (int j = 0; j < n; ++j) buf[j][q] = src[q * ld + j];
        memcpy(dst, buf, sizeof(vec) * n);
    }
}

/* dst[q * H + i] = src[i]'s lane q, for q < nb. */
static AI void lanes_out(const vec *restrict src, int nb, real *restrict dst) {
    const real *s = (const real *)src;
    if (nb == NL) {
        for (int q = 0; q < NL; ++q)
            UNROLL for (int i = 0; i < H; ++i) dst[q * H + i] = s[i * NL + q];
    } else {
        for (int q = 0; q < nb; ++q)
            for (int i = 0; i < H; ++i) dst[q * H + i] = s[i * NL + q];
    }
}

/* -- a step's pre-activations ---------------------------------------------------------------------- */

/* pre[r0 + k] = st[r0 + k] + Wi[r0 + k] x + Wh[r0 + k] h for k < W, x of ni inputs (Wi or Wh NULL: that part left
 * out): the W rows' accumulators in registers, the input part first (it does not wait for h). */
static AI void tile(const real *restrict st, const real *restrict Wi, const real *restrict Wh,
                    const vec *restrict xs, int ni, const vec *restrict hs, vec *restrict pre, int r0, int W) {
    vec acc[ACC];
    UNROLL for (int k = 0; k < W; ++k) acc[k] = SPLAT(st[r0 + k]);
    if (Wi)
        for (int j = 0; j < ni; ++j) {
            vec xj = xs[j];
            UNROLL for (int k = 0; k < W; ++k) acc[k] += Wi[(long)k * ni + j] * xj;
        }
    if (Wh)
        for (int m = 0; m < H; ++m) {
            vec hm = hs[m];
            UNROLL for (int k = 0; k < W; ++k) acc[k] += Wh[(long)k * H + m] * hm;
        }
    UNROLL for (int k = 0; k < W; ++k) pre[r0 + k] = acc[k];
}

/* Rows r0 .. r0 + n - 1 (n a constant where it is called), in tiles of at most ACC; Wi, Wh point at row r0. */
static AI void rows(const real *restrict st, const real *restrict Wi, const real *restrict Wh,
                    const vec *restrict xs, int ni, const vec *restrict hs, vec *restrict pre, int r0, int n) {
    const int nt = (n + ACC - 1) / ACC, ct = (n + nt - 1) / nt, cl = n - (nt - 1) * ct;
    for (int t = 0; t + 1 < nt; ++t)
        tile(st, Wi ? Wi + (long)t * ct * ni : 0, Wh ? Wh + (long)t * ct * H : 0, xs, ni, hs, pre, r0 + t * ct, ct);
    tile(st, Wi ? Wi + (long)(nt - 1) * ct * ni : 0, Wh ? Wh + (long)(nt - 1) * ct * H : 0, xs, ni, hs, pre,
         r0 + (nt - 1) * ct, cl);
}

/* Each row's constant part: the biases b_ih + b_hh (the GRU's n gate: b_hn and b_in apart). */
static void starts(const fw_call *C, real *st) {
    for (int r = 0; r < G * H; ++r) {
        real bi = C->bi ? C->bi[r] : 0, bh = C->bh ? C->bh[r] : 0;
#if CELL == 2
        if (r >= 2 * H) {
            st[r] = bh, st[r + H] = bi;
            continue;
        }
#endif
        st[r] = bi + bh;
    }
}

/* The activations of units i0 .. i0 + n - 1 (n a constant where it is called), side by side (simd.h's _n forms). */
static AI void act(const vec *pre, const vec *hs, const vec *cs, vec *hn, vec *cn, int i0, int n) {
    (void)hs, (void)cs, (void)cn;
#if CELL == 0
    EACH(j, n) hn[i0 + j] = pre[i0 + j];
    vtanh1_n(hn + i0, n);
#elif CELL == 1
    EACH(j, n) hn[i0 + j] = blend(pre[i0 + j] < SPLAT(0), SPLAT(0), pre[i0 + j]); /* torch's relu: NaN stays NaN */
#elif CELL == 2
    /* torch's GRU cell: n = tanh(i_n + r * h_n), h' = (h - n) * z + n */
    vec r[n], z[n], g[n];
    EACH(j, n) r[j] = pre[i0 + j], z[j] = pre[H + i0 + j];
    vsigm_n(r, n);
    vsigm_n(z, n);
    EACH(j, n) g[j] = pre[3 * H + i0 + j] + r[j] * pre[2 * H + i0 + j];
    vtanh1_n(g, n);
    EACH(j, n) hn[i0 + j] = (hs[i0 + j] - g[j]) * z[j] + g[j];
#else
    /* torch's LSTM cell: c' = f c + i g, h' = o tanh(c') */
    vec ig[n], fg[n], gg[n], og[n];
    EACH(j, n) ig[j] = pre[i0 + j], fg[j] = pre[H + i0 + j], gg[j] = pre[2 * H + i0 + j], og[j] = pre[3 * H + i0 + j];
    vsigm_n(ig, n);
    vsigm_n(fg, n);
    vtanh1_n(gg, n);
    vsigm_n(og, n);
    EACH(j, n) cn[i0 + j] = fg[j] * cs[i0 + j] + ig[j] * gg[j];
    EACH(j, n) gg[j] = cn[i0 + j];
    vtanh1_n(gg, n);
    EACH(j, n) hn[i0 + j] = og[j] * gg[j];
#endif
}

/* One step of the cell: hn (and cn) from the state hs (cs) and the input xs. */
static void step(const fw_call *C, const real *st, const vec *xs, const vec *hs, const vec *cs, vec *hn, vec *cn) {
    vec pre[NPRE] ALIGN;
    const int ni = (int)C->ni;
#if CELL == 2
    rows(st, C->Wi, C->Wh, xs, ni, hs, pre, 0, 2 * H);
    rows(st, 0, C->Wh + 2 * H * H, xs, ni, hs, pre, 2 * H, H);
    rows(st, C->Wi + 2 * H * ni, 0, xs, ni, hs, pre, 3 * H, H);
#else
    rows(st, C->Wi, C->Wh, xs, ni, hs, pre, 0, G * H);
#endif
    for (int i = 0; i + ACT <= H; i += ACT) act(pre, hs, cs, hn, cn, i, ACT);
    if (H % ACT) act(pre, hs, cs, hn, cn, H - H % ACT, H % ACT);
}

/* -- meeting a stored trajectory -------------------------------------------------------------------- */

/* Whether lane q of the new state v equals the stored state s ([.][H], at lane 0) bit for bit (tol = 0: the first
 * unit that differs ends the test, so a lane that does not meet costs one comparison). */
static int lane_equal(const vec *v, const real *s, int q) {
    const real *n = (const real *)v;
    for (int i = 0; i < H; ++i)
        if (memcmp(n + i * NL + q, s + q * H + i, sizeof(real))) return 0;
    return 1;
}

/* Whether lanes 0 .. nb - 1 of the new state v meet the stored rows s ([nb][H]) within tol > 0, into out[q]:
 * max_i |v_i - s_i| <= tol * max_i |s_i| (the maxima in real, NaN units passed over; the comparison in double).
 * Every unit counts here, so the lanes are tested together: the stored rows brought into lanes, H vector steps. */
static void lanes_meet_tol(const vec *v, const real *s, int nb, double tol, char *out) {
    vec sv[H] ALIGN, d = SPLAT(0), a = SPLAT(0);
    lanes_in(s, H, H, nb, sv);
    for (int i = 0; i < H; ++i) {
        vec e = v[i] - sv[i], m = sv[i];
        e = blend(e < SPLAT(0), -e, e);
        m = blend(m < SPLAT(0), -m, m);
        d = blend(e > d, e, d);
        a = blend(m > a, m, a);
    }
    for (int q = 0; q < nb; ++q) out[q] = d[q] <= tol * a[q];
}

#if CELL == 0
/* Whether any of lanes 0 .. nb - 1 of v may meet the stored rows s within tol > 0 (lanes_meet_tol's test): a tanh
 * RNN's states lie in [-1, 1], so tol * max|s| <= tol, and a lane whose first unit alone differs by more than tol
 * cannot meet.  Its |v_0 - s_0| is computed in real, as lanes_meet_tol computes it, so a lane this passes over is one
 * it would refuse: one unit of each lane instead of every unit, where no lane is near (a layer that remembers). */
static int lanes_may_meet_tol(const vec *v, const real *s, int nb, double tol) {
    const real *n = (const real *)v;
    for (int q = 0; q < nb; ++q) {
        real e = n[q] - s[q * H];
        e = e < 0 ? -e : e;
        if (!((double)e > tol)) return 1;
    }
    return 0;
}
#endif

/* Lane q of the state v into steps t .. t1 - 1 of dst ([T][B][H], at lane 0): a sequence that has ended carries it
 * to the end. */
static void fill_lane(const vec *v, int q, real *dst, long B, long t, long t1) {
    const real *s = (const real *)v;
    for (long u = t; u < t1; ++u)
        for (int i = 0; i < H; ++i) dst[(u * B + q) * H + i] = s[i * NL + q];
}

/* -- a job: steps t0 .. t1 - 1 of its lanes ----------------------------------------------------------
 * Meeting (J->meet), each batch element on its own: element b is done at the first step s_b whose new state meets
 * the stored one (it keeps the stored states from s_b on; met[b] = s_b), or once its sequence has ended without
 * meeting (its state is then a constant: written to t1 at once; met[b] = t1).  The job stops when every element
 * of its lanes is done.  So what is written depends on each element's own trajectory only, never on the lanes it
 * shares a job with (or on the target's register width). */
static void run_job(const fw_call *C, fw_job *J) {
    const long B = C->B, b0 = J->b0;
    const int nb = (int)J->nb;
    real st[NPRE];
    starts(C, st);
    const int ni = (int)C->ni;
    vec xs[ni] ALIGN, hb[2][H] ALIGN, cb[2][H] ALIGN;
    vec *hs = hb[0], *hn = hb[1], *cs = cb[0], *cn = cb[1];
    lanes_in(J->h0 ? J->h0 + b0 * H : 0, H, H, nb, hs);
#if CELL == 3
    lanes_in(J->c0 ? J->c0 + b0 * H : 0, H, H, nb, cs);
#endif
    vec lenv = SPLAT(0);
    long len[NL], met[NL];
    int left = nb; /* lanes not done */
    char done[NL];
    for (int q = 0; q < NL; ++q) {
        done[q] = q >= nb, met[q] = J->t1;
        len[q] = q >= nb || !C->len ? C->T : C->len[b0 + q] < C->T ? (long)C->len[b0 + q] : C->T;
        lenv[q] = (real)len[q];
    }
    long t;
    for (t = J->t0; t < J->t1 && left; ++t) {
        lanes_in(C->x + (t * B + b0) * ni, ni, ni, nb, xs);
        step(C, st, xs, hs, cs, hn, cn);
        if (C->len) { /* past its end a sequence keeps its state */
            ivec on = SPLAT((real)t) < lenv;
            for (int i = 0; i < H; ++i) hn[i] = blend(on, hn[i], hs[i]);
#if CELL == 3
            for (int i = 0; i < H; ++i) cn[i] = blend(on, cn[i], cs[i]);
#endif
        }
        real *ht = C->h + (t * B + b0) * H;
#if CELL == 3
        real *ct = C->c + (t * B + b0) * H;
#endif
        int all = left == nb; /* every lane still written: the fast stores */
        char meets[NL];
        if (J->meet && C->tol != 0) {
#if CELL == 0 /* (with lengths a carried h_0 may lie outside [-1, 1]) */
            if (!C->len && !lanes_may_meet_tol(hn, ht, nb, C->tol))
                memset(meets, 0, sizeof meets);
            else
#endif
                lanes_meet_tol(hn, ht, nb, C->tol, meets);
#if CELL == 3
            char meets_c[NL];
            lanes_meet_tol(cn, ct, nb, C->tol, meets_c);
            for (int q = 0; q < nb; ++q) meets[q] = meets[q] && meets_c[q];
#endif
        }
        if (J->meet)
            for (int q = 0; q < nb; ++q) {
                if (done[q]) continue;
#if CELL == 3
                int m = C->tol != 0 ? meets[q] : lane_equal(hn, ht, q) && lane_equal(cn, ct, q);
#else
                int m = C->tol != 0 ? meets[q] : lane_equal(hn, ht, q);
#endif
                if (!m && t < len[q]) continue;
                if (!m) { /* ended, and its carry differs from the stored one: it never meets */
                    fill_lane(hn, q, C->h + b0 * H, B, t, J->t1);
#if CELL == 3
                    fill_lane(cn, q, C->c + b0 * H, B, t, J->t1);
#endif
                }
                done[q] = 1, met[q] = m ? t : J->t1, --left, all = 0;
            }
        if (all) {
#if CELL == 3
            lanes_out(cn, nb, ct);
#endif
            lanes_out(hn, nb, ht);
        } else {
            for (int q = 0; q < nb; ++q)
                if (!done[q]) {
                    fill_lane(hn, q, C->h + b0 * H, B, t, t + 1);
#if CELL == 3
                    fill_lane(cn, q, C->c + b0 * H, B, t, t + 1);
#endif
                }
        }
        vec *p = hs;
        hs = hn, hn = p;
        p = cs, cs = cn, cn = p;
    }
    long s = J->meet ? J->t0 : J->t1;
    for (int q = 0; q < nb; ++q) {
        if (J->met) J->met[b0 + q] = J->meet ? met[q] : J->t1;
        s = J->meet && met[q] > s ? met[q] : s;
    }
    J->s = s;
}

/* -- the threads: jobs claimed from a shared counter by the caller and a pool -------------------------
 * The pool's threads spin briefly (SPIN_NS) for a call that follows at once, then sleep on a condition variable;
 * each runs in the caller's floating-point mode (subnormals flushed or not), so a job gives the same bits on any
 * thread.  The caller takes jobs too; once none is left to claim it closes the call (a thread that wakes later
 * takes nothing) and waits for the threads still running one. */
#define SPIN_NS 50000L
#define MAX_THREADS 64

typedef struct {
    const fw_call *C;
    fw_job *jobs;
    long n, next;
    unsigned csr;
} fw_batch;

static pthread_mutex_t pool_mx = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER, pool_idle = PTHREAD_COND_INITIALIZER;
static long pool_threads, pool_gen, pool_want, pool_inside;
static pid_t pool_pid;
static fw_batch *pool_job;

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

static void take_jobs(fw_batch *b) {
    for (long i; (i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED)) < b->n;) run_job(b->C, b->jobs + i);
}

static void *pool_main(void *arg) {
    long me = (long)arg, seen = 0;
    for (;;) {
        uint64_t t0 = now_ns();
        for (long spin = 1; __atomic_load_n(&pool_gen, __ATOMIC_ACQUIRE) == seen; ++spin) {
            if (!(spin & 31) && now_ns() - t0 > SPIN_NS) break;
            cpu_relax();
        }
        pthread_mutex_lock(&pool_mx);
        while (pool_gen == seen) pthread_cond_wait(&pool_wake, &pool_mx);
        seen = pool_gen;
        fw_batch *b = me < pool_want ? pool_job : 0;
        if (b) __atomic_add_fetch(&pool_inside, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&pool_mx);
        if (!b) continue;
        fp_set(b->csr);
        take_jobs(b);
        pthread_mutex_lock(&pool_mx);
        if (__atomic_sub_fetch(&pool_inside, 1, __ATOMIC_RELEASE) == 0) pthread_cond_broadcast(&pool_idle);
        pthread_mutex_unlock(&pool_mx);
    }
    return 0;
}

/* Pool threads up to n (again in a forked child, which has none); under pool_mx. */
static int pool_ensure(long n) {
    if (pool_pid != getpid()) pool_threads = 0, pool_pid = getpid();
    for (; pool_threads < n; ++pool_threads) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &at, pool_main, (void *)pool_threads);
        pthread_attr_destroy(&at);
        if (rc) return 0;
    }
    return 1;
}

/* The pool serves one call at a time: a call made while another holds it (from another thread of the caller's)
 * runs its jobs on its own thread -- the same bits, only slower. */
static pthread_mutex_t pool_owner = PTHREAD_MUTEX_INITIALIZER;

/* Run the n jobs on up to `threads` threads (this one among them).  Returns 0; 2 where a pool thread could not
 * be started (the jobs then ran on the threads there were). */
int fw_run(const fw_call *C, fw_job *jobs, long n, long threads) {
    fw_batch b = {C, jobs, n, 0, fp_get()};
    long p = threads < n ? threads : n, rc = 0;
    if (p > MAX_THREADS) p = MAX_THREADS;
    if (p > 1 && pthread_mutex_trylock(&pool_owner)) p = 1;
    if (p > 1) {
        pthread_mutex_lock(&pool_mx);
        if (!pool_ensure(p - 1)) rc = 2;
        pool_job = &b, pool_want = p - 1;
        __atomic_add_fetch(&pool_gen, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_mx);
    }
    take_jobs(&b);
    if (p > 1) {
        pthread_mutex_lock(&pool_mx);
        pool_job = 0;
        pthread_mutex_unlock(&pool_mx);
        /* the threads still in a job: spin a while (a quiet machine's wait), then sleep */
        uint64_t t0 = now_ns();
        for (long spin = 1; __atomic_load_n(&pool_inside, __ATOMIC_ACQUIRE); ++spin) {
            if (!(spin & 31) && now_ns() - t0 > SPIN_NS) break;
            cpu_relax();
        }
        pthread_mutex_lock(&pool_mx);
        while (pool_inside) pthread_cond_wait(&pool_idle, &pool_mx);
        pthread_mutex_unlock(&pool_mx);
        pthread_mutex_unlock(&pool_owner);
    }
    return (int)rc;
}
