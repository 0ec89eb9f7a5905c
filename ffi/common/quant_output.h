// The quantized output of an op (the six results output, colwise_output, scale_inv,
// colwise_scale_inv, amax, global_scale_inv) and its decoding, for any op family whose output y is
// a 2-D [M, N] tensor (docs/numerics.md §4-§5).
//
// y is split into `batches` independent tensors of M / batches consecutive rows (one per vmapped
// batch element; 1 otherwise), each with its own tensor scale and amax:
//   DELAYED / CURRENT  data fp8 [M, N]; colwise fp8 [batches, N, M / batches] (each batch's
//                      transpose); scale_inv f32[batches] = 1/scale
//   MXFP8              data and colwise fp8 [M, N]; block scales E8M0 [M, N/32] / [M/32, N]
//   NVFP4              data and colwise float4_e2m1fn [M, N], which XLA packs two per byte, first
//                      element in the low nibble; block scales E4M3 [M, N/16] / [M/16, N]; the
//                      global scale S; its inverse 1/S is the global_scale_inv output
//                      (f32[batches])
//   FP8_BLOCK_1D / 2D  per batch (Mb = M / batches rows): data fp8 [Mb, N]; colwise fp8 [N, Mb]
//                      (the transpose); float32 scale_inv of each copy [R, C] (data: [Mb, N],
//                      colwise: [N, Mb]) in cuBLASLt's layouts, zero-padded: 1D (1x128 blocks
//                      along C) [ceil(C/128), round_up(R, 4)], 2D (128x128) [ceil(R/128),
//                      round_up(ceil(C/128), 4)]; any M and N (the last blocks are partial)
// Inputs scale and amax, f32[batches]: DELAYED reads `scale`; CURRENT and NVFP4 read `amax`, the
// (global) amax of their first pass, and derive the scale (fmt::scale_from_amax: Q / amax, resp.
// 6 * 448 / amax), so no scale arithmetic is left to the caller. Every 1/scale is fmt::div_rn
// (correctly rounded, subnormal results included, under any denormal mode). Outputs a mode does
// not produce are empty (shape (0,)); the per-mode facts are kScalingModes (scaling.h).
// Host decoding (the QuantOutput struct is also read by device code).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>

#include "common/ffi_errors.h"
#include "common/formats.h"
#include "common/scaling.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

// Where and how an op emits y on its generic (quantizing or amax-only) path.
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
  // FP8_BLOCK: float32 scale_inv of the two copies, the block shape and the recipe's options.
  float* block_scale_f32 = nullptr;
  float* colwise_block_scale_f32 = nullptr;
  bool block_2d = false;        // 128x128 tiles (else 1x128 blocks)
  bool power_2_scale = false;   // scales rounded down to powers of two
  uint32_t amax_epsilon_bits = 0;  // the floor on each block's amax, as float32 bits
  bool rowwise() const { return data != nullptr; }
  bool colwise_out() const { return colwise != nullptr; }
  // The tensor scale of batch b (DELAYED, CURRENT, NVFP4).
  float tensor_scale(int64_t b) const {
    return scale_numerator > 0.0f ? fmt::scale_from_amax(scale[b], scale_numerator) : scale[b];
  }
};

// The per-batch inputs and the six quantized results of a call.
struct OutputBuffers {
  ffi::AnyBuffer scale, amax_in, out, colwise_out, scale_inv, colwise_scale_inv, amax_out,
      global_scale_inv;
};

// Blockwise FP8's recipe options (the FFI attributes power_2_scale and amax_epsilon, which the
// other modes ignore).
struct BlockOptions {
  bool power_2_scale = false;
  float amax_epsilon = 0.0f;
};

// The float32 scales of a blockwise FP8 copy [r, c] (quant_output.h's top): their count.
inline int64_t fp8_block_scale_count(bool block_2d, int64_t r, int64_t c) {
  const auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const auto rup = [&](int64_t a, int64_t b) { return cdiv(a, b) * b; };
  return block_2d ? cdiv(r, 128) * rup(cdiv(c, 128), 4) : cdiv(c, 128) * rup(r, 4);
}

