// The GEMM family's decoded problem: te_jax_gemm's buffers and attributes checked and turned into
// one row-major GEMM description (gemm/targets.h has the contract). Host-only.
//
//   L = lhs (M, K), or lhsᵀ when lhs_trans (stored (K, M));  R = rhs (K, N), or rhsᵀ when
//   rhs_trans (stored (N, K));
//   out (M, N) = epilogue(L·R · lhs_scale_inv · rhs_scale_inv + addend + bias)
// (block-scaled operands: each product term scaled by its blocks' scale_invs, GemmScaleMode)
// (addend: cuBLASLt's C with beta = 1, out's shape and dtype, DEFAULT epilogue only)
//
// with an optional leading batch B on lhs, rhs, out and the aux buffers (a strided batch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/ffi_errors.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::gemm {

namespace ffi = ::xla::ffi;

// The epilogue applied to h = acc · scales + bias (the FFI attribute `epilogue`; Python's
// te_jax.primitives.gemm.GemmEpilogue holds the same values).
enum class GemmEpilogue : int64_t {
  DEFAULT = 0,   // out = h
  GELU_AUX = 1,  // out = gelu_tanh(h), aux_out = h (rounded to out's dtype)
  RELU = 2,      // out = max(h, 0)
  DGELU = 3,     // out = acc · gelu_tanh'(aux_in); with grad_bias also dbias = Σ_rows out
  GELU = 4,      // out = gelu_tanh(h)
};

// How an FP8 operand's scale_inv applies (the FFI attributes `lhs_scale_mode` / `rhs_scale_mode`;
// Python's te_jax.primitives.gemm.GemmScaleMode holds the same values). The block modes read
// float32 scales in cuBLASLt's layouts, of the operand as stored (M, K) / (N, K):
//   BLOCK_1D  one per 1x128 block along K: (ceil(K/128), round_up(rows, 4)), rows contiguous
//   BLOCK_2D  one per 128x128 tile: (ceil(rows/128), round_up(ceil(K/128), 4)), K-blocks contiguous
// (the padding is never read). Block scaling is unbatched, FP8 only, and one operand at most is
// 2D (cuBLASLt has no 2D x 2D kernel).
enum class GemmScaleMode : int64_t {
  TENSOR = 0,    // one float32 per tensor, (1,)
  BLOCK_1D = 1,  // cuBLASLt's VEC128_32F
  BLOCK_2D = 2,  // cuBLASLt's BLK128x128_32F
};

inline constexpr int64_t kScaleBlock = 128;

// The float32 count of a block scale of an operand stored (rows, k).
inline int64_t block_scale_count(GemmScaleMode mode, int64_t rows, int64_t k) {
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const auto round_up4 = [](int64_t a) { return (a + 3) / 4 * 4; };
  if (mode == GemmScaleMode::BLOCK_1D) return ceil_div(k, kScaleBlock) * round_up4(rows);
  return ceil_div(rows, kScaleBlock) * round_up4(ceil_div(k, kScaleBlock));
}

// cuBLASLt's FP8 GEMM needs 16-byte aligned leading dimensions: K (both operands) and N (out).
inline constexpr int64_t kFp8Alignment = 16;

struct GemmProblem {
  ffi::DataType lhs_type, rhs_type, out_type;
  int64_t batch = 1, m = 0, n = 0, k = 0;
  bool lhs_trans = false, rhs_trans = false;
  GemmEpilogue epilogue = GemmEpilogue::DEFAULT;
  bool grad_bias = false, split_accumulator = true;
  GemmScaleMode lhs_scale_mode = GemmScaleMode::TENSOR, rhs_scale_mode = GemmScaleMode::TENSOR;
  // Take cuBLASLt's first heuristic choice untimed, so the algorithm (and the bits) are the same
  // in every process (gemm/NOTES.md, "Deterministic GEMMs").
  bool deterministic = false;

