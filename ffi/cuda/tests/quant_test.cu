// Standalone test of the te_jax CUDA quantizing kernels (quantize.cuh, through launch_act_lu /
// launch_dact_dbias with p.quantized), without XLA or Python. For each case:
//   1. the NO_SCALING kernel computes y (act_lu) or dx (dact) on the device, rounded to x's dtype:
//      the value the quantized path must quantize;
//   2. the quantizing launch runs into outputs poisoned with 0xFF bytes;
//   3. a host reference applies ffi/activation/cpu/quantized.cc's formulas (the same formats.h
//      functions: mul_exact, div_exact, mul_pow2, the encoders) to the device's y, and every output
//      byte is compared: codes (rowwise, colwise / transposed), block scales, scale_inv, amax
//      (bits);
//   4. dbias (backward with a workspace) against a float64 host sum, and bit-identical when the
//      grid is capped (another summation schedule) and on a second run;
//   5. the amax passes (q.emit == AMAX_PASS, only amax [and dbias]);
//   6. blockwise FP8 (1x128 and 128x128 blocks, activation/cuda/quantize/fp8_block.cuh): codes,
//      float32 scales and the scale layouts' zero padding, power-of-two scales on even M.
// Also: load_only for every (activation, dtype, mode), and CUDA graph capture of quantizing
// launches after a load_only pass (as the Initialize stage does). It is meant to be run on the GPU,
// also under compute-sanitizer (use --quick there). `--bench` times the kernels on 1 GiB operands
// against a device-to-device copy instead.
// Build and run: ffi/cuda/tests/run.sh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "activation/activations.h"
#include "activation/cuda/launch.h"
#include "activation/problem.h"
#include "common/formats.h"
#include "cuda/tests/harness.cuh"

using namespace te_jax;
using namespace te_jax_test;

namespace {

std::mt19937 g_rng(4242);

enum class QM { DELAYED, CURRENT, MX, NVFP4, AMAX, BLOCK1D, BLOCK2D };
const char* qm_name(QM m) {
  switch (m) {
    case QM::DELAYED: return "DELAYED";
    case QM::CURRENT: return "CURRENT";
    case QM::MX: return "MXFP8";
    case QM::NVFP4: return "NVFP4";
    case QM::AMAX: return "AMAX";
    case QM::BLOCK1D: return "FP8_BLOCK_1D";
    case QM::BLOCK2D: return "FP8_BLOCK_2D";
  }
  return "?";
}

struct TestSpec {
  ActivationEnum act;
  bool bwd;
  QM mode;
  QType qtype;
  bool row, col;
  int64_t M, H, batches;
  int64_t groups;  // backward: dbias workspace groups, 0 = no dbias
  int misalign;    // inputs misaligned by one element, outputs by one byte
  bool special;    // zero blocks, subnormals, huge values in the input
};

std::string describe(const TestSpec& s, const char* dtype) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s %s %s %s %s%s%s M=%lld H=%lld b=%lld g=%lld%s%s",
                s.bwd ? "dact" : "act", activation_name(s.act), dtype, qm_name(s.mode),
                s.qtype == QType::E4M3 ? "e4m3" : (s.qtype == QType::E5M2 ? "e5m2" : "e2m1"),
                s.row ? " row" : "", s.col ? " col" : "", (long long)s.M, (long long)s.H,
                (long long)s.batches, (long long)s.groups, s.misalign ? " misaligned" : "",
                s.special ? " special" : "");
  return buf;
}

// Random inputs spanning many binades (so block scales vary), with exact zeros; `special` adds an
// all-zero stretch, float32-subnormal values (bf16 / f32 inputs) and huge values.
template <typename T>
std::vector<T> gen_input(size_t n, bool special, float lo_exp = -12, float hi_exp = 4) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(static_cast<int>(lo_exp), static_cast<int>(hi_exp));
  std::uniform_int_distribution<int> z(0, 31);
  std::vector<T> v(n);
  float scale = 1.0f;
  for (size_t i = 0; i < n; ++i) {
    if (i % 8 == 0) scale = std::ldexp(1.0f, e(g_rng));
    v[i] = DT<T>::from(z(g_rng) == 0 ? 0.0f : u(g_rng) * scale);
  }
  if (special && n >= 256) {
    for (size_t i = 64; i < 128; ++i) v[i] = DT<T>::from(0.0f);
    if (!std::is_same_v<T, __half>) {
      // float32 subnormals (bf16 holds m * 2^-133 for m < 128)
      std::uniform_int_distribution<int> m(1, 127);
      for (size_t i = 128; i < 160; ++i) {
        v[i] = DT<T>::from(std::ldexp(static_cast<float>(m(g_rng)) * (i % 2 ? 1.f : -1.f), -133));
      }
      for (size_t i = 160; i < 192; i += 3) v[i] = DT<T>::from(std::ldexp(1.0f, -130));
    }
    // Large (but finite through every activation: an inf amax makes NaN scales, whose sign
    // differs between x86 and the GPU).
    for (size_t i = 192; i < 200; ++i) v[i] = DT<T>::from((i % 2 ? -1.0f : 1.0f) * 200.0f);
    for (size_t i = 200; i < 206; ++i) v[i] = DT<T>::from(-0.0f);  // codes keep the sign of -0
  }
  return v;
}

// ---- host reference (ffi/activation/cpu/quantized.cc's formulas) ------------------------------

uint8_t enc8(QType t, float v) { return t == QType::E5M2 ? fmt::to_e5m2(v) : fmt::to_e4m3(v); }
float qmax8(QType t) { return t == QType::E5M2 ? fmt::E5M2::kMax : fmt::E4M3::kMax; }
uint32_t key_of(float v) { return bits(v) & 0x7fffffffu; }

struct Outputs {
  std::vector<uint8_t> data, colwise, bscale, cbscale;
  std::vector<float> scale_inv, amax;
  std::vector<float> fscale, cfscale;  // blockwise FP8's float32 scales (padding included)
};

// Blockwise FP8's options in these tests: power-of-two scales on even M, an amax floor on the
// cases with special values (their zero and subnormal blocks fall below it).
bool block_pow2(const TestSpec& s) { return s.M % 2 == 0; }
uint32_t block_eps_bits(const TestSpec& s) { return s.special ? bits(0x1p-10f) : 0u; }

