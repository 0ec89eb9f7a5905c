// Standalone test of the te_jax CUDA kernels, without XLA or Python: drives launch_act_lu and
// launch_dact_dbias (ffi/activation/cuda/launch.h) directly, for every activation and dtype, and
// checks
//   - every output element is written (outputs are poisoned with NaN bytes first),
//   - values against a host reference (the same activations.h formulas in float on the host;
//     dbias summed in double), to docs/numerics.md §7's tolerances,
//   - amax: bit-equal to max|output| over the device's own outputs; NaN in -> NaN out,
//   - dbias: bit-identical across repeated runs and grid sizes (max_blocks), and equal to the scalar
//     path's result (misaligned copy of the same data); rows == 0 gives zeros,
//   - that the launches can be captured into a CUDA graph (after a load_only pass, as the
//     Initialize stage does) and the replay gives the same bits,
//   - the device sigmoid (hardware exp and reciprocal approximations, common/math.h) against
//     float64 over the whole float32 range where it is neither 0 nor 1, and the device erf
//     (branch-free fit, common/math.h) up to |x| = 8, each within its error bound.
// It is meant to be run on the GPU, also under compute-sanitizer (use --quick there).
// Build and run: ffi/cuda/tests/run.sh (see there).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "activation/activations.h"
#include "activation/cuda/launch.h"
#include "activation/problem.h"
#include "common/math.h"
#include "cuda/tests/harness.cuh"

using namespace te_jax;
using namespace te_jax_test;

namespace {

int g_notes = 0;
std::mt19937 g_rng(12345);

template <typename T>
std::vector<T> random_vec(size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<T> v(n);
  for (auto& e : v) e = DT<T>::from(d(g_rng));
  return v;
}

bool close(double got, double want, double tol) {
  if (std::isnan(got) || std::isnan(want)) return false;
  return std::fabs(got - want) <= tol + tol * std::fabs(want);
}

ActParams default_params() { return ActParams{}; }

// amax bits over outputs: max of (bits & 0x7fffffff), as the kernels define it.
template <typename T>
uint32_t amax_bits_of(const std::vector<T>& v) {
  uint32_t m = 0;
  for (const T& e : v) m = std::max(m, bits(DT<T>::to(e)) & 0x7fffffffu);
  return m;
}

float read_amax(float* d) {
  float h;
  CHECK_CUDA(cudaMemcpy(&h, d, sizeof(float), cudaMemcpyDeviceToHost));
  return h;
}

// ---- act_lu ------------------------------------------------------------------------------------

template <typename Spec, typename T>
void test_act_lu(ActivationEnum act, int64_t rows, int64_t H, int misalign, bool inject_nan) {
  constexpr int L = Spec::kActLen;
  const std::string tag = std::string("act_lu ") + activation_name(act) + " " + DT<T>::kName + " rows=" +
                          std::to_string(rows) + " H=" + std::to_string(H) +
                          (misalign ? " misaligned" : "") + (inject_nan ? " nan" : "");
  const size_t nx = rows * L * H, ny = rows * H;
  std::vector<T> hx = random_vec<T>(nx, -8.0f, 8.0f);
  if (inject_nan && nx > 0) hx[nx / 2] = DT<T>::from(NAN);
  DevBuf<T> x(nx, misalign * sizeof(T)), y(ny, misalign * sizeof(T));
  DevBuf<float> amax(1, 0);
  x.upload(hx);

  ActLuProblem p{};
  p.dtype = DT<T>::kType;
  p.act = act;
  p.params = default_params();
  p.rows = rows;
  p.hidden = H;
  p.x = x.ptr;
  p.y = y.ptr;
  p.amax = amax.ptr;

  Case c;
  std::vector<T> first;
  uint32_t first_amax = 0;
  const int sms_list[] = {132, 1, 7};
  for (int sms : sms_list) {
    y.poison();
    amax.poison();
    cuda::LaunchConfig cfg;
    cfg.max_blocks = static_cast<unsigned>(sms) * 4;
    CHECK_CUDA(cuda::launch_act_lu(p, 0, cfg));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> hy = y.download();
    const float a = read_amax(amax.ptr);
    if (sms == 132) {
      first = hy;
      first_amax = bits(a);
      // values
      int bad = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < H; ++j) {
          const float xa = DT<T>::to(hx[(r * L) * H + j]);
          const float xb = L == 2 ? DT<T>::to(hx[(r * L + 1) * H + j]) : 0.0f;
          const float want = DT<T>::to(DT<T>::from(act_forward<Spec>(xa, xb, p.params)));
          const float got = DT<T>::to(hy[r * H + j]);
          const bool nan_ok = inject_nan && std::isnan(want) && std::isnan(got);
          if (!nan_ok && !close(got, want, DT<T>::kTol)) {
            if (bad++ < 3) {
              fail(tag + ": y[" + std::to_string(r) + "," + std::to_string(j) + "] = " +
                   std::to_string(got) + ", want " + std::to_string(want));
            }
          }
        }
      }
      // amax equals max|y| over the device's outputs, bit for bit (so NaN when any y is NaN).
      const uint32_t want_bits = amax_bits_of(hy);
      if (inject_nan && !(std::isnan(a) == (want_bits > 0x7f800000u))) {
        fail(tag + ": amax NaN-ness differs from the outputs'");
      } else if (bits(a) != want_bits) {
        fail(tag + ": amax bits " + std::to_string(bits(a)) + " != max|y| bits " +
             std::to_string(want_bits));
      }
    } else {
      if (hy.size() && std::memcmp(hy.data(), first.data(), hy.size() * sizeof(T)) != 0) {
        fail(tag + ": output differs with max_blocks=4*" + std::to_string(sms));
      }
      if (bits(a) != first_amax) {
        fail(tag + ": amax differs with max_blocks=4*" + std::to_string(sms));
      }
    }
  }
}

