// te_jax_dact_dbias_quantize with dbias on CUDA: dx and the dbias partial sums in one kernel, then
// a small kernel that adds the partials in a fixed order. No float atomics: the same inputs give
// the same bits on every run, whatever the GPU or the grid.
//
// Rows are p.batches consecutive batches of R = rows / batches rows; each batch is cut into
// G = p.groups contiguous row groups, group g covering rows [g*R/G, (g+1)*R/G) of its batch.
//
// dact_dbias_kernel: grid (column tiles, batches*groups), 256 threads = 32 column lanes x 8 row
// lanes. A column lane owns kVec consecutive columns of H (16 bytes; kVec = 1 on the scalar path
// for H not a multiple of the vector width), so a tile is 32*kVec columns, and in a gated problem
// the lane handles those columns of both halves. Row lane t of the block takes rows
// begin+t, begin+t+8, ... of its group (two rows per iteration: 4 (non-gated) or 6 (gated)
// independent 16-byte loads in flight), writes dx, and accumulates float32 column sums of the
// unrounded dx in registers in row order. The 8 row lanes' sums go through shared memory and are
// added in lane order 0..7; the block writes the result to workspace[b, g, half*H + column].
//
// dbias_finalize_kernel: dbias[b, n] = sum over g = 0..G-1 of workspace[b, g, n], in that order,
// rounded to the input dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/activations.h"
#include "common/problem.h"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace te_jax::cuda {
namespace {

constexpr int kColLanes = 32;
constexpr int kRowLanes = kThreads / kColLanes;  // 8
constexpr int kRowUnroll = 2;
constexpr unsigned kMaxGridY = 65535;

template <typename T>
struct DbiasArgs {
  const T* x;              // [rows, act_len, H]
  const T* dz;             // [rows, H]
  T* dx;                   // [rows, act_len, H]
  float* workspace;        // [batches, groups, act_len * H]
  uint64_t hidden;         // H
  uint64_t rows_per_batch; // R
  uint64_t groups;         // G
  uint64_t batch_groups;   // batches * G
  ActParams params;
  unsigned* amax;          // bits of max|dx|, or nullptr
};

// Blocks per SM the kernel is compiled to fit: registers <= 80 non-gated, <= 128 gated (a tighter
// cap spills). With 6 (gated) or 4 16-byte loads per thread in flight, that is 48 KB per SM.
template <typename Spec>
constexpr int kDbiasBlocksPerSm = Spec::kGated ? 2 : 3;

template <typename Spec, typename T, int kVec>
__global__ void __launch_bounds__(kThreads, kDbiasBlocksPerSm<Spec>)
    dact_dbias_kernel(const DbiasArgs<T> a) {
  constexpr int L = Spec::kActLen;
  constexpr int kTileCols = kColLanes * kVec;
  __shared__ float partial[L][kRowLanes][kTileCols];

  const int tx = threadIdx.x % kColLanes;
  const int ty = threadIdx.x / kColLanes;
  const uint64_t H = a.hidden;
  const uint64_t tile_col0 = static_cast<uint64_t>(blockIdx.x) * kTileCols;
  const uint64_t col = tile_col0 + static_cast<uint64_t>(tx) * kVec;
  const bool active = col < H;  // kVec divides H on the vector path
  const uint64_t G = a.groups;
  const uint64_t R = a.rows_per_batch;
  unsigned amax_bits = 0;

  for (uint64_t bg = blockIdx.y; bg < a.batch_groups; bg += gridDim.y) {
    const uint64_t b = bg / G;
    const uint64_t g = bg % G;
    const uint64_t r_begin = b * R + g * R / G;
    const uint64_t r_end = b * R + (g + 1) * R / G;

    float acc0[kVec], acc1[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc0[i] = acc1[i] = 0.0f;

    if (active) {
      for (uint64_t r = r_begin + ty; r < r_end; r += kRowUnroll * kRowLanes) {
        Pack<T, kVec> xa[kRowUnroll], xb[kRowUnroll], gz[kRowUnroll];
#pragma unroll
        for (int k = 0; k < kRowUnroll; ++k) {
          const uint64_t rk = r + k * kRowLanes;
          if (rk < r_end) {
            const uint64_t in_off = rk * (L * H) + col;
            gz[k] = load_pack<T, kVec>(a.dz + rk * H + col);
            xa[k] = load_pack<T, kVec>(a.x + in_off);
            if constexpr (Spec::kGated) xb[k] = load_pack<T, kVec>(a.x + in_off + H);
          }
        }
#pragma unroll
        for (int k = 0; k < kRowUnroll; ++k) {
          const uint64_t rk = r + k * kRowLanes;
          if (rk < r_end) {
            const uint64_t in_off = rk * (L * H) + col;
            float fa[kVec], fb[kVec], fg[kVec], da[kVec], db[kVec], rounded[kVec];
            to_float(gz[k], fg);
            to_float(xa[k], fa);
            if constexpr (Spec::kGated) to_float(xb[k], fb);
#pragma unroll
            for (int i = 0; i < kVec; ++i) {
              act_backward<Spec>(fg[i], fa[i], Spec::kGated ? fb[i] : 0.0f, a.params, da[i],
                                 db[i]);
              acc0[i] += da[i];
              if constexpr (Spec::kGated) acc1[i] += db[i];
            }
            store_pack(a.dx + in_off, from_float<T, kVec>(da, rounded));
            amax_update(amax_bits, rounded);
            if constexpr (Spec::kGated) {
              store_pack(a.dx + in_off + H, from_float<T, kVec>(db, rounded));
              amax_update(amax_bits, rounded);
            }
          }
        }
      }
    }

    // Add the 8 row lanes' sums in lane order and write this group's partial.
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      partial[0][ty][tx * kVec + i] = acc0[i];
      if constexpr (L == 2) partial[L - 1][ty][tx * kVec + i] = acc1[i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < L * kTileCols; i += kThreads) {
      const int h = i / kTileCols;
      const int c = i % kTileCols;
      float s = partial[h][0][c];
#pragma unroll
      for (int t = 1; t < kRowLanes; ++t) s += partial[h][t][c];
      if (tile_col0 + c < H) a.workspace[bg * (L * H) + h * H + tile_col0 + c] = s;
    }
    __syncthreads();  // `partial` is reused by the next group
  }

  if (a.amax != nullptr) block_amax_commit(amax_bits, a.amax);
}

// dbias[b, c] = sum_{g < G} workspace[b, g, c] (in order), rounded to T.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dbias_finalize_kernel(const float* __restrict__ ws, T* __restrict__ dbias, uint64_t n,
                          uint64_t groups, uint64_t batches) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * kThreads;
  for (uint64_t b = blockIdx.y; b < batches; b += gridDim.y) {
    for (uint64_t c = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x; c < n;
         c += step) {
      const float* p = ws + b * groups * n + c;
      float s = 0.0f;
#pragma unroll 4
      for (uint64_t g = 0; g < groups; ++g) s += p[g * n];
      dbias[b * n + c] = from_float1<T>(s);
    }
  }
}

