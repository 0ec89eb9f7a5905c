// Building blocks of the CPU loops, shared by kernels.cc (NO_SCALING) and quantized.cc:
// the storage types (float32 <-> bfloat16 / float16, branch-free), the multiversioning attribute
// TE_JAX_LOOP, and the loops computing unrounded float32 results of gathered elements.
#pragma once

#include <algorithm>
#include <cstdint>

#include "activation/activations.h"
#include "common/formats.h"
#include "common/host_math.h"
#include "common/macros.h"
#include "cpu/parallel.h"

// Attributes of the hot loops. With GCC >= 11 on ELF x86-64 they are compiled for x86-64-v4
// (AVX-512), v3 (AVX2 + FMA) and the baseline, dispatched once at load time through an ifunc
// (wheels are built for the baseline). Elsewhere the loops are compiled once, with the target's
// default flags. A build may define TE_JAX_LOOP itself (e.g. empty, to test one ISA level chosen
// with -march). The CPU extension is compiled with -fno-trapping-math (CMakeLists.txt): without
// it GCC will not if-convert a ?: whose arm computes (`x > 0 ? x * x : 0` in activations.h), and
// those loops stay scalar below AVX-512. Results are unchanged; nothing observes FP exceptions.
#if defined(TE_JAX_LOOP)
#elif defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && \
    defined(__ELF__)
#define TE_JAX_LOOP \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TE_JAX_LOOP
#endif