// ---- dact (with or without dbias) ------------------------------------------------------------

template <typename Spec, typename T>
void test_dact(ActivationEnum act, int64_t rows, int64_t H, int64_t batches, int64_t groups,
               int misalign, bool with_dbias) {
  constexpr int L = Spec::kActLen;
  const std::string tag = std::string(with_dbias ? "dact_dbias " : "dact ") + activation_name(act) + " " +
                          DT<T>::kName + " rows=" + std::to_string(rows) + " H=" +
                          std::to_string(H) +
                          (with_dbias ? " batches=" + std::to_string(batches) +
                                            " groups=" + std::to_string(groups)
                                      : std::string()) +
                          (misalign ? " misaligned" : "");
  const size_t nx = rows * L * H, nz = rows * H, n = L * H;
  std::vector<T> hx = random_vec<T>(nx, -8.0f, 8.0f);
  std::vector<T> hz = random_vec<T>(nz, -2.0f, 2.0f);
  DevBuf<T> x(nx, misalign * sizeof(T)), dz(nz, misalign * sizeof(T)),
      dx(nx, misalign * sizeof(T));
  DevBuf<T> dbias(with_dbias ? batches * n : 0, 0);
  DevBuf<float> ws(with_dbias ? batches * groups * n : 0, 0);
  DevBuf<float> amax(1, 0);
  x.upload(hx);
  dz.upload(hz);

  DActProblem p{};
  p.dtype = DT<T>::kType;
  p.act = act;
  p.params = default_params();
  p.act_len = L;
  p.rows = rows;
  p.hidden = H;
  p.dz = dz.ptr;
  p.x = x.ptr;
  p.dx = dx.ptr;
  p.amax = amax.ptr;
  if (with_dbias) {
    p.dbias = dbias.ptr;
    p.workspace = ws.ptr;
    p.batches = batches;
    p.groups = groups;
  }

  // Host reference: dx in float (rounded to T), dbias summed in double from unrounded dx.
  std::vector<float> ref_dx(nx);
  std::vector<double> ref_db(with_dbias ? batches * n : 0, 0.0), abs_db(ref_db.size(), 0.0);
  const int64_t R = with_dbias ? rows / batches : 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < H; ++j) {
      const float g = DT<T>::to(hz[r * H + j]);
      const float xa = DT<T>::to(hx[(r * L) * H + j]);
      const float xb = L == 2 ? DT<T>::to(hx[(r * L + 1) * H + j]) : 0.0f;
      float da, db;
      act_backward<Spec>(g, xa, xb, p.params, da, db);
      ref_dx[(r * L) * H + j] = da;
      if (L == 2) ref_dx[(r * L + 1) * H + j] = db;
      if (with_dbias) {
        const int64_t b = r / R;
        ref_db[b * n + j] += da;
        abs_db[b * n + j] += std::fabs(da);
        if (L == 2) {
          ref_db[b * n + H + j] += db;
          abs_db[b * n + H + j] += std::fabs(db);
        }
      }
    }
  }

  Case c;
  std::vector<T> first_dx, first_db;
  uint32_t first_amax = 0;
  const int sms_list[] = {132, 1, 7};
  for (int sms : sms_list) {
    dx.poison();
    dbias.poison();
    ws.poison();
    amax.poison();
    cuda::LaunchConfig cfg;
    cfg.max_blocks = static_cast<unsigned>(sms) * 4;
    CHECK_CUDA(cuda::launch_dact_dbias(p, 0, cfg));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> hdx = dx.download(), hdb = dbias.download();
    const float a = read_amax(amax.ptr);
    if (sms == 132) {
      first_dx = hdx;
      first_db = hdb;
      first_amax = bits(a);
      int bad = 0;
      for (size_t i = 0; i < nx; ++i) {
        const float want = DT<T>::to(DT<T>::from(ref_dx[i]));
        const float got = DT<T>::to(hdx[i]);
        if (!close(got, want, DT<T>::kTol) && bad++ < 3) {
          fail(tag + ": dx[" + std::to_string(i) + "] = " + std::to_string(got) + ", want " +
               std::to_string(want));
        }
      }
      if (bits(a) != amax_bits_of(hdx)) fail(tag + ": amax != max|dx| (bits)");
      for (size_t i = 0; i < ref_db.size(); ++i) {
        const double want = ref_db[i];
        const double got = DT<T>::to(hdb[i]);
        // float32 summation error over the rows plus one rounding to T.
        const double tol = 1e-5 * abs_db[i] + DT<T>::kTol * std::fabs(want) + 1e-6;
        if (!(std::fabs(got - want) <= tol) && bad++ < 6) {
          fail(tag + ": dbias[" + std::to_string(i) + "] = " + std::to_string(got) + ", want " +
               std::to_string(want));
        }
      }
    } else {
      if (nx && std::memcmp(hdx.data(), first_dx.data(), nx * sizeof(T)) != 0) {
        fail(tag + ": dx differs with max_blocks=4*" + std::to_string(sms));
      }
      if (hdb.size() && std::memcmp(hdb.data(), first_db.data(), hdb.size() * sizeof(T)) != 0) {
        fail(tag + ": dbias not deterministic (max_blocks=4*" + std::to_string(sms) + ")");
      }
      if (bits(a) != first_amax) {
        fail(tag + ": amax differs with max_blocks=4*" + std::to_string(sms));
      }
    }
  }

  // The scalar path (a misaligned copy of the same data) must give the same dbias bits.
  if (with_dbias && !misalign && rows > 0) {
    DevBuf<T> x2(nx, sizeof(T)), dz2(nz, sizeof(T)), dx2(nx, sizeof(T));
    x2.upload(hx);
    dz2.upload(hz);
    dbias.poison();
    DActProblem q = p;
    q.x = x2.ptr;
    q.dz = dz2.ptr;
    q.dx = dx2.ptr;
    CHECK_CUDA(cuda::launch_dact_dbias(q, 0, cuda::LaunchConfig{}));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> hdb = dbias.download(), hdx = dx2.download();
    if (std::memcmp(hdb.data(), first_db.data(), hdb.size() * sizeof(T)) != 0) {
      ++g_notes;
      std::printf("NOTE: %s: scalar-path dbias bits differ from the vector path's\n", tag.c_str());
    }
    if (nx && std::memcmp(hdx.data(), first_dx.data(), nx * sizeof(T)) != 0) {
      ++g_notes;
      std::printf("NOTE: %s: scalar-path dx bits differ from the vector path's\n", tag.c_str());
    }
  }

  // In place, dx written over x (te_jax aliases them for a gated dact whose blockwise FP8 blocks
  // span its halves): every kernel reads an element of x before the same thread writes dx there,
  // so the bits are the separate buffers'.
  if (L == 2 && nx) {
    DevBuf<T> xdx(nx, misalign * sizeof(T));
    xdx.upload(hx);
    dbias.poison();
    DActProblem q = p;
    q.x = xdx.ptr;
    q.dx = xdx.ptr;
    CHECK_CUDA(cuda::launch_dact_dbias(q, 0, cuda::LaunchConfig{}));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> hdx = xdx.download(), hdb = dbias.download();
    if (std::memcmp(hdx.data(), first_dx.data(), nx * sizeof(T)) != 0) {
      fail(tag + ": dx written over x differs");
    }
    if (hdb.size() && std::memcmp(hdb.data(), first_db.data(), hdb.size() * sizeof(T)) != 0) {
      fail(tag + ": dbias differs with dx written over x");
    }
  }
}

