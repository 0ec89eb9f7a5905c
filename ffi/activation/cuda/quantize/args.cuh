// The quantizing kernel's runtime arguments (filled by launch.cuh's launch_quantized).
#pragma once

#include <cstdint>

#include "activation/activations.h"
#include "common/formats.h"

namespace te_jax::cuda::quant {

struct QuantizeArgs {
  const void* x;   // [M, kInHalves, H]
  const void* dz;  // [M, H] (backward)
  uint64_t H;
  uint64_t y_cols;          // kOutHalves * H: the row length of y and of its codes
  uint64_t rows_per_batch;  // M / batches
  uint64_t batches;
  // Per batch: row tiles, column tiles, and groups (the dbias workspace's; else = row tiles, or
  // ranges of consecutive row tiles in the block-scaled modes).
  uint32_t row_tiles, col_tiles, groups;
  ActParams params;
  uint8_t* data;               // rowwise codes, or nullptr
  uint8_t* colwise;            // colwise codes, or nullptr
  uint8_t* block_scale;        // rowwise block scales (MXFP8 / NVFP4)
  uint8_t* colwise_block_scale;  // colwise block scales
  const float* scale;          // [batches] (TENSOR, NVFP4): the scale, or the amax it derives from
  float scale_numerator;       // > 0: `scale` holds the amax; the scale is fmt::scale_from_amax
  float* scale_inv;            // [batches] 1 / scale (TENSOR; NVFP4: 1 / S), or nullptr
  unsigned* amax;              // [batches] bits of max|y|, or nullptr
  float* dbias_ws;             // dbias partials [batches, groups, y_cols], or nullptr
  float qmax;                  // MXFP8: the format's max
  bool e5m2;                   // FP8 format of TENSOR / MXFP8 codes
  bool vec_in;                 // 16-byte loads (H % 8 == 0, inputs 16-byte aligned)
  bool vec_out;                // rowwise-layout codes stored 8 (NVFP4: 4) bytes at a time
  bool vec_transposed;         // transposed codes stored 8 kRowsPerThread bytes at a time
};

// The tensor scale of batch b: given (DELAYED) or derived from the amax (CURRENT, NVFP4).
__device__ __forceinline__ float tensor_scale(const QuantizeArgs& args, uint64_t b) {
  return args.scale_numerator > 0.0f ? fmt::scale_from_amax(args.scale[b], args.scale_numerator)
                                     : args.scale[b];
}

}  // namespace te_jax::cuda::quant
