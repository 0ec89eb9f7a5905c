// CPU loops of te_jax_act_lu and te_jax_dact_dbias_quantize (NO_SCALING).
//
// Structure: the runtime enum is mapped once per call to a compile-time ActivationSpec
// (with_activation), the dtype to a storage type and "amax requested" to a bool; the hot loops
// below are plain loops over contiguous rows that call act_forward / act_backward (always
// inlined), load and store bfloat16 / float16 with integer bit manipulation, and so vectorise.
// Each hot loop is compiled for several x86-64 levels (GCC function multiversioning; the best
// one is picked once, at load time) since wheels are built for the baseline ISA. Work is split
// over the FFI thread pool in chunks of rows (parallel.h); dbias uses one task per
// (batch, row group), fixed by the workspace shape, so its bits never depend on the threads.
#include "activation/cpu/kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "activation/activations.h"
#include "activation/cpu/loops.h"
#include "common/host_math.h"
#include "common/macros.h"
#include "cpu/parallel.h"

namespace te_jax::cpu {
namespace {

namespace ffi = ::xla::ffi;
using namespace loops;

// ---- hot loops ---------------------------------------------------------------------------
// Plain loops over contiguous elements, compiled for each x86-64 level. They only ever run on a
// multiple of kVec elements (per row), written as blocks of exactly kVec, so the compiler emits
// vector code with no remainder loop. The rest of a row (its "tail") is gathered into
// zero-padded buffers and run through the *_raw loops below, again on a multiple of kVec. So
// every element is computed by vector code, whatever its position: the compiler's choices about
// contracting a*b+c into an FMA (which can differ between a loop's vector body and a scalar
// remainder) cannot make the result depend on where an element sits in a row or a chunk.
//
// Each main loop returns the max abs_key of what it stored. ActParams is taken by value so that
// the compiler knows the stores cannot change it.

// Non-gated forward over n contiguous elements (n % kVec == 0).
template <typename Spec, typename D, bool kAmax>
TE_JAX_LOOP int32_t fwd_flat(const typename D::T* __restrict x,
                             typename D::T* __restrict y, int64_t n, ActParams p) {
  int32_t key = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kVec) {
    for (int64_t i = i0; i < i0 + kVec; ++i) {
      const typename D::T o = D::store(act_forward<Spec>(D::load(x[i]), 0.0f, p));
      y[i] = o;
      if constexpr (kAmax) key = std::max(key, D::abs_key(o));
    }
  }
  return key;
}

// Gated forward over `rows` rows of x [rows, 2, h] -> y [rows, h], columns [c0, c1)
// ((c1 - c0) % kVec == 0).
template <typename Spec, typename D, bool kAmax>
TE_JAX_LOOP int32_t fwd_gated(const typename D::T* __restrict x,
                              typename D::T* __restrict y, int64_t rows, int64_t h,
                              int64_t c0, int64_t c1, ActParams p) {
  int32_t key = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const typename D::T* __restrict a = x + r * 2 * h;
    const typename D::T* __restrict b = a + h;
    typename D::T* __restrict o = y + r * h;
    for (int64_t j0 = c0; j0 < c1; j0 += kVec) {
      for (int64_t j = j0; j < j0 + kVec; ++j) {
        const typename D::T v = D::store(act_forward<Spec>(D::load(a[j]), D::load(b[j]), p));
        o[j] = v;
        if constexpr (kAmax) key = std::max(key, D::abs_key(v));
      }
    }
  }
  return key;
}

// Non-gated backward over n contiguous elements (n % kVec == 0).
template <typename Spec, typename D, bool kAmax>
TE_JAX_LOOP int32_t bwd_flat(const typename D::T* __restrict dz,
                             const typename D::T* __restrict x,
                             typename D::T* __restrict dx, int64_t n, ActParams p) {
  int32_t key = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kVec) {
    for (int64_t i = i0; i < i0 + kVec; ++i) {
      float da, db;
      act_backward<Spec>(D::load(dz[i]), D::load(x[i]), 0.0f, p, da, db);
      const typename D::T o = D::store(da);
      dx[i] = o;
      if constexpr (kAmax) key = std::max(key, D::abs_key(o));
    }
  }
  return key;
}