// ---- CUDA graph capture ------------------------------------------------------------------------

template <typename Spec, typename T>
void test_graph(ActivationEnum act) {
  constexpr int L = Spec::kActLen;
  const int64_t rows = 96, H = 256, batches = 2, groups = 3, n = L * H;
  const std::string tag = std::string("graph ") + activation_name(act) + " " + DT<T>::kName;
  std::vector<T> hx = random_vec<T>(rows * L * H, -8.0f, 8.0f);
  std::vector<T> hz = random_vec<T>(rows * H, -2.0f, 2.0f);
  DevBuf<T> x(hx.size(), 0), dz(hz.size(), 0), y(rows * H, 0), dx(hx.size(), 0),
      dbias(batches * n, 0);
  DevBuf<float> ws(batches * groups * n, 0), amax1(1, 0), amax2(1, 0);
  x.upload(hx);
  dz.upload(hz);
  ActLuProblem pa{DT<T>::kType, act, default_params(), rows, H, x.ptr, y.ptr, amax1.ptr};
  DActProblem pd{};
  pd.dtype = DT<T>::kType;
  pd.act = act;
  pd.params = default_params();
  pd.act_len = L;
  pd.rows = rows;
  pd.hidden = H;
  pd.dz = dz.ptr;
  pd.x = x.ptr;
  pd.dx = dx.ptr;
  pd.dbias = dbias.ptr;
  pd.workspace = ws.ptr;
  pd.batches = batches;
  pd.groups = groups;
  pd.amax = amax2.ptr;

  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Eager run (reference bits).
  CHECK_CUDA(cuda::launch_act_lu(pa, s, {}));
  CHECK_CUDA(cuda::launch_dact_dbias(pd, s, {}));
  CHECK_CUDA(cudaStreamSynchronize(s));
  const std::vector<T> y0 = y.download(), dx0 = dx.download(), db0 = dbias.download();
  const float a10 = read_amax(amax1.ptr), a20 = read_amax(amax2.ptr);
  y.poison();
  dx.poison();
  dbias.poison();
  amax1.poison();
  amax2.poison();

  const auto enqueue = [&](const cuda::LaunchConfig& cfg) {
    const cudaError_t e = cuda::launch_act_lu(pa, s, cfg);
    return e != cudaSuccess ? e : cuda::launch_dact_dbias(pd, s, cfg);
  };
  Case c;
  if (!replay_in_graph(s, enqueue, tag)) return;
  const std::vector<T> y1 = y.download(), dx1 = dx.download(), db1 = dbias.download();
  if (std::memcmp(y0.data(), y1.data(), y0.size() * sizeof(T)) ||
      std::memcmp(dx0.data(), dx1.data(), dx0.size() * sizeof(T)) ||
      std::memcmp(db0.data(), db1.data(), db0.size() * sizeof(T)) ||
      bits(read_amax(amax1.ptr)) != bits(a10) ||
      bits(read_amax(amax2.ptr)) != bits(a20)) {
    fail(tag + ": graph replay differs from the eager run");
  }
  CHECK_CUDA(cudaStreamDestroy(s));
}

