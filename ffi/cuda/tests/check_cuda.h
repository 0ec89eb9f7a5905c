// CHECK_CUDA for the standalone CUDA test programs: print the error and where, exit 2.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(x)                                                                     \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::printf("CUDA error %s (%s) at %s:%d\n", cudaGetErrorName(e_),                  \
                  cudaGetErrorString(e_), __FILE__, __LINE__);                            \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)
