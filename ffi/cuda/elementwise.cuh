// The elementwise activation kernel (forward: act_lu; backward without dbias: dact) and its host
// launcher, instantiated per (activation, dtype) by act_lu.cu and dact.cu.
//
// Index space: the output of act_lu / the upstream gradient dz, [rows, H], cut into "units" of
// kVec consecutive elements (one 16-byte access; kVec = 1 on the scalar path).
//   non-gated  the [rows, H] arrays are treated as one flat array of rows*H elements: units of
//              kVec over it, and a scalar tail of (rows*H) % kVec elements done by block 0.
//   gated      kVec divides H; unit u is row r = u / (H/kVec), column c = u % (H/kVec); its
//              inputs are x[r, 0, c*kVec...] (activation half) and x[r, 1, c*kVec...] (linear
//              half), at flat offsets u*kVec + r*H and u*kVec + r*H + H. The row offset r*H of
//              each of a thread's slots is carried along the grid-stride loop with additions
//              (one 64-bit division per thread, at the start).
// Grid-stride loop: thread t of T handles units t + k*T (k < kUnroll) per iteration, then moves on
// by kUnroll*T. Consecutive threads touch consecutive 16-byte units (coalesced), and each thread
// issues all kUnroll * (loads per unit) 16-byte loads before it uses the first.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/activations.h"
#include "common/problem.h"
#include "cuda/device_utils.cuh"
#include "cuda/launch.h"

namespace te_jax::cuda {

template <typename T>
struct EltArgs {
  const T* x;                // [rows, act_len, H]
  const T* dz;               // [rows, H]; backward only
  T* out;                    // forward: y [rows, H]; backward: dx [rows, act_len, H]
  uint64_t n_units;          // units of kVec elements in the [rows, H] index space
  uint64_t units_per_row;    // gated: H / kVec
  uint64_t hidden;           // H
  uint64_t n_elems;          // rows * H (non-gated scalar tail)
  ActParams params;
  unsigned* amax;            // bits of max|out|, or nullptr
};

// Computes one unit from its loaded inputs, stores it, and folds it into the amax bits.
//   in_off   flat offset of the unit's activation-half inputs in x (and dx)
//   out_off  flat offset of the unit in the [rows, H] arrays (y, dz)
template <typename Spec, typename T, int N, bool kBwd>
__device__ __forceinline__ void eltwise_unit(const EltArgs<T>& a, const Pack<T, N>& xa,
                                             const Pack<T, N>& xb, const Pack<T, N>& dz,
                                             uint64_t in_off, uint64_t out_off,
                                             unsigned& amax_bits) {
  float fa[N], fb[N];
  to_float(xa, fa);
  if constexpr (Spec::kGated) to_float(xb, fb);
  if constexpr (!kBwd) {
    float y[N], yr[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      y[i] = act_forward<Spec>(fa[i], Spec::kGated ? fb[i] : 0.0f, a.params);
    }
    store_pack(a.out + out_off, from_float<T, N>(y, yr));
    amax_update(amax_bits, yr);
  } else {
    float g[N], da[N], db[N], r[N];
    to_float(dz, g);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      act_backward<Spec>(g[i], fa[i], Spec::kGated ? fb[i] : 0.0f, a.params, da[i], db[i]);
    }
    store_pack(a.out + in_off, from_float<T, N>(da, r));
    amax_update(amax_bits, r);
    if constexpr (Spec::kGated) {
      store_pack(a.out + in_off + a.hidden, from_float<T, N>(db, r));
      amax_update(amax_bits, r);
    }
  }
}

// Blocks per SM the kernel is compiled to fit (registers <= 64, or <= 80 for gated backward, which
// keeps 6 loads in flight): the register cap that lets this many blocks share an SM.
template <typename Spec, bool kBwd>
constexpr int kEltBlocksPerSm = Spec::kGated && kBwd ? 3 : 4;

