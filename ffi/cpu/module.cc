// The _te_jax_cpu extension module: the CPU FFI handlers as PyCapsules, for
// jax.ffi.register_ffi_target(name, capsule, platform="cpu").
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace te_jax::cpu {
// Defined in handlers.cc.
XLA_FFI_Handler* act_lu_handler();
XLA_FFI_Handler* dact_dbias_handler();
XLA_FFI_Handler* quantize_handler();
XLA_FFI_Handler* act_amax_handler();
XLA_FFI_Handler* dact_amax_handler();
}  // namespace te_jax::cpu

NB_MODULE(_te_jax_cpu, m) {
  m.doc() = "te_jax CPU kernels (XLA FFI handlers)";
  m.def(
      "registrations",
      [] {
        namespace tc = te_jax::cpu;
        const auto capsule = [](XLA_FFI_Handler* h) {
          return nb::capsule(reinterpret_cast<void*>(h));
        };
        nb::dict d;
        d["te_jax_act_lu"] = capsule(tc::act_lu_handler());
        d["te_jax_dact_dbias_quantize"] = capsule(tc::dact_dbias_handler());
        d["te_jax_quantize"] = capsule(tc::quantize_handler());
        d["te_jax_act_amax"] = capsule(tc::act_amax_handler());
        d["te_jax_dact_dbias_amax"] = capsule(tc::dact_amax_handler());
        return d;
      },
      "{target name: PyCapsule of its XLA FFI execute handler} for platform \"cpu\".");
}
