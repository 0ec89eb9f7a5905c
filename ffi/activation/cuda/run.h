// The activation family on the CUDA backend: a decoded problem is enqueued on the stream
// (execute) or has its kernels loaded (initialize, LaunchConfig::load_only); launch.h.
#pragma once

#include <cuda_runtime.h>

#include "activation/cuda/launch.h"
#include "activation/problem.h"
#include "cuda/backend.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::cuda {

struct ActivationBackend : Backend {
  template <::xla::ffi::ExecutionStage S>
  static ::xla::ffi::Error run(const char* op, const ActLuProblem& p, cudaStream_t stream) {
    return status<S>(op, launch_act_lu(p, stream, config<S>()));
  }
  template <::xla::ffi::ExecutionStage S>
  static ::xla::ffi::Error run(const char* op, const DActProblem& p, cudaStream_t stream) {
    return status<S>(op, launch_dact_dbias(p, stream, config<S>()));
  }

 private:
  template <::xla::ffi::ExecutionStage S>
  static LaunchConfig config() {
    LaunchConfig cfg;
    cfg.load_only = kLoadOnly<S>;
    return cfg;
  }
};

}  // namespace te_jax::cuda
