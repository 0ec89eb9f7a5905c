// What every CUDA handler shares, whatever its op family. Each target has two stages:
//   execute     decodes the call and enqueues the kernels on the given stream. It never
//               synchronises, allocates, queries the device or reads device memory, so it carries
//               ffi::Traits::kCmdBufferCompatible and XLA may capture it in a CUDA graph.
//   initialize  runs before each execution, outside capture, and does what capture forbids:
//               loads the kernels the call will use into the current context (lazy module
//               loading during capture, or while NCCL kernels run, fails or hangs).
// A family's CUDA backend (e.g. activation/cuda/run.h) derives from Backend and adds
// run<S>(op, problem, stream).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace te_jax::cuda {

struct Backend {
  using Context = ::xla::ffi::PlatformStream<cudaStream_t>;
  static constexpr bool cmd_buffer_compatible(::xla::ffi::ExecutionStage s) {
    return s == ::xla::ffi::ExecutionStage::kExecute;
  }
  // Whether stage S only loads the kernels (initialize) instead of launching them (execute).
  template <::xla::ffi::ExecutionStage S>
  static constexpr bool kLoadOnly = S == ::xla::ffi::ExecutionStage::kInitialize;

  // The launchers' status as the handler's error (ffi::Error::Internal naming the op).
  template <::xla::ffi::ExecutionStage S>
  static ::xla::ffi::Error status(const char* op, cudaError_t e) {
    if (e == cudaSuccess) return ::xla::ffi::Error::Success();
    return ::xla::ffi::Error::Internal(
        std::string(op) + ": " + (kLoadOnly<S> ? "loading the kernels" : "kernel launch failed") +
        ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  }
};

}  // namespace te_jax::cuda
