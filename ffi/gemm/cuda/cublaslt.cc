#include "gemm/cuda/cublaslt.h"

#include <dlfcn.h>

#include <mutex>

namespace te_jax::gemm {
namespace {

std::mutex g_mutex;
std::string g_path;  // set_cublaslt_path

const char* soname() {
  static const std::string name = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  return name.c_str();
}

void* open_library(std::string* tried) {
  if (void* h = dlopen(soname(), RTLD_NOW | RTLD_NOLOAD)) return h;
  *tried = std::string(soname()) + " is not loaded yet";
  std::string path;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    path = g_path;
  }
  if (!path.empty()) {
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) return h;
    *tried += std::string("; dlopen(") + path + "): " + dlerror();
  }
  if (void* h = dlopen(soname(), RTLD_NOW | RTLD_GLOBAL)) return h;
  *tried += std::string("; dlopen(") + soname() + "): " + dlerror();
  return nullptr;
}

template <class F>
bool resolve(void* lib, const char* name, F& fn, std::string* missing) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (!fn) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return fn != nullptr;
}

struct Loaded {
  CublasLt lt{};
  std::string error;  // empty when loaded
};

Loaded load() {
  Loaded r;
  std::string tried;
  void* lib = open_library(&tried);
  if (!lib) {
    r.error = "cannot load cuBLASLt (" + tried + "); install the nvidia-cublas wheel jax's CUDA "
              "plugin uses (pip install \"nvidia-cublas>=" + std::to_string(CUBLAS_VER_MAJOR) +
              ",<" + std::to_string(CUBLAS_VER_MAJOR + 1) + "\")";
    return r;
  }
  std::string missing;
  CublasLt& lt = r.lt;
  resolve(lib, "cublasLtCreate", lt.create, &missing);
  resolve(lib, "cublasLtGetVersion", lt.get_version, &missing);
  resolve(lib, "cublasLtGetStatusString", lt.status_string, &missing);
  resolve(lib, "cublasLtMatmul", lt.matmul, &missing);
  resolve(lib, "cublasLtMatmulDescInit_internal", lt.desc_init, &missing);
  resolve(lib, "cublasLtMatmulDescSetAttribute", lt.desc_set, &missing);
  resolve(lib, "cublasLtMatrixLayoutInit_internal", lt.layout_init, &missing);
  resolve(lib, "cublasLtMatrixLayoutSetAttribute", lt.layout_set, &missing);
  resolve(lib, "cublasLtMatmulPreferenceInit_internal", lt.pref_init, &missing);
  resolve(lib, "cublasLtMatmulPreferenceSetAttribute", lt.pref_set, &missing);
  resolve(lib, "cublasLtMatmulAlgoGetHeuristic", lt.heuristic, &missing);
  resolve(lib, "cublasLtMatmulAlgoConfigGetAttribute", lt.algo_config_get, &missing);
  if (!missing.empty()) {
    r.error = "the loaded cuBLASLt lacks " + missing;
    return r;
  }
  // The opaque descriptors' sizes and the attributes' values are those of the header: the
  // library must be of the same major version.
  const size_t version = lt.get_version();
  if (version / 10000 != CUBLAS_VER_MAJOR) {
    r.error = "the loaded cuBLASLt is version " + std::to_string(version) +
              " but te_jax was built against " + std::to_string(CUBLAS_VERSION) +
              " (the major versions must match)";
  }
  return r;
}

}  // namespace

const CublasLt* cublaslt(std::string* error) {
  static const Loaded loaded = load();
  if (!loaded.error.empty()) {
    *error = loaded.error;
    return nullptr;
  }
  return &loaded.lt;
}

void set_cublaslt_path(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_path = path;
}

}  // namespace te_jax::gemm
