// te_jax_dact_dbias_quantize with dbias on CUDA: dx and the dbias partial sums in one kernel, then
// a small kernel that adds the partials in a fixed order. No float atomics: the same inputs give
// the same bits on every run, whatever the GPU or the grid.
//
// Rows are p.batches consecutive batches of R = rows / batches rows; each batch is cut into
// G = p.groups contiguous row groups, group g covering rows [g*R/G, (g+1)*R/G) of its batch.
//
// dact_dbias_kernel (the gated 16-byte path, and the scalar path): grid (column tiles,
// batches*groups), 256 threads = 32 column lanes x 8 row lanes. A column lane owns kVec
// consecutive columns of H (16 bytes; kVec = 1 on the scalar path for H not a multiple of the
// vector width), so a tile is 32*kVec columns, and in a gated problem the lane handles those
// columns of both halves. Row lane t of the block takes rows
// begin+t, begin+t+8, ... of its group (two rows per iteration: 4 (non-gated) or 6 (gated)
// independent 16-byte loads in flight), writes dx, and accumulates float32 column sums of the
// unrounded dx in registers in row order. The 8 row lanes' sums go through shared memory and are
// added in lane order 0..7; the block writes the result to workspace[b, g, half*H + column].
//
// dact_dbias_async_kernel: the same work split and summation order for the non-gated 16-byte path,
// with each thread streaming its rows through its own shared-memory slots by cp.async,
// kAsyncStages - 1 rows ahead of the row it computes (so the bits equal the register kernel's).
//
// dbias_finalize_kernel: dbias[b, n] = the sum over g < G of workspace[b, g, n], rounded to the
// input dtype, in a fixed two-level order: 32 lanes each add a contiguous range of groups in
// order, then the lanes' sums are added in lane order. A block owns 8 columns (one 32-byte
// sector of a workspace row) and keeps up to 32 loads per thread in flight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "activation/activations.h"
#include "activation/cuda/launch.h"
#include "activation/problem.h"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda {
namespace {

constexpr int kColLanes = 32;
constexpr int kRowLanes = kThreads / kColLanes;  // 8
constexpr int kRowUnroll = 2;
constexpr unsigned kMaxGridY = 65535;

// Adds the 8 row lanes' float32 sums of one row group in lane order and writes the group's
// partial (L halves of H columns, this block's tile of them) to `ws`, the group's workspace row.
// `partial` is block-shared scratch; it may be reused once this returns.
template <int L, int kVec, int kTileCols = kColLanes * kVec>
__device__ __forceinline__ void commit_group_partial(float (&partial)[L][kRowLanes][kTileCols],
                                                     const float (&acc0)[kVec],
                                                     const float (&acc1)[kVec], uint64_t H,
                                                     uint64_t tile_col0, float* ws) {
  const int tx = threadIdx.x % kColLanes;
  const int ty = threadIdx.x / kColLanes;
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
    if (tile_col0 + c < H) ws[h * H + tile_col0 + c] = s;
  }
  __syncthreads();
}

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

    commit_group_partial<L, kVec>(partial, acc0, acc1, H, tile_col0, a.workspace + bg * (L * H));
  }

  if (a.amax != nullptr) block_amax_commit(amax_bits, a.amax);
}

// Pipeline of the non-gated 16-byte path: kAsyncStages rows per thread in shared memory (4 of them
// in flight, 128 bytes per thread; 40 KB per block), registers capped for kAsyncBlocksPerSm blocks
// per SM: it beat the register kernel (2 rows, 64 bytes per thread in flight, 3 blocks per SM)
// and other stage / block counts when timed. For gated problems the register kernel (2 blocks per
// SM, 96 bytes per thread) was faster than this pipeline, so it stays on that path.
constexpr int kAsyncStages = 5;
constexpr int kAsyncBlocksPerSm = 3;

template <typename Spec, int S>
constexpr size_t kAsyncSmem = sizeof(uint4) * S * (Spec::kActLen + 1) * kThreads;

