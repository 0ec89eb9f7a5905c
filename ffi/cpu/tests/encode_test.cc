// Checks ffi/activation/cpu/encode.h (the CPU loops' float32 -> FP8 / FP4 encoders) against
// common/formats.h, bit for bit, with the FPU in IEEE mode and with FTZ + DAZ set (as XLA's CPU
// threads run; x86 only):
//   encode   enc::encode_scaled<Fmt>(v, s = 1) and enc::Codes<Fmt>::of(v) against fmt::to_e4m3 /
//            to_e5m2 / to_e2m1 (a NaN v: the scaled encode gives the positive NaN's code, a
//            product's NaN being canonical) for every one of the 2^32 float32 bit patterns with
//            --full; by default for encode_input's structured subset: every sign, exponent and
//            top 12 significand bits with the low 11 bits at and next to 0 and 2^10 (so every
//            code, every rounding tie and the float32 neighbours of both, float32 subnormals,
//            inf and NaN payloads), every 1021st bit pattern and 2^22 pseudo-random ones;
//   tensor   encode_scaled<Fmt>(v, s) against Fmt::encode(fmt::mul_exact(v, s)) for ~40 scales s
//            (both paths: plain_tensor_scale true and false); v: every 30011th bit pattern, every
//            211th float32 subnormal (both signs, zeros included), and the values at and next to
//            every E4M3 code, scaled by 2^k for k = -130, -120, ..., 130;
//   mxfp8    Codes<Fmt>::of(v * pow2_neg(e)) against Fmt::encode(fmt::mul_pow2(v, -e)) for every
//            e where mxfp8_plain_exponent(e) holds (those v near the ends of that range and around
//            e = 0; elsewhere every 99991st pattern and every 2003rd subnormal, and the codes);
//   nvfp4    e2m1(v * s / bs) against to_e2m1(fmt::mul_exact(v, s) / bs) for three plain scales
//            s and every positive finite E4M3 block scale bs (the smaller set of v); and the
//            block scales nvfp4_block_scale<true>(amax, s) against formats.h's exact steps for
//            every 1031st non-negative amax pattern, every 31st one below 6 * 2^-126, and those
//            that land on and next to E4M3 codes and midpoints;
//   div      formats.h's div_by_e4m3, the CUDA NVFP4 kernels' division by the block scale,
//            against a / b (check_div_by_e4m3);
//   compare  formats.h's NVFP4 thresholds (the CUDA kernels' 16-bit inputs: codes by integer
//            comparisons) against the division (check_nvfp4_compare).
// The sampled checks are there for the one-multiply shortcuts (plain_tensor_scale,
// mxfp8_plain_exponent), whose arguments are about magnitudes, not about individual bit patterns.
// The encoders round at significand bit 19 or above (E4M3's round bit; higher for E5M2, E2M1 and
// the formats' subnormals), all of whose ties and neighbours the default subset holds; --full
// (about 25 s more on 2 idle cores) checks them on every input.
// Built and run by tests/test_cpu_encode.py with the extension's flags (-O3 -fno-trapping-math),
// from the repository root:
//   c++ -std=c++17 -O3 -fno-trapping-math -pthread -I ffi -isystem <jaxlib>/include
//       ffi/cpu/tests/encode_test.cc -o encode_test && ./encode_test [--threads N] [--full]
// Prints one line per check; exit status 1 on any mismatch (the first few are printed).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "activation/cpu/encode.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define TE_JAX_HAVE_MXCSR 1
#endif

