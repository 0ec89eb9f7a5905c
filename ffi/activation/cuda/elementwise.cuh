// The elementwise activation kernel and its host launcher: forward y = act(x) and backward
// dx = dact(dz, x) without dbias, each in one pass. Instantiated per (activation, dtype) by
// act_lu.cu and dact.cu (NO_SCALING: the values in x's dtype), and by quantize.cuh for the
// rowwise tensor-scaled FP8 outputs (codes fmt(y * scale), EltOut::kFp8) and the amax passes of
// the two-pass modes (EltOut::kNone): those are elementwise too, and this flat index space keeps
// more loads in flight than quantize.cuh's tiles (NOTES.md, "Quantized path", compares them).
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
// Batches (quantized outputs under vmap: each batch of rows/batches rows has its own scale and
// amax) are the grid's y (at most kEltMaxBatches); each is its own index space as above.
// Grid-stride loop: thread t of T handles units t + k*T (k < kUnroll) per iteration, then moves on
// by kUnroll*T. Consecutive threads touch consecutive 16-byte units (coalesced), and each thread
// issues all kUnroll * (loads per unit) 16-byte loads before it uses the first.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "activation/activations.h"
#include "activation/cuda/launch.h"
#include "activation/problem.h"
#include "common/formats.h"
#include "cuda/device_utils.cuh"
#include "cuda/fp8_codes.cuh"

namespace te_jax::cuda {

// What the kernel writes for each element of y (forward) or dx (backward).
enum class EltOut {
  kValues,  // the values in x's dtype (NO_SCALING)
  kFp8,     // FP8 codes fmt(y * scale[b]), one byte per element (tensor scaling, rowwise only)
  kNone,    // nothing: the amax pass of the two-pass modes
};

// The arrays are `batches` tensors of rows/batches consecutive rows each (vmap's batch of
// independently scaled tensors); batch b of each array starts b * (its stride) elements in.
template <typename T>
struct EltArgs {
  const T* x;                // [rows, act_len, H]
  const T* dz;               // [rows, H]; backward only
  T* out;                    // kValues: forward y [rows, H]; backward dx [rows, act_len, H]
  uint8_t* codes;            // kFp8: codes in out's layout
  uint64_t n_units;          // units of kVec elements in one batch's [rows, H] index space
  uint64_t units_per_row;    // gated: H / kVec
  uint64_t hidden;           // H
  uint64_t n_elems;          // a batch's rows * H (non-gated scalar tail)
  uint64_t batches;
  uint64_t x_stride, dz_stride, out_stride;  // elements per batch of x, dz, out / codes
  ActParams params;
  unsigned* amax;            // [batches] bits of max|out|, or nullptr
  const float* scale;        // kFp8: [batches] the scale, or the amax it derives from
  float scale_numerator;     // > 0: `scale` holds the amax; the scale is fmt::scale_from_amax
  float* scale_inv;          // kFp8: [batches] 1 / scale, or nullptr
  bool e5m2;                 // kFp8: the codes' format
};

// One batch's arrays, and its tensor scale (kFp8).
template <typename T>
struct EltBatch {
  const T* x;
  const T* dz;
  T* out;
  uint8_t* codes;
  float scale;
};

template <typename T>
__device__ __forceinline__ float elt_tensor_scale(const EltArgs<T>& a, uint64_t b) {
  return a.scale_numerator > 0.0f ? fmt::scale_from_amax(a.scale[b], a.scale_numerator)
                                  : a.scale[b];
}

// Rounds N values to T (one rounding, docs/numerics.md), writes them (or their FP8 codes) at
// element offset `off` of the output, and folds the rounded values into the amax bits.
template <typename T, int N, EltOut kOut>
__device__ __forceinline__ void eltwise_emit(const EltBatch<T>& B, bool e5m2, uint64_t off,
                                             const float (&v)[N], unsigned& amax_bits) {
  float r[N];
  const Pack<T, N> p = from_float<T, N>(v, r);
  if constexpr (kOut == EltOut::kValues) store_pack(B.out + off, p);
  if constexpr (kOut == EltOut::kFp8) {
    float q[N];
#pragma unroll
    for (int i = 0; i < N; ++i) q[i] = __fmul_rn(r[i], B.scale);
    // The bounds check of the grid-stride loop may have split the warp: vote among those here.
    store_pack(B.codes + off, fp8_pack<N>(e5m2, q, __activemask()));
  }
  amax_update(amax_bits, r);
}

// Computes one unit from its loaded inputs, emits it, and folds it into the amax bits.
//   in_off   flat offset of the unit's activation-half inputs in x (and dx)
//   out_off  flat offset of the unit in the [rows, H] arrays (y, dz)
template <typename Spec, typename T, int N, bool kBwd, EltOut kOut>
__device__ __forceinline__ void eltwise_unit(const EltArgs<T>& a, const EltBatch<T>& B,
                                             const Pack<T, N>& xa, const Pack<T, N>& xb,
                                             const Pack<T, N>& dz, uint64_t in_off,
                                             uint64_t out_off, unsigned& amax_bits) {
  float fa[N], fb[N];
  to_float(xa, fa);
  if constexpr (Spec::kGated) to_float(xb, fb);
  if constexpr (!kBwd) {
    float y[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      y[i] = act_forward<Spec>(fa[i], Spec::kGated ? fb[i] : 0.0f, a.params);
    }
    eltwise_emit<T, N, kOut>(B, a.e5m2, out_off, y, amax_bits);
  } else {
    float g[N], da[N], db[N];
    to_float(dz, g);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      act_backward<Spec>(g[i], fa[i], Spec::kGated ? fb[i] : 0.0f, a.params, da[i], db[i]);
    }
    eltwise_emit<T, N, kOut>(B, a.e5m2, in_off, da, amax_bits);
    if constexpr (Spec::kGated) eltwise_emit<T, N, kOut>(B, a.e5m2, in_off + a.hidden, db, amax_bits);
  }
}

