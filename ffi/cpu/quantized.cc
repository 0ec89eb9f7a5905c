// CPU generic path: the scaled modes of te_jax_act_lu / te_jax_quantize /
// te_jax_dact_dbias_quantize, and the amax passes (te_jax_act_amax, te_jax_dact_dbias_amax).
// Layouts and formulas: ffi/common/problem.h and SPEC.md §4-§5.
//
// The output y [M, N] (N = act_len * H) is produced in tiles of kTileRows rows x kTileCols
// columns of each half: the activation (or its gradient) is computed in float32 by the same
// loops as the NO_SCALING path, rounded to x's dtype, kept in the tile, and then emitted:
//   amax    max|y| of the tile, as the integer max of |y|'s bits (NaN above inf; exact,
//           order-independent), reduced per batch at the end;
//   tensor  codes = fmt(y * scale[batch]), written row by row, and/or transposed per batch;
//   MXFP8   per 32-element block (along a row, or down a column of the tile: tiles start at
//           multiples of 32 rows) the E8M0 exponent of amax_b / Q, codes = fmt(y * 2^-e);
//   NVFP4   per 16-element block, an E4M3 block scale from amax_b and the global scale S, codes
//           E2M1 packed two per byte along the row.
// dbias: the (batch, row group) tasks of the workspace, as in kernels.cc, but with group
// boundaries on tile boundaries (so a colwise block never straddles two tasks); each task adds
// its rows' unrounded float32 values in row order, and the groups are summed in order: the bits
// do not depend on the threads.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "common/activations.h"
#include "common/formats.h"
#include "common/problem.h"
#include "cpu/kernels.h"
#include "cpu/loops.h"
#include "cpu/parallel.h"