// ---- driver ------------------------------------------------------------------------------------

struct Shape {
  int64_t rows, hidden;
  int misalign;
};
struct DbiasShape {
  int64_t rows, hidden, batches, groups;
  int misalign;
};

template <typename Spec, typename T>
void run_all(ActivationEnum act) {
  // Load-only (the Initialize stage) must succeed for both targets.
  {
    ActLuProblem pa{DT<T>::kType, act, default_params(), 1, 8, nullptr, nullptr, nullptr};
    DActProblem pd{};
    pd.dtype = DT<T>::kType;
    pd.act = act;
    pd.act_len = Spec::kActLen;
    cuda::LaunchConfig load;
    load.load_only = true;
    Case c;
    if (cuda::launch_act_lu(pa, 0, load) != cudaSuccess ||
        cuda::launch_dact_dbias(pd, 0, load) != cudaSuccess) {
      fail(std::string("load_only ") + activation_name(act) + " " + DT<T>::kName);
    }
    float dummy;
    pd.dbias = &dummy;  // only its non-nullness matters with load_only
    if (cuda::launch_dact_dbias(pd, 0, load) != cudaSuccess) {
      fail(std::string("load_only dbias ") + activation_name(act) + " " + DT<T>::kName);
    }
  }
  std::vector<Shape> shapes = {{21, 33, 0}, {1, 1, 0},  {5, 8, 0},   {3, 64, 0},   {9, 64, 1},
                               {17, 1000, 0}, {0, 16, 0}, {4, 0, 0}, {7, 3, 0}, {2, 24, 1}};
  if (!g_quick) {
    shapes.push_back({512, 4096, 0});
    shapes.push_back({1031, 520, 0});
  }
  for (const Shape& s : shapes) {
    test_act_lu<Spec, T>(act, s.rows, s.hidden, s.misalign, false);
    test_dact<Spec, T>(act, s.rows, s.hidden, 1, 1, s.misalign, false);
  }
  test_act_lu<Spec, T>(act, 6, 40, 0, true);  // NaN in -> NaN amax
  std::vector<DbiasShape> dshapes = {{21, 33, 1, 1, 0}, {21, 33, 3, 2, 0}, {64, 64, 1, 5, 0},
                                     {4, 16, 1, 9, 0},  {0, 16, 1, 3, 0},  {12, 1, 4, 2, 0},
                                     {30, 48, 2, 4, 1}, {1, 8, 1, 1, 0}};
  if (!g_quick) {
    dshapes.push_back({1000, 136, 2, 7, 0});
    dshapes.push_back({1024, 4096, 1, 33, 0});
    dshapes.push_back({96, 24, 3, 70000, 0});  // batches*groups > 65535: grid-stride over y
  }
  for (const DbiasShape& s : dshapes) {
    test_dact<Spec, T>(act, s.rows, s.hidden, s.batches, s.groups, s.misalign, true);
  }
  test_graph<Spec, T>(act);
}

