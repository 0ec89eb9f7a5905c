// The XLA FFI signatures of the te_jax targets, shared by the CPU and CUDA handlers (which differ
// only in their context: ffi::ThreadPool or ffi::PlatformStream<cudaStream_t>) and by the
// execute and initialize stages.
//
// te_jax_act_lu (ActLuFFI)
//   args  x (..., [2,] H), scale f32[1], amax f32[1]
//   rets  output, colwise_output, scale_inv, colwise_scale_inv, updated_amax
//   attrs act_enum, scaling_mode, quantize_layout, act_params, output_amax
// te_jax_dact_dbias_quantize (DActLuDBiasQuantizeFFI)
//   args  dz (..., H), x (..., [2,] H), scale f32[1], amax f32[1]
//   rets  output, colwise_output, scale_inv, colwise_scale_inv, updated_amax, dbias, workspace
//   attrs scaling_mode, act_enum, quantize_layout, is_dbias, act_params, output_amax
//
// `scale` is the delayed-scaling scale; `amax` is a precomputed (global) amax for the two-pass
// modes. Outputs a mode does not produce are empty (shape (0,)).
#pragma once

#include "common/attrs.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

template <::xla::ffi::ExecutionStage kStage, typename Context>
auto bind_act_lu() {
  namespace ffi = ::xla::ffi;
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<Context>()
      .template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::AnyBuffer>()   // scale
      .template Arg<ffi::AnyBuffer>()   // amax
      .template Ret<ffi::AnyBuffer>()   // output
      .template Ret<ffi::AnyBuffer>()   // colwise_output
      .template Ret<ffi::AnyBuffer>()   // scale_inv
      .template Ret<ffi::AnyBuffer>()   // colwise_scale_inv
      .template Ret<ffi::AnyBuffer>()   // updated_amax
      .template Attr<ActivationEnum>("act_enum")
      .template Attr<ScalingMode>("scaling_mode")
      .template Attr<QuantizeLayout>("quantize_layout")
      .template Attr<ActParams>("act_params")
      .template Attr<bool>("output_amax");
}

template <::xla::ffi::ExecutionStage kStage, typename Context>
auto bind_dact_dbias() {
  namespace ffi = ::xla::ffi;
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<Context>()
      .template Arg<ffi::AnyBuffer>()   // dz
      .template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::AnyBuffer>()   // scale
      .template Arg<ffi::AnyBuffer>()   // amax
      .template Ret<ffi::AnyBuffer>()   // output
      .template Ret<ffi::AnyBuffer>()   // colwise_output
      .template Ret<ffi::AnyBuffer>()   // scale_inv
      .template Ret<ffi::AnyBuffer>()   // colwise_scale_inv
      .template Ret<ffi::AnyBuffer>()   // updated_amax
      .template Ret<ffi::AnyBuffer>()   // dbias
      .template Ret<ffi::AnyBuffer>()   // workspace
      .template Attr<ScalingMode>("scaling_mode")
      .template Attr<ActivationEnum>("act_enum")
      .template Attr<QuantizeLayout>("quantize_layout")
      .template Attr<bool>("is_dbias")
      .template Attr<ActParams>("act_params")
      .template Attr<bool>("output_amax");
}

}  // namespace te_jax
