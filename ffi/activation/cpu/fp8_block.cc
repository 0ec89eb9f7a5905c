// CPU blockwise FP8 (FP8_BLOCK_1D / FP8_BLOCK_2D) of te_jax_act_lu, te_jax_quantize and
// te_jax_dact_dbias_quantize. Layouts: common/quant_output.h; formulas: docs/numerics.md §4-§5.
//
// Each batch's output y [Mb, N] (N = act_len * H) is produced in bands of 128 rows (the last one
// partial): the activation (or its gradient) in float32 by the NO_SCALING loops, rounded to x's
// dtype, kept as one row of N values per band row. Then, per band:
//   1D  rowwise: per row and 128-column block, scale = fp8_block_scale(max|y_b|), codes
//       fmt(y * scale); colwise: per column, the same over the band's rows, into the transposed
//       copy [N, Mb];
//   2D  per 128 x 128 tile one scale; both copies' codes from it (the colwise copy is the
//       transpose).
// scale_inv lands in cuBLASLt's layouts; the band that ends a padded axis writes its zeros.
// dbias: the (batch, row group) tasks of the workspace, each group a range of whole bands, adding
// its rows' unrounded float32 values in row order; the groups are summed in order.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "activation/activations.h"
#include "activation/cpu/encode.h"
#include "activation/cpu/kernels.h"
#include "activation/cpu/loops.h"
#include "activation/problem.h"
#include "common/formats.h"
#include "cpu/parallel.h"

namespace te_jax::cpu {
namespace {

namespace ffi = ::xla::ffi;
using namespace loops;

constexpr int64_t kBlk = 128;

// The shape of one call: batches of mb rows of y, n columns (l halves of h).
struct BlockGeometry {
  int64_t batches, mb, h, halves;
  int64_t n() const { return halves * h; }
  int64_t bands() const { return ceil_div(mb, kBlk); }
  int64_t col_blocks() const { return ceil_div(n(), kBlk); }
};

// A band of y (up to 128 rows of n values, rounded to x's dtype) and the row scratch, per thread.
struct Band {
  std::vector<float> v;        // [kBlk][n]
  std::vector<float> row;      // one row's outputs before they are placed: [2][hp]
  std::vector<float> pad[3];   // zero-padded inputs of a row
  std::vector<float> column;   // one column of the band
  void reserve(int64_t n, int64_t hp) {
    v.resize(static_cast<size_t>(kBlk * n));
    row.resize(static_cast<size_t>(2 * hp));
    for (auto& p : pad) p.resize(static_cast<size_t>(hp));
    column.resize(kBlk);
  }
};

Band& thread_band() {
  thread_local std::unique_ptr<Band> band = std::make_unique<Band>();
  return *band;
}

// act_lu: y rows [r0, r0 + nr) of x [m, act_len, h] into band.v.
template <typename Spec, typename D>
void produce_forward(const typename D::T* x, const BlockGeometry& g, const ActParams& p,
                     int64_t r0, int64_t nr, Band& band) {
  const int64_t hp = round_up_vec(g.h), L = Spec::kActLen;
  for (int64_t i = 0; i < nr; ++i) {
    const typename D::T* a = x + (r0 + i) * L * g.h;
    const typename D::T* b = Spec::kGated ? a + g.h : a;
    a = padded(a, g.h, hp, band.pad[0].data());
    b = Spec::kGated ? padded(b, g.h, hp, band.pad[1].data()) : a;
    fwd_raw<Spec, D>(a, b, band.row.data(), hp, p);
    round_to_storage<D>(band.row.data(), g.h);
    std::copy(band.row.data(), band.row.data() + g.h, band.v.data() + i * g.n());
  }
}

// dact: dx rows [r0, r0 + nr) (dA, then dB when gated) into band.v; adds the unrounded values to
// part (n floats) row after row when part is given.
template <typename Spec, typename D>
void produce_backward(const typename D::T* dz, const typename D::T* x, const BlockGeometry& g,
                      const ActParams& p, int64_t r0, int64_t nr, float* part, Band& band) {
  const int64_t hp = round_up_vec(g.h), L = Spec::kActLen;
  float* da = band.row.data();
  float* db = da + hp;  // non-gated: dB (0) is computed and dropped
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t r = r0 + i;
    const typename D::T* gz = padded(dz + r * g.h, g.h, hp, band.pad[0].data());
    const typename D::T* a = x + r * L * g.h;
    const typename D::T* b = Spec::kGated ? a + g.h : a;
    a = padded(a, g.h, hp, band.pad[1].data());
    b = Spec::kGated ? padded(b, g.h, hp, band.pad[2].data()) : a;
    bwd_raw<Spec, D>(gz, a, b, da, db, hp, p);
    for (int64_t l = 0; l < L; ++l) {
      float* vals = l == 0 ? da : db;
      if (part != nullptr) {
        float* __restrict s = part + l * g.h;
        for (int64_t j = 0; j < g.h; ++j) s[j] += vals[j];
      }
      round_to_storage<D>(vals, g.h);
      std::copy(vals, vals + g.h, band.v.data() + i * g.n() + l * g.h);
    }
  }
}

// Quantizes the band (rows [r0, r0 + nr) of batch b, band index k) of y in its format.
template <typename Fmt>
struct BandEmitter {
  const QuantOutput& q;
  const BlockGeometry& g;

