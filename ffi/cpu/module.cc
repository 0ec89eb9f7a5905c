// The _te_jax_cpu extension module and the CPU registration table: every op family's targets, each
// with its execute handler, for jax.ffi.register_ffi_target(name, capsule, platform="cpu").
#include <nanobind/nanobind.h>

#include "activation/cpu/run.h"
#include "activation/targets.h"
#include "common/handler.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace {

// d[name] = the execute handler's capsule, for each target of a family on its CPU backend.
template <class Backend, class... Targets>
void add_targets(nb::dict& d, te_jax::TargetList<Targets...>) {
  constexpr auto kExecute = xla::ffi::ExecutionStage::kExecute;
  ((d[Targets::kName] =
        nb::capsule(reinterpret_cast<void*>(&te_jax::handler<Targets, Backend, kExecute>))),
   ...);
}

}  // namespace

NB_MODULE(_te_jax_cpu, m) {
  m.doc() = "te_jax CPU kernels (XLA FFI handlers)";
  m.def(
      "registrations",
      [] {
        nb::dict d;
        add_targets<te_jax::cpu::ActivationBackend>(d, te_jax::activation::Targets{});
        return d;
      },
      "{target name: PyCapsule of its XLA FFI execute handler} for platform \"cpu\".");
}
