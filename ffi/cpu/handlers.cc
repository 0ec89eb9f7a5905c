// XLA FFI execute handlers of the CPU targets: decode and validate (common/problem.h), then run
// the loops of kernels.cc on the FFI thread pool.
#include "activation/targets.h"
#include "activation/problem.h"
#include "activation/cpu/kernels.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::cpu {
namespace {

namespace ffi = ::xla::ffi;

ffi::Error ActLuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                     ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> colwise_out, ffi::Result<ffi::AnyBuffer> scale_inv,
                     ffi::Result<ffi::AnyBuffer> colwise_scale_inv,
                     ffi::Result<ffi::AnyBuffer> amax_out,
    ffi::Result<ffi::AnyBuffer> global_scale_inv, ActivationEnum act_enum,
                     ScalingMode scaling_mode, QuantizeLayout quantize_layout,
                     ActParams act_params, bool output_amax) {
  ActLuProblem p;
  if (auto e = decode_act_lu(p, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                             &*colwise_scale_inv, &*amax_out, &*global_scale_inv, act_enum, scaling_mode,
                             quantize_layout, act_params, output_amax);
      e.failure()) {
    return e;
  }
  act_lu(p, &pool);
  return ffi::Error::Success();
}

ffi::Error DActLuDBiasQuantizeImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer scale,
    ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> colwise_out,
    ffi::Result<ffi::AnyBuffer> scale_inv, ffi::Result<ffi::AnyBuffer> colwise_scale_inv,
    ffi::Result<ffi::AnyBuffer> amax_out,
    ffi::Result<ffi::AnyBuffer> global_scale_inv, ffi::Result<ffi::AnyBuffer> dbias,
    ffi::Result<ffi::AnyBuffer> workspace, ScalingMode scaling_mode, ActivationEnum act_enum,
    QuantizeLayout quantize_layout, bool is_dbias, ActParams act_params, bool output_amax) {
  DActProblem p;
  if (auto e = decode_dact_dbias(p, dz, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                                 &*colwise_scale_inv, &*amax_out, &*global_scale_inv, &*dbias, &*workspace,
                                 scaling_mode, act_enum, quantize_layout, is_dbias, act_params,
                                 output_amax);
      e.failure()) {
    return e;
  }
  dact_dbias(p, &pool);
  return ffi::Error::Success();
}

ffi::Error QuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                        ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> colwise_out,
                        ffi::Result<ffi::AnyBuffer> scale_inv,
                        ffi::Result<ffi::AnyBuffer> colwise_scale_inv,
                        ffi::Result<ffi::AnyBuffer> amax_out,
    ffi::Result<ffi::AnyBuffer> global_scale_inv, ScalingMode scaling_mode,
                        QuantizeLayout quantize_layout, bool output_amax) {
  ActLuProblem p;
  if (auto e = decode_quantize(p, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                               &*colwise_scale_inv, &*amax_out, &*global_scale_inv, scaling_mode,
                               quantize_layout, output_amax);
      e.failure()) {
    return e;
  }
  act_lu(p, &pool);
  return ffi::Error::Success();
}

ffi::Error ActAmaxImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> amax,
                       ActivationEnum act_enum, ActParams act_params) {
  ActLuProblem p;
  if (auto e = decode_act_amax(p, x, &*amax, act_enum, act_params); e.failure()) return e;
  act_lu(p, &pool);
  return ffi::Error::Success();
}

ffi::Error DActAmaxImpl(ffi::ThreadPool pool, ffi::AnyBuffer dz, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> amax, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> workspace, ActivationEnum act_enum,
                        bool is_dbias, ActParams act_params) {
  DActProblem p;
  if (auto e = decode_dact_amax(p, dz, x, &*amax, &*dbias, &*workspace, act_enum, is_dbias,
                                act_params);
      e.failure()) {
    return e;
  }
  dact_dbias(p, &pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(ActLuFFI, ActLuImpl,
                       (bind_act_lu<ffi::ExecutionStage::kExecute, ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER(DActLuDBiasQuantizeFFI, DActLuDBiasQuantizeImpl,
                       (bind_dact_dbias<ffi::ExecutionStage::kExecute, ffi::ThreadPool>()));

XLA_FFI_DEFINE_HANDLER(QuantizeFFI, QuantizeImpl,
                       (bind_quantize<ffi::ExecutionStage::kExecute, ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER(ActAmaxFFI, ActAmaxImpl,
                       (bind_act_amax<ffi::ExecutionStage::kExecute, ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER(DActAmaxFFI, DActAmaxImpl,
                       (bind_dact_amax<ffi::ExecutionStage::kExecute, ffi::ThreadPool>()));

// Accessors for module.cc (the handler variables above are internal to this file).
XLA_FFI_Handler* act_lu_handler() { return ActLuFFI; }
XLA_FFI_Handler* dact_dbias_handler() { return DActLuDBiasQuantizeFFI; }
XLA_FFI_Handler* quantize_handler() { return QuantizeFFI; }
XLA_FFI_Handler* act_amax_handler() { return ActAmaxFFI; }
XLA_FFI_Handler* dact_amax_handler() { return DActAmaxFFI; }

}  // namespace te_jax::cpu
