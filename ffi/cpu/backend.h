// What every CPU handler shares, whatever its op family: the FFI thread pool as context (rows are
// split over it; see parallel.h) and the execute stage only. A family's CPU backend
// (e.g. activation/cpu/run.h) derives from it and adds run<S>(op, problem, pool).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace te_jax::cpu {

struct Backend {
  using Context = ::xla::ffi::ThreadPool;
  static constexpr bool cmd_buffer_compatible(::xla::ffi::ExecutionStage) { return false; }
};

}  // namespace te_jax::cpu
