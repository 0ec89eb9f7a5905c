// Standalone GPU check of ffi/common/formats.h, without XLA or Python: the device conversions
// (cvt.rn.satfinite for E4M3/E5M2 on sm_89+, the portable code otherwise) against the host
// versions compiled in this same file, which tools/check_formats.py checks against ml_dtypes.
//   - to_e4m3 / to_e5m2 / to_e2m1, the x2 forms and e8m0_exponent / e8m0_biased (q_max 448 and
//     57344) for every float32 bit pattern, in chunks of 2^28: the host computes the expected
//     codes (all cores), the device compares. E4M3/E5M2 are also run through the portable code on
//     the device (what the compute_80 PTX runs), so both device paths are covered on sm_89+.
//   - from_* for every byte.
//   - mul_pow2 for ~1M y (a stride over all bit patterns plus edge cases) and every k in
//     [-252, 252]: equal to the host bits (any NaN for NaN), and correctly rounded wherever
//     |y 2^k| >= 2^-126 (against the exact product in double).
// Prints the mismatch count per check and the first few mismatches; exit status 1 on any.
//
// Build and run from the repository root (no GPU needed to build; the run should take well
// under a minute, mostly the host computing the expected codes on all cores):
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
//     -gencode=arch=compute_80,code=compute_80 -Iffi ffi/cuda/tests/formats_test.cu
//     -o /tmp/formats_test && /tmp/formats_test
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/formats.h"
#include "cuda/tests/check_cuda.h"

namespace fmt = te_jax::fmt;
namespace hb = te_jax::math::host::bits;

namespace {

enum Check {
  kE4M3, kE4M3Portable, kE4M3x2, kE5M2, kE5M2Portable, kE5M2x2, kE2M1, kE2M1x2,
  kE8M0_448, kE8M0_57344, kDecE4M3, kDecE5M2, kDecE2M1, kMulPow2Host, kMulPow2Exact, kNumChecks
};
const char* const kNames[kNumChecks] = {
    "to_e4m3", "to_e4m3 (portable)", "to_e4m3x2", "to_e5m2", "to_e5m2 (portable)", "to_e5m2x2",
    "to_e2m1", "to_e2m1x2", "e8m0 q=448", "e8m0 q=57344", "from_e4m3", "from_e5m2",
    "from_e2m1", "mul_pow2 == host", "mul_pow2 exact"};

constexpr int kMaxRecords = 40;
struct Record {
  int check, k;  // k: mul_pow2's exponent, else 0
  uint32_t input, got, want;
};
struct Report {
  unsigned long long count[kNumChecks];
  unsigned int n_records;
  Record rec[kMaxRecords];
};

__device__ void record(Report* r, int check, uint32_t input, uint32_t got, uint32_t want,
                       int k = 0) {
  atomicAdd(&r->count[check], 1ull);
  const unsigned int slot = atomicAdd(&r->n_records, 1u);
  if (slot < kMaxRecords) r->rec[slot] = Record{check, k, input, got, want};
}

// Expected codes for one chunk of bit patterns, computed on the host.
struct Expected {
  uint8_t *e4m3, *e5m2, *e2m1, *e8m0_448, *e8m0_57344;
};

constexpr uint64_t kChunk = 1ull << 28;

void host_expected(uint64_t base, const Expected& x) {
  const unsigned n_threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < n_threads; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t lo = kChunk * t / n_threads, hi = kChunk * (t + 1) / n_threads;
      for (uint64_t i = lo; i < hi; ++i) {
        const float v = hb::to_float(static_cast<uint32_t>(base + i));
        x.e4m3[i] = fmt::to_e4m3(v);
        x.e5m2[i] = fmt::to_e5m2(v);
        x.e2m1[i] = fmt::to_e2m1(v);
        x.e8m0_448[i] = fmt::e8m0_biased(v, 448.0f);
        x.e8m0_57344[i] = fmt::e8m0_biased(v, 57344.0f);
      }
    });
  }
  for (auto& th : threads) th.join();
}