// y: [M, N] float (rounded to x's dtype), N = O * H.
Outputs reference(const TestSpec& s, const std::vector<float>& y, int64_t M, int64_t N,
                  const std::vector<float>& scale) {
  Outputs r;
  const int64_t B = s.batches, mb = M / B;
  auto Y = [&](int64_t row, int64_t c) { return y[row * N + c]; };
  r.amax.assign(B, 0.0f);
  for (int64_t b = 0; b < B; ++b) {
    uint32_t k = 0;
    for (int64_t row = b * mb; row < (b + 1) * mb; ++row)
      for (int64_t c = 0; c < N; ++c) k = std::max(k, key_of(Y(row, c)));
    r.amax[b] = from_bits(k);
  }
  switch (s.mode) {
    case QM::DELAYED:
    case QM::CURRENT: {
      if (s.row) r.data.resize(M * N);
      if (s.col) r.colwise.resize(M * N);
      for (int64_t row = 0; row < M; ++row) {
        const int64_t b = row / mb;
        for (int64_t c = 0; c < N; ++c) {
          const uint8_t code = enc8(s.qtype, fmt::mul_exact(Y(row, c), scale[b]));
          if (s.row) r.data[row * N + c] = code;
          if (s.col) r.colwise[b * N * mb + c * mb + (row - b * mb)] = code;
        }
      }
      r.scale_inv.resize(B);
      for (int64_t b = 0; b < B; ++b) r.scale_inv[b] = fmt::div_rn(1.0f, scale[b]);
      break;
    }
    case QM::MX: {
      const float Q = qmax8(s.qtype);
      auto block = [&](float amax, float* v, uint8_t* out, int cnt, int64_t stride,
                       uint8_t* sc) {
        const int e = fmt::e8m0_exponent(amax, Q);
        *sc = fmt::e8m0_biased(amax, Q);
        const bool nan = amax != amax;  // a NaN block has NaN codes
        for (int i = 0; i < cnt; ++i) {
          out[i * stride] = enc8(s.qtype, nan ? amax : fmt::mul_pow2(v[i], -e));
        }
      };
      if (s.row) {
        r.data.resize(M * N);
        r.bscale.resize(M * N / 32);
        for (int64_t row = 0; row < M; ++row) {
          for (int64_t k = 0; k < N / 32; ++k) {
            float v[32];
            uint32_t key = 0;
            for (int i = 0; i < 32; ++i) key = std::max(key, key_of(v[i] = Y(row, 32 * k + i)));
            block(from_bits(key), v, &r.data[row * N + 32 * k], 32, 1,
                  &r.bscale[row * (N / 32) + k]);
          }
        }
      }
      if (s.col) {
        r.colwise.resize(M * N);
        r.cbscale.resize(M / 32 * N);
        for (int64_t rb = 0; rb < M / 32; ++rb) {
          for (int64_t c = 0; c < N; ++c) {
            float v[32];
            uint32_t key = 0;
            for (int i = 0; i < 32; ++i) key = std::max(key, key_of(v[i] = Y(32 * rb + i, c)));
            block(from_bits(key), v, &r.colwise[(32 * rb) * N + c], 32, N, &r.cbscale[rb * N + c]);
          }
        }
      }
      break;
    }
    case QM::NVFP4: {
      auto bscale = [](float amax, float S) {
        return fmt::to_e4m3(fmt::mul_exact(fmt::div_exact<6>(amax), S));
      };
      auto code = [](float v, float S, float bs) -> uint8_t {
        const uint8_t c = fmt::to_e2m1(fmt::mul_exact(v, S) / bs);
        return bs == 0.0f ? 0 : c;
      };
      auto put = [](std::vector<uint8_t>& d, int64_t idx, uint8_t c) {
        uint8_t& byte = d[idx / 2];
        byte = (idx % 2) ? static_cast<uint8_t>((byte & 0x0f) | (c << 4))
                         : static_cast<uint8_t>((byte & 0xf0) | c);
      };
      if (s.row) {
        r.data.assign(M * N / 2, 0);
        r.bscale.resize(M * N / 16);
        for (int64_t row = 0; row < M; ++row) {
          const float S = scale[row / mb];
          for (int64_t k = 0; k < N / 16; ++k) {
            uint32_t key = 0;
            for (int i = 0; i < 16; ++i) key = std::max(key, key_of(Y(row, 16 * k + i)));
            const uint8_t sc = bscale(from_bits(key), S);
            r.bscale[row * (N / 16) + k] = sc;
            const float bs = fmt::from_e4m3(sc);
            for (int i = 0; i < 16; ++i) {
              put(r.data, row * N + 16 * k + i, code(Y(row, 16 * k + i), S, bs));
            }
          }
        }
      }
      if (s.col) {
        r.colwise.assign(M * N / 2, 0);
        r.cbscale.resize(M / 16 * N);
        for (int64_t rb = 0; rb < M / 16; ++rb) {
          const float S = scale[(16 * rb) / mb];
          for (int64_t c = 0; c < N; ++c) {
            uint32_t key = 0;
            for (int i = 0; i < 16; ++i) key = std::max(key, key_of(Y(16 * rb + i, c)));
            const uint8_t sc = bscale(from_bits(key), S);
            r.cbscale[rb * N + c] = sc;
            const float bs = fmt::from_e4m3(sc);
            for (int i = 0; i < 16; ++i) {
              put(r.colwise, (16 * rb + i) * N + c, code(Y(16 * rb + i, c), S, bs));
            }
          }
        }
      }
      r.scale_inv.resize(B);
      for (int64_t b = 0; b < B; ++b) r.scale_inv[b] = fmt::div_rn(1.0f, scale[b]);
      break;
    }
    case QM::AMAX: break;
    case QM::BLOCK1D:
    case QM::BLOCK2D: {
      // Per batch: the copy [mb, N] and its transpose [N, mb], scales in cuBLASLt's layouts.
      const bool d2 = s.mode == QM::BLOCK2D;
      const int64_t rs = fp8_block_scale_count(d2, mb, N), cs = fp8_block_scale_count(d2, N, mb);
      const int64_t rbs = (mb + 127) / 128, cbs = (N + 127) / 128;
      const int64_t rb_pad = (rbs + 3) / 4 * 4, cb_pad = (cbs + 3) / 4 * 4;
      const int64_t r_pad = (mb + 3) / 4 * 4, n_pad = (N + 3) / 4 * 4;
      const float Q = qmax8(s.qtype);
      auto scale_of = [&](uint32_t key) {
        return fmt::fp8_block_scale(key, Q, block_eps_bits(s), block_pow2(s));
      };
      if (s.row) {
        r.data.resize(M * N);
        r.fscale.assign(B * rs, 0.0f);
      }
      if (s.col) {
        r.colwise.resize(M * N);
        r.cfscale.assign(B * cs, 0.0f);
      }
      // Rows [i0, i1) x columns [c0, c1) of batch b as one block: its scale from its max|y|, its
      // codes into the rowwise and / or the colwise copy; returns its scale_inv.
      auto block = [&](int64_t b, int64_t i0, int64_t i1, int64_t c0, int64_t c1, bool to_row,
                       bool to_col) {
        uint32_t key = 0;
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t c = c0; c < c1; ++c) key = std::max(key, key_of(Y(b * mb + i, c)));
        const fmt::BlockScale sc = scale_of(key);
        for (int64_t i = i0; i < i1; ++i) {
          for (int64_t c = c0; c < c1; ++c) {
            const uint8_t code = enc8(s.qtype, fmt::mul_exact(Y(b * mb + i, c), sc.scale));
            if (to_row) r.data[(b * mb + i) * N + c] = code;
            if (to_col) r.colwise[b * N * mb + c * mb + i] = code;
          }
        }
        return sc.scale_inv;
      };
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t rb = 0; rb < rbs; ++rb) {
          const int64_t i0 = 128 * rb, i1 = std::min(mb, i0 + 128);
          for (int64_t cb = 0; cb < cbs; ++cb) {
            const int64_t c0 = 128 * cb, c1 = std::min(N, c0 + 128);
            if (d2) {  // one tile scale for both copies
              const float inv = block(b, i0, i1, c0, c1, s.row, s.col);
              if (s.row) r.fscale[b * rs + rb * cb_pad + cb] = inv;
              if (s.col) r.cfscale[b * cs + cb * rb_pad + rb] = inv;
              continue;
            }
            // 1D: each copy from y, blocks along its own rows (1 x 128 of y, resp. 128 x 1).
            for (int64_t i = i0; i < i1 && s.row; ++i) {
              r.fscale[b * rs + cb * r_pad + i] = block(b, i, i + 1, c0, c1, true, false);
            }
            for (int64_t c = c0; c < c1 && s.col; ++c) {
              r.cfscale[b * cs + rb * n_pad + c] = block(b, i0, i1, c, c + 1, false, true);
            }
          }
        }
      }
      break;
    }
  }
  return r;
}

