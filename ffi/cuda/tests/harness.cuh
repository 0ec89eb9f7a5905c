// What the standalone CUDA test programs (kernel_test, quant_test) share: CUDA error checking,
// case and failure counting, host-side dtype traits, device buffers with a misaligning offset.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "activation/activations.h"
#include "activation/cuda/launch.h"
#include "activation/problem.h"
#include "cuda/tests/check_cuda.h"

namespace te_jax_test {

using te_jax::ActivationEnum;
using te_jax::DType;

inline int g_checks = 0;         // test cases run
inline int g_failed_checks = 0;  // test cases with at least one failure
inline int g_failures = 0;       // failure messages
inline bool g_quick = false;

inline void fail(const std::string& what) {
  ++g_failures;
  if (g_failures <= 60) std::printf("FAIL: %s\n", what.c_str());
}

// One test case: counted once, failed if any fail() happened inside it.
struct Case {
  int before;
  Case() : before(g_failures) { ++g_checks; }
  ~Case() {
    if (g_failures > before) ++g_failed_checks;
  }
};

// Host-side dtype traits; kTol is docs/numerics.md §7's tolerance.
template <typename T> struct DT;
template <> struct DT<float> {
  static constexpr DType kType = DType::F32;
  static constexpr const char* kName = "f32";
  static constexpr double kTol = 2e-5;
  static float to(float v) { return v; }
  static float from(float v) { return v; }
};
template <> struct DT<__nv_bfloat16> {
  static constexpr DType kType = DType::BF16;
  static constexpr const char* kName = "bf16";
  static constexpr double kTol = 1.0 / 128;
  static float to(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};
template <> struct DT<__half> {
  static constexpr DType kType = DType::F16;
  static constexpr const char* kName = "f16";
  static constexpr double kTol = 1.0 / 1024;
  static float to(__half v) { return __half2float(v); }
  static __half from(float v) { return __float2half_rn(v); }
};

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A device allocation with `offset_bytes` of slack in front (not a multiple of 16: misaligned).
template <typename T>
struct DevBuf {
  char* base = nullptr;
  T* ptr = nullptr;
  size_t n = 0;
  DevBuf() = default;
  DevBuf(size_t count, int offset_bytes) { alloc(count, offset_bytes); }
  void alloc(size_t count, int offset_bytes) {
    n = count;
    CHECK_CUDA(cudaMalloc(&base, count * sizeof(T) + offset_bytes + 64));
    ptr = reinterpret_cast<T*>(base + offset_bytes);
  }
  ~DevBuf() {
    if (base) cudaFree(base);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  T* get() const { return n ? ptr : nullptr; }
  void upload(const std::vector<T>& h) {
    if (n) CHECK_CUDA(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  void poison() {  // 0xFF bytes: NaN in every float type
    if (n) CHECK_CUDA(cudaMemset(ptr, 0xFF, n * sizeof(T)));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    if (n) CHECK_CUDA(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// What XLA does with a command buffer: `enqueue(cfg)` (the op's launches on s, returning the first
// error) once with load_only (the Initialize stage), then captured in global mode (the strictest)
// and the graph replayed twice. False, after fail(), when a launch under capture failed.
template <typename Enqueue>
bool replay_in_graph(cudaStream_t s, Enqueue enqueue, const std::string& tag) {
  te_jax::cuda::LaunchConfig load;
  load.load_only = true;
  CHECK_CUDA(enqueue(load));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const cudaError_t e = enqueue(te_jax::cuda::LaunchConfig{});
  CHECK_CUDA(cudaStreamEndCapture(s, &graph));
  if (e != cudaSuccess) {
    fail(tag + ": launch under capture failed: " + cudaGetErrorString(e));
    CHECK_CUDA(cudaGraphDestroy(graph));
    return false;
  }
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 2; ++rep) CHECK_CUDA(cudaGraphLaunch(exec, s));
  CHECK_CUDA(cudaStreamSynchronize(s));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return true;
}

}  // namespace te_jax_test
