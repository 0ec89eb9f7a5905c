// Host-side exp and erf. PLACEHOLDER until the vectorisable versions land: libm calls.
#pragma once

#include <cmath>

namespace te_jax::math::host {
inline float exp(float x) { return std::exp(x); }
inline float erf(float x) { return std::erf(x); }
}  // namespace te_jax::math::host