void compare_bytes(const std::string& tag, const char* what, const std::vector<uint8_t>& got,
                   const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    fail(tag + ": " + what + " size " + std::to_string(got.size()) + " != " +
         std::to_string(want.size()));
    return;
  }
  int bad = 0;
  size_t nbad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      ++nbad;
      if (bad++ < 3) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s[%zu] = 0x%02x, want 0x%02x", what, i, got[i], want[i]);
        fail(tag + ": " + buf);
      }
    }
  }
  if (nbad > 3) fail(tag + ": " + what + ": " + std::to_string(nbad) + " bytes differ in all");
}

void compare_floats(const std::string& tag, const char* what, const std::vector<float>& got,
                    const std::vector<float>& want) {
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (bits(got[i]) != bits(want[i])) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s[%zu] = %a, want %a", what, i, got[i], want[i]);
      fail(tag + ": " + buf);
      return;
    }
  }
}

// ---- one case ----------------------------------------------------------------------------------

// Device outputs of one quantizing launch.
struct DevOut {
  DevBuf<uint8_t> data, colwise, bscale, cbscale;
  DevBuf<float> scale, scale_inv, amax, ws, fscale, cfscale;
  DevBuf<char> dbias;  // bytes
};

template <typename T>
void run_case(const TestSpec& s) {
  with_activation(s.act, [&](auto spec) {
    using Spec = decltype(spec);
    constexpr int L = Spec::kActLen;
    const int O = s.bwd ? L : 1;
    const int64_t M = s.M, H = s.H, N = O * H, B = s.batches, mb = M / B;
    const std::string tag = describe(s, DT<T>::kName);
    const int mis = s.misalign;
    const size_t nx = M * L * H, nz = M * H;
    std::vector<T> hx = gen_input<T>(nx, s.special);
    std::vector<T> hz = gen_input<T>(nz, false, -3, 1);
    DevBuf<T> x(nx, mis * sizeof(T)), dz(s.bwd ? nz : 0, mis * sizeof(T));
    x.upload(hx);
    dz.upload(hz);

    // 1. y on the device (NO_SCALING).
    std::vector<float> y(M * N);
    {
      DevBuf<T> yd(M * N, 0);
      if (!s.bwd) {
        ActLuProblem p{DT<T>::kType, s.act, ActParams{}, M, H, x.ptr, yd.ptr, nullptr};
        CHECK_CUDA(cuda::launch_act_lu(p, 0, {}));
      } else {
        DActProblem p{};
        p.dtype = DT<T>::kType;
        p.act = s.act;
        p.act_len = L;
        p.rows = M;
        p.hidden = H;
        p.dz = dz.ptr;
        p.x = x.ptr;
        p.dx = yd.ptr;
        CHECK_CUDA(cuda::launch_dact_dbias(p, 0, {}));
      }
      CHECK_CUDA(cudaDeviceSynchronize());
      const std::vector<T> h = yd.download();
      for (size_t i = 0; i < h.size(); ++i) y[i] = DT<T>::to(h[i]);
    }

    // Scales per batch: DELAYED Q / amax_b times a factor (some batches saturate), given to the
    // kernel; CURRENT and NVFP4 get an amax (CURRENT's scaled by a factor, so some batches
    // saturate) and derive the scale themselves: Q / amax, resp. 6 * 448 / amax.
    std::vector<float> scale(B, 1.0f), scale_in(B, 1.0f);
    float numerator = 0.0f;
    {
      const TestSpec amax_spec{s.act, s.bwd, QM::AMAX, s.qtype, false, false, M, H, B, 0, 0, false};
      const Outputs a = reference(amax_spec, y, M, N, scale);
      const float factors[] = {0.75f, 3.0f, 1.0f, 1.0f / 64};
      for (int64_t b = 0; b < B; ++b) {
        const float am = a.amax[b];
        if (s.mode == QM::NVFP4) {
          numerator = fmt::kNvfp4GlobalQ;
          scale_in[b] = am;
          scale[b] = fmt::scale_from_amax(am, numerator);
        } else if (s.mode == QM::CURRENT) {
          numerator = qmax8(s.qtype);
          scale_in[b] = am / factors[b % 4];
          scale[b] = fmt::scale_from_amax(scale_in[b], numerator);
        } else if (s.mode == QM::DELAYED) {
          scale[b] = scale_in[b] = am > 0 ? qmax8(s.qtype) / am * factors[b % 4] : 1.0f;
        }
      }
    }
    const Outputs want = reference(s, y, M, N, scale);

    // 2. the quantizing launch.
    const bool tensor = s.mode == QM::DELAYED || s.mode == QM::CURRENT;
    const bool nvfp4 = s.mode == QM::NVFP4;
    const bool fp8_block = s.mode == QM::BLOCK1D || s.mode == QM::BLOCK2D;
    const bool d2 = s.mode == QM::BLOCK2D;
    const int64_t data_bytes = nvfp4 ? M * N / 2 : M * N;
    const int64_t bs = s.mode == QM::MX ? 32 : 16;
    DevOut o;
    o.data.alloc(s.row && s.mode != QM::AMAX ? data_bytes : 0, mis);
    o.colwise.alloc(s.col && s.mode != QM::AMAX ? data_bytes : 0, mis);
    const bool byte_scales = !tensor && !fp8_block && s.mode != QM::AMAX;
    o.bscale.alloc(byte_scales && s.row ? M * N / bs : 0, mis);
    o.cbscale.alloc(byte_scales && s.col ? M * N / bs : 0, mis);
    o.fscale.alloc(fp8_block && s.row ? B * fp8_block_scale_count(d2, mb, N) : 0, 0);
    o.cfscale.alloc(fp8_block && s.col ? B * fp8_block_scale_count(d2, N, mb) : 0, 0);
    o.scale.alloc(B, 0);
    o.scale_inv.alloc(tensor || nvfp4 ? B : 0, 0);
    const bool want_amax = s.mode != QM::CURRENT && s.mode != QM::MX && !fp8_block;
    o.amax.alloc(want_amax ? B : 0, 0);
    const bool dbias = s.bwd && s.groups > 0;
    o.ws.alloc(dbias ? B * s.groups * N : 0, 0);
    o.dbias.alloc(dbias ? B * N * sizeof(T) : 0, 0);
    o.scale.upload(scale_in);

    QuantOutput q{};
    q.emit = s.mode == QM::AMAX    ? QuantEmit::AMAX_PASS
             : s.mode == QM::MX    ? QuantEmit::MXFP8
             : s.mode == QM::NVFP4 ? QuantEmit::NVFP4
             : fp8_block           ? QuantEmit::FP8_BLOCK
                                   : QuantEmit::TENSOR;
    q.qtype = s.qtype;
    q.batches = B;
    q.scale = (tensor || nvfp4) ? o.scale.ptr : nullptr;
    q.scale_numerator = numerator;
    q.data = o.data.get();
    q.colwise = o.colwise.get();
    q.scale_inv = o.scale_inv.get();
    q.block_scale = o.bscale.get();
    q.colwise_block_scale = o.cbscale.get();
    q.amax = o.amax.get();
    q.block_scale_f32 = o.fscale.get();
    q.colwise_block_scale_f32 = o.cfscale.get();
    q.block_2d = d2;
    q.power_2_scale = block_pow2(s);
    q.amax_epsilon_bits = block_eps_bits(s);

    auto launch = [&](unsigned max_blocks, cudaStream_t stream, bool load_only) {
      cuda::LaunchConfig cfg;
      cfg.max_blocks = max_blocks;
      cfg.load_only = load_only;
      if (!s.bwd) {
        ActLuProblem p{DT<T>::kType, s.act, ActParams{}, M, H, x.ptr, nullptr, nullptr};
        p.quantized = true;
        p.q = q;
        return cuda::launch_act_lu(p, stream, cfg);
      }
      DActProblem p{};
      p.dtype = DT<T>::kType;
      p.act = s.act;
      p.act_len = L;
      p.rows = M;
      p.hidden = H;
      p.dz = dz.ptr;
      p.x = x.ptr;
      if (dbias) {
        p.dbias = o.dbias.ptr;
        p.workspace = o.ws.ptr;
        p.batches = B;
        p.groups = s.groups;
      }
      p.quantized = true;
      p.q = q;
      return cuda::launch_dact_dbias(p, stream, cfg);
    };
    auto poison_all = [&] {
      o.data.poison();
      o.colwise.poison();
      o.bscale.poison();
      o.cbscale.poison();
      o.fscale.poison();
      o.cfscale.poison();
      o.scale_inv.poison();
      o.amax.poison();
      o.ws.poison();
      o.dbias.poison();
    };

    Case c;
    CHECK_CUDA(launch(0, 0, true));  // as the Initialize stage does, before any execute
    poison_all();
    CHECK_CUDA(launch(0, 0, false));
    CHECK_CUDA(cudaDeviceSynchronize());

    // 3. every output byte against the reference.
    if (s.mode != QM::AMAX) {
      if (s.row) compare_bytes(tag, "data", o.data.download(), want.data);
      if (s.col) compare_bytes(tag, "colwise", o.colwise.download(), want.colwise);
      if (byte_scales && s.row) {
        compare_bytes(tag, "scale_inv", o.bscale.download(), want.bscale);
      }
      if (byte_scales && s.col) {
        compare_bytes(tag, "colwise_scale_inv", o.cbscale.download(), want.cbscale);
      }
      if (fp8_block && s.row) compare_floats(tag, "scale_inv", o.fscale.download(), want.fscale);
      if (fp8_block && s.col) {
        compare_floats(tag, "colwise_scale_inv", o.cfscale.download(), want.cfscale);
      }
      if (tensor || nvfp4) {
        compare_floats(tag, "scale_inv", o.scale_inv.download(), want.scale_inv);
      }
    }
    if (want_amax) compare_floats(tag, "amax", o.amax.download(), want.amax);

    // 4. dbias against float64 (unrounded dx on the host, same activation formulas).
    std::vector<char> db0 = o.dbias.download();
    if (dbias) {
      std::vector<double> ref(B * N, 0.0), mag(B * N, 0.0);
      for (int64_t r = 0; r < M; ++r) {
        for (int64_t j = 0; j < H; ++j) {
          const float g = DT<T>::to(hz[r * H + j]);
          const float xa = DT<T>::to(hx[(r * L) * H + j]);
          const float xb = L == 2 ? DT<T>::to(hx[(r * L + 1) * H + j]) : 0.0f;
          float da, db;
          act_backward<Spec>(g, xa, xb, ActParams{}, da, db);
          const int64_t b = r / mb;
          ref[b * N + j] += da;
          mag[b * N + j] += std::fabs(da);
          if (L == 2) {
            ref[b * N + H + j] += db;
            mag[b * N + H + j] += std::fabs(db);
          }
        }
      }
      const T* got = reinterpret_cast<const T*>(db0.data());
      const double tol_t =
          std::is_same_v<T, float> ? 2e-5 : (std::is_same_v<T, __half> ? 1.0 / 1024 : 1.0 / 128);
      int bad = 0;
      for (int64_t i = 0; i < B * N; ++i) {
        const double g = DT<T>::to(got[i]);
        const double tol = 1e-5 * mag[i] + tol_t * std::fabs(ref[i]) + 1e-6;
        if (!(std::fabs(g - ref[i]) <= tol) && bad++ < 3) {
          fail(tag + ": dbias[" + std::to_string(i) + "] = " + std::to_string(g) + ", want " +
               std::to_string(ref[i]));
        }
      }
    }

    // Determinism: a capped grid (another schedule of the same work) gives the same bits.
    const auto d0 = o.data.download(), c0 = o.colwise.download(), b0 = o.bscale.download(),
               cb0 = o.cbscale.download();
    const auto fs0 = o.fscale.download(), cfs0 = o.cfscale.download();
    const auto a0 = o.amax.download(), si0 = o.scale_inv.download();
    poison_all();
    CHECK_CUDA(launch(g_quick ? 3 : 7, 0, false));
    CHECK_CUDA(cudaDeviceSynchronize());
    if (o.data.download() != d0 || o.colwise.download() != c0 || o.bscale.download() != b0 ||
        o.cbscale.download() != cb0 || o.dbias.download() != db0 ||
        std::memcmp(o.fscale.download().data(), fs0.data(), fs0.size() * 4) != 0 ||
        std::memcmp(o.cfscale.download().data(), cfs0.data(), cfs0.size() * 4) != 0 ||
        std::memcmp(o.amax.download().data(), a0.data(), a0.size() * 4) != 0 ||
        std::memcmp(o.scale_inv.download().data(), si0.data(), si0.size() * 4) != 0) {
      fail(tag + ": outputs differ with a capped grid");
    }
  });
}

