// cuBLASLt, loaded at run time: te_jax's CUDA extension does not link libcublasLt. It uses the
// copy jax's CUDA plugin already loaded (dlopen RTLD_NOLOAD of its soname), else the file Python
// found in the `nvidia` wheels (set_cublaslt_path), else whatever the dynamic linker finds. The
// functions come from the header the extension was compiled against (decltype of each).
#pragma once

#include <cublasLt.h>

#include <string>

namespace te_jax::gemm {

struct CublasLt {
  decltype(&cublasLtCreate) create;
  decltype(&cublasLtGetVersion) get_version;
  decltype(&cublasLtGetStatusString) status_string;
  decltype(&cublasLtMatmul) matmul;
  decltype(&cublasLtMatmulDescInit_internal) desc_init;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set;
  decltype(&cublasLtMatrixLayoutInit_internal) layout_init;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set;
  decltype(&cublasLtMatmulPreferenceInit_internal) pref_init;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) algo_config_get;
};

// The loaded library (loaded on first call, thread-safe), or nullptr with `error` saying what
// was tried.
const CublasLt* cublaslt(std::string* error);

// Where Python found libcublasLt.so.<major> (tried after the already-loaded copy).
void set_cublaslt_path(const std::string& path);

}  // namespace te_jax::gemm