// Blocks per SM the kernel is compiled to fit (registers <= 64, or <= 80 for gated backward, which
// keeps 6 loads in flight): the register cap that lets this many blocks share an SM. The
// unquantized non-gated forward runs one 16-byte unit per thread at 8 blocks per SM (<= 32
// registers), see kEltUnroll.
template <typename Spec, bool kBwd, EltOut kOut>
constexpr bool kEltThinForward = !Spec::kGated && !kBwd && kOut == EltOut::kValues;
template <typename Spec, bool kBwd, EltOut kOut>
constexpr int kEltBlocksPerSm = kEltThinForward<Spec, kBwd, kOut> ? 8
                                : Spec::kGated && kBwd            ? 3
                                                                  : 4;

// One batch's grid-stride loop; returns the thread's amax bits over it.
template <typename Spec, typename T, int kVec, int kUnroll, bool kBwd, EltOut kOut>
__device__ __forceinline__ unsigned eltwise_batch(const EltArgs<T>& a, const EltBatch<T>& B) {
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
        xa[k] = load_pack<T, kVec>(B.x + in_off);
        if constexpr (kGated) xb[k] = load_pack<T, kVec>(B.x + in_off + H);
        if constexpr (kBwd) g[k] = load_pack<T, kVec>(B.dz + u * kVec);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint64_t u = u0 + k * nthreads;
      if (u < a.n_units) {
        const uint64_t in_off = kGated ? u * kVec + row_off[k] : u * kVec;
        eltwise_unit<Spec, T, kVec, kBwd, kOut>(a, B, xa[k], xb[k], g[k], in_off, u * kVec,
                                                amax_bits);
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
      const Pack<T, 1> xa = load_pack<T, 1>(B.x + i);
      Pack<T, 1> g;
      if constexpr (kBwd) g = load_pack<T, 1>(B.dz + i);
      eltwise_unit<Spec, T, 1, kBwd, kOut>(a, B, xa, xa, g, i, i, amax_bits);
    }
  }
  return amax_bits;
}

// Batch blockIdx.y (the launcher gives every batch its row of blocks: a loop over batches here
// cost the gated kernels registers, and spills), its units along x.
template <typename Spec, typename T, int kVec, int kUnroll, bool kBwd, EltOut kOut>
__global__ void __launch_bounds__(kThreads, (kEltBlocksPerSm<Spec, kBwd, kOut>))
    eltwise_kernel(const EltArgs<T> a) {
  if constexpr (kOut == EltOut::kFp8) {
    if (a.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0) {
      for (uint64_t b = threadIdx.x; b < a.batches; b += kThreads) {
        a.scale_inv[b] = fmt::div_rn(1.0f, elt_tensor_scale(a, b));
      }
    }
  }
  const uint64_t b = blockIdx.y;
  EltBatch<T> B{a.x + b * a.x_stride, nullptr, nullptr, nullptr, 0.0f};
  if constexpr (kBwd) B.dz = a.dz + b * a.dz_stride;
  if constexpr (kOut == EltOut::kValues) B.out = a.out + b * a.out_stride;
  if constexpr (kOut == EltOut::kFp8) {
    B.codes = a.codes + b * a.out_stride;
    B.scale = elt_tensor_scale(a, b);
  }
  const unsigned amax_bits = eltwise_batch<Spec, T, kVec, kUnroll, kBwd, kOut>(a, B);
  if (a.amax != nullptr) block_amax_commit(amax_bits, a.amax + b);
}

// Loads per unit (each one 16-byte access on the vector path) and the unroll that keeps 4 (6 for
// gated backward) independent loads in flight per thread. The unquantized non-gated forward
// instead runs one unit per thread with twice the threads per SM, which beat 2 or 4 units per
// thread at 4 blocks per SM, float32 and bf16 alike (NOTES.md, "Elementwise kernel").
template <typename Spec, bool kBwd, EltOut kOut>
constexpr int kEltUnroll = kEltThinForward<Spec, kBwd, kOut> ? 1
                           : (Spec::kGated ? 2 : 1) + (kBwd ? 1 : 0) >= 3
                               ? 2
                               : 4 / ((Spec::kGated ? 2 : 1) + (kBwd ? 1 : 0));

