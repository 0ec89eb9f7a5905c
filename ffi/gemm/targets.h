// The GEMM family's XLA FFI target: its binding (the FFI contract) and its ONE handler body; the
// body decodes the call (gemm/problem.h) and hands it to Backend::run<S> (gemm/cuda/run.h).
// CUDA only: on the CPU te_jax's GEMM is lax.dot_general (te_jax/primitives/gemm/).
//
// te_jax_gemm
//   args  lhs (B?, M, K) or stored (B?, K, M) with lhs_trans; rhs (B?, K, N) or stored (B?, N, K)
//         with rhs_trans; bias (N,) in out's dtype or (0,); aux_in (B?, M, N) (DGELU) or (0,);
//         lhs_scale_inv, rhs_scale_inv: f32[1] (FP8 dequantization scales; 1 otherwise), or an
//         FP8 operand's block scales in cuBLASLt's layout (its scale mode, gemm/problem.h);
//         addend (B?, M, N) in out's dtype or (0,) (C, added with beta = 1; DEFAULT epilogue)
//   rets  out (B?, M, N); aux_out (B?, M, N) for GELU_AUX or (0,); dbias (N,) for grad_bias or
//         (0,); workspace u8[bytes]
//   attrs lhs_trans, rhs_trans (bool), epilogue (GemmEpilogue, int64), grad_bias,
//         split_accumulator, deterministic (bool), lhs_scale_mode, rhs_scale_mode
//         (GemmScaleMode, int64)
// Operands are f32 / bf16 / f16 (out the same dtype) or FP8 (E4M3 x E4M3, E4M3 x E5M2,
// E5M2 x E4M3; out f32 / bf16 / f16) in the TN form: lhs (M, K), rhs stored (N, K).
// `deterministic` takes cuBLASLt's first heuristic choice instead of timing candidates: the same
// bits in every process (gemm/NOTES.md). An amax of the output is the caller's to reduce.
#pragma once

#include "common/handler.h"
#include "gemm/problem.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(te_jax::gemm::GemmEpilogue);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(te_jax::gemm::GemmScaleMode);

namespace te_jax::gemm {

using Ret = ffi::Result<ffi::AnyBuffer>;

struct Gemm {
  static constexpr const char* kName = "te_jax_gemm";

  template <ffi::ExecutionStage S, class Context>
  static auto bind() {
    return ffi::Ffi::Bind<S>()
        .template Ctx<Context>()
        .template Arg<ffi::AnyBuffer>()  // lhs
        .template Arg<ffi::AnyBuffer>()  // rhs
        .template Arg<ffi::AnyBuffer>()  // bias
        .template Arg<ffi::AnyBuffer>()  // aux_in
        .template Arg<ffi::AnyBuffer>()  // lhs_scale_inv
        .template Arg<ffi::AnyBuffer>()  // rhs_scale_inv
        .template Arg<ffi::AnyBuffer>()  // addend
        .template Ret<ffi::AnyBuffer>()  // out
        .template Ret<ffi::AnyBuffer>()  // aux_out
        .template Ret<ffi::AnyBuffer>()  // dbias
        .template Ret<ffi::AnyBuffer>()  // workspace
        .template Attr<bool>("lhs_trans")
        .template Attr<bool>("rhs_trans")
        .template Attr<GemmEpilogue>("epilogue")
        .template Attr<bool>("grad_bias")
        .template Attr<bool>("split_accumulator")
        .template Attr<bool>("deterministic")
        .template Attr<GemmScaleMode>("lhs_scale_mode")
        .template Attr<GemmScaleMode>("rhs_scale_mode");
  }

  template <class Backend, ffi::ExecutionStage S>
  static ffi::Error impl(ContextArg<Backend> ctx, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                         ffi::AnyBuffer bias, ffi::AnyBuffer aux_in,
                         ffi::AnyBuffer lhs_scale_inv, ffi::AnyBuffer rhs_scale_inv,
                         ffi::AnyBuffer addend, Ret out,
                         Ret aux_out, Ret dbias, Ret workspace, bool lhs_trans, bool rhs_trans,
                         GemmEpilogue epilogue, bool grad_bias, bool split_accumulator,
                         bool deterministic, GemmScaleMode lhs_scale_mode,
                         GemmScaleMode rhs_scale_mode) {
    GemmProblem p;
    if (auto e = decode_gemm(p, lhs, rhs, bias, aux_in, lhs_scale_inv, rhs_scale_inv, addend, &*out,
                             &*aux_out, &*dbias, &*workspace, lhs_trans, rhs_trans, epilogue,
                             grad_bias, split_accumulator, deterministic, lhs_scale_mode,
                             rhs_scale_mode, kName);
        e.failure()) {
      return e;
    }
    return Backend::template run<S>(kName, p, ctx);
  }
};

using Targets = TargetList<Gemm>;

}  // namespace te_jax::gemm
