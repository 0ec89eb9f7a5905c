// float32 -> FP8 / FP4 codes for the CPU loops: bit for bit fmt::to_e4m3 / to_e5m2 / to_e2m1
// (common/formats.h) for every float32 input, under any denormal mode
// (ffi/cpu/tests/encode_test.cc checks every rounding tie and its neighbours, or with --full all
// 2^32 inputs, with and without FTZ/DAZ), but shaped for GCC's vectoriser.
//
// Why not call fmt::to_* in the loops: their result is a uint8_t, and GCC narrows their
// mask-arithmetic selects to 8 and 16 bits ("over-widening"), repacking every compare mask to
// bytes with permutes. Here the selects are ?: of uint32_t values (a compare and a blend or a
// masked op in a vector loop), which stay on 32-bit lanes; the value is cut to a byte when
// stored, so the loops vectorise without repacking (NOTES.md has the timings).
//
// The math is formats.h's (restated here): for |v| = a (bits) at or above the smallest normal
// 2^emin, n = (a - rebias + half - 1 + lsb) >> drop rounds the dropped mantissa bits to nearest
// even (a carry bumps the exponent), clamped to the max code; below 2^emin, bits(|v| + C) - bits(C)
// counts the quanta 2^(emin - mbits) (the FPU rounds |v| + C to a multiple of that quantum, ties to
// even; C is normal and so is the sum, so FTZ cannot touch it, and a float32 subnormal |v|, which
// DAZ reads as 0, gives code 0 either way). NaN: E4M3 0x7f | sign, E5M2 0x7e | sign, E2M1 0x8.
//
// Scaled encodes: code(v * s) with one float multiply replaces formats.h's exact products where it
// gives the same codes (plain_tensor_scale, mxfp8_plain_exponent below); the loops fall back to
// fmt::mul_exact / fmt::mul_pow2 otherwise.
#pragma once

#include <cstdint>

#include "activation/cpu/loops.h"
#include "common/formats.h"
#include "common/host_math.h"