// ---- graph capture -----------------------------------------------------------------------------

void test_graph() {
  using T = __nv_bfloat16;
  const int64_t M = 96, H = 256, B = 3, G = 2;
  std::vector<T> hx = gen_input<T>(M * 2 * H, false), hz = gen_input<T>(M * H, false, -3, 1);
  DevBuf<T> x(hx.size(), 0), dz(hz.size(), 0);
  x.upload(hx);
  dz.upload(hz);
  DevBuf<uint8_t> d1(M * H, 0), c1(M * H, 0), s1(M * H / 32, 0), cs1(M * H / 32, 0);
  DevBuf<uint8_t> d2(M * 2 * H, 0), c2(M * 2 * H, 0);
  DevBuf<float> scale(B, 0), scale_inv(B, 0), amax1(B, 0), amax2(B, 0), ws(B * G * 2 * H, 0);
  DevBuf<T> dbias(B * 2 * H, 0);
  scale.upload(std::vector<float>{2.0f, 0.5f, 8.0f});

  ActLuProblem pa{DType::BF16, ActivationEnum::SWIGLU, ActParams{}, M, H, x.ptr, nullptr, nullptr};
  pa.quantized = true;
  pa.q.emit = QuantEmit::MXFP8;
  pa.q.batches = B;
  pa.q.data = d1.ptr;
  pa.q.colwise = c1.ptr;
  pa.q.block_scale = s1.ptr;
  pa.q.colwise_block_scale = cs1.ptr;
  pa.q.amax = amax1.ptr;
  DActProblem pd{};
  pd.dtype = DType::BF16;
  pd.act = ActivationEnum::SWIGLU;
  pd.act_len = 2;
  pd.rows = M;
  pd.hidden = H;
  pd.dz = dz.ptr;
  pd.x = x.ptr;
  pd.dbias = dbias.ptr;
  pd.workspace = ws.ptr;
  pd.batches = B;
  pd.groups = G;
  pd.quantized = true;
  pd.q.emit = QuantEmit::TENSOR;
  pd.q.qtype = QType::E5M2;
  pd.q.batches = B;
  pd.q.scale = scale.ptr;
  pd.q.data = d2.ptr;
  pd.q.colwise = c2.ptr;
  pd.q.scale_inv = scale_inv.ptr;
  pd.q.amax = amax2.ptr;

  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CHECK_CUDA(cuda::launch_act_lu(pa, st, {}));
  CHECK_CUDA(cuda::launch_dact_dbias(pd, st, {}));
  CHECK_CUDA(cudaStreamSynchronize(st));
  auto snap = [&] {
    std::vector<std::vector<uint8_t>> v = {d1.download(), c1.download(), s1.download(),
                                           cs1.download(), d2.download(), c2.download()};
    auto push_f = [&](const DevBuf<float>& b) {
      const auto h = b.download();
      v.emplace_back(reinterpret_cast<const uint8_t*>(h.data()),
                     reinterpret_cast<const uint8_t*>(h.data()) + h.size() * 4);
    };
    push_f(scale_inv);
    push_f(amax1);
    push_f(amax2);
    const auto db = dbias.download();
    v.emplace_back(reinterpret_cast<const uint8_t*>(db.data()),
                   reinterpret_cast<const uint8_t*>(db.data()) + db.size() * sizeof(T));
    return v;
  };
  const auto eager = snap();
  for (auto* b : {&d1, &c1, &s1, &cs1, &d2, &c2}) b->poison();
  for (auto* b : {&scale_inv, &amax1, &amax2}) b->poison();
  dbias.poison();

  const auto enqueue = [&](const cuda::LaunchConfig& cfg) {
    const cudaError_t e = cuda::launch_act_lu(pa, st, cfg);
    return e != cudaSuccess ? e : cuda::launch_dact_dbias(pd, st, cfg);
  };
  Case c;
  if (!replay_in_graph(st, enqueue, "graph")) return;
  if (snap() != eager) fail("graph: replay differs from the eager run");
  CHECK_CUDA(cudaStreamDestroy(st));
}

