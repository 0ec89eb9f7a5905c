// Device helpers shared by the te_jax CUDA kernels: packed 16-byte loads/stores of float32,
// bfloat16 and float16 converted to/from float32, and the amax reduction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace te_jax::cuda {

// Every kernel runs blocks of this many threads (block-level reductions assume it).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVecOf = 16 / static_cast<int>(sizeof(T));

// N consecutive elements of T, read and written as one N*sizeof(T)-byte access. Packs of 4 bytes
// or more hold raw 32-bit words (so a 16-byte pack is one LDG.E.128 / STG.E.128 into 4 registers,
// and two 16-bit values share a register); a single 16-bit element is held as itself.
template <typename T, int N, bool kWords = (N * sizeof(T) >= 4)>
struct alignas(N * sizeof(T)) Pack {
  static constexpr int kNumWords = static_cast<int>(N * sizeof(T) / 4);
  static_assert(N * sizeof(T) == 4 || N * sizeof(T) == 8 || N * sizeof(T) == 16,
                "a pack is 4, 8 or 16 bytes");
  uint32_t w[kNumWords];
};

template <typename T, int N>
struct Pack<T, N, false> {
  static_assert(N == 1, "sub-word packs hold one element");
  T v;
};

// Loads go through the read-only data path (ld.global.nc: no kernel reads what it has written;
// the unquantized dact may write dx over x, each element after the same thread has read it, and
// nothing reads it again) and stores are explicit vector stores: plain struct copies were split
// into 32-bit stores by the compiler on some paths (gated dact, dbias).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  Pack<T, N> r;
  if constexpr (N * sizeof(T) == 16) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    r.w[0] = u.x;
    r.w[1] = u.y;
    r.w[2] = u.z;
    r.w[3] = u.w;
  } else if constexpr (N * sizeof(T) == 8) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    r.w[0] = u.x;
    r.w[1] = u.y;
  } else if constexpr (N * sizeof(T) == 4) {
    r.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    r.v = __ldg(p);
  }
  return r;
}

// N elements of T at p as the raw words of a Pack<T, N>, one element per load: the first n
// loaded, the rest 0 (the bounded path beside load_pack; p aligned to T only).
template <typename T, int N>
__device__ __forceinline__ void load_words_bounded(const T* p, int n,
                                                   uint32_t (&w)[N * sizeof(T) / 4]) {
  static_assert(sizeof(T) == 4 || (sizeof(T) == 2 && N % 2 == 0), "whole words");
  if constexpr (sizeof(T) == 4) {
    const unsigned* s = reinterpret_cast<const unsigned*>(p);
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = k < n ? __ldg(s + k) : 0u;
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      const unsigned lo = 2 * k < n ? __ldg(s + 2 * k) : 0u;
      const unsigned hi = 2 * k + 1 < n ? __ldg(s + 2 * k + 1) : 0u;
      w[k] = lo | (hi << 16);
    }
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  if constexpr (N * sizeof(T) == 16) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1]),
                 "r"(v.w[2]), "r"(v.w[3])
                 : "memory");
  } else if constexpr (N * sizeof(T) == 8) {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1])
                 : "memory");
  } else if constexpr (N * sizeof(T) == 4) {
    asm volatile("st.global.b32 [%0], %1;" ::"l"(p), "r"(v.w[0]) : "memory");
  } else {
    *p = v.v;
  }
}

// Two 16-bit values packed in a word (element 2i in the low half) <-> float32.
__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
__device__ __forceinline__ float2 f16x2_to_float2(uint32_t w) {
  __half2 h;
  memcpy(&h, &w, sizeof(w));
  return __half22float2(h);
}
__device__ __forceinline__ uint32_t float2_to_bf16x2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // round to nearest even
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}
__device__ __forceinline__ uint32_t float2_to_f16x2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);  // round to nearest even
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}

template <typename T>
__device__ __forceinline__ float scalar_to_float(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    static_assert(std::is_same_v<T, __half>, "unsupported element type");
    return __half2float(v);
  }
}

template <typename T>
__device__ __forceinline__ T from_float1(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(f);
  } else {
    static_assert(std::is_same_v<T, __half>, "unsupported element type");
    return __float2half_rn(f);
  }
}

// Pack -> float32 values.
template <typename T, int N>
__device__ __forceinline__ void to_float(const Pack<T, N>& p, float (&f)[N]) {
  if constexpr (N * sizeof(T) < 4) {
    f[0] = scalar_to_float(p.v);
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = __uint_as_float(p.w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 t = std::is_same_v<T, __nv_bfloat16> ? bf16x2_to_float2(p.w[i])
                                                        : f16x2_to_float2(p.w[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
}

// float32 values -> Pack, rounded to nearest even (one rounding, docs/numerics.md). `r` receives
// the rounded values back in float32 (what amax is taken over).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> from_float(const float (&f)[N], float (&r)[N]) {
  Pack<T, N> p;
  if constexpr (N * sizeof(T) < 4) {
    p.v = from_float1<T>(f[0]);
    r[0] = scalar_to_float(p.v);
  } else if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      p.w[i] = __float_as_uint(f[i]);
      r[i] = f[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        p.w[i] = float2_to_bf16x2(f[2 * i], f[2 * i + 1]);
      } else {
        p.w[i] = float2_to_f16x2(f[2 * i], f[2 * i + 1]);
      }
    }
    to_float(p, r);
  }
  return p;
}

// amax is kept as the uint32 bits of |y|: for non-negative floats the integer order is the
// float order, and every NaN (sign cleared) compares above +inf, so an integer max gives NaN
// whenever any element is NaN. Integer max is order-independent: the result bits do not depend on
// the grid or on scheduling.
template <int N>
__device__ __forceinline__ void amax_update(unsigned& m, const float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) m = max(m, __float_as_uint(r[i]) & 0x7fffffffu);
}

// Block-wide max of `m`, then one atomicMax into *out (which the launcher zeroed on the stream).
// Every thread of the block must call it (it has a barrier).
__device__ __forceinline__ void block_amax_commit(unsigned m, unsigned* out) {
  __shared__ unsigned warp_max[kWarps];
  m = __reduce_max_sync(0xffffffffu, m);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < kWarps ? warp_max[lane] : 0u;
    m = __reduce_max_sync(0xffffffffu, m);
    if (lane == 0 && m != 0u) atomicMax(out, m);
  }
}

// cp.async: 16 bytes from global to shared memory, through L2 only; a thread's group commit, the
// wait until at most N of its groups are pending, and the wait for all of its copies.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// Host helpers.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Loads the kernel's module into the current context (what the Initialize stage is for: a lazy
// load inside graph capture, or while collectives run, is what must not happen).
template <typename K>
cudaError_t load_kernel(K* kernel) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, kernel);
}

}  // namespace te_jax::cuda
