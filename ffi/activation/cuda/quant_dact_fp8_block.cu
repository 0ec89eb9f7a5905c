// dact_dbias on CUDA: FP8_BLOCK_1D_SCALING and FP8_BLOCK_2D_SCALING (quantize/fp8_block.cuh), with
// or without dbias; its own translation unit so it compiles in parallel.
#include "activation/cuda/quantize/fp8_block.cuh"

namespace te_jax::cuda {

cudaError_t launch_dact_q_fp8_block(const DActProblem& p, cudaStream_t stream,
                                    const LaunchConfig& cfg) {
  const quant::QuantizeCall call = quant::backward_call(p);
  return quant::dispatch_act_dtype<true>(p.act, p.dtype, [&](auto spec, auto t) {
    return quant::launch_fp8_block<decltype(spec), typename decltype(t)::type, true>(call, stream,
                                                                                 cfg);
  });
}

}  // namespace te_jax::cuda
