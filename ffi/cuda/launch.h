// Host entry points of the te_jax CUDA kernels, called by the FFI handlers (handlers.cc).
//
// Each launcher takes a decoded problem (common/problem.h) and enqueues its kernels on `stream`
// and nothing else: no synchronisation, no allocation, no device queries, no reads of device
// memory; so the execute handlers may be captured into CUDA graphs. With `load_only` the launcher
// instead calls cudaFuncGetAttributes on every kernel the problem may use (which loads the module
// into the current context) and launches nothing: that is the Initialize stage's job, done
// outside graph capture.
#pragma once

#include <cuda_runtime.h>

#include "common/problem.h"

namespace te_jax::cuda {

struct LaunchConfig {
  // Launch nothing; load every kernel the problem may use (the Initialize stage).
  bool load_only = false;
  // Cap on the elementwise kernels' grid (0: one block per chunk of work, the fast default).
  // Results never depend on it; tests set it to exercise the grid-stride loop.
  unsigned max_blocks = 0;
};

// te_jax_act_lu, NO_SCALING: y = act(x) (gated: act(x[:, 0, :]) * lin(x[:, 1, :])), and
// optionally amax = max|y| (float32) over y rounded to its dtype.
cudaError_t launch_act_lu(const ActLuProblem& p, cudaStream_t stream, const LaunchConfig& cfg);

// te_jax_dact_dbias_quantize, NO_SCALING: dx = dact(dz, x), optionally dbias (deterministic
// two-stage reduction through the workspace) and amax = max|dx|.
cudaError_t launch_dact_dbias(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg);

// The dbias branch of launch_dact_dbias (p.dbias != nullptr), in its own translation unit
// (dact_dbias.cu) so the two halves compile in parallel.
cudaError_t launch_dact_with_dbias(const DActProblem& p, cudaStream_t stream,
                                   const LaunchConfig& cfg);

}  // namespace te_jax::cuda