// Gated backward over `rows` rows (dz [rows, h], x and dx [rows, 2, h]), columns [c0, c1)
// ((c1 - c0) % kVec == 0).
template <typename Spec, typename D, bool kAmax>
TE_JAX_LOOP int32_t bwd_gated(const typename D::T* __restrict dz,
                              const typename D::T* __restrict x,
                              typename D::T* __restrict dx, int64_t rows, int64_t h,
                              int64_t c0, int64_t c1, ActParams p) {
  int32_t key = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const typename D::T* __restrict g = dz + r * h;
    const typename D::T* __restrict a = x + r * 2 * h;
    const typename D::T* __restrict b = a + h;
    typename D::T* __restrict da_out = dx + r * 2 * h;
    typename D::T* __restrict db_out = da_out + h;
    for (int64_t j0 = c0; j0 < c1; j0 += kVec) {
      for (int64_t j = j0; j < j0 + kVec; ++j) {
        float da, db;
        act_backward<Spec>(D::load(g[j]), D::load(a[j]), D::load(b[j]), p, da, db);
        const typename D::T oa = D::store(da);
        const typename D::T ob = D::store(db);
        da_out[j] = oa;
        db_out[j] = ob;
        if constexpr (kAmax) key = std::max(key, std::max(D::abs_key(oa), D::abs_key(ob)));
      }
    }
  }
  return key;
}

// Backward with dbias partial sums: like bwd_flat / bwd_gated over `rows` rows of width h,
// columns [c0, c1) ((c1 - c0) % kVec == 0), and ws[j] += dA (gated: also ws[h + j] += dB), the
// unrounded float32 values, row after row.
template <typename Spec, typename D, bool kAmax>
TE_JAX_LOOP int32_t bwd_dbias(const typename D::T* __restrict dz,
                              const typename D::T* __restrict x,
                              typename D::T* __restrict dx, float* __restrict ws,
                              int64_t rows, int64_t h, int64_t c0, int64_t c1,
                              ActParams p) {
  constexpr int64_t L = Spec::kActLen;
  int32_t key = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const typename D::T* __restrict g = dz + r * h;
    const typename D::T* __restrict a = x + r * L * h;
    typename D::T* __restrict da_out = dx + r * L * h;
    if constexpr (Spec::kGated) {
      const typename D::T* __restrict b = a + h;
      typename D::T* __restrict db_out = da_out + h;
      float* __restrict ws_b = ws + h;
      for (int64_t j0 = c0; j0 < c1; j0 += kVec) {
        for (int64_t j = j0; j < j0 + kVec; ++j) {
          float da, db;
          act_backward<Spec>(D::load(g[j]), D::load(a[j]), D::load(b[j]), p, da, db);
          const typename D::T oa = D::store(da);
          const typename D::T ob = D::store(db);
          da_out[j] = oa;
          db_out[j] = ob;
          ws[j] += da;
          ws_b[j] += db;
          if constexpr (kAmax) key = std::max(key, std::max(D::abs_key(oa), D::abs_key(ob)));
        }
      }
    } else {
      for (int64_t j0 = c0; j0 < c1; j0 += kVec) {
        for (int64_t j = j0; j < j0 + kVec; ++j) {
          float da, db;
          act_backward<Spec>(D::load(g[j]), D::load(a[j]), 0.0f, p, da, db);
          const typename D::T o = D::store(da);
          da_out[j] = o;
          ws[j] += da;
          if constexpr (kAmax) key = std::max(key, D::abs_key(o));
        }
      }
    }
  }
  return key;
}

// ---- row tails -----------------------------------------------------------------------------
// The columns [t0, t1) (t1 - t0 < kVec) of `rows` consecutive rows, gathered row after row into
// zero-padded buffers, computed by the *_raw loops, and scattered back (rounded) in the same
// order, so dbias partial sums still add each column's rows in row order.

