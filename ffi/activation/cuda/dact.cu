// te_jax_dact_dbias_quantize on CUDA. Without dbias: the elementwise backward kernel of
// elementwise.cuh. With dbias: dact_dbias.cu. Quantized outputs and the amax pass (with or
// without dbias): the quant_dact_*.cu launchers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "activation/activations.h"
#include "activation/cuda/elementwise.cuh"
#include "activation/cuda/launch.h"
#include "activation/problem.h"

namespace te_jax::cuda {

cudaError_t launch_dact_dbias(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg) {
  if (p.quantized) {  // the generic path (quantize.cuh), with or without dbias
    switch (p.q.emit) {
      case QuantEmit::TENSOR: return launch_dact_q_tensor(p, stream, cfg);
      case QuantEmit::MXFP8: return launch_dact_q_mx(p, stream, cfg);
      case QuantEmit::NVFP4: return launch_dact_q_nvfp4(p, stream, cfg);
      case QuantEmit::AMAX_PASS: return launch_dact_q_amax(p, stream, cfg);
      case QuantEmit::FP8_BLOCK: return launch_dact_q_fp8_block(p, stream, cfg);
    }
    return cudaErrorInvalidValue;
  }
  if (p.dbias != nullptr) return launch_dact_with_dbias(p, stream, cfg);
  cudaError_t err = cudaErrorInvalidValue;  // unknown activation or dtype (decode rejects both)
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    switch (p.dtype) {
      case DType::F32:
        err = launch_eltwise<Spec, float, true>(p.x, p.dz, p.dx, p.rows, p.hidden, p.params,
                                                p.amax, stream, cfg);
        break;
      case DType::BF16:
        err = launch_eltwise<Spec, __nv_bfloat16, true>(p.x, p.dz, p.dx, p.rows, p.hidden,
                                                        p.params, p.amax, stream, cfg);
        break;
      case DType::F16:
        err = launch_eltwise<Spec, __half, true>(p.x, p.dz, p.dx, p.rows, p.hidden, p.params,
                                                 p.amax, stream, cfg);
        break;
    }
  });
  return err;
}

}  // namespace te_jax::cuda
