// CPU generic path: the scaled modes of te_jax_act_lu / te_jax_quantize /
// te_jax_dact_dbias_quantize, and the amax passes (te_jax_act_amax, te_jax_dact_dbias_amax).
// Layouts and formulas: activation/problem.h and docs/numerics.md §4-§5.
//
// The output y [M, N] (N = act_len * H) is produced in tiles of kTileRows rows x kTileCols
// columns of each half (one row x kRowCols columns when no colwise layout is wanted; see
// Tasks): the activation (or its gradient) is computed in float32 by the same loops as the
// NO_SCALING path, rounded to x's dtype, kept in the tile, and then emitted:
//   amax    max|y| of the tile, as the integer max of |y|'s bits (NaN above inf; exact,
//           order-independent), reduced per batch at the end;
//   tensor  codes = fmt(y * scale[batch]), written row by row, and/or transposed per batch;
//   MXFP8   per 32-element block (along a row, or down a column of the tile: tiles start at
//           multiples of 32 rows) the E8M0 exponent of amax_b / Q, codes = fmt(y * 2^-e);
//   NVFP4   per 16-element block, an E4M3 block scale from amax_b and the global scale S, codes
//           E2M1 packed two per byte along the row.
// The codes are encode.h's (formats.h's bits, in loops that vectorise), from one float multiply
// by the scale wherever that gives the codes of formats.h's exact products (which the rare other
// scales still use).
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

#include "activation/activations.h"
#include "activation/cpu/encode.h"
#include "activation/cpu/kernels.h"
#include "activation/cpu/loops.h"
#include "activation/cpu/transpose.h"
#include "activation/problem.h"
#include "common/formats.h"
#include "cpu/parallel.h"

