// What a quantizing launcher needs from either problem (QuantizeCall), and the dispatch over
// activation and input dtype that instantiates it (launch.cuh's tiled kernel, fp8_block.cuh's).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "activation/activations.h"
#include "activation/problem.h"

namespace te_jax::cuda::quant {

struct QuantizeCall {
  const void* x;
  const void* dz;
  int64_t rows, hidden;
  ActParams params;
  const QuantOutput* q;
  float* ws;        // dbias workspace, or nullptr
  void* dbias;      // dbias output, or nullptr
  int64_t groups;   // dbias groups (when ws)
  DType dtype;
};

inline QuantizeCall forward_call(const ActLuProblem& p) {
  return {p.x, nullptr, p.rows, p.hidden, p.params, &p.q, nullptr, nullptr, 0, p.dtype};
}

inline QuantizeCall backward_call(const DActProblem& p) {
  return {p.x,     p.dz, p.rows, p.hidden, p.params, &p.q, p.dbias != nullptr ? p.workspace : nullptr,
          p.dbias, p.groups, p.dtype};
}

template <typename T>
constexpr DType kDTypeOf = std::is_same_v<T, float>           ? DType::F32
                           : std::is_same_v<T, __nv_bfloat16> ? DType::BF16
                                                              : DType::F16;

template <typename T>
struct TypeTag {
  using type = T;
};

// launch(Spec{}, TypeTag<T>{}) for the activation's Spec and the dtype's T; the backward skips
// IDENTITY (no op uses it). cudaErrorInvalidValue for an activation or dtype it does not take.
template <bool kBwd, typename Launch>
cudaError_t dispatch_act_dtype(ActivationEnum act, DType dtype, Launch&& launch) {
  cudaError_t err = cudaErrorInvalidValue;
  with_activation(act, [&](auto spec) {
    using Spec = decltype(spec);
    if constexpr (!(kBwd && !Spec::kGated && std::is_same_v<typename Spec::Act, act::Identity>)) {
      switch (dtype) {
        case DType::F32: err = launch(spec, TypeTag<float>{}); break;
        case DType::BF16: err = launch(spec, TypeTag<__nv_bfloat16>{}); break;
        case DType::F16: err = launch(spec, TypeTag<__half>{}); break;
      }
    }
  });
  return err;
}

}  // namespace te_jax::cuda::quant