namespace {

using namespace te_jax;
using namespace te_jax::cpu;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The FPU mode of the calling thread: IEEE, or flush-to-zero + denormals-are-zero.
void set_ftz_daz(bool on) {
#if defined(TE_JAX_HAVE_MXCSR)
  const unsigned kFtzDaz = 0x8040;
  _mm_setcsr(on ? (_mm_getcsr() | kFtzDaz) : (_mm_getcsr() & ~kFtzDaz));
#else
  (void)on;
#endif
}

// The encoder under test in a plain vectorisable loop (encode_scaled multiplies first).
template <typename Fmt>
TE_JAX_LOOP void codes_loop(const float* __restrict v, uint8_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(enc::Codes<Fmt>::of(v[i]));
}

// The reference, formats.h's encoder, in the same kind of loop (only to make the test faster).
template <typename Fmt>
TE_JAX_LOOP void reference_loop(const float* __restrict v, uint8_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = Fmt::encode(v[i]);
}

// v[i] = the float with bits first + i.
TE_JAX_LOOP void patterns(float* __restrict v, int64_t n, uint64_t first) {
  for (int64_t i = 0; i < n; ++i) v[i] = float_of(static_cast<uint32_t>(first + i));
}

// What the MXFP8 loops compute for a block with a plain exponent e.
template <typename Fmt>
TE_JAX_LOOP void pow2_loop(const float* __restrict v, uint8_t* __restrict out, int64_t n, int e) {
  const float m = enc::pow2_neg(e);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(enc::Codes<Fmt>::of(v[i] * m));
}

// What the NVFP4 loops compute with a plain tensor scale.
TE_JAX_LOOP void nvfp4_loop(const float* __restrict v, uint8_t* __restrict out, int64_t n, float s,
                            float bs) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(enc::e2m1(v[i] * s / bs));
}

// Seconds since the previous call (for the report lines).
double lap() {
  static auto last = std::chrono::steady_clock::now();
  const auto now = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(now - last).count();
  last = now;
  return s;
}

// NVFP4 block scales with a plain tensor scale, as the NVFP4 loops compute them.
TE_JAX_LOOP void block_scale_loop(const float* __restrict amax, uint8_t* __restrict out, int64_t n,
                                  float s) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<uint8_t>(enc::nvfp4_block_scale<true>(amax[i], s));
  }
}

// Mismatch reporting, shared by the threads.
struct Report {
  std::atomic<uint64_t> mismatches{0};
  std::atomic<int> printed{0};
  void add(const char* what, const std::string& ctx, uint32_t v_bits, int want, int got) {
    ++mismatches;
    if (printed.fetch_add(1) < 10) {
      std::printf("  MISMATCH %s %s v=0x%08x (%.9g): want 0x%02x got 0x%02x\n", what, ctx.c_str(),
                  v_bits, static_cast<double>(float_of(v_bits)), want, got);
    }
  }
};

// Runs body(begin, end) over [0, total) split among `threads` threads, each in the FPU mode.
template <typename Body>
void run_split(uint64_t total, int threads, bool ftz, const Body& body) {
  std::vector<std::thread> pool;
  const uint64_t per = (total + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const uint64_t b = std::min(total, t * per), e = std::min(total, b + per);
    pool.emplace_back([&body, b, e, ftz] {
      set_ftz_daz(ftz);
      body(b, e);
    });
  }
  for (auto& th : pool) th.join();
}

constexpr int64_t kChunk = 1 << 16;

// The encode check's default inputs (see the header), kEncodeInputs of them: input k is
// bit pattern encode_input(k). First every sign, exponent and top 12 significand bits (bits 11-22)
// with the low 11 bits 0, 1, 2, 0x3ff, 0x400, 0x401, 0x7fe, 0x7ff; then every 1021st bit pattern;
// then 2^22 pseudo-random ones (splitmix64 of k).
constexpr uint64_t kEncodeHeads = uint64_t{1} << 24, kEncodeStride = 1021;
constexpr uint64_t kEncodeStrided = ((uint64_t{1} << 32) + kEncodeStride - 1) / kEncodeStride;
constexpr uint64_t kEncodeInputs = kEncodeHeads + kEncodeStrided + (uint64_t{1} << 22);

