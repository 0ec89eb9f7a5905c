// act_lu / quantize on CUDA, generic path: the amax pass (max|y| per batch). One instantiation of
// quantize.cuh's kernel per (activation, dtype); one translation unit per mode so they compile in
// parallel.
#include "activation/cuda/quantize.cuh"

namespace te_jax::cuda {

cudaError_t launch_act_lu_q_amax(const ActLuProblem& p, cudaStream_t stream,
                                 const LaunchConfig& cfg) {
  return quant::dispatch_forward<QuantEmit::AMAX_PASS>(p, stream, cfg);
}

}  // namespace te_jax::cuda
