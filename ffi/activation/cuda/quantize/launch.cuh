// Host side of the quantizing kernel: launch_quantized sizes the grid and fills QuantizeArgs,
// routing the outputs that need no tile (rowwise tensor-scaled codes, the amax passes, both
// without dbias) to elementwise.cuh's flat kernel; dispatch_forward / dispatch_backward
// instantiate it per activation and dtype for the launchers of launch.h (quant_*.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "activation/activations.h"
#include "activation/cuda/elementwise.cuh"
#include "activation/cuda/launch.h"
#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/call.cuh"
#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/kernel.cuh"
#include "activation/problem.h"
#include "common/formats.h"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda::quant {

// The rowwise tensor-scaled codes and the amax passes, without dbias, on elementwise.cuh's kernel
// (one flat pass; no tile structure is needed when nothing is transposed, blocked or summed).
template <typename Spec, typename T, QuantEmit M, bool kBwd>
cudaError_t launch_quantized_eltwise(const QuantizeCall& call, cudaStream_t stream,
                                     const LaunchConfig& cfg) {
  static_assert(M == QuantEmit::TENSOR || M == QuantEmit::AMAX_PASS, "elementwise modes");
  const QuantOutput& q = *call.q;
  EltArgs<T> args{};
  args.x = static_cast<const T*>(call.x);
  args.dz = static_cast<const T*>(call.dz);
  args.codes = q.data;
  args.batches = static_cast<uint64_t>(q.batches);
  args.params = call.params;
  args.amax = reinterpret_cast<unsigned*>(q.amax);
  args.scale = q.scale;
  args.scale_numerator = q.scale_numerator;
  args.scale_inv = q.scale_inv;
  args.e5m2 = q.qtype == QType::E5M2;
  constexpr EltOut kOut = M == QuantEmit::TENSOR ? EltOut::kFp8 : EltOut::kNone;
  return launch_eltwise_batches<Spec, T, kBwd, kOut>(args, call.rows, call.hidden, stream, cfg);
}