constexpr int64_t kTailBuf = 256;  // a multiple of kVec, and > any tail

// Strided view of a [rows, act_len, h] operand: element (r, j) of half k is at
// base[r * row_stride + k * h + j].
template <typename T>
struct Rows {
  T* base;
  int64_t row_stride;
  int64_t h;
  T* at(int64_t r, int k, int64_t j) const { return base + r * row_stride + k * h + j; }
};

template <typename Spec, typename D>
int32_t fwd_tail(Rows<const typename D::T> x, Rows<typename D::T> y, int64_t rows, int64_t t0,
                 int64_t t1, const ActParams& p) {
  using T = typename D::T;
  const int64_t w = t1 - t0;
  if (w <= 0 || rows <= 0) return 0;
  const int64_t per = kTailBuf / w;  // rows per buffer
  T a[kTailBuf] = {}, b[kTailBuf] = {};
  float f[kTailBuf];
  int32_t key = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    const int64_t nr = std::min(per, rows - r0);
    int64_t k = 0;
    for (int64_t r = r0; r < r0 + nr; ++r) {
      for (int64_t j = t0; j < t1; ++j, ++k) {
        a[k] = *x.at(r, 0, j);
        b[k] = Spec::kGated ? *x.at(r, 1, j) : T{};
      }
    }
    const int64_t padded = round_up_vec(k);
    for (int64_t i = k; i < padded; ++i) a[i] = b[i] = T{};
    fwd_raw<Spec, D>(a, b, f, padded, p);
    k = 0;
    for (int64_t r = r0; r < r0 + nr; ++r) {
      for (int64_t j = t0; j < t1; ++j, ++k) {
        const T o = D::store(f[k]);
        *y.at(r, 0, j) = o;
        key = std::max(key, D::abs_key(o));
      }
    }
  }
  return key;
}

// ws: the partial sums of these rows' columns (ws[j], gated also ws[h + j]), or nullptr.
template <typename Spec, typename D>
int32_t bwd_tail(Rows<const typename D::T> dz, Rows<const typename D::T> x,
                 Rows<typename D::T> dx, float* ws, int64_t rows, int64_t t0, int64_t t1,
                 const ActParams& p) {
  using T = typename D::T;
  const int64_t w = t1 - t0;
  if (w <= 0 || rows <= 0) return 0;
  const int64_t per = kTailBuf / w;
  T g[kTailBuf] = {}, a[kTailBuf] = {}, b[kTailBuf] = {};
  float da[kTailBuf], db[kTailBuf];
  int32_t key = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += per) {
    const int64_t nr = std::min(per, rows - r0);
    int64_t k = 0;
    for (int64_t r = r0; r < r0 + nr; ++r) {
      for (int64_t j = t0; j < t1; ++j, ++k) {
        g[k] = *dz.at(r, 0, j);
        a[k] = *x.at(r, 0, j);
        b[k] = Spec::kGated ? *x.at(r, 1, j) : T{};
      }
    }
    const int64_t padded = round_up_vec(k);
    for (int64_t i = k; i < padded; ++i) g[i] = a[i] = b[i] = T{};
    bwd_raw<Spec, D>(g, a, b, da, db, padded, p);
    k = 0;
    for (int64_t r = r0; r < r0 + nr; ++r) {
      for (int64_t j = t0; j < t1; ++j, ++k) {
        const T oa = D::store(da[k]);
        *dx.at(r, 0, j) = oa;
        key = std::max(key, D::abs_key(oa));
        if (ws != nullptr) ws[j] += da[k];
        if constexpr (Spec::kGated) {
          const T ob = D::store(db[k]);
          *dx.at(r, 1, j) = ob;
          key = std::max(key, D::abs_key(ob));
          if (ws != nullptr) ws[dx.h + j] += db[k];
        }
      }
    }
  }
  return key;
}

// ---- one tile: main loops + tails ----------------------------------------------------------