namespace te_jax::cpu {
namespace {

namespace ffi = ::xla::ffi;
using namespace loops;

// Tile shapes (multiples of kVec and of both block sizes). A whole tile is kTileRows x kTileCols;
// without a colwise layout a unit is one row of kRowCols columns (see Tasks). Wide whole tiles
// make longer runs along each of their 32 rows, which made the colwise layouts faster than
// 256-column tiles, while 1024-column row units were slower than 256-column ones.
constexpr int64_t kTileRows = 32;    // one MXFP8 colwise block, two NVFP4 ones
constexpr int64_t kTileCols = 1024;  // the tile buffer's width
constexpr int64_t kRowCols = 256;

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

// out[i] = the low byte of v[i], i < n: the loops computing per-block values keep them on
// 32-bit lanes (a byte store in the loop makes GCC narrow them; see encode.h).
TE_HOST_INLINE void store_bytes(const uint32_t* __restrict v, uint8_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(v[i]);
}

// key[k] = the max |y| key (F32::abs_key) of block k, the kBlock values v[kBlock * k ...], for
// k < blocks.
template <int kBlock>
TE_JAX_LOOP void block_max_keys(const float* __restrict v, int64_t blocks, int32_t* __restrict key) {
  for (int64_t k = 0; k < blocks; ++k) {
    int32_t m = 0;
    for (int i = 0; i < kBlock; ++i) m = std::max(m, F32::abs_key(v[kBlock * k + i]));
    key[k] = m;
  }
}

// MXFP8 block code of y in a block with exponent e and amax, exactly (the fallback of the loops
// below, for the exponents where enc::mxfp8_plain_exponent is false): a NaN block (scale 0xFF)
// has NaN codes.
template <typename Fmt>
TE_HOST_INLINE uint8_t mxfp8_code_exact(float y, int e, float amax) {
  return Fmt::encode(amax != amax ? amax : fmt::mul_pow2(y, -e));
}

// MXFP8 along a row: n / 32 blocks (n <= kTileCols); scales[k] = biased exponent of block k.
// In passes over the row (block maxima, exponents, codes), so that each is a plain loop: the
// codes are one multiply by 2^-e, and the (rare) blocks where that is not exact are redone.
// The exponents are computed for whole chunks of blocks (the maxima are 0 past the last one), a
// fixed trip count: over a row unit's 8 blocks (NVFP4: 16) GCC 12 ran the loop with a variable
// trip count in scalar code.
template <typename Fmt>
TE_JAX_LOOP void mxfp8_row(const float* __restrict v, uint8_t* __restrict out,
                           uint8_t* __restrict scales, int64_t n) {
  constexpr int kMaxBlocks = kTileCols / 32, kChunk = 8;
  const int64_t blocks = n / 32;
  int32_t key[kMaxBlocks] = {};
  block_max_keys<32>(v, blocks, key);
  int e[kMaxBlocks];
  uint32_t biased[kMaxBlocks];
  float mult[kMaxBlocks];  // 2^-e[k] (1 where the block is redone)
  for (int64_t k0 = 0; k0 < blocks; k0 += kChunk) {
    for (int64_t k = k0; k < k0 + kChunk; ++k) {
      e[k] = fmt::e8m0_exponent(F32::key_value(key[k]), Fmt::kMax);
      biased[k] = static_cast<uint32_t>(e[k] + 127);  // fmt::e8m0_biased
      mult[k] = enc::pow2_neg(enc::mxfp8_plain_exponent(e[k]) ? e[k] : 0);
    }
  }
  store_bytes(biased, scales, blocks);
  int exact = 0;  // blocks to redo
  for (int64_t k = 0; k < blocks; ++k) exact += enc::mxfp8_plain_exponent(e[k]) ? 0 : 1;
  for (int64_t k = 0; k < blocks; ++k) {
    for (int i = 0; i < 32; ++i) {
      out[32 * k + i] = static_cast<uint8_t>(enc::Codes<Fmt>::of(v[32 * k + i] * mult[k]));
    }
  }
  if (exact == 0) return;
  for (int64_t k = 0; k < blocks; ++k) {
    if (enc::mxfp8_plain_exponent(e[k])) continue;
    const float amax = F32::key_value(key[k]);
    for (int i = 0; i < 32; ++i) out[32 * k + i] = mxfp8_code_exact<Fmt>(v[32 * k + i], e[k], amax);
  }
}

// MXFP8 down the 32 rows of a tile: one block per column j < n. Every column is encoded with
// one multiply by 2^-e; the (rare) columns where that is not exact are then redone.
template <typename Fmt>
TE_JAX_LOOP void mxfp8_cols(const float (*__restrict v)[kTileCols],
                            uint8_t (*__restrict out)[kTileCols], uint8_t* __restrict scales,
                            int64_t n) {
  int32_t key[kTileCols] = {};
  for (int i = 0; i < 32; ++i)
    for (int64_t j = 0; j < n; ++j) key[j] = std::max(key[j], F32::abs_key(v[i][j]));
  int e[kTileCols];
  uint32_t biased[kTileCols];
  float mult[kTileCols];  // 2^-e[j] (1 where the column is redone)
  int exact = 0;          // columns to redo
  for (int64_t j = 0; j < n; ++j) {
    e[j] = fmt::e8m0_exponent(F32::key_value(key[j]), Fmt::kMax);
    biased[j] = static_cast<uint32_t>(e[j] + 127);  // fmt::e8m0_biased
    const bool plain = enc::mxfp8_plain_exponent(e[j]);
    mult[j] = enc::pow2_neg(plain ? e[j] : 0);
    exact += plain ? 0 : 1;
  }
  store_bytes(biased, scales, n);
  for (int i = 0; i < 32; ++i)
    for (int64_t j = 0; j < n; ++j) {
      out[i][j] = static_cast<uint8_t>(enc::Codes<Fmt>::of(v[i][j] * mult[j]));
    }
  if (exact == 0) return;
  for (int64_t j = 0; j < n; ++j) {
    if (enc::mxfp8_plain_exponent(e[j])) continue;
    const float amax = F32::key_value(key[j]);
    for (int i = 0; i < 32; ++i) out[i][j] = mxfp8_code_exact<Fmt>(v[i][j], e[j], amax);
  }
}

// E2M1 code of y in a block whose E4M3 block scale decodes to bs (0 where bs is 0).
// kPlain (enc::plain_tensor_scale(s)): y * s has the codes of fmt::mul_exact(y, s) also after the
// division, since bs >= 2^-9 keeps a product under 2^-26 under 2^-17, far below E2M1's 0.25.
template <bool kPlain>
TE_HOST_INLINE uint32_t nvfp4_code(float y, float s, float bs) {
  const uint32_t c = enc::e2m1(enc::scaled<kPlain>(y, s) / bs);
  return bs == 0.0f ? 0u : c;
}

// out[j] = codes[2j] | codes[2j + 1] << 4 for j < n / 2: E2M1 codes two per byte, the first in
// the low nibble (fmt::pack_e2m1). The codes are kept on 32-bit lanes until here (see encode.h).
TE_HOST_INLINE void pack_e2m1(const uint32_t* __restrict codes, uint8_t* __restrict out,
                              int64_t n) {
  for (int64_t j = 0; j < n / 2; ++j) {
    out[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
  }
}

// NVFP4 along a row: n / 16 blocks (n <= kTileCols), codes packed two per byte into out[n / 2].
// In passes over the row (block maxima, block scales, codes, packing), each a plain loop.
template <bool kPlain>
TE_JAX_LOOP void nvfp4_row(const float* __restrict v, uint8_t* __restrict out,
                           uint8_t* __restrict scales, int64_t n, float s) {
  constexpr int kMaxBlocks = kTileCols / 16, kChunk = 16;
  const int64_t blocks = n / 16;
  int32_t key[kMaxBlocks] = {};
  block_max_keys<16>(v, blocks, key);
  uint32_t sc[kMaxBlocks];
  float bs[kMaxBlocks];
  for (int64_t k0 = 0; k0 < blocks; k0 += kChunk) {
    for (int64_t k = k0; k < k0 + kChunk; ++k) {
      sc[k] = enc::nvfp4_block_scale<kPlain>(F32::key_value(key[k]), s);
      bs[k] = fmt::from_e4m3(static_cast<uint8_t>(sc[k]));
    }
  }
  store_bytes(sc, scales, blocks);
  uint32_t codes[kTileCols];
  for (int64_t k = 0; k < blocks; ++k) {
    for (int i = 0; i < 16; ++i) codes[16 * k + i] = nvfp4_code<kPlain>(v[16 * k + i], s, bs[k]);
  }
  pack_e2m1(codes, out, 16 * blocks);
}

// NVFP4 down 16 rows of a tile: one block per column j < n; codes packed along the rows' columns
// into out[i][j / 2].
template <bool kPlain>
TE_JAX_LOOP void nvfp4_cols(const float (*__restrict v)[kTileCols],
                            uint8_t (*__restrict out)[kTileCols], uint8_t* __restrict scales,
                            int64_t n, float s) {
  int32_t key[kTileCols] = {};
  for (int i = 0; i < 16; ++i)
    for (int64_t j = 0; j < n; ++j) key[j] = std::max(key[j], F32::abs_key(v[i][j]));
  uint32_t sc[kTileCols];
  float bs[kTileCols];
  for (int64_t j = 0; j < n; ++j) {
    sc[j] = enc::nvfp4_block_scale<kPlain>(F32::key_value(key[j]), s);
    bs[j] = fmt::from_e4m3(static_cast<uint8_t>(sc[j]));
  }
  store_bytes(sc, scales, n);
  uint32_t codes[kTileCols];
  for (int i = 0; i < 16; ++i) {
    for (int64_t j = 0; j < n; ++j) codes[j] = nvfp4_code<kPlain>(v[i][j], s, bs[j]);
    pack_e2m1(codes, out[i], n);
  }
}

// ---- producing a tile -----------------------------------------------------------------------

// The geometry of one call: y is [m, act_len * h], batches of m / batches rows, produced in whole
// tiles (a colwise layout is wanted) or in row units (see Tasks).
struct Geometry {
  int64_t m, h, act_len, batches;
  bool whole_tiles;
  int64_t n() const { return act_len * h; }
  int64_t rows_per_batch() const { return m / batches; }
  int64_t row_tiles() const { return ceil_div(rows_per_batch(), kTileRows); }
  int64_t cols() const { return whole_tiles ? kTileCols : kRowCols; }  // per column tile
  int64_t col_tiles() const { return ceil_div(h, cols()); }
  // The rows [r, r + rows) of batch b (cut at the batch's end) x column tile ct.
  void place(Tile& t, int64_t b, int64_t r, int64_t rows, int64_t ct) const {
    t.batch = b;
    t.r0 = b * rows_per_batch() + r;
    t.nr = std::min(rows, rows_per_batch() - r);
    t.c0 = ct * cols();
    t.nc = std::min(cols(), h - t.c0);
  }
};

// A call's tasks: task (batch b, row group grp, column block cb) owns the row tiles
// [grp * rt / groups, (grp + 1) * rt / groups) of batch b and the column tiles
// [cb * cpt, (cb + 1) * cpt), and visits them row by row. With a colwise layout a unit is a whole
// tile (a colwise block spans its rows) and a task one column tile. Without one, a unit is one
// row of kRowCols columns, and a task all columns where there are enough tasks without
// splitting them: its inputs are read and its outputs written along rows. 32-row tiles made a
// rowwise-only call slower: a tile's rows are ~100 short streams at once, which the hardware
// prefetchers do not follow. Either way each column's rows are added to dbias in row
// order, and the groups keep their tile boundaries: the bits do not change.
struct Tasks {
  int64_t batches, groups, rt, ct;
  bool whole_tiles;
  int64_t cpt = 1, col_blocks = 1;  // column tiles per task, column blocks

  Tasks(const Geometry& g, int64_t groups_, ffi::ThreadPool* pool)
      : batches(g.batches), groups(groups_), rt(g.row_tiles()), ct(g.col_tiles()),
        whole_tiles(g.whole_tiles) {
    cpt = whole_tiles ? 1 : ct;
    const int64_t rows_tasks = batches * groups, want = 2 * num_workers(pool);
    if (!whole_tiles && rows_tasks < want && ct > 1) {
      cpt = ceil_div(ct, std::min(ct, ceil_div(want, rows_tasks)));
    }
    col_blocks = ct > 0 ? ceil_div(ct, cpt) : 0;
  }
  int64_t count(bool empty) const { return empty ? 0 : batches * groups * col_blocks; }
  int64_t batch(int64_t task) const { return task / (groups * col_blocks); }
  // The columns of task's column block: [c0, c1).
  void columns(int64_t task, const Geometry& g, int64_t& c0, int64_t& c1) const {
    const int64_t cb = task % col_blocks;
    c0 = cb * cpt * g.cols();
    c1 = std::min(g.h, (cb + 1) * cpt * g.cols());
  }
  // Calls fn(t) with t placed on each unit of the task, in order.
  template <typename Fn>
  void visit(int64_t task, const Geometry& g, Tile& t, Fn&& fn) const {
    const int64_t b = batch(task), grp = (task / col_blocks) % groups, cb = task % col_blocks;
    const int64_t r0 = grp * rt / groups * kTileRows;
    const int64_t r1 = std::min(g.rows_per_batch(), (grp + 1) * rt / groups * kTileRows);
    const int64_t c_end = std::min(ct, (cb + 1) * cpt);
    const int64_t step = whole_tiles ? kTileRows : 1;
    for (int64_t r = r0; r < r1; r += step) {
      for (int64_t c = cb * cpt; c < c_end; ++c) {
        g.place(t, b, r, step, c);
        fn(t);
      }
    }
  }
};

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
    switch (q.emit) {
      case QuantEmit::TENSOR: tensor(t, L, n); break;
      case QuantEmit::MXFP8: mxfp8(t, L, n); break;
      case QuantEmit::NVFP4: nvfp4(t, L, n); break;
      case QuantEmit::AMAX_PASS:
      case QuantEmit::FP8_BLOCK: break;  // fp8_block.cc's
    }
    return key;
  }

