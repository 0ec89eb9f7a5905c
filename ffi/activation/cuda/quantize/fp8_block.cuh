// Blockwise FP8 (FP8_BLOCK_1D / FP8_BLOCK_2D) of te_jax_act_lu / te_jax_quantize /
// te_jax_dact_dbias_quantize on CUDA: its own tiled kernel, since a block spans 128 rows (the
// other modes' tiles are 32). Formulas and layouts: common/quant_output.h, docs/numerics.md
// §4-§5; the bits equal activation/cpu/fp8_block.cc's (dbias up to its summation order).
//
// A thread block (8 warps) owns a tile of 128 rows x 128 columns of each output half. The gated
// backward writes both halves of 128 columns of H where H % 128 == 0 (its 1x128 blocks then
// never straddle the halves); otherwise ("flat") its tile is 128 columns of [M, 2H] itself, each
// value computed from its own half's inputs (both x halves and dz read for each):
//   1. produce: warp w computes rows 16w .. 16w + 15, lane L columns 4L .. 4L + 3 (one 8- or
//      16-byte load per input and row), rounds the values to x's dtype and keeps them in shared
//      memory; along the way the row maxima (a warp max per row), the lane's column maxima and
//      the dbias column sums (unrounded) of its rows;
//   2. scales: row scales by 16 lanes per warp, column (1D) or tile (2D) scales by one thread per
//      column after a barrier; scale_inv and the layouts' zero padding to global memory;
//   3. codes: rowwise, each warp its rows (4 bytes per lane, 128 per row); colwise, per 16-row
//      chunk of a column: 8 lanes fill one column's 128 contiguous bytes per store.
// Shared memory holds the tile as 32-bit words, row r's word w at w ^ (4 * ((r / 16) % 8)): the
// rows a colwise read takes together (16 apart) fall on different banks, and a lane's words of a
// row stay together. Grid: x the 128-column tiles, y the row groups (dbias: the workspace's; else
// one tile each), z the batches, each strided where the grid is capped.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "activation/activations.h"
#include "activation/cuda/launch.h"
#include "activation/cuda/quantize/call.cuh"
#include "activation/problem.h"
#include "common/formats.h"
#include "cuda/device_utils.cuh"
#include "cuda/fp8_codes.cuh"

namespace te_jax::cuda::quant {

constexpr int kFb = 128;                     // a block's edge: tile rows and columns
constexpr int kFbRowsPerWarp = kFb / kWarps;  // 16
// Rows whose loads a lane issues together, before it computes any: about 64 bytes per lane (8
// rows of one 16-bit input, 4 of two, ...), never fewer than 2 (the register cap allows no
// more without spilling). Raw words: 16-bit values stay two to a register until computed.
template <typename Spec, bool kBwd>
constexpr int kFbInputs = Spec::kActLen + (kBwd ? 1 : 0);
template <typename Spec, typename T, bool kBwd>
constexpr int kFbRowStep = std::max<int>(
    2, 1 << (31 - __builtin_clz(64 / (kFbInputs<Spec, kBwd> * 4 * static_cast<int>(sizeof(T))))));

struct Fp8BlockArgs {
  const void* x;
  const void* dz;
  uint64_t H;               // columns of each half
  uint64_t y_cols;          // columns of y: 2H for the gated backward, else H
  uint64_t rows_per_batch;  // Mb
  uint32_t batches, row_tiles, col_tiles, groups;
  ActParams params;
  uint8_t* data;            // [batches * Mb, y_cols] or nullptr
  uint8_t* colwise;         // [batches, y_cols, Mb] or nullptr
  float* scale_inv;         // the rowwise copy's scales (quant_output.h) or nullptr
  float* colwise_scale_inv;
  float* dbias_ws;          // [batches, groups, y_cols] or nullptr
  uint64_t row_scales, col_scales;  // scales per batch of each copy
  float qmax;
  uint32_t eps_bits;
  bool pow2, e5m2, block_2d;
  bool vec_in;   // 4-element loads (H % 4 == 0, aligned inputs)
  bool vec_row;  // 4-byte rowwise code stores (H % 4 == 0, aligned)
  bool vec_col;  // 16-byte colwise code stores (Mb % 16 == 0, aligned)
};

template <typename Spec, bool kBwd, bool kFlat>
constexpr int kFbHalves = kBwd && !kFlat ? Spec::kActLen : 1;

// Dynamic shared memory of one block: the values, then the per-warp column partials, the dbias
// partials, the row and column scales and the 2D tile scales.
template <typename Spec, typename T, bool kBwd, bool kFlat>
struct Fp8BlockSmem {
  static constexpr int kHalves = kFbHalves<Spec, kBwd, kFlat>;
  static constexpr int kRowWords = kFb * static_cast<int>(sizeof(T)) / 4;
  static constexpr size_t kVals = size_t{kHalves} * kFb * kRowWords * 4;
  static constexpr size_t kPartials = size_t{kHalves} * kWarps * kFb * 4;
  static constexpr size_t kScales = size_t{kHalves} * kFb * 4;
  static constexpr size_t kBytes =
      kVals + kPartials * (kBwd ? 2 : 1) + 2 * kScales + size_t{kHalves} * (kWarps + 1) * 4;
};

__device__ __forceinline__ int fb_swizzle(int r) { return ((r >> 4) & 7) << 2; }

// Max |y| is taken on keys in T's own bits (|y|'s bits: for float32, bfloat16 and float16 alike
// an unsigned max is the max of the magnitudes, a NaN above inf); 16-bit keys two to a word,
// compared as packed halves (one instruction per pair). fb_key_bits gives the float32 bits.
template <typename T>
__device__ __forceinline__ uint32_t fb_key_bits(uint32_t k) {
  if constexpr (std::is_same_v<T, float>) {
    return k;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return k << 16;
  } else {
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(k))));
  }
}

