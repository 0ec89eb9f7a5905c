// FP8 codes of N float32 values, packed little-endian in N bytes: the bits of formats.h's
// fmt::to_e4m3 / to_e5m2 (saturating round-to-nearest-even, NaN keeps its sign). Shared by the
// elementwise kernel (tensor-scaled rowwise output) and the tiled kernel of quantize.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats.h"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda {

// Whether this compilation pass has the FP8 conversion instructions (sm_89+).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
inline constexpr bool kHardwareFp8 = true;
#else
inline constexpr bool kHardwareFp8 = false;
#endif

// Four FP8 codes of a..d (a in the low byte) by two hardware conversions and one pack (sm_89+).
// The hardware's NaN is 0x7f in both formats.
template <bool kE5m2>
__device__ __forceinline__ uint32_t hw_fp8x4(float a, float b, float c, float d) {
  uint32_t w;
  if constexpr (kE5m2) {
    asm("{.reg .b16 lo, hi;\n\tcvt.rn.satfinite.e5m2x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e5m2x2.f32 hi, %4, %3;\n\tmov.b32 %0, {lo, hi};}"
        : "=r"(w) : "f"(a), "f"(b), "f"(c), "f"(d));
  } else {
    asm("{.reg .b16 lo, hi;\n\tcvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\tmov.b32 %0, {lo, hi};}"
        : "=r"(w) : "f"(a), "f"(b), "f"(c), "f"(d));
  }
  return w;
}

// The codes of q in the format kE5m2 chooses. A NaN among the q[k] must be positive (every
// caller's q are products, and the GPU's float32 arithmetic makes only the positive quiet NaN;
// MXFP8's NaN factor is a block's amax, a magnitude): its E4M3 code is then formats.h's 0x7f, the
// hardware's, so E4M3 needs no NaN patch.
// E5M2's NaN is 0x7e | sign (formats.h), not the hardware's 0x7f: the lanes of `mask` take
// formats.h's functions only when one of them holds a NaN, a warp-uniform branch, so the common
// case pays one cvt per pair. Every lane of `mask` must call it (pass __activemask() in code that
// may diverge: the vote then covers the lanes present, which is all it needs).
template <bool kE5m2, int N>
__device__ __forceinline__ Pack<uint8_t, N> fp8_pack_as(const float (&q)[N], unsigned mask) {
  Pack<uint8_t, N> p;
  if constexpr (N == 1) {
    p.v = kE5m2 ? fmt::to_e5m2(q[0]) : fmt::to_e4m3(q[0]);
  } else {
    static_assert(N % 4 == 0, "word packs of FP8 codes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    bool nan = false;
    if constexpr (kE5m2) {
#pragma unroll
      for (int k = 0; k < N; ++k) nan |= q[k] != q[k];
    }
    if (!kE5m2 || !__any_sync(mask, nan)) {
#pragma unroll
      for (int j = 0; j < N / 4; ++j) {
        p.w[j] = hw_fp8x4<kE5m2>(q[4 * j], q[4 * j + 1], q[4 * j + 2], q[4 * j + 3]);
      }
      return p;
    }
#endif
    if constexpr (kE5m2 || !kHardwareFp8) {
#pragma unroll
      for (int j = 0; j < N / 4; ++j) {
        uint32_t c[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float x = q[4 * j + 2 * h], y = q[4 * j + 2 * h + 1];
          c[h] = kE5m2 ? fmt::to_e5m2x2(x, y) : fmt::to_e4m3x2(x, y);
        }
        p.w[j] = c[0] | (c[1] << 16);
      }
    }
  }
  return p;
}

// fp8_pack_as for a format chosen at run time.
template <int N>
__device__ __forceinline__ Pack<uint8_t, N> fp8_pack(bool e5m2, const float (&q)[N],
                                                     unsigned mask) {
  return e5m2 ? fp8_pack_as<true, N>(q, mask) : fp8_pack_as<false, N>(q, mask);
}

}  // namespace te_jax::cuda