  void tensor(Tile& t, int64_t L, int64_t n) const {
    const float s = q.tensor_scale(t.batch);
    for (int l = 0; l < L; ++l) {
      for (int64_t i = 0; i < t.nr; ++i) {
        if (q.data != nullptr) {
          enc::encode_scaled<Fmt>(t.v[l][i], q.data + (t.r0 + i) * n + l * g.h + t.c0, t.nc, s);
        }
        if (q.colwise != nullptr) enc::encode_scaled<Fmt>(t.v[l][i], t.codes[l][i], t.nc, s);
      }
    }
    if (q.colwise == nullptr) return;
    // Batch b's transpose: colwise[b][col][row - b * rows_per_batch].
    const int64_t mb = g.rows_per_batch();
    uint8_t* base = q.colwise + t.batch * n * mb + (t.r0 - t.batch * mb);
    for (int l = 0; l < L; ++l) {
      transpose::bytes(t.codes[l][0], kTileCols, base + (l * g.h + t.c0) * mb, mb, t.nr, t.nc);
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
    if (enc::plain_tensor_scale(s)) {
      nvfp4_scaled<true>(t, L, n, s);
    } else {
      nvfp4_scaled<false>(t, L, n, s);
    }
  }

  template <bool kPlain>
  void nvfp4_scaled(Tile& t, int64_t L, int64_t n, float s) const {
    for (int l = 0; l < L; ++l) {
      const int64_t col = l * g.h + t.c0;
      if (q.data != nullptr) {
        for (int64_t i = 0; i < t.nr; ++i) {
          const int64_t r = t.r0 + i;
          nvfp4_row<kPlain>(t.v[l][i], q.data + (r * n + col) / 2,
                            q.block_scale + r * (n / 16) + col / 16, t.nc, s);
        }
      }
      if (q.colwise != nullptr) {  // t.nr is 16 or 32: rows per batch are a multiple of 16
        for (int64_t i0 = 0; i0 < t.nr; i0 += 16) {
          nvfp4_cols<kPlain>(t.v[l] + i0, t.codes[l] + i0,
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

// Row groups per batch where the call is free to choose them (no dbias workspace): one per row
// tile, except for the transposed layout (tensor scaling, colwise), where a task goes down up to
// 16 row tiles of its column tile while there are at least 2 tasks per worker. Its 32-row tiles
// each write half a cache line of every output column; a task that also writes the other half
// finds the line still in cache, and its output is one 256-column block of colwise rows.
int64_t row_groups(const Geometry& g, const QuantOutput& q, ffi::ThreadPool* pool) {
  const int64_t rt = g.row_tiles();
  const bool transposed = q.colwise != nullptr && q.emit == QuantEmit::TENSOR;
  if (!transposed) return rt;
  const int64_t want = 2 * num_workers(pool);
  int64_t per_group = std::min<int64_t>(16, rt);
  while (per_group > 1 && g.batches * ceil_div(rt, per_group) * g.col_tiles() < want) {
    per_group /= 2;
  }
  return ceil_div(rt, std::max<int64_t>(1, per_group));
}

template <typename D>
void act_lu_generic(const ActLuProblem& p, ffi::ThreadPool* pool) {
  using T = typename D::T;
  const QuantOutput& q = p.q;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    const Geometry g{p.rows, p.hidden, 1, q.batches, q.colwise != nullptr};
    const Tasks tk(g, row_groups(g, q, pool), pool);
    const int64_t tasks = tk.count(p.rows == 0 || p.hidden == 0);
    std::vector<int32_t> keys(tasks, 0);
    std::vector<int64_t> task_batch(tasks, 0);
    with_emitter(q, g, [&](auto emit) {
      parallel_chunks(pool, tasks, [&](int64_t task) {
        int32_t key = 0;
        tk.visit(task, g, thread_tile(), [&](Tile& t) {
          produce_forward<Spec, D>(static_cast<const T*>(p.x), g, p.params, t);
          key = std::max(key, emit(t));
        });
        keys[task] = key;
        task_batch[task] = tk.batch(task);
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
    const Geometry g{p.rows, p.hidden, Spec::kActLen, q.batches, q.colwise != nullptr};
    const int64_t n = g.n();
    const T* dz = static_cast<const T*>(p.dz);
    const T* x = static_cast<const T*>(p.x);
    const bool empty = p.rows == 0 || p.hidden == 0;
    // With dbias, the workspace's row groups.
    const int64_t groups = p.dbias != nullptr ? p.groups : row_groups(g, q, pool);
    const Tasks tk(g, groups, pool);
    const int64_t tasks = tk.count(empty);
    std::vector<int32_t> keys(tasks, 0);
    std::vector<int64_t> task_batch(tasks, 0);
    with_emitter(q, g, [&](auto emit) {
      parallel_chunks(pool, tasks, [&](int64_t task) {
        float* part = nullptr;
        if (p.dbias != nullptr) {
          // Workspace row (batch, group) of this task; zero its columns first.
          part = p.workspace + (task / tk.col_blocks) * n;
          int64_t c0, c1;
          tk.columns(task, g, c0, c1);
          for (int l = 0; l < Spec::kActLen; ++l) {
            std::fill(part + l * p.hidden + c0, part + l * p.hidden + c1, 0.0f);
          }
        }
        int32_t key = 0;
        tk.visit(task, g, thread_tile(), [&](Tile& t) {
          produce_backward<Spec, D>(dz, x, g, p.params, part, t);
          key = std::max(key, emit(t));
        });
        keys[task] = key;
        task_batch[task] = tk.batch(task);
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
  if (p.q.emit == QuantEmit::FP8_BLOCK) return act_lu_fp8_block(p, pool);
  switch (p.dtype) {
    case DType::F32: act_lu_generic<F32>(p, pool); break;
    case DType::BF16: act_lu_generic<BF16>(p, pool); break;
    case DType::F16: act_lu_generic<F16>(p, pool); break;
  }
}

void dact_dbias_quantized(const DActProblem& p, ffi::ThreadPool* pool) {
  if (p.q.emit == QuantEmit::FP8_BLOCK) return dact_dbias_fp8_block(p, pool);
  switch (p.dtype) {
    case DType::F32: dact_generic<F32>(p, pool); break;
    case DType::BF16: dact_generic<BF16>(p, pool); break;
    case DType::F16: dact_generic<F16>(p, pool); break;
  }
}

}  // namespace te_jax::cpu
