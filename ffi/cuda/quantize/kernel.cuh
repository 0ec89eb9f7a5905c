// The quantizing kernel, organised as ffi/cpu/quantized.cc is: per work item (column tile, group
// of row tiles, batch), per tile produce the values (all of the tile's loads, then the activation
// in float32 rounded to x's dtype, the amax key and the dbias sums), emit them in the mode's
// format (TENSOR / MXFP8 / NVFP4; nothing for the amax pass), and at the end of the item commit
// the amax and write the dbias partials. The modes are compile-time branches of one body: the
// kernels are register-bound, and their machine code is kept as it was tuned (see
// ffi/cuda/NOTES.md, "Quantized path", for the design and docs/performance.md for measurements).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/activations.h"
#include "common/formats.h"
#include "cuda/device_utils.cuh"
#include "cuda/quantize/args.cuh"
#include "cuda/quantize/codes.cuh"
#include "cuda/quantize/geometry.cuh"
#include "cuda/quantize/mxfp8_scale.cuh"
#include "cuda/quantize/nvfp4_codes.cuh"
#include "cuda/quantize/shared.cuh"
#include "cuda/quantize/values.cuh"

namespace te_jax::cuda::quant {

template <typename Spec, typename T, Mode M, bool kBwd>
__global__ void __launch_bounds__(kThreads, (kMinBlocksPerSm<Spec, T, M, kBwd>))
    quantize_kernel(const QuantizeArgs args) {
  using Geo = TileGeometry<Spec, T, kBwd>;
  using Smem = SharedLayout<Spec, T, M, kBwd>;
  constexpr int kInHalves = Geo::kInHalves, kOutHalves = Geo::kOutHalves, kRowsPerThread = Geo::kRowsPerThread, kCols = Geo::kCols, kColLanes = Geo::kColLanes, kRowLanes = Geo::kRowLanes;
  constexpr int kColBlocks = Smem::kColBlocks;
  constexpr bool kFp4Cmp = Smem::kFp4Cmp;
  __shared__ alignas(16) unsigned char smem_a[Smem::kExchangeBytes];
  __shared__ alignas(16) unsigned char smem_b[Smem::kBlockBytes];
  __shared__ alignas(16) uint32_t smem_t[Smem::kTableRows][kFp4TableWords];
  __shared__ alignas(16) uint4 smem_p[Smem::kPrefetchChunks][Smem::kPrefetch ? kThreads : 1];

  const int tid = threadIdx.x;
  // Lets the compiler fold index arithmetic that mixes tid with compile-time strides.
  __builtin_assume(tid >= 0 && tid < kThreads);
  const int tx = tid % kColLanes, ty = tid / kColLanes;
  const uint64_t H = args.H, y_cols = args.y_cols, rows_per_batch = args.rows_per_batch;
  const T* x = static_cast<const T*>(args.x);
  const T* dz = static_cast<const T*>(args.dz);
  const bool rowwise = args.data != nullptr, colwise = args.colwise != nullptr;

  if constexpr (M == Mode::kTensor || M == Mode::kNvfp4) {
    if (args.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
      for (uint64_t b = tid; b < args.batches; b += kThreads) {
        args.scale_inv[b] = fmt::div_rn(1.0f, tensor_scale(args, b));
      }
    }
  }

  // Work items (column tile x, group y, batch z), grid-strided in each dimension (the grid is
  // (col_tiles, groups, batches) unless capped).
  for (uint32_t b = blockIdx.z; b < args.batches; b += gridDim.z) {
  if constexpr (kFp4Cmp) {
    __syncthreads();  // the previous batch's table is read until here
    build_fp4_table<T>(*reinterpret_cast<Fp4Table*>(smem_t), tensor_scale(args, b));
    __syncthreads();
  }
  // The batch's tensor scale (a load and, for a scale derived from the amax, a division: once per
  // batch, not per tile).
  [[maybe_unused]] float s = 0.0f;
  if constexpr (M == Mode::kTensor || M == Mode::kNvfp4) s = tensor_scale(args, b);
  // Column tiles outer, groups inner: a block usually keeps its column tile (the grid's x is the
  // column tile count) and walks several groups, so the column set-up runs once.
  for (uint32_t ct = blockIdx.x; ct < args.col_tiles; ct += gridDim.x) {
  const uint64_t tile_c0 = uint64_t{ct} * kCols;
  const uint64_t c0 = tile_c0 + static_cast<uint64_t>(tx) * 8;  // this lane's first column
  const int ncol = c0 < H ? static_cast<int>(std::min<uint64_t>(8, H - c0)) : 0;
  for (uint32_t g = blockIdx.y; g < args.groups; g += gridDim.y) {
    // The group's row tiles: one (groups == row_tiles), or a range of consecutive ones (the dbias
    // groups; the block-scaled modes' blocks, see launch_quantized).
    uint64_t t_begin = g, t_end = uint64_t{g} + 1;
    if (args.groups != args.row_tiles) {
      t_begin = uint64_t{g} * args.row_tiles / args.groups;
      t_end = (uint64_t{g} + 1) * args.row_tiles / args.groups;
    }
    uint32_t amax_key = 0;  // packed max of |y| (Values8::to_key)
    float acc[kOutHalves][8];
#pragma unroll
    for (int l = 0; l < kOutHalves; ++l)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[l][k] = 0.0f;

    // This thread's element offsets in x, dz and y at (its first row of the group's first tile,
    // c0); each tile steps them by its rows' strides instead of multiplying per tile (the 64-bit
    // products were a large part of a tile's instructions: ffi/cuda/NOTES.md, "The ALU pipe").
    const uint64_t row_first = b * rows_per_batch + t_begin * kTileRows + static_cast<uint64_t>(ty) * kRowsPerThread;
    uint64_t x_off = row_first * (kInHalves * H) + c0;
    [[maybe_unused]] uint64_t z_off = row_first * H + c0;
    uint64_t y_off = row_first * y_cols + c0;
    // With Smem::kPrefetch the whole tiles' inputs go through smem_p: the copies of tile rt + 1 are
    // issued as soon as tile rt's have been read, so they are in flight while tile rt is computed.
    [[maybe_unused]] bool prefetched = false;  // this tile's inputs are on their way to smem_p
    [[maybe_unused]] auto prefetch = [&](uint64_t xo) {
#pragma unroll
      for (int c = 0; c < Smem::kChunks; ++c) {
        const auto k = Smem::chunk(c);
        cp_async16(&smem_p[c][tid], x + xo + k.i * (kInHalves * H) + k.h * H + k.q * (16 / sizeof(T)));
      }
    };
    for (uint64_t rt = t_begin; rt < t_end;
         ++rt, x_off += kTileRows * kInHalves * H, z_off += kTileRows * H, y_off += kTileRows * y_cols) {
      const uint64_t r0 = b * rows_per_batch + rt * kTileRows;  // the tile's first row
      const int tile_rows = static_cast<int>(std::min<uint64_t>(kTileRows, rows_per_batch - rt * kTileRows));
      // Whole tiles (every row and column inside, 16-byte loads and vector stores), nearly all of
      // a large input, run a copy of the tile in which the edge checks are constants, for the
      // block-scaled forward (branches were a measurable share of its instructions). The backward
      // and the tensor-scaled tiles keep one copy: the second one added spills there and was
      // slower (ffi/cuda/NOTES.md, "Per-tile overhead").
      constexpr bool kWholeCopy = !kBwd && (M == Mode::kMx || M == Mode::kNvfp4);
      const bool whole = tile_rows == kTileRows && tile_c0 + kCols <= H && args.vec_in && args.vec_out;
      auto tile = [&](auto whole_tag) {
        constexpr bool kWhole = decltype(whole_tag)::value;
        const int rows = kWhole ? kTileRows : tile_rows;
        [[maybe_unused]] const bool vec_in = kWhole || args.vec_in, vec_out = kWhole || args.vec_out;
        int valid_cols[kRowsPerThread];
        // ---- loads: all of the tile's, then compute ----
        RawWords8<T> in[kRowsPerThread][Geo::kLoadsPerRow];
        if constexpr (Smem::kPrefetch && kWhole) {
          if (!prefetched) prefetch(x_off);
          cp_async_wait_all();
#pragma unroll
          for (int c = 0; c < Smem::kChunks; ++c) {
            const auto k = Smem::chunk(c);
            const uint4 u = smem_p[c][tid];
            uint32_t* w = &in[k.i][k.h].w[4 * k.q];
            w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
          }
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) valid_cols[i] = 8;
          // The next tile's copies reuse this thread's chunks: its reads above are done first
          // (a thread's shared-memory accesses are performed in order, and the copies write only
          // after their global loads return).
          prefetched = rt + 1 < t_end && rows_per_batch - (rt + 1) * kTileRows >= kTileRows;
          if (prefetched) prefetch(x_off + kTileRows * kInHalves * H);
        } else {
          if constexpr (Smem::kPrefetch) prefetched = false;
          const T* xr = x + x_off;
          [[maybe_unused]] const T* zr = dz + z_off;
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
            valid_cols[i] = kWhole ? 8 : (ty * kRowsPerThread + i < rows ? ncol : 0);
            if constexpr (kBwd) load8(zr + i * H, vec_in, valid_cols[i], in[i][0]);
            load8(xr + i * (kInHalves * H), vec_in, valid_cols[i], in[i][kBwd ? 1 : 0]);
            if constexpr (kInHalves == 2) load8(xr + i * (kInHalves * H) + H, vec_in, valid_cols[i], in[i][kBwd ? 2 : 1]);
          }
        }
        Values8<T> v[kRowsPerThread][kOutHalves];  // y rounded to T (0 where invalid)
        if constexpr (kRawIdentity<Spec, T, kBwd>) {
          // y = x: the loaded words are the values (invalid elements were loaded as 0).
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) v[i][0].w[j] = in[i][0].w[j];
          }
          if (args.amax != nullptr) {
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                amax_key = Values8<T>::key_max(amax_key, quiet_nan16<T>(v[i][0].w[j]) * 2u);
              }
            }
          }
        } else {
#pragma unroll
          for (int i = 0; i < kRowsPerThread; ++i) {
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
              v[i][l].set(raw[l], valid_cols[i]);
              amax_key = Values8<T>::key_max(amax_key, packed_max8(v[i][l]));
              // dbias: masked elements come from zero inputs (dz = 0), whose gradients are +-0
              // for every activation, and adding +-0 leaves the sum (never -0: it starts at +0)
              // as it is.
              if constexpr (kBwd) {
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[l][k] += raw[l][k];
              }
            }
          }
        }

        // ---- emit ----
        if constexpr (M == Mode::kTensor) {
          constexpr int kStride = Smem::kTransposedStride;
          auto& tcodes = *reinterpret_cast<uint8_t(*)[kOutHalves][kTileRows][kStride]>(smem_a);
#pragma unroll
          for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
            for (int i = 0; i < kRowsPerThread; ++i) {
              const int ri = ty * kRowsPerThread + i;
              const uint2 c = tensor_codes(args.e5m2, v[i][l], s);
              if (rowwise && valid_cols[i] > 0) {
                store_codes8(args.data + y_off + i * y_cols + l * H, c, vec_out, valid_cols[i]);
              }
              if (colwise) {
                // Two 4-byte stores: the padded stride keeps only 4-byte alignment.
                uint32_t* t = reinterpret_cast<uint32_t*>(&tcodes[l][ri][tx * 8]);
                t[0] = c.x;
                t[1] = c.y;
              }
            }
          }
          if (colwise) {
            __syncthreads();
            if constexpr (kRowsPerThread == 4) {
              // Thread = (column group g of 4 columns, row quarter q of 8 rows): 8 shared loads of
              // 4 codes (one row of the group each), two 4x4 byte transposes, then per column one
              // 8-byte store of its 8 rows. The 4 lanes of a group fill each column's 32-byte
              // sector in one store instruction (8 whole sectors per instruction; one column per
              // thread wrote 16-byte halves, 32 per instruction, well below copy bandwidth). The
              // stride of kCols + 4 bytes (an odd number of words) puts the quarters' rows 8 apart
              // on different banks.
              const int q = tid & 3, grp = tid >> 2;
              const int rb = 8 * q;
              const uint64_t col0 = tile_c0 + 4 * grp;
              if (col0 < H && rb < rows) {
#pragma unroll
                for (int l = 0; l < kOutHalves; ++l) {
                  uint32_t w[8];
#pragma unroll
                  for (int r = 0; r < 8; ++r) {
                    w[r] = *reinterpret_cast<const uint32_t*>(&tcodes[l][rb + r][4 * grp]);
                  }
                  uint32_t cw[4][2];  // column k: rows 0-3, rows 4-7 (first row in the low byte)
#pragma unroll
                  for (int h = 0; h < 2; ++h) {
                    const uint32_t* x = w + 4 * h;
                    const uint32_t t0 = __byte_perm(x[0], x[1], 0x5140);
                    const uint32_t t1 = __byte_perm(x[2], x[3], 0x5140);
                    const uint32_t t2 = __byte_perm(x[0], x[1], 0x7362);
                    const uint32_t t3 = __byte_perm(x[2], x[3], 0x7362);
                    cw[0][h] = __byte_perm(t0, t1, 0x5410);
                    cw[1][h] = __byte_perm(t0, t1, 0x7632);
                    cw[2][h] = __byte_perm(t2, t3, 0x5410);
                    cw[3][h] = __byte_perm(t2, t3, 0x7632);
                  }
#pragma unroll
                  for (int k = 0; k < 4; ++k) {
                    const uint64_t col = col0 + k;
                    if (col < H) {
                      uint8_t* dst =
                          args.colwise + b * y_cols * rows_per_batch + (l * H + col) * rows_per_batch + rt * kTileRows + rb;
                      if (args.vec_transposed) {  // the 8 rows are whole (rows_per_batch % 32 == 0)
                        asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(cw[k][0]),
                                     "r"(cw[k][1])
                                     : "memory");
                      } else {
                        const int m = min(8, rows - rb);
                        for (int j = 0; j < m; ++j) {
                          dst[j] = static_cast<uint8_t>(cw[k][j >> 2] >> (8 * (j & 3)));
                        }
                      }
                    }
                  }
                }
              }
            } else {
              constexpr int kChunks = kThreads / kCols;          // 4 / kRowsPerThread
              constexpr int kChunkRows = kTileRows / kChunks;    // 8 kRowsPerThread
              const int tc = tid % kCols, ch = tid / kCols;
              const int rb = ch * kChunkRows;
              const uint64_t col = tile_c0 + tc;
              if (col < H && rb < rows) {
#pragma unroll
                for (int l = 0; l < kOutHalves; ++l) {
                  uint8_t* dst = args.colwise + b * y_cols * rows_per_batch + (l * H + col) * rows_per_batch + rt * kTileRows + rb;
                  if (args.vec_transposed) {  // the chunk is whole (rows_per_batch % kChunkRows == 0)
                    uint32_t w[kChunkRows / 4];
#pragma unroll
                    for (int j = 0; j < kChunkRows / 4; ++j) {
                      w[j] = static_cast<uint32_t>(tcodes[l][rb + 4 * j][tc]) |
                             (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 1][tc]) << 8) |
                             (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 2][tc]) << 16) |
                             (static_cast<uint32_t>(tcodes[l][rb + 4 * j + 3][tc]) << 24);
                    }
                    if constexpr (kChunkRows == 8) {
                      asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(w[0]),
                                   "r"(w[1])
                                   : "memory");
                    } else {
#pragma unroll
                      for (int j = 0; j < kChunkRows / 16; ++j) {
                        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst + 16 * j),
                                     "r"(w[4 * j]), "r"(w[4 * j + 1]), "r"(w[4 * j + 2]),
                                     "r"(w[4 * j + 3])
                                     : "memory");
                      }
                    }
                  } else {
                    const int m = min(kChunkRows, rows - rb);
                    for (int j = 0; j < m; ++j) dst[j] = tcodes[l][rb + j][tc];
                  }
                }
              }
            }
            __syncthreads();  // tcodes is rewritten by the next tile
          }
        } else if constexpr (M == Mode::kMx || M == Mode::kNvfp4) {
          constexpr int kGroupLanes = M == Mode::kMx ? 4 : 2;  // lanes per rowwise block
          if (rowwise) {
            // The block maxima of all rows first (the shuffles' latencies overlap), then one row at
            // a time.
            unsigned keys[kOutHalves][kRowsPerThread];
#pragma unroll
            for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
              for (int i = 0; i < kRowsPerThread; ++i) {
                keys[l][i] = Values8<T>::to_key(packed_max8(v[i][l]));
              }
            }
#pragma unroll
            for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
              for (int i = 0; i < kRowsPerThread; ++i) {
                unsigned key = keys[l][i];
                key = max(key, __shfl_xor_sync(0xffffffffu, key, 1));
                if constexpr (kGroupLanes == 4) {
                  key = max(key, __shfl_xor_sync(0xffffffffu, key, 2));
                }
                keys[l][i] = key;
              }
            }
            // The block scales of this lane's rows: row i, half l at bsr[i * bs_row + l * bs_half],
            // for the lanes that store them (c0 % kBlk == 0; the rowwise layout needs y_cols % kBlk ==
            // 0, so row * y_cols / kBlk + c0 / kBlk = y_off / kBlk).
            constexpr int kBlk = M == Mode::kMx ? 32 : 16;
            const uint64_t bs_row = y_cols / kBlk, bs_half = H / kBlk;
            uint8_t* const bsr = args.block_scale + y_off / kBlk;
            // 16-bit NVFP4: the two lanes of a block hold the same keys; each computes the scale
            // codes of half of the rows (lane tx % 2 == h takes rows [h R / 2, (h + 1) R / 2),
            // R = kRowsPerThread is 2 or 4 here) and gives them to the other: one shuffle for ~16
            // instructions of nvfp4_scale, most of them on the ALU pipe (measured faster:
            // ffi/cuda/NOTES.md, "The ALU pipe").
            [[maybe_unused]] uint8_t fp4_codes[kOutHalves][kRowsPerThread];
            if constexpr (kFp4Cmp) {
              const bool upper = (tx & 1) != 0;
#pragma unroll
              for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
                for (int k = 0; k < kRowsPerThread / 2; ++k) {
                  const uint8_t mine = nvfp4_scale(upper ? keys[l][kRowsPerThread / 2 + k] : keys[l][k], s);
                  const uint8_t other =
                      static_cast<uint8_t>(__shfl_xor_sync(0xffffffffu, unsigned{mine}, 1));
                  fp4_codes[l][k] = upper ? other : mine;
                  fp4_codes[l][kRowsPerThread / 2 + k] = upper ? mine : other;
                }
              }
            }
