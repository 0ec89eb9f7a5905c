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

// 1 / (1 + exp(-x)); exp overflow (x << 0) gives exactly 0. On the device __frcp_rn is the
// correctly rounded reciprocal: the same bits as the IEEE division, without its slow path.
TE_HD float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(1.0f + exp(-x));
#else
  return 1.0f / (1.0f + exp(-x));
#endif
}

}  // namespace te_jax::math
