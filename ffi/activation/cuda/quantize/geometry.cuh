// The quantizing kernel's tile shape and lane layout, and its register cap. Its template takes the
// QuantEmit (common/scaling.h) it emits: FP8 codes under a tensor scale, MXFP8 codes and E8M0
// block scales, NVFP4 codes and E4M3 block scales, or nothing but the amax (the amax pass).
#pragma once

#include <type_traits>

#include "common/scaling.h"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda::quant {

constexpr int kTileRows = 32;

// The tile geometry of one instantiation. A column lane owns 8 consecutive columns (one 16-byte
// load of a 16-bit dtype, two of float32), a row lane kRowsPerThread consecutive rows, chosen so
// that each thread issues >= 64 bytes of loads per tile before it computes.
template <typename Spec, typename T, bool kBwd>
struct TileGeometry {
  static constexpr int kInHalves = Spec::kActLen;              // halves of x (2: gated)
  static constexpr int kOutHalves = kBwd ? kInHalves : 1;      // halves of y
  static constexpr int kLoadsPerRow = kInHalves + (kBwd ? 1 : 0);  // 8-element loads per row
  static constexpr int kLoadBytesPerRow = 8 * static_cast<int>(sizeof(T)) * kLoadsPerRow;
  static constexpr int kRowsPerThread =
      kLoadBytesPerRow >= 64 ? 1 : (kLoadBytesPerRow >= 32 ? 2 : 4);
  static constexpr int kCols = 64 * kRowsPerThread;           // tile columns (of each half)
  static constexpr int kColLanes = 8 * kRowsPerThread;
  static constexpr int kRowLanes = kThreads / kColLanes;      // = 32 / kRowsPerThread
  static_assert(kRowLanes * kRowsPerThread == kTileRows, "row lanes x rows per lane = tile rows");
};

// Blocks per SM the registers are capped for: the tightest cap that did not spill (GELU_EXACT
// aside): 4 (<= 64 registers) for the tensor-scaled and amax kernels, 3 (<= 80) for the
// block-scaled ones, 2 (<= 128) for the gated backward. The NVFP4 forward of 16-bit inputs
// (codes by comparison) takes 4 too: measured faster than 3 (NOTES.md), though most of
// its bf16 instantiations then spill 8 bytes.
template <typename Spec, typename T, QuantEmit M, bool kBwd>
constexpr int kMinBlocksPerSm = (kBwd && Spec::kGated)                       ? 2
                                : (M == QuantEmit::TENSOR || M == QuantEmit::AMAX_PASS) ? 4
                                : (M == QuantEmit::NVFP4 && !std::is_same_v<T, float> && !kBwd) ? 4
                                                                           : 3;

}  // namespace te_jax::cuda::quant