namespace te_jax::cpu {
namespace {

namespace ffi = ::xla::ffi;
using namespace loops;

constexpr int64_t kTileRows = 32;   // one MXFP8 colwise block, two NVFP4 ones
constexpr int64_t kTileCols = 256;  // a multiple of kVec and of both block sizes

// One tile of y: v[l][i][j] is y at row r0 + i, column l * H + c0 + j (l = half of a gated
// dact output, else 0), already rounded to x's dtype; codes: scratch for the colwise layouts.
struct Tile {
  int64_t batch = 0, r0 = 0, nr = 0, c0 = 0, nc = 0;
  alignas(64) float v[2][kTileRows][kTileCols];
  alignas(64) uint8_t codes[2][kTileRows][kTileCols];
  // The row-major inputs of a row whose piece is not a whole number of vector blocks.
  alignas(64) float pad_in[3][kTileCols];
};

// A tile buffer per thread, reused across tasks and calls.
Tile& thread_tile() {
  thread_local std::unique_ptr<Tile> tile = std::make_unique<Tile>();
  return *tile;
}

// ---- vectorisable loops over one tile row or block ----------------------------------------

// v = float(round_to_D(v)) for n values: what the NO_SCALING path would output.
template <typename D>
TE_JAX_LOOP void round_to_storage(float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = D::load(D::store(v[i]));
}

TE_JAX_LOOP int32_t max_abs_key(const float* __restrict v, int64_t n) {
  int32_t key = 0;
  for (int64_t i = 0; i < n; ++i) key = std::max(key, F32::abs_key(v[i]));
  return key;
}

template <typename Fmt>
TE_JAX_LOOP void encode_scaled(const float* __restrict v, uint8_t* __restrict out, int64_t n,
                               float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = Fmt::encode(fmt::mul_exact(v[i], scale));
}

// MXFP8 along a row: n / 32 blocks; scales[k] = biased exponent of block k.
template <typename Fmt>
TE_JAX_LOOP void mxfp8_row(const float* __restrict v, uint8_t* __restrict out,
                           uint8_t* __restrict scales, int64_t n) {
  for (int64_t k = 0; k < n / 32; ++k) {
    const float* __restrict b = v + 32 * k;
    int32_t key = 0;
    for (int i = 0; i < 32; ++i) key = std::max(key, F32::abs_key(b[i]));
    const float amax = F32::key_value(key);
    const int e = fmt::e8m0_exponent(amax, Fmt::kMax);
    scales[k] = fmt::e8m0_biased(amax, Fmt::kMax);
    // A NaN block (scale 0xFF) has NaN codes.
    const bool nan = amax != amax;
    for (int i = 0; i < 32; ++i) {
      out[32 * k + i] = Fmt::encode(nan ? amax : fmt::mul_pow2(b[i], -e));
    }
  }
}

// MXFP8 down the 32 rows of a tile: one block per column j < n.
template <typename Fmt>
TE_JAX_LOOP void mxfp8_cols(const float (*__restrict v)[kTileCols],
                            uint8_t (*__restrict out)[kTileCols], uint8_t* __restrict scales,
                            int64_t n) {
  int32_t key[kTileCols] = {};
  for (int i = 0; i < 32; ++i)
    for (int64_t j = 0; j < n; ++j) key[j] = std::max(key[j], F32::abs_key(v[i][j]));
  int e[kTileCols];
  float nan[kTileCols];  // the block's NaN amax, or 0: a NaN block has NaN codes
  for (int64_t j = 0; j < n; ++j) {
    const float amax = F32::key_value(key[j]);
    e[j] = fmt::e8m0_exponent(amax, Fmt::kMax);
    scales[j] = fmt::e8m0_biased(amax, Fmt::kMax);
    nan[j] = amax != amax ? amax : 0.0f;
  }
  for (int i = 0; i < 32; ++i)
    for (int64_t j = 0; j < n; ++j) {
      out[i][j] = Fmt::encode(nan[j] != nan[j] ? nan[j] : fmt::mul_pow2(v[i][j], -e[j]));
    }
}

// NVFP4 block scale (E4M3 code) of a block with max |y| = amax, global scale s.
// (amax / 6) * s, each step correctly rounded whatever the CPU's denormal mode.
TE_HD uint8_t nvfp4_block_scale(float amax, float s) {
  return fmt::to_e4m3(fmt::mul_exact(fmt::div_exact<6>(amax), s));
}

// E2M1 code of y in a block whose E4M3 block scale decodes to bs (0 where bs is 0).
TE_HD uint8_t nvfp4_code(float y, float s, float bs) {
  const uint8_t c = fmt::to_e2m1(fmt::mul_exact(y, s) / bs);
  return bs == 0.0f ? uint8_t{0} : c;
}

// NVFP4 along a row: n / 16 blocks, codes packed two per byte into out[n / 2].
TE_JAX_LOOP void nvfp4_row(const float* __restrict v, uint8_t* __restrict out,
                           uint8_t* __restrict scales, int64_t n, float s) {
  for (int64_t k = 0; k < n / 16; ++k) {
    const float* __restrict b = v + 16 * k;
    int32_t key = 0;
    for (int i = 0; i < 16; ++i) key = std::max(key, F32::abs_key(b[i]));
    const uint8_t sc = nvfp4_block_scale(F32::key_value(key), s);
    scales[k] = sc;
    const float bs = fmt::from_e4m3(sc);
    for (int i = 0; i < 8; ++i) {
      out[8 * k + i] = fmt::pack_e2m1(nvfp4_code(b[2 * i], s, bs), nvfp4_code(b[2 * i + 1], s, bs));
    }
  }
}

// NVFP4 down 16 rows of a tile: one block per column j < n; codes packed along the rows' columns
// into out[i][j / 2].
TE_JAX_LOOP void nvfp4_cols(const float (*__restrict v)[kTileCols],
                            uint8_t (*__restrict out)[kTileCols], uint8_t* __restrict scales,
                            int64_t n, float s) {
  int32_t key[kTileCols] = {};
  for (int i = 0; i < 16; ++i)
    for (int64_t j = 0; j < n; ++j) key[j] = std::max(key[j], F32::abs_key(v[i][j]));
  float bs[kTileCols];
  for (int64_t j = 0; j < n; ++j) {
    scales[j] = nvfp4_block_scale(F32::key_value(key[j]), s);
    bs[j] = fmt::from_e4m3(scales[j]);
  }
  for (int i = 0; i < 16; ++i)
    for (int64_t j = 0; j < n / 2; ++j)
      out[i][j] = fmt::pack_e2m1(nvfp4_code(v[i][2 * j], s, bs[2 * j]),
                                 nvfp4_code(v[i][2 * j + 1], s, bs[2 * j + 1]));
}

// ---- producing a tile -----------------------------------------------------------------------

// The geometry of one call: y is [m, act_len * h], batches of m / batches rows.
struct Geometry {
  int64_t m, h, act_len, batches;
  int64_t n() const { return act_len * h; }
  int64_t rows_per_batch() const { return m / batches; }
  int64_t row_tiles() const { return ceil_div(rows_per_batch(), kTileRows); }
  int64_t col_tiles() const { return ceil_div(h, kTileCols); }
  // Tile (batch b, row tile rt, column tile ct).
  void place(Tile& t, int64_t b, int64_t rt, int64_t ct) const {
    t.batch = b;
    t.r0 = b * rows_per_batch() + rt * kTileRows;
    t.nr = std::min(kTileRows, (b + 1) * rows_per_batch() - t.r0);
    t.c0 = ct * kTileCols;
    t.nc = std::min(kTileCols, h - t.c0);
  }
};

// Points at n contiguous inputs, or copies them zero-padded to a whole number of vector blocks.
template <typename T>
const T* padded(const T* src, int64_t n, int64_t padded_n, float* buf) {
  if (n == padded_n) return src;
  T* dst = reinterpret_cast<T*>(buf);
  std::copy(src, src + n, dst);
  std::fill(dst + n, dst + padded_n, T{});
  return dst;
}

// act_lu: x [m, act_len, h] -> v[0].
template <typename Spec, typename D>
void produce_forward(const typename D::T* x, const Geometry& g, const ActParams& p, Tile& t) {
  const int64_t n = round_up_vec(t.nc), L = Spec::kActLen;
  for (int64_t i = 0; i < t.nr; ++i) {
    const typename D::T* a = x + (t.r0 + i) * L * g.h + t.c0;
    const typename D::T* b = Spec::kGated ? a + g.h : a;
    a = padded(a, t.nc, n, t.pad_in[0]);
    b = Spec::kGated ? padded(b, t.nc, n, t.pad_in[1]) : a;
    fwd_raw<Spec, D>(a, b, t.v[0][i], n, p);
    round_to_storage<D>(t.v[0][i], t.nc);
  }
}

// dact: dz [m, h], x [m, act_len, h] -> v[0] (dA), v[1] (dB, gated); adds the unrounded values
// to ws[c0 + j] (and ws[h + c0 + j]) row after row when ws is given.
template <typename Spec, typename D>
void produce_backward(const typename D::T* dz, const typename D::T* x, const Geometry& g,
                      const ActParams& p, float* ws, Tile& t) {
  const int64_t n = round_up_vec(t.nc), L = Spec::kActLen;
  for (int64_t i = 0; i < t.nr; ++i) {
    const int64_t r = t.r0 + i;
    const typename D::T* gz = padded(dz + r * g.h + t.c0, t.nc, n, t.pad_in[0]);
    const typename D::T* a = x + r * L * g.h + t.c0;
    const typename D::T* b = Spec::kGated ? a + g.h : a;
    a = padded(a, t.nc, n, t.pad_in[1]);
    b = Spec::kGated ? padded(b, t.nc, n, t.pad_in[2]) : a;
    // Non-gated: dB is computed (as 0) into v[1], which is otherwise unused.
    bwd_raw<Spec, D>(gz, a, b, t.v[0][i], t.v[1][i], n, p);
    for (int l = 0; l < L; ++l) {
      if (ws != nullptr) {
        float* __restrict part = ws + l * g.h + t.c0;
        const float* __restrict vals = t.v[l][i];
        for (int64_t j = 0; j < t.nc; ++j) part[j] += vals[j];
      }
      round_to_storage<D>(t.v[l][i], t.nc);
    }
  }
}

// ---- emitting a tile ------------------------------------------------------------------------

template <typename Fmt>
struct Emitter {
  const QuantOutput& q;
  const Geometry& g;