// Forward of rows [0, rows) x columns [c0, c1) of x / y (already offset to the tile's first row).
// The max abs_key of the outputs when kAmax (the tails compute it anyway; it costs nothing there).
template <typename Spec, typename D, bool kAmax>
int32_t fwd_tile(const typename D::T* x, typename D::T* y, int64_t rows, int64_t h, int64_t c0,
                 int64_t c1, const ActParams& p) {
  using T = typename D::T;
  const int64_t main_end = c0 + (c1 - c0) / kVec * kVec;
  int32_t key = 0;
  if constexpr (Spec::kGated) {
    if (main_end > c0) key = fwd_gated<Spec, D, kAmax>(x, y, rows, h, c0, main_end, p);
    key = std::max(key, fwd_tail<Spec, D>(Rows<const T>{x, 2 * h, h}, Rows<T>{y, h, h}, rows,
                                          main_end, c1, p));
  } else {
    // Non-gated tiles are flat: rows == 1, [c0, c1) indexes the flat array.
    if (main_end > c0) key = fwd_flat<Spec, D, kAmax>(x + c0, y + c0, main_end - c0, p);
    key = std::max(key, fwd_tail<Spec, D>(Rows<const T>{x, 0, 0}, Rows<T>{y, 0, 0}, 1, main_end,
                                          c1, p));
  }
  return key;
}

// Backward of rows [0, rows) x columns [c0, c1); ws (may be nullptr) as in bwd_dbias.
template <typename Spec, typename D, bool kAmax>
int32_t bwd_tile(const typename D::T* dz, const typename D::T* x, typename D::T* dx, float* ws,
                 int64_t rows, int64_t h, int64_t c0, int64_t c1, const ActParams& p) {
  using T = typename D::T;
  constexpr int64_t L = Spec::kActLen;
  const int64_t main_end = c0 + (c1 - c0) / kVec * kVec;
  int32_t key = 0;
  if (main_end > c0) {
    if (ws != nullptr) {
      key = bwd_dbias<Spec, D, kAmax>(dz, x, dx, ws, rows, h, c0, main_end, p);
    } else if constexpr (Spec::kGated) {
      key = bwd_gated<Spec, D, kAmax>(dz, x, dx, rows, h, c0, main_end, p);
    } else {
      key = bwd_flat<Spec, D, kAmax>(dz + c0, x + c0, dx + c0, main_end - c0, p);
    }
  }
  key = std::max(key, bwd_tail<Spec, D>(Rows<const T>{dz, h, h}, Rows<const T>{x, L * h, h},
                                        Rows<T>{dx, L * h, h}, ws, rows, main_end, c1, p));
  return key;
}

// ---- work splitting ------------------------------------------------------------------------

// Elements (outputs of act_lu, dz elements of dact) per parallel chunk: large enough that the
// per-chunk overhead (one atomic increment) vanishes, small enough to balance the threads.
constexpr int64_t kChunkElems = 32 * 1024;
// Column blocks are multiples of this many elements (whole vector blocks; >= 64 bytes).
constexpr int64_t kColAlign = kVec;

// A [rows, h] iteration space cut into tiles of whole rows, or of column blocks of one row when a
// row alone is bigger than a chunk.
struct Tiling {
  int64_t rows_per_tile = 1;
  int64_t cols_per_tile = 0;
  int64_t col_tiles = 1;
  int64_t tiles = 0;

  Tiling(int64_t rows, int64_t h) {
    if (rows == 0 || h == 0) return;
    if (h >= kChunkElems) {
      cols_per_tile = round_up(kChunkElems, kColAlign);
      col_tiles = ceil_div(h, cols_per_tile);
      rows_per_tile = 1;
    } else {
      cols_per_tile = h;
      col_tiles = 1;
      rows_per_tile = std::max<int64_t>(1, kChunkElems / h);
    }
    tiles = ceil_div(rows, rows_per_tile) * col_tiles;
  }
  // Tile t covers rows [r0, r1) and columns [c0, c1).
  void bounds(int64_t t, int64_t rows, int64_t h, int64_t& r0, int64_t& r1, int64_t& c0,
              int64_t& c1) const {
    const int64_t rt = t / col_tiles, ct = t % col_tiles;
    r0 = rt * rows_per_tile;
    r1 = std::min(rows, r0 + rows_per_tile);
    c0 = ct * cols_per_tile;
    c1 = std::min(h, c0 + cols_per_tile);
  }
};

