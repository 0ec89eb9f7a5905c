// XLA FFI handlers of the te_jax CUDA targets and their nanobind module, _te_jax_cuda.
//
// Each target has two stages:
//   execute     decodes the call (common/problem.h) and enqueues the kernels on the given stream.
//               It never synchronises, allocates, queries the device or reads device memory, so
//               it carries ffi::Traits::kCmdBufferCompatible and XLA may capture it in a CUDA
//               graph.
//   initialize  runs before each execution, outside capture, and does what capture forbids:
//               loads the kernels the call will use into the current context (lazy module
//               loading during capture, or while NCCL kernels run, fails or hangs).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include <string>
#include <type_traits>

#include "activation/targets.h"
#include "activation/problem.h"
#include "activation/cuda/launch.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace te_jax::cuda {
namespace {

using Stream = ffi::PlatformStream<cudaStream_t>;
using Ret = ffi::Result<ffi::AnyBuffer>;

ffi::Error cuda_error(const char* op, const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string(op) + ": " + what + ": " + cudaGetErrorName(e) + ": " +
                              cudaGetErrorString(e));
}

// Enqueues (execute) or loads (initialize) the kernels of a decoded problem.
template <bool kInitialize, typename Problem>
ffi::Error launch(const char* op, const Problem& p, cudaStream_t stream) {
  LaunchConfig cfg;
  cfg.load_only = kInitialize;
  cudaError_t e;
  if constexpr (std::is_same_v<Problem, ActLuProblem>) {
    e = launch_act_lu(p, stream, cfg);
  } else {
    e = launch_dact_dbias(p, stream, cfg);
  }
  if (e != cudaSuccess) {
    return cuda_error(op, kInitialize ? "loading the kernels" : "kernel launch failed", e);
  }
  return ffi::Error::Success();
}

// ---- te_jax_act_lu -------------------------------------------------------------------------

template <bool kInitialize>
ffi::Error ActLuImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                     ffi::AnyBuffer amax, Ret out, Ret colwise_out, Ret scale_inv,
                     Ret colwise_scale_inv, Ret amax_out, Ret global_scale_inv, ActivationEnum act_enum,
                     ScalingMode scaling_mode, QuantizeLayout quantize_layout,
                     ActParams act_params, bool output_amax) {
  constexpr const char* op = "te_jax_act_lu";
  ActLuProblem p;
  if (ffi::Error e = decode_act_lu(p, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                                   &*colwise_scale_inv, &*amax_out, &*global_scale_inv, act_enum, scaling_mode,
                                   quantize_layout, act_params, output_amax);
      e.failure()) {
    return e;
  }
  return launch<kInitialize>(op, p, stream);
}

// ---- te_jax_dact_dbias_quantize ------------------------------------------------------------

template <bool kInitialize>
ffi::Error DActLuDBiasQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer x,
                                   ffi::AnyBuffer scale, ffi::AnyBuffer amax, Ret out,
                                   Ret colwise_out, Ret scale_inv, Ret colwise_scale_inv,
                                   Ret amax_out, Ret global_scale_inv, Ret dbias, Ret workspace,
                                   ScalingMode scaling_mode, ActivationEnum act_enum,
                                   QuantizeLayout quantize_layout, bool is_dbias,
                                   ActParams act_params, bool output_amax) {
  constexpr const char* op = "te_jax_dact_dbias_quantize";
  DActProblem p;
  if (ffi::Error e = decode_dact_dbias(p, dz, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                                       &*colwise_scale_inv, &*amax_out, &*global_scale_inv, &*dbias,
                                       &*workspace, scaling_mode, act_enum, quantize_layout,
                                       is_dbias, act_params, output_amax);
      e.failure()) {
    return e;
  }
  return launch<kInitialize>(op, p, stream);
}

// ---- te_jax_quantize (act_lu of the identity) -----------------------------------------------

template <bool kInitialize>
ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                        ffi::AnyBuffer amax, Ret out, Ret colwise_out, Ret scale_inv,
                        Ret colwise_scale_inv, Ret amax_out, Ret global_scale_inv, ScalingMode scaling_mode,
                        QuantizeLayout quantize_layout, bool output_amax) {
  constexpr const char* op = "te_jax_quantize";
  ActLuProblem p;
  if (ffi::Error e = decode_quantize(p, x, scale, amax, &*out, &*colwise_out, &*scale_inv,
                                     &*colwise_scale_inv, &*amax_out, &*global_scale_inv, scaling_mode,
                                     quantize_layout, output_amax);
      e.failure()) {
    return e;
  }
  return launch<kInitialize>(op, p, stream);
}

// ---- te_jax_act_amax (first pass of the two-pass modes) -------------------------------------

template <bool kInitialize>
ffi::Error ActAmaxImpl(cudaStream_t stream, ffi::AnyBuffer x, Ret amax, ActivationEnum act_enum,
                       ActParams act_params) {
  constexpr const char* op = "te_jax_act_amax";
  ActLuProblem p;
  if (ffi::Error e = decode_act_amax(p, x, &*amax, act_enum, act_params); e.failure()) return e;
  return launch<kInitialize>(op, p, stream);
}

