// float32 <-> FP8 / FP4 codes (docs/numerics.md §3-§4), one definition for host and device.
//
// Encoding (to_*): round to nearest, ties to even, saturating: |v| beyond the format's max,
// +-inf included, gives +-max, i.e. the bits of ml_dtypes' cast of clip(v, -max, max). For |v| at
// or above the format's smallest normal 2^emin, the float32 exponent is rebiased and the dropped
// mantissa bits are rounded in integer arithmetic: (a - rebias + half - 1 + lsb) >> drop, where
// lsb is the lowest kept bit (ties to even); a carry out of the mantissa bumps the exponent, which
// is the correct rounding. Below 2^emin the format's step is the fixed quantum 2^(emin - mbits);
// adding the power of two C whose float32 ulp is that quantum makes the FPU round |v| to a
// multiple of it (ties to even), and bits(|v| + C) - bits(C) is the code (the count of quanta,
// 2^mbits being the smallest normal). A float32 subnormal becomes 0 in every format here, so
// denormals-are-zero does not change that result.
// NaN: E4M3 -> 0x7f | sign, E5M2 -> 0x7e | sign (both as ml_dtypes and XLA give); E2M1 has no
// NaN: NaN -> 0x8 (-0) whatever its sign, as XLA's convert gives (ml_dtypes gives 0x8 for +NaN but
// 0x0 for -NaN; NVIDIA's cvt.rn.satfinite.e2m1x2 gives 0x7, +6).
// Decoding (from_*) is exact; a NaN code gives the quiet NaN 0x7fc00000 | sign (as ml_dtypes).
//
// All of it is integer bit manipulation and branch-free selects (host_math.h's bits), so CPU loops
// over contiguous arrays vectorise. On the device, sm_89+ (__CUDA_ARCH__ >= 890) converts to
// E4M3/E5M2 with cvt.rn.satfinite (<cuda_fp8.h>), which is the same rounding and saturation; its
// NaN code is patched to the host's so both give the same bits for every input. E2M1 has a
// hardware conversion only on sm_100+ (family-specific targets): the portable code runs on sm_90.
//
// MXFP8 scales (E8M0): e8m0_exponent is ceil(log2(amax / q_max)) of the exact real quotient,
// found from the bits: amax = (1 + fa) 2^ea, q = (1 + fq) 2^eq gives amax / q = r 2^(ea - eq) with
// r = (1 + fa) / (1 + fq) in (1/2, 2), and ceil(log2 r) = 1 if fa > fq, else 0. Exact for every
// amax (a subnormal one is normalised through an exact int -> float conversion, never by float
// arithmetic on it, so FTZ/DAZ cannot change it) and every positive normal q_max.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_math.h"
#include "common/macros.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace te_jax::fmt {