#pragma unroll
            for (int l = 0; l < kOutHalves; ++l) {
#pragma unroll
              for (int i = 0; i < kRowsPerThread; ++i) {
                uint8_t* const bs_at = bsr + i * bs_row + l * bs_half;
                const bool lead = (tx & (kGroupLanes - 1)) == 0;
                if constexpr (M == Mode::kMx) {
                  const MxScale sc(keys[l][i], args.qmax);
                  if (valid_cols[i] > 0 && lead) *bs_at = static_cast<uint8_t>(-sc.k + 127);
                  float q[8];
#pragma unroll
                  for (int k = 0; k < 8; ++k) q[k] = sc(v[i][l][k]);
                  const uint2 c = fp8_codes(args.e5m2, q);
                  if (valid_cols[i] > 0) store_codes8(args.data + y_off + i * y_cols + l * H, c, vec_out, valid_cols[i]);
                } else if constexpr (kFp4Cmp) {
                  const uint8_t code = fp4_codes[l][i];
                  if (valid_cols[i] > 0 && lead) *bs_at = code;
                  const uint32_t* const row = smem_t[code & 0x7fu];
                  const uint4 t0 = reinterpret_cast<const uint4*>(row)[0];
                  const uint4 t1 = reinterpret_cast<const uint4*>(row)[1];
                  const uint32_t y[7] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z};
                  const uint32_t keep = t1.w, nan_codes = row[8];
                  uint32_t codes = 0;
#pragma unroll
                  for (int p = 0; p < 4; ++p) {
                    codes = fp4_place(codes, fp4_pair(v[i][l].w[p], y), p);
                  }
                  if (valid_cols[i] > 0) {
                    store_fp4x8(args.data + y_off / 2 + i * (y_cols / 2) + l * (H / 2),
                                (codes & keep) | nan_codes, vec_out, valid_cols[i]);
                  }
                } else {
                  const uint8_t code = nvfp4_scale(keys[l][i], s);
                  if (valid_cols[i] > 0 && lead) *bs_at = code;
                  float bs[8], rb[8];
                  const float bsv = fmt::from_e4m3(code), rbv = __frcp_rn(bsv);
#pragma unroll
                  for (int k = 0; k < 8; ++k) bs[k] = bsv, rb[k] = rbv;
                  if (valid_cols[i] > 0) {
                    store_fp4x8(args.data + y_off / 2 + i * (y_cols / 2) + l * (H / 2),
                                nvfp4_codes(v[i][l], s, bs, rb), vec_out, valid_cols[i]);
                  }
                }
              }
            }
          }
          if (colwise) {
            auto& red = *reinterpret_cast<unsigned(*)[kOutHalves][kRowLanes][kCols]>(smem_a);
            [[maybe_unused]] auto& mx_f = *reinterpret_cast<float(*)[kOutHalves][kCols]>(smem_b);
            // NVFP4: the decoded block scales, then their reciprocals RN(1 / bs).
            [[maybe_unused]] auto& fp4_bs = *reinterpret_cast<float(*)[2][kOutHalves][kColBlocks][kCols]>(smem_b);
            // Per-lane column maxima over the lane's kRowsPerThread rows (all in one column block: kRowsPerThread | 16).
#pragma unroll
            for (int l = 0; l < kOutHalves; ++l) {
              unsigned ck[8];
              if constexpr (std::is_same_v<T, float>) {
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                  ck[k] = v[0][l].key_word(k);
#pragma unroll
                  for (int i = 1; i < kRowsPerThread; ++i) ck[k] = max(ck[k], v[i][l].key_word(k));
                }
              } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                  uint32_t m = v[0][l].key_word(j);
#pragma unroll
                  for (int i = 1; i < kRowsPerThread; ++i) m = Values8<T>::key_max(m, v[i][l].key_word(j));
                  ck[2 * j] = Values8<T>::key_lo(m);
                  ck[2 * j + 1] = Values8<T>::key_hi(m);
                }
              }
              uint4* dst = reinterpret_cast<uint4*>(&red[l][ty][tx * 8]);
              dst[0] = make_uint4(ck[0], ck[1], ck[2], ck[3]);
              dst[1] = make_uint4(ck[4], ck[5], ck[6], ck[7]);
            }
            __syncthreads();
            // Column block maxima (and the colwise block scales) by kOutHalves * kColBlocks * kCols
            // threads, in an unrolled loop whose index arithmetic folds (as a runtime loop, index
            // and address arithmetic was about half of the reducers' instructions). cb: the tile's
            // first row of colwise block scales, at its column 0 (block row (r0 + 16 blk) / 16 =
            // r0 / 16 + blk for NVFP4, r0 / 32 for MXFP8).
            constexpr int kLanesPerBlk = kRowLanes / kColBlocks;
            constexpr int kRedItems = kOutHalves * kColBlocks * kCols;
            uint8_t* const cb = args.colwise_block_scale + (r0 / (M == Mode::kMx ? 32 : 16)) * y_cols + tile_c0;
