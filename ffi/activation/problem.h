// The activation family's problems (what a backend runs) and the decoding and validation of its
// FFI calls into them, shared by the CPU and CUDA backends.
//
// A target's handler body (targets.h) calls decode_act_lu / decode_dact_dbias / ... to fill a
// problem (returning the error if any) and hands the problem to its backend. Everything a backend
// needs is here: typed views of the shapes, the raw pointers, and the optional outputs (nullptr
// when not requested). Shape and dtype errors come back as ffi::Error::InvalidArgument naming the
// op, what was expected and what was received; Python checks the same things at trace time, so
// these only fire on a bad direct call.
//
// Layout (row-major):
//   act_lu      x  [rows, act_len, H]  ->  y [rows, H]
//   dact_dbias  dz [rows, H], x [rows, act_len, H]  ->  dx [rows, act_len, H]
//               dbias [batches, act_len, H]: the sum of dx over each batch's rows/batches rows
//               workspace float32 [batches, groups, act_len * H]: per-group partial sums
// act_len is 2 for gated activations, 1 otherwise (for which the act axis is absent in the buffers).
//
// Quantized outputs (common/quant_output.h) view the output y as 2-D [M, N] (act_lu: M = rows,
// N = H; dact: N = act_len * H).
// The value quantized is y rounded to x's dtype (what NO_SCALING would output), so a fused op
// equals quantize(op(x)) bit for bit; dbias still sums the unrounded float32 values.
// The amax targets (te_jax_act_amax, te_jax_dact_dbias_amax) are the first pass of the two-pass
// modes: max|y| per batch (and dbias), nothing else written.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "activation/activations.h"
#include "common/dtypes.h"
#include "common/ffi_errors.h"
#include "common/quant_output.h"
#include "common/scaling.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

struct ActLuProblem {
  DType dtype;
  ActivationEnum act;
  ActParams params;
  int64_t rows;
  int64_t hidden;
  const void* x;
  void* y;      // NO_SCALING output (nullptr when `quantized`)
  float* amax;  // NO_SCALING: max|y| as float32, or nullptr when output_amax is off
  bool quantized = false;  // the generic path: emit through q instead of y / amax
  QuantOutput q;
};

struct DActProblem {
  DType dtype;
  ActivationEnum act;
  ActParams params;
  int act_len;
  int64_t rows;
  int64_t hidden;
  const void* dz;
  const void* x;
  void* dx;
  void* dbias;        // [batches, act_len * hidden] in the input dtype, or nullptr
  float* workspace;   // [batches, groups, act_len * hidden], or nullptr
  int64_t batches;    // dbias is reduced over rows / batches consecutive rows per batch
  int64_t groups;     // row groups per batch (deterministic two-stage reduction)
  float* amax;        // NO_SCALING: max|dx| as float32, or nullptr
  bool quantized = false;  // the generic path: emit dx through q instead of dx / amax
  QuantOutput q;
};

