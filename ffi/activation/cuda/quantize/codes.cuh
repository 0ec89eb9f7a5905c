// Code and store helpers shared by the emitters: FP8 codes of 8 values, the stores of a lane's
// 8 codes of one row, and two pinned instructions (prmt, an 8-byte shared load).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_utils.cuh"
#include "cuda/fp8_codes.cuh"

namespace te_jax::cuda::quant {

// 8 codes of fmt(q[k]) (fp8_pack_as: a NaN q[k] must be positive), little-endian in two words.
// Every lane of the warp must call it.
template <bool kE5m2>
__device__ __forceinline__ uint2 fp8_codes(const float (&q)[8]) {
  const Pack<uint8_t, 8> p = fp8_pack_as<kE5m2, 8>(q, 0xffffffffu);
  return make_uint2(p.w[0], p.w[1]);
}
__device__ __forceinline__ uint2 fp8_codes(bool e5m2, const float (&q)[8]) {
  return e5m2 ? fp8_codes<true>(q) : fp8_codes<false>(q);
}

// The FP8 format of a block of code: fixed at compile time, or args.e5m2's, per value.
enum class Fp8Format { kE4M3, kE5M2, kRuntime };

// 8 codes of fmt(v[k] * s).
template <Fp8Format kFmt, typename V>
__device__ __forceinline__ uint2 tensor_codes(const V& v, float s, bool e5m2) {
  float q[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) q[k] = __fmul_rn(v[k], s);
  if constexpr (kFmt == Fp8Format::kRuntime) {
    return fp8_codes(e5m2, q);
  } else {
    return fp8_codes<kFmt == Fp8Format::kE5M2>(q);
  }
}

// The byte permute prmt.b32 (sel's 4-bit selectors may replicate a byte's sign).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
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

// An 8-byte shared-memory load that the compiler keeps where it is written (volatile asm): left
// free, it hoisted all of a lane's per-column factors at once and spilled.
__device__ __forceinline__ float2 lds_f2(const float2* p) {
  float2 r;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
               : "=f"(r.x), "=f"(r.y)
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
  return r;
}

}  // namespace te_jax::cuda::quant