#pragma unroll
            for (int e0 = 0; e0 < kRedItems; e0 += kThreads) {
              const unsigned e = static_cast<unsigned>(e0 + tid);
              if (kRedItems % kThreads != 0 && e >= kRedItems) break;
              const unsigned l = e / (kColBlocks * kCols), blk = (e / kCols) % kColBlocks, c = e % kCols;
              unsigned m = 0;
#pragma unroll
              for (int t = 0; t < kLanesPerBlk; ++t) m = max(m, red[l][blk * kLanesPerBlk + t][c]);
              const bool out = tile_c0 + c < H && static_cast<int>(blk) * 16 < rows;
              if constexpr (M == Mode::kMx) {
                const MxScale sc(m, args.qmax);
                mx_f[l][c] = sc.factor();
                if (out) cb[l * H + c] = static_cast<uint8_t>(127 - sc.k);
              } else {
                const uint8_t code = nvfp4_scale(m, s);
                if constexpr (kFp4Cmp) {
                  // The block's thresholds from the table, and its special case: row 7 holds the
                  // nibble mask of the codes kept (0xf, or 0 for a zero or NaN scale) in the low
                  // byte and the NaN code (8 or 0) in the high one.
                  auto& thh = *reinterpret_cast<uint16_t(*)[kOutHalves][kColBlocks][8][kCols]>(smem_b);
                  // Column c is half c % 2 of pair (c % 8) / 2 of lane c / 8.
                  const int slot = 2 * fp4_pair_slot<kColLanes>(c / 8, (c % 8) / 2) + c % 2;
#pragma unroll
                  for (int j = 0; j < 7; ++j) {
                    thh[l][blk][j][slot] = static_cast<uint16_t>(smem_t[code & 0x7fu][j]);
                  }
                  const uint32_t cc = code & 0x7fu;
                  thh[l][blk][7][slot] = static_cast<uint16_t>(
                      cc == 0u ? 0u : (cc == 0x7fu ? 0x800u : 0xfu));
                } else {
                  const float bs = fmt::from_e4m3(code);
                  fp4_bs[0][l][blk][c] = bs;
                  fp4_bs[1][l][blk][c] = __frcp_rn(bs);
                }
                if (out) cb[blk * y_cols + l * H + c] = code;
              }
            }
            __syncthreads();
            [[maybe_unused]] const int blk = kColBlocks == 2 ? (ty * kRowsPerThread) / 16 : 0;
