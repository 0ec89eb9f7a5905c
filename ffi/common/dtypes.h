// The input dtypes the kernels take, and their XLA FFI data types.
#pragma once

#include <optional>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

enum class DType { F32, F16, BF16 };

// The kernels' DType of an FFI buffer's element type (nullopt: not one the kernels take).
inline std::optional<DType> kernel_dtype(::xla::ffi::DataType t) {
  switch (t) {
    case ::xla::ffi::DataType::F32: return DType::F32;
    case ::xla::ffi::DataType::F16: return DType::F16;
    case ::xla::ffi::DataType::BF16: return DType::BF16;
    default: return std::nullopt;
  }
}

}  // namespace te_jax