  // Returns the tile's max abs key (0 when no amax is wanted).
  int32_t operator()(Tile& t) const {
    const int64_t L = g.act_len, n = g.n();
    int32_t key = 0;
    if (q.amax != nullptr) {
      for (int l = 0; l < L; ++l)
        for (int64_t i = 0; i < t.nr; ++i) key = std::max(key, max_abs_key(t.v[l][i], t.nc));
    }
    switch (q.mode) {
      case ScalingMode::DELAYED_TENSOR_SCALING:
      case ScalingMode::CURRENT_TENSOR_SCALING: tensor(t, L, n); break;
      case ScalingMode::MXFP8_1D_SCALING: mxfp8(t, L, n); break;
      case ScalingMode::NVFP4_1D_SCALING: nvfp4(t, L, n); break;
      default: break;  // the amax pass
    }
    return key;
  }

  void tensor(Tile& t, int64_t L, int64_t n) const {
    const float s = q.tensor_scale(t.batch);
    for (int l = 0; l < L; ++l) {
      for (int64_t i = 0; i < t.nr; ++i) {
        if (q.data != nullptr) {
          encode_scaled<Fmt>(t.v[l][i], q.data + (t.r0 + i) * n + l * g.h + t.c0, t.nc, s);
        }
        if (q.colwise != nullptr) encode_scaled<Fmt>(t.v[l][i], t.codes[l][i], t.nc, s);
      }
    }
    if (q.colwise == nullptr) return;
    // Batch b's transpose: colwise[b][col][row - b * rows_per_batch].
    const int64_t mb = g.rows_per_batch();
    uint8_t* base = q.colwise + t.batch * n * mb + (t.r0 - t.batch * mb);
    for (int l = 0; l < L; ++l) {
      for (int64_t j = 0; j < t.nc; ++j) {
        uint8_t* __restrict dst = base + (l * g.h + t.c0 + j) * mb;
        for (int64_t i = 0; i < t.nr; ++i) dst[i] = t.codes[l][i][j];
      }
    }
  }

