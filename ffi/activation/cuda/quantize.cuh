// The generic (quantizing or amax-only) path of te_jax_act_lu / te_jax_quantize /
// te_jax_dact_dbias_quantize and the amax passes on CUDA: one tiled kernel template, instantiated
// per (activation, input dtype, mode, forward/backward) by the quant_*.cu files. Formulas and
// buffer layouts: common/problem.h, SPEC.md §4-§5; the reference semantics are
// ffi/cpu/quantized.cc, whose bits every output here matches (dbias excepted: it sums in its own
// fixed order).
// Outputs with no transposed, blocked or summed part (rowwise tensor-scaled codes, the amax passes,
// both without dbias) take elementwise.cuh's flat kernel instead: launch_quantized_eltwise.
//
// Output y is [M, N] (N = O * H: O = 2 halves for a gated dact, else 1), split into `batches`
// tensors of mb = M / batches consecutive rows. The kernel walks tiles of 32 rows x kCols columns
// of H; a tile never straddles a batch (row tiles restart at each batch, the last one may be
// short), and its O halves are emitted separately at column offsets l * H.
//
// Threads: 256 = kTx column lanes x kRL row lanes. A column lane owns 8 consecutive columns (one
// 16-byte load of a 16-bit dtype, two of float32); a row lane owns R consecutive rows of the tile
// (R = 4, 2 or 1, so that each thread issues >= 64 bytes of loads before it computes). So a tile
// is kCols = 64 R columns wide, kRL = 32 / R row lanes tall. Every load of a tile is issued before
// the first value is computed (the MXFP8 forward copies the next whole tile's inputs into shared
// memory with cp.async while it computes this one). Per value: the activation (or its gradient)
// in float32, rounded to x's dtype (what NO_SCALING outputs; 16-bit values stay packed two per
// register, and max keys are taken on the packed pairs), then:
//   amax    integer max of |y|'s bits (NaN above inf), block-reduced, atomicMax per batch;
//   TENSOR  codes = fmt(y * scale[b]) (8 bytes per lane and row, one store); the colwise
//           (transposed) layout goes through shared memory: the codes are stored row-major, and
//           after a barrier each thread gathers 8R bytes of colwise[b][col][row] (R = 4: 8 rows
//           of 4 columns, transposed in registers, so that 4 lanes write each column's 32 rows
//           in one store instruction; else 8R rows of one column) and stores them;
//   MXFP8   rowwise: the 32-element block is 4 adjacent lanes (two xor shuffles of the max key);
//           colwise: each lane's per-column max over its rows goes to shared memory, one thread
//           per column block reduces them and computes the block's scale and scaling factors
//           once, and every lane encodes its rows with its columns' factors; colwise codes keep
//           the rowwise layout (one store per lane and row);
//   NVFP4   the same with 16-element blocks (2 lanes rowwise, 16 rows colwise), E4M3 block scales,
//           E2M1 codes packed two per byte (4 bytes per lane and row); for 16-bit inputs the codes
//           are counts of thresholds reached, compared two values at a time (kFp4ByCompare),
//           from a table the block builds per tensor scale;
//   dbias   (backward) unrounded float32 sums in registers: each thread adds its rows in row order,
//           tile after tile of its (batch, group); at the end of the group the row lanes' sums
//           are added in lane order through shared memory and written to workspace[b, g, :]; the
//           finalize kernel of dact_dbias.cu adds the groups in a fixed order. No float atomics.
// Work items are (column tile, group, batch) = the grid's (x, y, z), one block each (grid-stride
// where LaunchConfig::max_blocks caps it, or y / z exceed 65535); without dbias a group is one row
// tile, except in the block-scaled modes, where it is up to 8 consecutive ones (launch_quantized).
// A group's tiles step their addresses from one to the next. No 64-bit division per tile: with a
// flat item index, the six divisions that split it cost as much as the tile's own work (the
// range of a group of several tiles takes two divisions, once per group).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "activation/activations.h"
#include "common/formats.h"
#include "activation/problem.h"
#include "cuda/device_utils.cuh"
#include "activation/cuda/elementwise.cuh"
#include "cuda/fp8_codes.cuh"
#include "activation/cuda/launch.h"

namespace te_jax::cuda {

namespace quant {

enum class Mode { kTensor, kMx, kNvfp4, kAmax };

constexpr int kTileRows = 32;

// Geometry of one instantiation.
template <typename Spec, typename T, bool kBwd>
struct Geo {
  static constexpr int L = Spec::kActLen;          // halves of x
  static constexpr int O = kBwd ? L : 1;           // halves of y
  static constexpr int kLoads = L + (kBwd ? 1 : 0);  // 8-element loads per row and lane
  static constexpr int kBytes = 8 * static_cast<int>(sizeof(T)) * kLoads;
  static constexpr int R = kBytes >= 64 ? 1 : (kBytes >= 32 ? 2 : 4);  // rows per thread
  static constexpr int kCols = 64 * R;
  static constexpr int kTx = 8 * R;
  static constexpr int kRL = kThreads / kTx;  // = 32 / R
  static_assert(kRL * R == kTileRows, "row lanes x rows per lane = tile rows");
};

// Blocks per SM the registers are capped for (the tightest cap that did not spill, GELU_EXACT
// aside): 4 (<= 64 registers) for the tensor-scaled and amax kernels, 3 (<= 80) for the
// block-scaled ones, 2 (<= 128) for the gated backward. The NVFP4 forward of 16-bit inputs
// (codes by comparison) takes 4 too: 4-5% faster on the H100 than 3 (quant_test --bench,
// quantize NVFP4 row 0.611 -> 0.585 ms, row + col 1.068 -> 1.026 ms), though most of its bf16
// instantiations then spill 8 bytes.
template <typename Spec, typename T, Mode M, bool kBwd>
constexpr int kMinBlocks = (kBwd && Spec::kGated)                       ? 2
                           : (M == Mode::kTensor || M == Mode::kAmax) ? 4
                           : (M == Mode::kNvfp4 && !std::is_same_v<T, float> && !kBwd) ? 4
                                                                      : 3;

// The kernel's runtime arguments.
struct QArgs {
  const void* x;   // [M, L, H]
  const void* dz;  // [M, H] (backward)
  uint64_t H, n, mb, batches;
  // Per batch: row tiles, and groups (the workspace's; = row tiles without dbias).
  uint32_t row_tiles, col_tiles, groups;
  ActParams params;
  uint8_t* data;         // rowwise codes, or nullptr
  uint8_t* colwise;      // colwise codes, or nullptr
  uint8_t* bscale;       // rowwise block scales (MXFP8 / NVFP4)
  uint8_t* cbscale;      // colwise block scales
  const float* scale;    // [batches] (TENSOR, NVFP4): the scale, or the amax it derives from
  float scale_numerator; // > 0: `scale` holds the amax; the scale is fmt::scale_from_amax
  float* scale_inv;      // [batches] 1 / scale (TENSOR; NVFP4: 1 / S), or nullptr
  unsigned* amax;        // [batches] bits of max|y|, or nullptr
  float* ws;             // dbias partials [batches, groups, n], or nullptr
  float qmax;            // MXFP8: the format's max
  bool e5m2;             // FP8 format of TENSOR / MXFP8 codes
  bool vec_in;           // 16-byte loads (H % 8 == 0, inputs 16-byte aligned)
  bool vec_out;          // rowwise-layout codes stored 8 (NVFP4: 4) bytes at a time
  bool vec_t;            // transposed codes stored 8R bytes at a time
};

// The tensor scale of batch b: given (DELAYED) or derived from the amax (CURRENT, NVFP4).
__device__ __forceinline__ float tensor_scale(const QArgs& a, uint64_t b) {
  return a.scale_numerator > 0.0f ? fmt::scale_from_amax(a.scale[b], a.scale_numerator)
                                  : a.scale[b];
}

// 8 consecutive elements of T as raw 32-bit words.
template <typename T>
struct Raw8 {
  static constexpr int kWords = 2 * static_cast<int>(sizeof(T));
  uint32_t w[kWords];
};

// Loads 8 elements at p, of which the first n_ok are valid (the rest read as 0). On the vector
// path n_ok is 0 or 8 and p is 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load8(const T* p, bool vec, int n_ok, Raw8<T>& r) {
  if (vec) {
    if (n_ok > 0) {
      const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
      for (int j = 0; j < Raw8<T>::kWords / 4; ++j) {
        const uint4 u = __ldg(q + j);
        r.w[4 * j] = u.x;
        r.w[4 * j + 1] = u.y;
        r.w[4 * j + 2] = u.z;
        r.w[4 * j + 3] = u.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < Raw8<T>::kWords; ++j) r.w[j] = 0u;
    }
  } else if constexpr (sizeof(T) == 4) {
    const unsigned* s = reinterpret_cast<const unsigned*>(p);
#pragma unroll
    for (int k = 0; k < 8; ++k) r.w[k] = k < n_ok ? __ldg(s + k) : 0u;
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned lo = 2 * k < n_ok ? __ldg(s + 2 * k) : 0u;
      const unsigned hi = 2 * k + 1 < n_ok ? __ldg(s + 2 * k + 1) : 0u;
      r.w[k] = lo | (hi << 16);
    }
  }
}