template <typename Spec, typename T>
cudaError_t launch_typed(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg) {
  constexpr int kVec = kVecOf<T>;
  constexpr int L = Spec::kActLen;
  auto* const vec_kernel = &dact_dbias_kernel<Spec, T, kVec>;
  auto* const scalar_kernel = &dact_dbias_kernel<Spec, T, 1>;
  auto* const finalize_kernel = &dbias_finalize_kernel<T>;
  if (cfg.load_only) {
    if (cudaError_t e = load_kernel(vec_kernel); e != cudaSuccess) return e;
    if (cudaError_t e = load_kernel(scalar_kernel); e != cudaSuccess) return e;
    return load_kernel(finalize_kernel);
  }

  if (p.amax != nullptr) {
    if (cudaError_t e = cudaMemsetAsync(p.amax, 0, sizeof(float), stream); e != cudaSuccess) {
      return e;
    }
  }
  if (p.hidden <= 0 || p.batches <= 0 || p.groups <= 0) return cudaSuccess;  // nothing to write

  DbiasArgs<T> a;
  a.x = static_cast<const T*>(p.x);
  a.dz = static_cast<const T*>(p.dz);
  a.dx = static_cast<T*>(p.dx);
  a.workspace = p.workspace;
  a.hidden = static_cast<uint64_t>(p.hidden);
  a.rows_per_batch = static_cast<uint64_t>(p.rows / p.batches);
  a.groups = static_cast<uint64_t>(p.groups);
  a.batch_groups = static_cast<uint64_t>(p.batches) * a.groups;
  a.params = p.params;
  a.amax = reinterpret_cast<unsigned*>(p.amax);

  const bool vec =
      aligned16(p.x) && aligned16(p.dz) && aligned16(p.dx) && p.hidden % kVec == 0;
  const uint64_t tile = static_cast<uint64_t>(kColLanes) * (vec ? kVec : 1);
  const dim3 grid(static_cast<unsigned>((a.hidden + tile - 1) / tile),
                  static_cast<unsigned>(std::min<uint64_t>(a.batch_groups, kMaxGridY)));
  if (vec) {
    vec_kernel<<<grid, kThreads, 0, stream>>>(a);
  } else {
    scalar_kernel<<<grid, kThreads, 0, stream>>>(a);
  }

  const uint64_t n = static_cast<uint64_t>(L) * a.hidden;
  const dim3 fgrid(static_cast<unsigned>(std::min<uint64_t>((n + kThreads - 1) / kThreads, 1024)),
                   static_cast<unsigned>(std::min<uint64_t>(p.batches, kMaxGridY)));
  finalize_kernel<<<fgrid, kThreads, 0, stream>>>(p.workspace, static_cast<T*>(p.dbias), n,
                                                  a.groups, static_cast<uint64_t>(p.batches));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_dact_with_dbias(const DActProblem& p, cudaStream_t stream,
                                   const LaunchConfig& cfg) {
  cudaError_t err = cudaErrorInvalidValue;  // unknown activation or dtype (decode rejects both)
  with_activation(p.act, [&](auto spec) {
    using Spec = decltype(spec);
    switch (p.dtype) {
      case DType::F32: err = launch_typed<Spec, float>(p, stream, cfg); break;
      case DType::BF16: err = launch_typed<Spec, __nv_bfloat16>(p, stream, cfg); break;
      case DType::F16: err = launch_typed<Spec, __half>(p, stream, cfg); break;
    }
  });
  return err;
}

}  // namespace te_jax::cuda