template <typename T>
__device__ __forceinline__ fmt::BlockScale fb_scale(const Fp8BlockArgs& a, uint32_t key) {
  return fmt::fp8_block_scale(fb_key_bits<T>(key), a.qmax, a.eps_bits, a.pow2);
}

// 4 inputs of T at p (the first n valid, the rest 0) as raw words: one 8- or 16-byte load on
// the vector path.
template <typename T>
__device__ __forceinline__ Pack<T, 4> fb_load4(const T* p, bool vec, int n) {
  if (vec && n == 4) return load_pack<T, 4>(p);
  Pack<T, 4> r;
  load_words_bounded<T, 4>(p, n, r.w);
  return r;
}

// Blocks per SM the registers are capped for: 3 (<= 85 registers; 3 x 38 KiB of shared memory
// for 16-bit inputs), 2 for the gated backward (its 16-bit tile of both halves is 80 KiB).
template <typename Spec, bool kBwd>
constexpr int kFbBlocksPerSm = kBwd && Spec::kGated ? 2 : 3;

// The gated backward's flat tile: a lane's 3 x 4 inputs of flat columns c .. c + 3 of [M, 2H]
// (both x halves and dz at each one's column of H), the first n valid.
template <typename T>
__device__ __forceinline__ void fb_load_flat(const T* x, const T* dz, uint64_t gr, uint64_t c,
                                             uint64_t H, int n, bool vec, Pack<T, 4> (&raw)[3]) {
  if (vec) {  // H % 4 == 0: the 4 columns are in one half
    const uint64_t h = c >= H ? c - H : c;
    raw[0] = fb_load4(x + gr * 2 * H + h, true, n);
    raw[1] = fb_load4(x + gr * 2 * H + H + h, true, n);
    raw[2] = fb_load4(dz + gr * H + h, true, n);
    return;
  }
  using U = std::conditional_t<sizeof(T) == 4, unsigned, unsigned short>;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(T)); ++k) raw[i].w[k] = 0u;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < n) {
      const uint64_t cj = c + j, h = cj >= H ? cj - H : cj;
      const U* src[3] = {reinterpret_cast<const U*>(x + gr * 2 * H + h),
                         reinterpret_cast<const U*>(x + gr * 2 * H + H + h),
                         reinterpret_cast<const U*>(dz + gr * H + h)};
#pragma unroll
      for (int i = 0; i < 3; ++i) {
        const uint32_t v = __ldg(src[i]);
        if constexpr (sizeof(T) == 4) {
          raw[i].w[j] = v;
        } else {
          raw[i].w[j / 2] |= v << (16 * (j % 2));
        }
      }
    }
  }
}

