// One XLA FFI handler per (target, backend, stage), from one handler body per target.
//
// A target (e.g. activation/targets.h) is a struct with
//   static constexpr const char* kName;                      the FFI target name
//   template <ExecutionStage S, class Context> static auto bind();   its binding: args, rets, attrs
//   template <class Backend, ExecutionStage S> static ffi::Error impl(ContextArg<Backend>, ...);
// and a backend (e.g. activation/cpu/run.h) supplies `Context` (the FFI context type its bodies
// take), cmd_buffer_compatible(S), and the run<S>(op, problem, context) the body ends with.
// handler<Target, Backend, S> is what XLA_FFI_DEFINE_HANDLER would define for that triple: a
// plain function, a distinct symbol per instantiation, holding its decoded binding in a static.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace te_jax {

// The type a handler body receives for its backend's context (ffi::ThreadPool stays itself;
// ffi::PlatformStream<cudaStream_t> arrives as the cudaStream_t).
template <class Backend>
using ContextArg = typename ::xla::ffi::CtxDecoding<typename Backend::Context>::Type;

template <class Target, class Backend, ::xla::ffi::ExecutionStage S>
XLA_FFI_Error* handler(XLA_FFI_CallFrame* call_frame) {
  namespace ffi = ::xla::ffi;
  static const auto* bound = [] {
    auto binding = Target::template bind<S, typename Backend::Context>();
    constexpr auto* impl = &Target::template impl<Backend, S>;
    if constexpr (Backend::cmd_buffer_compatible(S)) {
      return binding.To(impl, {ffi::Traits::kCmdBufferCompatible}).release();
    } else {
      return binding.To(impl).release();
    }
  }();
  return bound->Call(call_frame);
}

// The targets of one op family, for the backends' registration tables.
template <class... Targets>
struct TargetList {};

}  // namespace te_jax
