// Decoding and validation of the te_jax FFI calls, shared by the CPU and CUDA handlers.
//
// A handler binds its buffers (see bindings.h), calls decode_act_lu / decode_dact_dbias to fill a
// problem (returning the error if any), and hands the problem to its backend. Everything a backend needs is here: typed views of the
// shapes, the raw pointers, and the optional outputs (nullptr when not requested). Shape and dtype
// errors come back as ffi::Error::InvalidArgument naming the op, what was expected and what was
// received; Python checks the same things at trace time, so these only fire on a bad direct call.
//
// Layout (row-major):
//   act_lu      x  [rows, act_len, H]  ->  y [rows, H]
//   dact_dbias  dz [rows, H], x [rows, act_len, H]  ->  dx [rows, act_len, H]
//               dbias [batches, act_len, H]: the sum of dx over each batch's rows/batches rows
//               workspace float32 [batches, groups, act_len * H]: per-group partial sums
// act_len is 2 for gated activations, 1 otherwise (for which the act axis is absent in the buffers).
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>

#include "common/activations.h"
#include "common/attrs.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

namespace ffi = ::xla::ffi;

// Input dtypes the kernels take.
enum class DType { F32, F16, BF16 };

struct ActLuProblem {
  DType dtype;
  ActivationEnum act;
  ActParams params;
  int64_t rows;
  int64_t hidden;
  const void* x;
  void* y;
  float* amax;  // max|y| as float32, or nullptr when output_amax is off
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
  float* amax;        // max|dx| as float32, or nullptr
};

namespace detail {

inline std::string dims_str(ffi::Span<const int64_t> d) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < d.size(); ++i) s << (i ? ", " : "") << d[i];
  s << (d.size() == 1 ? ",)" : ")");
  return s.str();
}

inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F64: return "float64";
    default: return "an unsupported dtype";
  }
}

inline std::optional<DType> kernel_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::F32;
    case ffi::DataType::F16: return DType::F16;
    case ffi::DataType::BF16: return DType::BF16;
    default: return std::nullopt;
  }
}

inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

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

inline bool same_dims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// Checks the quantization arguments. Only NO_SCALING is implemented so far: the scaled modes
// return an error naming the mode, and their outputs must be empty.
inline ffi::Error check_no_scaling(const char* op, ScalingMode mode, ffi::AnyBuffer scale,
                                   ffi::AnyBuffer amax, ffi::AnyBuffer colwise_out,
                                   ffi::AnyBuffer scale_inv, ffi::AnyBuffer colwise_scale_inv,
                                   ffi::AnyBuffer updated_amax, bool output_amax) {
  if (mode != ScalingMode::NO_SCALING) {
    return invalid(op, std::string("scaling_mode ") + scaling_mode_name(mode) +
                           " is not implemented yet; only NO_SCALING is");
  }
  if (scale.element_type() != ffi::DataType::F32 || amax.element_type() != ffi::DataType::F32) {
    return invalid(op, "scale and amax must be float32");
  }
  if (colwise_out.element_count() != 0 || scale_inv.element_count() != 0 ||
      colwise_scale_inv.element_count() != 0) {
    return invalid(op, "NO_SCALING takes empty colwise_output, scale_inv and colwise_scale_inv");
  }
  const size_t want = output_amax ? 1 : 0;
  if (updated_amax.element_type() != ffi::DataType::F32 || updated_amax.element_count() != want) {
    return invalid(op, std::string("updated_amax must be float32 with ") + std::to_string(want) +
                           " element(s) when output_amax is " + (output_amax ? "true" : "false"));
  }
  return ffi::Error::Success();
}

}  // namespace detail

inline ffi::Error decode_act_lu(
    ActLuProblem& p, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer amax, ffi::AnyBuffer* out,
    ffi::AnyBuffer* colwise_out, ffi::AnyBuffer* scale_inv, ffi::AnyBuffer* colwise_scale_inv,
    ffi::AnyBuffer* updated_amax, ActivationEnum act, ScalingMode mode, QuantizeLayout layout,
    const ActParams& params, bool output_amax) {
  constexpr const char* op = "te_jax_act_lu";
  using namespace detail;
  int act_len = 0;
  if (!with_activation(act, [&](auto spec) { act_len = decltype(spec)::kActLen; })) {
    return invalid(op, "unknown act_enum " + std::to_string(static_cast<int64_t>(act)));
  }
  auto dtype = kernel_dtype(x.element_type());
  if (!dtype) {
    return invalid(op, std::string("x must be float32, bfloat16 or float16, got ") +
                           dtype_name(x.element_type()));
  }
  if (auto e = check_no_scaling(op, mode, scale, amax, *colwise_out, *scale_inv,
                                *colwise_scale_inv, *updated_amax, output_amax);
      e.failure()) {
    return e;
  }
  p = ActLuProblem{*dtype, act, params, 0, 0, x.untyped_data(), out->untyped_data(), nullptr};
  if (auto e = split_rows(op, x.dimensions(), act_len, p.rows, p.hidden); e.failure()) return e;
  if (out->element_type() != x.element_type() ||
      out->element_count() != static_cast<size_t>(p.rows * p.hidden)) {
    return invalid(op, "output must be " + std::string(dtype_name(x.element_type())) + " with " +
                           std::to_string(p.rows * p.hidden) + " elements, got " +
                           dims_str(out->dimensions()));
  }
  if (output_amax) p.amax = updated_amax->typed_data<float>();
  return ffi::Error::Success();
}

inline ffi::Error decode_dact_dbias(
    DActProblem& p, ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer amax,
    ffi::AnyBuffer* out, ffi::AnyBuffer* colwise_out, ffi::AnyBuffer* scale_inv,
    ffi::AnyBuffer* colwise_scale_inv, ffi::AnyBuffer* updated_amax, ffi::AnyBuffer* dbias,
    ffi::AnyBuffer* workspace, ScalingMode mode, ActivationEnum act, QuantizeLayout layout,
    bool is_dbias, const ActParams& params, bool output_amax) {
  constexpr const char* op = "te_jax_dact_dbias_quantize";
  using namespace detail;
  int act_len = 0;
  if (!with_activation(act, [&](auto spec) { act_len = decltype(spec)::kActLen; })) {
    return invalid(op, "unknown act_enum " + std::to_string(static_cast<int64_t>(act)));
  }
  auto dtype = kernel_dtype(x.element_type());
  if (!dtype) {
    return invalid(op, std::string("x must be float32, bfloat16 or float16, got ") +
                           dtype_name(x.element_type()));
  }
  if (dz.element_type() != x.element_type()) {
    return invalid(op, std::string("dz must have x's dtype ") + dtype_name(x.element_type()) +
                           ", got " + dtype_name(dz.element_type()));
  }
  if (auto e = check_no_scaling(op, mode, scale, amax, *colwise_out, *scale_inv,
                                *colwise_scale_inv, *updated_amax, output_amax);
      e.failure()) {
    return e;
  }
  p = DActProblem{};
  p.dtype = *dtype;
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
  if (out->element_type() != x.element_type() || !same_dims(out->dimensions(), x.dimensions())) {
    return invalid(op, "output must have x's shape " + dims_str(x.dimensions()) + " and dtype");
  }
  p.dz = dz.untyped_data();
  p.x = x.untyped_data();
  p.dx = out->untyped_data();
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
  if (output_amax) p.amax = updated_amax->typed_data<float>();
  return ffi::Error::Success();
}

}  // namespace te_jax