uint32_t encode_input(uint64_t k) {
  static constexpr uint32_t kTails[] = {0u, 1u, 2u, 0x3ffu, 0x400u, 0x401u, 0x7feu, 0x7ffu};
  if (k < kEncodeHeads) return static_cast<uint32_t>(k >> 3) << 11 | kTails[k & 7];
  k -= kEncodeHeads;
  if (k < kEncodeStrided) return static_cast<uint32_t>(k * kEncodeStride);
  uint64_t z = (k + 1) * 0x9e3779b97f4a7c15u;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

// The default inputs (all 2^32 bit patterns with `full`) through both encoders, against
// Fmt::encode.
template <typename Fmt>
void check_encode(const char* name, bool full, int threads, bool ftz, Report& rep) {
  const uint64_t count = full ? uint64_t{1} << 32 : kEncodeInputs;
  run_split(count, threads, ftz, [&](uint64_t begin, uint64_t end) {
    std::vector<float> v(kChunk);
    std::vector<uint8_t> want(kChunk), got_scaled(kChunk), got_plain(kChunk);
    for (uint64_t c0 = begin; c0 < end; c0 += kChunk) {
      const int64_t n = static_cast<int64_t>(std::min<uint64_t>(kChunk, end - c0));
      if (full) {
        patterns(v.data(), n, c0);
      } else {
        for (int64_t i = 0; i < n; ++i) v[i] = float_of(encode_input(c0 + i));
      }
      reference_loop<Fmt>(v.data(), want.data(), n);
      enc::encode_scaled<Fmt>(v.data(), got_scaled.data(), n, 1.0f);
      codes_loop<Fmt>(v.data(), got_plain.data(), n);
      if (std::memcmp(got_scaled.data(), want.data(), n) != 0 ||
          std::memcmp(got_plain.data(), want.data(), n) != 0) {
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t u = bits_of(v[i]);
          // A scaled encode's NaN is the product's, the positive NaN (fmt::canonical_nan).
          const uint8_t want_scaled =
              std::isnan(v[i]) ? static_cast<uint8_t>(Fmt::encode(fmt::canonical_nan(v[i])))
                               : want[i];
          if (got_scaled[i] != want_scaled) {
            rep.add(name, "encode_scaled", u, want_scaled, got_scaled[i]);
          }
          if (got_plain[i] != want[i]) rep.add(name, "Codes::of", u, want[i], got_plain[i]);
        }
      }
    }
  });
}

// The inputs of the scaled checks: every `stride`th bit pattern, every `sub_stride`th subnormal
// (both signs, zeros included: where the plain products differ from the exact ones), and special
// values.
std::vector<float> scaled_inputs(uint64_t stride, uint32_t sub_stride) {
  std::vector<float> v;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += stride) {
    v.push_back(float_of(static_cast<uint32_t>(u)));
  }
  for (uint32_t m = 0; m < 0x800000u; m += sub_stride) {
    v.push_back(float_of(m));
    v.push_back(float_of(m | 0x80000000u));
  }
  v.push_back(float_of(0x007fffffu));  // the largest subnormals
  v.push_back(float_of(0x807fffffu));
  const uint32_t special[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u,
                              0xff800001u, 0x7fffffffu, 0x00800000u, 0x80800000u, 0x7f7fffffu,
                              0xff7fffffu, 0x3f800000u, 0xbf800000u};
  for (uint32_t u : special) v.push_back(float_of(u));
  // Every code's value and the float32 neighbours of every midpoint between codes, scaled by 2^k.
  for (int k = -130; k <= 130; k += 10) {
    for (uint32_t c = 0; c < 256; ++c) {
      const float f = fmt::from_e4m3(static_cast<uint8_t>(c)) * std::ldexp(1.0f, k);
      for (int d = -2; d <= 2; ++d) v.push_back(float_of(bits_of(f) + d));
    }
  }
  return v;
}

// Tensor scales: both sides of the plain / exact boundary and the special values.
std::vector<float> tensor_scales() {
  std::vector<float> s = {1.0f, 3.0f, 0.37f, 448.0f / 0.37f, 57344.0f / 3.1f, 1e-3f, 1e10f, 1e-30f,
                          0x1p100f, 0x1p101f, 0x1p127f, 0x1.fffffep127f, 0x1p-126f, 0x1p-120f,
                          0x1p-149f, 1e-40f, 0.0f, -0.0f, -3.5f, -0x1p100f, -0x1p110f};
  const float p100 = 0x1p100f;
  s.push_back(float_of(bits_of(p100) - 1));  // just below 2^100 (plain)
  s.push_back(float_of(bits_of(p100) + 1));  // just above (exact)
  s.push_back(float_of(0x7f800000u));        // inf
  s.push_back(float_of(0xff800000u));
  s.push_back(float_of(0x7fc00000u));  // NaN
  s.push_back(float_of(0xffc00001u));
  for (int k = -20; k <= 20; k += 4) s.push_back(1.7f * std::ldexp(1.0f, k));
  return s;
}

