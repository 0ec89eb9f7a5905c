// act_lu / quantize on CUDA: FP8_BLOCK_1D_SCALING and FP8_BLOCK_2D_SCALING (quantize/fp8_block.cuh),
// one instantiation per (activation, dtype); its own translation unit so it compiles in parallel.
#include "activation/cuda/quantize/fp8_block.cuh"

namespace te_jax::cuda {

cudaError_t launch_act_lu_q_fp8_block(const ActLuProblem& p, cudaStream_t stream,
                                      const LaunchConfig& cfg) {
  const quant::Fp8BlockCall call{p.x, nullptr, p.rows, p.hidden, p.params, &p.q, nullptr, nullptr, 0};
  cudaError_t err = cudaErrorInvalidValue;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    switch (p.dtype) {
      case DType::F32: err = quant::launch_fp8_block<Spec, float, false>(call, stream, cfg); break;
      case DType::BF16: err = quant::launch_fp8_block<Spec, __nv_bfloat16, false>(call, stream, cfg); break;
      case DType::F16: err = quant::launch_fp8_block<Spec, __half, false>(call, stream, cfg); break;
    }
  });
  return err;
}

}  // namespace te_jax::cuda
