// The generic (quantizing or amax-only) path of te_jax_act_lu / te_jax_quantize /
// te_jax_dact_dbias_quantize and the amax passes on CUDA: one tiled kernel template, instantiated
// per (activation, input dtype, mode, forward/backward) by the quant_*.cu files. Formulas and
// buffer layouts: common/quant_output.h, docs/numerics.md §4-§5; the reference semantics are
// activation/cpu/quantized.cc, whose bits every output here matches (dbias excepted: it sums in its own
// fixed order). Organised as quantized.cc is: produce a tile's values, emit them per mode, finish
// the work item. The parts, under quantize/:
//   geometry.cuh      the tile shape and lane layout (TileGeometry), the register cap
//   args.cuh          the kernel's runtime arguments (QuantizeArgs), the batch's tensor scale
//   values.cuh        a lane's 8 values of a row: raw loads, y rounded to x's dtype, max keys
//   tile.cuh          where a tile and a thread are (Lane, TilePosition)
//   produce.cuh       the tile's loads (TileLoader, with the MXFP8 forward's prefetch) and values
//   codes.cuh         FP8 codes and the code stores shared by the emitters
//   nvfp4_codes.cuh   NVFP4 block scales and E2M1 codes, by division or by comparison (Fp4Table)
//   emitter.cuh       the emitter interface and the block's shared buffers
//   emit_tensor.cuh   TENSOR: scaled FP8 codes, the transposed layout through shared memory
//   emit_block_scaled.cuh   MXFP8 / NVFP4 block maxima, rowwise by shuffles, colwise by reducers
//   mxfp8_scale.cuh   MXFP8 block scale and factor (MxScale)
//   emit_mxfp8.cuh    MXFP8 scales and codes
//   emit_nvfp4.cuh    NVFP4 scales and codes
//   emit_amax.cuh     the amax pass (nothing per tile)
//   dbias.cuh         the dbias partial sums of a work item
//   kernel.cuh        the kernel: work items, tiles, produce + emit, amax and dbias at the end
//   launch.cuh        host side: grid, arguments, routing to elementwise.cuh, dispatch
// Design notes: ffi/activation/cuda/NOTES.md ("Quantized path").
#pragma once

#include "activation/cuda/quantize/launch.cuh"
