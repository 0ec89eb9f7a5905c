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
//
// Quantized outputs (SPEC.md §4-§5) view the output y as 2-D [M, N] (act_lu: M = rows, N = H;
// dact: N = act_len * H) split into `batches` independent tensors of M / batches consecutive rows
// (one per vmapped batch element; 1 otherwise), each with its own tensor scale and amax:
//   DELAYED / CURRENT  data fp8 [M, N]; colwise fp8 [batches, N, M / batches] (each batch's
//                      transpose); scale_inv f32[batches] = 1/scale
//   MXFP8              data and colwise fp8 [M, N]; block scales E8M0 [M, N/32] / [M/32, N]
//   NVFP4              data and colwise float4_e2m1fn [M, N], which XLA packs two per byte, first
//                      element in the low nibble; block scales E4M3 [M, N/16] / [M/16, N]; the
//                      global scale S; its inverse 1/S is the global_scale_inv output (f32[batches])
// Inputs scale and amax, f32[batches]: DELAYED reads `scale`; CURRENT and NVFP4 read `amax`, the
// (global) amax of their first pass, and derive the scale (fmt::scale_from_amax: Q / amax, resp.
// 6 * 448 / amax), so no scale arithmetic is left to the caller. Every 1/scale is fmt::div_rn
// (correctly rounded, subnormal results included, under any denormal mode).
// The value quantized is y rounded to x's dtype (what NO_SCALING would output), so a fused op
// equals quantize(op(x)) bit for bit; dbias still sums the unrounded float32 values.
// The amax targets (te_jax_act_amax, te_jax_dact_dbias_amax) are the first pass of the two-pass
// modes: max|y| per batch (and dbias), nothing else written.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>

#include "activation/activations.h"
#include "common/scaling.h"
#include "common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

namespace ffi = ::xla::ffi;

// Input dtypes the kernels take.
enum class DType { F32, F16, BF16 };

// Quantized output formats.
enum class QType { E4M3, E5M2, E2M1 };

// What the generic path writes: the amax pass (first pass of CURRENT and NVFP4) only max|y|; the
// scaled modes their codes and scales. DELAYED and CURRENT emit alike (TENSOR): they differ only in
// where the scale comes from (QuantOutput::tensor_scale).
enum class QuantEmit { AMAX_PASS, TENSOR, MXFP8, NVFP4 };

// The emit of a scaled mode (NO_SCALING has none: it takes the elementwise path).
constexpr QuantEmit quant_emit(ScalingMode m) {
  return m == ScalingMode::MXFP8_1D_SCALING   ? QuantEmit::MXFP8
         : m == ScalingMode::NVFP4_1D_SCALING ? QuantEmit::NVFP4
                                              : QuantEmit::TENSOR;
}

inline const char* quant_emit_name(QuantEmit e) {
  switch (e) {
    case QuantEmit::AMAX_PASS: return "AMAX_PASS";
    case QuantEmit::TENSOR: return "TENSOR";
    case QuantEmit::MXFP8: return "MXFP8";
    case QuantEmit::NVFP4: return "NVFP4";
  }
  return "?";
}

// Where and how an op emits y on its generic (quantizing or amax-only) path; see the top comment.
// Pointers of outputs the call does not produce are nullptr.
struct QuantOutput {
  QuantEmit emit = QuantEmit::AMAX_PASS;
  QType qtype = QType::E4M3;
  int64_t batches = 1;
  const float* scale = nullptr;          // [batches]: DELAYED the scale; CURRENT / NVFP4 the amax
                                         // input (the scale derives from it)
  float scale_numerator = 0.0f;          // CURRENT: Q; NVFP4: 6 * 448; DELAYED: 0 (scale given)
  uint8_t* data = nullptr;               // rowwise codes
  uint8_t* colwise = nullptr;            // colwise codes
  float* scale_inv = nullptr;            // [batches] 1 / scale: DELAYED, CURRENT; NVFP4 1 / S
  uint8_t* block_scale = nullptr;        // MXFP8 / NVFP4 rowwise block scales
  uint8_t* colwise_block_scale = nullptr;
  float* amax = nullptr;                 // [batches] max|y|
  bool rowwise() const { return data != nullptr; }
  bool colwise_out() const { return colwise != nullptr; }
  // The tensor scale of batch b (DELAYED, CURRENT, NVFP4).
  float tensor_scale(int64_t b) const {
    return scale_numerator > 0.0f ? fmt::scale_from_amax(scale[b], scale_numerator) : scale[b];
  }
};

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