template <typename T>
__device__ __forceinline__ void to_float8(const Raw8<T>& r, float (&f)[8]) {
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = __uint_as_float(r.w[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 t = std::is_same_v<T, __nv_bfloat16> ? bf16x2_to_float2(r.w[k])
                                                        : f16x2_to_float2(r.w[k]);
      f[2 * k] = t.x;
      f[2 * k + 1] = t.y;
    }
  }
}

// 8 values of y rounded to T, 0 where invalid; v[k] reads one as float32. 16-bit dtypes hold them
// packed two per register (they are exact in T), which halves the registers of a tile.
template <typename T>
struct V8 {
  // Max keys: |y| bits compared as integers. 16-bit values are compared two at a time, as the
  // packed halves of key_word = w * 2: the magnitudes doubled (the order of |y| in the 16-bit
  // formats, NaN above inf, as in float32). The high half's sign leaves the word; the low half's
  // lands in the high half's lowest bit, which can only order equal magnitudes, and which the
  // keys shift out: the larger of 2a + g and 2b + g' (g, g' < 2) is, halved, max(a, b). The
  // doubling is a multiply, on the FMA pipe, where the mask & 0x7fff7fff was a logic operation on
  // the ALU pipe, the one that bounds the NVFP4 kernels (ncu, quantize NVFP4 row + col: ALU 75%
  // busy, issue 73%; quant_test --bench 0.826 -> 0.815 ms with the doubling). to_key turns
  // such a packed max into the float32 key of the larger half; key_lo / key_hi of one half.
  static constexpr int kWords = 4;
  __device__ __forceinline__ uint32_t key_word(int j) const { return w[j] * 2u; }
  static __device__ __forceinline__ uint32_t pmax(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }
  static __device__ __forceinline__ uint32_t half_key(uint32_t h) {  // 15-bit |y| -> float32 key
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return h << 16;
    } else {
      return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
    }
  }
  static __device__ __forceinline__ uint32_t key_lo(uint32_t m) {
    return half_key((m & 0xffffu) >> 1);
  }
  static __device__ __forceinline__ uint32_t key_hi(uint32_t m) { return half_key(m >> 17); }
  static __device__ __forceinline__ uint32_t to_key(uint32_t m) {
    return half_key(max(m & 0xffffu, m >> 16) >> 1);
  }
  uint32_t w[4];
  // Rounds raw to T; elements k >= n_ok become +0 (a branch: n_ok < 8 only at the edges).
  __device__ __forceinline__ void set(const float (&raw)[8], int n_ok) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = std::is_same_v<T, __nv_bfloat16> ? float2_to_bf16x2(raw[2 * j], raw[2 * j + 1])
                                              : float2_to_f16x2(raw[2 * j], raw[2 * j + 1]);
    }
    if (n_ok < 8) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        w[j] &= (2 * j < n_ok ? 0x0000ffffu : 0u) | (2 * j + 1 < n_ok ? 0xffff0000u : 0u);
      }
    }
  }
  // The unpacking is volatile asm so that the compiler re-unpacks at each use instead of keeping
  // the float32 values live across the emit phases (which doubled the registers and spilled).
  __device__ __forceinline__ float operator[](int k) const {
    uint32_t r;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (k & 1) {
        asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(r) : "r"(w[k >> 1]));
      } else {
        asm volatile("shl.b32 %0, %1, 16;" : "=r"(r) : "r"(w[k >> 1]));
      }
      return __uint_as_float(r);
    } else {
      float f;
      if (k & 1) {
        asm volatile("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.f32.f16 %0, hi;}"
                     : "=f"(f) : "r"(w[k >> 1]));
      } else {
        asm volatile("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.f32.f16 %0, lo;}"
                     : "=f"(f) : "r"(w[k >> 1]));
      }
      return f;
    }
  }
};

template <>
struct V8<float> {
  static constexpr int kWords = 8;
  __device__ __forceinline__ uint32_t key_word(int j) const {
    return __float_as_uint(f[j]) & 0x7fffffffu;
  }
  static __device__ __forceinline__ uint32_t pmax(uint32_t a, uint32_t b) { return max(a, b); }
  static __device__ __forceinline__ uint32_t to_key(uint32_t m) { return m; }
  float f[8];
  __device__ __forceinline__ void set(const float (&raw)[8], int n_ok) {
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = raw[k];
    if (n_ok < 8) {
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = k < n_ok ? f[k] : 0.0f;
    }
  }
  __device__ __forceinline__ float operator[](int k) const { return f[k]; }
};

// The packed max of |v| over the 8 values (V8::to_key gives the float32 key).
template <typename T>
__device__ __forceinline__ uint32_t pmax8(const V8<T>& v) {
  uint32_t m = v.key_word(0);
#pragma unroll
  for (int j = 1; j < V8<T>::kWords; ++j) m = V8<T>::pmax(m, v.key_word(j));
  return m;
}

// 8 codes of fmt(q[k]), little-endian in two words. Every lane of the warp must call it.
__device__ __forceinline__ uint2 fp8_codes(bool e5m2, const float (&q)[8]) {
  const Pack<uint8_t, 8> p = fp8_pack<8>(e5m2, q, 0xffffffffu);
  return make_uint2(p.w[0], p.w[1]);
}

// 8 codes of fmt(v[k] * s).
template <typename V>
__device__ __forceinline__ uint2 tensor_codes(bool e5m2, const V& v, float s) {
  float q[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) q[k] = __fmul_rn(v[k], s);
  return fp8_codes(e5m2, q);
}

// The MXFP8 scaling of one block (exponent e = e8m0_exponent(amax, Q), k = -e in [-128, 127]):
// codes equal to the CPU's `nan ? amax : fmt::mul_pow2(y, k)` (a block whose amax is NaN has NaN
// codes), bit for bit, with one multiply per element and one factor per block, p = 2^k (exact:
// 2^-127, only reached by an infinite amax, is subnormal, and the kernels keep subnormals), or
// the NaN amax itself. y * p is the correctly rounded y * 2^k for every y, subnormal included
// (one IEEE rounding; no FTZ on the device). mul_pow2 is that too wherever the result is at least
// 2^-126, or +-inf or +-0; below 2^-126 the two may differ by a subnormal ulp, but both encode to
// the zero of y's sign in E4M3 and E5M2 (whose smallest subnormals are 2^-9 and 2^-16).
struct MxScale {
  int k;
  float p;  // 2^k, or the block's amax when it is NaN
  __device__ __forceinline__ explicit MxScale(float factor) : k(0), p(factor) {}
  __device__ __forceinline__ MxScale(unsigned key, float qmax) {
    const float amax = __uint_as_float(key);
    k = -fmt::e8m0_exponent(amax, qmax);
    // 2^k: normal bits for k >= -126, else the subnormal 2^-127 (k = -128 is NaN's, replaced).
    const float pk = __uint_as_float(k >= -126 ? static_cast<uint32_t>(k + 127) << 23 : 0x400000u);
    p = amax != amax ? amax : pk;
  }
  __device__ __forceinline__ float factor() const { return p; }
  __device__ __forceinline__ float operator()(float y) const {
    const float r = __fmul_rn(y, p);
    return p != p ? p : r;
  }
};

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

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
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

