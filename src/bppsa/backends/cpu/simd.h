/* The build target's vector registers and the vector math the CPU kernels share (chain_scan.c, forward.c).
 *
 * Included after the kernel's `typedef REAL real;` (REALBITS: its width in bits).  fvec is one whole register of
 * reals (or SIMD_BYTES), the type of every function here.  No operation mixes lanes: a lane's value depends on that lane's
 * inputs only, never on its neighbours (so a batch element gets the same bits in any slice of lanes). */
#ifndef BPPSA_SIMD_H
#define BPPSA_SIMD_H

/* The target's vector registers, from the compiler's own macros for the -march it was given (the Python side
 * reads the same macros to size LANES: bppsa.backends.cpu.native.target): their width in bytes and how many
 * there are.  Every vector type below fits one register, and every block of accumulators fits the register
 * file (ACC of them, the rest left for the operands): a vector or a tile wider than that is built piecewise
 * through the stack (on AVX2, 64-byte vectors made the scan ~10x slower). */
#if defined(__AVX512F__)
#define VREG_BYTES 64
#define NREG 32
#elif defined(__AVX__)
#define VREG_BYTES 32
#define NREG 16
#elif defined(__aarch64__) || defined(__ARM_NEON)
#define VREG_BYTES 16
#define NREG 32
#else /* SSE2 (every x86-64) and other 16-byte SIMD */
#define VREG_BYTES 16
#define NREG 16
#endif

/* The calling thread's floating-point mode (x86's MXCSR, AArch64's FPCR: rounding, subnormals flushed or not), read
 * and set: a kernel's threads run a call in one mode, so a unit gives the same bits on any of them. */
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif
static inline unsigned fp_get(void) {
#if defined(__SSE__) || defined(__x86_64__)
    return _mm_getcsr();
#elif defined(__aarch64__)
    return (unsigned)__builtin_aarch64_get_fpcr();
#else
    return 0;
#endif
}

static inline void fp_set(unsigned m) {
#if defined(__SSE__) || defined(__x86_64__)
    _mm_setcsr(m);
#elif defined(__aarch64__)
    __builtin_aarch64_set_fpcr(m);
#else
    (void)m;
#endif
}

/* The vectors of the functions below: one register (SIMD_BYTES, unless the kernel asks for a narrower power of two
 * before including this: the forward's narrower lane slices). */
#ifndef SIMD_BYTES
#define SIMD_BYTES VREG_BYTES
#endif
_Static_assert(SIMD_BYTES <= VREG_BYTES && (SIMD_BYTES & (SIMD_BYTES - 1)) == 0, "a vector of at most one register");
typedef real fvec __attribute__((vector_size(SIMD_BYTES), aligned(sizeof(real))));
#if REALBITS == 32
typedef int ivec __attribute__((vector_size(SIMD_BYTES)));
typedef ivec kvec;
#define EXP_HI 88.0f
#define EXP_LO (-87.0f)
#define MANT 23
#define BIAS 127
#else
typedef long long ivec __attribute__((vector_size(SIMD_BYTES)));
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__AVX512DQ__)
/* exp's k = round(x / ln2) (|k| < 1100) in 32-bit lanes: x86 converts between double and 64-bit integers only
 * from AVX-512 on, between double and 32-bit ones everywhere. */
typedef int kvec __attribute__((vector_size(SIMD_BYTES / 2)));
#else
typedef ivec kvec;
#endif
#define EXP_HI 709.0
#define EXP_LO (-708.0)
#define MANT 52
#define BIAS 1023
#endif
#define SPLAT(v) ((fvec){0} + (real)(v))

static inline fvec blend(ivec mask, fvec yes, fvec no) { return (fvec)(((ivec)yes & mask) | ((ivec)no & ~mask)); }

/* c < a ? c : a and c > a ? c : a, lane by lane: a where a is NaN, exactly blend(a > c, c, a) and blend(a < c, c, a)
 * -- in one instruction on x86 (minps(c, a) returns its second operand where either is NaN), where the blend is a
 * compare and two or three logic operations. */
#if defined(__SSE2__) && (SIMD_BYTES == 16 || (SIMD_BYTES == 32 && defined(__AVX__)) || \
                                                   (SIMD_BYTES == 64 && defined(__AVX512F__)))
