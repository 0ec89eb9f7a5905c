// Enums and struct attributes of the te_jax FFI targets, and their XLA FFI attribute decoding.
// Host-only (includes the XLA FFI API). Python passes every attribute as an exact numpy scalar:
// the enums as np.int64, booleans as np.bool_, act_params as
// {"clamped_swiglu": {"limit": np.float32, "alpha": np.float32, "glu_linear_offset": np.float32}}.
#pragma once

#include <cstdint>

#include "activation/activations.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

// Values follow TE's JAXX_Scaling_Mode.
enum class ScalingMode : int64_t {
  NO_SCALING = 0,
  DELAYED_TENSOR_SCALING = 1,
  MXFP8_1D_SCALING = 2,
  CURRENT_TENSOR_SCALING = 3,
  NVFP4_1D_SCALING = 4,
};

enum class QuantizeLayout : int64_t {
  ROWWISE = 0,
  COLWISE = 1,
  ROWWISE_COLWISE = 2,
};

inline const char* scaling_mode_name(ScalingMode m) {
  switch (m) {
    case ScalingMode::NO_SCALING: return "NO_SCALING";
    case ScalingMode::DELAYED_TENSOR_SCALING: return "DELAYED_TENSOR_SCALING";
    case ScalingMode::MXFP8_1D_SCALING: return "MXFP8_1D_SCALING";
    case ScalingMode::CURRENT_TENSOR_SCALING: return "CURRENT_TENSOR_SCALING";
    case ScalingMode::NVFP4_1D_SCALING: return "NVFP4_1D_SCALING";
  }
  return "<unknown scaling mode>";
}

}  // namespace te_jax

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(te_jax::ActivationEnum);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(te_jax::ScalingMode);
XLA_FFI_REGISTER_ENUM_ATTR_DECODING(te_jax::QuantizeLayout);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(te_jax::ClampedSwigluParams, StructMember<float>("limit"),
                                      StructMember<float>("alpha"),
                                      StructMember<float>("glu_linear_offset"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(te_jax::ActParams,
                                      StructMember<te_jax::ClampedSwigluParams>("clamped_swiglu"));