// The colwise thresholds' shared-memory word of (lane tx, column pair p): the lanes' words of
// one pair are adjacent, so a warp's 4-byte loads hit 32 different banks.
template <int kTx>
__device__ __forceinline__ int fp4_pair_slot(int tx, int p) {
  return p * kTx + tx;
}

// Stores 8 codes (one byte each) at p: one 8-byte store on the vector path, else the first n_ok.
__device__ __forceinline__ void store_codes8(uint8_t* p, uint2 c, bool vec, int n_ok) {
  if (vec) {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(c.x), "r"(c.y) : "memory");
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (k < n_ok) p[k] = static_cast<uint8_t>((k < 4 ? c.x : c.y) >> (8 * (k & 3)));
    }
  }
}

// Stores 8 E2M1 codes packed in 4 bytes at p (vector: one 4-byte store; else the bytes whose
// first code is among the first n_ok).
__device__ __forceinline__ void store_fp4x8(uint8_t* p, uint32_t w, bool vec, int n_ok) {
  if (vec) {
    asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (2 * k < n_ok) p[k] = static_cast<uint8_t>(w >> (8 * k));
    }
  }
}

// The standalone quantize of a 16-bit input (the identity forward): y is x itself, so the kernel
// takes the loaded words as they are instead of converting them to float32 and back (12
// instructions per 8 values). The round trip quiets signalling NaNs (the CPU's store sets the
// quiet bit and keeps the payload): no code depends on a NaN's payload, but the amax does, so it
// takes the words through quiet_nan16.
template <typename Spec, typename T, bool kBwd>
inline constexpr bool kRawIdentity = !kBwd && !Spec::kGated && !std::is_same_v<T, float> &&
                                     std::is_same_v<typename Spec::Act, act::Identity>;

// The packed 16-bit pair w with the quiet bit set in each NaN half (bfloat16 bit 6, float16 bit 9):
// a half is NaN when its magnitude exceeds the infinity's, which the add carries into bit 15.
template <typename T>
__device__ __forceinline__ uint32_t quiet_nan16(uint32_t w) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr uint32_t kBelowNan = kBf16 ? 0x007f007fu : 0x03ff03ffu;  // 0x7fff - inf
  constexpr int kShift = kBf16 ? 9 : 6;                             // bit 15 -> the quiet bit
  const uint32_t nan = ((w & 0x7fff7fffu) + kBelowNan) & 0x80008000u;
  return w | (nan >> kShift);
}

// An 8-byte shared-memory load that the compiler keeps where it is written (volatile asm): left
// free, it hoisted all of a lane's per-column factors at once and spilled.
__device__ __forceinline__ float2 lds_f2(const float2* p) {
  float2 r;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
               : "=f"(r.x), "=f"(r.y)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return r;
}

template <typename Spec, typename T, Mode M, bool kBwd>
struct Smem {
  using G = Geo<Spec, T, kBwd>;
  static constexpr bool kColBlocks = M == Mode::kMx || M == Mode::kNvfp4;
  static constexpr int kNblk = M == Mode::kNvfp4 ? 2 : 1;
  // Region A: TENSOR: transposed codes [O][32][kCols] bytes; MX/NVFP4: per-lane column keys
  // [O][kRL][kCols] u32. dbias partials [O][kRL][kCols] f32 alias it (used after a barrier).
  // The transposed codes' row stride: R = 4 pads each row by one bank word (see kTStride).
  static constexpr int kTStride = G::R == 4 ? G::kCols + 4 : G::kCols;
  static constexpr size_t kTensorBytes =
      M == Mode::kTensor ? size_t{G::O} * kTileRows * kTStride : 0;
  static constexpr size_t kRedBytes = kColBlocks ? size_t{G::O} * G::kRL * G::kCols * 4 : 0;
  static constexpr size_t kPartBytes = kBwd ? size_t{G::O} * G::kRL * G::kCols * 4 : 0;
  static constexpr size_t kA = std::max({kTensorBytes, kRedBytes, kPartBytes, size_t{16}});
  // Region B: per column block [O][kNblk][kCols]: MX: the scaling factor (MxScale::factor,
  // float); NVFP4: the decoded E4M3 block scale and its reciprocal ([2][O][kNblk][kCols] float),
  // or for 16-bit inputs the block's thresholds and special-case masks ([O][kNblk][8][kCols]
  // u16, see kFp4ByCompare).
  static constexpr bool kFp4Cmp = M == Mode::kNvfp4 && kFp4ByCompare<T>;
  static constexpr size_t kB =
      M == Mode::kMx ? size_t{G::O} * G::kCols * 4
      : M != Mode::kNvfp4 ? 16
      : kFp4Cmp ? size_t{G::O} * kNblk * 8 * G::kCols * 2
                : size_t{2} * G::O * kNblk * G::kCols * 4;
  // Region T (16-bit NVFP4): the threshold table of the batch's tensor scale.
  static constexpr int kTableRows = kFp4Cmp ? 128 : 1;
  // Region P (the MXFP8 forward): the next whole tile's inputs, copied asynchronously while this
  // one is computed: per thread R * L loads of 8 elements, in 16-byte chunks [chunk][thread] (a
  // warp's chunk is 512 contiguous bytes: no bank conflicts). quant_test --bench (H100): act_lu
  // GELU MXFP8 row + col 0.870 -> 0.827 ms, SWIGLU 1.147 -> 1.117 ms, quantize MXFP8 row + col
  // 0.775 -> 0.771 ms; the NVFP4 forward lost with it (quantize row + col 0.824 -> 0.834 ms, act_lu
  // GELU row 0.684 -> 0.704 ms), so it loads directly.
  static constexpr bool kPrefetch = !kBwd && M == Mode::kMx;
  static constexpr int kPerLoad = static_cast<int>(sizeof(T)) / 2;  // 16-byte chunks per load
  static constexpr int kChunks = G::R * G::L * kPerLoad;
  static constexpr int kPfChunks = kPrefetch ? kChunks : 1;
  // Chunk c holds quarter q of the load of half h of row i (in[i][h].w[4q .. 4q + 3]).
  struct Chunk {
    int i, h, q;
  };
  static constexpr Chunk chunk(int c) {
    return {c / (G::L * kPerLoad), (c / kPerLoad) % G::L, c % kPerLoad};
  }
};