inline const char* qtype_name(QType t) {
  switch (t) {
    case QType::E4M3: return "float8_e4m3fn";
    case QType::E5M2: return "float8_e5m2";
    case QType::E2M1: return "float4_e2m1fn (packed uint8)";
  }
  return "?";
}

inline std::string count_error(const char* what, size_t want, ffi::AnyBuffer b) {
  return std::string(what) + " must have " + std::to_string(want) + " elements, got shape " +
         dims_str(b.dimensions());
}

// The output buffers of an op whose output y is [m, n], made of rows of `unit`-column pieces that
// a scaling block must not straddle (gated dact: the two halves, unit = H; otherwise unit = n).
// NO_SCALING fills y / amax (the fast path); the scaled modes fill q and set quantized.
struct OutputBuffers {
  ffi::AnyBuffer scale, amax_in, out, colwise_out, scale_inv, colwise_scale_inv, amax_out,
      global_scale_inv;
};

inline ffi::Error decode_output(const char* op, ScalingMode mode, QuantizeLayout layout,
                                ffi::DataType x_type, int64_t m, int64_t n, int64_t unit,
                                const OutputBuffers& b, bool output_amax, void*& y, float*& amax,
                                bool& quantized, QuantOutput& q) {
  using DT = ffi::DataType;
  if (b.scale.element_type() != DT::F32 || b.amax_out.element_type() != DT::F32 ||
      b.global_scale_inv.element_type() != DT::F32) {
    return invalid(op, "scale, amax and global_scale_inv must be float32");
  }
  if (layout != QuantizeLayout::ROWWISE && layout != QuantizeLayout::COLWISE &&
      layout != QuantizeLayout::ROWWISE_COLWISE) {
    return invalid(op, "unknown quantize_layout " + std::to_string(static_cast<int64_t>(layout)));
  }
  const size_t elems = static_cast<size_t>(m * n);
  if (mode == ScalingMode::NO_SCALING) {
    if (b.colwise_out.element_count() != 0 || b.scale_inv.element_count() != 0 ||
        b.colwise_scale_inv.element_count() != 0) {
      return invalid(op, "NO_SCALING takes empty colwise_output, scale_inv and colwise_scale_inv");
    }
    const size_t want = output_amax ? 1 : 0;
    if (b.global_scale_inv.element_count() != 0) {
      return invalid(op, "NO_SCALING takes an empty global_scale_inv");
    }
    if (b.amax_out.element_count() != want) {
      return invalid(op, std::string("amax must have ") + std::to_string(want) +
                             " element(s) when output_amax is " + (output_amax ? "true" : "false"));
    }
    if (b.out.element_type() != x_type || b.out.element_count() != elems) {
      return invalid(op, "output must be " + std::string(dtype_name(x_type)) + " with " +
                             std::to_string(elems) + " elements, got " +
                             dims_str(b.out.dimensions()));
    }
    y = b.out.untyped_data();
    amax = output_amax ? b.amax_out.typed_data<float>() : nullptr;
    quantized = false;
    return ffi::Error::Success();
  }

  const bool tensor = mode == ScalingMode::DELAYED_TENSOR_SCALING ||
                      mode == ScalingMode::CURRENT_TENSOR_SCALING;
  const bool mxfp8 = mode == ScalingMode::MXFP8_1D_SCALING;
  const bool nvfp4 = mode == ScalingMode::NVFP4_1D_SCALING;
  if (!tensor && !mxfp8 && !nvfp4) {
    return invalid(op, "unknown scaling_mode " + std::to_string(static_cast<int64_t>(mode)));
  }
  const bool row = layout != QuantizeLayout::COLWISE;
  const bool col = layout != QuantizeLayout::ROWWISE;
  q = QuantOutput{};
  q.emit = quant_emit(mode);
  // One tensor per element of the per-batch input: CURRENT and NVFP4 read the amax of their
  // first pass, DELAYED (and MXFP8, for the count only) the scale.
  const bool from_amax = mode == ScalingMode::CURRENT_TENSOR_SCALING || nvfp4;
  const ffi::AnyBuffer& per_batch_in = from_amax ? b.amax_in : b.scale;
  const char* per_batch_name = from_amax ? "amax" : "scale";
  q.batches = static_cast<int64_t>(per_batch_in.element_count());
  if (q.batches < 1 || (m % q.batches) != 0) {
    return invalid(op, std::string(per_batch_name) + " must have one element per batch (a " +
                           "divisor of the " + std::to_string(m) + " rows), got shape " +
                           dims_str(per_batch_in.dimensions()));
  }
  const int64_t rows_per_batch = m / q.batches;

  // Data codes: fp8 dtype for the tensor modes and MXFP8; NVFP4 float4_e2m1fn, which XLA stores
  // two per byte, first element in the low nibble: the kernels' packing (element_count() counts
  // codes; ByteWidth() says 1, which is not the buffer's size).
  std::optional<QType> qtype;
  for (const ffi::AnyBuffer* d : {&b.out, &b.colwise_out}) {
    if (d->element_count() == 0) continue;
    std::optional<QType> t;
    if (nvfp4 && d->element_type() == DT::F4E2M1FN) t = QType::E2M1;
    if (!nvfp4 && d->element_type() == DT::F8E4M3FN) t = QType::E4M3;
    if (!nvfp4 && d->element_type() == DT::F8E5M2) t = QType::E5M2;
    if (!t || (qtype && *qtype != *t)) {
      return invalid(op, std::string(scaling_mode_name(mode)) +
                             (nvfp4 ? " data must be float4_e2m1fn"
                                    : " data must be float8_e4m3fn or float8_e5m2 (both alike)"));
    }
    qtype = t;
  }
  q.qtype = qtype.value_or(nvfp4 ? QType::E2M1 : QType::E4M3);
  if (b.out.element_count() != (row ? elems : 0)) {
    return invalid(op, count_error("output", row ? elems : 0, b.out));
  }
  if (b.colwise_out.element_count() != (col ? elems : 0)) {
    return invalid(op, count_error("colwise_output", col ? elems : 0, b.colwise_out));
  }

  if (tensor) {
    if (b.scale_inv.element_type() != DT::F32 ||
        b.scale_inv.element_count() != static_cast<size_t>(q.batches)) {
      return invalid(op, "scale_inv must be float32 with one element per batch (" +
                             std::to_string(q.batches) + ")");
    }
    if (b.colwise_scale_inv.element_count() != 0) {
      return invalid(op, "tensor scaling shares scale_inv: colwise_scale_inv must be empty");
    }
    q.scale_inv = b.scale_inv.typed_data<float>();
  } else {
    const int64_t bs = mxfp8 ? 32 : 16;
    if (nvfp4 && unit % 2 != 0) {
      return invalid(op, "NVFP4 packs two E2M1 codes per byte along the last axis: it needs an "
                         "even last axis, got " + std::to_string(unit));
    }
    if (row && unit % bs != 0) {
      return invalid(op, std::string(scaling_mode_name(mode)) + " rowwise needs the last axis (" +
                             std::to_string(unit) + ") divisible by " + std::to_string(bs));
    }
    if (col && rows_per_batch % bs != 0) {
      return invalid(op, std::string(scaling_mode_name(mode)) + " colwise needs the rows (" +
                             std::to_string(rows_per_batch) + " per batch) divisible by " +
                             std::to_string(bs));
    }
    const auto scale_type_ok = [&](ffi::DataType t) {
      return mxfp8 ? (t == DT::U8 || t == DT::F8E8M0FNU) : (t == DT::U8 || t == DT::F8E4M3FN);
    };
    const auto scale_ok = [&](ffi::AnyBuffer s, size_t want) {
      return s.element_count() == want && (want == 0 || scale_type_ok(s.element_type()));
    };
    const size_t row_scales = row ? elems / bs : 0, col_scales = col ? elems / bs : 0;
    const char* scale_dtype = mxfp8 ? "float8_e8m0fnu" : "float8_e4m3fn";
    if (!scale_ok(b.scale_inv, row_scales)) {
      return invalid(op, count_error((std::string("scale_inv (") + scale_dtype + ")").c_str(),
                                     row_scales, b.scale_inv));
    }
    if (!scale_ok(b.colwise_scale_inv, col_scales)) {
      return invalid(op,
                     count_error((std::string("colwise_scale_inv (") + scale_dtype + ")").c_str(),
                                 col_scales, b.colwise_scale_inv));
    }
    if (row) q.block_scale = static_cast<uint8_t*>(b.scale_inv.untyped_data());
    if (col) q.colwise_block_scale = static_cast<uint8_t*>(b.colwise_scale_inv.untyped_data());
  }

  // Per-batch float32 outputs: DELAYED's amax (CURRENT's and NVFP4's come from their amax pass),
  // NVFP4's 1 / S.
  const bool delayed = mode == ScalingMode::DELAYED_TENSOR_SCALING;
  const auto per_batch_ok = [&](const char* name, ffi::AnyBuffer buf, bool produced) {
    const size_t want = produced ? static_cast<size_t>(q.batches) : 0;
    if (buf.element_count() == want) return ffi::Error::Success();
    return invalid(op, std::string(name) + " must have " + std::to_string(want) +
                           " element(s) for " + scaling_mode_name(mode) + ", got shape " +
                           dims_str(buf.dimensions()));
  };
  if (auto e = per_batch_ok("amax", b.amax_out, delayed); e.failure()) return e;
  if (auto e = per_batch_ok("global_scale_inv", b.global_scale_inv, nvfp4); e.failure()) return e;
  if (mode != ScalingMode::MXFP8_1D_SCALING) q.scale = per_batch_in.typed_data<float>();
  if (delayed) q.amax = b.amax_out.typed_data<float>();
  if (nvfp4) q.scale_inv = b.global_scale_inv.typed_data<float>();
  if (mode == ScalingMode::CURRENT_TENSOR_SCALING) {
    q.scale_numerator = q.qtype == QType::E5M2 ? fmt::E5M2::kMax : fmt::E4M3::kMax;
  }
  if (nvfp4) q.scale_numerator = fmt::kNvfp4GlobalQ;
  if (row) q.data = static_cast<uint8_t*>(b.out.untyped_data());
  if (col) q.colwise = static_cast<uint8_t*>(b.colwise_out.untyped_data());
  y = nullptr;
  amax = nullptr;
  quantized = true;
  return ffi::Error::Success();
}