namespace detail {

// Splits x's dims into rows * act_len * hidden; checks the gated axis.
inline ffi::Error split_rows(const char* op, ffi::Span<const int64_t> d, int act_len,
                             int64_t& rows, int64_t& hidden) {
  const size_t feature_rank = static_cast<size_t>(act_len == 2 ? 2 : 1);
  if (d.size() < feature_rank) {
    return invalid(op, "x must have rank >= " + std::to_string(feature_rank) + ", got shape " +
                           dims_str(d));
  }
  if (act_len == 2 && d[d.size() - 2] != 2) {
    return invalid(op, "a gated activation takes x of shape (..., 2, H), got " + dims_str(d));
  }
  hidden = d[d.size() - 1];
  rows = 1;
  for (size_t i = 0; i + feature_rank < d.size(); ++i) rows *= d[i];
  return ffi::Error::Success();
}

inline ffi::Error activation_len(const char* op, ActivationEnum act, int& act_len) {
  if (!with_activation(act, [&](auto spec) { act_len = decltype(spec)::kActLen; })) {
    return invalid(op, "unknown act_enum " + std::to_string(static_cast<int64_t>(act)));
  }
  return ffi::Error::Success();
}

// x's dtype, one the kernels take.
inline ffi::Error input_dtype(const char* op, ffi::AnyBuffer x, DType& dtype) {
  const std::optional<DType> t = kernel_dtype(x.element_type());
  if (!t) {
    return invalid(op, std::string("x must be float32, bfloat16 or float16, got ") +
                           dtype_name(x.element_type()));
  }
  dtype = *t;
  return ffi::Error::Success();
}

// x (and its activation) of act_lu and the amax pass.
inline ffi::Error decode_act_input(const char* op, ActLuProblem& p, ffi::AnyBuffer x,
                                   ActivationEnum act, const ActParams& params, int& act_len) {
  if (auto e = activation_len(op, act, act_len); e.failure()) return e;
  DType dtype = DType::F32;
  if (auto e = input_dtype(op, x, dtype); e.failure()) return e;
  p = ActLuProblem{dtype, act, params, 0, 0, x.untyped_data(), nullptr, nullptr};
  return split_rows(op, x.dimensions(), act_len, p.rows, p.hidden);
}

// dz, x, dbias and workspace of dact_dbias and its amax pass.
inline ffi::Error decode_dact_input(const char* op, DActProblem& p, ffi::AnyBuffer dz,
                                    ffi::AnyBuffer x, ffi::AnyBuffer* dbias,
                                    ffi::AnyBuffer* workspace, ActivationEnum act, bool is_dbias,
                                    const ActParams& params) {
  int act_len = 0;
  if (auto e = activation_len(op, act, act_len); e.failure()) return e;
  DType dtype = DType::F32;
  if (auto e = input_dtype(op, x, dtype); e.failure()) return e;
  if (act == ActivationEnum::IDENTITY) {
    return invalid(op, "act_enum IDENTITY is for te_jax_quantize / te_jax_act_amax only");
  }
  if (dz.element_type() != x.element_type()) {
    return invalid(op, std::string("dz must have x's dtype ") + dtype_name(x.element_type()) +
                           ", got " + dtype_name(dz.element_type()));
  }
  p = DActProblem{};
  p.dtype = dtype;
  p.act = act;
  p.params = params;
  p.act_len = act_len;
  if (auto e = split_rows(op, x.dimensions(), act_len, p.rows, p.hidden); e.failure()) return e;
  const int64_t n = act_len * p.hidden;
  if (dz.element_count() != static_cast<size_t>(p.rows * p.hidden) ||
      (dz.dimensions().size() > 0 && dz.dimensions().back() != p.hidden)) {
    return invalid(op, "dz must have shape x.shape without the act axis (" +
                           std::to_string(p.rows) + " rows of " + std::to_string(p.hidden) +
                           "), got " + dims_str(dz.dimensions()));
  }
  p.dz = dz.untyped_data();
  p.x = x.untyped_data();
  if (is_dbias) {
    if (dbias->element_type() != x.element_type() || n == 0 || dbias->element_count() == 0 ||
        dbias->element_count() % n != 0) {
      return invalid(op, "dbias must have x's dtype and [batches, " + std::to_string(act_len) +
                             ", " + std::to_string(p.hidden) + "] elements, got " +
                             dims_str(dbias->dimensions()));
    }
    p.batches = static_cast<int64_t>(dbias->element_count()) / n;
    auto wd = workspace->dimensions();
    if (workspace->element_type() != ffi::DataType::F32 || wd.size() != 3 ||
        wd[0] != p.batches || wd[1] < 1 || wd[2] != n) {
      return invalid(op, "workspace must be float32 [" + std::to_string(p.batches) +
                             ", groups >= 1, " + std::to_string(n) + "], got " + dims_str(wd));
    }
    if (p.rows % p.batches != 0) {
      return invalid(op, std::to_string(p.rows) + " rows do not split into " +
                             std::to_string(p.batches) + " dbias batches");
    }
    p.groups = wd[1];
    p.dbias = dbias->untyped_data();
    p.workspace = workspace->typed_data<float>();
  } else if (dbias->element_count() != 0 || workspace->element_count() != 0) {
    return invalid(op, "dbias and workspace must be empty when is_dbias is false");
  }
  return ffi::Error::Success();
}

// Quantized dact with dbias: the dbias batches are the quantization batches.
inline ffi::Error check_dbias_batches(const char* op, const DActProblem& p) {
  if (p.quantized && p.dbias != nullptr && p.batches != p.q.batches) {
    return invalid(op, "dbias has " + std::to_string(p.batches) + " batches but scale has " +
                           std::to_string(p.q.batches));
  }
  return ffi::Error::Success();
}

}  // namespace detail

