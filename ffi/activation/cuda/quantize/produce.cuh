// Producing a tile's values: the loads of x (and dz), all issued before the first value is
// computed, then per value the activation (or its gradient) in float32, rounded to x's dtype
// (what NO_SCALING outputs). Along the way the thread's packed max key of |y| (the amax) and,
// backward, its dbias sums.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "activation/activations.h"
#include "activation/cuda/elementwise.cuh"
#include "activation/cuda/quantize/args.cuh"
#include "activation/cuda/quantize/dbias.cuh"
#include "activation/cuda/quantize/geometry.cuh"
#include "activation/cuda/quantize/tile.cuh"
#include "activation/cuda/quantize/values.cuh"
#include "cuda/device_utils.cuh"

namespace te_jax::cuda::quant {

// The standalone quantize of a 16-bit input (the identity forward): y is x itself, so the kernel
// takes the loaded words as they are instead of converting them to float32 and back (12
// instructions per 8 values). The round trip quiets signalling NaNs (the CPU's store sets the
// quiet bit and keeps the payload): no code depends on a NaN's payload, but the amax does, so it
// takes the words through quiet_nan16.
template <typename Spec, typename T, bool kBwd>
inline constexpr bool kRawIdentity = !kBwd && !Spec::kGated && !std::is_same_v<T, float> &&
                                     std::is_same_v<typename Spec::Act, act::Identity>;

// The packed 16-bit pair w with the quiet bit set in each NaN half (bfloat16 bit 6, float16 bit 9):
// a half is NaN when its magnitude exceeds the infinity's, which the add carries into bit 15.
template <typename T>
__device__ __forceinline__ uint32_t quiet_nan16(uint32_t w) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr uint32_t kBelowNan = kBf16 ? 0x007f007fu : 0x03ff03ffu;  // 0x7fff - inf
  constexpr int kShift = kBf16 ? 9 : 6;                             // bit 15 -> the quiet bit
  const uint32_t nan = ((w & 0x7fff7fffu) + kBelowNan) & 0x80008000u;
  return w | (nan >> kShift);
}

// The tile loads of one thread, for the tiles of one group. With kPrefetch (the MXFP8 forward)
// whole tiles' inputs go through shared memory: the cp.async copies of tile rt + 1 are issued as
// soon as tile rt's have been read, so they are in flight while tile rt is computed.
template <typename Spec, typename T, bool kBwd, bool kPrefetch>
struct TileLoader {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  static constexpr int kInHalves = TileShape::kInHalves;
  static constexpr int kRowsPerThread = TileShape::kRowsPerThread;
  static constexpr int kLoadsPerRow = TileShape::kLoadsPerRow;
  // The prefetch buffer: per thread kRowsPerThread * kInHalves loads of 8 elements, in 16-byte
  // chunks [chunk][thread] (a warp's chunk is 512 contiguous bytes: no bank conflicts).
  static constexpr int kChunksPerLoad = static_cast<int>(sizeof(T)) / 2;
  static constexpr int kChunks = kRowsPerThread * kInHalves * kChunksPerLoad;
  static constexpr int kBufferChunks = kPrefetch ? kChunks : 1;
  static constexpr int kBufferThreads = kPrefetch ? kThreads : 1;
  using Buffer = uint4[kBufferChunks][kBufferThreads];
  // Chunk c holds quarter q of the load of half h of row i (in[i][h].w[4q .. 4q + 3]).
  struct Chunk {
    int i, h, q;
  };
  static constexpr Chunk chunk(int c) {
    return {c / (kInHalves * kChunksPerLoad), (c / kChunksPerLoad) % kInHalves,
            c % kChunksPerLoad};
  }

  const T* x;
  const T* dz;
  uint64_t H;
  int tid;
  Buffer& buffer;
  bool prefetched;  // the next tile's inputs are on their way to `buffer`