template <typename Fmt>
void check_tensor(const char* name, const std::vector<float>& v, int threads, bool ftz,
                  Report& rep) {
  for (float s : tensor_scales()) {
    run_split(v.size(), threads, ftz, [&](uint64_t begin, uint64_t end) {
      std::vector<uint8_t> got(kChunk);
      for (uint64_t c0 = begin; c0 < end; c0 += kChunk) {
        const int64_t n = static_cast<int64_t>(std::min<uint64_t>(kChunk, end - c0));
        enc::encode_scaled<Fmt>(v.data() + c0, got.data(), n, s);
        for (int64_t i = 0; i < n; ++i) {
          const uint8_t want = Fmt::encode(fmt::mul_exact(v[c0 + i], s));
          if (got[i] != want) {
            char ctx[64];
            std::snprintf(ctx, sizeof ctx, "tensor s=0x%08x", bits_of(s));
            rep.add(name, ctx, bits_of(v[c0 + i]), want, got[i]);
          }
        }
      }
    });
  }
}

template <typename Fmt>
void check_mxfp8(const char* name, const std::vector<float>& v_all,
                 const std::vector<float>& v_few, int threads, bool ftz, Report& rep) {
  for (int e = -127; e <= 128; ++e) {
    if (!enc::mxfp8_plain_exponent(e)) continue;
    // Every input near the ends of the plain range, fewer in between.
    const bool edge = e <= -98 || e >= 124 || (e >= -2 && e <= 2);
    const std::vector<float>& v = edge ? v_all : v_few;
    run_split(v.size(), threads, ftz, [&](uint64_t begin, uint64_t end) {
      std::vector<uint8_t> got(kChunk);
      for (uint64_t c0 = begin; c0 < end; c0 += kChunk) {
        const int64_t n = static_cast<int64_t>(std::min<uint64_t>(kChunk, end - c0));
        pow2_loop<Fmt>(v.data() + c0, got.data(), n, e);
        for (int64_t i = 0; i < n; ++i) {
          const uint8_t want = Fmt::encode(fmt::mul_pow2(v[c0 + i], -e));
          if (got[i] != want) {
            rep.add(name, "mxfp8 e=" + std::to_string(e), bits_of(v[c0 + i]), want, got[i]);
          }
        }
      }
    });
  }
}

void check_nvfp4(const std::vector<float>& v, int threads, bool ftz, Report& rep) {
  const float scales[] = {1.0f, 2688.0f / 5.3f, 0x1p100f};  // plain_tensor_scale
  for (float s : scales) {
    for (uint32_t c = 1; c < 0x7f; ++c) {  // every positive finite E4M3 block scale
      const float bs = fmt::from_e4m3(static_cast<uint8_t>(c));
      run_split(v.size(), threads, ftz, [&](uint64_t begin, uint64_t end) {
        std::vector<uint8_t> got(kChunk);
        for (uint64_t c0 = begin; c0 < end; c0 += kChunk) {
          const int64_t n = static_cast<int64_t>(std::min<uint64_t>(kChunk, end - c0));
          nvfp4_loop(v.data() + c0, got.data(), n, s, bs);
          for (int64_t i = 0; i < n; ++i) {
            const uint8_t want = fmt::to_e2m1(fmt::mul_exact(v[c0 + i], s) / bs);
            if (got[i] != want) rep.add("e2m1", "nvfp4", bits_of(v[c0 + i]), want, got[i]);
          }
        }
      });
    }
  }
}

