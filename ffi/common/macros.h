// Host/device qualifiers of the headers whose code runs on both (common/, activations.h).
#pragma once

#if defined(__CUDACC__)
#define TE_HD __host__ __device__ __forceinline__
#else
#define TE_HD inline __attribute__((always_inline))
#endif