// Flat chunks of n elements.
int64_t flat_chunks(int64_t n) { return ceil_div(n, kChunkElems); }

int32_t max_key(const std::vector<int32_t>& keys) {
  int32_t k = 0;
  for (int32_t v : keys) k = std::max(k, v);
  return k;
}

// with_activation, also mapping the runtime "amax requested" flag to a std::bool_constant.
template <typename Fn>
void with_activation_amax(ActivationEnum act, bool amax, Fn&& fn) {
  with_activation(act, [&](auto spec) {
    if (amax) {
      fn(spec, std::true_type{});
    } else {
      fn(spec, std::false_type{});
    }
  });
}

// ---- act_lu --------------------------------------------------------------------------------

template <typename D>
void act_lu_typed(const ActLuProblem& p, ffi::ThreadPool* pool) {
  using T = typename D::T;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int64_t rows = p.rows, h = p.hidden;
  const ActParams params = p.params;
  int32_t key = 0;
  if (rows > 0 && h > 0) {
    with_activation_amax(p.act, p.amax != nullptr, [&](auto spec, auto amax) {
      using Spec = decltype(spec);
      constexpr bool kAmax = decltype(amax)::value;
      if constexpr (Spec::kGated) {
        const Tiling tiling(rows, h);
        std::vector<int32_t> keys(tiling.tiles, 0);
        parallel_chunks(pool, tiling.tiles, [&](int64_t t) {
          int64_t r0, r1, c0, c1;
          tiling.bounds(t, rows, h, r0, r1, c0, c1);
          keys[t] = fwd_tile<Spec, D, kAmax>(x + r0 * 2 * h, y + r0 * h, r1 - r0, h, c0, c1,
                                              params);
        });
        key = max_key(keys);
      } else {
        const int64_t n = rows * h;
        const int64_t chunks = flat_chunks(n);
        std::vector<int32_t> keys(chunks, 0);
        parallel_chunks(pool, chunks, [&](int64_t c) {
          const int64_t i0 = c * kChunkElems, i1 = std::min(n, i0 + kChunkElems);
          keys[c] = fwd_tile<Spec, D, kAmax>(x, y, 1, n, i0, i1, params);
        });
        key = max_key(keys);
      }
    });
  }
  if (p.amax != nullptr) *p.amax = D::key_value(key);
}

// ---- dact_dbias ----------------------------------------------------------------------------

template <typename Spec, typename D, bool kAmax>
int32_t dact_no_dbias(const DActProblem& p, ffi::ThreadPool* pool) {
  using T = typename D::T;
  const T* dz = static_cast<const T*>(p.dz);
  const T* x = static_cast<const T*>(p.x);
  T* dx = static_cast<T*>(p.dx);
  const int64_t rows = p.rows, h = p.hidden;
  const ActParams params = p.params;
  if (rows == 0 || h == 0) return 0;
  if constexpr (Spec::kGated) {
    const Tiling tiling(rows, h);
    std::vector<int32_t> keys(tiling.tiles, 0);
    parallel_chunks(pool, tiling.tiles, [&](int64_t t) {
      int64_t r0, r1, c0, c1;
      tiling.bounds(t, rows, h, r0, r1, c0, c1);
      keys[t] = bwd_tile<Spec, D, kAmax>(dz + r0 * h, x + r0 * 2 * h, dx + r0 * 2 * h, nullptr,
                                         r1 - r0, h, c0, c1, params);
    });
    return max_key(keys);
  } else {
    const int64_t n = rows * h;
    const int64_t chunks = flat_chunks(n);
    std::vector<int32_t> keys(chunks, 0);
    parallel_chunks(pool, chunks, [&](int64_t c) {
      const int64_t i0 = c * kChunkElems, i1 = std::min(n, i0 + kChunkElems);
      keys[c] = bwd_tile<Spec, D, kAmax>(dz, x, dx, nullptr, 1, n, i0, i1, params);
    });
    return max_key(keys);
  }
}

