// Where a tile is and where this thread is in it: what the producer and the emitters share.
// The tile's values themselves are arrays of the kernel's (produce.cuh fills them).
#pragma once

#include <cstdint>

#include "activation/cuda/quantize/values.cuh"

namespace te_jax::cuda::quant {

// This thread's lane in the block and the sizes of y (the same for the whole kernel).
struct Lane {
  int tid;                  // threadIdx.x
  int tx, ty;               // column lane (8 columns), row lane (kRowsPerThread rows)
  uint64_t H;               // columns of each half
  uint64_t y_cols;          // row length of y: kOutHalves * H
  uint64_t rows_per_batch;  // rows of each batch (row tiles restart at each batch)
  bool rowwise, colwise;    // the outputs written (args.data, args.colwise not null)
};

// One tile: 32 rows (fewer at the end of a batch) x kCols columns of each half.
struct TilePosition {
  uint32_t batch;
  uint64_t row_tile;   // within the batch
  uint64_t first_row;  // of y: batch * rows_per_batch + row_tile * kTileRows
  uint64_t first_col;  // of H: column tile * kCols
  int rows;            // rows inside the batch (kTileRows but in its last tile)
  uint64_t y_off;      // this thread's first element of y (its first row, its first column)
  bool vec_out;        // the rowwise-layout codes are stored 8 (NVFP4: 4) bytes at a time
};

}  // namespace te_jax::cuda::quant