// Block amaxes (>= 0, NaN, inf): every 1031st non-negative bit pattern, every 31st one below
// 6 * 2^-126 (where the exact quotient is subnormal), and per scale the amaxes that give E4M3
// codes and midpoints, against formats.h's exact steps.
void check_nvfp4_block_scales(int threads, bool ftz, Report& rep) {
  std::vector<float> amax;
  for (uint32_t u = 0; u < 0x7fc00001u; u += 1031) amax.push_back(float_of(u));
  for (uint32_t u = 0; u < 0x01400000u; u += 31) amax.push_back(float_of(u));
  amax.push_back(float_of(0x7f800000u));
  amax.push_back(float_of(0x7fc00000u));
  const float scales[] = {1.0f, 2688.0f / 5.3f, 0x1p100f, 0x1p-126f, 1e-20f};
  const size_t sampled = amax.size();
  for (float s : scales) {
    // And the amaxes whose (amax / 6) * s is at or next to each E4M3 code and midpoint (ties).
    amax.resize(sampled);
    for (uint32_t c = 0; c < 0x7e; ++c) {
      const double lo = fmt::from_e4m3(static_cast<uint8_t>(c));
      const double hi = fmt::from_e4m3(static_cast<uint8_t>(c + 1));
      for (double target : {lo, (lo + hi) / 2}) {
        const float a = static_cast<float>(target * 6.0 / static_cast<double>(s));
        for (int d = -2; d <= 2; ++d) amax.push_back(float_of(bits_of(a) + d));
      }
    }
    run_split(amax.size(), threads, ftz, [&](uint64_t begin, uint64_t end) {
      std::vector<uint8_t> got(kChunk);
      for (uint64_t c0 = begin; c0 < end; c0 += kChunk) {
        const int64_t n = static_cast<int64_t>(std::min<uint64_t>(kChunk, end - c0));
        block_scale_loop(amax.data() + c0, got.data(), n, s);
        for (int64_t i = 0; i < n; ++i) {
          const float a = amax[c0 + i];
          const uint8_t want = fmt::to_e4m3(fmt::mul_exact(fmt::div_exact<6>(a), s));
          if (got[i] != want) rep.add("e4m3", "nvfp4 block scale", bits_of(a), want, got[i]);
        }
      }
    });
  }
}

}  // namespace
// formats.h's div_by_e4m3 (the CUDA NVFP4 kernels' division by the block scale, three operations
// given r = RN(1 / b)) against the correctly rounded a / b, in IEEE mode (the device keeps
// subnormals): every significand of a at the exponents whose quotients span every E2M1 code,
// over E4M3's eight significands of b; and every 4099th pattern of a in [0, 2^100) (zero and
// subnormals included) over every positive finite E4M3 b. Exact wherever a >= 2^-100;
// below, both quotients are under 2^-91.
void check_div_by_e4m3(int threads, Report& rep) {
  auto check = [&rep](float a, float b) {
    const float r = 1.0f / b;  // SSE division: correctly rounded
    const float got = fmt::div_by_e4m3(a, b, r), want = a / b;
    if (bits_of(got) == bits_of(want) || (a < 0x1p-100f && want < 0x1p-91f && got < 0x1p-91f)) {
      return;
    }
    char ctx[96];
    std::snprintf(ctx, sizeof ctx, "div_by_e4m3 b=%g: want 0x%08x got 0x%08x", b, bits_of(want),
                  bits_of(got));
    rep.add("e2m1", ctx, bits_of(a), fmt::e2m1_magnitude(want), fmt::e2m1_magnitude(got));
  };
  run_split(uint64_t{1} << 23, threads, false, [&](uint64_t begin, uint64_t end) {
    for (uint64_t m = begin; m < end; ++m) {
      for (uint32_t code = 0x38; code <= 0x3f; ++code) {  // 1, 1.125, ..., 1.875
        const float b = fmt::from_e4m3(static_cast<uint8_t>(code));
        for (int e = -3; e <= 3; ++e) {
          check(float_of((static_cast<uint32_t>(127 + e) << 23) | static_cast<uint32_t>(m)), b);
        }
      }
    }
  });
  const uint64_t count = 0x71800000u / 4099 + 1;  // a < 2^100
  run_split(count, threads, false, [&](uint64_t begin, uint64_t end) {
    for (uint64_t k = begin; k < end; ++k) {
      const float a = float_of(static_cast<uint32_t>(k * 4099));
      for (uint32_t code = 0x01; code <= 0x7e; ++code) {
        check(a, fmt::from_e4m3(static_cast<uint8_t>(code)));
      }
    }
  });
  if (!std::isnan(fmt::div_by_e4m3(NAN, 1.5f, 1.0f / 1.5f))) rep.add("e2m1", "div NaN", 0, 1, 0);
  // The NVFP4 block scales' amax / 6 on the device: every 1031st pattern in [2^-100, 2^128).
  const uint64_t count6 = (0x7f800000u - 0x0d800000u) / 1031 + 1;
  run_split(count6, threads, false, [&](uint64_t begin, uint64_t end) {
    for (uint64_t k = begin; k < end; ++k) {
      check(float_of(0x0d800000u + static_cast<uint32_t>(k * 1031)), 6.0f);
    }
  });
}

