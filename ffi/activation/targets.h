// The activation family's XLA FFI targets: for each, its name, its binding (the FFI contract:
// argument, result and attribute order and names) and its ONE handler body, shared by the CPU and
// CUDA backends and by CUDA's execute and initialize stages. A body decodes the call into a problem
// (problem.h) and hands it to Backend::run<S> (activation/cpu/run.h, activation/cuda/run.h);
// common/handler.h turns (target, backend, stage) into the handler XLA calls.
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
// Python passes every attribute as an exact numpy scalar: the enums as np.int64, booleans as
// np.bool_, act_params as
// {"clamped_swiglu": {"limit": np.float32, "alpha": np.float32, "glu_linear_offset": np.float32}}.
#pragma once

#include <utility>

#include "activation/activations.h"
#include "activation/problem.h"
#include "common/handler.h"
#include "common/scaling.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(te_jax::ActivationEnum);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(te_jax::ClampedSwigluParams, StructMember<float>("limit"),
                                      StructMember<float>("alpha"),
                                      StructMember<float>("glu_linear_offset"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(te_jax::ActParams,
                                      StructMember<te_jax::ClampedSwigluParams>("clamped_swiglu"));

namespace te_jax::activation {

namespace ffi = ::xla::ffi;
using Ret = ffi::Result<ffi::AnyBuffer>;

// The six quantized results: output, colwise_output, scale_inv, colwise_scale_inv, amax,
// global_scale_inv (common/quant_output.h).
template <typename Binding>
auto with_quantized_rets(Binding b) {
  return std::move(b)
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

// The front of te_jax_act_lu's and te_jax_quantize's bindings: the context, x, scale, amax and
// the six quantized results.
template <ffi::ExecutionStage S, class Context>
auto bind_x_scale_amax() {
  return with_quantized_rets(ffi::Ffi::Bind<S>()
                                 .template Ctx<Context>()
                                 .template Arg<ffi::AnyBuffer>()    // x
                                 .template Arg<ffi::AnyBuffer>()    // scale
                                 .template Arg<ffi::AnyBuffer>());  // amax
}

struct ActLu {
  static constexpr const char* kName = "te_jax_act_lu";

  template <ffi::ExecutionStage S, class Context>
  static auto bind() {
    return bind_x_scale_amax<S, Context>()
        .template Attr<ActivationEnum>("act_enum")
        .template Attr<ScalingMode>("scaling_mode")
        .template Attr<QuantizeLayout>("quantize_layout")
        .template Attr<ActParams>("act_params")
        .template Attr<bool>("power_2_scale")
        .template Attr<float>("amax_epsilon")
        .template Attr<bool>("output_amax");
  }

  template <class Backend, ffi::ExecutionStage S>
  static ffi::Error impl(ContextArg<Backend> ctx, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                         ffi::AnyBuffer amax, Ret out, Ret colwise_out, Ret scale_inv,
                         Ret colwise_scale_inv, Ret amax_out, Ret global_scale_inv,
                         ActivationEnum act_enum, ScalingMode scaling_mode,
                         QuantizeLayout quantize_layout, ActParams act_params,
                         bool power_2_scale, float amax_epsilon, bool output_amax) {
    ActLuProblem p;
    if (auto e = decode_act_lu(p, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                               &*colwise_scale_inv, &*amax_out, &*global_scale_inv, act_enum,
                               scaling_mode, quantize_layout, act_params,
                               BlockOptions{power_2_scale, amax_epsilon}, output_amax, kName);
        e.failure()) {
      return e;
    }
    return Backend::template run<S>(kName, p, ctx);
  }
};

struct DActLuDBiasQuantize {
  static constexpr const char* kName = "te_jax_dact_dbias_quantize";

  template <ffi::ExecutionStage S, class Context>
  static auto bind() {
    return with_quantized_rets(ffi::Ffi::Bind<S>()
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
        .template Attr<bool>("power_2_scale")
        .template Attr<float>("amax_epsilon")
        .template Attr<bool>("output_amax");
  }

  template <class Backend, ffi::ExecutionStage S>
  static ffi::Error impl(ContextArg<Backend> ctx, ffi::AnyBuffer dz, ffi::AnyBuffer x,
                         ffi::AnyBuffer scale, ffi::AnyBuffer amax, Ret out, Ret colwise_out,
                         Ret scale_inv, Ret colwise_scale_inv, Ret amax_out,
                         Ret global_scale_inv, Ret dbias, Ret workspace,
                         ScalingMode scaling_mode, ActivationEnum act_enum,
                         QuantizeLayout quantize_layout, bool is_dbias, ActParams act_params,
                         bool power_2_scale, float amax_epsilon, bool output_amax) {
    DActProblem p;
    if (auto e = decode_dact_dbias(p, dz, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                                   &*colwise_scale_inv, &*amax_out, &*global_scale_inv, &*dbias,
                                   &*workspace, scaling_mode, act_enum, quantize_layout,
                                   is_dbias, act_params, BlockOptions{power_2_scale, amax_epsilon},
                                   output_amax);
        e.failure()) {
      return e;
    }
    return Backend::template run<S>(kName, p, ctx);
  }
};

// act_lu of the identity, under its own name.
struct Quantize {
  static constexpr const char* kName = "te_jax_quantize";

  template <ffi::ExecutionStage S, class Context>
  static auto bind() {
    return bind_x_scale_amax<S, Context>()
        .template Attr<ScalingMode>("scaling_mode")
        .template Attr<QuantizeLayout>("quantize_layout")
        .template Attr<bool>("power_2_scale")
        .template Attr<float>("amax_epsilon")
        .template Attr<bool>("output_amax");
  }

  template <class Backend, ffi::ExecutionStage S>
  static ffi::Error impl(ContextArg<Backend> ctx, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                         ffi::AnyBuffer amax, Ret out, Ret colwise_out, Ret scale_inv,
                         Ret colwise_scale_inv, Ret amax_out, Ret global_scale_inv,
                         ScalingMode scaling_mode, QuantizeLayout quantize_layout,
                         bool power_2_scale, float amax_epsilon, bool output_amax) {
    ActLuProblem p;
    if (auto e = decode_act_lu(p, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                               &*colwise_scale_inv, &*amax_out, &*global_scale_inv,
                               ActivationEnum::IDENTITY, scaling_mode, quantize_layout,
                               ActParams{}, BlockOptions{power_2_scale, amax_epsilon},
                               output_amax, kName);
        e.failure()) {
      return e;
    }
    return Backend::template run<S>(kName, p, ctx);
  }
};

// The first pass of act_lu (or quantize, act_enum IDENTITY) in the two-pass modes.
struct ActAmax {
  static constexpr const char* kName = "te_jax_act_amax";

  template <ffi::ExecutionStage S, class Context>
  static auto bind() {
    return ffi::Ffi::Bind<S>()
        .template Ctx<Context>()
        .template Arg<ffi::AnyBuffer>()   // x
        .template Ret<ffi::AnyBuffer>()   // amax
        .template Attr<ActivationEnum>("act_enum")
        .template Attr<ActParams>("act_params");
  }

  template <class Backend, ffi::ExecutionStage S>
  static ffi::Error impl(ContextArg<Backend> ctx, ffi::AnyBuffer x, Ret amax,
                         ActivationEnum act_enum, ActParams act_params) {
    ActLuProblem p;
    if (auto e = decode_act_amax(p, x, &*amax, act_enum, act_params); e.failure()) return e;
    return Backend::template run<S>(kName, p, ctx);
  }
};

// The first pass of dact_dbias in the two-pass modes (amax and dbias).
struct DActDBiasAmax {
  static constexpr const char* kName = "te_jax_dact_dbias_amax";

  template <ffi::ExecutionStage S, class Context>
  static auto bind() {
    return ffi::Ffi::Bind<S>()
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

  template <class Backend, ffi::ExecutionStage S>
  static ffi::Error impl(ContextArg<Backend> ctx, ffi::AnyBuffer dz, ffi::AnyBuffer x, Ret amax,
                         Ret dbias, Ret workspace, ActivationEnum act_enum, bool is_dbias,
                         ActParams act_params) {
    DActProblem p;
    if (auto e = decode_dact_amax(p, dz, x, &*amax, &*dbias, &*workspace, act_enum, is_dbias,
                                  act_params);
        e.failure()) {
      return e;
    }
    return Backend::template run<S>(kName, p, ctx);
  }
};

// Every target of the family, in registration order.
using Targets = TargetList<ActLu, DActLuDBiasQuantize, Quantize, ActAmax, DActDBiasAmax>;

}  // namespace te_jax::activation