#include <immintrin.h>
#if REALBITS == 32 && SIMD_BYTES == 16
#define VMIN_ _mm_min_ps
#define VMAX_ _mm_max_ps
#define VREG_ __m128
#elif REALBITS == 32 && SIMD_BYTES == 32
#define VMIN_ _mm256_min_ps
#define VMAX_ _mm256_max_ps
#define VREG_ __m256
#elif REALBITS == 32
#define VMIN_ _mm512_min_ps
#define VMAX_ _mm512_max_ps
#define VREG_ __m512
#elif SIMD_BYTES == 16
#define VMIN_ _mm_min_pd
#define VMAX_ _mm_max_pd
#define VREG_ __m128d
#elif SIMD_BYTES == 32
#define VMIN_ _mm256_min_pd
#define VMAX_ _mm256_max_pd
#define VREG_ __m256d
#else
#define VMIN_ _mm512_min_pd
#define VMAX_ _mm512_max_pd
#define VREG_ __m512d
#endif
static inline fvec vmin(fvec c, fvec a) { return (fvec)VMIN_((VREG_)c, (VREG_)a); }
static inline fvec vmax(fvec c, fvec a) { return (fvec)VMAX_((VREG_)c, (VREG_)a); }
#undef VMIN_
#undef VMAX_
#undef VREG_
#else
static inline fvec vmin(fvec c, fvec a) { return blend(a > c, c, a); }
static inline fvec vmax(fvec c, fvec a) { return blend(a < c, c, a); }
#endif

/* The functions on n independent vectors at once (the _n forms; n a constant where they are inlined): each
 * statement is applied to all n before the next, so n dependency chains run side by side.  One exp is a chain of
 * ~30 dependent operations (~90 cycles): one vector at a time, the out-of-order window holds too few of them to
 * keep the units busy (the forward's activations took 3x longer so).  Each vector gets the same operations, in the
 * same order, for any n. */
#define EACH(k, n) _Pragma("GCC unroll 16") for (int k = 0; k < (n); ++k)
#define SIMD_AI inline __attribute__((always_inline))
#define NMAX 16 /* the most vectors an _n form takes (EACH unrolls that many) */

/* x = exp(x) for every lane: x = k ln2 + r (Cody-Waite), |r| <= ln2/2, exp(r) by a polynomial (float: Cephes'
 * expf, ~1 ulp; double: Taylor to r^13, ~1e-16), times 2^k built in the exponent bits. */
static SIMD_AI void vexp_n(fvec *x, int n) {
    fvec k[NMAX], p[NMAX], r[NMAX];
    kvec ki[NMAX];
    EACH(j, n) x[j] = vmax(SPLAT(EXP_LO), vmin(SPLAT(EXP_HI), x[j]));
    EACH(j, n) {
        fvec t = x[j] * SPLAT(1.44269504088896340736);
        ki[j] = __builtin_convertvector(t + blend(t >= SPLAT(0), SPLAT(0.5), SPLAT(-0.5)), kvec);
    }
    EACH(j, n) k[j] = __builtin_convertvector(ki[j], fvec);
#if REALBITS == 32
    EACH(j, n) r[j] = x[j] - k[j] * SPLAT(0.693359375f) - k[j] * SPLAT(-2.12194440e-4f);
    EACH(j, n) p[j] = SPLAT(1.9875691500e-4f);
    EACH(j, n) p[j] = p[j] * r[j] + SPLAT(1.3981999507e-3f);
    EACH(j, n) p[j] = p[j] * r[j] + SPLAT(8.3334519073e-3f);
    EACH(j, n) p[j] = p[j] * r[j] + SPLAT(4.1665795894e-2f);
    EACH(j, n) p[j] = p[j] * r[j] + SPLAT(1.6666665459e-1f);
    EACH(j, n) p[j] = p[j] * r[j] + SPLAT(5.0000001201e-1f);
    EACH(j, n) p[j] = p[j] * r[j] * r[j] + r[j] + SPLAT(1);
#else
    EACH(j, n) r[j] = x[j] - k[j] * SPLAT(6.93145751953125e-1) - k[j] * SPLAT(1.42860682030941723212e-6);
    EACH(j, n) p[j] = SPLAT(1.0 / 6227020800.0); /* 1/13! */
    static const double inv_fact[] = {1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
                                      1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0,
                                      1.0 / 6.0, 0.5, 1.0, 1.0};
    for (int i = 0; i < 13; ++i) EACH(j, n) p[j] = p[j] * r[j] + SPLAT(inv_fact[i]);
#endif
    EACH(j, n) x[j] = p[j] * (fvec)((__builtin_convertvector(ki[j], ivec) + BIAS) << MANT);
}

static inline fvec vexp(fvec x) {
    vexp_n(&x, 1);
    return x;
}

/* p = sigmoid(x) and q = 1 - p = sigmoid(-x) = e^-x p, each to a few ulp (1 - p would cancel as p nears 1); one
 * division. */
static inline void vsigmoid(fvec x, fvec *p, fvec *q) {
    fvec e = vexp(-x), d = SPLAT(1) + e, r = SPLAT(1) / d;
    *p = r;
    *q = e * r;
}
/* n = tanh(x) and s = 1 - n^2, both to a few ulp.  Near 0 (|x| < 0.625) n is Cephes' odd expansion
 * (float: tanhf's polynomial; double: tanh's rational), where 1 - 2 / (e^2x + 1) would cancel, and
 * s = 1 - n^2 loses nothing (n^2 < 0.31).  Further out, with u = e^-2|x|, n = ±(1 - u) / (1 + u) and
 * s = 4u / (1 + u)^2: 1 - n^2 from a rounded n would lose digits as |n| nears 1, and the GRU's
 * e = (1 - z)(1 - n^2) is a factor of every gate's gradient. */