// Internal linkage (each including file gets its own copies): the multiversioned (ifunc) loops
// must not be shared across translation units.
namespace te_jax::cpu {
namespace {
namespace loops {

namespace hb = ::te_jax::math::host::bits;

// ---- storage types -------------------------------------------------------------------------
// load: storage -> float32; store: float32 -> storage, rounding to nearest even, NaN kept NaN.
// All selects are branch-free (hb::select; see host_math.h for why).
// abs_key: a non-negative int32 that orders |v| like the values do, with every NaN above +inf,
// so an integer max over keys is max|v| with NaN propagation (and is associative: deterministic).

struct F32 {
  using T = float;
  TE_HD static float load(float v) { return v; }
  TE_HD static float store(float f) { return f; }
  TE_HD static int32_t abs_key(float v) { return static_cast<int32_t>(hb::of(v) & 0x7fffffffu); }
  static float key_value(int32_t k) { return hb::to_float(static_cast<uint32_t>(k)); }
};

struct BF16 {
  using T = uint16_t;
  TE_HD static float load(uint16_t v) { return fmt::from_bf16(v); }
  TE_HD static uint16_t store(float f) {
    const uint32_t u = hb::of(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // RNE; overflow -> inf
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return static_cast<uint16_t>(hb::select((u & 0x7fffffffu) > 0x7f800000u, quiet_nan, rounded));
  }
  TE_HD static int32_t abs_key(uint16_t v) { return static_cast<int32_t>(v & 0x7fffu); }
  static float key_value(int32_t k) { return load(static_cast<uint16_t>(k)); }
};

struct F16 {
  using T = uint16_t;
  TE_HD static float load(uint16_t v) { return fmt::from_f16(v); }
  TE_HD static uint16_t store(float f) {
    const uint32_t u = hb::of(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    // Normal range: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest
    // even; >= 65520 rounds to (or past) 0x7c00 and saturates there, i.e. +-inf.
    uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    normal = std::min(normal, 0x7c00u);
    // |f| < 2^-14: adding 0.5 makes the FPU round |f| to a multiple of 2^-24 (the f16 subnormal
    // step), ties to even; the low bits of the sum are then the f16 bits (0x400 = 2^-14 included).
    const uint32_t subnormal = hb::of(hb::to_float(a) + 0.5f) - 0x3f000000u;
    const uint32_t quiet_nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    const uint32_t r =
        hb::select(a > 0x7f800000u, quiet_nan, hb::select(a < 0x38800000u, subnormal, normal));
    return static_cast<uint16_t>(r | sign);
  }
  TE_HD static int32_t abs_key(uint16_t v) { return static_cast<int32_t>(v & 0x7fffu); }
  static float key_value(int32_t k) { return load(static_cast<uint16_t>(k)); }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }

// ---- vector blocks ---------------------------------------------------------------------
// Hot loops run on multiples of kVec elements, in blocks of exactly kVec, so every element is
// computed by the same vector code (see kernels.cc).

// Elements per vector-code block: a multiple of every vectorisation factor the compiler may pick.
constexpr int64_t kVec = 64;

inline int64_t round_up_vec(int64_t n) { return round_up(n, kVec); }

// Points at n contiguous inputs, or copies them zero-padded to a whole number of vector blocks
// (padded_n elements) into buf, which has room for padded_n floats.
template <typename T>
const T* padded(const T* src, int64_t n, int64_t padded_n, float* buf) {
  if (n == padded_n) return src;
  T* dst = reinterpret_cast<T*>(buf);
  std::copy(src, src + n, dst);
  std::fill(dst + n, dst + padded_n, T{});
  return dst;
}

// v = float(round_to_D(v)) for n values: what the NO_SCALING path would output.
template <typename D>
TE_JAX_LOOP void round_to_storage(float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = D::load(D::store(v[i]));
}

// The max |v| key (F32::abs_key) of n values.
[[maybe_unused]] TE_JAX_LOOP int32_t max_abs_key(const float* __restrict v, int64_t n) {
  int32_t key = 0;
  for (int64_t i = 0; i < n; ++i) key = std::max(key, F32::abs_key(v[i]));
  return key;
}

// Unrounded float32 results of n gathered elements (n % kVec == 0); b is unused when not gated.
template <typename Spec, typename D>
TE_JAX_LOOP void fwd_raw(const typename D::T* __restrict a,
                         const typename D::T* __restrict b, float* __restrict f,
                         int64_t n, ActParams p) {
  for (int64_t i0 = 0; i0 < n; i0 += kVec) {
    for (int64_t i = i0; i < i0 + kVec; ++i) {
      f[i] = act_forward<Spec>(D::load(a[i]), Spec::kGated ? D::load(b[i]) : 0.0f, p);
    }
  }
}

template <typename Spec, typename D>
TE_JAX_LOOP void bwd_raw(const typename D::T* __restrict g,
                         const typename D::T* __restrict a,
                         const typename D::T* __restrict b, float* __restrict da,
                         float* __restrict db, int64_t n, ActParams p) {
  for (int64_t i0 = 0; i0 < n; i0 += kVec) {
    for (int64_t i = i0; i < i0 + kVec; ++i) {
      float fa, fb;
      act_backward<Spec>(D::load(g[i]), D::load(a[i]), Spec::kGated ? D::load(b[i]) : 0.0f, p,
                         fa, fb);
      da[i] = fa;
      db[i] = fb;
    }
  }
}
// dbias[n] = sum over g = 0..groups-1, in order, of ws[g * stride + n], for n in [n0, n1).
template <typename D>
TE_JAX_LOOP void reduce_groups(const float* __restrict ws, typename D::T* __restrict dbias,
                               int64_t groups, int64_t stride, int64_t n0, int64_t n1) {
  constexpr int64_t kBlock = 512;
  float acc[kBlock];
  for (int64_t s = n0; s < n1; s += kBlock) {
    const int64_t len = std::min(kBlock, n1 - s);
    for (int64_t i = 0; i < len; ++i) acc[i] = ws[s + i];
    for (int64_t g = 1; g < groups; ++g) {
      const float* __restrict row = ws + g * stride + s;
      for (int64_t i = 0; i < len; ++i) acc[i] += row[i];
    }
    for (int64_t i = 0; i < len; ++i) dbias[s + i] = D::store(acc[i]);
  }
}

// dbias[b, :] = sum over g in order of ws[b, g, :] for every batch b, split over
// (batch, column block) on the pool when the work is large enough to pay for it.
template <typename D>
void sum_groups(const float* ws, typename D::T* dbias, int64_t batches, int64_t groups, int64_t n,
                ::xla::ffi::ThreadPool* pool) {
  const int64_t want = 2 * num_workers(pool);
  const int64_t red_cols = std::max<int64_t>(4096, round_up(ceil_div(n, want), kVec));
  const int64_t red_blocks = ceil_div(n, red_cols);
  const bool parallel_reduce = batches * groups * n >= 4 * 32 * 1024;
  parallel_chunks(parallel_reduce ? pool : nullptr, batches * red_blocks, [&](int64_t t) {
    const int64_t b = t / red_blocks, blk = t % red_blocks;
    const int64_t n0 = blk * red_cols, n1 = std::min(n, n0 + red_cols);
    reduce_groups<D>(ws + b * groups * n, dbias + b * n, groups, n, n0, n1);
  });
}

}  // namespace loops
}  // namespace
}  // namespace te_jax::cpu
