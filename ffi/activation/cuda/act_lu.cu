// te_jax_act_lu on CUDA: the elementwise forward kernel of elementwise.cuh, one instantiation per
// (activation, dtype); quantized outputs and the amax pass go to the quant_act_*.cu launchers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "activation/activations.h"
#include "activation/cuda/elementwise.cuh"
#include "activation/cuda/launch.h"
#include "activation/problem.h"

namespace te_jax::cuda {

cudaError_t launch_act_lu(const ActLuProblem& p, cudaStream_t stream, const LaunchConfig& cfg) {
  if (p.quantized) {  // the generic path (quantize.cuh)
    switch (p.q.emit) {
      case QuantEmit::TENSOR: return launch_act_lu_q_tensor(p, stream, cfg);
      case QuantEmit::MXFP8: return launch_act_lu_q_mx(p, stream, cfg);
      case QuantEmit::NVFP4: return launch_act_lu_q_nvfp4(p, stream, cfg);
      case QuantEmit::AMAX_PASS: return launch_act_lu_q_amax(p, stream, cfg);
      case QuantEmit::FP8_BLOCK: return launch_act_lu_q_fp8_block(p, stream, cfg);
    }
    return cudaErrorInvalidValue;
  }
  cudaError_t err = cudaErrorInvalidValue;  // unknown activation or dtype (decode rejects both)
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    switch (p.dtype) {
      case DType::F32:
        err = launch_eltwise<Spec, float, false>(p.x, nullptr, p.y, p.rows, p.hidden, p.params,
                                                 p.amax, stream, cfg);
        break;
      case DType::BF16:
        err = launch_eltwise<Spec, __nv_bfloat16, false>(p.x, nullptr, p.y, p.rows, p.hidden,
                                                         p.params, p.amax, stream, cfg);
        break;
      case DType::F16:
        err = launch_eltwise<Spec, __half, false>(p.x, nullptr, p.y, p.rows, p.hidden, p.params,
                                                  p.amax, stream, cfg);
        break;
    }
  });
  return err;
}

}  // namespace te_jax::cuda