template <typename Spec, typename T, bool kBwd, bool kFlat>
__global__ void __launch_bounds__(kThreads, (kFbBlocksPerSm<Spec, kBwd>))
    fp8_block_kernel(const Fp8BlockArgs a) {
  using Smem = Fp8BlockSmem<Spec, T, kBwd, kFlat>;
  constexpr int kHalves = Smem::kHalves, kInHalves = Spec::kActLen;
  constexpr int kRowWords = Smem::kRowWords;
  constexpr int kLaneWords = static_cast<int>(sizeof(T));  // words of a lane's 4 values
  constexpr int kRowStep = kFbRowStep<Spec, T, kBwd>;
  extern __shared__ __align__(16) unsigned char fb_smem[];
  uint32_t* vals = reinterpret_cast<uint32_t*>(fb_smem);  // [kHalves][kFb][kRowWords]
  unsigned* ckey = reinterpret_cast<unsigned*>(fb_smem + Smem::kVals);  // [h][warp][col]
  float* dpart = reinterpret_cast<float*>(fb_smem + Smem::kVals + Smem::kPartials);
  float* rscale = reinterpret_cast<float*>(fb_smem + Smem::kVals +
                                           Smem::kPartials * (kBwd ? 2 : 1));  // [h][row]
  float* cscale = rscale + kHalves * kFb;                                      // [h][col]
  unsigned* wkey = reinterpret_cast<unsigned*>(cscale + kHalves * kFb);        // [h][warp]
  float* tscale = reinterpret_cast<float*>(wkey + kHalves * kWarps);           // [h]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint64_t H = a.H, Ny = a.y_cols, Mb = a.rows_per_batch;
  const uint64_t W = kFlat ? Ny : H;  // the width the column tiles cover
  const T* x = static_cast<const T*>(a.x);
  const T* dz = static_cast<const T*>(a.dz);
  const bool row_out = a.data != nullptr, col_out = a.colwise != nullptr;
  const bool block_2d = a.block_2d;
  const uint64_t rpad = (Mb + 3) / 4 * 4, npad = (Ny + 3) / 4 * 4;
  const uint64_t cbs = (Ny + kFb - 1) / kFb, cbpad = (cbs + 3) / 4 * 4;
  const uint64_t rbpad = (uint64_t{a.row_tiles} + 3) / 4 * 4;

  for (uint32_t b = blockIdx.z; b < a.batches; b += gridDim.z) {
  for (uint32_t ct = blockIdx.x; ct < a.col_tiles; ct += gridDim.x) {
  const uint64_t c0 = uint64_t{ct} * kFb;
  for (uint32_t g = blockIdx.y; g < a.groups; g += gridDim.y) {
    uint32_t t_begin = g, t_end = g + 1;
    if (a.groups != a.row_tiles) {
      t_begin = static_cast<uint32_t>(uint64_t{g} * a.row_tiles / a.groups);
      t_end = static_cast<uint32_t>((uint64_t{g} + 1) * a.row_tiles / a.groups);
    }
    float dacc = 0.0f;  // kBwd: this thread's column (tid < kHalves * kFb) summed over the group
    for (uint32_t rt = t_begin; rt < t_end; ++rt) {
      const uint64_t rl0 = uint64_t{rt} * kFb;  // the tile's first row within the batch
      const int tile_rows = static_cast<int>(std::min<uint64_t>(kFb, Mb - rl0));
      const uint64_t grow0 = uint64_t{b} * Mb + rl0;  // ... of the whole input

      // ---- 1. produce ----
      const uint64_t c = c0 + 4 * lane;
      const int ncol = c < W ? static_cast<int>(std::min<uint64_t>(4, W - c)) : 0;
      // Every row and column inside, 8- or 16-byte loads: no bounds per row (whole tiles are
      // nearly all of a large input).
      const bool whole = tile_rows == kFb && c0 + kFb <= W && a.vec_in;
      // The lane's inputs in the warp's first row; rows step by 32-bit offsets from there (16
      // rows of at most 2H elements).
      const uint64_t gw = grow0 + warp * kFbRowsPerWarp;
      const uint64_t hcol = kFlat && c >= H ? c - H : c;  // flat: the column within its half
      const T* xw = x + gw * (kInHalves * H) + (kFlat ? hcol : c);
      const T* dzw = kBwd ? dz + gw * H + (kFlat ? hcol : c) : nullptr;
      const uint32_t x_step = static_cast<uint32_t>(kInHalves * H), z_step = static_cast<uint32_t>(H);
      // This lane's words of the warp's first row in shared memory (the swizzle of rows 16w ..
      // 16w + 15 is 4w).
      uint32_t* const vw =
          vals + warp * kFbRowsPerWarp * kRowWords + ((kLaneWords * lane) ^ (warp << 2));
      // The lane's column keys (16-bit: two per word), its rows' max key and its own row's.
      uint32_t colk[kHalves][kLaneWords] = {}, tkey[kHalves] = {}, my_row_key[kHalves] = {};
      float dsum[kHalves][4] = {};
      // Whole tiles take a copy of the loop without bounds (a template argument, not a branch
      // per row).
      auto produce = [&](auto whole_tag) {
        constexpr bool kWhole = decltype(whole_tag)::value;
  #pragma unroll 1
        for (int i0 = 0; i0 < kFbRowsPerWarp; i0 += kRowStep) {
          constexpr int kInputs = kFbInputs<Spec, kBwd>;
          Pack<T, 4> raw[kRowStep][kInputs];  // x (a half), x (b half), dz
  #pragma unroll
          for (int s = 0; s < kRowStep; ++s) {
            const int r = warp * kFbRowsPerWarp + i0 + s;
            const uint32_t ri = static_cast<uint32_t>(i0 + s);
            const T* xr = xw + ri * x_step;
            [[maybe_unused]] const T* zr = kBwd ? dzw + ri * z_step : nullptr;
            if constexpr (kWhole) {
              raw[s][0] = load_pack<T, 4>(xr);
              if constexpr (Spec::kGated) raw[s][1] = load_pack<T, 4>(xr + H);
              if constexpr (kBwd) raw[s][kInputs - 1] = load_pack<T, 4>(zr);
            } else if constexpr (kFlat) {
              fb_load_flat(x, dz, grow0 + r, c, H, r < tile_rows ? ncol : 0, a.vec_in, raw[s]);
            } else {
              const int n = r < tile_rows ? ncol : 0;
              raw[s][0] = fb_load4(xr, a.vec_in, n);
              if constexpr (Spec::kGated) raw[s][1] = fb_load4(xr + H, a.vec_in, n);
              if constexpr (kBwd) raw[s][kInputs - 1] = fb_load4(zr, a.vec_in, n);
            }
          }
  #pragma unroll
          for (int s = 0; s < kRowStep; ++s) {
            const int r = warp * kFbRowsPerWarp + i0 + s;
            const int n = kWhole ? 4 : (r < tile_rows ? ncol : 0);
            float in[3][4], y[kHalves][4];
            to_float(raw[s][0], in[0]);
            if constexpr (Spec::kGated) to_float(raw[s][1], in[1]);
            if constexpr (kBwd) to_float(raw[s][kInputs - 1], in[2]);
  #pragma unroll
            for (int j = 0; j < 4; ++j) {
              if constexpr (kBwd) {
                float da, db;
                act_backward<Spec>(in[2][j], in[0][j], Spec::kGated ? in[1][j] : 0.0f, a.params,
                                   da, db);
                if constexpr (kFlat) {
                  y[0][j] = c + j >= H ? db : da;
                } else {
                  y[0][j] = da;
                  if constexpr (kHalves == 2) y[1][j] = db;
                }
              } else {
                y[0][j] = act_forward<Spec>(in[0][j], Spec::kGated ? in[1][j] : 0.0f, a.params);
              }
            }
            if (!kWhole && n < 4) {  // outside the tile's rows or columns: 0, no max or sum sees it
  #pragma unroll
              for (int l = 0; l < kHalves; ++l) {
  #pragma unroll
                for (int j = 0; j < 4; ++j) y[l][j] = j < n ? y[l][j] : 0.0f;
              }
            }
  #pragma unroll
            for (int l = 0; l < kHalves; ++l) {
              float rv[4];
              const Pack<T, 4> p = from_float<T, 4>(y[l], rv);
              uint32_t* dst = vw + (l * kFb + i0 + s) * kRowWords;
              if constexpr (kLaneWords == 4) {
                *reinterpret_cast<uint4*>(dst) = make_uint4(p.w[0], p.w[1], p.w[2], p.w[3]);
              } else {
                *reinterpret_cast<uint2*>(dst) = make_uint2(p.w[0], p.w[1]);
              }
              unsigned key = 0;
              if constexpr (kLaneWords == 4) {
  #pragma unroll
                for (int j = 0; j < 4; ++j) {
                  const uint32_t k = p.w[j] & 0x7fffffffu;
                  key = max(key, k);
                  colk[l][j] = max(colk[l][j], k);
                }
              } else {
                const uint32_t k0 = p.w[0] & 0x7fff7fffu, k1 = p.w[1] & 0x7fff7fffu;
                colk[l][0] = __vmaxu2(colk[l][0], k0);
                colk[l][1] = __vmaxu2(colk[l][1], k1);
                const uint32_t m2 = __vmaxu2(k0, k1);
                key = max(m2 & 0xffffu, m2 >> 16);
              }
              if constexpr (kBwd) {
  #pragma unroll
                for (int j = 0; j < 4; ++j) dsum[l][j] += y[l][j];
              }
              tkey[l] = max(tkey[l], key);
              const unsigned row_key = __reduce_max_sync(0xffffffffu, key);
              if (lane == i0 + s) my_row_key[l] = row_key;
            }
          }
        }
      };
      if (whole) {
        produce(std::true_type{});
      } else {
        produce(std::false_type{});
      }

      // ---- 2. scales ----
#pragma unroll
      for (int l = 0; l < kHalves; ++l) {
        const int r = warp * kFbRowsPerWarp + lane;
        if (!block_2d && lane < kFbRowsPerWarp) {
          const fmt::BlockScale s = fb_scale<T>(a, my_row_key[l]);
          rscale[l * kFb + r] = s.scale;
          if (row_out && r < tile_rows) {
            const uint64_t cb = (l * H + c0) / kFb;
            a.scale_inv[b * a.row_scales + cb * rpad + rl0 + r] = s.scale_inv;
          }
        }
        unsigned* ck = ckey + (l * kWarps + warp) * kFb + 4 * lane;
        if constexpr (kLaneWords == 4) {
#pragma unroll
          for (int j = 0; j < 4; ++j) ck[j] = colk[l][j];
        } else {  // element 2i in the low half
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            ck[2 * i] = colk[l][i] & 0xffffu;
            ck[2 * i + 1] = colk[l][i] >> 16;
          }
        }
        if constexpr (kBwd) {
#pragma unroll
          for (int j = 0; j < 4; ++j) dpart[(l * kWarps + warp) * kFb + 4 * lane + j] = dsum[l][j];
        }
        const unsigned wk = __reduce_max_sync(0xffffffffu, tkey[l]);
        if (lane == 0) wkey[l * kWarps + warp] = wk;
      }
      __syncthreads();
      if (tid < kHalves * kFb) {
        const int l = tid / kFb, cc = tid % kFb;
        const uint64_t col = l * H + c0 + cc;  // y column
        const bool col_in = c0 + cc < W;
        unsigned m = 0;
        float ds = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          m = max(m, ckey[(l * kWarps + w) * kFb + cc]);
          if constexpr (kBwd) ds += dpart[(l * kWarps + w) * kFb + cc];
        }
        if constexpr (kBwd) dacc += ds;
        if (!block_2d) {
          const fmt::BlockScale s = fb_scale<T>(a, m);
          cscale[l * kFb + cc] = s.scale;
          if (col_out && col_in) {
            a.colwise_scale_inv[b * a.col_scales + rt * npad + col] = s.scale_inv;
          }
        } else if (cc == 0) {
          unsigned tk = 0;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) tk = max(tk, wkey[l * kWarps + w]);
          const fmt::BlockScale s = fb_scale<T>(a, tk);
          tscale[l] = s.scale;
          const uint64_t cb = (l * H + c0) / kFb;
          if (row_out) a.scale_inv[b * a.row_scales + rt * cbpad + cb] = s.scale_inv;
          if (col_out) a.colwise_scale_inv[b * a.col_scales + cb * rbpad + rt] = s.scale_inv;
        }
      }
      // The layouts' zero padding, by the tiles at the padded ends.
      const bool last_rt = rt + 1 == a.row_tiles, last_ct = ct + 1 == a.col_tiles;
      if (!block_2d) {
        if (row_out && last_rt && tid < kHalves * 4) {
          const int l = tid / 4, k = tid % 4;
          const uint64_t cb = (l * H + c0) / kFb;
          if (Mb + k < rpad) a.scale_inv[b * a.row_scales + cb * rpad + Mb + k] = 0.0f;
        }
        if (col_out && last_ct && tid < 4 && Ny + tid < npad) {
          a.colwise_scale_inv[b * a.col_scales + rt * npad + Ny + tid] = 0.0f;
        }
      } else {
        if (row_out && last_ct && tid < 4 && cbs + tid < cbpad) {
          a.scale_inv[b * a.row_scales + rt * cbpad + cbs + tid] = 0.0f;
        }
        if (col_out && last_rt && tid < kHalves * 4) {
          const int l = tid / 4, k = tid % 4;
          const uint64_t cb = (l * H + c0) / kFb;
          if (a.row_tiles + k < rbpad) {
            a.colwise_scale_inv[b * a.col_scales + cb * rbpad + a.row_tiles + k] = 0.0f;
          }
        }
      }
      __syncthreads();

      // ---- 3. codes ----
      // The FP8 format is a branch per tile, not per value (each copy converts in one format).
      auto emit_codes = [&](auto e5m2_tag) {
        constexpr bool kE5m2 = decltype(e5m2_tag)::value;
        if (row_out) {
          // The lane's codes in the warp's first row (rows 16 apart: 32-bit offsets). Whole tiles
          // with 4-byte stores take a copy without bounds.
          uint8_t* const drow = a.data + gw * Ny + c;
          auto store_rows = [&](auto whole_tag) {
            constexpr bool kWhole = decltype(whole_tag)::value;
  #pragma unroll
            for (int l = 0; l < kHalves; ++l) {
  #pragma unroll 4
              for (int i = 0; i < kFbRowsPerWarp; ++i) {
                const int r = warp * kFbRowsPerWarp + i;
                const uint32_t* src = vw + (l * kFb + i) * kRowWords;
                Pack<T, 4> p;
  #pragma unroll
                for (int k = 0; k < kLaneWords; ++k) p.w[k] = src[k];
                float v[4], q[4];
                to_float(p, v);
                const float s = block_2d ? tscale[l] : rscale[l * kFb + r];
  #pragma unroll
                for (int j = 0; j < 4; ++j) q[j] = __fmul_rn(v[j], s);
                const Pack<uint8_t, 4> codes = fp8_pack_as<kE5m2, 4>(q, 0xffffffffu);
                uint8_t* dst = drow + static_cast<uint32_t>(i * Ny + l * H);
                if (kWhole || (a.vec_row && ncol == 4 && r < tile_rows)) {
                  *reinterpret_cast<uint32_t*>(dst) = codes.w[0];
                } else if (r < tile_rows) {
                  for (int j = 0; j < ncol; ++j) dst[j] = static_cast<uint8_t>(codes.w[0] >> (8 * j));
                }
              }
            }
          };
          if (whole && a.vec_row) {
            store_rows(std::true_type{});
          } else {
            store_rows(std::false_type{});
          }
        }
        if (col_out) {
          // Items (half, word column, 16-row chunk): a warp's 32 take 4 word columns x 8 chunks.
          constexpr int kItems = kHalves * kRowWords * 8;
          constexpr int kColsPerWord = 4 / static_cast<int>(sizeof(T));
  #pragma unroll 1
          for (int e = tid; e < kItems; e += kThreads) {
            const int chunk = e & 7, wc = (e >> 3) % kRowWords, l = e / (kRowWords * 8);
            float v[kColsPerWord][16];
  #pragma unroll
            for (int k = 0; k < 16; ++k) {
              const int r = 16 * chunk + k;
              const uint32_t w = vals[(l * kFb + r) * kRowWords + (wc ^ fb_swizzle(r))];
              if constexpr (kColsPerWord == 1) {
                v[0][k] = __uint_as_float(w);
              } else {
                const float2 f = std::is_same_v<T, __nv_bfloat16> ? bf16x2_to_float2(w)
                                                                  : f16x2_to_float2(w);
                v[0][k] = f.x;
                v[kColsPerWord - 1][k] = f.y;
              }
            }
            const int row0 = 16 * chunk;
  #pragma unroll
            for (int h = 0; h < kColsPerWord; ++h) {
              const int cc = kColsPerWord * wc + h;
              const float s = block_2d ? tscale[l] : cscale[l * kFb + cc];
              float q[16];
  #pragma unroll
              for (int k = 0; k < 16; ++k) q[k] = __fmul_rn(v[h][k], s);
              const Pack<uint8_t, 16> codes = fp8_pack_as<kE5m2, 16>(q, __activemask());
              if (c0 + cc < W && row0 < tile_rows) {
                uint8_t* dst = a.colwise + (uint64_t{b} * Ny + l * H + c0 + cc) * Mb + rl0 + row0;
                if (a.vec_col) {
                  store_pack(dst, codes);
                } else {
                  const int m = min(16, tile_rows - row0);
                  for (int k = 0; k < m; ++k) {
                    dst[k] = static_cast<uint8_t>(codes.w[k >> 2] >> (8 * (k & 3)));
                  }
                }
              }
            }
          }
        }
      };
      if (a.e5m2) {
        emit_codes(std::true_type{});
      } else {
        emit_codes(std::false_type{});
      }
      __syncthreads();  // the next tile rewrites the shared values and partials
    }
    if constexpr (kBwd) {
      if (a.dbias_ws != nullptr && tid < kHalves * kFb) {
        const int l = tid / kFb, cc = tid % kFb;
        if (c0 + cc < W) {
          a.dbias_ws[(uint64_t{b} * a.groups + g) * Ny + l * H + c0 + cc] = dacc;
        }
      }
    }
  }  // groups
  }  // column tiles
  }  // batches
}

