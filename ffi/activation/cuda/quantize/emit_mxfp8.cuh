// MXFP8: 32-element blocks, E8M0 block scales, FP8 codes of y * 2^k. Rowwise a block is 4
// adjacent lanes; colwise one block per column of the 32-row tile (emit_block_scaled.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/codes.cuh"
#include "activation/cuda/quantize/emit_block_scaled.cuh"
#include "activation/cuda/quantize/emitter.cuh"
#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/mxfp8_scale.cuh"
#include "activation/cuda/quantize/tile.cuh"
#include "common/formats.h"

namespace te_jax::cuda::quant {

template <typename Spec, typename T, bool kBwd>
struct Mxfp8Emitter
    : BlockScaledEmitter<Mxfp8Emitter<Spec, T, kBwd>, Spec, T, kBwd> {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  static constexpr int kOutHalves = TileShape::kOutHalves;
  static constexpr int kRowsPerThread = TileShape::kRowsPerThread;
  static constexpr int kCols = TileShape::kCols;
  static constexpr int kBlock = 32;
  static constexpr int kGroupLanes = 4;
  static constexpr int kColBlocks = 1;
  static constexpr bool kTensorScale = false;
  // The forward copies the next whole tile's inputs into shared memory while it computes this
  // one (measured faster for MXFP8, slower for NVFP4: NOTES.md, "The ALU pipe").
  static constexpr bool kPrefetchInputs = !kBwd;
  // Per column: the scaling factor (MxScale::factor) [kOutHalves][kCols] float.
  static constexpr size_t kBlockBytes = size_t{kOutHalves} * kCols * 4;
  static constexpr int kTableRows = 1;
  // The tile's values (produce.cuh): v[i][l] row i, half l; valid_cols[i] its columns inside.
  using ValidCols = int[kRowsPerThread];
  using TileY = Values8<T>[kRowsPerThread][kOutHalves];

  __device__ __forceinline__ static void begin_batch(const QuantizeArgs&, const SharedBuffers&,
                                                     uint32_t) {}

  // Row i, half l: its block's scale (by the block's first lane) and its 8 codes.
  __device__ __forceinline__ static void emit_rows(
      const QuantizeArgs& args, const SharedBuffers&, const Lane& lane, const TilePosition& tile,
      float, const ValidCols& valid_cols, const TileY& v,
      const unsigned (&keys)[kOutHalves][kRowsPerThread]) {
    // The block scales of this lane's rows: row i, half l at bsr[i * bs_row + l * bs_half],
    // for the lanes that store them (c0 % kBlock == 0; the rowwise layout needs
    // y_cols % kBlock == 0, so row * y_cols / kBlock + c0 / kBlock = y_off / kBlock).
    const uint64_t y_cols = lane.y_cols, H = lane.H;
    const uint64_t bs_row = y_cols / kBlock, bs_half = H / kBlock;
    uint8_t* const bsr = args.block_scale + tile.y_off / kBlock;
#pragma unroll
    for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        uint8_t* const bs_at = bsr + i * bs_row + l * bs_half;
        const bool lead = (lane.tx & (kGroupLanes - 1)) == 0;
        const MxScale sc(keys[l][i], args.qmax);
        if (valid_cols[i] > 0 && lead) *bs_at = static_cast<uint8_t>(-sc.k + 127);
        float q[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = sc(v[i][l][k]);
        const uint2 c = fp8_codes(args.e5m2, q);
        if (valid_cols[i] > 0) {
          store_codes8(args.data + tile.y_off + i * y_cols + l * H, c, tile.vec_out,
                       valid_cols[i]);
        }
      }
    }
  }

  // Column block (l, c) with max key m: its factor for emit_columns, and its scale (when out).
  __device__ __forceinline__ static void reduce_column_block(const QuantizeArgs& args,
                                                             const SharedBuffers& smem,
                                                             const Lane& lane, float, unsigned l,
                                                             unsigned, unsigned c, unsigned m,
                                                             bool out, uint8_t* cb) {
    auto& factors = *reinterpret_cast<float(*)[kOutHalves][kCols]>(smem.block);
    const MxScale sc(m, args.qmax);
    factors[l][c] = sc.factor();
    if (out) cb[l * lane.H + c] = static_cast<uint8_t>(127 - sc.k);
  }

  // Every row of the lane with its columns' factors.
  __device__ __forceinline__ static void emit_columns(const QuantizeArgs& args,
                                                      const SharedBuffers& smem, const Lane& lane,
                                                      const TilePosition& tile, float,
                                                      const ValidCols& valid_cols, const TileY& v) {
    auto& factors = *reinterpret_cast<float(*)[kOutHalves][kCols]>(smem.block);
#pragma unroll
    for (int l = 0; l < kOutHalves; ++l) {
      // Column pairs outer, rows inner: two columns' scales live at a time; the scaled values of
      // a row are kept (float) until its 8 are ready.
      float q[kRowsPerThread][8];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const float2 f =
            lds_f2(reinterpret_cast<const float2*>(&factors[l][lane.tx * 8 + 2 * kk]));
        const MxScale s0(f.x), s1(f.y);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          q[i][2 * kk] = s0(v[i][l][2 * kk]);
          q[i][2 * kk + 1] = s1(v[i][l][2 * kk + 1]);
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const uint2 c = fp8_codes(args.e5m2, q[i]);
        if (valid_cols[i] > 0) {
          store_codes8(args.colwise + tile.y_off + i * lane.y_cols + l * lane.H, c, tile.vec_out,
                       valid_cols[i]);
        }
      }
    }
  }
};

template <typename Spec, typename T, bool kBwd>
struct EmitterOf<QuantEmit::MXFP8, Spec, T, kBwd> {
  using type = Mxfp8Emitter<Spec, T, kBwd>;
};

}  // namespace te_jax::cuda::quant