// ---- te_jax_dact_dbias_amax (first pass of dact_dbias in the two-pass modes) ----------------

template <bool kInitialize>
ffi::Error DActAmaxImpl(cudaStream_t stream, ffi::AnyBuffer dz, ffi::AnyBuffer x, Ret amax,
                        Ret dbias, Ret workspace, ActivationEnum act_enum, bool is_dbias,
                        ActParams act_params) {
  constexpr const char* op = "te_jax_dact_dbias_amax";
  DActProblem p;
  if (ffi::Error e = decode_dact_amax(p, dz, x, &*amax, &*dbias, &*workspace, act_enum, is_dbias,
                                      act_params);
      e.failure()) {
    return e;
  }
  return launch<kInitialize>(op, p, stream);
}

// Bindings (functions, so the template commas stay out of the handler macros).
auto act_lu_execute_binding() { return bind_act_lu<ffi::ExecutionStage::kExecute, Stream>(); }
auto act_lu_initialize_binding() {
  return bind_act_lu<ffi::ExecutionStage::kInitialize, Stream>();
}
auto dact_execute_binding() { return bind_dact_dbias<ffi::ExecutionStage::kExecute, Stream>(); }
auto dact_initialize_binding() {
  return bind_dact_dbias<ffi::ExecutionStage::kInitialize, Stream>();
}

auto quantize_execute_binding() { return bind_quantize<ffi::ExecutionStage::kExecute, Stream>(); }
auto quantize_initialize_binding() {
  return bind_quantize<ffi::ExecutionStage::kInitialize, Stream>();
}
auto act_amax_execute_binding() { return bind_act_amax<ffi::ExecutionStage::kExecute, Stream>(); }
auto act_amax_initialize_binding() {
  return bind_act_amax<ffi::ExecutionStage::kInitialize, Stream>();
}
auto dact_amax_execute_binding() {
  return bind_dact_amax<ffi::ExecutionStage::kExecute, Stream>();
}
auto dact_amax_initialize_binding() {
  return bind_dact_amax<ffi::ExecutionStage::kInitialize, Stream>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(ActLuFFI, ActLuImpl<false>, act_lu_execute_binding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(ActLuInitializeFFI, ActLuImpl<true>, act_lu_initialize_binding());
XLA_FFI_DEFINE_HANDLER(DActLuDBiasQuantizeFFI, DActLuDBiasQuantizeImpl<false>,
                       dact_execute_binding(), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(DActLuDBiasQuantizeInitializeFFI, DActLuDBiasQuantizeImpl<true>,
                       dact_initialize_binding());
XLA_FFI_DEFINE_HANDLER(QuantizeFFI, QuantizeImpl<false>, quantize_execute_binding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(QuantizeInitializeFFI, QuantizeImpl<true>, quantize_initialize_binding());
XLA_FFI_DEFINE_HANDLER(ActAmaxFFI, ActAmaxImpl<false>, act_amax_execute_binding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(ActAmaxInitializeFFI, ActAmaxImpl<true>, act_amax_initialize_binding());
XLA_FFI_DEFINE_HANDLER(DActAmaxFFI, DActAmaxImpl<false>, dact_amax_execute_binding(),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(DActAmaxInitializeFFI, DActAmaxImpl<true>, dact_amax_initialize_binding());

}  // namespace te_jax::cuda

namespace {

template <typename T>
nb::capsule handler_capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes XLA_FFI_CallFrame* and returns XLA_FFI_Error*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict stages(nb::capsule initialize, nb::capsule execute) {
  nb::dict d;
  d["initialize"] = initialize;
  d["execute"] = execute;
  return d;
}

}  // namespace

NB_MODULE(_te_jax_cuda, m) {
  m.doc() = "te_jax CUDA kernels, as XLA FFI handlers";
  m.def(
      "registrations",
      []() {
        namespace tc = te_jax::cuda;
        nb::dict d;
        d["te_jax_act_lu"] = stages(handler_capsule(tc::ActLuInitializeFFI),
                                    handler_capsule(tc::ActLuFFI));
        d["te_jax_dact_dbias_quantize"] =
            stages(handler_capsule(tc::DActLuDBiasQuantizeInitializeFFI),
                   handler_capsule(tc::DActLuDBiasQuantizeFFI));
        d["te_jax_quantize"] = stages(handler_capsule(tc::QuantizeInitializeFFI),
                                      handler_capsule(tc::QuantizeFFI));
        d["te_jax_act_amax"] = stages(handler_capsule(tc::ActAmaxInitializeFFI),
                                      handler_capsule(tc::ActAmaxFFI));
        d["te_jax_dact_dbias_amax"] = stages(handler_capsule(tc::DActAmaxInitializeFFI),
                                             handler_capsule(tc::DActAmaxFFI));
        return d;
      },
      "{target name: {'initialize': capsule, 'execute': capsule}} for "
      "jax.ffi.register_ffi_target(name, stages, platform='CUDA').");
}
