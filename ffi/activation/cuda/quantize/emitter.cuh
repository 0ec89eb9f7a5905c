// What every emitter (emit_tensor.cuh, emit_mxfp8.cuh, emit_nvfp4.cuh, emit_amax.cuh) shares: the
// block's shared buffers, and the emitter of each mode. An emitter is a struct of
//   kTensorScale      the mode takes the batch's tensor scale (and writes scale_inv);
//   kWholeTileCopy    the kernel runs whole tiles in a second copy of the tile body whose edge
//                     checks are constants;
//   kPrefetchInputs   the producer copies the next whole tile's inputs ahead (cp.async);
//   kExchangeBytes, kBlockBytes, kTableRows   its shared memory (SharedBuffers);
//   begin_batch(...)  once per batch, before its tiles (every thread: may have barriers);
//   emit<kWhole>(...) one tile's codes and scales (every thread: may have barriers).
#pragma once

#include <cstdint>

#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/nvfp4_codes.cuh"

namespace te_jax::cuda::quant {

// The block's shared memory, as the emitters see it.
struct SharedBuffers {
  // Per-tile exchange between lanes: TENSOR the transposed codes, MXFP8 / NVFP4 the per-lane
  // column maxima (the dbias partials alias it at the end of a group).
  unsigned char* exchange;
  // Per column block: MXFP8 scaling factors, NVFP4 block scales or thresholds.
  unsigned char* block;
  // NVFP4 of 16-bit inputs: the threshold table of the batch's tensor scale (Fp4Table).
  uint32_t (*fp4_table)[kFp4TableWords];
};

template <QuantEmit M, typename Spec, typename T, bool kBwd>
struct EmitterOf;

}  // namespace te_jax::cuda::quant
