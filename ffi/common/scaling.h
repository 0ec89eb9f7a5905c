// Scaling modes and quantize layouts of the te_jax FFI targets, and the one description of each
// scaling mode (kScalingModes) that decoding reads instead of testing modes one by one.
// Host-only tables (the enums are also used by device code). Python passes the enums as np.int64.
#pragma once

#include <cstdint>
#include <iterator>

#include "common/formats.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

// Values 0-4 follow TE's JAXX_Scaling_Mode; the blockwise FP8 modes are te_jax's own.
enum class ScalingMode : int64_t {
  NO_SCALING = 0,
  DELAYED_TENSOR_SCALING = 1,
  MXFP8_1D_SCALING = 2,
  CURRENT_TENSOR_SCALING = 3,
  NVFP4_1D_SCALING = 4,
  FP8_BLOCK_1D_SCALING = 5,
  FP8_BLOCK_2D_SCALING = 6,
};

enum class QuantizeLayout : int64_t {
  ROWWISE = 0,
  COLWISE = 1,
  ROWWISE_COLWISE = 2,
};

// Quantized data formats (the values index kQTypes).
enum class QType { E4M3, E5M2, E2M1 };

struct QTypeInfo {
  ::xla::ffi::DataType dtype;  // the data buffers' XLA dtype
  const char* name;            // its numpy name
  float max;                   // largest finite value: CURRENT's scale numerator
  bool packed;                 // two codes per byte along the last axis
};

inline constexpr QTypeInfo kQTypes[] = {
    {::xla::ffi::DataType::F8E4M3FN, "float8_e4m3fn", fmt::E4M3::kMax, false},
    {::xla::ffi::DataType::F8E5M2, "float8_e5m2", fmt::E5M2::kMax, false},
    {::xla::ffi::DataType::F4E2M1FN, "float4_e2m1fn", fmt::E2M1::kMax, true},
};

constexpr const QTypeInfo& qtype_info(QType t) { return kQTypes[static_cast<int>(t)]; }

// What the generic path writes: the amax pass (first pass of CURRENT and NVFP4) only max|y|; the
// scaled modes their codes and scales. DELAYED and CURRENT emit alike (TENSOR): they differ only in
// where the scale comes from (QuantOutput::tensor_scale).
enum class QuantEmit { AMAX_PASS, TENSOR, MXFP8, NVFP4, FP8_BLOCK };

inline const char* quant_emit_name(QuantEmit e) {
  switch (e) {
    case QuantEmit::AMAX_PASS: return "AMAX_PASS";
    case QuantEmit::TENSOR: return "TENSOR";
    case QuantEmit::MXFP8: return "MXFP8";
    case QuantEmit::NVFP4: return "NVFP4";
    case QuantEmit::FP8_BLOCK: return "FP8_BLOCK";
  }
  return "?";
}

// The per-batch float32 input a mode reads: DELAYED its quantizer's scale, CURRENT and NVFP4 the
// amax of their first pass (the scale derives from it).
enum class BatchInput { NONE, SCALE, AMAX };

// The numerator of a scale derived from an amax (scale = numerator / amax, fmt::scale_from_amax).
enum class ScaleNumerator {
  NONE,          // the scale is given (DELAYED) or there is none
  FORMAT_MAX,    // CURRENT: the data format's largest value
  NVFP4_GLOBAL,  // NVFP4: 6 * 448 (fmt::kNvfp4GlobalQ)
};

// Everything decoding needs to know about one scaling mode (docs/numerics.md §4-§5).
struct ScalingModeInfo {
  ScalingMode mode;
  const char* name;
  bool quantized;                   // false: NO_SCALING, the elementwise path (the rest unused)
  QuantEmit emit;
  int64_t block;                    // elements per block scale; 0: one scale per tensor
  QType data_types[2];              // accepted data formats, the first the default
  int num_data_types;
  ::xla::ffi::DataType block_scale_dtype;  // block scales: this dtype (or uint8)
  const char* block_scale_name;
  BatchInput reads;                 // per-batch input read (MXFP8 counts batches from `scale`)
  bool writes_amax;                 // DELAYED: max|y| per batch (the others get theirs from the
                                    // amax pass)
  bool writes_global_scale_inv;     // NVFP4: 1 / S per batch
  ScaleNumerator numerator;
};

