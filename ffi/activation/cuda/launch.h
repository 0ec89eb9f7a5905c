// Host entry points of the activation family's CUDA kernels, called by its CUDA backend (run.h).
//
// Each launcher takes a decoded problem (activation/problem.h) and enqueues its kernels on
// `stream` and nothing else: no synchronisation, no allocation, no device queries, no reads of device
// memory; so the execute handlers may be captured into CUDA graphs. With `load_only` the launcher
// instead calls cudaFuncGetAttributes on every kernel the problem may use (which loads the module
// into the current context) and launches nothing: that is the Initialize stage's job, done
// outside graph capture.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "activation/problem.h"

namespace te_jax::cuda {

struct LaunchConfig {
  // Launch nothing; load every kernel the problem may use (the Initialize stage).
  bool load_only = false;
  // Cap on the elementwise kernels' grid (0: one block per chunk of work, the fast default).
  // Results never depend on it; tests set it to exercise the grid-stride loop.
  unsigned max_blocks = 0;
};

// te_jax_act_lu (and te_jax_quantize, te_jax_act_amax: act = IDENTITY / the amax pass).
// NO_SCALING: y = act(x) (gated: act(x[:, 0, :]) * lin(x[:, 1, :])), and optionally amax =
// max|y| (float32) over y rounded to its dtype. p.quantized: emits through p.q.
cudaError_t launch_act_lu(const ActLuProblem& p, cudaStream_t stream, const LaunchConfig& cfg);

// te_jax_dact_dbias_quantize (and te_jax_dact_dbias_amax). NO_SCALING: dx = dact(dz, x),
// optionally dbias (deterministic two-stage reduction through the workspace) and amax = max|dx|.
// p.quantized: emits dx through p.q (dbias as before).
cudaError_t launch_dact_dbias(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg);

// The generic path (p.quantized: the scaled modes, and the amax passes, q.emit == AMAX_PASS)
// of launch_act_lu / launch_dact_dbias, one translation unit per mode
// (quant_{act,dact}_{tensor,mx,nvfp4,amax}.cu, kernels in quantize.cuh; quant_{act,dact}_fp8_block.cu,
// the blockwise FP8 kernel of quantize/fp8_block.cuh). launch_act_lu and launch_dact_dbias
// dispatch to them.
cudaError_t launch_act_lu_q_tensor(const ActLuProblem& p, cudaStream_t stream,
                                   const LaunchConfig& cfg);
cudaError_t launch_act_lu_q_mx(const ActLuProblem& p, cudaStream_t stream, const LaunchConfig& cfg);
cudaError_t launch_act_lu_q_nvfp4(const ActLuProblem& p, cudaStream_t stream,
                                  const LaunchConfig& cfg);
cudaError_t launch_act_lu_q_amax(const ActLuProblem& p, cudaStream_t stream,
                                 const LaunchConfig& cfg);
cudaError_t launch_act_lu_q_fp8_block(const ActLuProblem& p, cudaStream_t stream,
                                      const LaunchConfig& cfg);
cudaError_t launch_dact_q_tensor(const DActProblem& p, cudaStream_t stream,
                                 const LaunchConfig& cfg);
cudaError_t launch_dact_q_mx(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg);
cudaError_t launch_dact_q_nvfp4(const DActProblem& p, cudaStream_t stream,
                                const LaunchConfig& cfg);
cudaError_t launch_dact_q_amax(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg);
cudaError_t launch_dact_q_fp8_block(const DActProblem& p, cudaStream_t stream,
                                    const LaunchConfig& cfg);

// The dbias finalize kernel (dact_dbias.cu): dbias[b, c] = sum over g of ws[b, g, c] in a fixed
// order (32 contiguous ranges of groups, each in order, then the ranges in order), rounded to
// dtype; ws is [batches, groups, n]. With load_only, only loads it.
cudaError_t launch_dbias_finalize(const float* ws, void* dbias, DType dtype, uint64_t n,
                                  uint64_t groups, uint64_t batches, cudaStream_t stream,
                                  bool load_only);

// The dbias branch of launch_dact_dbias (p.dbias != nullptr), in its own translation unit
// (dact_dbias.cu) so the two halves compile in parallel.
cudaError_t launch_dact_with_dbias(const DActProblem& p, cudaStream_t stream,
                                   const LaunchConfig& cfg);

}  // namespace te_jax::cuda