  const void* lhs = nullptr;
  const void* rhs = nullptr;
  const void* bias = nullptr;    // nullptr: no bias
  const void* aux_in = nullptr;  // DGELU's pre-activation
  const void* addend = nullptr;  // C, added to the scaled product; nullptr: none
  const float* lhs_scale_inv = nullptr;
  const float* rhs_scale_inv = nullptr;
  void* out = nullptr;
  void* aux_out = nullptr;  // GELU_AUX's h
  void* dbias = nullptr;    // DGELU with grad_bias
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  bool fp8() const { return is_fp8(lhs_type); }
  bool block_scaled() const {
    return lhs_scale_mode != GemmScaleMode::TENSOR || rhs_scale_mode != GemmScaleMode::TENSOR;
  }
  static bool is_fp8(ffi::DataType t) {
    return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
  }
  // One line naming the problem, for error messages.
  std::string describe() const;
};

inline const char* gemm_dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    default: return dtype_name(t);
  }
}

inline std::string GemmProblem::describe() const {
  std::string s = std::string(gemm_dtype_name(lhs_type)) + (lhs_trans ? "ᵀ" : "") + " x " +
                  gemm_dtype_name(rhs_type) + (rhs_trans ? "ᵀ" : "") + " -> " +
                  gemm_dtype_name(out_type) + ", B=" + std::to_string(batch) +
                  " M=" + std::to_string(m) + " N=" + std::to_string(n) +
                  " K=" + std::to_string(k) + ", epilogue " +
                  std::to_string(static_cast<int64_t>(epilogue));
  if (block_scaled())
    s += ", scale modes " + std::to_string(static_cast<int64_t>(lhs_scale_mode)) + " x " +
         std::to_string(static_cast<int64_t>(rhs_scale_mode));
  if (bias) s += ", bias";
  if (addend) s += ", addend";
  if (deterministic) s += ", deterministic";
  return s;
}

