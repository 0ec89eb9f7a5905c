// dact_dbias on CUDA: FP8_BLOCK_1D_SCALING and FP8_BLOCK_2D_SCALING (quantize/fp8_block.cuh), with
// or without dbias; its own translation unit so it compiles in parallel.
#include "activation/cuda/quantize/fp8_block.cuh"

namespace te_jax::cuda {

cudaError_t launch_dact_q_fp8_block(const DActProblem& p, cudaStream_t stream,
                                    const LaunchConfig& cfg) {
  const quant::Fp8BlockCall call{p.x,      p.dz, p.rows,  p.hidden, p.params, &p.q,
                          p.dbias != nullptr ? p.workspace : nullptr, p.dbias, p.groups};
  cudaError_t err = cudaErrorInvalidValue;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    if constexpr (!Spec::kGated && std::is_same_v<typename Spec::Act, act::Identity>) {
      err = cudaErrorInvalidValue;
    } else {
      switch (p.dtype) {
        case DType::F32: err = quant::launch_fp8_block<Spec, float, true>(call, stream, cfg); break;
        case DType::BF16: err = quant::launch_fp8_block<Spec, __nv_bfloat16, true>(call, stream, cfg); break;
        case DType::F16: err = quant::launch_fp8_block<Spec, __half, true>(call, stream, cfg); break;
      }
    }
  });
  return err;
}

}  // namespace te_jax::cuda