// Indexed by ScalingMode.
inline constexpr ScalingModeInfo kScalingModes[] = {
    {ScalingMode::NO_SCALING, "NO_SCALING", false, QuantEmit::AMAX_PASS, 0,
     {QType::E4M3, QType::E4M3}, 0, ::xla::ffi::DataType::INVALID, "", BatchInput::NONE, false,
     false, ScaleNumerator::NONE},
    {ScalingMode::DELAYED_TENSOR_SCALING, "DELAYED_TENSOR_SCALING", true, QuantEmit::TENSOR, 0,
     {QType::E4M3, QType::E5M2}, 2, ::xla::ffi::DataType::INVALID, "", BatchInput::SCALE, true,
     false, ScaleNumerator::NONE},
    {ScalingMode::MXFP8_1D_SCALING, "MXFP8_1D_SCALING", true, QuantEmit::MXFP8, 32,
     {QType::E4M3, QType::E5M2}, 2, ::xla::ffi::DataType::F8E8M0FNU, "float8_e8m0fnu",
     BatchInput::NONE, false, false, ScaleNumerator::NONE},
    {ScalingMode::CURRENT_TENSOR_SCALING, "CURRENT_TENSOR_SCALING", true, QuantEmit::TENSOR, 0,
     {QType::E4M3, QType::E5M2}, 2, ::xla::ffi::DataType::INVALID, "", BatchInput::AMAX, false,
     false, ScaleNumerator::FORMAT_MAX},
    {ScalingMode::NVFP4_1D_SCALING, "NVFP4_1D_SCALING", true, QuantEmit::NVFP4, 16,
     {QType::E2M1, QType::E2M1}, 1, ::xla::ffi::DataType::F8E4M3FN, "float8_e4m3fn",
     BatchInput::AMAX, false, true, ScaleNumerator::NVFP4_GLOBAL},
    // Blockwise FP8: float32 scales in cuBLASLt's layouts, any shape (partial blocks at the
    // edges); the count of batches comes from `scale` (ones), as MXFP8's.
    {ScalingMode::FP8_BLOCK_1D_SCALING, "FP8_BLOCK_1D_SCALING", true, QuantEmit::FP8_BLOCK, 128,
     {QType::E4M3, QType::E5M2}, 2, ::xla::ffi::DataType::F32, "float32", BatchInput::NONE, false,
     false, ScaleNumerator::NONE},
    {ScalingMode::FP8_BLOCK_2D_SCALING, "FP8_BLOCK_2D_SCALING", true, QuantEmit::FP8_BLOCK, 128,
     {QType::E4M3, QType::E5M2}, 2, ::xla::ffi::DataType::F32, "float32", BatchInput::NONE, false,
     false, ScaleNumerator::NONE},
};

// The description of m, or nullptr for a value outside the enum.
constexpr const ScalingModeInfo* scaling_mode_info(ScalingMode m) {
  const auto i = static_cast<int64_t>(m);
  return i >= 0 && i < static_cast<int64_t>(std::size(kScalingModes)) ? &kScalingModes[i] : nullptr;
}

inline const char* scaling_mode_name(ScalingMode m) {
  const ScalingModeInfo* info = scaling_mode_info(m);
  return info != nullptr ? info->name : "<unknown scaling mode>";
}

// The emit of a scaled mode (NO_SCALING has none: it takes the elementwise path).
constexpr QuantEmit quant_emit(ScalingMode m) { return scaling_mode_info(m)->emit; }

// The numerator of the tensor scale of `info` with data format t (0: the scale is given).
constexpr float scale_numerator(const ScalingModeInfo& info, QType t) {
  return info.numerator == ScaleNumerator::FORMAT_MAX     ? qtype_info(t).max
         : info.numerator == ScaleNumerator::NVFP4_GLOBAL ? fmt::kNvfp4GlobalQ
                                                          : 0.0f;
}

constexpr bool scaling_modes_well_formed() {
  for (size_t i = 0; i < std::size(kScalingModes); ++i) {
    const ScalingModeInfo& m = kScalingModes[i];
    if (static_cast<size_t>(m.mode) != i || m.quantized != (m.mode != ScalingMode::NO_SCALING)) {
      return false;
    }
  }
  return true;
}
static_assert(scaling_modes_well_formed(),
              "kScalingModes is indexed by ScalingMode; NO_SCALING alone is unquantized");

}  // namespace te_jax

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(te_jax::ScalingMode);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(te_jax::QuantizeLayout);
