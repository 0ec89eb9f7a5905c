// dbias partial sums (backward with a workspace): unrounded float32 sums in registers, each thread
// adding its rows in row order, tile after tile of its (batch, group). At the end of the group
// the row lanes' sums are added in lane order through shared memory and written to
// workspace[batch, group, :]; the finalize kernel of dact_dbias.cu adds the groups in a fixed
// order. No float atomics: the bits do not depend on the schedule.
#pragma once

#include <cstddef>
#include <cstdint>

#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/tile.cuh"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda::quant {

// One thread's sums of its 8 columns of each half.
template <int kOutHalves>
struct DbiasSums {
  float sum[kOutHalves][8];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int l = 0; l < kOutHalves; ++l)
#pragma unroll
      for (int k = 0; k < 8; ++k) sum[l][k] = 0.0f;
  }

  __device__ __forceinline__ void add(int l, const float (&raw)[8]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) sum[l][k] += raw[k];
  }

  // The shared memory of `write`: [kOutHalves][kRowLanes][kCols] float32.
  template <int kRowLanes, int kCols>
  static constexpr size_t kSharedBytes = size_t{kOutHalves} * kRowLanes * kCols * 4;

  // Adds the block's row lanes in lane order and writes the group's partial sums of the
  // column tile starting at first_col. Every thread of the block must call it (barriers);
  // `shared` may hold the last tile's data until the first one.
  template <int kRowLanes, int kCols>
  __device__ __forceinline__ void write(const QuantizeArgs& args, const Lane& lane,
                                        unsigned char* shared, uint32_t batch, uint32_t group,
                                        uint64_t first_col) const {
    auto& part = *reinterpret_cast<float(*)[kOutHalves][kRowLanes][kCols]>(shared);
    __syncthreads();
#pragma unroll
    for (int l = 0; l < kOutHalves; ++l) {
      float4* dst = reinterpret_cast<float4*>(&part[l][lane.ty][lane.tx * 8]);
      dst[0] = make_float4(sum[l][0], sum[l][1], sum[l][2], sum[l][3]);
      dst[1] = make_float4(sum[l][4], sum[l][5], sum[l][6], sum[l][7]);
    }
    __syncthreads();
    float* wrow = args.dbias_ws + (uint64_t{batch} * args.groups + group) * lane.y_cols;
    for (int e = lane.tid; e < kOutHalves * kCols; e += kThreads) {
      const int l = e / kCols, c = e % kCols;
      float s = part[l][0][c];
#pragma unroll
      for (int t = 1; t < kRowLanes; ++t) s += part[l][t][c];
      if (first_col + c < lane.H) wrow[l * lane.H + first_col + c] = s;
    }
    __syncthreads();
  }
};

}  // namespace te_jax::cuda::quant
