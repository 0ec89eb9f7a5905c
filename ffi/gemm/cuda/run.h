// The GEMM family on the CUDA backend: a decoded problem runs as one cuBLASLt matmul
// (cublaslt_gemm.cc). Initialize loads cuBLASLt, creates the device's handle and picks the
// algorithm (cached per problem); execute looks it up and enqueues the matmul on the stream.
#pragma once

#include <cuda_runtime.h>

#include "cuda/backend.h"
#include "gemm/problem.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::cuda {

struct GemmBackend : Backend {
  template <::xla::ffi::ExecutionStage S>
  static ::xla::ffi::Error run(const char* op, const gemm::GemmProblem& p, cudaStream_t stream);
};

}  // namespace te_jax::cuda
