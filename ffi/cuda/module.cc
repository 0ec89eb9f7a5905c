// The _te_jax_cuda extension module and the CUDA registration table: every op family's targets,
// each with its initialize and execute handlers (see backend.h), for
// jax.ffi.register_ffi_target(name, stages, platform="CUDA").
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "activation/cuda/run.h"
#include "activation/targets.h"
#include "common/handler.h"
#include "gemm/cuda/cublaslt.h"
#include "gemm/cuda/run.h"
#include "gemm/targets.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace {

template <class Target, class Backend, xla::ffi::ExecutionStage S>
nb::capsule capsule() {
  return nb::capsule(reinterpret_cast<void*>(&te_jax::handler<Target, Backend, S>));
}

// d[name] = {"initialize": capsule, "execute": capsule}, for each target of a family on its CUDA
// backend.
template <class Backend, class... Targets>
void add_targets(nb::dict& d, te_jax::TargetList<Targets...>) {
  using Stage = xla::ffi::ExecutionStage;
  const auto stages = [](nb::capsule initialize, nb::capsule execute) {
    nb::dict s;
    s["initialize"] = initialize;
    s["execute"] = execute;
    return s;
  };
  ((d[Targets::kName] = stages(capsule<Targets, Backend, Stage::kInitialize>(),
                               capsule<Targets, Backend, Stage::kExecute>())),
   ...);
}

}  // namespace

NB_MODULE(_te_jax_cuda, m) {
  m.doc() = "te_jax CUDA kernels, as XLA FFI handlers";
  m.def(
      "registrations",
      []() {
        nb::dict d;
        add_targets<te_jax::cuda::ActivationBackend>(d, te_jax::activation::Targets{});
        add_targets<te_jax::cuda::GemmBackend>(d, te_jax::gemm::Targets{});
        return d;
      },
      "{target name: {'initialize': capsule, 'execute': capsule}} for "
      "jax.ffi.register_ffi_target(name, stages, platform='CUDA').");
  m.def("set_cublaslt_path", &te_jax::gemm::set_cublaslt_path, nb::arg("path"),
        "Where te_jax_gemm loads libcublasLt from if jax's CUDA plugin has not loaded it.");
}
