// MXFP8 block scaling: the E8M0 scale of a block and its factor 2^k.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/formats.h"

namespace te_jax::cuda::quant {

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

}  // namespace te_jax::cuda::quant