template <typename Spec, typename T, Mode M, bool kBwd>
__global__ void __launch_bounds__(kThreads, (kMinBlocks<Spec, T, M, kBwd>))
    quant_kernel(const QArgs a) {
  using G = Geo<Spec, T, kBwd>;
  using S = Smem<Spec, T, M, kBwd>;
  constexpr int L = G::L, O = G::O, R = G::R, kCols = G::kCols, kTx = G::kTx, kRL = G::kRL;
  constexpr int kNblk = S::kNblk;
  constexpr bool kFp4Cmp = S::kFp4Cmp;
  __shared__ alignas(16) unsigned char smem_a[S::kA];
  __shared__ alignas(16) unsigned char smem_b[S::kB];
  __shared__ alignas(16) uint32_t smem_t[S::kTableRows][kFp4TableWords];
  __shared__ alignas(16) uint4 smem_p[S::kPfChunks][S::kPrefetch ? kThreads : 1];

  const int tid = threadIdx.x;
  // Lets the compiler fold index arithmetic that mixes tid with compile-time strides.
  __builtin_assume(tid >= 0 && tid < kThreads);
  const int tx = tid % kTx, ty = tid / kTx;
  const uint64_t H = a.H, n = a.n, mb = a.mb;
  const T* x = static_cast<const T*>(a.x);
  const T* dz = static_cast<const T*>(a.dz);
  const bool rowwise = a.data != nullptr, colwise = a.colwise != nullptr;

  if constexpr (M == Mode::kTensor || M == Mode::kNvfp4) {
    if (a.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
      for (uint64_t b = tid; b < a.batches; b += kThreads) {
        a.scale_inv[b] = fmt::div_rn(1.0f, tensor_scale(a, b));
      }
    }
  }

  // Work items (column tile x, group y, batch z), grid-strided in each dimension (the grid is
  // (col_tiles, groups, batches) unless capped).
  for (uint32_t b = blockIdx.z; b < a.batches; b += gridDim.z) {
  if constexpr (kFp4Cmp) {
    __syncthreads();  // the previous batch's table is read until here
    build_fp4_table<T>(*reinterpret_cast<Fp4Table*>(smem_t), tensor_scale(a, b));
    __syncthreads();
  }
  // The batch's tensor scale (a load and, for a scale derived from the amax, a division: once per
  // batch, not per tile).
  [[maybe_unused]] float s = 0.0f;
  if constexpr (M == Mode::kTensor || M == Mode::kNvfp4) s = tensor_scale(a, b);
  // Column tiles outer, groups inner: a block usually keeps its column tile (the grid's x is the
  // column tile count) and walks several groups, so the column set-up runs once.
  for (uint32_t ct = blockIdx.x; ct < a.col_tiles; ct += gridDim.x) {
  const uint64_t tile_c0 = uint64_t{ct} * kCols;
  const uint64_t c0 = tile_c0 + static_cast<uint64_t>(tx) * 8;  // this lane's first column
  const int ncol = c0 < H ? static_cast<int>(std::min<uint64_t>(8, H - c0)) : 0;
  for (uint32_t g = blockIdx.y; g < a.groups; g += gridDim.y) {
    // The group's row tiles: one (groups == row_tiles), or a range of consecutive ones (the dbias
    // groups; the block-scaled modes' blocks, see launch_quantized).
    uint64_t t_begin = g, t_end = uint64_t{g} + 1;
    if (a.groups != a.row_tiles) {
      t_begin = uint64_t{g} * a.row_tiles / a.groups;
      t_end = (uint64_t{g} + 1) * a.row_tiles / a.groups;
    }
    uint32_t amax_p = 0;  // packed max of |y| (V8::to_key)
    float acc[O][8];
#pragma unroll
    for (int l = 0; l < O; ++l)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[l][k] = 0.0f;

    // This thread's element offsets in x, dz and y at (its first row of the group's first tile,
    // c0); each tile steps them by its rows' strides instead of multiplying per tile (the
    // products and their operands' reloads were ~100 instructions per warp and tile in the SASS).
    const uint64_t row_first = b * mb + t_begin * kTileRows + static_cast<uint64_t>(ty) * R;
    uint64_t x_off = row_first * (L * H) + c0;
    [[maybe_unused]] uint64_t z_off = row_first * H + c0;
    uint64_t y_off = row_first * n + c0;
    // With S::kPrefetch the whole tiles' inputs go through smem_p: the copies of tile rt + 1 are
    // issued as soon as tile rt's have been read, so they are in flight while tile rt is computed.
    [[maybe_unused]] bool prefetched = false;  // this tile's inputs are on their way to smem_p
    [[maybe_unused]] auto prefetch = [&](uint64_t xo) {
#pragma unroll
      for (int c = 0; c < S::kChunks; ++c) {
        const auto k = S::chunk(c);
        cp_async16(&smem_p[c][tid], x + xo + k.i * (L * H) + k.h * H + k.q * (16 / sizeof(T)));
      }
    };
    for (uint64_t rt = t_begin; rt < t_end;
         ++rt, x_off += kTileRows * L * H, z_off += kTileRows * H, y_off += kTileRows * n) {
      const uint64_t r0 = b * mb + rt * kTileRows;  // the tile's first row
      const int tile_rows = static_cast<int>(std::min<uint64_t>(kTileRows, mb - rt * kTileRows));
      // Whole tiles (every row and column inside, 16-byte loads and vector stores), nearly all of
      // a large input, run a copy of the tile in which the edge checks are constants, for the
      // block-scaled forward (in ncu's count of the NVFP4 row + col pass, branch and
      // reconvergence instructions were 3.9 of 48.7 per element). The backward and the
      // tensor-scaled tiles keep one copy: the second one added spills there (quant_test --bench:
      // dact + dbias GELU NVFP4 1.10 -> 1.41 ms, the transposed GELU 0.77 -> 0.82 ms).
      constexpr bool kWholeCopy = !kBwd && (M == Mode::kMx || M == Mode::kNvfp4);
      const bool whole = tile_rows == kTileRows && tile_c0 + kCols <= H && a.vec_in && a.vec_out;
      auto tile = [&](auto whole_tag) {
        constexpr bool kWhole = decltype(whole_tag)::value;
        const int nr = kWhole ? kTileRows : tile_rows;
        [[maybe_unused]] const bool vec_in = kWhole || a.vec_in, vec_out = kWhole || a.vec_out;
        int nok[R];
        // ---- loads: all of the tile's, then compute ----
        Raw8<T> in[R][G::kLoads];
        if constexpr (S::kPrefetch && kWhole) {
          if (!prefetched) prefetch(x_off);
          cp_async_wait_all();
#pragma unroll
          for (int c = 0; c < S::kChunks; ++c) {
            const auto k = S::chunk(c);
            const uint4 u = smem_p[c][tid];
            uint32_t* w = &in[k.i][k.h].w[4 * k.q];
            w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
          }
#pragma unroll
          for (int i = 0; i < R; ++i) nok[i] = 8;
          // The next tile's copies reuse this thread's chunks: its reads above are done first
          // (a thread's shared-memory accesses are performed in order, and the copies write only
          // after their global loads return).
          prefetched = rt + 1 < t_end && mb - (rt + 1) * kTileRows >= kTileRows;
          if (prefetched) prefetch(x_off + kTileRows * L * H);
        } else {
          if constexpr (S::kPrefetch) prefetched = false;
          const T* xr = x + x_off;
          [[maybe_unused]] const T* zr = dz + z_off;
#pragma unroll
          for (int i = 0; i < R; ++i) {
            nok[i] = kWhole ? 8 : (ty * R + i < nr ? ncol : 0);
            if constexpr (kBwd) load8(zr + i * H, vec_in, nok[i], in[i][0]);
            load8(xr + i * (L * H), vec_in, nok[i], in[i][kBwd ? 1 : 0]);
            if constexpr (L == 2) load8(xr + i * (L * H) + H, vec_in, nok[i], in[i][kBwd ? 2 : 1]);
          }
        }
        V8<T> v[R][O];  // y rounded to T (0 where invalid)
        if constexpr (kRawIdentity<Spec, T, kBwd>) {
          // y = x: the loaded words are the values (invalid elements were loaded as 0).
#pragma unroll
          for (int i = 0; i < R; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) v[i][0].w[j] = in[i][0].w[j];
          }
          if (a.amax != nullptr) {
#pragma unroll
            for (int i = 0; i < R; ++i) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                amax_p = V8<T>::pmax(amax_p, quiet_nan16<T>(v[i][0].w[j]) * 2u);
              }
            }
          }
        } else {
#pragma unroll
          for (int i = 0; i < R; ++i) {
            [[maybe_unused]] float fa[8], fb[8], fg[8], raw[O][8];
            if constexpr (kBwd) to_float8(in[i][0], fg);
            to_float8(in[i][kBwd ? 1 : 0], fa);
            if constexpr (L == 2) to_float8(in[i][kBwd ? 2 : 1], fb);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              const float bk = L == 2 ? fb[k] : 0.0f;
              if constexpr (!kBwd) {
                raw[0][k] = act_forward<Spec>(fa[k], bk, a.params);
              } else {
                float da, db;
                act_backward<Spec>(fg[k], fa[k], bk, a.params, da, db);
                raw[0][k] = da;
                if constexpr (O == 2) raw[O - 1][k] = db;
              }
            }
#pragma unroll
            for (int l = 0; l < O; ++l) {
              v[i][l].set(raw[l], nok[i]);
              amax_p = V8<T>::pmax(amax_p, pmax8(v[i][l]));
              // dbias: masked elements come from zero inputs (dz = 0), whose gradients are +-0
              // for every activation, and adding +-0 leaves the sum (never -0: it starts at +0)
              // as it is.
              if constexpr (kBwd) {
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[l][k] += raw[l][k];
              }
            }
          }
        }

        // ---- emit ----
        if constexpr (M == Mode::kTensor) {
          constexpr int kStride = S::kTStride;
          auto& tcodes = *reinterpret_cast<uint8_t(*)[O][kTileRows][kStride]>(smem_a);
#pragma unroll
          for (int l = 0; l < O; ++l) {
#pragma unroll
            for (int i = 0; i < R; ++i) {
              const int ri = ty * R + i;
              const uint2 c = tensor_codes(a.e5m2, v[i][l], s);
              if (rowwise && nok[i] > 0) {
                store_codes8(a.data + y_off + i * n + l * H, c, vec_out, nok[i]);
              }
              if (colwise) {
                // Two 4-byte stores: the padded stride keeps only 4-byte alignment.
                uint32_t* t = reinterpret_cast<uint32_t*>(&tcodes[l][ri][tx * 8]);
                t[0] = c.x;
                t[1] = c.y;
              }
            }
          }
          if (colwise) {
            __syncthreads();
            if constexpr (R == 4) {
              // Thread = (column group g of 4 columns, row quarter q of 8 rows): 8 shared loads of
              // 4 codes (one row of the group each), two 4x4 byte transposes, then per column one
              // 8-byte store of its 8 rows. The 4 lanes of a group fill each column's 32-byte
              // sector in one store instruction (8 whole sectors per instruction; one column per
              // thread wrote 16-byte halves, 32 per instruction, at 0.67 of copy bandwidth on the
              // H100). The stride of kCols + 4 bytes (an odd number of words) puts the quarters'
              // rows 8 apart on different banks.
              const int q = tid & 3, grp = tid >> 2;
              const int rb = 8 * q;
              const uint64_t col0 = tile_c0 + 4 * grp;
              if (col0 < H && rb < nr) {
#pragma unroll
                for (int l = 0; l < O; ++l) {
                  uint32_t w[8];
#pragma unroll
                  for (int r = 0; r < 8; ++r) {
                    w[r] = *reinterpret_cast<const uint32_t*>(&tcodes[l][rb + r][4 * grp]);
                  }
                  uint32_t cw[4][2];  // column k: rows 0-3, rows 4-7 (first row in the low byte)
#pragma unroll
                  for (int h = 0; h < 2; ++h) {
                    const uint32_t* x = w + 4 * h;
                    const uint32_t t0 = __byte_perm(x[0], x[1], 0x5140);
                    const uint32_t t1 = __byte_perm(x[2], x[3], 0x5140);
                    const uint32_t t2 = __byte_perm(x[0], x[1], 0x7362);
                    const uint32_t t3 = __byte_perm(x[2], x[3], 0x7362);
                    cw[0][h] = __byte_perm(t0, t1, 0x5410);
                    cw[1][h] = __byte_perm(t0, t1, 0x7632);
                    cw[2][h] = __byte_perm(t2, t3, 0x5410);
                    cw[3][h] = __byte_perm(t2, t3, 0x7632);
                  }
#pragma unroll
                  for (int k = 0; k < 4; ++k) {
                    const uint64_t col = col0 + k;
                    if (col < H) {
                      uint8_t* dst =
                          a.colwise + b * n * mb + (l * H + col) * mb + rt * kTileRows + rb;
                      if (a.vec_t) {  // the 8 rows are whole (mb % 32 == 0)
                        asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(cw[k][0]),
                                     "r"(cw[k][1])
                                     : "memory");
                      } else {
                        const int m = min(8, nr - rb);
                        for (int j = 0; j < m; ++j) {
                          dst[j] = static_cast<uint8_t>(cw[k][j >> 2] >> (8 * (j & 3)));
                        }
                      }
                    }
                  }
                }
              }
            } else {
              constexpr int kChunks = kThreads / kCols;          // 4 / R
              constexpr int kChunkRows = kTileRows / kChunks;    // 8 R
              const int tc = tid % kCols, ch = tid / kCols;
              const int rb = ch * kChunkRows;
              const uint64_t col = tile_c0 + tc;
              if (col < H && rb < nr) {
#pragma unroll
                for (int l = 0; l < O; ++l) {
                  uint8_t* dst = a.colwise + b * n * mb + (l * H + col) * mb + rt * kTileRows + rb;
                  if (a.vec_t) {  // the chunk is whole (mb % kChunkRows == 0)
                    uint32_t w[kChunkRows / 4];
#pragma unroll
                    for (int j = 0; j < kChunkRows / 4; ++j) {
                      w[j] = static_cast<uint32_t>(tcodes[l][rb + 4 * j][tc]) |
                             (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 1][tc]) << 8) |
                             (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 2][tc]) << 16) |
                             (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 3][tc]) << 24);
                    }
                    if constexpr (kChunkRows == 8) {
                      asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(w[0]),
                                   "r"(w[1])
                                   : "memory");
                    } else {
#pragma unroll
                      for (int j = 0; j < kChunkRows / 16; ++j) {
                        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 16 * j),
                                     "r"(w[4 * j]), "r"(w[4 * j + 1]), "r"(w[4 * j + 2]),
                                     "r"(w[4 * j + 3])
                                     : "memory");
                      }
                    }
                  } else {
                    const int m = min(kChunkRows, nr - rb);
                    for (int j = 0; j < m; ++j) dst[j] = tcodes[l][rb + j][tc];
                  }
                }
              }
            }
            __syncthreads();  // tcodes is rewritten by the next tile
          }
        } else if constexpr (M == Mode::kMx || M == Mode::kNvfp4) {
          constexpr int kGroupLanes = M == Mode::kMx ? 4 : 2;  // lanes per rowwise block
          if (rowwise) {
            // The block maxima of all rows first (the shuffles' latencies overlap), then one row at
            // a time.
            unsigned keys[O][R];
#pragma unroll
            for (int l = 0; l < O; ++l) {
#pragma unroll
              for (int i = 0; i < R; ++i) {
                keys[l][i] = V8<T>::to_key(pmax8(v[i][l]));
              }
            }
#pragma unroll
            for (int l = 0; l < O; ++l) {
#pragma unroll
              for (int i = 0; i < R; ++i) {
                unsigned key = keys[l][i];
                key = max(key, __shfl_xor_sync(0xffffffffu, key, 1));
                if constexpr (kGroupLanes == 4) {
                  key = max(key, __shfl_xor_sync(0xffffffffu, key, 2));
                }
                keys[l][i] = key;
              }
            }
            // The block scales of this lane's rows: row i, half l at bsr[i * bs_row + l * bs_half],
            // for the lanes that store them (c0 % kBlk == 0; the rowwise layout needs n % kBlk ==
            // 0, so row * n / kBlk + c0 / kBlk = y_off / kBlk).
            constexpr int kBlk = M == Mode::kMx ? 32 : 16;
            const uint64_t bs_row = n / kBlk, bs_half = H / kBlk;
            uint8_t* const bsr = a.bscale + y_off / kBlk;
            // 16-bit NVFP4: the two lanes of a block hold the same keys; each computes the scale
            // codes of half of the rows (lane tx % 2 == h takes rows [h R / 2, (h + 1) R / 2); R
            // is 2 or 4 here) and gives them to the other: one shuffle for ~16 instructions of
            // nvfp4_scale, most of them on the ALU pipe. quant_test --bench (H100): quantize
            // NVFP4 row + col 0.815 -> 0.788 ms, act_lu GELU NVFP4 row 0.680 -> 0.644 ms.
            [[maybe_unused]] uint8_t fp4_codes[O][R];
            if constexpr (kFp4Cmp) {
              const bool upper = (tx & 1) != 0;
#pragma unroll
              for (int l = 0; l < O; ++l) {
#pragma unroll
                for (int k = 0; k < R / 2; ++k) {
                  const uint8_t mine = nvfp4_scale(upper ? keys[l][R / 2 + k] : keys[l][k], s);
                  const uint8_t other =
                      static_cast<uint8_t>(__shfl_xor_sync(0xffffffffu, unsigned{mine}, 1));
                  fp4_codes[l][k] = upper ? other : mine;
                  fp4_codes[l][R / 2 + k] = upper ? mine : other;
                }
              }
            }
#pragma unroll
            for (int l = 0; l < O; ++l) {
#pragma unroll
              for (int i = 0; i < R; ++i) {
                uint8_t* const bs_at = bsr + i * bs_row + l * bs_half;
                const bool lead = (tx & (kGroupLanes - 1)) == 0;
                if constexpr (M == Mode::kMx) {
                  const MxScale sc(keys[l][i], a.qmax);
                  if (nok[i] > 0 && lead) *bs_at = static_cast<uint8_t>(-sc.k + 127);
                  float q[8];
#pragma unroll
                  for (int k = 0; k < 8; ++k) q[k] = sc(v[i][l][k]);
                  const uint2 c = fp8_codes(a.e5m2, q);
                  if (nok[i] > 0) store_codes8(a.data + y_off + i * n + l * H, c, vec_out, nok[i]);
                } else if constexpr (kFp4Cmp) {
                  const uint8_t code = fp4_codes[l][i];
                  if (nok[i] > 0 && lead) *bs_at = code;
                  const uint32_t* const row = smem_t[code & 0x7fu];
                  const uint4 t0 = reinterpret_cast<const uint4*>(row)[0];
                  const uint4 t1 = reinterpret_cast<const uint4*>(row)[1];
                  const uint32_t y[7] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z};
                  const uint32_t keep = t1.w, nan_codes = row[8];
                  uint32_t codes = 0;
#pragma unroll
                  for (int p = 0; p < 4; ++p) {
                    codes = fp4_place(codes, fp4_pair(v[i][l].w[p], y), p);
                  }
                  if (nok[i] > 0) {
                    store_fp4x8(a.data + y_off / 2 + i * (n / 2) + l * (H / 2),
                                (codes & keep) | nan_codes, vec_out, nok[i]);
                  }
                } else {
                  const uint8_t code = nvfp4_scale(keys[l][i], s);
                  if (nok[i] > 0 && lead) *bs_at = code;
                  float bs[8], rb[8];
                  const float bsv = fmt::from_e4m3(code), rbv = __frcp_rn(bsv);
#pragma unroll
                  for (int k = 0; k < 8; ++k) bs[k] = bsv, rb[k] = rbv;
                  if (nok[i] > 0) {
                    store_fp4x8(a.data + y_off / 2 + i * (n / 2) + l * (H / 2),
                                nvfp4_codes(v[i][l], s, bs, rb), vec_out, nok[i]);
                  }
                }
              }
            }
          }
          if (colwise) {
            auto& red = *reinterpret_cast<unsigned(*)[O][kRL][kCols]>(smem_a);
            [[maybe_unused]] auto& mx_f = *reinterpret_cast<float(*)[O][kCols]>(smem_b);
            // NVFP4: the decoded block scales, then their reciprocals RN(1 / bs).
            [[maybe_unused]] auto& fp4_bs = *reinterpret_cast<float(*)[2][O][kNblk][kCols]>(smem_b);
            // Per-lane column maxima over the lane's R rows (all in one column block: R | 16).
#pragma unroll
            for (int l = 0; l < O; ++l) {
              unsigned ck[8];
              if constexpr (std::is_same_v<T, float>) {
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                  ck[k] = v[0][l].key_word(k);
#pragma unroll
                  for (int i = 1; i < R; ++i) ck[k] = max(ck[k], v[i][l].key_word(k));
                }
              } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                  uint32_t m = v[0][l].key_word(j);
#pragma unroll
                  for (int i = 1; i < R; ++i) m = V8<T>::pmax(m, v[i][l].key_word(j));
                  ck[2 * j] = V8<T>::key_lo(m);
                  ck[2 * j + 1] = V8<T>::key_hi(m);
                }
              }
              uint4* dst = reinterpret_cast<uint4*>(&red[l][ty][tx * 8]);
              dst[0] = make_uint4(ck[0], ck[1], ck[2], ck[3]);
              dst[1] = make_uint4(ck[4], ck[5], ck[6], ck[7]);
            }
            __syncthreads();
            // Column block maxima (and the colwise block scales) by O * kNblk * kCols threads, in
            // an unrolled loop whose index arithmetic folds (as a runtime loop, index and address
            // arithmetic was ~60 of the ~115 instructions per column block in the SASS). cb: the
            // tile's first row of colwise block scales, at its column 0 (block row
            // (r0 + 16 blk) / 16 = r0 / 16 + blk for NVFP4, r0 / 32 for MXFP8).
            constexpr int kLanesPerBlk = kRL / kNblk;
            constexpr int kRedItems = O * kNblk * kCols;
            uint8_t* const cb = a.cbscale + (r0 / (M == Mode::kMx ? 32 : 16)) * n + tile_c0;