  __device__ __forceinline__ void prefetch(uint64_t x_off) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const auto k = chunk(c);
      cp_async16(&buffer[c][tid],
                 x + x_off + k.i * (kInHalves * H) + k.h * H + k.q * (16 / sizeof(T)));
    }
  }

  // Issues all of the tile's loads into `in` (x_off, z_off: this thread's first elements of x
  // and dz; the prefetch of the group's next tile, tile_end its end) and sets valid_cols.
  template <bool kWhole>
  __device__ __forceinline__ void load(const Lane& lane, const TilePosition& tile,
                                       uint64_t tile_end, uint64_t x_off, uint64_t z_off,
                                       int ncol, bool vec_in,
                                       RawWords8<T> (&in)[kRowsPerThread][kLoadsPerRow],
                                       int (&valid_cols)[kRowsPerThread]) {
    if constexpr (kPrefetch && kWhole) {
      if (!prefetched) prefetch(x_off);
      cp_async_wait_all();
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const auto k = chunk(c);
        const uint4 u = buffer[c][tid];
        uint32_t* w = &in[k.i][k.h].w[4 * k.q];
        w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
      }
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) valid_cols[i] = 8;
      // The next tile's copies reuse this thread's chunks: its reads above are done first
      // (a thread's shared-memory accesses are performed in order, and the copies write only
      // after their global loads return).
      prefetched = tile.row_tile + 1 < tile_end &&
                   lane.rows_per_batch - (tile.row_tile + 1) * kTileRows >= kTileRows;
      if (prefetched) prefetch(x_off + kTileRows * kInHalves * H);
    } else {
      if constexpr (kPrefetch) prefetched = false;
      const T* xr = x + x_off;
      [[maybe_unused]] const T* zr = dz + z_off;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        // A local (not valid_cols[i]): the stores into `in` may alias valid_cols as far as this
        // function alone can tell, and a reload would lose n's known range [0, 8].
        const int n = kWhole ? 8 : (lane.ty * kRowsPerThread + i < tile.rows ? ncol : 0);
        valid_cols[i] = n;
        if constexpr (kBwd) load8(zr + i * H, vec_in, n, in[i][0]);
        load8(xr + i * (kInHalves * H), vec_in, n, in[i][kBwd ? 1 : 0]);
        if constexpr (kInHalves == 2) {
          load8(xr + i * (kInHalves * H) + H, vec_in, n, in[i][kBwd ? 2 : 1]);
        }
      }
    }
  }
};

// The tile's values from its loaded inputs: y = act(x) (forward) or its gradients (backward)
// rounded to T, 0 where invalid (past valid_cols); amax_key gathers the packed max of |y|
// (Values8::to_key), and the backward adds the unrounded values to its dbias sums.
template <typename Spec, typename T, bool kBwd>
__device__ __forceinline__ void compute_tile_values(
    const QuantizeArgs& args,
    const RawWords8<T> (&in)[TileGeometry<Spec, T, kBwd>::kRowsPerThread]
                            [TileGeometry<Spec, T, kBwd>::kLoadsPerRow],
    const int (&valid_cols)[TileGeometry<Spec, T, kBwd>::kRowsPerThread],
    Values8<T> (&y)[TileGeometry<Spec, T, kBwd>::kRowsPerThread]
                   [TileGeometry<Spec, T, kBwd>::kOutHalves],
    uint32_t& amax_key, DbiasSums<TileGeometry<Spec, T, kBwd>::kOutHalves>& dbias) {
  using TileShape = TileGeometry<Spec, T, kBwd>;
  constexpr int kInHalves = TileShape::kInHalves, kOutHalves = TileShape::kOutHalves;
  constexpr int kRowsPerThread = TileShape::kRowsPerThread;
  if constexpr (kRawIdentity<Spec, T, kBwd>) {
    // y = x: the loaded words are the values (invalid elements were loaded as 0).
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) y[i][0].w[j] = in[i][0].w[j];
    }
    if (args.amax != nullptr) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          amax_key = Values8<T>::key_max(amax_key, quiet_nan16<T>(y[i][0].w[j]) * 2u);
        }
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int n_ok = valid_cols[i];  // read once: the stores into y may alias valid_cols here
      [[maybe_unused]] float fa[8], fb[8], fg[8], raw[kOutHalves][8];
      if constexpr (kBwd) to_float8(in[i][0], fg);
      to_float8(in[i][kBwd ? 1 : 0], fa);
      if constexpr (kInHalves == 2) to_float8(in[i][kBwd ? 2 : 1], fb);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float bk = kInHalves == 2 ? fb[k] : 0.0f;
        if constexpr (!kBwd) {
          raw[0][k] = act_forward<Spec>(fa[k], bk, args.params);
        } else {
          float da, db;
          act_backward<Spec>(fg[k], fa[k], bk, args.params, da, db);
          raw[0][k] = da;
          if constexpr (kOutHalves == 2) raw[kOutHalves - 1][k] = db;
        }
      }
#pragma unroll
      for (int l = 0; l < kOutHalves; ++l) {
        y[i][l].set(raw[l], n_ok);
        amax_key = Values8<T>::key_max(amax_key, packed_max8(y[i][l]));
        // dbias: masked elements come from zero inputs (dz = 0), whose gradients are +-0
        // for every activation, and adding +-0 leaves the sum (never -0: it starts at +0)
        // as it is.
        if constexpr (kBwd) dbias.add(l, raw[l]);
      }
    }
  }
}

}  // namespace te_jax::cuda::quant
