"""Fit the compiled forward's float tanh (simd.h's vtanh1_n): tanh(x) ~ x P(x^2) / Q(x^2) on [0, CLAMP], P of
degree 6 and Q of degree 3 in x^2, Q(0) = 1, minimising the largest relative error.

The fit is Loeb's linearisation (x P - tanh Q = 0, weighted by the last iterate's 1 / (tanh Q)) inside Lawson's
reweighting, which drives a weighted least-squares fit towards the minimax one; x^2 is scaled to [0, 1] while
fitting.  Prints the error of the fit in exact (double) arithmetic and the coefficients as simd.h spells them.
Evaluated in float the rounding of the Horner steps dominates: see simd.h for the measured error."""
import argparse

import numpy as np


def fit(clamp: float, n_p: int, n_q: int, iterations: int = 400):
    x = np.concatenate([np.linspace(1e-3, clamp, 40_000), np.geomspace(1e-5, 1e-3, 200)])
    t, s = np.tanh(x), (x / clamp) ** 2
    vp = (x / clamp)[:, None] * s[:, None] ** np.arange(n_p)
    vq = s[:, None] ** np.arange(1, n_q)
    w, q_last, best = np.full(len(x), 1 / len(x)), np.ones_like(x), (np.inf, None)
    for _ in range(iterations):
        a = np.concatenate([vp, -t[:, None] * vq], 1)
        sw = np.sqrt(w) / (t * q_last)
        sol = np.linalg.lstsq(a * sw[:, None], t * sw, rcond=None)[0]
        q_last = 1 + vq @ sol[n_p:]
        err = np.abs(vp @ sol[:n_p] / q_last / t - 1)
        if err.max() < best[0]:
            best = (err.max(), sol.copy())
        w = w * np.sqrt(err + 1e-30)
        w /= w.sum()
    err, sol = best
    p = sol[:n_p] / clamp ** (2 * np.arange(n_p) + 1)
    q = np.concatenate([[1.0], sol[n_p:] / clamp ** (2 * np.arange(1, n_q))])
    return err, p, q


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clamp", type=float, default=9.0, help="the fit's range [0, CLAMP] (tanh(9) rounds to 1)")
    ap.add_argument("--p-terms", type=int, default=7)
    ap.add_argument("--q-terms", type=int, default=4)
    a = ap.parse_args()
    err, p, q = fit(a.clamp, a.p_terms, a.q_terms)
    print(f"largest relative error of the fit on [0, {a.clamp}] in double: {err:.3g}")
    print("P:", ", ".join(f"{np.float32(c):.9e}f" for c in p))
    print("Q:", ", ".join(f"{np.float32(c):.9e}f" for c in q))


if __name__ == "__main__":
    main()