  void mxfp8(Tile& t, int64_t L, int64_t n) const {
    for (int l = 0; l < L; ++l) {
      const int64_t col = l * g.h + t.c0;
      if (q.data != nullptr) {
        for (int64_t i = 0; i < t.nr; ++i) {
          const int64_t r = t.r0 + i;
          mxfp8_row<Fmt>(t.v[l][i], q.data + r * n + col, q.block_scale + r * (n / 32) + col / 32,
                         t.nc);
        }
      }
      if (q.colwise != nullptr) {  // t.nr == 32: rows per batch are a multiple of 32
        mxfp8_cols<Fmt>(t.v[l], t.codes[l], q.colwise_block_scale + (t.r0 / 32) * n + col, t.nc);
        for (int64_t i = 0; i < t.nr; ++i) {
          std::memcpy(q.colwise + (t.r0 + i) * n + col, t.codes[l][i], t.nc);
        }
      }
    }
  }

  void nvfp4(Tile& t, int64_t L, int64_t n) const {
    const float s = q.tensor_scale(t.batch);
    for (int l = 0; l < L; ++l) {
      const int64_t col = l * g.h + t.c0;
      if (q.data != nullptr) {
        for (int64_t i = 0; i < t.nr; ++i) {
          const int64_t r = t.r0 + i;
          nvfp4_row(t.v[l][i], q.data + (r * n + col) / 2, q.block_scale + r * (n / 16) + col / 16,
                    t.nc, s);
        }
      }
      if (q.colwise != nullptr) {  // t.nr is 16 or 32: rows per batch are a multiple of 16
        for (int64_t i0 = 0; i0 < t.nr; i0 += 16) {
          nvfp4_cols(t.v[l] + i0, t.codes[l] + i0,
                     q.colwise_block_scale + ((t.r0 + i0) / 16) * n + col, t.nc, s);
        }
        for (int64_t i = 0; i < t.nr; ++i) {
          std::memcpy(q.colwise + ((t.r0 + i) * n + col) / 2, t.codes[l][i], t.nc / 2);
        }
      }
    }
  }
};

// Calls fn(Emitter<Fmt>) for the call's output format.
template <typename Fn>
void with_emitter(const QuantOutput& q, const Geometry& g, Fn&& fn) {
  switch (q.qtype) {
    case QType::E4M3: fn(Emitter<fmt::E4M3>{q, g}); break;
    case QType::E5M2: fn(Emitter<fmt::E5M2>{q, g}); break;
    case QType::E2M1: fn(Emitter<fmt::E2M1>{q, g}); break;
  }
}

// Per-batch amax from per-task keys (task_batch[t] = the batch of task t), and the tensor
// scale_inv = 1 / scale.
void finish(const QuantOutput& q, const std::vector<int32_t>& keys,
            const std::vector<int64_t>& task_batch) {
  if (q.amax != nullptr) {
    std::vector<int32_t> batch_key(q.batches, 0);
    for (size_t t = 0; t < keys.size(); ++t) {
      batch_key[task_batch[t]] = std::max(batch_key[task_batch[t]], keys[t]);
    }
    for (int64_t b = 0; b < q.batches; ++b) q.amax[b] = F32::key_value(batch_key[b]);
  }
  if (q.scale_inv != nullptr) {
    for (int64_t b = 0; b < q.batches; ++b) q.scale_inv[b] = fmt::div_rn(1.0f, q.tensor_scale(b));
  }
}

// ---- the ops --------------------------------------------------------------------------------

template <typename D>
void act_lu_generic(const ActLuProblem& p, ffi::ThreadPool* pool) {
  using T = typename D::T;
  const QuantOutput& q = p.q;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    const Geometry g{p.rows, p.hidden, 1, q.batches};
    const int64_t rt = g.row_tiles(), ct = g.col_tiles();
    const int64_t tasks = p.rows > 0 && p.hidden > 0 ? q.batches * rt * ct : 0;
    std::vector<int32_t> keys(tasks, 0);
    std::vector<int64_t> task_batch(tasks, 0);
    with_emitter(q, g, [&](auto emit) {
      parallel_chunks(pool, tasks, [&](int64_t task) {
        Tile& t = thread_tile();
        g.place(t, task / (rt * ct), (task / ct) % rt, task % ct);
        produce_forward<Spec, D>(static_cast<const T*>(p.x), g, p.params, t);
        keys[task] = emit(t);
        task_batch[task] = t.batch;
      });
    });
    finish(q, keys, task_batch);
  });
}