__global__ void encode_kernel(uint64_t base, Expected x, Report* r) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < kChunk;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t u = static_cast<uint32_t>(base + i);
    const float v = __uint_as_float(u);
    const uint64_t j = i ^ 1u;  // the partner of the x2 forms
    const float w = __uint_as_float(static_cast<uint32_t>(base + j));

    uint32_t c = fmt::to_e4m3(v);
    if (c != x.e4m3[i]) record(r, kE4M3, u, c, x.e4m3[i]);
    c = fmt::detail::to_e4m3(v);
    if (c != x.e4m3[i]) record(r, kE4M3Portable, u, c, x.e4m3[i]);
    c = fmt::to_e4m3x2(v, w);
    uint32_t want = x.e4m3[i] | (x.e4m3[j] << 8);
    if (c != want) record(r, kE4M3x2, u, c, want);

    c = fmt::to_e5m2(v);
    if (c != x.e5m2[i]) record(r, kE5M2, u, c, x.e5m2[i]);
    c = fmt::detail::to_e5m2(v);
    if (c != x.e5m2[i]) record(r, kE5M2Portable, u, c, x.e5m2[i]);
    c = fmt::to_e5m2x2(v, w);
    want = x.e5m2[i] | (x.e5m2[j] << 8);
    if (c != want) record(r, kE5M2x2, u, c, want);

    c = fmt::to_e2m1(v);
    if (c != x.e2m1[i]) record(r, kE2M1, u, c, x.e2m1[i]);
    c = fmt::to_e2m1x2(v, w);
    want = x.e2m1[i] | (x.e2m1[j] << 4);
    if (c != want) record(r, kE2M1x2, u, c, want);

    // Biased code; the exponent must be the same number minus 127.
    c = fmt::e8m0_biased(v, 448.0f);
    if (c != x.e8m0_448[i] || fmt::e8m0_exponent(v, 448.0f) + 127 != int(c))
      record(r, kE8M0_448, u, c, x.e8m0_448[i]);
    c = fmt::e8m0_biased(v, 57344.0f);
    if (c != x.e8m0_57344[i] || fmt::e8m0_exponent(v, 57344.0f) + 127 != int(c))
      record(r, kE8M0_57344, u, c, x.e8m0_57344[i]);
  }
}

__global__ void decode_kernel(const uint32_t* want, Report* r) {  // want: [3][256] float bits
  const uint32_t c = threadIdx.x;
  const uint32_t got[3] = {__float_as_uint(fmt::from_e4m3(static_cast<uint8_t>(c))),
                           __float_as_uint(fmt::from_e5m2(static_cast<uint8_t>(c))),
                           __float_as_uint(fmt::from_e2m1(static_cast<uint8_t>(c)))};
  for (int f = 0; f < 3; ++f)
    if (got[f] != want[f * 256 + c]) record(r, kDecE4M3 + f, c, got[f], want[f * 256 + c]);
}

__device__ bool same_value(uint32_t a, uint32_t b) {  // equal bits, or both NaN
  return a == b || (isnan(__uint_as_float(a)) && isnan(__uint_as_float(b)));
}

__global__ void mul_pow2_kernel(const float* y, const float* host, int n, int k, Report* r) {
  const double p2k = __longlong_as_double(static_cast<long long>(k + 1023) << 52);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint32_t got = __float_as_uint(fmt::mul_pow2(y[i], k));
    const uint32_t h = __float_as_uint(host[i]);
    // NaN: the GPU's multiply returns its canonical NaN, the CPU's the quieted input.
    if (!same_value(got, h)) record(r, kMulPow2Host, __float_as_uint(y[i]), got, h, k);
    const double exact = static_cast<double>(y[i]) * p2k;  // exact in double
    const uint32_t want = __float_as_uint(__double2float_rn(exact));
    const bool tiny = fabs(exact) < 0x1p-126;
    const bool ok = tiny ? fabsf(__uint_as_float(got)) <= 0x1p-126f : same_value(got, want);
    if (!ok) record(r, kMulPow2Exact, __float_as_uint(y[i]), got, want, k);
  }
}

}  // namespace

