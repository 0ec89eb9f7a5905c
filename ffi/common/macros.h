// Host/device qualifiers shared by every header in ffi/common.
#pragma once

#if defined(__CUDACC__)
#define TE_HD __host__ __device__ __forceinline__
#else
#define TE_HD inline __attribute__((always_inline))
#endif