namespace te_jax::cpu {
namespace {
namespace enc {

namespace hb = ::te_jax::math::host::bits;

// ---- one value: the code in the low bits of a uint32_t ---------------------------------------

// E4M3: emin -6, bias 7, 3 mantissa bits (drop 20), C = 2^14, max code 0x7e (448).
TE_HOST_INLINE uint32_t e4m3(float v) {
  const uint32_t u = hb::of(v);
  const uint32_t a = u & 0x7fffffffu;
  uint32_t n = (a + ((a >> 20) & 1u) + (0x7ffffu - (120u << 23))) >> 20;
  n = n < 0x7eu ? n : 0x7eu;  // > 448, inf and NaN saturate (NaN is fixed below)
  const uint32_t sub = hb::of(hb::to_float(a) + 0x1p14f) - 0x46800000u;
  uint32_t r = a < 0x3c800000u ? sub : n;
  r += a > 0x7f800000u ? 1u : 0u;  // NaN: 0x7e + 1 = 0x7f
  return r | ((u >> 24) & 0x80u);
}

// E5M2: emin -14, bias 15, 2 mantissa bits (drop 21), C = 2^7, max code 0x7b (57344).
TE_HOST_INLINE uint32_t e5m2(float v) {
  const uint32_t u = hb::of(v);
  const uint32_t a = u & 0x7fffffffu;
  uint32_t n = (a + ((a >> 21) & 1u) + (0xfffffu - (112u << 23))) >> 21;
  n = n < 0x7bu ? n : 0x7bu;  // > 57344, inf and NaN saturate (NaN is fixed below)
  const uint32_t sub = hb::of(hb::to_float(a) + 0x1p7f) - 0x43000000u;
  uint32_t r = a < 0x38800000u ? sub : n;
  r = a > 0x7f800000u ? 0x7eu : r;
  return r | ((u >> 24) & 0x80u);
}

// E2M1 (the low nibble, bit 3 the sign): emin 0, bias 1, 1 mantissa bit (drop 22), C = 2^22,
// max code 0x7 (6). NaN gives 0x8 whatever its sign.
TE_HOST_INLINE uint32_t e2m1(float v) {
  const uint32_t u = hb::of(v);
  const uint32_t a = u & 0x7fffffffu;
  uint32_t n = (a + ((a >> 22) & 1u) + (0x1fffffu - (126u << 23))) >> 22;
  n = n < 0x7u ? n : 0x7u;
  const uint32_t sub = hb::of(hb::to_float(a) + 0x1p22f) - 0x4a800000u;
  const uint32_t r = (a < 0x3f800000u ? sub : n) | ((u >> 28) & 0x8u);
  return a > 0x7f800000u ? 0x8u : r;
}

// Codes<Fmt>::of(v): the encoder of a formats.h trait.
template <typename Fmt>
struct Codes;
template <>
struct Codes<fmt::E4M3> {
  TE_HOST_INLINE static uint32_t of(float v) { return e4m3(v); }
};
template <>
struct Codes<fmt::E5M2> {
  TE_HOST_INLINE static uint32_t of(float v) { return e5m2(v); }
};
template <>
struct Codes<fmt::E2M1> {
  TE_HOST_INLINE static uint32_t of(float v) { return e2m1(v); }
};

// ---- when one multiply is exact enough ------------------------------------------------------

// Tensor scales: code(v * s) == code(fmt::mul_exact(v, s)) for every v when |s| <= 2^100 (NaN
// fails the test). mul_exact returns the same v * s for every v that is not zero or subnormal.
// For those (|v| < 2^-126) both products are below 2^-126 * 2^100 = 2^-26 in magnitude, under half
// the smallest subnormal code of every format (2^-17 for E5M2), so both give the zero code with
// the sign of v * s: mul_exact's exact path keeps that sign, and so does the FPU's product
// (a flushed or DAZ-read operand is a signed zero). NaN and inf v: the same FPU product.
TE_HOST_INLINE bool plain_tensor_scale(float s) {
  return (hb::of(s) & 0x7fffffffu) <= 0x71800000u;  // 2^100
}

// MXFP8: code(v * 2^-e) == code(fmt::mul_pow2(v, -e)) for every v when e is in [-100, 126]: then
// 2^-e is a normal float, so the product is correctly rounded (exact, or +-inf) wherever it is at
// least 2^-126, like mul_pow2's; below that (v subnormal, |v| * 2^100 < 2^-26, or a normal v
// scaled under 2^-126) both results are under half the smallest subnormal code and encode to the
// zero code with v's sign. e = 127 (amax = inf) and 128 (NaN) take the exact path, as does
// e < -100 (amax < Q * 2^-100, Q the format's max: subnormal v may then scale to nonzero codes).
TE_HOST_INLINE bool mxfp8_plain_exponent(int e) { return e >= -100 && e <= 126; }

// 2^-e as a float, for e in [-127, 126].
TE_HOST_INLINE float pow2_neg(int e) { return hb::to_float(static_cast<uint32_t>(127 - e) << 23); }

// v * s with the codes of fmt::mul_exact(v, s): the plain product when kPlain
// (plain_tensor_scale(s)), else mul_exact. A template parameter, not a runtime select: a vector
// loop would compute both arms.
template <bool kPlain>
TE_HOST_INLINE float scaled(float v, float s) {
  if constexpr (kPlain) {
    return fmt::canonical_nan(v * s);
  } else {
    return fmt::mul_exact(v, s);
  }
}

// NVFP4 block scale: the E4M3 code of (amax / 6) * s for amax >= 0 (or NaN), each step correctly
// rounded whatever the CPU's denormal mode (fmt::div_exact, fmt::mul_exact). With kPlain
// (plain_tensor_scale(s)) the native quotient and product give the same code: they differ from
// the exact ones only where the quotient is under 2^-126, and then both products are under
// 2^-126 * 2^100 = 2^-26, both encoding to 0.
template <bool kPlain>
TE_HOST_INLINE uint32_t nvfp4_block_scale(float amax, float s) {
  if constexpr (kPlain) {
    return e4m3(fmt::canonical_nan(amax / 6.0f * s));
  } else {
    return e4m3(fmt::mul_exact(fmt::div_exact<6>(amax), s));
  }
}

// ---- loops ----------------------------------------------------------------------------------

// out[i] = the code of fmt::mul_exact(v[i], s) (Fmt::encode's bits), for n values.
template <typename Fmt>
TE_JAX_LOOP void encode_scaled(const float* __restrict v, uint8_t* __restrict out, int64_t n,
                               float s) {
  if (plain_tensor_scale(s)) {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = static_cast<uint8_t>(Codes<Fmt>::of(scaled<true>(v[i], s)));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = static_cast<uint8_t>(Codes<Fmt>::of(scaled<false>(v[i], s)));
    }
  }
}

}  // namespace enc
}  // namespace
}  // namespace te_jax::cpu
