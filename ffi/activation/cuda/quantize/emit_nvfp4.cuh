// NVFP4: 16-element blocks, E4M3 block scales under the batch's tensor scale S, E2M1 codes packed
// two per byte (4 bytes per lane and row). Rowwise a block is 2 adjacent lanes; colwise 16 rows
// of a column (two blocks per 32-row tile; emit_block_scaled.cuh). For 16-bit inputs the codes
// are counts of thresholds reached, compared two values at a time (kFp4ByCompare), from the
// table each block builds per tensor scale; float32 inputs divide by the block scale.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/codes.cuh"
#include "activation/cuda/quantize/emit_block_scaled.cuh"
#include "activation/cuda/quantize/emitter.cuh"
#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/nvfp4_codes.cuh"
#include "activation/cuda/quantize/tile.cuh"
#include "common/formats.h"

namespace te_jax::cuda::quant {

template <typename Spec, typename T, bool kBwd>
struct Nvfp4Emitter
    : BlockScaledEmitter<Nvfp4Emitter<Spec, T, kBwd>, Spec, T, kBwd> {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  static constexpr int kOutHalves = TileShape::kOutHalves;
  static constexpr int kRowsPerThread = TileShape::kRowsPerThread;
  static constexpr int kCols = TileShape::kCols, kColLanes = TileShape::kColLanes;
  static constexpr int kBlock = 16;
  static constexpr int kGroupLanes = 2;
  static constexpr int kColBlocks = 2;
  static constexpr bool kByCompare = kFp4ByCompare<T>;
  static constexpr bool kTensorScale = true;
  // Measured slower with the prefetch of the next tile's inputs (NOTES.md): loads
  // directly.
  static constexpr bool kPrefetchInputs = false;
  // Per column block [kOutHalves][kColBlocks][kCols]: the decoded E4M3 block scale and its
  // reciprocal ([2][...] float), or for 16-bit inputs the block's thresholds and special-case
  // masks ([kOutHalves][kColBlocks][8][kCols] u16).
  static constexpr size_t kBlockBytes = kByCompare
                                            ? size_t{kOutHalves} * kColBlocks * 8 * kCols * 2
                                            : size_t{2} * kOutHalves * kColBlocks * kCols * 4;
  static constexpr int kTableRows = kByCompare ? 128 : 1;
  // The tile's values (produce.cuh): v[i][l] row i, half l; valid_cols[i] its columns inside.
  using ValidCols = int[kRowsPerThread];
  using TileY = Values8<T>[kRowsPerThread][kOutHalves];

  // 16-bit inputs: the threshold table of the batch's tensor scale.
  __device__ __forceinline__ static void begin_batch(const QuantizeArgs& args,
                                                     const SharedBuffers& smem, uint32_t batch) {
    if constexpr (kByCompare) {
      __syncthreads();  // the previous batch's table is read until here
      build_fp4_table<T>(*reinterpret_cast<Fp4Table*>(smem.fp4_table), tensor_scale(args, batch));
      __syncthreads();
    }
  }

  // Row i, half l: its block's scale (by the block's first lane) and its 8 codes.
  __device__ __forceinline__ static void emit_rows(
      const QuantizeArgs& args, const SharedBuffers& smem, const Lane& lane,
      const TilePosition& tile, float scale, const ValidCols& valid_cols, const TileY& v,
      const unsigned (&keys)[kOutHalves][kRowsPerThread]) {
    // The block scales of this lane's rows: row i, half l at bsr[i * bs_row + l * bs_half],
    // for the lanes that store them (c0 % kBlock == 0; the rowwise layout needs
    // y_cols % kBlock == 0, so row * y_cols / kBlock + c0 / kBlock = y_off / kBlock).
    const uint64_t y_cols = lane.y_cols, H = lane.H;
    const uint64_t bs_row = y_cols / kBlock, bs_half = H / kBlock;
    uint8_t* const bsr = args.block_scale + tile.y_off / kBlock;
    // 16-bit inputs: the two lanes of a block hold the same keys; each computes the scale codes
    // of half of the rows (lane tx % 2 == h takes rows [h R / 2, (h + 1) R / 2), R =
    // kRowsPerThread is 2 or 4 here) and gives them to the other: one shuffle for ~16
    // instructions of nvfp4_scale, most of them on the ALU pipe (NOTES.md).
    [[maybe_unused]] uint8_t fp4_codes[kOutHalves][kRowsPerThread];
    if constexpr (kByCompare) {
      constexpr int kHalfRows = kRowsPerThread / 2;
      const bool upper = (lane.tx & 1) != 0;
#pragma unroll
      for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
        for (int k = 0; k < kHalfRows; ++k) {
          const uint8_t mine = nvfp4_scale(upper ? keys[l][kHalfRows + k] : keys[l][k], scale);
          const uint8_t other =
              static_cast<uint8_t>(__shfl_xor_sync(0xffffffffu, unsigned{mine}, 1));
          fp4_codes[l][k] = upper ? other : mine;
          fp4_codes[l][kHalfRows + k] = upper ? mine : other;
        }
      }
    }
#pragma unroll
    for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        uint8_t* const bs_at = bsr + i * bs_row + l * bs_half;
        const bool lead = (lane.tx & (kGroupLanes - 1)) == 0;
        if constexpr (kByCompare) {
          const uint8_t code = fp4_codes[l][i];
          if (valid_cols[i] > 0 && lead) *bs_at = code;
          const uint32_t* const row = smem.fp4_table[code & 0x7fu];
          const uint4 t0 = reinterpret_cast<const uint4*>(row)[0];
          const uint4 t1 = reinterpret_cast<const uint4*>(row)[1];
          const uint32_t y[7] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z};
          const uint32_t keep = t1.w, nan_codes = row[8];
          uint32_t codes = 0;
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            codes = fp4_place(codes, fp4_pair(v[i][l].w[p], y), p);
          }
          if (valid_cols[i] > 0) {
            store_fp4x8(args.data + tile.y_off / 2 + i * (y_cols / 2) + l * (H / 2),
                        (codes & keep) | nan_codes, tile.vec_out, valid_cols[i]);
          }
        } else {
          const uint8_t code = nvfp4_scale(keys[l][i], scale);
          if (valid_cols[i] > 0 && lead) *bs_at = code;
          float bs[8], rb[8];
          const float bsv = fmt::from_e4m3(code), rbv = __frcp_rn(bsv);
#pragma unroll
          for (int k = 0; k < 8; ++k) bs[k] = bsv, rb[k] = rbv;
          if (valid_cols[i] > 0) {
            store_fp4x8(args.data + tile.y_off / 2 + i * (y_cols / 2) + l * (H / 2),
                        nvfp4_codes(v[i][l], scale, bs, rb), tile.vec_out,
                        valid_cols[i]);
          }
        }
      }
    }
  }

  // Column block (l, blk, c) with max key m: what emit_columns needs of it, and its scale code
  // (when out).
  __device__ __forceinline__ static void reduce_column_block(const QuantizeArgs&,
                                                             const SharedBuffers& smem,
                                                             const Lane& lane, float scale,
                                                             unsigned l, unsigned blk, unsigned c,
                                                             unsigned m, bool out, uint8_t* cb) {
    const uint8_t code = nvfp4_scale(m, scale);
    if constexpr (kByCompare) {
      // The block's thresholds from the table, and its special case: row 7 holds the nibble
      // mask of the codes kept (0xf, or 0 for a zero or NaN scale) in the low byte and the NaN
      // code (8 or 0) in the high one.
      auto& thh = *reinterpret_cast<uint16_t(*)[kOutHalves][kColBlocks][8][kCols]>(smem.block);
      // Column c is half c % 2 of pair (c % 8) / 2 of lane c / 8.
      const int slot = 2 * fp4_pair_slot<kColLanes>(c / 8, (c % 8) / 2) + c % 2;
      const uint32_t cc = code & 0x7fu;
#pragma unroll
      for (int j = 0; j < 7; ++j) {
        thh[l][blk][j][slot] = static_cast<uint16_t>(smem.fp4_table[cc][j]);
      }
      thh[l][blk][7][slot] = static_cast<uint16_t>(cc == 0u ? 0u : (cc == 0x7fu ? 0x800u : 0xfu));
    } else {
      // The decoded block scales, then their reciprocals RN(1 / bs).
      auto& fp4_bs = *reinterpret_cast<float(*)[2][kOutHalves][kColBlocks][kCols]>(smem.block);
      const float bs = fmt::from_e4m3(code);
      fp4_bs[0][l][blk][c] = bs;
      fp4_bs[1][l][blk][c] = __frcp_rn(bs);
    }
    if (out) cb[blk * lane.y_cols + l * lane.H + c] = code;
  }

  // Every row of the lane with its columns' block scales (its rows are in one block).
  __device__ __forceinline__ static void emit_columns(const QuantizeArgs& args,
                                                      const SharedBuffers& smem, const Lane& lane,
                                                      const TilePosition& tile, float scale,
                                                      const ValidCols& valid_cols, const TileY& v) {
    const int tx = lane.tx;
    const int blk = (lane.ty * kRowsPerThread) / 16;
#pragma unroll
    for (int l = 0; l < kOutHalves; ++l) {
      if constexpr (kByCompare) {
        const auto& thw =
            *reinterpret_cast<const uint32_t(*)[kOutHalves][kColBlocks][8][kCols / 2]>(smem.block);
        // One column pair at a time (its 7 thresholds live), rows inner; part[i]: row i's codes
        // so far, pair p's byte placed at byte p.
        uint32_t part[kRowsPerThread];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          uint32_t y[7];
#pragma unroll
          for (int j = 0; j < 7; ++j) y[j] = thw[l][blk][j][fp4_pair_slot<kColLanes>(tx, p)];
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
            part[i] = fp4_place(p == 0 ? 0u : part[i], fp4_pair(v[i][l].w[p], y), p);
          }
        }
        // Row 7: per column pair, [keep0 | nan0 << 8, keep1 | nan1 << 8]; q | q >> 12 puts the
        // pair's keep byte in byte 0 and its NaN byte in byte 1.
        uint32_t z[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          const uint32_t q = thw[l][blk][7][fp4_pair_slot<kColLanes>(tx, p)];
          z[p] = q | (q >> 12);
        }
        const uint32_t keep = prmt(prmt(z[0], z[1], 0x40u), prmt(z[2], z[3], 0x40u), 0x5410u);
        const uint32_t nanc = prmt(prmt(z[0], z[1], 0x51u), prmt(z[2], z[3], 0x51u), 0x5410u);
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          if (valid_cols[i] > 0) {
            store_fp4x8(args.colwise + tile.y_off / 2 + i * (lane.y_cols / 2) + l * (lane.H / 2),
                        (part[i] & keep) | nanc, tile.vec_out, valid_cols[i]);
          }
        }
      } else {
        auto& fp4_bs = *reinterpret_cast<float(*)[2][kOutHalves][kColBlocks][kCols]>(smem.block);
        const float4* src = reinterpret_cast<const float4*>(&fp4_bs[0][l][blk][tx * 8]);
        const float4* srr = reinterpret_cast<const float4*>(&fp4_bs[1][l][blk][tx * 8]);
        const float4 u0 = src[0], u1 = src[1], w0 = srr[0], w1 = srr[1];
        const float bs[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
        const float rb[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          if (valid_cols[i] > 0) {
            store_fp4x8(args.colwise + tile.y_off / 2 + i * (lane.y_cols / 2) + l * (lane.H / 2),
                        nvfp4_codes(v[i][l], scale, bs, rb), tile.vec_out,
                        valid_cols[i]);
          }
        }
      }
    }
  }
};

template <typename Spec, typename T, bool kBwd>
struct EmitterOf<QuantEmit::NVFP4, Spec, T, kBwd> {
  using type = Nvfp4Emitter<Spec, T, kBwd>;
};

}  // namespace te_jax::cuda::quant