  fmt::BlockScale scale_of(int32_t key) const {
    return fmt::fp8_block_scale(static_cast<uint32_t>(key), Fmt::kMax, q.amax_epsilon_bits,
                                q.power_2_scale);
  }

  void operator()(Band& band, int64_t b, int64_t k, int64_t nr) const {
    const int64_t n = g.n(), mb = g.mb, cbs = g.col_blocks();
    const int64_t rl0 = k * kBlk;  // the band's first row within the batch
    const bool last_band = k == g.bands() - 1;
    float* rs = q.block_scale_f32 == nullptr
                    ? nullptr
                    : q.block_scale_f32 + b * fp8_block_scale_count(q.block_2d, mb, n);
    float* cs = q.colwise_block_scale_f32 == nullptr
                    ? nullptr
                    : q.colwise_block_scale_f32 + b * fp8_block_scale_count(q.block_2d, n, mb);
    uint8_t* data = q.data == nullptr ? nullptr : q.data + (b * mb + rl0) * n;
    uint8_t* colwise = q.colwise == nullptr ? nullptr : q.colwise + b * n * mb + rl0;
    const float* v = band.v.data();
    float* col = band.column.data();
    if (q.block_2d) {
      const int64_t cb_pad = round_up(cbs, 4), rb_pad = round_up(g.bands(), 4);
      for (int64_t cb = 0; cb < cbs; ++cb) {
        const int64_t j0 = cb * kBlk, w = std::min(kBlk, n - j0);
        int32_t key = 0;
        for (int64_t i = 0; i < nr; ++i) key = std::max(key, max_abs_key(v + i * n + j0, w));
        const fmt::BlockScale s = scale_of(key);
        if (data != nullptr) {
          for (int64_t i = 0; i < nr; ++i) {
            enc::encode_scaled<Fmt>(v + i * n + j0, data + i * n + j0, w, s.scale);
          }
          rs[k * cb_pad + cb] = s.scale_inv;
        }
        if (colwise != nullptr) {
          for (int64_t j = j0; j < j0 + w; ++j) {
            for (int64_t i = 0; i < nr; ++i) col[i] = v[i * n + j];
            enc::encode_scaled<Fmt>(col, colwise + j * mb, nr, s.scale);
          }
          cs[cb * rb_pad + k] = s.scale_inv;
          if (last_band) std::fill(cs + cb * rb_pad + g.bands(), cs + (cb + 1) * rb_pad, 0.0f);
        }
      }
      if (data != nullptr) std::fill(rs + k * cb_pad + cbs, rs + (k + 1) * cb_pad, 0.0f);
      return;
    }
    if (data != nullptr) {
      const int64_t r_pad = round_up(mb, 4);
      for (int64_t i = 0; i < nr; ++i) {
        for (int64_t cb = 0; cb < cbs; ++cb) {
          const int64_t j0 = cb * kBlk, w = std::min(kBlk, n - j0);
          const fmt::BlockScale s = scale_of(max_abs_key(v + i * n + j0, w));
          enc::encode_scaled<Fmt>(v + i * n + j0, data + i * n + j0, w, s.scale);
          rs[cb * r_pad + rl0 + i] = s.scale_inv;
        }
      }
      if (last_band) {
        for (int64_t cb = 0; cb < cbs; ++cb) {
          std::fill(rs + cb * r_pad + mb, rs + (cb + 1) * r_pad, 0.0f);
        }
      }
    }
    if (colwise != nullptr) {
      const int64_t n_pad = round_up(n, 4);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t i = 0; i < nr; ++i) col[i] = v[i * n + j];
        const fmt::BlockScale s = scale_of(max_abs_key(col, nr));
        enc::encode_scaled<Fmt>(col, colwise + j * mb, nr, s.scale);
        cs[k * n_pad + j] = s.scale_inv;
      }
      std::fill(cs + k * n_pad + n, cs + (k + 1) * n_pad, 0.0f);
    }
  }
};

