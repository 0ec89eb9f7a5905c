// The part of MXFP8 and NVFP4 emission that the two share (emit_mxfp8.cuh, emit_nvfp4.cuh supply
// the format): the block maxima.
//   rowwise  a block is kGroupLanes adjacent lanes of one row: xor shuffles of the max key;
//   colwise  each lane's per-column max over its rows goes to shared memory, one thread per
//            column block reduces them and computes the block's scale and scaling factors once
//            (Format::reduce_column_block), and every lane encodes its rows with its columns'
//            factors (Format::emit_columns); colwise codes keep the rowwise layout (one store
//            per lane and row). Two barriers per tile.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/emitter.cuh"
#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/tile.cuh"
#include "activation/cuda/quantize/values.cuh"

namespace te_jax::cuda::quant {

// Format (CRTP) provides kBlock (elements per block), kGroupLanes (lanes per rowwise block),
// kColBlocks (colwise blocks per tile column), emit_rows, reduce_column_block and emit_columns.
template <typename Format, typename Spec, typename T, bool kBwd>
struct BlockScaledEmitter {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  static constexpr int kOutHalves = TileShape::kOutHalves;
  static constexpr int kRowsPerThread = TileShape::kRowsPerThread;
  static constexpr int kCols = TileShape::kCols, kRowLanes = TileShape::kRowLanes;
  // The whole tiles of the forward (every row and column inside, vector loads and stores),
  // nearly all of a large input, run a copy of the tile body whose edge checks are constants
  // (branches were a large share of the instructions: NOTES.md, "Per-tile overhead").
  // The backward keeps one copy: the second one added spills there.
  static constexpr bool kWholeTileCopy = !kBwd;
  // The per-lane column maxima [kOutHalves][kRowLanes][kCols] u32.
  static constexpr size_t kExchangeBytes = size_t{kOutHalves} * kRowLanes * kCols * 4;
  // The tile's values (produce.cuh): v[i][l] row i, half l; valid_cols[i] its columns inside.
  using ValidCols = int[kRowsPerThread];
  using TileY = Values8<T>[kRowsPerThread][kOutHalves];

  template <bool kWhole>
  __device__ __forceinline__ static void emit(const QuantizeArgs& args, const SharedBuffers& smem,
                                              const Lane& lane, const TilePosition& tile,
                                              float scale, const ValidCols& valid_cols,
                                              const TileY& v) {
    const bool rowwise = lane.rowwise, colwise = lane.colwise;
    if (rowwise) {
      // The block maxima of all rows first (the shuffles' latencies overlap), then one row at
      // a time.
      unsigned keys[kOutHalves][kRowsPerThread];
#pragma unroll
      for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          keys[l][i] = Values8<T>::to_key(packed_max8(v[i][l]));
        }
      }
#pragma unroll
      for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          unsigned key = keys[l][i];
          key = max(key, __shfl_xor_sync(0xffffffffu, key, 1));
          if constexpr (Format::kGroupLanes == 4) {
            key = max(key, __shfl_xor_sync(0xffffffffu, key, 2));
          }
          keys[l][i] = key;
        }
      }
      Format::emit_rows(args, smem, lane, tile, scale, valid_cols, v, keys);
    }
    if (colwise) {
      auto& red = *reinterpret_cast<unsigned(*)[kOutHalves][kRowLanes][kCols]>(smem.exchange);
      // Per-lane column maxima over the lane's rows (all in one column block: kRowsPerThread
      // divides 16).
#pragma unroll
      for (int l = 0; l < kOutHalves; ++l) {
        unsigned ck[8];
        if constexpr (std::is_same_v<T, float>) {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            ck[k] = v[0][l].key_word(k);
#pragma unroll
            for (int i = 1; i < kRowsPerThread; ++i) ck[k] = max(ck[k], v[i][l].key_word(k));
          }
        } else {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t m = v[0][l].key_word(j);
#pragma unroll
            for (int i = 1; i < kRowsPerThread; ++i) {
              m = Values8<T>::key_max(m, v[i][l].key_word(j));
            }
            ck[2 * j] = Values8<T>::key_lo(m);
            ck[2 * j + 1] = Values8<T>::key_hi(m);
          }
        }
        uint4* dst = reinterpret_cast<uint4*>(&red[l][lane.ty][lane.tx * 8]);
        dst[0] = make_uint4(ck[0], ck[1], ck[2], ck[3]);
        dst[1] = make_uint4(ck[4], ck[5], ck[6], ck[7]);
      }
      __syncthreads();
      // Column block maxima (and the colwise block scales) by kOutHalves * kColBlocks * kCols
      // threads, in an unrolled loop whose index arithmetic folds (a runtime loop spent most of
      // the reducers' instructions on index and address arithmetic). cb: the tile's first row of
      // colwise block scales, at its column 0 (block row (first_row + 16 blk) / 16 =
      // first_row / 16 + blk for NVFP4, first_row / 32 for MXFP8).
      constexpr int kColBlocks = Format::kColBlocks;
      constexpr int kLanesPerBlk = kRowLanes / kColBlocks;
      constexpr int kRedItems = kOutHalves * kColBlocks * kCols;
      uint8_t* const cb =
          args.colwise_block_scale + (tile.first_row / Format::kBlock) * lane.y_cols +
          tile.first_col;
#pragma unroll
      for (int e0 = 0; e0 < kRedItems; e0 += kThreads) {
        const unsigned e = static_cast<unsigned>(e0 + lane.tid);
        if (kRedItems % kThreads != 0 && e >= kRedItems) break;
        const unsigned l = e / (kColBlocks * kCols), blk = (e / kCols) % kColBlocks,
                       c = e % kCols;
        unsigned m = 0;
#pragma unroll
        for (int t = 0; t < kLanesPerBlk; ++t) m = max(m, red[l][blk * kLanesPerBlk + t][c]);
        const bool out = tile.first_col + c < lane.H && static_cast<int>(blk) * 16 < tile.rows;
        Format::reduce_column_block(args, smem, lane, scale, l, blk, c, m, out, cb);
      }
      __syncthreads();
      Format::emit_columns(args, smem, lane, tile, scale, valid_cols, v);
      // red and the factors: the next tile writes red only after every thread passed the
      // barrier above (so the reads of red are done), and the factors after its own first.
    }
  }
};

}  // namespace te_jax::cuda::quant
