// Transcendental functions used by activations.h, for host and device.
//
// Device code uses CUDA's full-precision expf/erff. Host code uses the definitions in
// host_math.h, written so that loops over contiguous float arrays vectorise (no calls into libm,
// no data-dependent branches).
#pragma once

#include "common/macros.h"

#if !defined(__CUDA_ARCH__)
#include "common/host_math.h"
#endif

namespace te_jax::math {

TE_HD float exp(float x) {
#if defined(__CUDA_ARCH__)
  return ::expf(x);
#else
  return host::exp(x);
#endif
}

TE_HD float erf(float x) {
#if defined(__CUDA_ARCH__)
  return ::erff(x);
#else
  return host::erf(x);
#endif
}

// 1 / (1 + exp(-x)); exp overflow (x << 0) gives exactly 0.
// On the device both steps are the hardware approximations: __expf (ex2.approx of x * log2(e))
// and __fdividef (rcp.approx, then a multiply). The relative error is a few float32 ulps plus
// about 2|x| ulps from rounding x * log2(e) (kernel_test measures it against float64 over the
// whole range), far inside SPEC.md §7's 1e-5. The correctly rounded pair (expf, __frcp_rn) was
// measured on the H100 to make GELU-based kernels instruction-bound: act_lu GELU + delayed FP8
// reached 0.69 of copy bandwidth with it and 0.94 with this (docs/performance.md).
TE_HD float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.0f, 1.0f + __expf(-x));
#else
  return 1.0f / (1.0f + exp(-x));
#endif
}

}  // namespace te_jax::math