// load_only (the Initialize stage) for every activation, dtype and mode.
void test_load_only() {
  Case c;
  const QuantEmit emits[] = {QuantEmit::TENSOR, QuantEmit::MXFP8, QuantEmit::NVFP4,
                             QuantEmit::AMAX_PASS, QuantEmit::FP8_BLOCK};
  cuda::LaunchConfig load;
  load.load_only = true;
  for (const ActivationEnum act : kActivations) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      for (QuantEmit m : emits) {
        ActLuProblem pa{dt, act, ActParams{}, 1, 32, nullptr, nullptr, nullptr};
        pa.quantized = true;
        pa.q.emit = m;
        if (cuda::launch_act_lu(pa, 0, load) != cudaSuccess) {
          fail(std::string("load_only act ") + activation_name(act) + " emit " +
               quant_emit_name(m));
        }
        if (act == ActivationEnum::IDENTITY) continue;
        DActProblem pd{};
        pd.dtype = dt;
        pd.act = act;
        pd.act_len = is_gated(act) ? 2 : 1;
        pd.quantized = true;
        pd.q.emit = m;
        float dummy;
        pd.dbias = &dummy;
        if (cuda::launch_dact_dbias(pd, 0, load) != cudaSuccess) {
          fail(std::string("load_only dact ") + activation_name(act) + " emit " +
               quant_emit_name(m));
        }
      }
    }
  }
}

// ---- the matrix of cases ------------------------------------------------------------------------