#pragma unroll
            for (int l = 0; l < kOutHalves; ++l) {
              if constexpr (M == Mode::kMx) {
                // Column pairs outer, rows inner: two columns' scales live at a time; the scaled
                // values of a row are kept (float) until its 8 are ready.
                float q[kRowsPerThread][8];
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                  const float2 f =
                      lds_f2(reinterpret_cast<const float2*>(&mx_f[l][tx * 8 + 2 * kk]));
                  const MxScale s0(f.x), s1(f.y);
#pragma unroll
                  for (int i = 0; i < kRowsPerThread; ++i) {
                    q[i][2 * kk] = s0(v[i][l][2 * kk]);
                    q[i][2 * kk + 1] = s1(v[i][l][2 * kk + 1]);
                  }
                }
#pragma unroll
                for (int i = 0; i < kRowsPerThread; ++i) {
                  const uint2 c = fp8_codes(args.e5m2, q[i]);
                  if (valid_cols[i] > 0) {
                    store_codes8(args.colwise + y_off + i * y_cols + l * H, c, vec_out,
                                 valid_cols[i]);
                  }
                }
              } else if constexpr (kFp4Cmp) {
                const auto& thw =
                    *reinterpret_cast<const uint32_t(*)[kOutHalves][kColBlocks][8][kCols / 2]>(smem_b);
                // One column pair at a time (its 7 thresholds live), rows inner; part[i]: row i's
                // codes so far, pair p's byte placed at byte p.
                uint32_t part[kRowsPerThread];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                  uint32_t y[7];
#pragma unroll
                  for (int j = 0; j < 7; ++j) y[j] = thw[l][blk][j][fp4_pair_slot<kColLanes>(tx, p)];
#pragma unroll
                  for (int i = 0; i < kRowsPerThread; ++i) {
                    part[i] = fp4_place(p == 0 ? 0u : part[i], fp4_pair(v[i][l].w[p], y), p);
                  }
                }
                // Row 7: per column pair, [keep0 | nan0 << 8, keep1 | nan1 << 8]; q | q >> 12 puts
                // the pair's keep byte in byte 0 and its NaN byte in byte 1.
                uint32_t z[4];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                  const uint32_t q = thw[l][blk][7][fp4_pair_slot<kColLanes>(tx, p)];
                  z[p] = q | (q >> 12);
                }
                const uint32_t keep =
                    prmt(prmt(z[0], z[1], 0x40u), prmt(z[2], z[3], 0x40u), 0x5410u);
                const uint32_t nanc =
                    prmt(prmt(z[0], z[1], 0x51u), prmt(z[2], z[3], 0x51u), 0x5410u);