// The amax buffer of an amax pass: float32, one element per batch.
inline ffi::Error decode_amax_output(const char* op, int64_t m, ffi::AnyBuffer out,
                                     QuantOutput& q) {
  q = QuantOutput{};
  q.batches = static_cast<int64_t>(out.element_count());
  if (out.element_type() != ffi::DataType::F32 || q.batches < 1 || m % q.batches != 0) {
    return invalid(op, "amax must be float32 with one element per batch (a divisor of the " +
                           std::to_string(m) + " rows), got shape " + dims_str(out.dimensions()));
  }
  q.amax = out.typed_data<float>();
  return ffi::Error::Success();
}

inline ffi::Error activation_len(const char* op, ActivationEnum act, int& act_len) {
  if (!with_activation(act, [&](auto spec) { act_len = decltype(spec)::kActLen; })) {
    return invalid(op, "unknown act_enum " + std::to_string(static_cast<int64_t>(act)));
  }
  return ffi::Error::Success();
}

// x (and its activation) of act_lu and the amax pass.
inline ffi::Error decode_act_input(const char* op, ActLuProblem& p, ffi::AnyBuffer x,
                                   ActivationEnum act, const ActParams& params, int& act_len) {
  if (auto e = activation_len(op, act, act_len); e.failure()) return e;
  auto dtype = kernel_dtype(x.element_type());
  if (!dtype) {
    return invalid(op, std::string("x must be float32, bfloat16 or float16, got ") +
                           dtype_name(x.element_type()));
  }
  p = ActLuProblem{*dtype, act, params, 0, 0, x.untyped_data(), nullptr, nullptr};
  return split_rows(op, x.dimensions(), act_len, p.rows, p.hidden);
}

