// The activation family on the CPU backend: a decoded problem runs on the FFI thread pool
// (kernels.h).
#pragma once

#include "activation/cpu/kernels.h"
#include "activation/problem.h"
#include "cpu/backend.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::cpu {

struct ActivationBackend : Backend {
  template <::xla::ffi::ExecutionStage>
  static ::xla::ffi::Error run(const char*, const ActLuProblem& p, ::xla::ffi::ThreadPool pool) {
    act_lu(p, &pool);
    return ::xla::ffi::Error::Success();
  }
  template <::xla::ffi::ExecutionStage>
  static ::xla::ffi::Error run(const char*, const DActProblem& p, ::xla::ffi::ThreadPool pool) {
    dact_dbias(p, &pool);
    return ::xla::ffi::Error::Success();
  }
};

}  // namespace te_jax::cpu