// The grid's y limit: more batches take quantize.cuh's tiled kernel.
constexpr uint64_t kEltMaxBatches = 65535;

// Enqueues: a memset of a.amax[0, batches) (when requested), then one elementwise kernel. `a`
// comes with its pointers, params, amax and (kFp8) scale fields set; this fills in the index
// space of `rows` x `hidden` in a.batches batches (which divide rows).
template <typename Spec, typename T, bool kBwd, EltOut kOut>
cudaError_t launch_eltwise_batches(EltArgs<T> a, int64_t rows, int64_t hidden,
                                   cudaStream_t stream, const LaunchConfig& cfg) {
  constexpr int kVec = kVecOf<T>;
  constexpr int kUnroll = kEltUnroll<Spec, kBwd, kOut>;
  auto* const vec_kernel = &eltwise_kernel<Spec, T, kVec, kUnroll, kBwd, kOut>;
  auto* const scalar_kernel = &eltwise_kernel<Spec, T, 1, kUnroll, kBwd, kOut>;
  if (cfg.load_only) {
    if (cudaError_t e = load_kernel(vec_kernel); e != cudaSuccess) return e;
    return load_kernel(scalar_kernel);
  }

  const uint64_t batches = std::max<uint64_t>(a.batches, 1);
  if (batches > kEltMaxBatches) return cudaErrorInvalidValue;
  if (a.amax != nullptr) {
    if (cudaError_t e = cudaMemsetAsync(a.amax, 0, batches * sizeof(float), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  const uint64_t H = static_cast<uint64_t>(hidden);
  const uint64_t mb = static_cast<uint64_t>(rows) / batches;
  constexpr uint64_t L = Spec::kGated ? 2 : 1;
  a.batches = batches;
  a.hidden = H;
  a.n_elems = mb * H;
  a.x_stride = mb * L * H;
  a.dz_stride = mb * H;
  a.out_stride = kBwd ? mb * L * H : mb * H;
  const bool fp8_scale_inv = kOut == EltOut::kFp8 && a.scale_inv != nullptr;
  if (a.n_elems == 0 && !fp8_scale_inv) return cudaSuccess;

  // The vector path needs every batch's arrays 16-byte aligned (codes: kVec-byte aligned), and
  // a gated row a whole number of units.
  const auto aligned = [](const void* p, uintptr_t k) {
    return (reinterpret_cast<uintptr_t>(p) % k) == 0;
  };
  const bool vec = aligned16(a.x) && (!kBwd || aligned16(a.dz)) &&
                   (kOut != EltOut::kValues || aligned16(a.out)) &&
                   (kOut != EltOut::kFp8 || aligned(a.codes, kVec)) &&
                   (!Spec::kGated || H % kVec == 0) && (batches == 1 || a.n_elems % kVec == 0);
  const int width = vec ? kVec : 1;
  a.units_per_row = H / width;
  a.n_units = a.n_elems / width;

  const uint64_t per_block = static_cast<uint64_t>(kThreads) * kUnroll;
  // One block per kThreads * kUnroll units, not a persistent grid: a grid capped at
  // kEltBlocksPerSm blocks per SM was slower (NOTES.md). The grid-stride loop
  // then runs once per thread, unless cfg.max_blocks (tests) or the grid's limits cap the grid.
  const uint64_t cap = cfg.max_blocks > 0 ? cfg.max_blocks : ~uint64_t{0};
  const uint64_t gx = std::clamp<uint64_t>((a.n_units + per_block - 1) / per_block, 1,
                                           std::min<uint64_t>(cap, 0x7fffffff));
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(batches));
  if (vec) {
    vec_kernel<<<grid, kThreads, 0, stream>>>(a);
  } else {
    scalar_kernel<<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

// NO_SCALING: y = act(x) (backward: dx = dact(dz, x)) in x's dtype, and optionally its amax.
template <typename Spec, typename T, bool kBwd>
cudaError_t launch_eltwise(const void* x, const void* dz, void* out, int64_t rows, int64_t hidden,
                           const ActParams& params, float* amax, cudaStream_t stream,
                           const LaunchConfig& cfg) {
  EltArgs<T> a{};
  a.x = static_cast<const T*>(x);
  a.dz = static_cast<const T*>(dz);
  a.out = static_cast<T*>(out);
  a.batches = 1;
  a.params = params;
  a.amax = reinterpret_cast<unsigned*>(amax);
  return launch_eltwise_batches<Spec, T, kBwd, EltOut::kValues>(a, rows, hidden, stream, cfg);
}

}  // namespace te_jax::cuda
