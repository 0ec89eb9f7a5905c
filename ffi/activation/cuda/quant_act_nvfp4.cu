// act_lu / quantize on CUDA, generic path: NVFP4_1D_SCALING. One instantiation of quantize.cuh's
// kernel per (activation, dtype); one translation unit per mode so they compile in parallel.
#include "activation/cuda/quantize.cuh"

namespace te_jax::cuda {

cudaError_t launch_act_lu_q_nvfp4(const ActLuProblem& p, cudaStream_t stream,
                                  const LaunchConfig& cfg) {
  return quant::dispatch_forward<QuantEmit::NVFP4>(p, stream, cfg);
}

}  // namespace te_jax::cuda