// ---- device math accuracy (common/math.h) ------------------------------------------------------

struct DeviceSigmoid {
  __device__ float operator()(float x) const { return math::sigmoid(x); }
};
struct DeviceErf {
  __device__ float operator()(float x) const { return math::erf(x); }
};

// F{}(x) for the float32 x with bits (i * step) | sign, i < n.
template <typename F>
__global__ void math_kernel(uint32_t step, uint32_t sign, uint64_t n, float* out) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n;
       i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = F{}(__uint_as_float(static_cast<uint32_t>(i * step) | sign));
  }
}

// F on the device over every step-th float32 of either sign up to |x| = limit; visit(x, F(x))
// on the host for each.
template <typename F, typename Visit>
void sweep(float limit, uint32_t step, const Visit& visit) {
  const uint64_t n = bits(limit) / step + 1;
  float* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, n * sizeof(float)));
  std::vector<float> got(n);
  for (uint32_t sign : {0u, 0x80000000u}) {
    math_kernel<F><<<1024, 256>>>(step, sign, n, d);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemcpy(got.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(i * step) | sign;
      float x;
      std::memcpy(&x, &u, 4);
      visit(x, got[i]);
    }
  }
  CHECK_CUDA(cudaFree(d));
}

// Every 64th float32 of either sign up to |x| = 104 (sigmoid is 0 or 1 within its bound beyond;
// 8 M values per sign with --quick's every 1024th): relative error at most 2^-24 * (4|x| + 32)
// (math.h: a few ulps, plus ~2|x| from rounding x * log2(e)), or 2^-126 absolute where the
// result is below the normal range. Prints the largest error in ulps (units of 2^-24 * s).
void test_sigmoid_accuracy() {
  Case c;
  double worst = 0.0, worst_x = 0.0, worst_small = 0.0;  // worst_small: |x| <= 16
  int bad = 0;
  sweep<DeviceSigmoid>(104.0f, g_quick ? 1024 : 64, [&](float xf, float got) {
    const double x = xf, want = 1.0 / (1.0 + std::exp(-x));
    const double err = std::fabs(got - want);
    const double ulps = err / (0x1p-24 * want);
    if (!(err <= 0x1p-24 * (4.0 * std::fabs(x) + 32.0) * want + 0x1p-126) && bad++ < 3) {
      fail("sigmoid(" + std::to_string(x) + ") = " + std::to_string(got) + ", want " +
           std::to_string(want));
    }
    if (want >= 0x1p-126 && ulps > worst) {
      worst = ulps;
      worst_x = x;
    }
    if (std::fabs(x) <= 16.0 && ulps > worst_small) worst_small = ulps;
  });
  std::printf("device sigmoid: max error %.1f ulps (at x = %g), %.1f ulps for |x| <= 16\n",
              worst, worst_x, worst_small);
}