#pragma unroll
                for (int i = 0; i < kRowsPerThread; ++i) {
                  if (valid_cols[i] > 0) {
                    store_fp4x8(args.colwise + y_off / 2 + i * (y_cols / 2) + l * (H / 2),
                                (part[i] & keep) | nanc, vec_out, valid_cols[i]);
                  }
                }
              } else {
                const float4* src = reinterpret_cast<const float4*>(&fp4_bs[0][l][blk][tx * 8]);
                const float4* srr = reinterpret_cast<const float4*>(&fp4_bs[1][l][blk][tx * 8]);
                const float4 u0 = src[0], u1 = src[1], w0 = srr[0], w1 = srr[1];
                const float bs[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
                const float rb[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
                for (int i = 0; i < kRowsPerThread; ++i) {
                  if (valid_cols[i] > 0) {
                    store_fp4x8(args.colwise + y_off / 2 + i * (y_cols / 2) + l * (H / 2),
                                nvfp4_codes(v[i][l], s, bs, rb), vec_out, valid_cols[i]);
                  }
                }
              }
            }
            // red and the factors: the next tile writes red only after every thread passed the
            // barrier above (so the reads of red are done), and the factors after its own first.
          }
        }
      };
      if (kWholeCopy && whole) {
        tile(std::integral_constant<bool, kWholeCopy>{});
      } else {
        tile(std::false_type{});
      }
    }

    // ---- end of the item: amax, dbias partial ----
    if (args.amax != nullptr) {
      block_amax_commit(Values8<T>::to_key(amax_key), args.amax + b);
      __syncthreads();  // its shared scratch is reused by the next item
    }
    if constexpr (kBwd) {
      if (args.dbias_ws != nullptr) {
        auto& part = *reinterpret_cast<float(*)[kOutHalves][kRowLanes][kCols]>(smem_a);
        __syncthreads();  // smem_a may hold the last tile's codes / keys
#pragma unroll
        for (int l = 0; l < kOutHalves; ++l) {
          float4* dst = reinterpret_cast<float4*>(&part[l][ty][tx * 8]);
          dst[0] = make_float4(acc[l][0], acc[l][1], acc[l][2], acc[l][3]);
          dst[1] = make_float4(acc[l][4], acc[l][5], acc[l][6], acc[l][7]);
        }
        __syncthreads();
        float* wrow = args.dbias_ws + (uint64_t{b} * args.groups + g) * y_cols;
        for (int e = tid; e < kOutHalves * kCols; e += kThreads) {
          const int l = e / kCols, c = e % kCols;
          float sum = part[l][0][c];
#pragma unroll
          for (int t = 1; t < kRowLanes; ++t) sum += part[l][t][c];
          if (tile_c0 + c < H) wrow[l * H + tile_c0 + c] = sum;
        }
        __syncthreads();
      }
    }
  }  // groups
  }  // column tiles
  }  // batches
}

}  // namespace te_jax::cuda::quant