#pragma unroll
            for (int e0 = 0; e0 < kRedItems; e0 += kThreads) {
              const unsigned e = static_cast<unsigned>(e0 + tid);
              if (kRedItems % kThreads != 0 && e >= kRedItems) break;
              const unsigned l = e / (kNblk * kCols), blk = (e / kCols) % kNblk, c = e % kCols;
              unsigned m = 0;
#pragma unroll
              for (int t = 0; t < kLanesPerBlk; ++t) m = max(m, red[l][blk * kLanesPerBlk + t][c]);
              const bool out = tile_c0 + c < H && static_cast<int>(blk) * 16 < nr;
              if constexpr (M == Mode::kMx) {
                const MxScale sc(m, a.qmax);
                mx_f[l][c] = sc.factor();
                if (out) cb[l * H + c] = static_cast<uint8_t>(127 - sc.k);
              } else {
                const uint8_t code = nvfp4_scale(m, s);
                if constexpr (kFp4Cmp) {
                  // The block's thresholds from the table, and its special case: row 7 holds the
                  // nibble mask of the codes kept (0xf, or 0 for a zero or NaN scale) in the low
                  // byte and the NaN code (8 or 0) in the high one.
                  auto& thh = *reinterpret_cast<uint16_t(*)[O][kNblk][8][kCols]>(smem_b);
                  // Column c is half c % 2 of pair (c % 8) / 2 of lane c / 8.
                  const int slot = 2 * fp4_pair_slot<kTx>(c / 8, (c % 8) / 2) + c % 2;
#pragma unroll
                  for (int j = 0; j < 7; ++j) {
                    thh[l][blk][j][slot] = static_cast<uint16_t>(smem_t[code & 0x7fu][j]);
                  }
                  const uint32_t cc = code & 0x7fu;
                  thh[l][blk][7][slot] = static_cast<uint16_t>(
                      cc == 0u ? 0u : (cc == 0x7fu ? 0x800u : 0xfu));
                } else {
                  const float bs = fmt::from_e4m3(code);
                  fp4_bs[0][l][blk][c] = bs;
                  fp4_bs[1][l][blk][c] = __frcp_rn(bs);
                }
                if (out) cb[blk * n + l * H + c] = code;
              }
            }
            __syncthreads();
            [[maybe_unused]] const int blk = kNblk == 2 ? (ty * R) / 16 : 0;