template <typename Spec, typename T, bool kBwd, bool kFlat>
cudaError_t launch_fp8_block_as(const QuantizeCall& call, cudaStream_t stream,
                                const LaunchConfig& cfg) {
  using Smem = Fp8BlockSmem<Spec, T, kBwd, kFlat>;
  constexpr int kHalves = Smem::kHalves;
  auto* const kernel = &fp8_block_kernel<Spec, T, kBwd, kFlat>;
  if (cfg.load_only) {
    // Set up once, by the Initialize stage (execute only enqueues): above 48 KiB a kernel must
    // opt in to its dynamic shared memory, and the largest shared-memory carveout lets the
    // blocks per SM the register cap allows fit there.
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(Smem::kBytes));
        e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e = cudaFuncSetAttribute(
            kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
        e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e = load_kernel(kernel); e != cudaSuccess) return e;
    return call.dbias != nullptr ? launch_dbias_finalize(nullptr, nullptr, kDTypeOf<T>, 0, 0, 0, stream,
                                                         true)
                                 : cudaSuccess;
  }
  const QuantOutput& q = *call.q;
  const uint64_t H = static_cast<uint64_t>(call.hidden);
  // A tile of both halves: its rowwise blocks must not straddle them (launch_fp8_block).
  if (kHalves == 2 && H % kFb != 0) return cudaErrorInvalidValue;
  Fp8BlockArgs a{};
  a.x = call.x;
  a.dz = call.dz;
  a.H = H;
  a.y_cols = (kFlat ? 2 : kHalves) * H;
  a.batches = static_cast<uint32_t>(q.batches);
  a.rows_per_batch = static_cast<uint64_t>(call.rows / q.batches);
  const uint64_t row_tiles = (a.rows_per_batch + kFb - 1) / kFb;
  const uint64_t col_tiles = ((kFlat ? a.y_cols : H) + kFb - 1) / kFb;
  const uint64_t groups = call.ws != nullptr ? static_cast<uint64_t>(call.groups) : row_tiles;
  if (row_tiles > 0x7fffffff || col_tiles > 0x7fffffff || groups > 0x7fffffff ||
      q.batches > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (row_tiles == 0 || col_tiles == 0) return cudaSuccess;
  a.row_tiles = static_cast<uint32_t>(row_tiles);
  a.col_tiles = static_cast<uint32_t>(col_tiles);
  a.groups = static_cast<uint32_t>(groups);
  a.params = call.params;
  a.data = q.data;
  a.colwise = q.colwise;
  a.scale_inv = q.block_scale_f32;
  a.colwise_scale_inv = q.colwise_block_scale_f32;
  a.dbias_ws = call.ws;
  a.row_scales = static_cast<uint64_t>(fp8_block_scale_count(q.block_2d, a.rows_per_batch, a.y_cols));
  a.col_scales = static_cast<uint64_t>(fp8_block_scale_count(q.block_2d, a.y_cols, a.rows_per_batch));
  a.qmax = q.qtype == QType::E5M2 ? fmt::E5M2::kMax : fmt::E4M3::kMax;
  a.eps_bits = q.amax_epsilon_bits;
  a.pow2 = q.power_2_scale;
  a.e5m2 = q.qtype == QType::E5M2;
  a.block_2d = q.block_2d;
  const auto aligned = [](const void* p, uintptr_t k) {
    return (reinterpret_cast<uintptr_t>(p) % k) == 0;
  };
  constexpr uintptr_t kLoadBytes = 4 * sizeof(T);
  a.vec_in = H % 4 == 0 && aligned(call.x, kLoadBytes) && (!kBwd || aligned(call.dz, kLoadBytes));
  a.vec_row = (kFlat ? a.y_cols : H) % 4 == 0 && aligned(q.data, 4);
  a.vec_col = a.rows_per_batch % 16 == 0 && aligned(q.colwise, 16);
  const uint64_t cap = cfg.max_blocks > 0 ? cfg.max_blocks : ~uint64_t{0};
  const uint64_t gx = std::clamp<uint64_t>(col_tiles, 1, std::min<uint64_t>(cap, 0x7fffffff));
  const uint64_t gy = std::clamp<uint64_t>(groups, 1, std::min<uint64_t>(cap / gx, 65535));
  const uint64_t gz =
      std::clamp<uint64_t>(q.batches, 1, std::min<uint64_t>(cap / (gx * gy), 65535));
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(gz));
  kernel<<<grid, kThreads, Smem::kBytes, stream>>>(a);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (call.dbias != nullptr) {
    return launch_dbias_finalize(call.ws, call.dbias, kDTypeOf<T>, a.y_cols, groups, q.batches, stream,
                                 false);
  }
  return cudaSuccess;
}

// The gated backward in tiles of both halves where H % 128 == 0, else flat.
template <typename Spec, typename T, bool kBwd>
cudaError_t launch_fp8_block(const QuantizeCall& call, cudaStream_t stream,
                             const LaunchConfig& cfg) {
  if constexpr (kBwd && Spec::kGated) {
    if (cfg.load_only) {
      if (cudaError_t e = launch_fp8_block_as<Spec, T, kBwd, false>(call, stream, cfg);
          e != cudaSuccess) {
        return e;
      }
      return launch_fp8_block_as<Spec, T, kBwd, true>(call, stream, cfg);
    }
    if (call.hidden % kFb != 0) return launch_fp8_block_as<Spec, T, kBwd, true>(call, stream, cfg);
  }
  return launch_fp8_block_as<Spec, T, kBwd, false>(call, stream, cfg);
}

}  // namespace te_jax::cuda::quant
