// The amax pass (the first pass of CURRENT scaling): nothing per tile. The max keys of |y| are
// gathered while the values are produced (produce.cuh, in every mode whose amax output is
// wanted) and committed per work item by the kernel: the integer max of |y|'s bits (NaN above
// inf), block-reduced, one atomicMax per batch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/emitter.cuh"
#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/tile.cuh"

namespace te_jax::cuda::quant {

template <typename Spec, typename T, bool kBwd>
struct AmaxEmitter {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  static constexpr bool kTensorScale = false;
  static constexpr bool kWholeTileCopy = false;
  static constexpr bool kPrefetchInputs = false;
  static constexpr size_t kExchangeBytes = 0;
  static constexpr size_t kBlockBytes = 16;
  static constexpr int kTableRows = 1;
  using ValidCols = int[TileShape::kRowsPerThread];
  using TileY = Values8<T>[TileShape::kRowsPerThread][TileShape::kOutHalves];

  __device__ __forceinline__ static void begin_batch(const QuantizeArgs&, const SharedBuffers&,
                                                     uint32_t) {}

  template <bool kWhole>
  __device__ __forceinline__ static void emit(const QuantizeArgs&, const SharedBuffers&,
                                              const Lane&, const TilePosition&, float,
                                              const ValidCols&, const TileY&) {}
};

template <typename Spec, typename T, bool kBwd>
struct EmitterOf<QuantEmit::AMAX_PASS, Spec, T, kBwd> {
  using type = AmaxEmitter<Spec, T, kBwd>;
};

}  // namespace te_jax::cuda::quant
