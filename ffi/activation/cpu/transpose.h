// Byte-matrix transpose for the colwise tensor-scaled layout (each batch's codes transposed).
//
// 16 x 16 blocks go through 16-byte vectors (GCC / Clang vector extensions: SSE2 on x86-64, NEON
// on AArch64): four rounds of "vector 2i + h = the bytes of half h of rows i and i + 8,
// interleaved" (punpcklbw / punpckhbw, zip1 / zip2). Why four rounds transpose: a byte's position
// is 8 bits, vector index v3 v2 v1 v0 then byte index b3 b2 b1 b0; a round sends byte j of half h
// of row i + 8s to byte 2j + s of vector 2i + h, i.e. rotates those 8 bits left by one, and four
// rotations swap the two halves: (row, column) -> (column, row). Elsewhere (and for the edges of a
// matrix that is not a whole number of blocks) bytes are copied one by one.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define TE_JAX_BYTE_VECTORS 1
#endif
#endif

namespace te_jax::cpu {
namespace {
namespace transpose {

// dst[j * ld_dst + i] = src[i * ld_src + j] for i < rows, j < cols, one by one.
inline void bytes_scalar(const uint8_t* src, int64_t ld_src, uint8_t* dst, int64_t ld_dst,
                         int64_t rows, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t i = 0; i < rows; ++i) dst[j * ld_dst + i] = src[i * ld_src + j];
  }
}

#if defined(TE_JAX_BYTE_VECTORS)

typedef uint8_t U8x16 __attribute__((vector_size(16)));

// One 16 x 16 block: rows src + i * ld_src, columns written to dst + j * ld_dst.
inline void block16(const uint8_t* src, int64_t ld_src, uint8_t* dst, int64_t ld_dst) {
  U8x16 r[16], t[16];
  for (int i = 0; i < 16; ++i) std::memcpy(&r[i], src + i * ld_src, 16);
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = __builtin_shufflevector(r[i], r[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                         21, 6, 22, 7, 23);
      t[2 * i + 1] = __builtin_shufflevector(r[i], r[i + 8], 8, 24, 9, 25, 10, 26, 11, 27, 12,
                                             28, 13, 29, 14, 30, 15, 31);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }
  for (int j = 0; j < 16; ++j) std::memcpy(dst + j * ld_dst, &r[j], 16);
}

// dst[j * ld_dst + i] = src[i * ld_src + j] for i < rows, j < cols.
inline void bytes(const uint8_t* src, int64_t ld_src, uint8_t* dst, int64_t ld_dst, int64_t rows,
                  int64_t cols) {
  const int64_t rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
  for (int64_t i = 0; i < rows16; i += 16) {
    for (int64_t j = 0; j < cols16; j += 16) {
      block16(src + i * ld_src + j, ld_src, dst + j * ld_dst + i, ld_dst);
    }
  }
  // The edges: the columns past the last whole block (all rows), then the rows past it.
  bytes_scalar(src + cols16, ld_src, dst + cols16 * ld_dst, ld_dst, rows, cols - cols16);
  bytes_scalar(src + rows16 * ld_src, ld_src, dst + rows16, ld_dst, rows - rows16, cols16);
}

#else

inline void bytes(const uint8_t* src, int64_t ld_src, uint8_t* dst, int64_t ld_dst, int64_t rows,
                  int64_t cols) {
  bytes_scalar(src, ld_src, dst, ld_dst, rows, cols);
}

#endif

}  // namespace transpose
}  // namespace
}  // namespace te_jax::cpu
