// The quantizing kernel's shared memory, per instantiation: what each region holds in each mode.
#pragma once

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "cuda/device_utils.cuh"
#include "cuda/quantize/geometry.cuh"
#include "cuda/quantize/nvfp4_codes.cuh"

namespace te_jax::cuda::quant {

template <typename Spec, typename T, Mode M, bool kBwd>
struct SharedLayout {
  using Geo = TileGeometry<Spec, T, kBwd>;
  static constexpr int kInHalves = Geo::kInHalves, kOutHalves = Geo::kOutHalves;
  static constexpr int kRowsPerThread = Geo::kRowsPerThread, kCols = Geo::kCols;
  static constexpr int kRowLanes = Geo::kRowLanes;
  static constexpr bool kBlockScaled = M == Mode::kMx || M == Mode::kNvfp4;
  static constexpr int kColBlocks = M == Mode::kNvfp4 ? 2 : 1;  // colwise blocks per tile column
  // Region A (exchange between lanes): TENSOR: transposed codes [kOutHalves][32][stride] bytes;
  // MX / NVFP4: per-lane column keys [kOutHalves][kRowLanes][kCols] u32. The dbias partials
  // [kOutHalves][kRowLanes][kCols] f32 alias it (used after a barrier). The transposed codes'
  // row stride: with 4 rows per thread each row is padded by one bank word (an odd number of
  // words puts the rows 8 apart that a gather reads on different banks).
  static constexpr int kTransposedStride = kRowsPerThread == 4 ? kCols + 4 : kCols;
  static constexpr size_t kTensorBytes =
      M == Mode::kTensor ? size_t{kOutHalves} * kTileRows * kTransposedStride : 0;
  static constexpr size_t kRedBytes = kBlockScaled ? size_t{kOutHalves} * kRowLanes * kCols * 4 : 0;
  static constexpr size_t kPartBytes = kBwd ? size_t{kOutHalves} * kRowLanes * kCols * 4 : 0;
  static constexpr size_t kExchangeBytes =
      std::max({kTensorBytes, kRedBytes, kPartBytes, size_t{16}});
  // Region B (per column block [kOutHalves][kColBlocks][kCols]): MX: the scaling factor
  // (MxScale::factor, float); NVFP4: the decoded E4M3 block scale and its reciprocal
  // ([2][kOutHalves][kColBlocks][kCols] float), or for 16-bit inputs the block's thresholds and
  // special-case masks ([kOutHalves][kColBlocks][8][kCols] u16, see kFp4ByCompare).
  static constexpr bool kFp4Cmp = M == Mode::kNvfp4 && kFp4ByCompare<T>;
  static constexpr size_t kBlockBytes =
      M == Mode::kMx        ? size_t{kOutHalves} * kCols * 4
      : M != Mode::kNvfp4 ? 16
      : kFp4Cmp           ? size_t{kOutHalves} * kColBlocks * 8 * kCols * 2
                          : size_t{2} * kOutHalves * kColBlocks * kCols * 4;
  // Region T (16-bit NVFP4): the threshold table of the batch's tensor scale.
  static constexpr int kTableRows = kFp4Cmp ? 128 : 1;
  // Region P (the MXFP8 forward): the next whole tile's inputs, copied asynchronously while this
  // one is computed: per thread kRowsPerThread * kInHalves loads of 8 elements, in 16-byte chunks
  // [chunk][thread] (a warp's chunk is 512 contiguous bytes: no bank conflicts). Measured faster
  // for the MXFP8 forward and slower for the NVFP4 one, which loads directly (ffi/cuda/NOTES.md,
  // "The ALU pipe").
  static constexpr bool kPrefetch = !kBwd && M == Mode::kMx;
  static constexpr int kChunksPerLoad = static_cast<int>(sizeof(T)) / 2;  // 16-byte chunks
  static constexpr int kChunks = kRowsPerThread * kInHalves * kChunksPerLoad;
  static constexpr int kPrefetchChunks = kPrefetch ? kChunks : 1;
  // Chunk c holds quarter q of the load of half h of row i (in[i][h].w[4q .. 4q + 3]).
  struct Chunk {
    int i, h, q;
  };
  static constexpr Chunk chunk(int c) {
    return {c / (kInHalves * kChunksPerLoad), (c / kChunksPerLoad) % kInHalves,
            c % kChunksPerLoad};
  }
};

}  // namespace te_jax::cuda::quant