template <typename T>
void run_matrix(ActivationEnum act, bool full) {
  const bool ident = act == ActivationEnum::IDENTITY;
  struct Shape {
    int64_t M, H, B;
    int mis;
  };
  // Tensor modes: any shape.
  std::vector<Shape> tshapes = {{37, 40, 1, 0}, {64, 33, 2, 0}, {96, 256, 3, 0}, {74, 24, 2, 1},
                                {0, 16, 2, 0},  {5, 7, 1, 0}};
  // Block modes: rowwise blocks need H % 32 (MXFP8) / 16 (NVFP4), colwise rows per batch likewise.
  std::vector<Shape> mxshapes = {{64, 64, 1, 0}, {128, 96, 2, 0}, {96, 32, 3, 0}, {64, 288, 1, 1}};
  std::vector<Shape> fp4shapes = {{32, 48, 1, 0}, {48, 80, 3, 0}, {64, 16, 2, 0}, {32, 32, 1, 1}};
  // Blockwise FP8: any shape. Partial tiles and a gated H not a multiple of 128 (the flat tile);
  // whole tiles, two batches and the gated backward's tile of both halves; misaligned.
  std::vector<Shape> blkshapes = {{130, 150, 1, 0}, {256, 256, 2, 0}, {70, 40, 1, 1}};
  if (g_quick) {  // under compute-sanitizer
    tshapes.resize(3);
    mxshapes.resize(2);
    fp4shapes.resize(2);
    blkshapes.resize(2);
  }
  if (full && !g_quick) {
    tshapes.push_back({1031, 520, 1, 0});
    mxshapes.push_back({256, 1024, 2, 0});
    fp4shapes.push_back({160, 528, 1, 0});
    blkshapes.push_back({301, 520, 1, 0});
  }
  const bool bwds[] = {false, true};
  for (bool bwd : bwds) {
    if (bwd && ident) continue;
    // Groups for dbias: none, 1, several (more groups than row tiles too).
    const int64_t groups_list[] = {0, 1, 3, 9};
    int gi = 0;
    auto next_groups = [&] { return bwd ? groups_list[(gi++) % 4] : 0; };
    auto layouts = [&](auto&& fn) {
      fn(true, false);
      fn(false, true);
      fn(true, true);
    };
    layouts([&](bool row, bool col) {
      for (const Shape& sh : tshapes) {
        for (QM m : {QM::DELAYED, QM::CURRENT}) {
          const QType qt = (sh.M + sh.H + (m == QM::CURRENT)) % 2 ? QType::E5M2 : QType::E4M3;
          run_case<T>({act, bwd, m, qt, row, col, sh.M, sh.H, sh.B, next_groups(), sh.mis,
                       ident && sh.M * sh.H >= 256});
        }
      }
      for (const Shape& sh : mxshapes) {
        if (!col && !row) continue;
        for (QType qt : {QType::E4M3, QType::E5M2}) {
          run_case<T>({act, bwd, QM::MX, qt, row, col, sh.M, sh.H, sh.B, next_groups(), sh.mis,
                       sh.M * sh.H >= 256});
        }
      }
      for (const Shape& sh : fp4shapes) {
        run_case<T>({act, bwd, QM::NVFP4, QType::E2M1, row, col, sh.M, sh.H, sh.B, next_groups(),
                     sh.mis, sh.M * sh.H >= 256});
      }
      for (const Shape& sh : blkshapes) {
        for (QM m : {QM::BLOCK1D, QM::BLOCK2D}) {
          const QType qt = (sh.M + (m == QM::BLOCK2D)) % 2 ? QType::E5M2 : QType::E4M3;
          run_case<T>({act, bwd, m, qt, row, col, sh.M, sh.H, sh.B, next_groups(), sh.mis,
                       sh.M * sh.H >= 256 && m == QM::BLOCK1D});
        }
      }
    });
    // Colwise-only block modes with a hidden size that is no multiple of the block.
    run_case<T>({act, bwd, QM::MX, QType::E4M3, false, true, 64, 40, 2, next_groups(), 0, false});
    run_case<T>({act, bwd, QM::MX, QType::E5M2, false, true, 32, 13, 1, next_groups(), 0, false});
    run_case<T>(
        {act, bwd, QM::NVFP4, QType::E2M1, false, true, 32, 10, 1, next_groups(), 0, false});
    // The amax passes.
    for (const Shape& sh : tshapes) {
      run_case<T>({act, bwd, QM::AMAX, QType::E4M3, false, false, sh.M, sh.H, sh.B, next_groups(),
                   sh.mis, false});
    }
  }
}

// ---- timing -------------------------------------------------------------------------------------

float time_ms(const std::function<void()>& fn, int reps = 20) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    fn();
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// primitives/dact_dbias.py: quantized kernels aim at 8192 blocks (<= 512 groups), the
// unquantized one at 32768 (<= 2048 groups).
int64_t dbias_groups(int64_t rows, int64_t hidden, int64_t itemsize, bool quantized) {
  const int64_t target = quantized ? 8192 : 32768, max_groups = quantized ? 512 : 2048;
  const int64_t tile = 32 * (16 / itemsize);
  const int64_t col_tiles = std::max<int64_t>(1, (hidden + tile - 1) / tile);
  const int64_t want = (target + col_tiles - 1) / col_tiles;
  return std::max<int64_t>(1, std::min<int64_t>({max_groups, want, (rows + 63) / 64}));
}

// Bench inputs: values u * 2^e, u uniform in (-1, 1), e in [-4, 2], from a hash of the index.
template <typename T>
__global__ void fill_kernel(T* p, size_t n, uint32_t seed) {
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += stride) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    const float u = static_cast<float>(h >> 8) * 0x1p-23f - 1.0f;
    p[i] = static_cast<T>(ldexpf(u, static_cast<int>(h & 7u) - 4));
  }
}

