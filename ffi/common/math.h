// Transcendental functions used by activations.h, for host and device.
//
// Device code uses the hardware exp2 approximation (erf, sigmoid, exp below), with errors far
// inside docs/numerics.md §7 and measured by ffi/cuda/tests/kernel_test. Host code uses the
// definitions in host_math.h, written so that loops over contiguous float arrays vectorise (no calls into libm,
// no data-dependent branches).
#pragma once

#include "common/macros.h"

#if !defined(__CUDA_ARCH__)
#include "common/host_math.h"
#endif

namespace te_jax::math {

// e^x. On the device __expf (ex2.approx of x * log2(e)): relative error 2 ulps plus |x| * 2^-24
// from rounding the product; only GELU-erf's derivative uses it, as e^(-x^2/2) times x / sqrt(2pi)
// (largest near |x| = 1, where that is ~3 ulps of 0.24).
TE_HD float exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return host::exp(x);
#endif
}

// erf(x). On the device, branch-free: sign(x) * (1 - 2^(t * Q(t))) with t = min(|x|, 3.9375) and
// t * Q(t) a degree-8 fit of log2(erfc(t)) (tools/fit_host_math.py, which also evaluates this
// float32 form against double erf: max absolute error 9.2e-8 over every 61st float32 in
// [0, 4.5]); exp2f adds at most 2 ulps of 2^(t * Q(t)) <= 1, and kernel_test measures the whole
// on the device against double. erf(0) is exactly 0 (the fit has no constant term),
// erf(+-inf) = +-1, erf(NaN) = NaN. CUDA's erff (1 ulp) selected its 7 coefficients per value
// between two ranges and branched to exp2 for |x| >= 1, which diverged in most warps and left the
// exact GeGLU forward behind XLA's own fusion (activation/cuda/NOTES.md, "Device math").
// Only GELU-erf uses it, as 0.5 * (1 + erf(x / sqrt 2)), where docs/numerics.md §7 allows 2e-5.
TE_HD float erf(float x) {
#if defined(__CUDA_ARCH__)
  // Q0..Q7, as tools/fit_host_math.py prints them (kErfDevice).
  constexpr float kQ[] = {-1.627908587e+00f, -9.184164405e-01f, -1.484814733e-01f,
                          2.825345844e-02f,  -7.744075847e-04f, -1.489588991e-03f,
                          4.455641902e-04f,  -4.536761116e-05f};
  const float t = fminf(fabsf(x), 3.9375f);
  float q = kQ[7];
#pragma unroll
  for (int k = 6; k >= 0; --k) q = __fmaf_rn(q, t, kQ[k]);
  const float r = copysignf(1.0f - exp2f(__fmul_rn(q, t)), x);
  return x != x ? x : r;
#else
  return host::erf(x);
#endif
}

// 1 / (1 + exp(-x)); exp overflow (x << 0) gives exactly 0.
// On the device both steps are the hardware approximations: e^-x as ex2.approx.ftz of
// x * -log2(e) (__expf's product) and __fdividef (rcp.approx, then a multiply). ftz flushes a
// subnormal 2^t (t < -126) to 0, which cannot change 1 + e, and saves __expf's range fix-up for
// such t (a compare and two predicated multiplies per value). The relative error is a few float32 ulps plus
// about 2|x| ulps from rounding x * log2(e) (kernel_test measures it against float64 over the
// whole range), far inside docs/numerics.md §7's 1e-5. The correctly rounded pair
// (expf, __frcp_rn) makes the GELU-based kernels instruction-bound rather than memory-bound
// (activation/cuda/NOTES.md, "Device math").
TE_HD float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(x, -1.4426950408889634f)));
  return __fdividef(1.0f, 1.0f + e);
#else
  return 1.0f / (1.0f + exp(-x));
#endif
}

}  // namespace te_jax::math