// Calls fn(BandEmitter<Fmt>) for the call's FP8 format.
template <typename Fn>
void with_band_emitter(const QuantOutput& q, const BlockGeometry& g, Fn&& fn) {
  if (q.qtype == QType::E5M2) {
    fn(BandEmitter<fmt::E5M2>{q, g});
  } else {
    fn(BandEmitter<fmt::E4M3>{q, g});
  }
}

// The bands [first, end) of group `grp` of `groups` over `bands` bands.
void group_bands(int64_t grp, int64_t groups, int64_t bands, int64_t& first, int64_t& end) {
  first = grp * bands / groups;
  end = (grp + 1) * bands / groups;
}

template <typename D>
void act_lu_block(const ActLuProblem& p, ffi::ThreadPool* pool) {
  using T = typename D::T;
  const QuantOutput& q = p.q;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    const BlockGeometry g{q.batches, p.rows / q.batches, p.hidden, 1};
    if (g.mb == 0 || g.n() == 0) return;
    const int64_t bands = g.bands();
    with_band_emitter(q, g, [&](auto emit) {
      parallel_chunks(pool, g.batches * bands, [&](int64_t task) {
        const int64_t b = task / bands, k = task % bands;
        const int64_t nr = std::min(kBlk, g.mb - k * kBlk);
        Band& band = thread_band();
        band.reserve(g.n(), round_up_vec(g.h));
        produce_forward<Spec, D>(static_cast<const T*>(p.x), g, p.params, b * g.mb + k * kBlk, nr,
                                 band);
        emit(band, b, k, nr);
      });
    });
  });
}

template <typename D>
void dact_block(const DActProblem& p, ffi::ThreadPool* pool) {
  using T = typename D::T;
  const QuantOutput& q = p.q;
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    const BlockGeometry g{q.batches, p.rows / q.batches, p.hidden, Spec::kActLen};
    const int64_t n = g.n(), bands = g.bands();
    const bool empty = g.mb == 0 || n == 0;
    // With dbias, the workspace's row groups (each a range of bands); else one band per task.
    const int64_t groups = p.dbias != nullptr ? p.groups : bands;
    const T* dz = static_cast<const T*>(p.dz);
    const T* x = static_cast<const T*>(p.x);
    if (!empty) {
      with_band_emitter(q, g, [&](auto emit) {
        parallel_chunks(pool, g.batches * groups, [&](int64_t task) {
          const int64_t b = task / groups, grp = task % groups;
          float* part = nullptr;
          if (p.dbias != nullptr) {
            part = p.workspace + task * n;
            std::fill(part, part + n, 0.0f);
          }
          int64_t first, end;
          group_bands(grp, groups, bands, first, end);
          Band& band = thread_band();
          band.reserve(n, round_up_vec(g.h));
          for (int64_t k = first; k < end; ++k) {
            const int64_t nr = std::min(kBlk, g.mb - k * kBlk);
            produce_backward<Spec, D>(dz, x, g, p.params, b * g.mb + k * kBlk, nr, part, band);
            emit(band, b, k, nr);
          }
        });
      });
    }
    if (p.dbias != nullptr) {
      if (empty) std::fill(p.workspace, p.workspace + q.batches * groups * n, 0.0f);
      sum_groups<D>(p.workspace, static_cast<T*>(p.dbias), q.batches, groups, n, pool);
    }
  });
}

}  // namespace

void act_lu_fp8_block(const ActLuProblem& p, ffi::ThreadPool* pool) {
  switch (p.dtype) {
    case DType::F32: act_lu_block<F32>(p, pool); break;
    case DType::BF16: act_lu_block<BF16>(p, pool); break;
    case DType::F16: act_lu_block<F16>(p, pool); break;
  }
}

void dact_dbias_fp8_block(const DActProblem& p, ffi::ThreadPool* pool) {
  switch (p.dtype) {
    case DType::F32: dact_block<F32>(p, pool); break;
    case DType::BF16: dact_block<BF16>(p, pool); break;
    case DType::F16: dact_block<F16>(p, pool); break;
  }
}

}  // namespace te_jax::cpu