template <typename D>
void dact_generic(const DActProblem& p, ffi::ThreadPool* pool) {
  using T = typename D::T;
  const QuantOutput& q = p.q;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    const Geometry g{p.rows, p.hidden, Spec::kActLen, q.batches};
    const int64_t rt = g.row_tiles(), ct = g.col_tiles(), n = g.n();
    const T* dz = static_cast<const T*>(p.dz);
    const T* x = static_cast<const T*>(p.x);
    const bool empty = p.rows == 0 || p.hidden == 0;
    // Without dbias every tile is a task; with it a task is (batch, group, column tile) and
    // owns the row tiles [group * rt / groups, (group + 1) * rt / groups) of its batch.
    const int64_t groups = p.dbias != nullptr ? p.groups : rt;
    const int64_t tasks = empty ? 0 : q.batches * groups * ct;
    std::vector<int32_t> keys(tasks, 0);
    std::vector<int64_t> task_batch(tasks, 0);
    with_emitter(q, g, [&](auto emit) {
      parallel_chunks(pool, tasks, [&](int64_t task) {
        const int64_t b = task / (groups * ct), grp = (task / ct) % groups, c = task % ct;
        float* part = nullptr;
        if (p.dbias != nullptr) {
          part = p.workspace + (b * groups + grp) * n;
          const int64_t c0 = c * kTileCols, c1 = std::min(p.hidden, c0 + kTileCols);
          for (int l = 0; l < Spec::kActLen; ++l) {
            std::fill(part + l * p.hidden + c0, part + l * p.hidden + c1, 0.0f);
          }
        }
        Tile& t = thread_tile();
        int32_t key = 0;
        for (int64_t r = grp * rt / groups; r < (grp + 1) * rt / groups; ++r) {
          g.place(t, b, r, c);
          produce_backward<Spec, D>(dz, x, g, p.params, part, t);
          key = std::max(key, emit(t));
        }
        keys[task] = key;
        task_batch[task] = b;
      });
    });
    if (p.dbias != nullptr) {
      if (empty) std::fill(p.workspace, p.workspace + q.batches * groups * n, 0.0f);
      sum_groups<D>(p.workspace, static_cast<T*>(p.dbias), q.batches, groups, n, pool);
    }
    finish(q, keys, task_batch);
  });
}

}  // namespace

void act_lu_quantized(const ActLuProblem& p, ffi::ThreadPool* pool) {
  switch (p.dtype) {
    case DType::F32: act_lu_generic<F32>(p, pool); break;
    case DType::BF16: act_lu_generic<BF16>(p, pool); break;
    case DType::F16: act_lu_generic<F16>(p, pool); break;
  }
}

void dact_dbias_quantized(const DActProblem& p, ffi::ThreadPool* pool) {
  switch (p.dtype) {
    case DType::F32: dact_generic<F32>(p, pool); break;
    case DType::BF16: dact_generic<BF16>(p, pool); break;
    case DType::F16: dact_generic<F16>(p, pool); break;
  }
}

}  // namespace te_jax::cpu