// The 16-byte path of dact_dbias_kernel, software-pipelined with S stages: each thread copies its
// own rows' 16-byte inputs into its own shared-memory slots with cp.async, S - 1 rows ahead of the
// row it computes, so that loads stay in flight while it computes and stores (no block barrier in
// the loop: a thread reads only what it copied). Same row order per lane, same lane order, so the
// same bits as the register kernel. (Written for gated problems too; only non-gated launches it.)
template <typename Spec, typename T, int S, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    dact_dbias_async_kernel(const DbiasArgs<T> a) {
  constexpr int L = Spec::kActLen;
  constexpr int kVec = kVecOf<T>;
  constexpr int kTileCols = kColLanes * kVec;
  constexpr int kLoads = L + 1;  // dz, x activation half, [x linear half]
  // stage[s][j][thread] (dynamic shared memory, kAsyncSmem bytes); after the loop the same memory
  // holds the lanes' partial sums.
  extern __shared__ uint4 dbias_stage[];
  auto& stage = *reinterpret_cast<uint4 (*)[S][kLoads][kThreads]>(dbias_stage);
  static_assert(kAsyncSmem<Spec, S> >= sizeof(float) * L * kRowLanes * kTileCols, "partial fits");
  auto& partial = *reinterpret_cast<float (*)[L][kRowLanes][kTileCols]>(&stage[0][0][0]);

  const int tid = threadIdx.x;
  const int tx = tid % kColLanes;
  const int ty = tid / kColLanes;
  const uint64_t H = a.hidden;
  const uint64_t tile_col0 = static_cast<uint64_t>(blockIdx.x) * kTileCols;
  const uint64_t col = tile_col0 + static_cast<uint64_t>(tx) * kVec;
  const bool active = col < H;
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
      const uint64_t r0 = r_begin + ty;
      const uint64_t n_rows = r0 < r_end ? (r_end - r0 + kRowLanes - 1) / kRowLanes : 0;
      auto issue = [&](uint64_t i, int s) {  // row r0 + i*kRowLanes into stage s
        const uint64_t r = r0 + i * kRowLanes;
        const uint64_t in_off = r * (L * H) + col;
        cp_async16(&stage[s][0][tid], a.dz + r * H + col);
        cp_async16(&stage[s][1][tid], a.x + in_off);
        if constexpr (Spec::kGated) cp_async16(&stage[s][2][tid], a.x + in_off + H);
      };
#pragma unroll
      for (int i = 0; i < S - 1; ++i) {
        if (i < n_rows) issue(i, i);
        cp_async_commit();
      }
      int s_read = 0, s_write = S - 1;
      for (uint64_t i = 0; i < n_rows; ++i) {
        if (i + (S - 1) < n_rows) issue(i + (S - 1), s_write);
        cp_async_commit();
        cp_async_wait<S - 1>();  // row i's copies (group i) have landed
        Pack<T, kVec> in[kLoads];
#pragma unroll
        for (int j = 0; j < kLoads; ++j) {
          const uint4 u = stage[s_read][j][tid];
          in[j].w[0] = u.x;
          in[j].w[1] = u.y;
          in[j].w[2] = u.z;
          in[j].w[3] = u.w;
        }
        s_read = s_read == S - 1 ? 0 : s_read + 1;
        s_write = s_write == S - 1 ? 0 : s_write + 1;

        const uint64_t r = r0 + i * kRowLanes;
        const uint64_t in_off = r * (L * H) + col;
        float fa[kVec], fb[kVec], fg[kVec], da[kVec], db[kVec], rounded[kVec];
        to_float(in[0], fg);
        to_float(in[1], fa);
        if constexpr (Spec::kGated) to_float(in[L], fb);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          act_backward<Spec>(fg[k], fa[k], Spec::kGated ? fb[k] : 0.0f, a.params, da[k], db[k]);
          acc0[k] += da[k];
          if constexpr (Spec::kGated) acc1[k] += db[k];
        }
        store_pack(a.dx + in_off, from_float<T, kVec>(da, rounded));
        amax_update(amax_bits, rounded);
        if constexpr (Spec::kGated) {
          store_pack(a.dx + in_off + H, from_float<T, kVec>(db, rounded));
          amax_update(amax_bits, rounded);
        }
      }
      cp_async_wait<0>();  // only empty groups can be pending here
    }

    __syncthreads();  // every thread is done reading `stage`, which `partial` overlays
    commit_group_partial<L, kVec>(partial, acc0, acc1, H, tile_col0, a.workspace + bg * (L * H));
  }

  if (a.amax != nullptr) block_amax_commit(amax_bits, a.amax);
}

// dbias[b, c] = the sum over g < G of workspace[b, g, c], rounded to T, in a fixed order: group
// lane l (of kFinLanes) adds groups [l*G/kFinLanes, (l+1)*G/kFinLanes) in order, and the lanes'
// sums are added in lane order. A block owns kFinCols columns of one batch (a 32-byte sector of
// a workspace row), so a float32 [G, H] workspace is read by many blocks with kFinUnroll loads
// in flight per thread.
constexpr int kFinCols = 8;
constexpr int kFinLanes = kThreads / kFinCols;  // 32
constexpr int kFinUnroll = 32;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dbias_finalize_kernel(const float* __restrict__ ws, T* __restrict__ dbias, uint64_t n,
                          uint64_t groups, uint64_t batches) {
  __shared__ float lane_sum[kFinLanes][kFinCols];
  const int tx = threadIdx.x % kFinCols;
  const int ty = threadIdx.x / kFinCols;
  const uint64_t col_blocks = (n + kFinCols - 1) / kFinCols;
  const uint64_t g_begin = ty * groups / kFinLanes;
  const uint64_t g_end = (ty + 1) * groups / kFinLanes;
  for (uint64_t b = blockIdx.y; b < batches; b += gridDim.y) {
    for (uint64_t cb = blockIdx.x; cb < col_blocks; cb += gridDim.x) {
      const uint64_t c = cb * kFinCols + tx;
      const bool active = c < n;
      const float* p = ws + b * groups * n + c;
      float s = 0.0f;
      if (active) {
        for (uint64_t g0 = g_begin; g0 < g_end; g0 += kFinUnroll) {
          float v[kFinUnroll];
#pragma unroll
          for (int u = 0; u < kFinUnroll; ++u) v[u] = g0 + u < g_end ? p[(g0 + u) * n] : 0.0f;
#pragma unroll
          for (int u = 0; u < kFinUnroll; ++u) {
            if (g0 + u < g_end) s += v[u];
          }
        }
      }
      lane_sum[ty][tx] = s;
      __syncthreads();
      if (ty == 0 && active) {
        float total = lane_sum[0][tx];
#pragma unroll
        for (int l = 1; l < kFinLanes; ++l) total += lane_sum[l][tx];
        dbias[b * n + c] = from_float1<T>(total);
      }
      __syncthreads();
    }
  }
}

