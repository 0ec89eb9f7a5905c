// te_jax_gemm on cuBLASLt. The row-major problem of gemm/problem.h is the column-major
//   D (N x M, ld N) = op(A) · op(B),  A := rhs, B := lhs
// (a row-major (M, N) array is a column-major N x M one): opA = T when rhs is stored (N, K),
// opB = T when lhs is stored (K, M). FP8's TN rule is then cuBLASLt's opA = T, opB = N. The bias
// (length N) is cuBLASLt's per-row bias of D; aux buffers and the addend (C, beta = 1) have D's
// layout.
//
// Descriptors live on the stack (the *Init functions: no allocation); the algorithm comes from a
// cache filled by the initialize stage, which times cuBLASLt's heuristic candidates for large
// problems into outputs of its own unless the call is deterministic (execute queries, untimed,
// only if a problem was never initialized, e.g. buffers of another alignment); the workspace is
// the call's own output buffer.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "gemm/cuda/cublaslt.h"
#include "gemm/cuda/run.h"

namespace te_jax::cuda {
namespace {

namespace ffi = ::xla::ffi;
using gemm::CublasLt;
using gemm::GemmEpilogue;
using gemm::GemmProblem;

cudaDataType_t cuda_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return CUDA_R_32F;
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    case ffi::DataType::F8E4M3FN: return CUDA_R_8F_E4M3;
    default: return CUDA_R_8F_E5M2;  // decode_gemm admits nothing else
  }
}

size_t type_bytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 4;
    case ffi::DataType::BF16:
    case ffi::DataType::F16: return 2;
    default: return 1;
  }
}

int32_t lt_scale_mode(gemm::GemmScaleMode m) {
  switch (m) {
    case gemm::GemmScaleMode::BLOCK_1D: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case gemm::GemmScaleMode::BLOCK_2D: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  }
}

