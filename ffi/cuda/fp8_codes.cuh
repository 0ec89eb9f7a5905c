// FP8 codes of N float32 values, packed little-endian in N bytes: the bits of formats.h's
// fmt::to_e4m3 / to_e5m2 (saturating round-to-nearest-even, NaN keeps its sign). Shared by the
// elementwise kernel (tensor-scaled rowwise output) and the tiled kernel of quantize.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats.h"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda {

// formats.h's to_e4m3x2 patches the NaN code of every element after the hardware conversion (a
// compare and a select each). Here the hardware conversion runs alone and the lanes of `mask`
// take formats.h's functions only when one of them holds a NaN: a warp-uniform branch, so the
// common case pays one cvt per pair. Every lane of `mask` must call it (pass __activemask() in
// code that may diverge: the vote then covers the lanes present, which is all it needs).
template <int N>
__device__ __forceinline__ Pack<uint8_t, N> fp8_pack(bool e5m2, const float (&q)[N],
                                                     unsigned mask) {
  Pack<uint8_t, N> p;
  if constexpr (N == 1) {
    p.v = e5m2 ? fmt::to_e5m2(q[0]) : fmt::to_e4m3(q[0]);
  } else {
    static_assert(N % 4 == 0, "word packs of FP8 codes");
    uint32_t c[N / 2];
    bool nan = false;
#pragma unroll
    for (int k = 0; k < N; ++k) nan |= q[k] != q[k];
    if (__any_sync(mask, nan)) {
#pragma unroll
      for (int k = 0; k < N / 2; ++k) {
        c[k] = e5m2 ? fmt::to_e5m2x2(q[2 * k], q[2 * k + 1])
                    : fmt::to_e4m3x2(q[2 * k], q[2 * k + 1]);
      }
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
      const __nv_fp8_interpretation_t f = e5m2 ? __NV_E5M2 : __NV_E4M3;
#pragma unroll
      for (int k = 0; k < N / 2; ++k) {
        c[k] = __nv_cvt_float2_to_fp8x2(make_float2(q[2 * k], q[2 * k + 1]), __NV_SATFINITE, f);
      }
#else
#pragma unroll
      for (int k = 0; k < N / 2; ++k) {
        c[k] = e5m2 ? fmt::to_e5m2x2(q[2 * k], q[2 * k + 1])
                    : fmt::to_e4m3x2(q[2 * k], q[2 * k + 1]);
      }
#endif
    }
#pragma unroll
    for (int j = 0; j < N / 4; ++j) p.w[j] = c[2 * j] | (c[2 * j + 1] << 16);
  }
  return p;
}

}  // namespace te_jax::cuda
