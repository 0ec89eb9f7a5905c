// TENSOR (DELAYED / CURRENT scaling): codes = fmt(y * scale[batch]), 8 bytes per lane and row in
// one store. The colwise (transposed) layout goes through shared memory: the codes are stored
// row-major, and after a barrier each thread gathers 8 kRowsPerThread bytes of
// colwise[batch][col][row] and stores them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/codes.cuh"
#include "activation/cuda/quantize/emitter.cuh"
#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/tile.cuh"

namespace te_jax::cuda::quant {

template <typename Spec, typename T, bool kBwd>
struct TensorEmitter {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  static constexpr int kOutHalves = TileShape::kOutHalves;
  static constexpr int kRowsPerThread = TileShape::kRowsPerThread;
  static constexpr int kCols = TileShape::kCols;
  static constexpr bool kTensorScale = true;
  // One copy of the tile body: a second one for whole tiles added spills here (measured slower:
  // NOTES.md, "Per-tile overhead").
  static constexpr bool kWholeTileCopy = false;
  static constexpr bool kPrefetchInputs = false;
  // The transposed codes' row stride: with 4 rows per thread each row is padded by one bank word
  // (an odd number of words puts the rows 8 apart that a gather reads on different banks).
  static constexpr int kStride = kRowsPerThread == 4 ? kCols + 4 : kCols;
  static constexpr size_t kExchangeBytes = size_t{kOutHalves} * kTileRows * kStride;
  static constexpr size_t kBlockBytes = 16;
  static constexpr int kTableRows = 1;
  // The tile's values (produce.cuh): v[i][l] row i, half l; valid_cols[i] its columns inside.
  using ValidCols = int[kRowsPerThread];
  using TileY = Values8<T>[kRowsPerThread][kOutHalves];

  __device__ __forceinline__ static void begin_batch(const QuantizeArgs&, const SharedBuffers&,
                                                     uint32_t) {}

  // The format is a branch per tile (warp-uniform), so each copy converts in one format: with the
  // format chosen per value the compiler predicated both conversions and E5M2's NaN vote. Not in
  // the gated backward, whose registers (128) spilled with two copies.
  static constexpr bool kFormatCopies = !(kBwd && Spec::kGated);
  template <bool kWhole>
  __device__ __forceinline__ static void emit(const QuantizeArgs& args, const SharedBuffers& smem,
                                              const Lane& lane, const TilePosition& tile,
                                              float scale, const ValidCols& valid_cols,
                                              const TileY& v) {
    auto& tcodes = *reinterpret_cast<uint8_t(*)[kOutHalves][kTileRows][kStride]>(smem.exchange);
    if constexpr (!kFormatCopies) {
      emit_codes<Fp8Format::kRuntime>(args, lane, tile, scale, valid_cols, v, tcodes);
    } else if (args.e5m2) {
      emit_codes<Fp8Format::kE5M2>(args, lane, tile, scale, valid_cols, v, tcodes);
    } else {
      emit_codes<Fp8Format::kE4M3>(args, lane, tile, scale, valid_cols, v, tcodes);
    }
    if (lane.colwise) {
      __syncthreads();
      store_transposed(args, lane, tile, tcodes);
      __syncthreads();  // tcodes is rewritten by the next tile
    }
  }