static inline void vtanh(fvec x, fvec *n, fvec *s) {
    fvec z = x * x, near;
#if REALBITS == 32
    near = SPLAT(-5.70498872745e-3f);
    near = near * z + SPLAT(2.06390887954e-2f);
    near = near * z + SPLAT(-5.37397155531e-2f);
    near = near * z + SPLAT(1.33314422036e-1f);
    near = near * z + SPLAT(-3.33332819422e-1f);
    near = near * z * x + x;
#else
    fvec P = (SPLAT(-9.64399179425052238628e-1) * z + SPLAT(-9.92877231001918586564e1)) * z +
             SPLAT(-1.61468768441708447952e3);
    fvec Q = ((z + SPLAT(1.12811678491632931402e2)) * z + SPLAT(2.23548839060100448583e3)) * z +
             SPLAT(4.84406305325125486048e3);
    near = x + x * (z * P / Q);
#endif
    ivec neg = x < SPLAT(0), small = (x < SPLAT(0.625)) & (x > SPLAT(-0.625));
    fvec ax = blend(neg, -x, x), u = vexp(SPLAT(-2) * ax), d = SPLAT(1) + u;
    fvec far = (SPLAT(1) - u) / d;
    *n = blend(small, near, blend(neg, -far, far));
    *s = blend(small, SPLAT(1) - near * near, SPLAT(4) * u / (d * d));
}


/* x = sigmoid(x) alone (the forward's gates: no 1 - p needed, one division). */
static SIMD_AI void vsigm_n(fvec *x, int n) {
    fvec e[NMAX];
    EACH(j, n) e[j] = -x[j];
    vexp_n(e, n);
    EACH(j, n) x[j] = SPLAT(1) / (SPLAT(1) + e[j]);
}

/* x = tanh(x) alone (the forward's activations: no derivative needed).
 * float: one rational function, x P(x^2) / Q(x^2), P of degree 6 and Q of degree 3 in x^2, fitted to tanh's relative
 * error on [0, 9] (scripts/fit_tanh.py: 6.6e-9 in exact arithmetic), x clamped to +-9 (beyond it tanh rounds to +-1)
 * and the result to +-1 (the Horner steps' rounding can pass it by an ulp or two near 9).  Within 5.4 ulp of tanh over
 * every float (mean 0.6-1 ulp; exp's form below: 1.5), in 14 operations and one division against that form's ~40:
 * the tanh RNN's step is 1.6x faster for it.  double: vtanh's n, as the backward computes it. */
static SIMD_AI void vtanh1_n(fvec *x, int n) {
#if REALBITS == 32
    static const float P[7] = {1.000000000e+00f, 1.308401525e-01f, 3.103961935e-03f, 1.115436589e-05f,
                               -2.022544976e-08f, 5.278050566e-11f, -8.488958099e-14f};
    static const float Q[4] = {1.000000000e+00f, 4.641734362e-01f, 2.449520119e-02f, 2.546153264e-04f};
    EACH(j, n) {
        fvec a = vmax(SPLAT(-9), vmin(SPLAT(9), x[j])), z = a * a, p = SPLAT(P[6]), q = SPLAT(Q[3]);
        for (int k = 5; k >= 0; --k) p = p * z + SPLAT(P[k]);
        for (int k = 2; k >= 0; --k) q = q * z + SPLAT(Q[k]);
        x[j] = vmax(SPLAT(-1), vmin(SPLAT(1), a * p / q));
    }
#else
    fvec z[NMAX], near[NMAX], u[NMAX];
    EACH(j, n) z[j] = x[j] * x[j];
    EACH(j, n) {
        fvec P = (SPLAT(-9.64399179425052238628e-1) * z[j] + SPLAT(-9.92877231001918586564e1)) * z[j] +
                 SPLAT(-1.61468768441708447952e3);
        fvec Q = ((z[j] + SPLAT(1.12811678491632931402e2)) * z[j] + SPLAT(2.23548839060100448583e3)) * z[j] +
                 SPLAT(4.84406305325125486048e3);
        near[j] = x[j] + x[j] * (z[j] * P / Q);
    }
    EACH(j, n) u[j] = SPLAT(-2) * blend(x[j] < SPLAT(0), -x[j], x[j]);
    vexp_n(u, n);
    EACH(j, n) {
        ivec neg = x[j] < SPLAT(0), small = (x[j] < SPLAT(0.625)) & (x[j] > SPLAT(-0.625));
        fvec far = (SPLAT(1) - u[j]) / (SPLAT(1) + u[j]);
        x[j] = blend(small, near[j], blend(neg, -far, far));
    }
#endif
}


#endif