// dz, x, dbias and workspace of dact_dbias and its amax pass.
inline ffi::Error decode_dact_input(const char* op, DActProblem& p, ffi::AnyBuffer dz,
                                    ffi::AnyBuffer x, ffi::AnyBuffer* dbias,
                                    ffi::AnyBuffer* workspace, ActivationEnum act, bool is_dbias,
                                    const ActParams& params) {
  int act_len = 0;
  if (auto e = activation_len(op, act, act_len); e.failure()) return e;
  auto dtype = kernel_dtype(x.element_type());
  if (!dtype) {
    return invalid(op, std::string("x must be float32, bfloat16 or float16, got ") +
                           dtype_name(x.element_type()));
  }
  if (act == ActivationEnum::IDENTITY) {
    return invalid(op, "act_enum IDENTITY is for te_jax_quantize / te_jax_act_amax only");
  }
  if (dz.element_type() != x.element_type()) {
    return invalid(op, std::string("dz must have x's dtype ") + dtype_name(x.element_type()) +
                           ", got " + dtype_name(dz.element_type()));
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

inline ffi::Error decode_act_lu(
    ActLuProblem& p, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer amax, ffi::AnyBuffer* out,
    ffi::AnyBuffer* colwise_out, ffi::AnyBuffer* scale_inv, ffi::AnyBuffer* colwise_scale_inv,
    ffi::AnyBuffer* amax_out, ffi::AnyBuffer* global_scale_inv, ActivationEnum act, ScalingMode mode, QuantizeLayout layout,
    const ActParams& params, bool output_amax, const char* op = "te_jax_act_lu") {
  using namespace detail;
  int act_len = 0;
  if (auto e = decode_act_input(op, p, x, act, params, act_len); e.failure()) return e;
  if (amax.element_type() != ffi::DataType::F32) return invalid(op, "amax must be float32");
  const OutputBuffers b{scale, amax, *out, *colwise_out, *scale_inv, *colwise_scale_inv,
                        *amax_out, *global_scale_inv};
  return decode_output(op, mode, layout, x.element_type(), p.rows, p.hidden, p.hidden, b,
                       output_amax, p.y, p.amax, p.quantized, p.q);
}

inline ffi::Error decode_dact_dbias(
    DActProblem& p, ffi::AnyBuffer dz, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer amax,
    ffi::AnyBuffer* out, ffi::AnyBuffer* colwise_out, ffi::AnyBuffer* scale_inv,
    ffi::AnyBuffer* colwise_scale_inv, ffi::AnyBuffer* amax_out, ffi::AnyBuffer* global_scale_inv, ffi::AnyBuffer* dbias,
    ffi::AnyBuffer* workspace, ScalingMode mode, ActivationEnum act, QuantizeLayout layout,
    bool is_dbias, const ActParams& params, bool output_amax) {
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
  if (auto e = decode_output(op, mode, layout, x.element_type(), p.rows, p.act_len * p.hidden,
                             p.hidden, b, output_amax, p.dx, p.amax, p.quantized, p.q);
      e.failure()) {
    return e;
  }
  return check_dbias_batches(op, p);
}

// te_jax_quantize: act_lu of the identity on x viewed as [rows, N] (Python passes 2-D x).
inline ffi::Error decode_quantize(
    ActLuProblem& p, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer amax, ffi::AnyBuffer* out,
    ffi::AnyBuffer* colwise_out, ffi::AnyBuffer* scale_inv, ffi::AnyBuffer* colwise_scale_inv,
    ffi::AnyBuffer* amax_out, ffi::AnyBuffer* global_scale_inv, ScalingMode mode, QuantizeLayout layout, bool output_amax) {
  return decode_act_lu(p, x, scale, amax, out, colwise_out, scale_inv, colwise_scale_inv,
                       amax_out, global_scale_inv, ActivationEnum::IDENTITY, mode, layout, ActParams{},
                       output_amax, "te_jax_quantize");
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