namespace detail {

namespace b = ::te_jax::math::host::bits;

TE_HD bool is_nan(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

TE_HD int select_int(bool c, int x, int y) {
  return static_cast<int>(b::select(c, static_cast<uint32_t>(x), static_cast<uint32_t>(y)));
}

// 2^n as a normal float, n in [-126, 127].
TE_HD float pow2(int n) { return b::to_float(static_cast<uint32_t>(n + 127) << 23); }

// NaN codes, given the float's bits (the sign is kept where the format has signed NaNs).
TE_HD uint32_t e4m3_nan(uint32_t u) { return 0x7fu | ((u >> 24) & 0x80u); }
TE_HD uint32_t e5m2_nan(uint32_t u) { return 0x7eu | ((u >> 24) & 0x80u); }

// Portable encoders (the host's, and the device's below sm_89). Per format: smallest normal
// 2^emin, rebias 127 - bias, dropped bits 23 - mbits, quantum constant C, max code.
TE_HD uint8_t to_e4m3(float v) {  // emin -6, bias 7, 3 mantissa bits, C = 2^14, max 0x7e = 448
  const uint32_t u = b::of(v);
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t n = (a - (120u << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  const uint32_t normal = b::select(n > 0x7eu, 0x7eu, n);  // > 448 and inf saturate
  const uint32_t sub = b::of(b::to_float(a) + 0x1p14f) - 0x46800000u;
  const uint32_t r = b::select(a < 0x3c800000u, sub, normal) | ((u >> 24) & 0x80u);
  return static_cast<uint8_t>(b::select(is_nan(u), e4m3_nan(u), r));
}

TE_HD uint8_t to_e5m2(float v) {  // emin -14, bias 15, 2 mantissa bits, C = 2^7, max 0x7b = 57344
  const uint32_t u = b::of(v);
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t n = (a - (112u << 23) + 0xfffffu + ((a >> 21) & 1u)) >> 21;
  const uint32_t normal = b::select(n > 0x7bu, 0x7bu, n);  // > 57344 and inf saturate
  const uint32_t sub = b::of(b::to_float(a) + 0x1p7f) - 0x43000000u;
  const uint32_t r = b::select(a < 0x38800000u, sub, normal) | ((u >> 24) & 0x80u);
  return static_cast<uint8_t>(b::select(is_nan(u), e5m2_nan(u), r));
}

// The E2M1 code of the float whose bits are a, sign bit clear (0x8 for NaN).
TE_HD uint32_t e2m1_magnitude(uint32_t a) {  // emin 0, bias 1, 1 mantissa bit, C = 2^22, max 6
  const uint32_t n = (a - (126u << 23) + 0x1fffffu + ((a >> 22) & 1u)) >> 22;
  const uint32_t normal = b::select(n > 0x7u, 0x7u, n);  // > 6 and inf saturate
  const uint32_t sub = b::of(b::to_float(a) + 0x1p22f) - 0x4a800000u;
  return b::select(a > 0x7f800000u, 0x8u, b::select(a < 0x3f800000u, sub, normal));
}

TE_HD uint8_t to_e2m1(float v) {
  const uint32_t u = b::of(v);
  return static_cast<uint8_t>(e2m1_magnitude(u & 0x7fffffffu) | ((u >> 28) & 0x8u));
}

}  // namespace detail

// ---- float32 -> code ------------------------------------------------------------------------

TE_HD uint8_t to_e4m3(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint32_t hw = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  const uint32_t u = math::host::bits::of(v);
  return static_cast<uint8_t>(math::host::bits::select(detail::is_nan(u), detail::e4m3_nan(u), hw));
#else
  return detail::to_e4m3(v);
#endif
}

TE_HD uint8_t to_e5m2(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint32_t hw = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
  const uint32_t u = math::host::bits::of(v);
  return static_cast<uint8_t>(math::host::bits::select(detail::is_nan(u), detail::e5m2_nan(u), hw));
#else
  return detail::to_e5m2(v);
#endif
}

// The code in the low nibble (bit 3 = sign), as ml_dtypes.float4_e2m1fn holds it.
TE_HD uint8_t to_e2m1(float v) { return detail::to_e2m1(v); }

// The E2M1 code (sign bit clear) of q >= 0, or 0x8 for a NaN q.
TE_HD uint32_t e2m1_magnitude(float q) { return detail::e2m1_magnitude(math::host::bits::of(q)); }

// Two values at once, x in the low byte (memory order): one cvt instruction on sm_89+.
TE_HD uint16_t to_e4m3x2(float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  namespace b = math::host::bits;
  const uint32_t hw = __nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E4M3);
  const uint32_t ux = b::of(x), uy = b::of(y);
  const uint32_t lo = b::select(detail::is_nan(ux), detail::e4m3_nan(ux), hw & 0xffu);
  const uint32_t hi = b::select(detail::is_nan(uy), detail::e4m3_nan(uy), hw >> 8);
  return static_cast<uint16_t>(lo | (hi << 8));
#else
  return static_cast<uint16_t>(detail::to_e4m3(x) | (detail::to_e4m3(y) << 8));
#endif
}

TE_HD uint16_t to_e5m2x2(float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  namespace b = math::host::bits;
  const uint32_t hw = __nv_cvt_float2_to_fp8x2(make_float2(x, y), __NV_SATFINITE, __NV_E5M2);
  const uint32_t ux = b::of(x), uy = b::of(y);
  const uint32_t lo = b::select(detail::is_nan(ux), detail::e5m2_nan(ux), hw & 0xffu);
  const uint32_t hi = b::select(detail::is_nan(uy), detail::e5m2_nan(uy), hw >> 8);
  return static_cast<uint16_t>(lo | (hi << 8));
#else
  return static_cast<uint16_t>(detail::to_e5m2(x) | (detail::to_e5m2(y) << 8));
#endif
}

// Two E2M1 codes in one byte, the first in the low nibble: how XLA stores float4_e2m1fn arrays
// (and how jax.lax.bitcast_convert_type(uint8 -> float4_e2m1fn) unpacks: 0x21 -> [0.5, 1.0]).
TE_HD uint8_t pack_e2m1(uint8_t lo, uint8_t hi) {
  return static_cast<uint8_t>((lo & 0xfu) | ((hi & 0xfu) << 4));
}

TE_HD uint8_t to_e2m1x2(float x, float y) { return pack_e2m1(to_e2m1(x), to_e2m1(y)); }

// ---- code -> float32 (exact) ------------------------------------------------------------------
// Normal codes: the code's exponent and mantissa fields shift into place together, with the
// exponent rebiased. Subnormal codes: m * quantum (an exact product of normal floats).

TE_HD float from_e4m3(uint8_t c) {
  namespace b = math::host::bits;
  const uint32_t s = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t em = c & 0x7fu;
  const uint32_t normal = s | ((em + (120u << 3)) << 20);
  const uint32_t sub = s | b::of(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-9f);
  const uint32_t r = b::select(em < 0x08u, sub, normal);
  return b::to_float(b::select(em == 0x7fu, s | 0x7fc00000u, r));
}

TE_HD float from_e5m2(uint8_t c) {
  namespace b = math::host::bits;
  const uint32_t s = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t em = c & 0x7fu;
  const uint32_t normal = s | ((em + (112u << 2)) << 21);
  const uint32_t sub = s | b::of(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-16f);
  const uint32_t special = s | b::select(em == 0x7cu, 0x7f800000u, 0x7fc00000u);  // inf, NaN
  return b::to_float(b::select(em < 0x04u, sub, b::select(em >= 0x7cu, special, normal)));
}

TE_HD float from_e2m1(uint8_t c) {  // the low nibble; the high one is ignored
  namespace b = math::host::bits;
  const uint32_t s = static_cast<uint32_t>(c & 0x8u) << 28;
  const uint32_t em = c & 0x7u;
  const uint32_t normal = s | ((em + (126u << 1)) << 22);
  const uint32_t sub = s | b::select(em == 1u, 0x3f000000u, 0u);  // 0.5 or 0
  return b::to_float(b::select(em < 0x2u, sub, normal));
}

// bfloat16 / float16 bits -> float32, exact (NaN kept NaN). A float16 subnormal is m * 2^-24,
// computed without subnormal floats, so it also holds under denormals-are-zero (which XLA's CPU
// threads set).
TE_HD float from_bf16(uint16_t v) {
  return math::host::bits::to_float(static_cast<uint32_t>(v) << 16);
}

TE_HD float from_f16(uint16_t v) {
  namespace b = math::host::bits;
  const uint32_t h = v;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  const uint32_t normal = sign | ((e + 112u) << 23) | (m << 13);
  const uint32_t inf_nan = sign | 0x7f800000u | (m << 13);
  const float m_scaled = static_cast<float>(static_cast<int32_t>(m)) * 0x1p-24f;
  const uint32_t subnormal = sign | b::of(m_scaled);
  return b::to_float(b::select(e == 0, subnormal, b::select(e == 31u, inf_nan, normal)));
}

// ---- traits for templated kernels -----------------------------------------------------------

struct E4M3 {
  static constexpr float kMax = 448.0f;
  TE_HD static uint8_t encode(float v) { return to_e4m3(v); }
  TE_HD static float decode(uint8_t c) { return from_e4m3(c); }
};

struct E5M2 {
  static constexpr float kMax = 57344.0f;
  TE_HD static uint8_t encode(float v) { return to_e5m2(v); }
  TE_HD static float decode(uint8_t c) { return from_e5m2(c); }
};

struct E2M1 {
  static constexpr float kMax = 6.0f;
  TE_HD static uint8_t encode(float v) { return to_e2m1(v); }
  TE_HD static float decode(uint8_t c) { return from_e2m1(c); }
};

// ---- MXFP8 block scales ---------------------------------------------------------------------

// e = ceil(log2(|amax| / q_max)) for the exact quotient (see the top of the file), clamped to
// [-127, 127]: amax == 0 gives -127, amax == inf gives 127. NaN amax gives 128, so that
// e + 127 is the E8M0 NaN code 0xFF. q_max must be a positive normal float.
TE_HD int e8m0_exponent(float amax, float q_max) {
  namespace b = math::host::bits;
  const uint32_t a = b::of(amax) & 0x7fffffffu;
  const uint32_t q = b::of(q_max);
  // A subnormal (or zero) amax is m * 2^-149, m = its bits < 2^23: float(m) is exact and normal.
  const bool sub = a < 0x00800000u;
  const uint32_t an = b::select(sub, b::of(static_cast<float>(static_cast<int32_t>(a))), a);
  const int ea = static_cast<int>(an >> 23) - detail::select_int(sub, 149, 0);
  const int eq = static_cast<int>(q >> 23);
  int e = ea - eq + static_cast<int>((an & 0x7fffffu) > (q & 0x7fffffu));
  e = detail::select_int(e < -127, -127, detail::select_int(e > 127, 127, e));
  return detail::select_int(a >= 0x7f800000u, detail::select_int(a > 0x7f800000u, 128, 127), e);
}

// The E8M0 code of the scale 2^e: e + 127 (0xFF for a NaN amax).
TE_HD uint8_t e8m0_biased(float amax, float q_max) {
  return static_cast<uint8_t>(e8m0_exponent(amax, q_max) + 127);
}

// y * 2^k, for k in [-252, 252] (every E8M0 exponent and its negation, with room). Two multiplies
// by normal powers of two 2^floor(n/2), 2^ceil(n/2): the result is the correctly rounded y * 2^k
// whenever that is normal, +-inf or 0, also under FTZ/DAZ. A subnormal y (which DAZ would read
// as 0) goes in as the exact float(m) and 2^(k - 149) instead. Results below 2^-126 may be
// flushed (FTZ) or off by a subnormal ulp (double rounding); every format here rounds them to 0.
// NaN and inf propagate.
TE_HD float mul_pow2(float y, int k) {
  namespace b = math::host::bits;
  const uint32_t u = b::of(y);
  const bool sub = (u & 0x7f800000u) == 0u;  // zero or subnormal
  const uint32_t m = b::of(static_cast<float>(static_cast<int32_t>(u & 0x7fffffu)));
  const float base = b::select(sub, b::to_float(m | (u & 0x80000000u)), y);
  int n = k - detail::select_int(sub, 149, 0);
  n = detail::select_int(n < -252, -252, n);  // only reached by a subnormal y: the result is 0
  const int n1 = n >> 1;                      // floor(n / 2) (arithmetic shift)
  return base * detail::pow2(n1) * detail::pow2(n - n1);
}

// p, or the positive quiet NaN 0x7fc00000 where p is a NaN. A product's NaN is the GPU's
// canonical positive NaN and the XLA path's (ieee.mul), while x86 returns an operand's NaN with
// its sign, and for NaN * NaN the operand the compiler happened to put first: a scaled encode
// gives the positive NaN code on every backend only with this.
TE_HD float canonical_nan(float p) {
  namespace b = math::host::bits;
  return b::select(p != p, b::to_float(0x7fc00000u), p);
}

// y * s, correctly rounded wherever the exact product is at least 2^-126, also when y is
// subnormal and the CPU treats subnormal inputs as zero (DAZ, which XLA's CPU threads set): a
// subnormal y = m * 2^-149 is multiplied as float(m) (exact) times s * 2^-24 (exact unless s is
// below 2^-102), then scaled by 2^-125; the pre-scaling keeps m * s from overflowing for any
// finite s. Products below 2^-126 become 0 in every format here, so their rounding is moot.
// A NaN product is the positive quiet NaN (canonical_nan).
TE_HD float mul_exact(float y, float s) {
  namespace b = math::host::bits;
  const uint32_t u = b::of(y);
  const bool sub = (u & 0x7f800000u) == 0u;  // zero or subnormal
  const float m = b::to_float(b::of(static_cast<float>(static_cast<int32_t>(u & 0x7fffffu))) |
                              (u & 0x80000000u));
  const float tiny = mul_pow2(m * mul_pow2(s, -24), -125);
  return canonical_nan(b::select(sub, tiny, y * s));
}

// x / C for x >= 0 (NaN and inf pass through the native division), correctly rounded also when
// the quotient is subnormal and the CPU flushes it (FTZ/DAZ): a quotient below 2^-126 means
// x < C * 2^-126 <= 2^-119, so x = A * 2^-149 with an integer A < 2^30, and the quotient is
// rne(A / C) units of 2^-149, whose count is its float32 bit pattern.
template <int C>
TE_HD float div_exact(float x) {
  static_assert(C >= 1 && C <= 127, "a small positive divisor");
  namespace b = math::host::bits;
  const uint32_t u = b::of(x);
  const uint32_t e = u >> 23;  // x >= 0: the biased exponent
  const uint32_t shift = e == 0 ? 0u : (e - 1u) & 31u;
  const uint32_t a = e == 0 ? u : ((u & 0x7fffffu) | 0x800000u) << shift;
  const uint32_t q = a / static_cast<uint32_t>(C), r = a - q * static_cast<uint32_t>(C);
  const uint32_t up = (2u * r > static_cast<uint32_t>(C)) |
                      ((2u * r == static_cast<uint32_t>(C)) & (q & 1u));
  const bool tiny = x < static_cast<float>(C) * 0x1p-126f || e == 0;
  return b::select(tiny, b::to_float(q + up), x / static_cast<float>(C));
}

// ---- tensor scales (docs/numerics.md §4) -----------------------------------------------------

namespace detail {

// clz of a nonzero 32-bit value.
TE_HD int clz32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(v);
#else
  return __builtin_clz(v);
#endif
}

// |x| = m * 2^(e - 23) with m in [2^23, 2^24) (subnormals normalised), for finite nonzero x.
TE_HD void significand(uint32_t u, uint32_t& m, int& e) {
  const uint32_t biased = (u >> 23) & 0xffu, frac = u & 0x7fffffu;
  if (biased == 0) {
    const int shift = clz32(frac) - 8;
    m = frac << shift;
    e = -126 - shift;
  } else {
    m = frac | 0x800000u;
    e = static_cast<int>(biased) - 127;
  }
}

}  // namespace detail

// RN(a / b) for a in [0, 2^100] (or NaN) and b a positive E4M3 value, given r = RN(1 / b) (a
// larger a can overflow q0 and give NaN; NVFP4's |y * S| is at most 2688 * (1 + 2^-23)): NVFP4's
// division by the block scale in three operations. q0 = RN(a * r) is within an ulp of a / b, so
// e = a - b * q0 is a float and the FMA gives it exactly, and RN(q0 + e * r) is RN(a / b)
// (Markstein's correction step; it needs r within half an ulp of 1 / b). encode_test checks the
// identity for every float32 significand of a over every E4M3 significand of b, and a's
// exponents over the whole range: exact wherever a >= 2^-100. For smaller a the residual e can
// fall below the subnormal grid and the result be an ulp off, but both it and a / b are then
// below 2^-91, whose E2M1 code is 0. A division costs several times more: reciprocal,
// refinement, range check and a branch per value.
TE_HD float div_by_e4m3(float a, float b, float r) {
#if defined(__CUDA_ARCH__)
  const float q0 = __fmul_rn(a, r);
  return __fmaf_rn(__fmaf_rn(-q0, b, a), r, q0);
#else
  const float q0 = a * r;
  return std::fma(std::fma(-q0, b, a), r, q0);
#endif
}

// ---- NVFP4 by comparisons (the CUDA kernels' 16-bit inputs) ------------------------------------
// For a finite block scale bs > 0, the E2M1 magnitude code of RN(p / bs), p >= 0 a float (inf
// included), is the number of the seven thresholds P_0 < ... < P_6 that p reaches, no division.
// Between adjacent E2M1 magnitudes lie the midpoints m_j = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; a
// tie rounds to the even code, which is the upper neighbour at j odd (1.0, 2.0, 4.0) and the lower
// one at j even. So code > j iff RN(p / bs) >= m_j (j odd), iff RN(p / bs) > m_j (j even), i.e.
// p / bs >= m_j - u/2 (u the float spacing below m_j), resp. p / bs > m_j + ulp(m_j)/2. bs * m_j
// is exact (4 + 3 significant bits, at least 2^-11) and bs * (m_j -+ half a spacing) lies strictly
// between bs * m_j and its float neighbour, so for a float p: p >= bs * m_j (j odd), resp.
// p >= nextup(bs * m_j) (j even). Saturation is built in (p past P_6 is code 7, as RN(p / bs) > 5
// is). encode_test checks it against e2m1(p / bs) for every block scale around every threshold.
TE_HD float nvfp4_threshold(float bs, int j) {
  namespace b = math::host::bits;
  const float m =
      j < 4 ? 0.25f + 0.5f * static_cast<float>(j) : (j == 4 ? 2.5f : (j == 5 ? 3.5f : 5.0f));
  const float t = bs * m;
  return (j & 1) ? t : b::to_float(b::of(t) + 1u);
}

// The largest 16-bit value (kBf16: bfloat16, else float16) <= z, as bits, for z >= 0 (NaN: inf).
template <bool kBf16>
TE_HD uint32_t half_bits_rd(float z) {
  namespace b = math::host::bits;
  const uint32_t u = b::of(z);
  if constexpr (kBf16) {
    return u >= 0x7f800000u ? 0x7f80u : u >> 16;
  } else {
    if (u >= 0x7f800000u) return 0x7c00u;
    if (u >= 0x47800000u) return 0x7bffu;                           // >= 65536: the max, 65504
    if (u >= 0x38800000u) return (u - (112u << 23)) >> 13;          // normal: truncate
    return static_cast<uint32_t>(b::to_float(u) * 0x1p24f);         // subnormal: whole quanta
  }
}

// The threshold P in the 16-bit input's own terms: the bits of the smallest 16-bit magnitude Y
// with RN(Y * s) >= P, for a finite scale s > 0 and inv_s = RN(1 / s). y -> RN(y * s) is
// monotone, so for an input y (a 16-bit value, exact in float32) RN(|y| * s) >= P iff |y| >= Y,
// and the codes of a block are integer comparisons of 15-bit magnitudes. z = RN(P * inv_s) is
// within two float32 ulps of the real threshold y*, far less than a 16-bit ulp (2^-8 or 2^-11
// relative). With c = z rounded down to 16 bits: c - 1 <= z - ulp < y* fails; if c fails, c + 1
// > z passes unless y* lies in the sliver between z and c + 1, and then c + 2 does. So Y is the
// first of c, c + 1 that passes, else c + 2.
template <bool kBf16>
TE_HD uint32_t nvfp4_input_threshold(float P, float s, float inv_s) {
  constexpr uint32_t kInf = kBf16 ? 0x7f80u : 0x7c00u;
  const auto value = [](uint32_t h) {
    return kBf16 ? from_bf16(static_cast<uint16_t>(h)) : from_f16(static_cast<uint16_t>(h));
  };
#if defined(__CUDA_ARCH__)
  const auto pass = [&](uint32_t h) { return __fmul_rn(value(h), s) >= P; };
  const uint32_t c = half_bits_rd<kBf16>(__fmul_rn(P, inv_s));
#else
  const auto pass = [&](uint32_t h) { return mul_exact(value(h), s) >= P; };
  const uint32_t c = half_bits_rd<kBf16>(mul_exact(P, inv_s));
#endif
  const uint32_t c1 = c + 1u < kInf ? c + 1u : kInf;
  const uint32_t c2 = c + 2u < kInf ? c + 2u : kInf;
  return pass(c) ? c : (pass(c1) ? c1 : c2);
}

// a / b in float32, correctly rounded (ties to even) for every result, subnormal included, with
// IEEE special cases. On the host in integer arithmetic only, so the CPU's FTZ/DAZ mode cannot
// change it: the significands' quotient (ma << 40) / mb has 40 or 41 bits; its remainder is the
// sticky bit. On the device __fdiv_rn is the same IEEE division (the kernels are built without
// -ftz, so subnormals are kept), and much cheaper than a 64-bit integer division inside a kernel.
TE_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  namespace bb = math::host::bits;
  const uint32_t ua = bb::of(a), ub = bb::of(b);
  const uint32_t sign = (ua ^ ub) & 0x80000000u;
  const uint32_t aa = ua & 0x7fffffffu, ab = ub & 0x7fffffffu;
  const bool a_nan = aa > 0x7f800000u, b_nan = ab > 0x7f800000u;
  const bool a_inf = aa == 0x7f800000u, b_inf = ab == 0x7f800000u;
  const bool a_zero = aa == 0u, b_zero = ab == 0u;
  if (a_nan || b_nan || (a_zero && b_zero) || (a_inf && b_inf)) return bb::to_float(0x7fc00000u);
  if (a_inf || b_zero) return bb::to_float(sign | 0x7f800000u);
  if (a_zero || b_inf) return bb::to_float(sign);
  uint32_t ma, mb;
  int ea, eb;
  detail::significand(ua, ma, ea);
  detail::significand(ub, mb, eb);
  const uint64_t num = static_cast<uint64_t>(ma) << 40;
  const uint64_t q = num / mb;
  const bool rem = num % mb != 0u;
  const int p = q >> 40 ? 40 : 39;  // the leading bit of q
  const int e = ea - eb + p - 40;   // |a / b| = (q / 2^p) * 2^e, q / 2^p in [1, 2)
  if (e > 127) return bb::to_float(sign | 0x7f800000u);
  // Keep 24 bits (a normal result) or fewer (a subnormal one: the unit is 2^-149).
  const int drop = p - 23 + (e < -126 ? -126 - e : 0);
  if (drop > 62) return bb::to_float(sign);  // below half the smallest subnormal
  const uint64_t kept = q >> drop, rest = q & ((uint64_t{1} << drop) - 1u);
  const uint64_t half = uint64_t{1} << (drop - 1);
  const bool up = rest > half || (rest == half && (rem || (kept & 1u)));
  const uint64_t mant = kept + (up ? 1u : 0u);
  // Normal: (biased exponent - 1) << 23 plus the significand with its hidden bit, so a carry
  // out of the significand bumps the exponent (to inf past the largest finite value).
  // Subnormal: the count of 2^-149 units is the bit pattern (a carry gives the smallest normal).
  const uint64_t bits = e < -126 ? mant : (static_cast<uint64_t>(e + 126) << 23) + mant;
  return bb::to_float(sign | static_cast<uint32_t>(bits));
#endif
}