void bench() {
  using T = __nv_bfloat16;
  const int64_t H = 4096, M = (int64_t{1} << 30) / (2 * H);  // x: 1 GiB of bf16 (non-gated)
  const size_t E = M * H;
  DevBuf<T> x(2 * E, 0), dz(E, 0);
  DevBuf<uint8_t> out(2 * E, 0), col(2 * E, 0), s1(E / 16, 0), s2(E / 16, 0);
  DevBuf<float> scale(1, 0), scale_inv(1, 0), amax(1, 0);
  DevBuf<float> ws(2048 * 2 * H, 0);
  DevBuf<T> dbias(2 * H, 0), ybuf(2 * E, 0);
  // Blockwise FP8's float32 scales: one per 128 elements of each copy (2D far fewer), padding.
  DevBuf<float> fs1(E / 128 + 4 * H, 0), fs2(E / 128 + 4 * H, 0);
  fill_kernel<<<4096, 256>>>(x.ptr, 2 * E, 1u);
  fill_kernel<<<4096, 256>>>(dz.ptr, E, 2u);
  CHECK_CUDA(cudaGetLastError());
  scale.upload({4.0f});
  cudaStream_t st = 0;
  const float t_copy = time_ms([&] {
    CHECK_CUDA(cudaMemcpyAsync(out.ptr, x.ptr, E * 2, cudaMemcpyDeviceToDevice, st));
  });
  const double copy_bw = 2.0 * E * 2 / (t_copy * 1e-3);  // read + write bytes per second
  std::printf("\ncopy of 1 GiB: %.3f ms, %.0f GB/s (read + write)\n", t_copy, copy_bw / 1e9);
  std::printf("%-58s %9s %11s %8s\n", "kernel (bf16, H=4096, x of 1 GiB per half)", "ms",
              "bytes/elem", "of copy");
  // BENCH_ONLY=substring: only the matching kernels, launched once each (for ncu).
  const char* only = std::getenv("BENCH_ONLY");
  auto report = [&](const char* name, float ms, double bytes_per_elem) {
    if (ms < 0) return;
    const double bw = bytes_per_elem * E / (ms * 1e-3);
    std::printf("%-58s %9.3f %11.3f %8.3f\n", name, ms, bytes_per_elem, bw / copy_bw);
  };
  auto measure = [&](const char* name, const std::function<void()>& fn, double bytes_per_elem) {
    if (only != nullptr) {
      if (std::strstr(name, only) == nullptr) return -1.0f;
      fn();
      CHECK_CUDA(cudaDeviceSynchronize());
      std::printf("ran %s\n", name);
      return -1.0f;
    }
    const float ms = time_ms(fn);
    report(name, ms, bytes_per_elem);
    return ms;
  };
  auto q_for = [&](ScalingMode m, bool row, bool colw, QType qt = QType::E4M3) {
    // As decode_quant_output sets it up (the two-pass modes' second pass derives its scale from
    // the amax).
    const ScalingModeInfo& info = *scaling_mode_info(m);
    QuantOutput q{};
    q.emit = info.emit;
    q.qtype = qt;
    q.batches = 1;
    if (info.reads != BatchInput::NONE) q.scale = scale.ptr;
    q.scale_numerator = scale_numerator(info, qt);
    if (row) q.data = out.ptr;
    if (colw) q.colwise = col.ptr;
    if (info.block == 0 || info.writes_global_scale_inv) q.scale_inv = scale_inv.ptr;
    if (info.block != 0 && row) q.block_scale = s1.ptr;
    if (info.block != 0 && colw) q.colwise_block_scale = s2.ptr;
    if (info.writes_amax) q.amax = amax.ptr;
    if (info.emit == QuantEmit::FP8_BLOCK) {  // float32 scales, power-of-two (the recipe's)
      q.block_scale = q.colwise_block_scale = nullptr;
      if (row) q.block_scale_f32 = fs1.ptr;
      if (colw) q.colwise_block_scale_f32 = fs2.ptr;
      q.block_2d = m == ScalingMode::FP8_BLOCK_2D_SCALING;
      q.power_2_scale = true;
    }
    return q;
  };
  cuda::LaunchConfig load;
  load.load_only = true;
  auto fwd = [&](ActivationEnum act, QuantOutput q, bool quantized = true) {
    ActLuProblem p{DType::BF16, act, ActParams{}, M, H, x.ptr, ybuf.ptr, amax.ptr};
    if (quantized) {
      p.quantized = true;
      p.q = q;
      p.y = nullptr;
      p.amax = nullptr;
    }
    CHECK_CUDA(cuda::launch_act_lu(p, st, load));  // the Initialize stage's part, untimed
    return [=] { CHECK_CUDA(cuda::launch_act_lu(p, st, {})); };
  };
  auto amax_pass = [&](ActivationEnum act) {
    QuantOutput q{};
    q.batches = 1;
    q.amax = amax.ptr;
    return fwd(act, q);
  };
  // The backward problem over the bench buffers: dz of 1/L GiB, x of 1 GiB (float32: half the rows,
  // the same bytes); with groups > 0, dbias through a workspace of that many groups.
  auto bwd_problem = [&](ActivationEnum act, DType dt, int64_t groups) {
    const int L = is_gated(act) ? 2 : 1;
    DActProblem p{};
    p.dtype = dt;
    p.act = act;
    p.act_len = L;
    p.rows = M / L / (dt == DType::F32 ? 2 : 1);
    p.hidden = H;
    p.dz = dz.ptr;
    p.x = x.ptr;
    p.dx = ybuf.ptr;
    if (groups > 0) {
      p.dbias = dbias.ptr;
      p.workspace = ws.ptr;
      p.batches = 1;
      p.groups = groups;
    }
    return p;
  };
  auto bwd = [&](ActivationEnum act, QuantOutput q, bool with_dbias, bool quantized = true) {
    const int64_t rows = M / (is_gated(act) ? 2 : 1);
    DActProblem p = bwd_problem(act, DType::BF16,
                                with_dbias ? dbias_groups(rows, H, 2, quantized) : 0);
    if (quantized) {
      p.quantized = true;
      p.q = q;
      p.dx = nullptr;
    } else {
      p.amax = amax.ptr;
    }
    CHECK_CUDA(cuda::launch_dact_dbias(p, st, load));  // the Initialize stage's part, untimed
    return [=] { CHECK_CUDA(cuda::launch_dact_dbias(p, st, {})); };
  };
  using SM = ScalingMode;
  const auto GELU = ActivationEnum::GELU, SWIGLU = ActivationEnum::SWIGLU;
  const auto ID = ActivationEnum::IDENTITY;
  const auto DELAYED = SM::DELAYED_TENSOR_SCALING, MX = SM::MXFP8_1D_SCALING;
  const auto FP4 = SM::NVFP4_1D_SCALING;
  const auto B1 = SM::FP8_BLOCK_1D_SCALING, B2 = SM::FP8_BLOCK_2D_SCALING;
  const double kB1 = 4.0 / 128;  // a float32 scale per 1x128 block, per copy
  const auto E2M1 = QType::E2M1;
  // Forward, non-gated: E elements of x (2 B) -> E outputs. Gated: x is 2E elements -> E outputs.
  measure("act_lu GELU NO_SCALING (+amax)", fwd(GELU, {}, false), 4);
  measure("act_lu GELU DELAYED e4m3 row", fwd(GELU, q_for(DELAYED, 1, 0)), 3);
  measure("act_lu GELU DELAYED e4m3 row+col(T)", fwd(GELU, q_for(DELAYED, 1, 1)), 4);
  measure("act_lu SWIGLU DELAYED e4m3 row (x 2E)", fwd(SWIGLU, q_for(DELAYED, 1, 0)), 5);
  {
    const float t1 = measure("act_lu GELU amax pass", amax_pass(GELU), 2);
    const float t2 = measure("act_lu GELU CURRENT e4m3 row: quantize pass",
                             fwd(GELU, q_for(SM::CURRENT_TENSOR_SCALING, 1, 0)), 3);
    if (t1 > 0 && t2 > 0) report("act_lu GELU CURRENT e4m3 row: both passes", t1 + t2, 5);
  }
  measure("act_lu GELU MXFP8 e4m3 row", fwd(GELU, q_for(MX, 1, 0)), 3 + 1.0 / 32);
  measure("act_lu GELU MXFP8 e4m3 row+col", fwd(GELU, q_for(MX, 1, 1)), 4 + 2.0 / 32);
  measure("act_lu SWIGLU MXFP8 e4m3 row+col (x 2E)", fwd(SWIGLU, q_for(MX, 1, 1)), 6 + 2.0 / 32);
  measure("act_lu GELU NVFP4 row", fwd(GELU, q_for(FP4, 1, 0, E2M1)), 2.5 + 1.0 / 16);
  measure("quantize DELAYED e4m3 row", fwd(ID, q_for(DELAYED, 1, 0)), 3);
  measure("quantize DELAYED e4m3 row+col(T)", fwd(ID, q_for(DELAYED, 1, 1)), 4);
  measure("quantize DELAYED e4m3 col(T)", fwd(ID, q_for(SM::DELAYED_TENSOR_SCALING, 0, 1)), 3);
  measure("quantize MXFP8 e4m3 row", fwd(ID, q_for(MX, 1, 0)), 3 + 1.0 / 32);
  measure("quantize MXFP8 e4m3 row+col", fwd(ID, q_for(MX, 1, 1)), 4 + 2.0 / 32);
  measure("quantize NVFP4 row", fwd(ID, q_for(FP4, 1, 0, E2M1)), 2.5 + 1.0 / 16);
  measure("quantize NVFP4 row+col", fwd(ID, q_for(FP4, 1, 1, E2M1)), 3 + 2.0 / 16);
  measure("quantize amax pass", amax_pass(ID), 2);
  measure("act_lu GELU BLOCK_1D e4m3 row", fwd(GELU, q_for(B1, 1, 0)), 3 + kB1);
  measure("act_lu GELU BLOCK_1D e4m3 row+col", fwd(GELU, q_for(B1, 1, 1)), 4 + 2 * kB1);
  measure("act_lu SWIGLU BLOCK_1D e4m3 row+col (x 2E)", fwd(SWIGLU, q_for(B1, 1, 1)),
          6 + 2 * kB1);
  measure("quantize BLOCK_1D e4m3 row+col", fwd(ID, q_for(B1, 1, 1)), 4 + 2 * kB1);
  measure("quantize BLOCK_2D e4m3 row+col", fwd(ID, q_for(B2, 1, 1)), 4);
  // Backward, per dx element: non-gated dz 2 + x 2 + out; gated (two dx elements per dz element):
  // dz 1 + x 2 + out.
  measure("dact_dbias GELU NO_SCALING (+amax)", bwd(GELU, {}, true, false), 6);
  measure("dact_dbias GELU DELAYED e4m3 row", bwd(GELU, q_for(DELAYED, 1, 0), true), 5);
  measure("dact_dbias GELU DELAYED e4m3 row+col(T)", bwd(GELU, q_for(DELAYED, 1, 1), true), 6);
  {
    QuantOutput qa{};
    qa.batches = 1;
    qa.amax = amax.ptr;
    const float t1 = measure("dact_dbias GELU amax pass (+dbias)", bwd(GELU, qa, true), 4);
    const float t2 = measure("dact GELU CURRENT e4m3 row: quantize pass (no dbias)",
                             bwd(GELU, q_for(SM::CURRENT_TENSOR_SCALING, 1, 0), false), 5);
    if (t1 > 0 && t2 > 0) report("dact_dbias GELU CURRENT: both passes", t1 + t2, 9);
  }
  // The unquantized dbias kernel's row groups (primitives/dact_dbias.py picks ~32768 blocks:
  // G = 2048 here in bf16, 1024 in float32).
  for (const DType dt : {DType::BF16, DType::F32}) {
    for (const int64_t groups : {256, 1024, 2048}) {
      const DActProblem p = bwd_problem(GELU, dt, groups);
      const std::string name = std::string("dact_dbias GELU NO_SCALING ") +
                               (dt == DType::F32 ? "float32" : "bf16") + " groups " +
                               std::to_string(groups);
      measure(name.c_str(), [=] { CHECK_CUDA(cuda::launch_dact_dbias(p, st, {})); }, 6);
    }
  }
  measure("dact_dbias SWIGLU NO_SCALING (+amax) [per dx elem]", bwd(SWIGLU, {}, true, false), 5);
  measure("dact_dbias SWIGLU DELAYED e4m3 row", bwd(SWIGLU, q_for(DELAYED, 1, 0), true), 4);
  {
    QuantOutput qa{};
    qa.batches = 1;
    qa.amax = amax.ptr;
    const float t1 = measure("dact_dbias SWIGLU amax pass (+dbias)", bwd(SWIGLU, qa, true), 3);
    const float t2 = measure("dact SWIGLU CURRENT: quantize pass (no dbias)",
                             bwd(SWIGLU, q_for(SM::CURRENT_TENSOR_SCALING, 1, 0), false), 4);
    if (t1 > 0 && t2 > 0) report("dact_dbias SWIGLU CURRENT: both passes", t1 + t2, 7);
  }
  measure("dact_dbias SWIGLU MXFP8 row+col", bwd(SWIGLU, q_for(MX, 1, 1), true), 5 + 2.0 / 32);
  measure("dact_dbias GELU MXFP8 row+col", bwd(GELU, q_for(MX, 1, 1), true), 6 + 2.0 / 32);
  measure("dact_dbias GELU BLOCK_1D row+col", bwd(GELU, q_for(B1, 1, 1), true), 6 + 2 * kB1);
  measure("dact_dbias SWIGLU BLOCK_1D row+col", bwd(SWIGLU, q_for(B1, 1, 1), true), 5 + 2 * kB1);
  measure("dact_dbias GELU NVFP4 row",
          bwd(GELU, q_for(FP4, 1, 0, QType::E2M1), true), 4.5 + 1.0 / 16);
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  bool do_bench = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      g_quick = true;
    } else if (std::strcmp(argv[i], "--bench") == 0) {
      do_bench = true;
    } else {
      only = argv[i];
    }
  }
  int dev = 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs%s\n", prop.name, prop.multiProcessorCount,
              g_quick ? " (quick)" : "");
  if (do_bench) {
    bench();
    return 0;
  }
  if (only.empty()) test_load_only();
  for (const ActivationEnum act : kActivations) {
    if (!only.empty() && only != activation_name(act)) continue;
    // The full matrix for a few activations; every activation in its forward and backward at
    // bf16, and float32 / float16 on a subset.
    const bool full = act == ActivationEnum::GELU || act == ActivationEnum::SWIGLU ||
                      act == ActivationEnum::IDENTITY || act == ActivationEnum::CLAMPED_SWIGLU ||
                      !only.empty();
    run_matrix<__nv_bfloat16>(act, full);
    if (!g_quick && (full || static_cast<int64_t>(act) % 3 == 0)) {
      run_matrix<float>(act, full);
      run_matrix<__half>(act, full);
    }
    std::printf("%-15s done (%d cases, %d failed so far)\n", activation_name(act), g_checks,
                g_failed_checks);
  }
  if (only.empty()) test_graph();
  std::printf("%d passed, %d failed\n", g_checks - g_failed_checks, g_failed_checks);
  return g_failed_checks ? 1 : 0;
}
