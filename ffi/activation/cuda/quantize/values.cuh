// A row's 8 values of one column lane: the raw loaded words (RawWords8, load8, to_float8) and
// y rounded to x's dtype (Values8), with the max keys of |y| that the amax and the block scales
// take.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/device_utils.cuh"

namespace te_jax::cuda::quant {

// 8 consecutive elements of T as raw 32-bit words.
template <typename T>
struct RawWords8 {
  static constexpr int kWords = 2 * static_cast<int>(sizeof(T));
  uint32_t w[kWords];
};

// Loads 8 elements at p, of which the first n_ok are valid (the rest read as 0). On the vector
// path n_ok is 0 or 8 and p is 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load8(const T* p, bool vec, int n_ok, RawWords8<T>& r) {
  if (vec) {
    if (n_ok > 0) {
      const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
      for (int j = 0; j < RawWords8<T>::kWords / 4; ++j) {
        const uint4 u = __ldg(q + j);
        r.w[4 * j] = u.x;
        r.w[4 * j + 1] = u.y;
        r.w[4 * j + 2] = u.z;
        r.w[4 * j + 3] = u.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < RawWords8<T>::kWords; ++j) r.w[j] = 0u;
    }
  } else {
    load_words_bounded<T, 8>(p, n_ok, r.w);
  }
}

template <typename T>
__device__ __forceinline__ void to_float8(const RawWords8<T>& r, float (&f)[8]) {
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

// 8 values of y rounded to T, 0 where invalid; y[k] reads one as float32. 16-bit dtypes hold them
// packed two per register (they are exact in T), which halves the registers of a tile.
template <typename T>
struct Values8 {
  // Max keys: |y| bits compared as integers. 16-bit values are compared two at a time, as the
  // packed halves of key_word = w * 2: the magnitudes doubled (the order of |y| in the 16-bit
  // formats, NaN above inf, as in float32). The high half's sign leaves the word; the low half's
  // lands in the high half's lowest bit, which can only order equal magnitudes, and which the
  // keys shift out: the larger of 2a + g and 2b + g' (g, g' < 2) is, halved, max(a, b). The
  // doubling is a multiply, on the FMA pipe, where the mask & 0x7fff7fff was a logic operation on
  // the ALU pipe, the one that bounds the NVFP4 kernels (NOTES.md, "The ALU pipe").
  // to_key turns such a packed max into the float32 key of the larger half; key_lo / key_hi of
  // one half.
  static constexpr int kWords = 4;
  __device__ __forceinline__ uint32_t key_word(int j) const { return w[j] * 2u; }
  static __device__ __forceinline__ uint32_t key_max(uint32_t a, uint32_t b) {
    return __vmaxu2(a, b);
  }
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
struct Values8<float> {
  static constexpr int kWords = 8;
  __device__ __forceinline__ uint32_t key_word(int j) const {
    return __float_as_uint(f[j]) & 0x7fffffffu;
  }
  static __device__ __forceinline__ uint32_t key_max(uint32_t a, uint32_t b) { return max(a, b); }
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

// The packed max of |v| over the 8 values (Values8::to_key gives the float32 key).
template <typename T>
__device__ __forceinline__ uint32_t packed_max8(const Values8<T>& v) {
  uint32_t m = v.key_word(0);
#pragma unroll
  for (int j = 1; j < Values8<T>::kWords; ++j) m = Values8<T>::key_max(m, v.key_word(j));
  return m;
}

}  // namespace te_jax::cuda::quant