template <typename Spec, typename T, QuantEmit M, bool kBwd>
cudaError_t launch_quantized(const QuantizeCall& call, cudaStream_t stream,
                             const LaunchConfig& cfg) {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  auto* const kernel = &quantize_kernel<Spec, T, M, kBwd>;
  const QuantOutput& q = *call.q;
  if constexpr (M == QuantEmit::TENSOR || M == QuantEmit::AMAX_PASS) {
    if (cfg.load_only) {
      if (cudaError_t e = launch_quantized_eltwise<Spec, T, M, kBwd>(call, stream, cfg);
          e != cudaSuccess) {
        return e;
      }
    } else if (call.ws == nullptr && q.colwise == nullptr &&
               (M == QuantEmit::AMAX_PASS || q.data != nullptr) &&
               static_cast<uint64_t>(q.batches) <= kEltMaxBatches) {
      return launch_quantized_eltwise<Spec, T, M, kBwd>(call, stream, cfg);
    }
  }
  if (cfg.load_only) {
    if (cudaError_t e = load_kernel(kernel); e != cudaSuccess) return e;
    if (call.dbias != nullptr) {
      return launch_dbias_finalize(nullptr, nullptr, kDTypeOf<T>, 0, 0, 0, stream, true);
    }
    return cudaSuccess;
  }
  const uint64_t batches = static_cast<uint64_t>(q.batches);
  if (q.amax != nullptr) {
    if (cudaError_t e = cudaMemsetAsync(q.amax, 0, batches * sizeof(float), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  const uint64_t H = static_cast<uint64_t>(call.hidden), M_ = static_cast<uint64_t>(call.rows);
  if (M == QuantEmit::NVFP4 && (H % 2) != 0 && (q.data != nullptr || q.colwise != nullptr)) {
    return cudaErrorInvalidValue;  // two codes per byte need an even row length
  }
  QuantizeArgs args{};
  args.x = call.x;
  args.dz = call.dz;
  args.H = H;
  args.y_cols = TileShape::kOutHalves * H;
  args.batches = batches;
  args.rows_per_batch = M_ / batches;
  const uint64_t row_tiles = (args.rows_per_batch + kTileRows - 1) / kTileRows;
  const uint64_t col_tiles = (H + TileShape::kCols - 1) / TileShape::kCols;
  uint64_t groups = call.ws != nullptr ? static_cast<uint64_t>(call.groups) : row_tiles;
  // One block per item; LaunchConfig::max_blocks (tests) caps the grid, x first.
  const uint64_t cap = cfg.max_blocks > 0 ? cfg.max_blocks : ~uint64_t{0};
  const uint64_t gx = std::clamp<uint64_t>(col_tiles, 1, std::min<uint64_t>(cap, 0x7fffffff));
  // Block scaling: on large inputs a block takes up to 8 consecutive row tiles (a group, when
  // there is no dbias to fix the groups), whose addresses it steps from tile to tile, and 16-bit
  // NVFP4 builds its threshold table once for them (3.5 entries of ~30 instructions per thread,
  // counted from the code: a few percent of one row tile's work); never fewer than 4096 blocks,
  // so that the last wave's idle SMs do not show. The tensor-scaled transposed store keeps one
  // row tile per block: there the blocks that run together should write neighbouring 32-row
  // pieces of each colwise row. Both chosen by timing the alternatives: NOTES.md, "The ALU pipe".
  uint64_t gy_max = 65535;
  if constexpr (M == QuantEmit::MXFP8 || M == QuantEmit::NVFP4) {
    const uint64_t blocks = std::max<uint64_t>((col_tiles * row_tiles * batches + 7) / 8, 4096);
    gy_max = std::clamp<uint64_t>((blocks + gx - 1) / gx, 1, gy_max);
    if (call.ws == nullptr) groups = std::min(groups, gy_max);
  }
  if (row_tiles > 0x7fffffff || col_tiles > 0x7fffffff || groups > 0x7fffffff ||
      batches > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  args.row_tiles = static_cast<uint32_t>(row_tiles);
  args.col_tiles = static_cast<uint32_t>(col_tiles);
  args.groups = static_cast<uint32_t>(groups);
  const uint64_t items = col_tiles * groups * batches;
  args.params = call.params;
  args.data = q.data;
  args.colwise = q.colwise;
  args.block_scale = q.block_scale;
  args.colwise_block_scale = q.colwise_block_scale;
  args.scale = q.scale;
  args.scale_numerator = q.scale_numerator;
  args.scale_inv = q.scale_inv;
  args.amax = reinterpret_cast<unsigned*>(q.amax);
  args.dbias_ws = call.ws;
  args.qmax = q.qtype == QType::E5M2 ? fmt::E5M2::kMax : fmt::E4M3::kMax;
  args.e5m2 = q.qtype == QType::E5M2;
  args.vec_in = H % 8 == 0 && aligned16(call.x) && (!kBwd || aligned16(call.dz));
  const auto aligned = [](const void* p, uintptr_t k) {
    return (reinterpret_cast<uintptr_t>(p) % k) == 0;
  };
  const uintptr_t out_align = M == QuantEmit::NVFP4 ? 4 : 8;
  args.vec_out = H % 8 == 0 && aligned(q.data, out_align) &&
              (M == QuantEmit::TENSOR || aligned(q.colwise, out_align));
  constexpr int kChunkRows = 8 * TileShape::kRowsPerThread;
  args.vec_transposed = args.rows_per_batch % kChunkRows == 0 && aligned(q.colwise, 16);

  const bool scale_inv = q.scale_inv != nullptr;
  if (items == 0 && !scale_inv) return cudaSuccess;
  const uint64_t gy = std::clamp<uint64_t>(groups, 1, std::min<uint64_t>(cap / gx, gy_max));
  const uint64_t gz = std::clamp<uint64_t>(batches, 1, std::min<uint64_t>(cap / (gx * gy), 65535));
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(gz));
  kernel<<<grid, kThreads, 0, stream>>>(args);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (call.dbias != nullptr && args.y_cols > 0) {
    return launch_dbias_finalize(call.ws, call.dbias, kDTypeOf<T>, args.y_cols, groups, batches,
                                 stream, false);
  }
  return cudaSuccess;
}

// Dispatch over activation and dtype for one mode.
template <QuantEmit M>
cudaError_t dispatch_forward(const ActLuProblem& p, cudaStream_t stream, const LaunchConfig& cfg) {
  const QuantizeCall call = forward_call(p);
  return dispatch_act_dtype<false>(p.act, p.dtype, [&](auto spec, auto t) {
    return launch_quantized<decltype(spec), typename decltype(t)::type, M, false>(call, stream, cfg);
  });
}

template <QuantEmit M>
cudaError_t dispatch_backward(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg) {
  const QuantizeCall call = backward_call(p);
  return dispatch_act_dtype<true>(p.act, p.dtype, [&](auto spec, auto t) {
    return launch_quantized<decltype(spec), typename decltype(t)::type, M, true>(call, stream, cfg);
  });
}

}  // namespace te_jax::cuda::quant
