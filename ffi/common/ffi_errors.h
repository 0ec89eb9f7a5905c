// The error messages of the te_jax FFI targets: each names the op, what was expected and what was
// received (shapes as Python prints them, dtypes by their numpy names). Host-only.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace te_jax {

namespace ffi = ::xla::ffi;

// "op: what", as ffi::Error::InvalidArgument.
inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// A shape as Python prints it: "(2, 3)", "(5,)", "()".
inline std::string dims_str(ffi::Span<const int64_t> d) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < d.size(); ++i) s << (i ? ", " : "") << d[i];
  s << (d.size() == 1 ? ",)" : ")");
  return s.str();
}

// The numpy name of an input dtype ("an unsupported dtype" for the rest).
inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F64: return "float64";
    default: return "an unsupported dtype";
  }
}

inline std::string count_error(const char* what, size_t want, ffi::AnyBuffer b) {
  return std::string(what) + " must have " + std::to_string(want) + " elements, got shape " +
         dims_str(b.dimensions());
}

inline bool same_dims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

}  // namespace te_jax
