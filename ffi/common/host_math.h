// Host-side exp and erf for the CPU kernels, written so that loops over contiguous float arrays
// vectorise: no calls into libm, no data-dependent branches (selects are mask blends), 2^n built
// from integer bits. Included by math.h for host code only (formats.h also uses the TE_HD bit
// helpers, on the device too).
//
// Accuracy (checked exhaustively over every float against double precision, with and without
// FMA contraction):
//   exp  relative error <= 1 ulp over the whole float range; exp(x) = +inf for x >~ 88.72,
//        0 below the subnormal range, NaN for NaN. Subnormal results are exact to <= 1 ulp of
//        2^-149 (or 0 under flush-to-zero).
//   erf  absolute error < 1e-7; erf(+-inf) = +-1, erf(NaN) = NaN, erf(-0) = -0.
//
// The polynomial coefficients are printed by tools/fit_host_math.py (near-minimax fits against
// float64 math.exp / math.erf / math.erfc, rounded to float32).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include "common/macros.h"

#if defined(__GNUC__) || defined(__clang__)
#define TE_HOST_INLINE inline __attribute__((always_inline))
#else
#define TE_HOST_INLINE inline
#endif

namespace te_jax::math::host {

// The bit helpers are TE_HD: common/formats.h uses them in device code too (there through the
// CUDA intrinsics; __builtin_bit_cast is a host-compiler feature).
namespace bits {

TE_HD uint32_t of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
#if defined(__has_builtin)
#if __has_builtin(__builtin_bit_cast)
  return __builtin_bit_cast(uint32_t, f);
#endif
#endif
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

TE_HD float to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
#if defined(__has_builtin)
#if __has_builtin(__builtin_bit_cast)
  return __builtin_bit_cast(float, u);
#endif
#endif
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Branch-free c ? a : b. The ?: operator reaches the optimiser as a branch; GCC will not
// if-convert a branch whose arm holds floating-point arithmetic that may trap (unless
// -fno-trapping-math), and after it sinks a value used by one arm only into that arm, or threads
// a clamp's constant through the arithmetic, the enclosing loop no longer vectorises. A mask
// blend has no branch to sink into, and compiles to a compare and a blend (or and/andnot/or).
TE_HD uint32_t select(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

TE_HD float select(bool c, float a, float b) { return to_float(select(c, of(a), of(b))); }

}  // namespace bits

// exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n*ln2 in [-ln2/2, ln2/2] (Cody-Waite: ln2 in
// two parts, the high part with enough trailing zero bits that n*kLn2Hi is exact for |n| < 512).
// exp(r) = 1 + r + r^2 * q(r), q of degree 4. 2^n is applied as two factors 2^(n1) * 2^(n2),
// n1 = floor(n/2), both normal numbers, so results that overflow become +inf and results in the
// subnormal range are rounded once, by the last multiplication.
TE_HOST_INLINE float exp(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;      // 0x3f317200
  constexpr float kLn2Lo = 1.4286068203e-6f;         // ln2 - kLn2Hi
  constexpr float kRound = 12582912.0f;             // 1.5 * 2^23: v + kRound rounds v to an integer
  constexpr uint32_t kRoundBits = 0x4b400000u;      // bits of kRound; bits(kRound + n) = this + n
  const float kf = x * kLog2e + kRound;
  const float n = kf - kRound;
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  // Coefficients c2..c6 from tools/fit_host_math.py (relative error of the polynomial 3.1e-9).
  float q = 1.382093993e-03f;
  q = q * r + 8.368683048e-03f;
  q = q * r + 4.166826606e-02f;
  q = q * r + 1.666652113e-01f;
  q = q * r + 4.999999404e-01f;
  const float p = 1.0f + (r + (r * r) * q);
  // u = n + 256 (unsigned arithmetic: defined for any input; only meaningful in range).
  const uint32_t u = bits::of(kf) - (kRoundBits - 256u);
  const uint32_t h = u >> 1;                             // floor(n/2) + 128
  const float s1 = bits::to_float((h - 1u) << 23);      // 2^floor(n/2)
  const float s2 = bits::to_float((u - h - 1u) << 23);  // 2^(n - floor(n/2))
  const float e = (p * s1) * s2;
  // The scale factors are valid normal numbers for n in [-252, 254], i.e. |x| < 174: e overflows
  // to +inf for x >~ 88.72 and underflows to 0 below -103.97 by itself. Beyond +-89 / -104 the
  // result is set directly (this also covers +-inf; NaN fails both comparisons and stays NaN).
  const float big = bits::select(x > 89.0f, std::numeric_limits<float>::infinity(), e);
  return bits::select(x < -104.0f, 0.0f, big);
}

// erf(x), odd. For a = |x|:
//   a < 1:            a + a * W(a^2), W of degree 6 (absolute error of the fit 1.1e-9);
//   1 <= a <= 3.9375: 1 - E(a - 2.25), E a polynomial of degree 14 fitted to erfc (absolute
//                     error of the fit 7.2e-9); a - 2.25 is exact for a in [1, 4);
//   a > 3.9375:       1 (the correctly rounded value beyond 3.9192, where erfc < 2^-25).
// Only multiplies and adds (two Horner chains, about 21 FMAs): no exp, no division. Both pieces
// are computed and blended (no branch). The sign bit is copied back at the end. Exhaustively
// checked (tools/fit_host_math.py --check): max absolute error 7.6e-8 without FMA contraction,
// 5.9e-8 with it (both in the a < 1 piece; the a >= 1 piece: 5.9e-8 in either mode).
TE_HOST_INLINE float erf(float x) {
  const uint32_t xb = bits::of(x);
  const uint32_t sign = xb & 0x80000000u;
  const float a = bits::to_float(xb & 0x7fffffffu);  // |x|; NaN stays NaN
  const float t = a * a;
  // a < 1: W0..W6 from tools/fit_host_math.py; a + a*W rounds last at the size of a, not of the
  // product, which keeps the error below 1e-7 without FMA too.
  float w = 7.330033986e-05f;
  w = w * t + -7.843275089e-04f;
  w = w * t + 5.167904310e-03f;
  w = w * t + -2.684183605e-02f;
  w = w * t + 1.128324419e-01f;
  w = w * t + -3.761258423e-01f;
  w = w * t + 1.283791512e-01f;
  const float small = a + a * w;
  // 1 <= a <= 3.9375: E0..E14 from tools/fit_host_math.py. E > 0 there, so large <= 1.
  const float s = a - 2.25f;
  float e = -1.046947887e-06f;
  e = e * s + 3.002152653e-06f;
  e = e * s + 1.300725671e-05f;
  e = e * s + -6.439865683e-05f;
  e = e * s + 3.005637518e-05f;
  e = e * s + 3.631479049e-04f;
  e = e * s + -1.018510782e-03f;
  e = e * s + 6.782836281e-04f;
  e = e * s + 2.914817072e-03f;
  e = e * s + -1.066173706e-02f;
  e = e * s + 1.908053271e-02f;
  e = e * s + -2.172371000e-02f;
  e = e * s + 1.607052051e-02f;
  e = e * s + -7.142366841e-03f;
  e = e * s + 1.462711138e-03f;
  const float large = 1.0f - e;
  // Above 3.9375 (where E would extrapolate the fit) erf is 1.0f. A NaN fails both comparisons
  // and `large` is NaN.
  const float r = bits::select(a > 3.9375f, 1.0f, bits::select(a < 1.0f, small, large));
  return bits::to_float(bits::of(r) | sign);
}

}  // namespace te_jax::math::host