#pragma unroll
            for (int l = 0; l < O; ++l) {
              if constexpr (M == Mode::kMx) {
                // Column pairs outer, rows inner: two columns' scales live at a time; the scaled
                // values of a row are kept (float) until its 8 are ready.
                float q[R][8];
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                  const float2 f =
                      lds_f2(reinterpret_cast<const float2*>(&mx_f[l][tx * 8 + 2 * kk]));
                  const MxScale s0(f.x), s1(f.y);
#pragma unroll
                  for (int i = 0; i < R; ++i) {
                    q[i][2 * kk] = s0(v[i][l][2 * kk]);
                    q[i][2 * kk + 1] = s1(v[i][l][2 * kk + 1]);
                  }
                }
#pragma unroll
                for (int i = 0; i < R; ++i) {
                  const uint2 c = fp8_codes(a.e5m2, q[i]);
                  if (nok[i] > 0) {
                    store_codes8(a.colwise + y_off + i * n + l * H, c, vec_out,
                                 nok[i]);
                  }
                }
              } else if constexpr (kFp4Cmp) {
                const auto& thw =
                    *reinterpret_cast<const uint32_t(*)[O][kNblk][8][kCols / 2]>(smem_b);
                // One column pair at a time (its 7 thresholds live), rows inner; part[i]: row i's
                // codes so far, pair p's byte placed at byte p.
                uint32_t part[R];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                  uint32_t y[7];
#pragma unroll
                  for (int j = 0; j < 7; ++j) y[j] = thw[l][blk][j][fp4_pair_slot<kTx>(tx, p)];
#pragma unroll
                  for (int i = 0; i < R; ++i) {
                    part[i] = fp4_place(p == 0 ? 0u : part[i], fp4_pair(v[i][l].w[p], y), p);
                  }
                }
                // Row 7: per column pair, [keep0 | nan0 << 8, keep1 | nan1 << 8]; q | q >> 12 puts
                // the pair's keep byte in byte 0 and its NaN byte in byte 1.
                uint32_t z[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                  const uint32_t q = thw[l][blk][7][fp4_pair_slot<kTx>(tx, p)];
                  z[p] = q | (q >> 12);
                }
                const uint32_t keep =
                    prmt(prmt(z[0], z[1], 0x40u), prmt(z[2], z[3], 0x40u), 0x5410u);
                const uint32_t nanc =
                    prmt(prmt(z[0], z[1], 0x51u), prmt(z[2], z[3], 0x51u), 0x5410u);
