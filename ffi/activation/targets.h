// The XLA FFI signatures of the te_jax targets, shared by the CPU and CUDA handlers (which differ
// only in their context: ffi::ThreadPool or ffi::PlatformStream<cudaStream_t>) and by the
// execute and initialize stages.
//
// te_jax_act_lu (ActLuFFI)
//   args  x (..., [2,] H), scale f32[batches], amax f32[batches]
//   rets  output, colwise_output, scale_inv, colwise_scale_inv, amax, global_scale_inv
//   attrs act_enum, scaling_mode, quantize_layout, act_params, output_amax
// te_jax_dact_dbias_quantize (DActLuDBiasQuantizeFFI)
//   args  dz (..., H), x (..., [2,] H), scale f32[batches], amax f32[batches]
//   rets  output, colwise_output, scale_inv, colwise_scale_inv, amax, global_scale_inv, dbias,
//         workspace
//   attrs scaling_mode, act_enum, quantize_layout, is_dbias, act_params, output_amax
// te_jax_quantize (QuantizeFFI): act_lu of the identity, x 2-D [M, N]
//   args  x, scale, amax; rets as te_jax_act_lu; attrs scaling_mode, quantize_layout, output_amax
// te_jax_act_amax: first pass of the two-pass modes (CURRENT, NVFP4)
//   args  x; rets amax f32[batches]; attrs act_enum, act_params
// te_jax_dact_dbias_amax: first pass of dact_dbias in the two-pass modes
//   args  dz, x; rets amax f32[batches], dbias, workspace; attrs act_enum, is_dbias, act_params
//
// DELAYED multiplies y by `scale` (the quantizer's); CURRENT and NVFP4 read `amax` (the global
// amax of their first pass) and derive the scale in the kernel; the other input is not read.
// amax is max|y| (NO_SCALING with output_amax, DELAYED); global_scale_inv is NVFP4's 1 / S. Outputs
// a mode does not produce are empty (shape (0,)); see problem.h for every buffer's shape.
#pragma once

#include <utility>

#include "common/scaling.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

// The six quantized outputs of te_jax_act_lu, te_jax_quantize and te_jax_dact_dbias_quantize:
// output, colwise_output, scale_inv, colwise_scale_inv, amax, global_scale_inv (problem.h).
template <typename Binding>
auto with_quantized_rets(Binding b) {
  namespace ffi = ::xla::ffi;
  return std::move(b)
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

template <::xla::ffi::ExecutionStage kStage, typename Context>
auto bind_act_lu() {
  namespace ffi = ::xla::ffi;
  return with_quantized_rets(ffi::Ffi::Bind<kStage>()
                                 .template Ctx<Context>()
                                 .template Arg<ffi::AnyBuffer>()    // x
                                 .template Arg<ffi::AnyBuffer>()    // scale
                                 .template Arg<ffi::AnyBuffer>())   // amax
      .template Attr<ActivationEnum>("act_enum")
      .template Attr<ScalingMode>("scaling_mode")
      .template Attr<QuantizeLayout>("quantize_layout")
      .template Attr<ActParams>("act_params")
      .template Attr<bool>("output_amax");
}

template <::xla::ffi::ExecutionStage kStage, typename Context>
auto bind_dact_dbias() {
  namespace ffi = ::xla::ffi;
  return with_quantized_rets(ffi::Ffi::Bind<kStage>()
                                 .template Ctx<Context>()
                                 .template Arg<ffi::AnyBuffer>()    // dz
                                 .template Arg<ffi::AnyBuffer>()    // x
                                 .template Arg<ffi::AnyBuffer>()    // scale
                                 .template Arg<ffi::AnyBuffer>())   // amax
      .template Ret<ffi::AnyBuffer>()   // dbias
      .template Ret<ffi::AnyBuffer>()   // workspace
      .template Attr<ScalingMode>("scaling_mode")
      .template Attr<ActivationEnum>("act_enum")
      .template Attr<QuantizeLayout>("quantize_layout")
      .template Attr<bool>("is_dbias")
      .template Attr<ActParams>("act_params")
      .template Attr<bool>("output_amax");
}

template <::xla::ffi::ExecutionStage kStage, typename Context>
auto bind_quantize() {
  namespace ffi = ::xla::ffi;
  return with_quantized_rets(ffi::Ffi::Bind<kStage>()
                                 .template Ctx<Context>()
                                 .template Arg<ffi::AnyBuffer>()    // x
                                 .template Arg<ffi::AnyBuffer>()    // scale
                                 .template Arg<ffi::AnyBuffer>())   // amax
      .template Attr<ScalingMode>("scaling_mode")
      .template Attr<QuantizeLayout>("quantize_layout")
      .template Attr<bool>("output_amax");
}

template <::xla::ffi::ExecutionStage kStage, typename Context>
auto bind_act_amax() {
  namespace ffi = ::xla::ffi;
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<Context>()
      .template Arg<ffi::AnyBuffer>()   // x
      .template Ret<ffi::AnyBuffer>()   // amax
      .template Attr<ActivationEnum>("act_enum")
      .template Attr<ActParams>("act_params");
}

template <::xla::ffi::ExecutionStage kStage, typename Context>
auto bind_dact_amax() {
  namespace ffi = ::xla::ffi;
  return ffi::Ffi::Bind<kStage>()
      .template Ctx<Context>()
      .template Arg<ffi::AnyBuffer>()   // dz
      .template Arg<ffi::AnyBuffer>()   // x
      .template Ret<ffi::AnyBuffer>()   // amax
      .template Ret<ffi::AnyBuffer>()   // dbias
      .template Ret<ffi::AnyBuffer>()   // workspace
      .template Attr<ActivationEnum>("act_enum")
      .template Attr<bool>("is_dbias")
      .template Attr<ActParams>("act_params");
}

}  // namespace te_jax