template <typename Spec, typename T, int kVec, int kUnroll, bool kBwd>
__global__ void __launch_bounds__(kThreads, (kEltBlocksPerSm<Spec, kBwd>))
    eltwise_kernel(const EltArgs<T> a) {
  constexpr bool kGated = Spec::kGated;
  const uint64_t nthreads = static_cast<uint64_t>(gridDim.x) * kThreads;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const uint64_t H = a.hidden;
  const uint64_t stride = kUnroll * nthreads;
  unsigned amax_bits = 0;

  // Gated only: column (in units) and row offset (r*H) of each slot, and how one grid stride
  // moves them.
  uint64_t col[kUnroll], row_off[kUnroll];
  uint64_t step_col = 0, step_row_off = 0;
  if constexpr (kGated) {
    const uint64_t upr = a.units_per_row;
    step_col = stride % upr;
    step_row_off = (stride / upr) * H;
    const uint64_t t_col = nthreads % upr, t_row_off = (nthreads / upr) * H;
    col[0] = tid % upr;
    row_off[0] = (tid / upr) * H;
#pragma unroll
    for (int k = 1; k < kUnroll; ++k) {
      col[k] = col[k - 1] + t_col;
      row_off[k] = row_off[k - 1] + t_row_off;
      if (col[k] >= upr) {
        col[k] -= upr;
        row_off[k] += H;
      }
    }
  }

  for (uint64_t u0 = tid; u0 < a.n_units; u0 += stride) {
    Pack<T, kVec> xa[kUnroll], xb[kUnroll], g[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint64_t u = u0 + k * nthreads;
      if (u < a.n_units) {
        const uint64_t in_off = kGated ? u * kVec + row_off[k] : u * kVec;
        xa[k] = load_pack<T, kVec>(a.x + in_off);
        if constexpr (kGated) xb[k] = load_pack<T, kVec>(a.x + in_off + H);
        if constexpr (kBwd) g[k] = load_pack<T, kVec>(a.dz + u * kVec);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint64_t u = u0 + k * nthreads;
      if (u < a.n_units) {
        const uint64_t in_off = kGated ? u * kVec + row_off[k] : u * kVec;
        eltwise_unit<Spec, T, kVec, kBwd>(a, xa[k], xb[k], g[k], in_off, u * kVec, amax_bits);
      }
    }
    if constexpr (kGated) {
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        col[k] += step_col;
        row_off[k] += step_row_off;
        if (col[k] >= a.units_per_row) {
          col[k] -= a.units_per_row;
          row_off[k] += H;
        }
      }
    }
  }

  // Non-gated vector path: the last (rows*H) % kVec elements, one per thread of block 0.
  if constexpr (!kGated && kVec > 1) {
    const uint64_t i = a.n_units * kVec + threadIdx.x;
    if (blockIdx.x == 0 && i < a.n_elems) {
      const Pack<T, 1> xa = load_pack<T, 1>(a.x + i);
      Pack<T, 1> g;
      if constexpr (kBwd) g = load_pack<T, 1>(a.dz + i);
      eltwise_unit<Spec, T, 1, kBwd>(a, xa, xa, g, i, i, amax_bits);
    }
  }

  if (a.amax != nullptr) block_amax_commit(amax_bits, a.amax);
}

// Loads per unit (each one 16-byte access on the vector path) and the unroll that keeps 4 (6 for
// gated backward) independent loads in flight per thread.
template <typename Spec, bool kBwd>
constexpr int kEltUnroll = (Spec::kGated ? 2 : 1) + (kBwd ? 1 : 0) >= 3
                               ? 2
                               : 4 / ((Spec::kGated ? 2 : 1) + (kBwd ? 1 : 0));

// Enqueues: a memset of *amax (when requested), then one elementwise kernel.
template <typename Spec, typename T, bool kBwd>
cudaError_t launch_eltwise(const void* x, const void* dz, void* out, int64_t rows, int64_t hidden,
                           const ActParams& params, float* amax, cudaStream_t stream,
                           const LaunchConfig& cfg) {
  constexpr int kVec = kVecOf<T>;
  constexpr int kUnroll = kEltUnroll<Spec, kBwd>;
  auto* const vec_kernel = &eltwise_kernel<Spec, T, kVec, kUnroll, kBwd>;
  auto* const scalar_kernel = &eltwise_kernel<Spec, T, 1, kUnroll, kBwd>;
  if (cfg.load_only) {
    if (cudaError_t e = load_kernel(vec_kernel); e != cudaSuccess) return e;
    return load_kernel(scalar_kernel);
  }

  if (amax != nullptr) {
    if (cudaError_t e = cudaMemsetAsync(amax, 0, sizeof(float), stream); e != cudaSuccess) return e;
  }
  const uint64_t n_elems = static_cast<uint64_t>(rows) * static_cast<uint64_t>(hidden);
  if (n_elems == 0) return cudaSuccess;

  EltArgs<T> a;
  a.x = static_cast<const T*>(x);
  a.dz = static_cast<const T*>(dz);
  a.out = static_cast<T*>(out);
  a.hidden = static_cast<uint64_t>(hidden);
  a.n_elems = n_elems;
  a.params = params;
  a.amax = reinterpret_cast<unsigned*>(amax);

  const bool vec = aligned16(x) && aligned16(out) && (!kBwd || aligned16(dz)) &&
                   (!Spec::kGated || hidden % kVec == 0);
  const int width = vec ? kVec : 1;
  a.units_per_row = static_cast<uint64_t>(hidden) / width;
  a.n_units = n_elems / width;

  const uint64_t per_block = static_cast<uint64_t>(kThreads) * kUnroll;
  // One block per kThreads * kUnroll units, not a persistent grid: measured on an H100 (1 GiB
  // bf16 operands), a grid capped at kEltBlocksPerSm blocks per SM reached 0.89-0.95 of copy
  // bandwidth, one block per chunk 0.95-1.02 (docs/performance.md). The grid-stride loop
  // then runs once per thread, unless cfg.max_blocks (tests) or gridDim.x's limit caps the grid.
  const uint64_t cap = cfg.max_blocks > 0 ? cfg.max_blocks : uint64_t{0x7fffffff};
  const uint64_t blocks =
      std::max<uint64_t>(1, std::min<uint64_t>((a.n_units + per_block - 1) / per_block, cap));
  if (vec) {
    vec_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  } else {
    scalar_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace te_jax::cuda