namespace detail {

// "float8_e4m3fn or float8_e5m2 (both alike)": the data formats `info` accepts.
inline std::string data_types_str(const ScalingModeInfo& info) {
  std::string s = qtype_info(info.data_types[0]).name;
  for (int i = 1; i < info.num_data_types; ++i) {
    s += std::string(" or ") + qtype_info(info.data_types[i]).name;
  }
  return info.num_data_types == 2 ? s + " (both alike)" : s;
}

// The data format of the non-empty data buffers, which must agree (nullopt: none is written).
inline ffi::Error decode_data_type(const char* op, const ScalingModeInfo& info,
                                   const OutputBuffers& b, std::optional<QType>& qtype) {
  for (const ffi::AnyBuffer* d : {&b.out, &b.colwise_out}) {
    if (d->element_count() == 0) continue;
    std::optional<QType> t;
    for (int i = 0; i < info.num_data_types; ++i) {
      if (d->element_type() == qtype_info(info.data_types[i]).dtype) t = info.data_types[i];
    }
    if (!t || (qtype && *qtype != *t)) {
      return invalid(op, std::string(info.name) + " data must be " + data_types_str(info));
    }
    qtype = t;
  }
  return ffi::Error::Success();
}

// The block scales of a block-scaled mode: `bs` elements per scale, along the rows (rowwise) and
// down the columns (colwise).
inline ffi::Error decode_block_scales(const char* op, const ScalingModeInfo& info,
                                      const OutputBuffers& b, size_t elems, int64_t unit,
                                      int64_t rows_per_batch, bool row, bool col, QuantOutput& q) {
  using DT = ffi::DataType;
  const int64_t bs = info.block;
  if (qtype_info(q.qtype).packed && unit % 2 != 0) {
    return invalid(op, "NVFP4 packs two E2M1 codes per byte along the last axis: it needs an "
                       "even last axis, got " + std::to_string(unit));
  }
  if (row && unit % bs != 0) {
    return invalid(op, std::string(info.name) + " rowwise needs the last axis (" +
                           std::to_string(unit) + ") divisible by " + std::to_string(bs));
  }
  if (col && rows_per_batch % bs != 0) {
    return invalid(op, std::string(info.name) + " colwise needs the rows (" +
                           std::to_string(rows_per_batch) + " per batch) divisible by " +
                           std::to_string(bs));
  }
  const auto scale_ok = [&](ffi::AnyBuffer s, size_t want) {
    const DT t = s.element_type();
    return s.element_count() == want && (want == 0 || t == DT::U8 || t == info.block_scale_dtype);
  };
  const size_t row_scales = row ? elems / bs : 0, col_scales = col ? elems / bs : 0;
  const auto scale_error = [&](const char* name, size_t want, ffi::AnyBuffer s) {
    const std::string what = std::string(name) + " (" + info.block_scale_name + ")";
    return invalid(op, count_error(what.c_str(), want, s));
  };
  if (!scale_ok(b.scale_inv, row_scales)) return scale_error("scale_inv", row_scales, b.scale_inv);
  if (!scale_ok(b.colwise_scale_inv, col_scales)) {
    return scale_error("colwise_scale_inv", col_scales, b.colwise_scale_inv);
  }
  if (row) q.block_scale = static_cast<uint8_t*>(b.scale_inv.untyped_data());
  if (col) q.colwise_block_scale = static_cast<uint8_t*>(b.colwise_scale_inv.untyped_data());
  return ffi::Error::Success();
}

// Blockwise FP8's float32 scales of each copy (counts per fp8_block_scale_count, per batch), and
// its options.
inline ffi::Error decode_fp8_block_scales(const char* op, ScalingMode mode, const OutputBuffers& b,
                                          int64_t m, int64_t n, int64_t batches, bool row,
                                          bool col, const BlockOptions& options, QuantOutput& q) {
  q.block_2d = mode == ScalingMode::FP8_BLOCK_2D_SCALING;
  const int64_t mb = m / batches;
  const size_t want_row = row ? batches * fp8_block_scale_count(q.block_2d, mb, n) : 0;
  const size_t want_col = col ? batches * fp8_block_scale_count(q.block_2d, n, mb) : 0;
  const auto ok = [](ffi::AnyBuffer s, size_t want) {
    return s.element_count() == want && (want == 0 || s.element_type() == ffi::DataType::F32);
  };
  if (!ok(b.scale_inv, want_row)) {
    return invalid(op, count_error("scale_inv (float32)", want_row, b.scale_inv));
  }
  if (!ok(b.colwise_scale_inv, want_col)) {
    return invalid(op, count_error("colwise_scale_inv (float32)", want_col, b.colwise_scale_inv));
  }
  if (!(options.amax_epsilon >= 0.0f) || options.amax_epsilon == INFINITY) {
    return invalid(op, "amax_epsilon must be a finite float >= 0");
  }
  if (row) q.block_scale_f32 = b.scale_inv.typed_data<float>();
  if (col) q.colwise_block_scale_f32 = b.colwise_scale_inv.typed_data<float>();
  q.power_2_scale = options.power_2_scale;
  uint32_t eps_bits;
  std::memcpy(&eps_bits, &options.amax_epsilon, sizeof(eps_bits));
  q.amax_epsilon_bits = eps_bits;
  return ffi::Error::Success();
}

}  // namespace detail