// NVFP4's global scale maps the tensor amax onto E2M1 max * E4M3 max.
inline constexpr float kNvfp4GlobalQ = 6.0f * 448.0f;

// The two-pass modes' tensor scale from the (global) amax: numerator / amax (CURRENT: the
// format's max Q; NVFP4: 6 * 448), 1 when amax is 0, float32 max when the quotient overflows,
// NaN for a NaN amax. Bit for bit te_jax.quantize.reference._scale_from.
TE_HD float scale_from_amax(float amax, float numerator) {
  namespace bb = math::host::bits;
  if ((bb::of(amax) & 0x7fffffffu) == 0u) return 1.0f;
  const float s = div_rn(numerator, amax);
  return (bb::of(s) & 0x7fffffffu) == 0x7f800000u ? 0x1.fffffep127f : s;
}

// ---- blockwise FP8 scales (docs/numerics.md §4) ----------------------------------------------

// A block's scale and its inverse.
struct BlockScale {
  float scale;      // what the block's values are multiplied by before encoding
  float scale_inv;  // RN(1 / scale): the stored scale
};

// Blockwise FP8's scale from the bits of the block's max|y| (`amax_bits`: |y|'s bits, a NaN above
// inf), the format's max q and the recipe's options: a = max(amax, eps) compared as bits (an amax
// is +0, positive or +NaN, which order as their bits; a float max would read a subnormal amax as 0
// under DAZ); scale = RN(q / a), float32 max where that overflows; with power_2_scale its mantissa
// bits cleared (2^floor(log2 scale)); scale = 1 where a is 0, inf or NaN. scale_inv = RN(1 /
// scale), a power of two exactly when the scale is one (2^-127 subnormal included). Bit for bit
// te_jax.quantize.scale_math.fp8_block_scale and the blockwise scale_inv.
TE_HD BlockScale fp8_block_scale(uint32_t amax_bits, float q, uint32_t eps_bits, bool pow2) {
  namespace bb = math::host::bits;
  const uint32_t a = amax_bits < eps_bits ? eps_bits : amax_bits;
  if (a == 0u || a >= 0x7f800000u) return {1.0f, 1.0f};
  float s = div_rn(q, bb::to_float(a));
  if (bb::of(s) == 0x7f800000u) s = 0x1.fffffep127f;
  if (pow2) s = bb::to_float(bb::of(s) & 0xff800000u);
  return {s, div_rn(1.0f, s)};
}

}  // namespace te_jax::fmt
