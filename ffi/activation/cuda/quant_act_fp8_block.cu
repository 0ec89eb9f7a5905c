// act_lu / quantize on CUDA: FP8_BLOCK_1D_SCALING and FP8_BLOCK_2D_SCALING (quantize/fp8_block.cuh),
// one instantiation per (activation, dtype); its own translation unit so it compiles in parallel.
#include "activation/cuda/quantize/fp8_block.cuh"

namespace te_jax::cuda {

cudaError_t launch_act_lu_q_fp8_block(const ActLuProblem& p, cudaStream_t stream,
                                      const LaunchConfig& cfg) {
  const quant::QuantizeCall call = quant::forward_call(p);
  return quant::dispatch_act_dtype<false>(p.act, p.dtype, [&](auto spec, auto t) {
    return quant::launch_fp8_block<decltype(spec), typename decltype(t)::type, false>(call, stream,
                                                                                 cfg);
  });
}

}  // namespace te_jax::cuda
