// dact_dbias on CUDA, generic path: DELAYED / CURRENT tensor scaling. One instantiation of
// quantize.cuh's kernel per (activation, dtype); one translation unit per mode so they compile in
// parallel.
#include "activation/cuda/quantize.cuh"

namespace te_jax::cuda {

cudaError_t launch_dact_q_tensor(const DActProblem& p, cudaStream_t stream,
                                 const LaunchConfig& cfg) {
  return quant::dispatch_backward<QuantEmit::TENSOR>(p, stream, cfg);
}

}  // namespace te_jax::cuda