// formats.h's NVFP4 by comparisons (the CUDA kernels' 16-bit path), in IEEE mode:
//   thresholds  #{j : p >= nvfp4_threshold(bs, j)} against e2m1(p / bs) for every positive finite
//               block scale bs: every p within 2^12 floats of each threshold, every 4099th
//               non-negative pattern, and inf;
//   inputs      #{j : |y| >= nvfp4_input_threshold(P_j, s, 1 / s)} against e2m1(RN(y * s) / bs)
//               for every bfloat16 and every float16 magnitude y (inf included), every positive
//               finite block scale and the tensor scales s below (the extremes included: the
//               float32 max, a subnormal 1 / s, scales that put the thresholds in the 16-bit
//               subnormals or past the float16 max).
// #{j : v >= thr[j]}: the E2M1 magnitude code by comparisons.
template <typename V>
uint32_t thresholds_reached(V v, const V (&thr)[7]) {
  uint32_t n = 0;
  for (int j = 0; j < 7; ++j) n += v >= thr[j] ? 1u : 0u;
  return n;
}

template <bool kBf16>
void check_nvfp4_inputs(const std::vector<float>& scales, int threads, Report& rep) {
  constexpr uint32_t kInf = kBf16 ? 0x7f80u : 0x7c00u;
  const uint64_t cases = scales.size() * 126;
  run_split(cases, threads, false, [&](uint64_t begin, uint64_t end) {
    for (uint64_t k = begin; k < end; ++k) {
      const float s = scales[k / 126];
      const float bs = fmt::from_e4m3(static_cast<uint8_t>(k % 126 + 1));
      uint32_t y_thr[7];
      for (int j = 0; j < 7; ++j) {
        y_thr[j] = fmt::nvfp4_input_threshold<kBf16>(fmt::nvfp4_threshold(bs, j), s, 1.0f / s);
      }
      for (uint32_t h = 0; h <= kInf; ++h) {
        const float y = kBf16 ? fmt::from_bf16(static_cast<uint16_t>(h))
                              : fmt::from_f16(static_cast<uint16_t>(h));
        const uint32_t want = fmt::e2m1_magnitude(fmt::mul_exact(y, s) / bs);
        const uint32_t got = thresholds_reached(h, y_thr);
        if (got != want) {
          char ctx[96];
          std::snprintf(ctx, sizeof ctx, "%s input 0x%04x s=%a bs=%g", kBf16 ? "bf16" : "f16", h,
                        static_cast<double>(s), static_cast<double>(bs));
          rep.add("e2m1", ctx, bits_of(y), static_cast<int>(want), static_cast<int>(got));
        }
      }
    }
  });
}

// Returns the number of tensor scales checked.
size_t check_nvfp4_compare(int threads, Report& rep) {
  auto check = [&rep](float p, float bs, const float (&thr)[7]) {
    const uint32_t got = thresholds_reached(p, thr);
    const uint32_t want = fmt::e2m1_magnitude(p / bs);
    if (got != want) {
      char ctx[64];
      std::snprintf(ctx, sizeof ctx, "threshold bs=%g", static_cast<double>(bs));
      rep.add("e2m1", ctx, bits_of(p), static_cast<int>(want), static_cast<int>(got));
    }
  };
  run_split(126, threads, false, [&](uint64_t begin, uint64_t end) {
    for (uint64_t c = begin; c < end; ++c) {
      const float bs = fmt::from_e4m3(static_cast<uint8_t>(c + 1));
      float thr[7];
      for (int j = 0; j < 7; ++j) thr[j] = fmt::nvfp4_threshold(bs, j);
      for (int j = 0; j < 7; ++j) {
        for (int d = -4096; d <= 4096; ++d) check(float_of(bits_of(thr[j]) + d), bs, thr);
      }
      for (uint64_t u = 0; u < 0x7f800000u; u += 4099) {
        check(float_of(static_cast<uint32_t>(u)), bs, thr);
      }
      check(INFINITY, bs, thr);
    }
  });
  std::vector<float> scales = {1.0f, 2688.0f / 5.3f, 0x1p100f, 0x1.fffffep127f, 0x1.8p126f,
                               0x1p-116f, 1.2345678f, 3.1415927e-3f, 7.777e6f};
  for (float amax : {65504.0f, 0x1.fep127f, 448.0f, 0.37f, 1e-5f, 0x1p-24f, 0x1p-133f, 6.1e-5f}) {
    scales.push_back(fmt::scale_from_amax(amax, fmt::kNvfp4GlobalQ));
  }
  check_nvfp4_inputs<true>(scales, threads, rep);
  check_nvfp4_inputs<false>(scales, threads, rep);
  return scales.size();
}