#pragma unroll
                for (int i = 0; i < R; ++i) {
                  if (nok[i] > 0) {
                    store_fp4x8(a.colwise + y_off / 2 + i * (n / 2) + l * (H / 2),
                                (part[i] & keep) | nanc, vec_out, nok[i]);
                  }
                }
              } else {
                const float4* src = reinterpret_cast<const float4*>(&fp4_bs[0][l][blk][tx * 8]);
                const float4* srr = reinterpret_cast<const float4*>(&fp4_bs[1][l][blk][tx * 8]);
                const float4 u0 = src[0], u1 = src[1], w0 = srr[0], w1 = srr[1];
                const float bs[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
                const float rb[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
                for (int i = 0; i < R; ++i) {
                  if (nok[i] > 0) {
                    store_fp4x8(a.colwise + y_off / 2 + i * (n / 2) + l * (H / 2),
                                nvfp4_codes(v[i][l], s, bs, rb), vec_out, nok[i]);
                  }
                }
              }
            }
            // red and the factors: the next tile writes red only after every thread passed the
            // barrier above (so the reads of red are done), and the factors after its own first.
          }
        }
      };
      if (kWholeCopy && whole) {
        tile(std::integral_constant<bool, kWholeCopy>{});
      } else {
        tile(std::false_type{});
      }
    }

    // ---- end of the item: amax, dbias partial ----
    if (a.amax != nullptr) {
      block_amax_commit(V8<T>::to_key(amax_p), a.amax + b);
      __syncthreads();  // its shared scratch is reused by the next item
    }
    if constexpr (kBwd) {
      if (a.ws != nullptr) {
        auto& part = *reinterpret_cast<float(*)[O][kRL][kCols]>(smem_a);
        __syncthreads();  // smem_a may hold the last tile's codes / keys
#pragma unroll
        for (int l = 0; l < O; ++l) {
          float4* dst = reinterpret_cast<float4*>(&part[l][ty][tx * 8]);
          dst[0] = make_float4(acc[l][0], acc[l][1], acc[l][2], acc[l][3]);
          dst[1] = make_float4(acc[l][4], acc[l][5], acc[l][6], acc[l][7]);
        }
        __syncthreads();
        float* wrow = a.ws + (uint64_t{b} * a.groups + g) * n;
        for (int e = tid; e < O * kCols; e += kThreads) {
          const int l = e / kCols, c = e % kCols;
          float sum = part[l][0][c];
#pragma unroll
          for (int t = 1; t < kRL; ++t) sum += part[l][t][c];
          if (tile_c0 + c < H) wrow[l * H + tile_c0 + c] = sum;
        }
        __syncthreads();
      }
    }
  }  // groups
  }  // column tiles
  }  // batches
}

// ---- host launcher ----------------------------------------------------------------------------

// Everything launch_quantized needs, from either problem.
struct QCall {
  const void* x;
  const void* dz;
  int64_t rows, hidden;
  ActParams params;
  const QuantOutput* q;
  float* ws;        // dbias workspace, or nullptr
  void* dbias;      // dbias output, or nullptr
  int64_t groups;   // dbias groups (when ws)
  DType dtype;
};

template <typename T>
constexpr DType kDTypeOf = std::is_same_v<T, float>           ? DType::F32
                           : std::is_same_v<T, __nv_bfloat16> ? DType::BF16
                                                              : DType::F16;

// The rowwise tensor-scaled codes and the amax passes, without dbias, on elementwise.cuh's kernel
// (one flat pass; no tile structure is needed when nothing is transposed, blocked or summed).
template <typename Spec, typename T, Mode M, bool kBwd>
cudaError_t launch_quantized_eltwise(const QCall& c, cudaStream_t stream, const LaunchConfig& cfg) {
  static_assert(M == Mode::kTensor || M == Mode::kAmax, "elementwise modes");
  const QuantOutput& q = *c.q;
  EltArgs<T> a{};
  a.x = static_cast<const T*>(c.x);
  a.dz = static_cast<const T*>(c.dz);
  a.codes = q.data;
  a.batches = static_cast<uint64_t>(q.batches);
  a.params = c.params;
  a.amax = reinterpret_cast<unsigned*>(q.amax);
  a.scale = q.scale;
  a.scale_numerator = q.scale_numerator;
  a.scale_inv = q.scale_inv;
  a.e5m2 = q.qtype == QType::E5M2;
  constexpr EltOut kOut = M == Mode::kTensor ? EltOut::kFp8 : EltOut::kNone;
  return launch_eltwise_batches<Spec, T, kBwd, kOut>(a, c.rows, c.hidden, stream, cfg);
}

