#!/usr/bin/env python3
"""Fit the polynomial coefficients of ffi/common/host_math.h and print them as C constants.

    python3 tools/fit_host_math.py

Needs only NumPy; the reference values come from float64 `math.exp`, `math.erf`, `math.erfc`.

Three near-minimax fits (Lawson's iteratively reweighted least squares on a dense grid, with each
coefficient then rounded to float32 in turn and the remaining ones refitted, so that the printed
float32 constants are the ones whose error was minimised):

exp   exp(r) ~= 1 + r + r^2 * (c2 + c3 r + c4 r^2 + c5 r^3 + c6 r^4)  on |r| <= ln2/2 (+ slack),
      minimising the relative error. host::exp reduces x = n ln2 + r and scales by 2^n.
erf   small |x| < 1:   erf(x) ~= x + x * W(x^2), W of degree 6 (W(0) = 2/sqrt(pi) - 1), minimising
                       the absolute error; evaluated as x + x*W so the last rounding is of x.
      1 <= |x| <= 4:   erf(x) = 1 - erfc(x), erfc(x) = exp(h(s) - x^2) with
                       h(x) = log(erfc(x)) + x^2 = log(erfcx(x)), a slowly varying function,
                       fitted as a polynomial in s = (x - 2.5) / 1.5 in [-1, 1]; the absolute
                       error of erf is then erfc(x) * |h error|, so the fit is weighted by erfc.
"""

import math

import numpy as np

F32 = np.float32


def lawson_fit(basis, target, weight, fixed=None, iters=200):
    """Coefficients c minimising max_i weight_i * |basis_i . c - target_i| (approximately).

    `fixed` maps column index -> value for coefficients already rounded to float32.
    """
    fixed = fixed or {}
    free = [k for k in range(basis.shape[1]) if k not in fixed]
    rhs = target - sum(basis[:, k] * v for k, v in fixed.items()) if fixed else target.copy()
    a = basis[:, free] * weight[:, None]
    b = rhs * weight
    lw = np.full(len(b), 1.0 / len(b))
    best_err, best = np.inf, None
    for _ in range(iters):
        s = np.sqrt(lw)
        sol, *_ = np.linalg.lstsq(a * s[:, None], b * s, rcond=None)
        r = np.abs(a @ sol - b)
        err = r.max()
        if err < best_err:
            best_err, best = err, sol
        lw = lw * (r + 1e-300)
        lw /= lw.sum()
    c = np.zeros(basis.shape[1])
    c[free] = best
    for k, v in fixed.items():
        c[k] = v
    return c


def fit_rounded(basis, target, weight, order):
    """Fits, then rounds coefficients to float32 one at a time in `order`, refitting the rest."""
    fixed = {}
    c = lawson_fit(basis, target, weight)
    for k in order:
        fixed[k] = float(F32(c[k]))
        c = lawson_fit(basis, target, weight, fixed)
    return c


def fit_exp():
    half = math.log(2.0) / 2 * 1.0005  # slack for the rounding of n = round(x / ln2)
    r = np.concatenate(
        [np.linspace(-half, half, 40001), half * np.sin(np.linspace(-1.57, 1.57, 4001))]
    )
    ex = np.exp(r)
    # unknowns c2..c6 of r^2 * (c2 + ... + c6 r^4); target e^r - 1 - r; relative error
    basis = np.stack([r**k for k in range(2, 7)], axis=1)
    target = np.expm1(r) - r
    c = fit_rounded(basis, target, 1.0 / ex, order=range(5))
    approx = 1.0 + r + basis @ c
    return c, np.abs(approx / ex - 1.0).max()


def fit_erf_small(deg=6):
    x = np.concatenate([np.linspace(0.0, 1.0, 40001), np.sin(np.linspace(0, 1.5707963, 4001))])
    t = x * x
    target = np.array([math.erf(v) for v in x]) - x
    basis = np.stack([x * t**k for k in range(deg + 1)], axis=1)
    c = fit_rounded(basis, target, np.ones_like(x), order=range(deg + 1))
    return c, np.abs(basis @ c - target).max()


ERF_MID, ERF_HALF = 2.5, 1.5  # the large piece covers [ERF_MID - ERF_HALF, ERF_MID + ERF_HALF]


def fit_erf_large(deg=6):
    lo, hi = ERF_MID - ERF_HALF, ERF_MID + ERF_HALF
    x = np.concatenate(
        [
            np.linspace(lo, hi, 40001),
            ERF_MID + ERF_HALF * np.sin(np.linspace(-1.5707963, 1.5707963, 4001)),
        ]
    )
    s = (x - ERF_MID) / ERF_HALF
    erfc = np.array([math.erfc(v) for v in x])
    target = np.log(erfc) + x * x
    basis = np.stack([s**k for k in range(deg + 1)], axis=1)
    c = fit_rounded(basis, target, erfc, order=range(deg + 1))
    approx = np.exp(basis @ c - x * x)
    return c, np.abs(approx - erfc).max()


def c_list(name, coeffs):
    body = ", ".join(f"{F32(v):.9e}f" for v in coeffs)
    return f"constexpr float {name}[] = {{{body}}};"


def main():
    ce, ee = fit_exp()
    cs, es = fit_erf_small()
    cl, el = fit_erf_large()
    print(f"// exp: c2..c6, max relative error of the polynomial {ee:.3g}")
    print(c_list("kExpPoly", ce))
    print(f"// erf |x| < 1: x + x * W(x^2), W0..W6, max absolute error {es:.3g}")
    print(c_list("kErfSmall", cs))
    print(
        f"// erf 1 <= |x| <= 4: log(erfcx(x)) in s = (|x| - {ERF_MID:g}) / {ERF_HALF:g}, "
        f"h0..h{len(cl) - 1}, max abs error {el:.3g}"
    )
    print(c_list("kErfLarge", cl))


if __name__ == "__main__":
    main()