namespace detail {

inline bool is_float(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// (B, rows, cols) of a rank-2 or rank-3 operand; false for another rank.
inline bool matrix_dims(ffi::AnyBuffer b, int64_t& batch, int64_t& rows, int64_t& cols) {
  auto d = b.dimensions();
  if (d.size() == 2) {
    batch = 1, rows = d[0], cols = d[1];
    return true;
  }
  if (d.size() == 3) {
    batch = d[0], rows = d[1], cols = d[2];
    return true;
  }
  return false;
}

inline bool absent(ffi::AnyBuffer b) { return b.element_count() == 0; }

}  // namespace detail

// Checks every buffer and attribute against the contract; fills `p`.
inline ffi::Error decode_gemm(GemmProblem& p, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                              ffi::AnyBuffer bias, ffi::AnyBuffer aux_in,
                              ffi::AnyBuffer lhs_scale_inv, ffi::AnyBuffer rhs_scale_inv,
                              ffi::AnyBuffer addend, ffi::AnyBuffer* out, ffi::AnyBuffer* aux_out,
                              ffi::AnyBuffer* dbias, ffi::AnyBuffer* workspace, bool lhs_trans,
                              bool rhs_trans, GemmEpilogue epilogue, bool grad_bias,
                              bool split_accumulator, bool deterministic,
                              GemmScaleMode lhs_scale_mode, GemmScaleMode rhs_scale_mode,
                              const char* op) {
  using detail::absent;
  p.lhs_type = lhs.element_type();
  p.rhs_type = rhs.element_type();
  p.out_type = out->element_type();
  p.lhs_trans = lhs_trans, p.rhs_trans = rhs_trans, p.epilogue = epilogue;
  p.grad_bias = grad_bias, p.split_accumulator = split_accumulator;
  p.lhs_scale_mode = lhs_scale_mode, p.rhs_scale_mode = rhs_scale_mode;
  p.deterministic = deterministic;

  const bool fp8 = GemmProblem::is_fp8(p.lhs_type);
  if (fp8) {
    if (!GemmProblem::is_fp8(p.rhs_type))
      return invalid(op, "an FP8 lhs needs an FP8 rhs, got " +
                             std::string(gemm_dtype_name(p.rhs_type)));
    if (p.lhs_type == ffi::DataType::F8E5M2 && p.rhs_type == ffi::DataType::F8E5M2)
      return invalid(op, "float8_e5m2 x float8_e5m2 has no cuBLASLt kernel (one operand must "
                         "be float8_e4m3fn)");
    if (!detail::is_float(p.out_type))
      return invalid(op, std::string("out must be float32, bfloat16 or float16, got ") +
                             gemm_dtype_name(p.out_type));
    if (lhs_trans || !rhs_trans)
      return invalid(op, "FP8 operands must be in the TN form: lhs stored (M, K) "
                         "(lhs_trans=False) and rhs stored (N, K) (rhs_trans=True)");
  } else {
    if (!detail::is_float(p.lhs_type))
      return invalid(op, std::string("lhs must be float32, bfloat16, float16, float8_e4m3fn or "
                                     "float8_e5m2, got ") + gemm_dtype_name(p.lhs_type));
    if (p.rhs_type != p.lhs_type || p.out_type != p.lhs_type)
      return invalid(op, std::string("lhs, rhs and out must share one dtype, got ") +
                             gemm_dtype_name(p.lhs_type) + ", " + gemm_dtype_name(p.rhs_type) +
                             ", " + gemm_dtype_name(p.out_type));
  }

  int64_t lb, lr, lc, rb, rr, rc, ob, orow, ocol;
  if (!detail::matrix_dims(lhs, lb, lr, lc) || !detail::matrix_dims(rhs, rb, rr, rc) ||
      !detail::matrix_dims(*out, ob, orow, ocol))
    return invalid(op, "lhs, rhs and out must be rank 2 (M, K) or rank 3 (B, M, K); got " +
                           dims_str(lhs.dimensions()) + ", " + dims_str(rhs.dimensions()) +
                           ", " + dims_str(out->dimensions()));
  const size_t rank = lhs.dimensions().size();
  if (rhs.dimensions().size() != rank || out->dimensions().size() != rank || lb != rb ||
      lb != ob)
    return invalid(op, "lhs, rhs and out must have the same rank and batch, got " +
                           dims_str(lhs.dimensions()) + ", " + dims_str(rhs.dimensions()) +
                           ", " + dims_str(out->dimensions()));
  p.batch = lb;
  p.m = lhs_trans ? lc : lr;
  p.k = lhs_trans ? lr : lc;
  p.n = rhs_trans ? rr : rc;
  const int64_t rk = rhs_trans ? rc : rr;
  if (rk != p.k)
    return invalid(op, "contracting dims differ: lhs " + dims_str(lhs.dimensions()) +
                           (lhs_trans ? " (transposed)" : "") + " and rhs " +
                           dims_str(rhs.dimensions()) + (rhs_trans ? " (transposed)" : ""));
  if (orow != p.m || ocol != p.n)
    return invalid(op, "out must be (M, N) = (" + std::to_string(p.m) + ", " +
                           std::to_string(p.n) + "), got " + dims_str(out->dimensions()));
  if (fp8 && p.m * p.n > 0 && (p.k % kFp8Alignment || p.n % kFp8Alignment))
    return invalid(op, "FP8 GEMMs need K and N to be multiples of 16, got K=" +
                           std::to_string(p.k) + " N=" + std::to_string(p.n));

  if (!absent(bias)) {
    if (bias.element_type() != p.out_type || bias.dimensions().size() != 1 ||
        bias.dimensions()[0] != p.n)
      return invalid(op, "bias must be (" + std::to_string(p.n) + ",) in out's dtype, got " +
                             dims_str(bias.dimensions()) + " " +
                             gemm_dtype_name(bias.element_type()));
    if (fp8 && p.out_type == ffi::DataType::F32)
      return invalid(op, "cuBLASLt's FP8 GEMM has no bias epilogue with a float32 output (te_jax's "
                         "GEMM primitive adds that bias itself)");
    p.bias = bias.untyped_data();
  }
  const bool dgelu = epilogue == GemmEpilogue::DGELU;
  const bool gelu_aux = epilogue == GemmEpilogue::GELU_AUX;
  if (static_cast<int64_t>(epilogue) < 0 || static_cast<int64_t>(epilogue) > 4)
    return invalid(op, "unknown epilogue " + std::to_string(static_cast<int64_t>(epilogue)));
  if (dgelu && p.bias) return invalid(op, "the DGELU epilogue takes no bias");
  if (grad_bias && !dgelu) return invalid(op, "grad_bias needs the DGELU epilogue");
  if (dgelu) {
    if (aux_in.element_type() != p.out_type || !same_dims(aux_in.dimensions(),
                                                          out->dimensions()))
      return invalid(op, "aux_in (the pre-activation) must have out's shape " +
                             dims_str(out->dimensions()) + " and dtype, got " +
                             dims_str(aux_in.dimensions()));
    p.aux_in = aux_in.untyped_data();
  } else if (!absent(aux_in)) {
    return invalid(op, "aux_in is read only by the DGELU epilogue");
  }
  if (gelu_aux) {
    if (aux_out->element_type() != p.out_type || !same_dims(aux_out->dimensions(),
                                                            out->dimensions()))
      return invalid(op, "aux_out must have out's shape " + dims_str(out->dimensions()) +
                             " and dtype, got " + dims_str(aux_out->dimensions()));
    p.aux_out = aux_out->untyped_data();
  } else if (aux_out->element_count() != 0) {
    return invalid(op, "aux_out must be empty unless epilogue is GELU_AUX");
  }
  if (grad_bias) {
    if (p.batch != 1) return invalid(op, "grad_bias takes an unbatched GEMM");
    if (dbias->element_type() != p.out_type || dbias->element_count() != size_t(p.n))
      return invalid(op, count_error("dbias", p.n, *dbias));
    p.dbias = dbias->untyped_data();
  } else if (dbias->element_count() != 0) {
    return invalid(op, "dbias must be empty unless grad_bias");
  }
  if (!absent(addend)) {
    if (epilogue != GemmEpilogue::DEFAULT)
      return invalid(op, "the addend is added with the DEFAULT epilogue only");
    if (addend.element_type() != p.out_type || !same_dims(addend.dimensions(),
                                                          out->dimensions()))
      return invalid(op, "addend must have out's shape " + dims_str(out->dimensions()) +
                             " and dtype, got " + dims_str(addend.dimensions()) + " " +
                             gemm_dtype_name(addend.element_type()));
    p.addend = addend.untyped_data();
  }
  for (const auto mode : {lhs_scale_mode, rhs_scale_mode}) {
    if (static_cast<int64_t>(mode) < 0 || static_cast<int64_t>(mode) > 2)
      return invalid(op, "unknown scale mode " + std::to_string(static_cast<int64_t>(mode)));
  }
  if (p.block_scaled()) {
    if (!fp8) return invalid(op, "block scale modes take FP8 operands");
    if (p.batch != 1) return invalid(op, "block-scaled FP8 GEMMs are unbatched");
    if (lhs_scale_mode == GemmScaleMode::BLOCK_2D && rhs_scale_mode == GemmScaleMode::BLOCK_2D)
      return invalid(op, "cuBLASLt has no GEMM of two 128x128-block-scaled operands (one must "
                         "be 1x128-block scaled)");
  }
  const auto scale_count = [&](GemmScaleMode mode, int64_t rows) -> int64_t {
    return mode == GemmScaleMode::TENSOR ? 1 : block_scale_count(mode, rows, p.k);
  };
  const int64_t lhs_scales = scale_count(lhs_scale_mode, p.m);
  const int64_t rhs_scales = scale_count(rhs_scale_mode, p.n);
  if (lhs_scale_inv.element_type() != ffi::DataType::F32 ||
      lhs_scale_inv.element_count() != size_t(lhs_scales) ||
      rhs_scale_inv.element_type() != ffi::DataType::F32 ||
      rhs_scale_inv.element_count() != size_t(rhs_scales))
    return invalid(op, "lhs_scale_inv and rhs_scale_inv must be float32 with " +
                           std::to_string(lhs_scales) + " and " + std::to_string(rhs_scales) +
                           " elements (their scale modes'), got " +
                           dims_str(lhs_scale_inv.dimensions()) + " and " +
                           dims_str(rhs_scale_inv.dimensions()));
  p.lhs_scale_inv = static_cast<const float*>(lhs_scale_inv.untyped_data());
  p.rhs_scale_inv = static_cast<const float*>(rhs_scale_inv.untyped_data());
  p.lhs = lhs.untyped_data();
  p.rhs = rhs.untyped_data();
  p.out = out->untyped_data();
  p.workspace = workspace->untyped_data();
  p.workspace_bytes = workspace->size_bytes();
  return ffi::Error::Success();
}

}  // namespace te_jax::gemm
