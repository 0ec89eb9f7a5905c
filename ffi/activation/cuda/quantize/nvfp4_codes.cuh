// NVFP4 codes: the E4M3 block scale of a block, the E2M1 codes by IEEE division (float32 inputs),
// and for 16-bit inputs the codes by comparison with the block's thresholds (Fp4Table).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "activation/cuda/quantize/codes.cuh"
#include "common/formats.h"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda::quant {

// NVFP4 block scale (E4M3 code) of a block with max |y| = amax under global scale s, and the
// E2M1 code of RN(RN(y * s) / bs) in a block whose scale decodes to bs (0 where bs is 0), given
// rb = RN(1 / bs) (once per block): IEEE operations, in the CPU's order. The quotient of the
// magnitude is fmt::div_by_e4m3 (three operations; __fdiv_rn per value cost a reciprocal, its
// refinement and a range-check branch), the sign of y * s goes back on its code (-0 / bs is -0:
// code 0x8; a NaN's code is 0x8 either way).
__device__ __forceinline__ uint8_t nvfp4_scale(unsigned key, float s) {
  // RN(amax / 6) is fmt::div_by_e4m3 (6 is an E4M3 value) wherever that is exact, amax = 0 or
  // in [2^-100, inf); a smaller amax (its quotient may be subnormal), inf and NaN take the IEEE
  // division, which costs a range check and a slow-path call besides.
  const float amax = __uint_as_float(key);
  const bool fast = key - 0x0d800000u < 0x7f800000u - 0x0d800000u || key == 0u;
  const float q = fast ? fmt::div_by_e4m3(amax, 6.0f, 0x1.555556p-3f) : __fdiv_rn(amax, 6.0f);
  return fmt::to_e4m3(__fmul_rn(q, s));
}
__device__ __forceinline__ uint32_t nvfp4_code(float y, float s, float bs, float rb) {
  const float p = __fmul_rn(y, s);
  const uint32_t c = fmt::e2m1_magnitude(fmt::div_by_e4m3(fabsf(p), bs, rb)) |
                     ((__float_as_uint(p) >> 28) & 0x8u);
  return bs == 0.0f ? 0u : c;
}
// 8 values -> 4 bytes (two codes per byte, first in the low nibble), little-endian.
template <typename V>
__device__ __forceinline__ uint32_t nvfp4_codes(const V& v, float s, const float (&bs)[8],
                                                const float (&rb)[8]) {
  uint32_t w = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) w |= nvfp4_code(v[k], s, bs[k], rb[k]) << (4 * k);
  return w;
}

// ---- NVFP4 of 16-bit values: codes by comparison -------------------------------------------
// For bfloat16 / float16 inputs the E2M1 code of RN(RN(y * s) / bs) needs no arithmetic per value:
// it is the count of the block's seven thresholds that |y| reaches (fmt::nvfp4_threshold,
// fmt::nvfp4_input_threshold), an integer comparison of 15-bit magnitudes, two values per
// 32-bit operation. Per tensor scale, each block builds the thresholds of every E4M3 block-scale
// code into shared memory (Fp4Table); a value pair then costs 7 subtractions, 4 logic operations
// and 5 to place the bits, where the division and the E2M1 rounding cost about 20 per value.
template <typename T>
inline constexpr bool kFp4ByCompare = !std::is_same_v<T, float>;

// [code][j], j < 7: threshold j of E4M3 block-scale code `code`, doubled into both halves
// (Y | Y << 16). j = 7, 8: the code's special case as masks, codes -> (codes & [7]) | [8]: a block
// whose scale is 0 has all +0 codes, one whose scale is NaN all 0x8 (as fmt::e2m1_magnitude of a
// NaN quotient gives), the others keep theirs (one logic operation per row of codes, where
// selecting them cost four). Rows of 12 words keep the 16-byte loads aligned.
constexpr int kFp4TableWords = 12;
using Fp4Table = uint32_t[128][kFp4TableWords];

template <typename T>
__device__ __forceinline__ void build_fp4_table(Fp4Table& tab, float s) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  const float inv_s = __frcp_rn(s);
  for (int e = threadIdx.x; e < 128 * 7; e += kThreads) {
    const int c = e / 7, j = e - 7 * c;
    const float bs = fmt::from_e4m3(static_cast<uint8_t>(c));
    const uint32_t y = fmt::nvfp4_input_threshold<kBf16>(fmt::nvfp4_threshold(bs, j), s, inv_s);
    tab[c][j] = y | (y << 16);
  }
  for (int c = threadIdx.x; c < 128; c += kThreads) {
    tab[c][7] = c == 0 || c == 0x7f ? 0u : ~0u;
    tab[c][8] = c == 0x7f ? 0x88888888u : 0u;
  }
}

// The two E2M1 codes (first in the low nibble) of the packed 16-bit pair w, in byte 3 of the
// result, given each half's thresholds y[j] (low half's in the low 16 bits). (w | 0x8000) - Y
// never borrows across halves (Y <= 0x7f80), and its bit 15 is |w| >= Y; so bit 15 / 31 of
// d_j is comparison j. The seven comparisons are a thermometer code of the magnitude: bit 0 is
// their parity, bit 1 is (c1 & !c3) | c5, bit 2 is c3. prmt with sign-replicating selectors
// spreads these bits (and the signs, bits 15 / 31 of w) into byte masks; each code bit is kept
// at its place in the output byte, in a different byte of z, and the multiply by 0x01010101 sums
// z's four bytes into byte 3 (their bits are disjoint: no carries).
__device__ __forceinline__ uint32_t fp4_pair(uint32_t w, const uint32_t (&y)[7]) {
  const uint32_t a = w | 0x80008000u;
  uint32_t d[7];
#pragma unroll
  for (int j = 0; j < 7; ++j) d[j] = a - y[j];
  const uint32_t b0 = d[0] ^ d[1] ^ d[2] ^ d[3] ^ d[4] ^ d[5] ^ d[6];
  const uint32_t b1 = (d[1] & ~d[3]) | d[5];
  const uint32_t ma = prmt(b0, b1, 0xfdb9u);  // [b0 lo, b0 hi, b1 lo, b1 hi] as byte masks
  const uint32_t mb = prmt(d[3], w, 0xfdb9u);  // [b2 lo, b2 hi, sign lo, sign hi]
  const uint32_t z = (ma & 0x20021001u) | (mb & 0x80084004u);
  return z * 0x01010101u;
}

// Pair p's codes (byte 3 of q, from fp4_pair) placed at byte p of part, keeping bytes 0..p-1:
// four calls, p = 0..3, assemble the 8 codes of a lane's row (part is ignored at p = 0).
__device__ __forceinline__ uint32_t fp4_place(uint32_t part, uint32_t q, int p) {
  constexpr uint32_t kSelector[4] = {0x0007u, 0x0070u, 0x0710u, 0x7210u};
  return prmt(part, q, kSelector[p]);
}

// The colwise thresholds' shared-memory word of (column lane tx, column pair p): the lanes' words
// of one pair are adjacent, so a warp's 4-byte loads hit 32 different banks.
template <int kColLanes>
__device__ __forceinline__ int fp4_pair_slot(int tx, int p) {
  return p * kColLanes + tx;
}

}  // namespace te_jax::cuda::quant
