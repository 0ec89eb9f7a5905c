// Every activation of docs/numerics.md §1 and its derivative, defined once, for host and device.
//
// An activation is a struct with one static function
//
//     TE_HD static void eval(float x, const ActParams& p, float& f, float& df);
//
// that writes f(x) and f'(x). Callers that need only one of them let the compiler drop the other
// (everything is inlined), so forward kernels pay nothing for the derivative.
//
// A gated activation pairs an activation with a "linear half" (Identity, or ClampedLinear for
// GPT-OSS clamped SwiGLU): for x = (a, b) with upstream gradient g,
//     y  = f(a) * b'              b' = lin(b)
//     dA = f'(a) * g * b'         dB = lin'(b) * g * f(a)
// `with_activation(enum, fn)` maps a runtime enum to these compile-time types.
//
// All arithmetic is float32 (docs/numerics.md: one rounding, to the output dtype, at the end).
#pragma once

#include <cstdint>
#include <utility>

#include "common/macros.h"
#include "common/math.h"

namespace te_jax {

// Every activation, declared once: X(NAME, act_enum value, activation half, linear half, gated).
// The enum, with_activation's switch, activation_name and kActivations derive from it. Values are
// TE's NVTE_Activation_Type order (0-11) plus te_jax's exact-GELU forms (12-13); Python passes
// them, so they never change. IDENTITY (y = x) is internal: the standalone quantize targets run
// the activation kernels with it.
#define TE_JAX_ACTIVATIONS(X)                             \
  X(GELU, 0, Gelu, Identity, false)                       \
  X(GEGLU, 1, Gelu, Identity, true)                       \
  X(GLU, 2, Sigmoid, Identity, true)                      \
  X(SILU, 3, Silu, Identity, false)                       \
  X(SWIGLU, 4, Silu, Identity, true)                      \
  X(RELU, 5, Relu, Identity, false)                       \
  X(REGLU, 6, Relu, Identity, true)                       \
  X(QGELU, 7, QuickGelu, Identity, false)                 \
  X(QGEGLU, 8, QuickGelu, Identity, true)                 \
  X(SRELU, 9, SquaredRelu, Identity, false)               \
  X(SREGLU, 10, SquaredRelu, Identity, true)              \
  X(CLAMPED_SWIGLU, 11, ClampedSilu, ClampedLinear, true) \
  X(GELU_EXACT, 12, GeluExact, Identity, false)           \
  X(GEGLU_EXACT, 13, GeluExact, Identity, true)           \
  X(IDENTITY, 99, Identity, Identity, false)

#define TE_JAX_ACTIVATION_ENUM_VALUE(name, value, Act, Lin, gated) name = value,
enum class ActivationEnum : int64_t { TE_JAX_ACTIVATIONS(TE_JAX_ACTIVATION_ENUM_VALUE) };
#undef TE_JAX_ACTIVATION_ENUM_VALUE

#define TE_JAX_ACTIVATION_ENUM_ITEM(name, value, Act, Lin, gated) ActivationEnum::name,
inline constexpr ActivationEnum kActivations[] = {
    TE_JAX_ACTIVATIONS(TE_JAX_ACTIVATION_ENUM_ITEM)};
#undef TE_JAX_ACTIVATION_ENUM_ITEM

// The enum's name ("GELU", ...), or "<unknown activation>".
inline const char* activation_name(ActivationEnum e) {
#define TE_JAX_ACTIVATION_NAME_CASE(name, value, Act, Lin, gated) \
  case ActivationEnum::name: return #name;
  switch (e) { TE_JAX_ACTIVATIONS(TE_JAX_ACTIVATION_NAME_CASE) }
#undef TE_JAX_ACTIVATION_NAME_CASE
  return "<unknown activation>";
}

struct ClampedSwigluParams {
  float limit = 7.0f;
  float alpha = 1.702f;
  float glu_linear_offset = 1.0f;
};

// Runtime parameters of the parametrised activations (only clamped SwiGLU has any today).
struct ActParams {
  ClampedSwigluParams clamped_swiglu;
};

namespace act {

// Non-finite inputs (docs/numerics.md §1). Every value and derivative below is NaN at x = NaN (the
// comparisons are written so that NaN takes the arm that returns x or a product of it), and at
// +-inf and where an intermediate overflows (x^2, x^3, beta*x) they give the limit, not the
// inf * 0 = NaN of the plain formula. The smooth forms need two selects for that, both compares
// against 0 (no extra transcendental):
//   f  = x * w with a weight w in [0, 1] (sigma, Phi): w is exactly 0 where x is far negative, and
//        only there can x be -inf; times_weight returns -0 (x * 0 for finite x < 0) instead.
//   f' = w + t * h(x): t (sigma*(1-sigma), or e^(-x^2/2)) is exactly 0 wherever h(x) can be
//        infinite (|x| beyond ~10, far below where x^2 or beta*x overflow); plus_term drops the
//        term there (and keeps w + t*h one FMA). NaN fails t == 0 and stays NaN.
// The selects compile to compare-and-blend: the CPU loops still vectorise (-fno-trapping-math).

// x * w, or -0 where w == 0 (x may be -inf there).
TE_HD float times_weight(float x, float w) { return w == 0.0f ? -0.0f : x * w; }

// times_weight for a weight that is 0 only at x < 0 (a CDF of x, or a sigmoid of a positive
// multiple of x). On the device x * 0 there is already the -0 wanted once x = -inf is clamped
// to the largest finite value: a max and a multiply instead of a compare, a multiply and a
// select (the GPU's one NaN stays NaN: w is NaN too). The host keeps times_weight's bits, NaN
// payloads included.
TE_HD float times_rising_weight(float x, float w) {
#if defined(__CUDA_ARCH__)
  return fmaxf(x, -3.40282347e38f) * w;
#else
  return times_weight(x, w);
#endif
}

// w + t * h, or w where t == 0 (h may be infinite there).
TE_HD float plus_term(float w, float t, float h) { return t == 0.0f ? w : w + t * h; }

// GELU, tanh form. 0.5*(1 + tanh(u)) == sigmoid(2u), so f and f' need one exp:
//   u = k*(x + c*x^3), s = sigmoid(2u)
//   f  = x*s
//   f' = s + x * (1 - tanh(u)^2)/2 * du/dx = s + 2*x*s*(1-s) * k*(1 + 3c*x^2)
// s is never NaN for a non-NaN x (1 + c*x^2 >= 1), and s*(1-s) == 0 for |x| >~ 10.
struct Gelu {
  TE_HD static void eval(float x, const ActParams&, float& f, float& df) {
    constexpr float k = 0.7978845608028654f;  // sqrt(2/pi)
    constexpr float c = 0.044715f;
    const float x2 = x * x;
    const float s = math::sigmoid(2.0f * k * x * (1.0f + c * x2));
    f = times_rising_weight(x, s);
    df = plus_term(s, s * (1.0f - s), 2.0f * k * x * (1.0f + 3.0f * c * x2));
  }
};

// GELU, erf form: f = x*Phi(x), f' = Phi(x) + x*phi(x). Phi(x) == 0 for x <~ -5.6 and
// e^(-x^2/2) == 0 for |x| >~ 14.4 (float32).
struct GeluExact {
  TE_HD static void eval(float x, const ActParams&, float& f, float& df) {
    constexpr float inv_sqrt2 = 0.7071067811865476f;
    constexpr float inv_sqrt_2pi = 0.3989422804014327f;
    const float cdf = 0.5f * (1.0f + math::erf(x * inv_sqrt2));
    f = times_rising_weight(x, cdf);
    df = plus_term(cdf, math::exp(-0.5f * x * x), x * inv_sqrt_2pi);
  }
};

// sigma(x); its derivative sigma*(1-sigma). The activation half of GLU. sigma(+-inf) = 1 / 0.
struct Sigmoid {
  TE_HD static void eval(float x, const ActParams&, float& f, float& df) {
    const float s = math::sigmoid(x);
    f = s;
    df = s * (1.0f - s);
  }
};

// x*sigma(beta*x) and its derivative sigma(bx) + bx*sigma(bx)*(1-sigma(bx)). beta*x may overflow
// (QuickGELU at |x| > 2e38): sigma saturates long before. kPositiveBeta: beta > 0 always (not a
// user's parameter), so sigma(bx) is 0 only at x < 0.
template <bool kPositiveBeta>
TE_HD void swish(float x, float beta, float& f, float& df) {
  const float bx = beta * x;
  const float s = math::sigmoid(bx);
  f = kPositiveBeta ? times_rising_weight(x, s) : times_weight(x, s);
  df = plus_term(s, s * (1.0f - s), bx);
}

struct Silu {
  TE_HD static void eval(float x, const ActParams&, float& f, float& df) {
    swish<true>(x, 1.0f, f, df);
  }
};

struct QuickGelu {
  TE_HD static void eval(float x, const ActParams&, float& f, float& df) {
    swish<true>(x, 1.702f, f, df);
  }
};

// NaN fails both x <= 0 and x > 0: f = x, f' = x (NaN).
struct Relu {
  TE_HD static void eval(float x, const ActParams&, float& f, float& df) {
    f = x <= 0.0f ? 0.0f : x;
    df = x > 0.0f ? 1.0f : (x <= 0.0f ? 0.0f : x);  // 0 at x == 0 (docs/numerics.md)
  }
};

struct SquaredRelu {
  TE_HD static void eval(float x, const ActParams&, float& f, float& df) {
    f = x <= 0.0f ? 0.0f : x * x;
    df = x <= 0.0f ? 0.0f : 2.0f * x;
  }
};

// GPT-OSS activation half: m = min(x, limit), f = m*sigma(alpha*m); f' = 0 above the limit.
// NaN fails x > limit: m = NaN, f = f' = NaN.
struct ClampedSilu {
  TE_HD static void eval(float x, const ActParams& p, float& f, float& df) {
    const float limit = p.clamped_swiglu.limit;
    const float m = x > limit ? limit : x;
    swish<false>(m, p.clamped_swiglu.alpha, f, df);
    df = x > limit ? 0.0f : df;
  }
};

// Linear halves of the gated forms: value lin(b) and derivative lin'(b); lin'(NaN) = NaN.
struct Identity {
  TE_HD static void eval(float b, const ActParams&, float& v, float& dv) {
    v = b;
    dv = b != b ? b : 1.0f;
  }
};

// b' = clip(b, -limit, limit) + offset; derivative 1 inside [-limit, limit] (inclusive), else 0.
// NaN fails every comparison: b' = NaN, and the derivative's select returns b (NaN).
struct ClampedLinear {
  TE_HD static void eval(float b, const ActParams& p, float& v, float& dv) {
    const float limit = p.clamped_swiglu.limit;
    const float c = b < -limit ? -limit : (b > limit ? limit : b);
    v = c + p.clamped_swiglu.glu_linear_offset;
    dv = (b >= -limit && b <= limit) ? 1.0f : (b != b ? b : 0.0f);
  }
};

}  // namespace act

// A compile-time description of one ActivationEnum value.
template <typename Act_, typename Lin_, bool kGated_>
struct ActivationSpec {
  using Act = Act_;
  using Lin = Lin_;  // meaningful only when gated
  static constexpr bool kGated = kGated_;
  static constexpr int kActLen = kGated_ ? 2 : 1;
};

// Calls fn(ActivationSpec<...>{}) for the runtime enum; returns false for an unknown value.
template <typename Fn>
bool with_activation(ActivationEnum e, Fn&& fn) {
#define TE_JAX_ACTIVATION_SPEC_CASE(name, value, Act, Lin, gated) \
  case ActivationEnum::name: fn(ActivationSpec<act::Act, act::Lin, gated>{}); return true;
  switch (e) { TE_JAX_ACTIVATIONS(TE_JAX_ACTIVATION_SPEC_CASE) }
#undef TE_JAX_ACTIVATION_SPEC_CASE
  return false;
}

inline bool is_gated(ActivationEnum e) {
  bool gated = false;
  with_activation(e, [&](auto spec) { gated = decltype(spec)::kGated; });
  return gated;
}

// Forward of one element (non-gated: b is ignored).
template <typename Spec>
TE_HD float act_forward(float a, float b, const ActParams& p) {
  float f, df;
  Spec::Act::eval(a, p, f, df);
  if constexpr (Spec::kGated) {
    float v, dv;
    Spec::Lin::eval(b, p, v, dv);
    return f * v;
  } else {
    return f;
  }
}

// Backward of one element given upstream g: writes dA (and dB when gated).
template <typename Spec>
TE_HD void act_backward(float g, float a, float b, const ActParams& p, float& da, float& db) {
  float f, df;
  Spec::Act::eval(a, p, f, df);
  if constexpr (Spec::kGated) {
    float v, dv;
    Spec::Lin::eval(b, p, v, dv);
    da = df * g * v;
    db = dv * g * f;
  } else {
    da = df * g;
    db = 0.0f;
  }
}

}  // namespace te_jax