cublasLtEpilogue_t lt_epilogue(const GemmProblem& p) {
  const bool bias = p.bias != nullptr;
  switch (p.epilogue) {
    case GemmEpilogue::GELU_AUX:
      return bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case GemmEpilogue::GELU: return bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
    case GemmEpilogue::RELU: return bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
    case GemmEpilogue::DGELU:
      return p.grad_bias ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
    default: return bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
}

// The largest power of two (<= 256) dividing a pointer: cuBLASLt's heuristics take the operands'
// alignment, and an algorithm chosen for 256-byte aligned buffers may not run on others.
uint32_t alignment(const void* ptr) {
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  uint32_t align = 256;
  while (align > 1 && (a % align)) align /= 2;
  return align;
}

// cuBLASLt's C and beta: the addend with beta = 1, or (C unread) out with beta = 0.
const void* c_of(const GemmProblem& p) { return p.addend ? p.addend : p.out; }
const float* beta_of(const GemmProblem& p) {
  static const float one = 1.0f, zero = 0.0f;
  return p.addend ? &one : &zero;
}

// Everything that changes the algorithm cuBLASLt picks.
struct AlgoKey {
  int device;
  int lhs_type, rhs_type, out_type;
  int64_t batch, m, n, k;
  bool lhs_trans, rhs_trans;
  int epilogue;
  bool bias, fast_accum, addend;
  int lhs_scale_mode, rhs_scale_mode;
  size_t workspace_bytes;
  uint32_t align_lhs, align_rhs, align_out, align_addend;
  bool deterministic;  // never served a timed choice, nor serves its untimed one to others

  auto tie() const {
    return std::tie(device, lhs_type, rhs_type, out_type, batch, m, n, k, lhs_trans, rhs_trans,
                    epilogue, bias, fast_accum, addend, lhs_scale_mode, rhs_scale_mode,
                    workspace_bytes, align_lhs, align_rhs, align_out, align_addend,
                    deterministic);
  }
  bool operator<(const AlgoKey& o) const { return tie() < o.tie(); }
};

struct State {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;  // one per device, never destroyed
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos;
};

State& state() {
  static State* s = new State();  // leaked: handles outlive static destruction order
  return *s;
}

ffi::Error lt_error(const CublasLt& lt, const char* op, const char* what, cublasStatus_t st,
                    const GemmProblem& p) {
  return ffi::Error::Internal(std::string(op) + ": " + what + " failed: " +
                              lt.status_string(st) + " (" + p.describe() + ")");
}

#define TE_JAX_LT(call, what)                                   \
  do {                                                          \
    cublasStatus_t st_ = (call);                                \
    if (st_ != CUBLAS_STATUS_SUCCESS) return lt_error(lt, op, what, st_, p); \
  } while (0)

// The descriptors of one call, built on the stack.
struct Descriptors {
  cublasLtMatmulDescOpaque_t op;
  cublasLtMatrixLayoutOpaque_t a, b, c, d;
};

ffi::Error describe(const CublasLt& lt, const char* op, const GemmProblem& p, Descriptors& ds) {
  TE_JAX_LT(lt.desc_init(&ds.op, sizeof(ds.op), CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescInit");
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const auto& value) {
    return lt.desc_set(&ds.op, attr, &value, sizeof(value));
  };
  const int32_t op_a = p.rhs_trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t op_b = p.lhs_trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_TRANSA, op_a), "set TRANSA");
  TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_TRANSB, op_b), "set TRANSB");
  const uint32_t epilogue = lt_epilogue(p);
  TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue), "set EPILOGUE");
  const int32_t out_type = cuda_type(p.out_type);
  if (p.bias) {
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias), "set BIAS_POINTER");
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, out_type), "set BIAS_DATA_TYPE");
  }
  if (p.dbias) {
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.dbias), "set BIAS_POINTER (dbias)");
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, out_type), "set BIAS_DATA_TYPE");
  }
  if (const void* aux = p.aux_out ? p.aux_out : p.aux_in) {
    const int64_t ld = p.n, stride = p.m * p.n;
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux), "set AUX_POINTER");
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld), "set AUX_LD");
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, out_type), "set AUX_DATA_TYPE");
    if (p.batch > 1)
      TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, stride), "set AUX_STRIDE");
  }
  if (p.fp8()) {
    // A := rhs, B := lhs.
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, p.rhs_scale_inv), "set A_SCALE");
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, p.lhs_scale_inv), "set B_SCALE");
    if (p.block_scaled()) {
      TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, lt_scale_mode(p.rhs_scale_mode)),
                "set A_SCALE_MODE");
      TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, lt_scale_mode(p.lhs_scale_mode)),
                "set B_SCALE_MODE");
    }
    const int8_t fast = p.split_accumulator ? 0 : 1;
    TE_JAX_LT(set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast), "set FAST_ACCUM");
  }

  // Column-major layouts (rows, cols, ld) of A = rhs, B = lhs, C (the addend) and D = out.
  const bool rt = p.rhs_trans, lt_ = p.lhs_trans;
  auto layout = [&](cublasLtMatrixLayoutOpaque_t& l, ffi::DataType t, uint64_t rows,
                    uint64_t cols, int64_t ld, int64_t stride) -> cublasStatus_t {
    cublasStatus_t st = lt.layout_init(&l, sizeof(l), cuda_type(t), rows, cols, ld);
    if (st != CUBLAS_STATUS_SUCCESS || p.batch == 1) return st;
    const int32_t count = static_cast<int32_t>(p.batch);
    st = lt.layout_set(&l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count));
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    return lt.layout_set(&l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                         sizeof(stride));
  };
  TE_JAX_LT(layout(ds.a, p.rhs_type, rt ? p.k : p.n, rt ? p.n : p.k, rt ? p.k : p.n, p.n * p.k),
            "layout A (rhs)");
  TE_JAX_LT(layout(ds.b, p.lhs_type, lt_ ? p.m : p.k, lt_ ? p.k : p.m, lt_ ? p.m : p.k,
                   p.m * p.k),
            "layout B (lhs)");
  TE_JAX_LT(layout(ds.c, p.out_type, p.n, p.m, p.n, p.m * p.n), "layout C");
  TE_JAX_LT(layout(ds.d, p.out_type, p.n, p.m, p.n, p.m * p.n), "layout D");
  return ffi::Error::Success();
}

AlgoKey key_of(int device, const GemmProblem& p) {
  return AlgoKey{device, static_cast<int>(p.lhs_type), static_cast<int>(p.rhs_type),
                 static_cast<int>(p.out_type), p.batch, p.m, p.n, p.k, p.lhs_trans, p.rhs_trans,
                 static_cast<int>(lt_epilogue(p)), p.bias != nullptr,
                 !p.split_accumulator, p.addend != nullptr, static_cast<int>(p.lhs_scale_mode),
                 static_cast<int>(p.rhs_scale_mode), p.workspace_bytes, alignment(p.lhs),
                 alignment(p.rhs), alignment(p.out), alignment(c_of(p)), p.deterministic};
}