// The outputs of an op whose output y is [m, n], made of rows of `unit`-column pieces that a
// scaling block must not straddle (gated dact: the two halves, unit = H; otherwise unit = n).
// NO_SCALING fills y / amax (the elementwise path); the scaled modes fill q and set quantized.
inline ffi::Error decode_quant_output(const char* op, ScalingMode mode, QuantizeLayout layout,
                                      ffi::DataType x_type, int64_t m, int64_t n, int64_t unit,
                                      const OutputBuffers& b, const BlockOptions& options,
                                      bool output_amax, void*& y, float*& amax, bool& quantized,
                                      QuantOutput& q) {
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

  const ScalingModeInfo* info = scaling_mode_info(mode);
  if (info == nullptr) {
    return invalid(op, "unknown scaling_mode " + std::to_string(static_cast<int64_t>(mode)));
  }
  const bool row = layout != QuantizeLayout::COLWISE;
  const bool col = layout != QuantizeLayout::ROWWISE;
  q = QuantOutput{};
  q.emit = info->emit;
  // One tensor per element of the per-batch input the mode reads (MXFP8, which reads none,
  // counts the scale's).
  const bool from_amax = info->reads == BatchInput::AMAX;
  const ffi::AnyBuffer& per_batch_in = from_amax ? b.amax_in : b.scale;
  const char* per_batch_name = from_amax ? "amax" : "scale";
  q.batches = static_cast<int64_t>(per_batch_in.element_count());
  if (q.batches < 1 || (m % q.batches) != 0) {
    return invalid(op, std::string(per_batch_name) + " must have one element per batch (a " +
                           "divisor of the " + std::to_string(m) + " rows), got shape " +
                           dims_str(per_batch_in.dimensions()));
  }
  const int64_t rows_per_batch = m / q.batches;

  // Data codes. XLA stores float4_e2m1fn two per byte, first element in the low nibble: the
  // kernels' packing (element_count() counts codes; ByteWidth() says 1, not the buffer's size).
  std::optional<QType> qtype;
  if (auto e = detail::decode_data_type(op, *info, b, qtype); e.failure()) return e;
  q.qtype = qtype.value_or(info->data_types[0]);
  if (b.out.element_count() != (row ? elems : 0)) {
    return invalid(op, count_error("output", row ? elems : 0, b.out));
  }
  if (b.colwise_out.element_count() != (col ? elems : 0)) {
    return invalid(op, count_error("colwise_output", col ? elems : 0, b.colwise_out));
  }

  if (info->block == 0) {
    if (b.scale_inv.element_type() != DT::F32 ||
        b.scale_inv.element_count() != static_cast<size_t>(q.batches)) {
      return invalid(op, "scale_inv must be float32 with one element per batch (" +
                             std::to_string(q.batches) + ")");
    }
    if (b.colwise_scale_inv.element_count() != 0) {
      return invalid(op, "tensor scaling shares scale_inv: colwise_scale_inv must be empty");
    }
    q.scale_inv = b.scale_inv.typed_data<float>();
  } else if (info->emit == QuantEmit::FP8_BLOCK) {
    if (auto e = detail::decode_fp8_block_scales(op, info->mode, b, m, n, q.batches, row, col,
                                                 options, q);
        e.failure()) {
      return e;
    }
  } else if (auto e = detail::decode_block_scales(op, *info, b, elems, unit, rows_per_batch, row,
                                                  col, q);
             e.failure()) {
    return e;
  }

  const auto per_batch_ok = [&](const char* name, ffi::AnyBuffer buf, bool produced) {
    const size_t want = produced ? static_cast<size_t>(q.batches) : 0;
    if (buf.element_count() == want) return ffi::Error::Success();
    return invalid(op, std::string(name) + " must have " + std::to_string(want) +
                           " element(s) for " + info->name + ", got shape " +
                           dims_str(buf.dimensions()));
  };
  if (auto e = per_batch_ok("amax", b.amax_out, info->writes_amax); e.failure()) return e;
  if (auto e = per_batch_ok("global_scale_inv", b.global_scale_inv, info->writes_global_scale_inv);
      e.failure()) {
    return e;
  }
  if (info->reads != BatchInput::NONE) q.scale = per_batch_in.typed_data<float>();
  if (info->writes_amax) q.amax = b.amax_out.typed_data<float>();
  if (info->writes_global_scale_inv) q.scale_inv = b.global_scale_inv.typed_data<float>();
  q.scale_numerator = scale_numerator(*info, q.qtype);
  if (row) q.data = static_cast<uint8_t*>(b.out.untyped_data());
  if (col) q.colwise = static_cast<uint8_t*>(b.colwise_out.untyped_data());
  y = nullptr;
  amax = nullptr;
  quantized = true;
  return ffi::Error::Success();
}

// The amax buffer of an amax pass (the first pass of CURRENT and NVFP4): float32, one element per
// batch; nothing else is written.
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

}  // namespace te_jax
