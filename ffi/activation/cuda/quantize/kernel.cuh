// The quantizing kernel: per work item (column tile, group of row tiles, batch), per tile
// produce the values (produce.cuh), then emit them in the mode's format (EmitterOf<M>: emit_*.cuh);
// at the end of the item commit the amax and write the dbias partials (dbias.cuh).
// Work items are the grid's (x, y, z), one block each, grid-strided where LaunchConfig::max_blocks
// caps the grid or y / z exceed 65535. A group's tiles step their addresses from one to the next:
// no 64-bit division or product per tile (with a flat item index, the divisions that split it
// cost as much as the tile's own work; NOTES.md).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/dbias.cuh"
#include "activation/cuda/quantize/emit_amax.cuh"
#include "activation/cuda/quantize/emit_mxfp8.cuh"
#include "activation/cuda/quantize/emit_nvfp4.cuh"
#include "activation/cuda/quantize/emit_tensor.cuh"
#include "activation/cuda/quantize/emitter.cuh"
#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/produce.cuh"
#include "activation/cuda/quantize/tile.cuh"
#include "activation/cuda/quantize/values.cuh"
#include "common/formats.h"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda::quant {

template <typename Spec, typename T, QuantEmit M, bool kBwd>
__global__ void __launch_bounds__(kThreads, (kMinBlocksPerSm<Spec, T, M, kBwd>))
    quantize_kernel(const QuantizeArgs args) {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  using Emit = typename EmitterOf<M, Spec, T, kBwd>::type;
  using Loader = TileLoader<Spec, T, kBwd, Emit::kPrefetchInputs>;
  using Dbias = DbiasSums<TileShape::kOutHalves>;
  constexpr int kInHalves = TileShape::kInHalves, kOutHalves = TileShape::kOutHalves;
  constexpr int kRowsPerThread = TileShape::kRowsPerThread, kCols = TileShape::kCols;
  constexpr int kColLanes = TileShape::kColLanes, kRowLanes = TileShape::kRowLanes;
  // The dbias partials alias the emitter's exchange buffer (written after a barrier).
  constexpr size_t kExchangeBytes =
      std::max({Emit::kExchangeBytes,
                kBwd ? Dbias::template kSharedBytes<kRowLanes, kCols> : size_t{0}, size_t{16}});
  __shared__ alignas(16) unsigned char smem_a[kExchangeBytes];
  __shared__ alignas(16) unsigned char smem_b[Emit::kBlockBytes];
  __shared__ alignas(16) uint32_t smem_t[Emit::kTableRows][kFp4TableWords];
  __shared__ alignas(16) uint4 smem_p[Loader::kBufferChunks][Loader::kBufferThreads];

  const int tid = threadIdx.x;
  // Lets the compiler fold index arithmetic that mixes tid with compile-time strides.
  __builtin_assume(tid >= 0 && tid < kThreads);
  const int tx = tid % kColLanes, ty = tid / kColLanes;
  const uint64_t H = args.H, y_cols = args.y_cols, rows_per_batch = args.rows_per_batch;
  const T* x = static_cast<const T*>(args.x);
  const T* dz = static_cast<const T*>(args.dz);
  const bool rowwise = args.data != nullptr, colwise = args.colwise != nullptr;
  const Lane lane{tid, tx, ty, H, y_cols, rows_per_batch, rowwise, colwise};
  const SharedBuffers smem{smem_a, smem_b, smem_t};

  if constexpr (Emit::kTensorScale) {
    if (args.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
      for (uint64_t b = tid; b < args.batches; b += kThreads) {
        args.scale_inv[b] = fmt::div_rn(1.0f, tensor_scale(args, b));
      }
    }
  }

  for (uint32_t b = blockIdx.z; b < args.batches; b += gridDim.z) {
  Emit::begin_batch(args, smem, b);
  // The batch's tensor scale (a load and, for a scale derived from the amax, a division: once per
  // batch, not per tile).
  [[maybe_unused]] float scale = 0.0f;
  if constexpr (Emit::kTensorScale) scale = tensor_scale(args, b);
  // Column tiles outer, groups inner: a block usually keeps its column tile (the grid's x is the
  // column tile count) and walks several groups, so the column set-up runs once.
  for (uint32_t ct = blockIdx.x; ct < args.col_tiles; ct += gridDim.x) {
  const uint64_t tile_c0 = uint64_t{ct} * kCols;
  const uint64_t c0 = tile_c0 + static_cast<uint64_t>(tx) * 8;  // this lane's first column
  const int ncol = c0 < H ? static_cast<int>(std::min<uint64_t>(8, H - c0)) : 0;
  for (uint32_t g = blockIdx.y; g < args.groups; g += gridDim.y) {
    // The group's row tiles: one (groups == row_tiles), or a range of consecutive ones (the dbias
    // groups; the block-scaled modes' blocks, see launch_quantized).
    uint64_t t_begin = g, t_end = uint64_t{g} + 1;
    if (args.groups != args.row_tiles) {
      t_begin = uint64_t{g} * args.row_tiles / args.groups;
      t_end = (uint64_t{g} + 1) * args.row_tiles / args.groups;
    }
    uint32_t amax_key = 0;  // packed max of |y| (Values8::to_key)
    Dbias dbias;
    dbias.zero();

    // This thread's element offsets in x, dz and y at (its first row of the group's first tile,
    // c0); each tile steps them by its rows' strides instead of multiplying per tile.
    const uint64_t row_first =
        b * rows_per_batch + t_begin * kTileRows + static_cast<uint64_t>(ty) * kRowsPerThread;
    uint64_t x_off = row_first * (kInHalves * H) + c0;
    [[maybe_unused]] uint64_t z_off = row_first * H + c0;
    uint64_t y_off = row_first * y_cols + c0;
    Loader loader{x, dz, H, tid, smem_p, false};
    for (uint64_t rt = t_begin; rt < t_end; ++rt, x_off += kTileRows * kInHalves * H,
                  z_off += kTileRows * H, y_off += kTileRows * y_cols) {
      const uint64_t r0 = b * rows_per_batch + rt * kTileRows;  // the tile's first row
      const int tile_rows =
          static_cast<int>(std::min<uint64_t>(kTileRows, rows_per_batch - rt * kTileRows));
      // Whole tiles (every row and column inside, 16-byte loads and vector stores) take the
      // second copy of the tile body where the emitter asks for one (Emit::kWholeTileCopy).
      const bool whole =
          tile_rows == kTileRows && tile_c0 + kCols <= H && args.vec_in && args.vec_out;
      auto tile = [&](auto whole_tag) {
        constexpr bool kWhole = decltype(whole_tag)::value;
        const bool vec_in = kWhole || args.vec_in;
        const TilePosition pos{b,      rt, r0, tile_c0, kWhole ? kTileRows : tile_rows,
                               y_off, kWhole || args.vec_out};
        int valid_cols[kRowsPerThread];
        // All of the tile's loads, then compute.
        RawWords8<T> in[kRowsPerThread][TileShape::kLoadsPerRow];
        loader.template load<kWhole>(lane, pos, t_end, x_off, z_off, ncol, vec_in, in, valid_cols);
        Values8<T> v[kRowsPerThread][kOutHalves];
        compute_tile_values<Spec, T, kBwd>(args, in, valid_cols, v, amax_key, dbias);
        Emit::template emit<kWhole>(args, smem, lane, pos, scale, valid_cols, v);
      };
      if (Emit::kWholeTileCopy && whole) {
        tile(std::integral_constant<bool, Emit::kWholeTileCopy>{});
      } else {
        tile(std::false_type{});
      }
    }

    // ---- end of the item: amax, dbias partials ----
    if (args.amax != nullptr) {
      block_amax_commit(Values8<T>::to_key(amax_key), args.amax + b);
      __syncthreads();  // its shared scratch is reused by the next item
    }
    if constexpr (kBwd) {
      if (args.dbias_ws != nullptr) {
        dbias.template write<kRowLanes, kCols>(args, lane, smem_a, b, g, tile_c0);
      }
    }
  }  // groups
  }  // column tiles
  }  // batches
}

}  // namespace te_jax::cuda::quant