// One task per (batch, row group), each split into column blocks when there are fewer
// (batch, group) pairs than threads; the partial sums do not depend on the split (each column
// is summed over the same rows in the same order), so neither does dbias.
template <typename Spec, typename D, bool kAmax>
int32_t dact_with_dbias(const DActProblem& p, ffi::ThreadPool* pool) {
  using T = typename D::T;
  constexpr int64_t L = Spec::kActLen;
  const T* dz = static_cast<const T*>(p.dz);
  const T* x = static_cast<const T*>(p.x);
  T* dx = static_cast<T*>(p.dx);
  T* dbias = static_cast<T*>(p.dbias);
  float* ws = p.workspace;
  const int64_t h = p.hidden, n = L * h;
  const int64_t batches = p.batches, groups = p.groups;
  const int64_t rows_per_batch = p.rows / batches;
  const ActParams params = p.params;

  const int64_t pairs = batches * groups;
  const int64_t want = 2 * num_workers(pool);
  int64_t col_blocks = 1;
  if (pairs < want && h >= 2 * 256) {
    col_blocks = std::min(ceil_div(want, pairs), h / 256);
  }
  const int64_t cols = round_up(ceil_div(h, col_blocks), kColAlign);
  col_blocks = ceil_div(h, cols);

  const int64_t tasks = pairs * col_blocks;
  std::vector<int32_t> keys(tasks, 0);
  parallel_chunks(pool, tasks, [&](int64_t t) {
    const int64_t pair = t / col_blocks, cb = t % col_blocks;
    const int64_t b = pair / groups, g = pair % groups;
    const int64_t r0 = b * rows_per_batch + g * rows_per_batch / groups;
    const int64_t r1 = b * rows_per_batch + (g + 1) * rows_per_batch / groups;
    const int64_t c0 = cb * cols, c1 = std::min(h, c0 + cols);
    float* part = ws + pair * n;
    for (int64_t j = c0; j < c1; ++j) part[j] = 0.0f;
    if constexpr (Spec::kGated) {
      for (int64_t j = c0; j < c1; ++j) part[h + j] = 0.0f;
    }
    keys[t] = bwd_tile<Spec, D, kAmax>(dz + r0 * h, x + r0 * n, dx + r0 * n, part, r1 - r0, h,
                                       c0, c1, params);
  });

  sum_groups<D>(ws, dbias, batches, groups, n, pool);
  return max_key(keys);
}

template <typename D>
void dact_dbias_typed(const DActProblem& p, ffi::ThreadPool* pool) {
  int32_t key = 0;
  with_activation_amax(p.act, p.amax != nullptr, [&](auto spec, auto amax) {
    using Spec = decltype(spec);
    constexpr bool kAmax = decltype(amax)::value;
    key = p.dbias != nullptr ? dact_with_dbias<Spec, D, kAmax>(p, pool)
                             : dact_no_dbias<Spec, D, kAmax>(p, pool);
  });
  if (p.amax != nullptr) *p.amax = D::key_value(key);
}

}  // namespace

void act_lu(const ActLuProblem& p, ffi::ThreadPool* pool) {
  if (p.quantized) return act_lu_quantized(p, pool);
  switch (p.dtype) {
    case DType::F32: act_lu_typed<F32>(p, pool); break;
    case DType::BF16: act_lu_typed<BF16>(p, pool); break;
    case DType::F16: act_lu_typed<F16>(p, pool); break;
  }
}

void dact_dbias(const DActProblem& p, ffi::ThreadPool* pool) {
  if (p.quantized) return dact_dbias_quantized(p, pool);
  switch (p.dtype) {
    case DType::F32: dact_dbias_typed<F32>(p, pool); break;
    case DType::BF16: dact_dbias_typed<BF16>(p, pool); break;
    case DType::F16: dact_dbias_typed<F16>(p, pool); break;
  }
}

}  // namespace te_jax::cpu