// The split-K reductions any algorithm may use: none, or float32 partial sums kept in the
// workspace and summed by a separate step (the product is rounded once, docs/numerics.md §8, and
// no two splits race). Never OUTPUT_TYPE (partial sums rounded to out's dtype) nor INPLACE:
// splits added into out itself, in its dtype, where cuBLASLt's counters only serialize the
// additions, promising no fixed order, so the bits need not repeat from run to run.
constexpr uint32_t kReductionSchemes =
    CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
static_assert((kReductionSchemes & (CUBLASLT_REDUCTION_SCHEME_INPLACE |
                                    CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE)) == 0,
              "deterministic GEMMs rely on every allowed reduction being reproducible");

// Whether an algorithm's split-K reduction is one of kReductionSchemes. The preference mask
// already asks cuBLASLt for that; a deterministic call checks the answer too. An algorithm whose
// configuration cannot be read is taken on the mask's word.
bool allowed_reduction(const CublasLt& lt, const cublasLtMatmulAlgo_t& algo) {
  uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  size_t written = 0;
  if (lt.algo_config_get(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme),
                         &written) != CUBLAS_STATUS_SUCCESS)
    return true;
  return (scheme & ~kReductionSchemes) == 0;
}

// Problems with fewer multiply-adds than this take cuBLASLt's first heuristic choice untimed (as
// deterministic calls do whatever their size).
constexpr double kTimedFlops = double(1 << 30);
// Up to candidates() algorithms, each timed over kTimedRuns back-to-back runs in each of kRounds
// interleaved rounds (its best round counts), after kWarmupRuns untimed runs that bring the clocks
// up from the idle of compilation: interleaving keeps a clock ramp from favouring later candidates.
constexpr int kMaxCandidates = 64, kTimedRuns = 3, kRounds = 3, kWarmupRuns = 10;
// How many heuristic answers a deterministic call reads, to skip any whose reduction is not
// allowed: a fixed number, so every process reads the same list.
constexpr int kDeterministicCandidates = 8;

// How many of cuBLASLt's heuristic candidates a large problem times: 8, or
// TE_JAX_GEMM_CANDIDATES (1 to 64; 1 takes the heuristic's first choice untimed).
int candidates() {
  static const int n = [] {
    const char* v = std::getenv("TE_JAX_GEMM_CANDIDATES");
    const int asked = v ? std::atoi(v) : 8;
    return asked < 1 ? 8 : (asked > kMaxCandidates ? kMaxCandidates : asked);
  }();
  return n;
}

// Output buffers for timing candidates, freed in stream order. The call's own outputs are never
// written before execute: one may be an entry output aliasing a donated input that this
// execution reads before the GEMM runs (the inputs are only read; the workspace is te_jax's own).
struct TimingOutputs {
  cudaStream_t stream;
  void* out = nullptr;
  void* aux = nullptr;
  void* dbias = nullptr;
  bool ok = true;

  TimingOutputs(const GemmProblem& p, cudaStream_t s) : stream(s) {
    const size_t elem = type_bytes(p.out_type);
    ok = alloc(&out, size_t(p.batch) * p.m * p.n * elem) &&
         (!p.aux_out || alloc(&aux, size_t(p.batch) * p.m * p.n * elem)) &&
         (!p.dbias || alloc(&dbias, size_t(p.n) * elem));
    if (!ok) cudaGetLastError();  // out of memory: the heuristic's first choice, untimed
  }
  ~TimingOutputs() {
    for (void* ptr : {out, aux, dbias})
      if (ptr) cudaFreeAsync(ptr, stream);
  }
  bool alloc(void** ptr, size_t bytes) {
    return cudaMallocAsync(ptr, bytes, stream) == cudaSuccess;
  }
};

