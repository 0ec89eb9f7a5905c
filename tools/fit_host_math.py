#!/usr/bin/env python3
"""Fit the polynomial coefficients of ffi/common/host_math.h (and of common/math.h's device erf)
and print them as C constants.

    python3 tools/fit_host_math.py [--check | --check-device [--full]]

Needs only NumPy; the reference values come from float64 `math.exp`, `math.erf`, `math.erfc`.

Three near-minimax fits (Lawson's iteratively reweighted least squares on a dense grid, with each
coefficient then rounded to float32 in turn and the remaining ones refitted, so that the printed
float32 constants are the ones whose error was minimised):

exp   exp(r) ~= 1 + r + r^2 * (c2 + c3 r + c4 r^2 + c5 r^3 + c6 r^4)  on |r| <= ln2/2 (+ slack),
      minimising the relative error. host::exp reduces x = n ln2 + r and scales by 2^n.
erf   small |x| < 1:   erf(x) ~= x + x * W(x^2), W of degree 6 (W(0) = 2/sqrt(pi) - 1), minimising
                       the absolute error; evaluated as x + x*W so the last rounding is of x.
      1 <= |x| <= 3.9375:
                       erf(x) = 1 - erfc(x), erfc(x) ~= E(s), E a polynomial of degree 14 in
                       s = |x| - 2.25 (exact in float32 on this range), minimising the absolute
                       error of erfc (= that of erf). No exp and no division: two Horner chains
                       and a blend. The centre 2.25 (of 2, 2.25, 2.5 tried) gave the smallest
                       float32 evaluation error under --check.
      |x| > 3.9375:    1. Beyond 3.9192, erfc(x) < 2^-25 (half the spacing of floats below 1),
                       so 1.0f is the correctly rounded erf.

device erf (common/math.h, CUDA only): erf(x) = sign(x) * (1 - 2^P(t)), t = min(|x|, 3.9375),
      P(t) = t * Q(t) ~= log2(erfc(t)) with Q of degree 7, minimising the absolute error of erf
      (weight erfc(t) ln 2). Branch-free on the GPU: a clamp, 8 FMAs, exp2f, a subtraction.
      `--check-device` evaluates that float32 form (FMAs emulated, 2^p exact) against double erf
      on every 61st float32 in [0, 4.5] (`--full`: every one); kernel_test measures it on the GPU,
      exp2f's error included.

`--check` compiles host::erf from ffi/common/host_math.h with the host C++ compiler (g++ by
default, $CXX) and compares it with double-precision erf over all 2^32 float inputs, once per
floating-point contraction mode (x86-64: -march=x86-64-v4, -march=x86-64-v3 (FMA), baseline
-march=x86-64 (no FMA), -march=x86-64-v3 -ffp-contract=off), all at -O3 -fno-trapping-math as the
CPU extension is built, so the loop under test is vectorised as the kernels' are. It reports the
max absolute error per piece and fails on a NaN for a non-NaN input, |erf| > 1, a wrong sign
(erf(-0) must be -0), erf(NaN) not NaN, or erf(+-inf) != +-1.
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


ERF_SPLIT = 1.0  # |x| < ERF_SPLIT: the small piece
ERF_ONE = 3.9375  # |x| > ERF_ONE: erf = 1 (63/16, exact in float32)
ERF_MID = 2.25  # E is a polynomial in s = |x| - ERF_MID


def fit_erf_large(deg=14):
    lo, hi = ERF_SPLIT, ERF_ONE
    x = np.concatenate(
        [
            np.linspace(lo, hi, 40001),
            (lo + hi) / 2 + (hi - lo) / 2 * np.sin(np.linspace(-1.5707963, 1.5707963, 4001)),
        ]
    )
    s = x - ERF_MID
    target = np.array([math.erfc(v) for v in x])
    basis = np.stack([s**k for k in range(deg + 1)], axis=1)
    c = fit_rounded(basis, target, np.ones_like(x), order=range(deg + 1))
    return c, np.abs(basis @ c - target).max()


def fit_erf_device(deg=8):
    """common/math.h's device erf: erf(t) = 1 - 2^P(t) for t = min(|x|, ERF_ONE), with
    P(t) = t * Q(t) ~= log2(erfc(t)) (P(0) = 0: erf(0) is exactly 0), Q of degree deg - 1.
    Minimises the absolute error of erf, erfc(t) * ln2 * |P - log2 erfc|."""
    lo, hi = 0.0, ERF_ONE
    t = np.concatenate(
        [
            np.linspace(lo, hi, 40001),
            (lo + hi) / 2 + (hi - lo) / 2 * np.sin(np.linspace(-1.5707963, 1.5707963, 4001)),
        ]
    )
    erfc_t = np.array([math.erfc(v) for v in t])
    target = np.log2(erfc_t)
    basis = np.stack([t**k for k in range(1, deg + 1)], axis=1)
    weight = erfc_t * math.log(2.0)
    c = fit_rounded(basis, target, weight, order=range(deg))
    return c, np.abs((basis @ c - target) * weight).max()


def device_erf32(x, q):
    """The device erf in float32 as math.h evaluates it: t = min(|x|, ERF_ONE), Horner with FMAs
    for Q (each FMA emulated in float64: the product is exact there, the sum rounded twice,
    which moves a result by at most one float32 ulp of an intermediate in rare ties), p = Q * t,
    then 1 - 2^p with an exact 2^p (the device's exp2f adds up to 2 ulps of 2^p <= 1)."""
    t = np.minimum(np.abs(x), F32(ERF_ONE)).astype(np.float64)
    acc = np.full_like(t, F32(q[-1]), dtype=np.float64)
    for k in range(len(q) - 2, -1, -1):
        acc = (acc * t + np.float64(F32(q[k]))).astype(F32).astype(np.float64)
    p = (acc * t).astype(F32).astype(np.float64)
    r = (1.0 - np.exp2(p).astype(F32).astype(np.float64)).astype(F32)
    return np.copysign(r, x)


def check_erf_device(q, stride=1):
    """Max |device_erf32 - erf| over every stride-th float32 in [0, 4.5] (and its sign)."""
    from math import erf

    verf = np.vectorize(erf, otypes=[np.float64])
    end = int(np.array(4.5, F32).view(np.uint32))
    worst, worst_x = 0.0, 0.0
    for b0 in range(0, end + 1, 1 << 22):
        u = np.arange(b0, min(end + 1, b0 + (1 << 22)), stride, dtype=np.uint32)
        x = u.view(F32)
        err = np.abs(device_erf32(x, q).astype(np.float64) - verf(x.astype(np.float64)))
        i = int(err.argmax())
        if err[i] > worst:
            worst, worst_x = float(err[i]), float(x[i])
    neg = device_erf32(np.array([-0.0, -1.0, np.inf, -np.inf], F32), q)
    assert np.signbit(neg[0]) and neg[1] < 0 and neg[2] == 1 and neg[3] == -1, neg
    return worst, worst_x


def c_list(name, coeffs):
    body = ", ".join(f"{F32(v):.9e}f" for v in coeffs)
    return f"constexpr float {name}[] = {{{body}}};"


CHECK_SOURCE = r"""
// Generated by tools/fit_host_math.py --check: host::erf against double erf, every float input.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "common/host_math.h"

namespace host = te_jax::math::host;

static float to_f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static uint32_t to_u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// Out of line so that this loop is vectorised like the kernels' loops.
__attribute__((noinline)) void run(const float* __restrict x, float* __restrict y, int n) {
  for (int i = 0; i < n; ++i) y[i] = host::erf(x[i]);
}

int main() {
  constexpr int kBlock = 1 << 16;
  constexpr int64_t kBlocks = (int64_t{1} << 32) / kBlock;
  double err_small = 0, err_large = 0;
  float at_small = 0, at_large = 0;
  unsigned long long bad = 0, first_bad = 0;
#pragma omp parallel
  {
    static thread_local float x[kBlock], y[kBlock];
    double es = 0, el = 0;
    float as = 0, al = 0;
    unsigned long long nbad = 0, fbad = 0;
#pragma omp for schedule(dynamic, 64)
    for (int64_t b = 0; b < kBlocks; ++b) {
      for (int i = 0; i < kBlock; ++i) x[i] = to_f(static_cast<uint32_t>(b * kBlock + i));
      run(x, y, kBlock);
      for (int i = 0; i < kBlock; ++i) {
        const float v = x[i], r = y[i];
        bool ok;
        if (std::isnan(v)) {
          ok = std::isnan(r);
        } else {
          // Finite and in [-1, 1], with the sign bit of the input (so erf(-0) = -0).
          ok = !std::isnan(r) && std::fabs(r) <= 1.0f && ((to_u(r) ^ to_u(v)) >> 31) == 0;
          const double e = std::fabs(static_cast<double>(r) - std::erf(static_cast<double>(v)));
          if (std::fabs(v) < SPLIT) {
            if (e > es) { es = e; as = v; }
          } else if (e > el) {
            el = e; al = v;
          }
        }
        if (!ok && nbad++ == 0) fbad = to_u(v);
      }
    }
#pragma omp critical
    {
      if (es > err_small) { err_small = es; at_small = as; }
      if (el > err_large) { err_large = el; at_large = al; }
      if (nbad && !bad) first_bad = fbad;
      bad += nbad;
    }
  }
  const float inf = INFINITY;
  if (host::erf(inf) != 1.0f || host::erf(-inf) != -1.0f || !std::isnan(host::erf(NAN)) ||
      to_u(host::erf(-0.0f)) != 0x80000000u) {
    ++bad;
  }
  std::printf("max abs error %.3g (|x| < %g, at x = %.9g), %.3g (|x| >= %g, at x = %.9g); "
              "bad %llu (first 0x%08llx)\n",
              err_small, SPLIT, at_small, err_large, SPLIT, at_large, bad, first_bad);
  return bad ? 1 : 0;
}
"""


def check_modes():
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        return [
            ["-march=x86-64-v4"],
            ["-march=x86-64-v3"],
            ["-march=x86-64"],
            ["-march=x86-64-v3", "-ffp-contract=off"],
        ]
    return [[], ["-ffp-contract=off"]]


def check_erf():
    """Exhaustive check of host::erf (see the module docstring). Returns a process exit code."""
    import os
    import pathlib
    import subprocess
    import tempfile

    ffi = pathlib.Path(__file__).resolve().parent.parent / "ffi"
    cxx = os.environ.get("CXX", "g++")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "check_erf.cc"
        src.write_text(CHECK_SOURCE)
        for mode in check_modes():
            exe = pathlib.Path(tmp) / "check_erf"
            cmd = [cxx, "-std=c++17", "-O3", "-fno-trapping-math", *mode]
            cmd += [f"-DSPLIT={ERF_SPLIT}f", f"-I{ffi}", str(src), "-o", str(exe)]
            # OpenMP only to use every core; the check is the same without it.
            if subprocess.run([*cmd, "-fopenmp"], capture_output=True).returncode != 0:
                subprocess.run(cmd, check=True)
            out = subprocess.run([str(exe)], capture_output=True, text=True)
            print(f"erf [{' '.join(mode) or 'default flags'}]: {out.stdout.strip()}", flush=True)
            failed |= out.returncode != 0
    return 1 if failed else 0


def main():
    import sys

    if "--check" in sys.argv[1:]:
        sys.exit(check_erf())
    ce, ee = fit_exp()
    cs, es = fit_erf_small()
    cl, el = fit_erf_large()
    print(f"// exp: c2..c6, max relative error of the polynomial {ee:.3g}")
    print(c_list("kExpPoly", ce))
    print(f"// erf |x| < {ERF_SPLIT:g}: x + x * W(x^2), W0..W6, max absolute error {es:.3g}")
    print(c_list("kErfSmall", cs))
    print(
        f"// erf {ERF_SPLIT:g} <= |x| <= {ERF_ONE:g}: 1 - E(|x| - {ERF_MID:g}), E ~= erfc, "
        f"E0..E{len(cl) - 1}, max absolute error {el:.3g}"
    )
    print(c_list("kErfLarge", cl))
    cd, ed = fit_erf_device()
    print(f"// device erf: 1 - 2^(t * Q(t)), t = min(|x|, {ERF_ONE:g}), Q0..Q{len(cd) - 1}, "
          f"max absolute error of the fit {ed:.3g}")
    print(c_list("kErfDevice", cd))
    if "--check-device" in sys.argv[1:]:
        stride = 1 if "--full" in sys.argv[1:] else 61
        worst, at = check_erf_device(cd, stride)
        print(f"// device erf in float32 (exact 2^p), every {stride} float32 in [0, 4.5]: "
              f"max absolute error {worst:.3g} at x = {at:.9g}")


if __name__ == "__main__":
    main()