template <typename Spec, typename T, Mode M, bool kBwd>
cudaError_t launch_quantized(const QCall& c, cudaStream_t stream, const LaunchConfig& cfg) {
  using G = Geo<Spec, T, kBwd>;
  auto* const kernel = &quant_kernel<Spec, T, M, kBwd>;
  const QuantOutput& q = *c.q;
  if constexpr (M == Mode::kTensor || M == Mode::kAmax) {
    if (cfg.load_only) {
      if (cudaError_t e = launch_quantized_eltwise<Spec, T, M, kBwd>(c, stream, cfg);
          e != cudaSuccess) {
        return e;
      }
    } else if (c.ws == nullptr && q.colwise == nullptr &&
               (M == Mode::kAmax || q.data != nullptr) &&
               static_cast<uint64_t>(q.batches) <= kEltMaxBatches) {
      return launch_quantized_eltwise<Spec, T, M, kBwd>(c, stream, cfg);
    }
  }
  if (cfg.load_only) {
    if (cudaError_t e = load_kernel(kernel); e != cudaSuccess) return e;
    if (c.dbias != nullptr) {
      return launch_dbias_finalize(nullptr, nullptr, kDTypeOf<T>, 0, 0, 0, stream, true);
    }
    return cudaSuccess;
  }
  const uint64_t batches = static_cast<uint64_t>(q.batches);
  if (q.amax != nullptr) {
    if (cudaError_t e = cudaMemsetAsync(q.amax, 0, batches * sizeof(float), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  const uint64_t H = static_cast<uint64_t>(c.hidden), M_ = static_cast<uint64_t>(c.rows);
  if (M == Mode::kNvfp4 && (H % 2) != 0 && (q.data != nullptr || q.colwise != nullptr)) {
    return cudaErrorInvalidValue;  // two codes per byte need an even row length
  }
  QArgs a{};
  a.x = c.x;
  a.dz = c.dz;
  a.H = H;
  a.n = G::O * H;
  a.batches = batches;
  a.mb = M_ / batches;
  const uint64_t row_tiles = (a.mb + kTileRows - 1) / kTileRows;
  const uint64_t col_tiles = (H + G::kCols - 1) / G::kCols;
  uint64_t groups = c.ws != nullptr ? static_cast<uint64_t>(c.groups) : row_tiles;
  // One block per item; LaunchConfig::max_blocks (tests) caps the grid, x first.
  const uint64_t cap = cfg.max_blocks > 0 ? cfg.max_blocks : ~uint64_t{0};
  const uint64_t gx = std::clamp<uint64_t>(col_tiles, 1, std::min<uint64_t>(cap, 0x7fffffff));
  // Block scaling: on large inputs a block takes up to 8 consecutive row tiles (a group, when
  // there is no dbias to fix the groups), whose addresses it steps from tile to tile, and 16-bit
  // NVFP4 builds its threshold table once for them (3.5 entries of ~30 instructions per thread,
  // counted from the code: a few percent of one row tile's work); never fewer than 4096 blocks,
  // so that the last wave's idle SMs do not show. quant_test --bench (H100): quantize NVFP4 row +
  // col 0.90 -> 0.82 ms (consecutive tiles with 64-bit tile counters and the rowwise block-scale
  // pointer), act_lu GELU MXFP8 row 0.72 -> 0.63 ms with the consecutive tiles (the stepped
  // offsets alone had taken it 0.74 -> 0.72). The tensor-scaled transposed store keeps one row
  // tile per block: there the blocks that run together write neighbouring 32-row pieces of each
  // colwise row, and with 8 tiles per block the same pass took 0.75 -> 1.03 ms.
  uint64_t gy_max = 65535;
  if constexpr (M == Mode::kMx || M == Mode::kNvfp4) {
    const uint64_t blocks = std::max<uint64_t>((col_tiles * row_tiles * batches + 7) / 8, 4096);
    gy_max = std::clamp<uint64_t>((blocks + gx - 1) / gx, 1, gy_max);
    if (c.ws == nullptr) groups = std::min(groups, gy_max);
  }
  if (row_tiles > 0x7fffffff || col_tiles > 0x7fffffff || groups > 0x7fffffff ||
      batches > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  a.row_tiles = static_cast<uint32_t>(row_tiles);
  a.col_tiles = static_cast<uint32_t>(col_tiles);
  a.groups = static_cast<uint32_t>(groups);
  const uint64_t items = col_tiles * groups * batches;
  a.params = c.params;
  a.data = q.data;
  a.colwise = q.colwise;
  a.bscale = q.block_scale;
  a.cbscale = q.colwise_block_scale;
  a.scale = q.scale;
  a.scale_numerator = q.scale_numerator;
  a.scale_inv = q.scale_inv;
  a.amax = reinterpret_cast<unsigned*>(q.amax);
  a.ws = c.ws;
  a.qmax = q.qtype == QType::E5M2 ? fmt::E5M2::kMax : fmt::E4M3::kMax;
  a.e5m2 = q.qtype == QType::E5M2;
  a.vec_in = H % 8 == 0 && aligned16(c.x) && (!kBwd || aligned16(c.dz));
  const auto aligned = [](const void* p, uintptr_t k) {
    return (reinterpret_cast<uintptr_t>(p) % k) == 0;
  };
  const uintptr_t out_align = M == Mode::kNvfp4 ? 4 : 8;
  a.vec_out = H % 8 == 0 && aligned(q.data, out_align) &&
              (M == Mode::kTensor || aligned(q.colwise, out_align));
  constexpr int kChunkRows = 8 * G::R;
  a.vec_t = a.mb % kChunkRows == 0 && aligned(q.colwise, 16);

  const bool scale_inv = q.scale_inv != nullptr;
  if (items == 0 && !scale_inv) return cudaSuccess;
  const uint64_t gy = std::clamp<uint64_t>(groups, 1, std::min<uint64_t>(cap / gx, gy_max));
  const uint64_t gz = std::clamp<uint64_t>(batches, 1, std::min<uint64_t>(cap / (gx * gy), 65535));
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(gz));
  kernel<<<grid, kThreads, 0, stream>>>(a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (c.dbias != nullptr && a.n > 0) {
    return launch_dbias_finalize(c.ws, c.dbias, kDTypeOf<T>, a.n, groups, batches, stream, false);
  }
  return cudaSuccess;
}

// Dispatch over activation and dtype for one mode. The backward skips IDENTITY (no op uses it).
template <Mode M>
cudaError_t dispatch_forward(const ActLuProblem& p, cudaStream_t stream, const LaunchConfig& cfg) {
  const QCall c{p.x, nullptr, p.rows, p.hidden, p.params, &p.q, nullptr, nullptr, 0, p.dtype};
  cudaError_t err = cudaErrorInvalidValue;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    switch (p.dtype) {
      case DType::F32: err = launch_quantized<Spec, float, M, false>(c, stream, cfg); break;
      case DType::BF16:
        err = launch_quantized<Spec, __nv_bfloat16, M, false>(c, stream, cfg);
        break;
      case DType::F16: err = launch_quantized<Spec, __half, M, false>(c, stream, cfg); break;
    }
  });
  return err;
}

template <Mode M>
cudaError_t dispatch_backward(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg) {
  const QCall c{p.x,    p.dz,    p.rows,        p.hidden, p.params, &p.q,
                p.dbias != nullptr ? p.workspace : nullptr, p.dbias, p.groups, p.dtype};
  cudaError_t err = cudaErrorInvalidValue;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    if constexpr (!Spec::kGated && std::is_same_v<typename Spec::Act, act::Identity>) {
      err = cudaErrorInvalidValue;
    } else {
      switch (p.dtype) {
        case DType::F32: err = launch_quantized<Spec, float, M, true>(c, stream, cfg); break;
        case DType::BF16:
          err = launch_quantized<Spec, __nv_bfloat16, M, true>(c, stream, cfg);
          break;
        case DType::F16: err = launch_quantized<Spec, __half, M, true>(c, stream, cfg); break;
      }
    }
  });
  return err;
}

}  // namespace quant
}  // namespace te_jax::cuda