int main() {
  const auto t0 = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  const int grid = prop.multiProcessorCount * 8;

  Report* report;
  CHECK_CUDA(cudaMallocManaged(&report, sizeof(Report)));
  std::memset(report, 0, sizeof(Report));

  // ---- encode + e8m0: every bit pattern, chunk by chunk.
  Expected h{}, d{};
  uint8_t** hp[5] = {&h.e4m3, &h.e5m2, &h.e2m1, &h.e8m0_448, &h.e8m0_57344};
  uint8_t** dp[5] = {&d.e4m3, &d.e5m2, &d.e2m1, &d.e8m0_448, &d.e8m0_57344};
  for (int a = 0; a < 5; ++a) {
    CHECK_CUDA(cudaMallocHost(hp[a], kChunk));
    CHECK_CUDA(cudaMalloc(dp[a], kChunk));
  }
  for (uint64_t base = 0; base < (1ull << 32); base += kChunk) {
    host_expected(base, h);
    for (int a = 0; a < 5; ++a)
      CHECK_CUDA(cudaMemcpy(*dp[a], *hp[a], kChunk, cudaMemcpyHostToDevice));
    encode_kernel<<<grid, 256>>>(base, d, report);
    CHECK_CUDA(cudaGetLastError());
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::printf("encode + e8m0 over all 2^32 floats: %.1f s\n", seconds());

  // ---- decode: every byte.
  uint32_t* dec;
  CHECK_CUDA(cudaMallocManaged(&dec, 3 * 256 * sizeof(uint32_t)));
  for (uint32_t c = 0; c < 256; ++c) {
    dec[c] = hb::of(fmt::from_e4m3(static_cast<uint8_t>(c)));
    dec[256 + c] = hb::of(fmt::from_e5m2(static_cast<uint8_t>(c)));
    dec[512 + c] = hb::of(fmt::from_e2m1(static_cast<uint8_t>(c)));
  }
  decode_kernel<<<1, 256>>>(dec, report);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());

  // ---- mul_pow2: a sample of y, every k.
  std::vector<float> y;
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) y.push_back(hb::to_float(uint32_t(u)));
  for (uint32_t u : {0x00000000u, 0x00000001u, 0x00400000u, 0x007fffffu, 0x00800000u,
                     0x00ffffffu, 0x3f800000u, 0x7f7fffffu, 0x7f800000u, 0x7fc00000u}) {
    y.push_back(hb::to_float(u));
    y.push_back(hb::to_float(u | 0x80000000u));
  }
  const int n = static_cast<int>(y.size());
  std::vector<float> host(n);
  float *dy, *dhost;
  CHECK_CUDA(cudaMalloc(&dy, n * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dhost, n * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  for (int k = -252; k <= 252; ++k) {
    for (int i = 0; i < n; ++i) host[i] = fmt::mul_pow2(y[i], k);
    CHECK_CUDA(cudaMemcpy(dhost, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    mul_pow2_kernel<<<grid, 256>>>(dy, dhost, n, k, report);
    CHECK_CUDA(cudaGetLastError());
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::printf("mul_pow2: %d y x 505 k; total %.1f s\n", n, seconds());

  // ---- report.
  unsigned long long total = 0;
  for (int c = 0; c < kNumChecks; ++c) {
    std::printf("  %-20s %llu mismatches\n", kNames[c], report->count[c]);
    total += report->count[c];
  }
  const unsigned int shown = std::min<unsigned int>(report->n_records, kMaxRecords);
  for (unsigned int i = 0; i < shown; ++i) {
    const Record& m = report->rec[i];
    std::printf("MISMATCH %s: input 0x%08x (%g)%s got 0x%08x want 0x%08x\n", kNames[m.check],
                m.input, double(hb::to_float(m.input)),
                m.check >= kMulPow2Host ? (" k=" + std::to_string(m.k)).c_str() : "", m.got,
                m.want);
  }
  std::printf(total == 0 ? "PASS\n" : "FAIL\n");
  return total == 0 ? 0 : 1;
}