// Launches the pipelined kernel (with load_only, just loads it).
template <typename Spec, typename T, int S, int kMinBlocks>
cudaError_t launch_async(const DbiasArgs<T>& a, dim3 grid, cudaStream_t stream, bool load_only) {
  auto* const kernel = &dact_dbias_async_kernel<Spec, T, S, kMinBlocks>;
  constexpr size_t smem = kAsyncSmem<Spec, S>;
  static_assert(smem <= 48 * 1024, "within the default dynamic shared-memory limit");
  if (load_only) return load_kernel(kernel);
  kernel<<<grid, kThreads, smem, stream>>>(a);
  return cudaSuccess;
}

template <typename Spec, typename T>
cudaError_t launch_typed(const DActProblem& p, cudaStream_t stream, const LaunchConfig& cfg) {
  constexpr int kVec = kVecOf<T>;
  constexpr int L = Spec::kActLen;
  auto* const scalar_kernel = &dact_dbias_kernel<Spec, T, 1>;
  auto* const finalize_kernel = &dbias_finalize_kernel<T>;
  // 16-byte path: gated problems use the register kernel, non-gated the cp.async pipeline.
  auto vec_launch = [&](const DbiasArgs<T>& a, dim3 grid, bool load_only) -> cudaError_t {
    if constexpr (Spec::kGated) {
      auto* const vec_kernel = &dact_dbias_kernel<Spec, T, kVec>;
      if (load_only) return load_kernel(vec_kernel);
      vec_kernel<<<grid, kThreads, 0, stream>>>(a);
      return cudaSuccess;
    } else {
      return launch_async<Spec, T, kAsyncStages, kAsyncBlocksPerSm>(a, grid, stream, load_only);
    }
  };
  if (cfg.load_only) {
    if (cudaError_t e = vec_launch(DbiasArgs<T>{}, dim3(), true); e != cudaSuccess) return e;
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
    if (cudaError_t e = vec_launch(a, grid, false); e != cudaSuccess) return e;
  } else {
    scalar_kernel<<<grid, kThreads, 0, stream>>>(a);
  }

  const uint64_t n = static_cast<uint64_t>(L) * a.hidden;
  const dim3 fgrid(
      static_cast<unsigned>(std::min<uint64_t>((n + kFinCols - 1) / kFinCols, 0x7fffffff)),
      static_cast<unsigned>(std::min<uint64_t>(p.batches, kMaxGridY)));
  finalize_kernel<<<fgrid, kThreads, 0, stream>>>(p.workspace, static_cast<T*>(p.dbias), n,
                                                  a.groups, static_cast<uint64_t>(p.batches));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_dbias_finalize(const float* ws, void* dbias, DType dtype, uint64_t n,
                                  uint64_t groups, uint64_t batches, cudaStream_t stream,
                                  bool load_only) {
  auto go = [&](auto* kernel, auto* out) -> cudaError_t {
    if (load_only) return load_kernel(kernel);
    if (n == 0 || batches == 0) return cudaSuccess;
    const dim3 fgrid(
        static_cast<unsigned>(std::min<uint64_t>((n + kFinCols - 1) / kFinCols, 0x7fffffff)),
        static_cast<unsigned>(std::min<uint64_t>(batches, kMaxGridY)));
    kernel<<<fgrid, kThreads, 0, stream>>>(ws, out, n, groups, batches);
    return cudaGetLastError();
  };
  switch (dtype) {
    case DType::F32: return go(&dbias_finalize_kernel<float>, static_cast<float*>(dbias));
    case DType::BF16:
      return go(&dbias_finalize_kernel<__nv_bfloat16>, static_cast<__nv_bfloat16*>(dbias));
    case DType::F16: return go(&dbias_finalize_kernel<__half>, static_cast<__half*>(dbias));
  }
  return cudaErrorInvalidValue;
}

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