// The fastest of `n` candidate algorithms for `p` (whose outputs are TimingOutputs; the
// workspace is scribbled on, execute overwrites it), timed on `stream`; -1 if none ran.
int fastest(const CublasLt& lt, cublasLtHandle_t handle, const GemmProblem& p, Descriptors& ds,
            const cublasLtMatmulHeuristicResult_t* results, int n, cudaStream_t stream) {
  cudaEvent_t start, stop;
  if (cudaEventCreate(&start) != cudaSuccess) return -1;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return -1;
  }
  const float one = 1.0f;
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return lt.matmul(handle, &ds.op, &one, p.rhs, &ds.a, p.lhs, &ds.b, beta_of(p), c_of(p),
                     &ds.c, p.out, &ds.d, &algo, p.workspace, p.workspace_bytes, stream) ==
           CUBLAS_STATUS_SUCCESS;
  };
  bool usable[kMaxCandidates] = {};
  float best_ms[kMaxCandidates] = {};
  for (int i = 0; i < n; ++i)  // a candidate that does not launch is dropped
    usable[i] = results[i].state == CUBLAS_STATUS_SUCCESS && run(results[i].algo);
  for (int i = 0; i < n; ++i) {
    if (!usable[i]) continue;
    for (int r = 0; r < kWarmupRuns; ++r) run(results[i].algo);
    break;
  }
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < n; ++i) {
      if (!usable[i]) continue;
      bool ok = cudaEventRecord(start, stream) == cudaSuccess;
      for (int r = 0; ok && r < kTimedRuns; ++r) ok = run(results[i].algo);
      ok = ok && cudaEventRecord(stop, stream) == cudaSuccess &&
           cudaEventSynchronize(stop) == cudaSuccess;
      float ms = 0;
      ok = ok && cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
      if (!ok) usable[i] = false;
      else if (round == 0 || ms < best_ms[i]) best_ms[i] = ms;
    }
  }
  int best = -1;
  for (int i = 0; i < n; ++i)
    if (usable[i] && (best < 0 || best_ms[i] < best_ms[best])) best = i;
  cudaGetLastError();  // a candidate that failed to launch leaves nothing behind
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

// This problem's algorithm: cuBLASLt's heuristic candidates, timed where `may_time` (the
// initialize stage, outside graph capture), the problem is large and the call not deterministic,
// else the first (for a deterministic call, the first whose reduction is allowed).
ffi::Error pick_algo(const CublasLt& lt, const char* op, cublasLtHandle_t handle,
                     const GemmProblem& p, const AlgoKey& key, Descriptors& ds,
                     cudaStream_t stream, bool may_time, cublasLtMatmulAlgo_t* algo) {
  cublasLtMatmulPreferenceOpaque_t pref;
  TE_JAX_LT(lt.pref_init(&pref, sizeof(pref)), "MatmulPreferenceInit");
  auto set = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    return lt.pref_set(&pref, attr, &value, sizeof(value));
  };
  const uint64_t ws = p.workspace_bytes;
  TE_JAX_LT(set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws), "set MAX_WORKSPACE_BYTES");
  TE_JAX_LT(set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_rhs), "set ALIGNMENT_A");
  TE_JAX_LT(set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_lhs), "set ALIGNMENT_B");
  TE_JAX_LT(set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_addend),
            "set ALIGNMENT_C");
  TE_JAX_LT(set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_out), "set ALIGNMENT_D");
  TE_JAX_LT(set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, kReductionSchemes),
            "set REDUCTION_SCHEME");
  cublasLtMatmulHeuristicResult_t results[kMaxCandidates];
  int found = 0;
  const bool timed =
      may_time && !p.deterministic && double(p.batch) * p.m * p.n * p.k >= kTimedFlops;
  const int asked = p.deterministic ? kDeterministicCandidates : (timed ? candidates() : 1);
  TE_JAX_LT(lt.heuristic(handle, &ds.op, &ds.a, &ds.b, &ds.c, &ds.d, &pref, asked, results,
                         &found),
            "MatmulAlgoGetHeuristic");
  if (p.deterministic) {
    for (int i = 0; i < found; ++i) {
      if (results[i].state == CUBLAS_STATUS_SUCCESS && allowed_reduction(lt, results[i].algo)) {
        *algo = results[i].algo;
        return ffi::Error::Success();
      }
    }
    return ffi::Error::Internal(std::string(op) + ": cuBLASLt has no algorithm with a "
                                "reproducible reduction for " + p.describe());
  }
  if (found == 0 || results[0].state != CUBLAS_STATUS_SUCCESS)
    return ffi::Error::Internal(std::string(op) + ": cuBLASLt has no algorithm for " +
                                p.describe());
  int best = 0;
  if (timed && found > 1) {
    TimingOutputs scratch(p, stream);
    GemmProblem q = p;
    q.out = scratch.out;
    q.aux_out = scratch.aux;
    q.dbias = scratch.dbias;
    Descriptors dq;
    best = scratch.ok && !describe(lt, op, q, dq).failure()
               ? fastest(lt, handle, q, dq, results, found, stream)
               : -1;
  }
  *algo = results[best < 0 ? 0 : best].algo;
  return ffi::Error::Success();
}