int main(int argc, char** argv) {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  bool full = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--full")) full = true;
    else {
      std::fprintf(stderr, "usage: %s [--threads N] [--full]\n", argv[0]);
      return 2;
    }
  }
  const std::vector<float> v_scaled = scaled_inputs(30011, 211);
  const std::vector<float> v_few = scaled_inputs(99991, 2003);
  Report rep;
  lap();
  bool modes[] = {false, true};
#if !defined(TE_JAX_HAVE_MXCSR)
  std::printf("(no MXCSR on this target: the FTZ/DAZ runs repeat the IEEE ones)\n");
#endif
  for (bool ftz : modes) {
    const char* mode = ftz ? "FTZ+DAZ" : "IEEE";
    const uint64_t before = rep.mismatches;
    check_encode<fmt::E4M3>("e4m3", full, threads, ftz, rep);
    check_encode<fmt::E5M2>("e5m2", full, threads, ftz, rep);
    check_encode<fmt::E2M1>("e2m1", full, threads, ftz, rep);
    std::printf("encode %-7s %s bit patterns x {e4m3, e5m2, e2m1}: %llu mismatches (%.1f s)\n",
                mode, full ? "all 2^32" : std::to_string(kEncodeInputs).c_str(),
                static_cast<unsigned long long>(rep.mismatches - before), lap());
    const uint64_t before_t = rep.mismatches;
    check_tensor<fmt::E4M3>("e4m3", v_scaled, threads, ftz, rep);
    check_tensor<fmt::E5M2>("e5m2", v_scaled, threads, ftz, rep);
    check_tensor<fmt::E2M1>("e2m1", v_scaled, threads, ftz, rep);
    std::printf("tensor %-7s %zu values x %zu scales x 3 formats: %llu mismatches (%.1f s)\n",
                mode, v_scaled.size(), tensor_scales().size(),
                static_cast<unsigned long long>(rep.mismatches - before_t), lap());
    const uint64_t before_m = rep.mismatches;
    check_mxfp8<fmt::E4M3>("e4m3", v_scaled, v_few, threads, ftz, rep);
    check_mxfp8<fmt::E5M2>("e5m2", v_scaled, v_few, threads, ftz, rep);
    std::printf("mxfp8  %-7s every plain exponent x {e4m3, e5m2}: %llu mismatches (%.1f s)\n",
                mode, static_cast<unsigned long long>(rep.mismatches - before_m), lap());
    const uint64_t before_n = rep.mismatches;
    check_nvfp4(v_few, threads, ftz, rep);
    check_nvfp4_block_scales(threads, ftz, rep);
    std::printf("nvfp4  %-7s %zu values x 126 block scales; block scales: %llu mismatches "
                "(%.1f s)\n", mode, v_few.size(),
                static_cast<unsigned long long>(rep.mismatches - before_n), lap());
  }
  const uint64_t before_d = rep.mismatches;
  check_div_by_e4m3(threads, rep);
  std::printf("div_by_e4m3 IEEE every significand x 8 block-scale significands; every 4099th "
              "pattern x 126 block scales; / 6 every 1031st pattern: %llu mismatches (%.1f s)\n",
              static_cast<unsigned long long>(rep.mismatches - before_d), lap());
  const uint64_t before_c = rep.mismatches;
  const size_t n_scales = check_nvfp4_compare(threads, rep);
  std::printf("nvfp4 by comparisons IEEE thresholds x 126 block scales; every bf16 / f16 "
              "magnitude x 126 block scales x %zu tensor scales: %llu mismatches (%.1f s)\n",
              n_scales, static_cast<unsigned long long>(rep.mismatches - before_c), lap());
  std::printf("%s\n", rep.mismatches == 0 ? "PASS" : "FAIL");
  return rep.mismatches == 0 ? 0 : 1;
}