// te_jax_act_lu, and te_jax_quantize (act IDENTITY, x viewed as [rows, N]: Python passes 2-D x).
inline ffi::Error decode_act_lu(
    ActLuProblem& p, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer amax,
    ffi::AnyBuffer* out, ffi::AnyBuffer* colwise_out, ffi::AnyBuffer* scale_inv,
    ffi::AnyBuffer* colwise_scale_inv, ffi::AnyBuffer* amax_out, ffi::AnyBuffer* global_scale_inv,
    ActivationEnum act, ScalingMode mode, QuantizeLayout layout, const ActParams& params,
    const BlockOptions& options, bool output_amax, const char* op) {
  using namespace detail;
  int act_len = 0;
  if (auto e = decode_act_input(op, p, x, act, params, act_len); e.failure()) return e;
  if (amax.element_type() != ffi::DataType::F32) return invalid(op, "amax must be float32");
  const OutputBuffers b{scale, amax, *out, *colwise_out, *scale_inv, *colwise_scale_inv,
                        *amax_out, *global_scale_inv};
  return decode_quant_output(op, mode, layout, x.element_type(), p.rows, p.hidden, p.hidden, b,
                             options, output_amax, p.y, p.amax, p.quantized, p.q);
}

// te_jax_dact_dbias_quantize.
inline ffi::Error decode_dact_dbias(
    DActProblem& p, ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer amax,
    ffi::AnyBuffer* out, ffi::AnyBuffer* colwise_out, ffi::AnyBuffer* scale_inv,
    ffi::AnyBuffer* colwise_scale_inv, ffi::AnyBuffer* amax_out, ffi::AnyBuffer* global_scale_inv,
    ffi::AnyBuffer* dbias, ffi::AnyBuffer* workspace, ScalingMode mode, ActivationEnum act,
    QuantizeLayout layout, bool is_dbias, const ActParams& params, const BlockOptions& options,
    bool output_amax) {
  constexpr const char* op = "te_jax_dact_dbias_quantize";
  using namespace detail;
  if (auto e = decode_dact_input(op, p, dz, x, dbias, workspace, act, is_dbias, params);
      e.failure()) {
    return e;
  }
  if (amax.element_type() != ffi::DataType::F32) return invalid(op, "amax must be float32");
  if (mode == ScalingMode::NO_SCALING &&
      (out->element_type() != x.element_type() || !same_dims(out->dimensions(), x.dimensions()))) {
    return invalid(op, "output must have x's shape " + dims_str(x.dimensions()) + " and dtype");
  }
  const OutputBuffers b{scale, amax, *out, *colwise_out, *scale_inv, *colwise_scale_inv,
                        *amax_out, *global_scale_inv};
  if (auto e = decode_quant_output(op, mode, layout, x.element_type(), p.rows,
                                   p.act_len * p.hidden, p.hidden, b, options, output_amax, p.dx,
                                   p.amax, p.quantized, p.q);
      e.failure()) {
    return e;
  }
  return check_dbias_batches(op, p);
}

// te_jax_act_amax: the first pass of act_lu (or quantize, act = IDENTITY) in the two-pass modes.
inline ffi::Error decode_act_amax(ActLuProblem& p, ffi::AnyBuffer x, ffi::AnyBuffer* amax_out,
                                  ActivationEnum act, const ActParams& params) {
  constexpr const char* op = "te_jax_act_amax";
  using namespace detail;
  int act_len = 0;
  if (auto e = decode_act_input(op, p, x, act, params, act_len); e.failure()) return e;
  p.quantized = true;
  return decode_amax_output(op, p.rows, *amax_out, p.q);
}

// te_jax_dact_dbias_amax: the first pass of dact_dbias in the two-pass modes (amax and dbias).
inline ffi::Error decode_dact_amax(DActProblem& p, ffi::AnyBuffer dz, ffi::AnyBuffer x,
                                   ffi::AnyBuffer* amax_out, ffi::AnyBuffer* dbias,
                                   ffi::AnyBuffer* workspace, ActivationEnum act, bool is_dbias,
                                   const ActParams& params) {
  constexpr const char* op = "te_jax_dact_dbias_amax";
  using namespace detail;
  if (auto e = decode_dact_input(op, p, dz, x, dbias, workspace, act, is_dbias, params);
      e.failure()) {
    return e;
  }
  p.quantized = true;
  if (auto e = decode_amax_output(op, p.rows, *amax_out, p.q); e.failure()) return e;
  return check_dbias_batches(op, p);
}

}  // namespace te_jax
