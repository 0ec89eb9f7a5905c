// XLA FFI execute handlers of the CPU targets: decode and validate (common/problem.h), then run
// the loops of kernels.cc on the FFI thread pool.
#include "common/bindings.h"
#include "common/problem.h"
#include "cpu/kernels.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::cpu {
namespace {

namespace ffi = ::xla::ffi;

ffi::Error ActLuImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                     ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> colwise_out, ffi::Result<ffi::AnyBuffer> scale_inv,
                     ffi::Result<ffi::AnyBuffer> colwise_scale_inv,
                     ffi::Result<ffi::AnyBuffer> updated_amax, ActivationEnum act_enum,
                     ScalingMode scaling_mode, QuantizeLayout quantize_layout,
                     ActParams act_params, bool output_amax) {
  ActLuProblem p;
  if (auto e = decode_act_lu(p, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                             &*colwise_scale_inv, &*updated_amax, act_enum, scaling_mode,
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
    ffi::Result<ffi::AnyBuffer> updated_amax, ffi::Result<ffi::AnyBuffer> dbias,
    ffi::Result<ffi::AnyBuffer> workspace, ScalingMode scaling_mode, ActivationEnum act_enum,
    QuantizeLayout quantize_layout, bool is_dbias, ActParams act_params, bool output_amax) {
  DActProblem p;
  if (auto e = decode_dact_dbias(p, dz, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                                 &*colwise_scale_inv, &*updated_amax, &*dbias, &*workspace,
                                 scaling_mode, act_enum, quantize_layout, is_dbias, act_params,
                                 output_amax);
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

// Accessors for module.cc (the handler variables above are internal to this file).
XLA_FFI_Handler* act_lu_handler() { return ActLuFFI; }
XLA_FFI_Handler* dact_dbias_handler() { return DActLuDBiasQuantizeFFI; }

}  // namespace te_jax::cpu