  // The rowwise codes to y, and to tcodes (row-major) for the colwise layout.
  template <Fp8Format kFmt>
  __device__ __forceinline__ static void emit_codes(
      const QuantizeArgs& args, const Lane& lane, const TilePosition& tile, float scale,
      const ValidCols& valid_cols, const TileY& v,
      uint8_t (&tcodes)[kOutHalves][kTileRows][kStride]) {
    const bool rowwise = lane.rowwise, colwise = lane.colwise;
    const int tx = lane.tx, ty = lane.ty;
    const uint64_t H = lane.H, y_cols = lane.y_cols;
#pragma unroll
    for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const int ri = ty * kRowsPerThread + i;
        const uint2 c = tensor_codes<kFmt>(v[i][l], scale, args.e5m2);
        if (rowwise && valid_cols[i] > 0) {
          store_codes8(args.data + tile.y_off + i * y_cols + l * H, c, tile.vec_out,
                       valid_cols[i]);
        }
        if (colwise) {
          // Two 4-byte stores: the padded stride keeps only 4-byte alignment.
          uint32_t* t = reinterpret_cast<uint32_t*>(&tcodes[l][ri][tx * 8]);
          t[0] = c.x;
          t[1] = c.y;
        }
      }
    }
  }

  // The tile's colwise codes from the row-major tcodes into colwise[batch][col][row].
  __device__ __forceinline__ static void store_transposed(
      const QuantizeArgs& args, const Lane& lane, const TilePosition& tile,
      const uint8_t (&tcodes)[kOutHalves][kTileRows][kStride]) {
    const int tid = lane.tid;
    const uint64_t H = lane.H, y_cols = lane.y_cols, rows_per_batch = lane.rows_per_batch;
    const int rows = tile.rows;
    // The tile's column (l * H + col) of batch b starts at this offset + (l * H + col) * rows.
    const auto dst_at = [&](int l, uint64_t col, int first) {
      return args.colwise + tile.batch * y_cols * rows_per_batch +
             (l * H + col) * rows_per_batch + tile.row_tile * kTileRows + first;
    };
    if constexpr (kRowsPerThread == 4) {
      // Thread = (column group of 4 columns, row quarter q of 8 rows): 8 shared loads of 4 codes
      // (one row of the group each), two 4x4 byte transposes, then per column one 8-byte store
      // of its 8 rows. The 4 lanes of a group fill each column's 32-byte sector in one store
      // instruction (8 whole sectors per instruction; one column per thread wrote 16-byte
      // halves, 32 per instruction, well below copy bandwidth: NOTES.md).
      const int q = tid & 3, grp = tid >> 2;
      const int rb = 8 * q;
      const uint64_t col0 = tile.first_col + 4 * grp;
      if (col0 < H && rb < rows) {
#pragma unroll
        for (int l = 0; l < kOutHalves; ++l) {
          uint32_t w[8];
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            w[r] = *reinterpret_cast<const uint32_t*>(&tcodes[l][rb + r][4 * grp]);
          }
          uint32_t cw[4][2];  // column k: rows 0-3, rows 4-7 (first row in the low byte)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t* x = w + 4 * h;
            const uint32_t t0 = __byte_perm(x[0], x[1], 0x5140);
            const uint32_t t1 = __byte_perm(x[2], x[3], 0x5140);
            const uint32_t t2 = __byte_perm(x[0], x[1], 0x7362);
            const uint32_t t3 = __byte_perm(x[2], x[3], 0x7362);
            cw[0][h] = __byte_perm(t0, t1, 0x5410);
            cw[1][h] = __byte_perm(t0, t1, 0x7632);
            cw[2][h] = __byte_perm(t2, t3, 0x5410);
            cw[3][h] = __byte_perm(t2, t3, 0x7632);
          }
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const uint64_t col = col0 + k;
            if (col < H) {
              uint8_t* dst = dst_at(l, col, rb);
              if (args.vec_transposed) {  // the 8 rows are whole (rows_per_batch % 32 == 0)
                asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(cw[k][0]),
                             "r"(cw[k][1])
                             : "memory");
              } else {
                const int m = min(8, rows - rb);
                for (int j = 0; j < m; ++j) {
                  dst[j] = static_cast<uint8_t>(cw[k][j >> 2] >> (8 * (j & 3)));
                }
              }
            }
          }
        }
      }
    } else {
      // Thread = (column, chunk of 8 kRowsPerThread rows): gathers its column's codes of the
      // chunk and stores them at once.
      constexpr int kChunks = kThreads / kCols;        // 4 / kRowsPerThread
      constexpr int kChunkRows = kTileRows / kChunks;  // 8 kRowsPerThread
      const int tc = tid % kCols, ch = tid / kCols;
      const int rb = ch * kChunkRows;
      const uint64_t col = tile.first_col + tc;
      if (col < H && rb < rows) {
#pragma unroll
        for (int l = 0; l < kOutHalves; ++l) {
          uint8_t* dst = dst_at(l, col, rb);
          if (args.vec_transposed) {  // the chunk is whole (rows_per_batch % kChunkRows == 0)
            uint32_t w[kChunkRows / 4];
#pragma unroll
            for (int j = 0; j < kChunkRows / 4; ++j) {
              w[j] = static_cast<uint32_t>(tcodes[l][rb + 4 * j][tc]) |
                     (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 1][tc]) << 8) |
                     (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 2][tc]) << 16) |
                     (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 3][tc]) << 24);
            }
            if constexpr (kChunkRows == 8) {
              asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(w[0]), "r"(w[1])
                           : "memory");
            } else {
#pragma unroll
              for (int j = 0; j < kChunkRows / 16; ++j) {
                asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 16 * j),
                             "r"(w[4 * j]), "r"(w[4 * j + 1]), "r"(w[4 * j + 2]),
                             "r"(w[4 * j + 3])
                             : "memory");
              }
            }
          } else {
            const int m = min(kChunkRows, rows - rb);
            for (int j = 0; j < m; ++j) dst[j] = tcodes[l][rb + j][tc];
          }
        }
      }
    }
  }
};

template <typename Spec, typename T, bool kBwd>
struct EmitterOf<QuantEmit::TENSOR, Spec, T, kBwd> {
  using type = TensorEmitter<Spec, T, kBwd>;
};

}  // namespace te_jax::cuda::quant