#undef TE_JAX_LT

// The device's handle and this problem's algorithm: created / picked on first use.
ffi::Error prepare(const CublasLt& lt, const char* op, const GemmProblem& p, Descriptors& ds,
                   cudaStream_t stream, bool may_time, cublasLtHandle_t* handle,
                   cublasLtMatmulAlgo_t* algo) {
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess)
    return ffi::Error::Internal(std::string(op) + ": cudaGetDevice: " + cudaGetErrorString(e));
  const AlgoKey key = key_of(device, p);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto h = s.handles.find(device);
  if (h == s.handles.end()) {
    cublasLtHandle_t created;
    if (cublasStatus_t st = lt.create(&created); st != CUBLAS_STATUS_SUCCESS)
      return ffi::Error::Internal(std::string(op) + ": cublasLtCreate: " + lt.status_string(st));
    h = s.handles.emplace(device, created).first;
  }
  *handle = h->second;
  auto a = s.algos.find(key);
  if (a == s.algos.end()) {
    cublasLtMatmulAlgo_t chosen;
    if (auto e = pick_algo(lt, op, *handle, p, key, ds, stream, may_time, &chosen); e.failure())
      return e;
    a = s.algos.emplace(key, chosen).first;
  }
  *algo = a->second;
  return ffi::Error::Success();
}

// Zero-size problems never reach cuBLASLt: only the reductions' results need writing.
ffi::Error run_empty(const char* op, const GemmProblem& p, cudaStream_t stream) {
  cudaError_t e = cudaSuccess;
  if (p.dbias && p.n > 0)
    e = cudaMemsetAsync(p.dbias, 0, p.n * type_bytes(p.out_type), stream);  // sum of nothing
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

template <ffi::ExecutionStage S>
ffi::Error GemmBackend::run(const char* op, const GemmProblem& p, cudaStream_t stream) {
  if (p.k == 0 && p.batch * p.m * p.n > 0)
    return ffi::Error::InvalidArgument(std::string(op) + ": K = 0 is computed without the GEMM "
                                       "(te_jax.primitives.gemm); got " + p.describe());
  if (p.batch * p.m * p.n == 0) return kLoadOnly<S> ? ffi::Error::Success() : run_empty(op, p, stream);
  std::string why;
  const gemm::CublasLt* lt = gemm::cublaslt(&why);
  if (!lt) return ffi::Error::Internal(std::string(op) + ": " + why);
  Descriptors ds;
  if (auto e = describe(*lt, op, p, ds); e.failure()) return e;
  cublasLtHandle_t handle;
  cublasLtMatmulAlgo_t algo;
  if (auto e = prepare(*lt, op, p, ds, stream, kLoadOnly<S>, &handle, &algo); e.failure()) return e;
  if constexpr (kLoadOnly<S>) return ffi::Error::Success();
  const float one = 1.0f;
  cublasStatus_t st = lt->matmul(handle, &ds.op, &one, p.rhs, &ds.a, p.lhs, &ds.b, beta_of(p),
                                 c_of(p), &ds.c, p.out, &ds.d, &algo, p.workspace,
                                 p.workspace_bytes, stream);
  if (st != CUBLAS_STATUS_SUCCESS)
    return ffi::Error::Internal(std::string(op) + ": cublasLtMatmul failed: " +
                                lt->status_string(st) + " (" + p.describe() + ")");
  return ffi::Error::Success();
}

template ffi::Error GemmBackend::run<ffi::ExecutionStage::kInitialize>(const char*,
                                                                       const GemmProblem&,
                                                                       cudaStream_t);
template ffi::Error GemmBackend::run<ffi::ExecutionStage::kExecute>(const char*,
                                                                    const GemmProblem&,
                                                                    cudaStream_t);

}  // namespace te_jax::cuda
