#!/usr/bin/env bash
# Builds and runs the standalone CUDA kernel tests on a machine with a GPU:
#   kernel_test  the NO_SCALING kernels (act_lu, dact, dact + dbias)
#   quant_test   the quantizing kernels (activation/cuda/quantize.cuh: tensor / MXFP8 / NVFP4
#                outputs, the amax passes), bit for bit against a host reference
# then the quick variants under compute-sanitizer (memcheck, racecheck, initcheck, synccheck).
#
#   bash ffi/cuda/tests/run.sh              # build, full tests, sanitizers
#   SANITIZE=0 bash ffi/cuda/tests/run.sh   # build and full tests only
#   SKIP_BUILD=1 bash ffi/cuda/tests/run.sh # use the binaries already in $BUILD
#   BUILD_ONLY=1 bash ffi/cuda/tests/run.sh # build, run nothing (A/B builds of two trees)
#   BENCH=1 ...                             # also quant_test --bench (1 GiB operands)
#   TOOLS="memcheck" ...                    # the sanitizer tools to run
#   NVCC_EXTRA="-DNAME=1" ...               # extra nvcc flags (experiments)
#
# Needs nvcc, and jaxlib for the XLA FFI headers (problem.h includes them). Writes to
# ${BUILD:-/tmp/te_jax_kernel_test}. Exit status: non-zero if any step failed.
set -u
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
BUILD="${BUILD:-/tmp/te_jax_kernel_test}"
ARCH="${ARCH:--gencode=arch=compute_90a,code=sm_90a}"
PY="${PYTHON:-python3}"
mkdir -p "$BUILD"
KERNELS=(act_lu dact dact_dbias quant_act_tensor quant_act_mx quant_act_nvfp4 quant_act_amax
         quant_dact_tensor quant_dact_mx quant_dact_nvfp4 quant_dact_amax quant_act_fp8_block
         quant_dact_fp8_block)
TESTS=(kernel_test quant_test)

if [ "${SKIP_BUILD:-0}" = 0 ]; then
  XLA_INC="$($PY -c 'import jaxlib, os; print(os.path.dirname(jaxlib.__file__) + "/include")')" \
    || exit 2
  FLAGS=(-std=c++17 -O3 -lineinfo --expt-relaxed-constexpr $ARCH -I"$ROOT/ffi" -isystem "$XLA_INC"
         -Xcompiler=-Wall ${NVCC_EXTRA:-})
  t0=$(date +%s)
  pids=()
  for src in "${KERNELS[@]}"; do
    nvcc "${FLAGS[@]}" -c "$ROOT/ffi/activation/cuda/$src.cu" -o "$BUILD/$src.o" &
    pids+=($!)
  done
  for t in "${TESTS[@]}"; do
    nvcc "${FLAGS[@]}" -c "$ROOT/ffi/cuda/tests/$t.cu" -o "$BUILD/$t.o" &
    pids+=($!)
  done
  ok=1
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  [ "$ok" = 1 ] || { echo "build failed"; exit 2; }
  objs=()
  for src in "${KERNELS[@]}"; do objs+=("$BUILD/$src.o"); done
  for t in "${TESTS[@]}"; do
    nvcc $ARCH "${objs[@]}" "$BUILD/$t.o" -o "$BUILD/$t" || exit 2
  done
  echo "built in $(( $(date +%s) - t0 )) s"
fi

[ "${BUILD_ONLY:-0}" = 0 ] || exit 0

status=0
for t in "${TESTS[@]}"; do
  echo "== $t"
  "$BUILD/$t" || status=1
done

if [ "${SANITIZE:-1}" != 0 ]; then
  for tool in ${TOOLS:-memcheck racecheck initcheck synccheck}; do
    for run in "kernel_test SWIGLU" "kernel_test GELU" "quant_test SWIGLU" "quant_test IDENTITY"; do
      set -- $run
      log="$BUILD/sanitize_${tool}_$1_$2.log"
      echo "== compute-sanitizer --tool $tool ($1 $2, quick)"
      compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
        "$BUILD/$1" --quick "$2" > "$log" 2>&1
      rc=$?
      tail -n 3 "$log"
      [ "$rc" = 0 ] || { echo "compute-sanitizer $tool $1 $2: exit $rc"; status=1; }
    done
  done
fi

if [ "${BENCH:-0}" != 0 ]; then
  "$BUILD/quant_test" --bench || status=1
fi
exit $status