// Every 16th float32 of either sign up to |x| = 8 (every 256th with --quick), and the specials:
// absolute error at most 3e-7 (math.h: 9.2e-8 from the fit evaluated in float32, plus exp2f's
// 2 ulps of a value <= 1), erf(+-0) = +-0, erf(+-inf) = +-1, erf(NaN) NaN. Prints the largest.
void test_erf_accuracy() {
  Case c;
  double worst = 0.0, worst_x = 0.0;
  int bad = 0;
  sweep<DeviceErf>(8.0f, g_quick ? 256 : 16, [&](float xf, float got) {
    const double x = xf, err = std::fabs(got - std::erf(x));
    if (!(err <= 3e-7) || (x == 0.0 && std::signbit(got) != std::signbit(xf))) {
      if (bad++ < 3) fail("erf(" + std::to_string(x) + ") = " + std::to_string(got));
    }
    if (err > worst) {
      worst = err;
      worst_x = x;
    }
  });
  // The specials: a sweep up to inf in steps of one exponent (its last value is +-inf), and one
  // up to the quiet NaN in a single step (0 and +-NaN).
  sweep<DeviceErf>(INFINITY, 0x800000u, [&](float x, float got) {
    if (std::isinf(x) && got != std::copysign(1.0f, x)) fail("erf(+-inf) != +-1");
  });
  sweep<DeviceErf>(std::nanf(""), 0x7fc00000u, [&](float x, float got) {
    if (std::isnan(x) && !std::isnan(got)) fail("erf(NaN) is not NaN");
  });
  std::printf("device erf: max absolute error %.3g (at x = %g)\n", worst, worst_x);
}

}  // namespace

int main(int argc, char** argv) {
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) g_quick = true;
    else only = argv[i];  // an activation name, e.g. SWIGLU
  }
  int dev = 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs%s\n", prop.name, prop.multiProcessorCount,
              g_quick ? " (quick)" : "");
  if (only.empty()) {
    test_sigmoid_accuracy();
    test_erf_accuracy();
  }
  for (const ActivationEnum act : kActivations) {
    if (act == ActivationEnum::IDENTITY) continue;
    if (!only.empty() && only != activation_name(act)) continue;
    with_activation(act, [&](auto spec) {
      using Spec = decltype(spec);
      run_all<Spec, float>(act);
      run_all<Spec, __nv_bfloat16>(act);
      run_all<Spec, __half>(act);
    });
    std::printf("%-15s done (%d cases, %d failed so far)\n", activation_name(act), g_checks,
                g_failed_checks);
  }
  std::printf("%d passed, %d failed\n", g_checks - g_failed_checks, g_failed_checks);
  if (g_notes) std::printf("%d notes (not failures)\n", g_notes);
  return g_failed_checks ? 1 : 0;
}
