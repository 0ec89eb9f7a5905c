#!/usr/bin/env bash
# Builds and runs the standalone CUDA kernel test (kernel_test.cu) on a machine with a GPU, then
# the quick variant under compute-sanitizer (memcheck, racecheck, initcheck, synccheck).
#
#   bash ffi/cuda/tests/run.sh            # build, full test, sanitizers on two activations
#   SANITIZE=0 bash ffi/cuda/tests/run.sh # build and full test only
#
# Needs nvcc, and jaxlib for the XLA FFI headers (problem.h includes them). Writes to
# ${BUILD:-/tmp/te_jax_kernel_test}. Exit status: non-zero if any step failed.
set -u
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
BUILD="${BUILD:-/tmp/te_jax_kernel_test}"
ARCH="${ARCH:--gencode=arch=compute_90a,code=sm_90a}"
PY="${PYTHON:-python3}"
mkdir -p "$BUILD"
XLA_INC="$($PY -c 'import jaxlib, os; print(os.path.dirname(jaxlib.__file__) + "/include")')" \
  || exit 2
FLAGS=(-std=c++17 -O3 -lineinfo --expt-relaxed-constexpr $ARCH -I"$ROOT/ffi" -isystem "$XLA_INC"
       -Xcompiler=-Wall)

t0=$(date +%s)
pids=()
for src in act_lu dact dact_dbias tests/kernel_test; do
  nvcc "${FLAGS[@]}" -c "$ROOT/ffi/cuda/$src.cu" -o "$BUILD/$(basename $src).o" &
  pids+=($!)
done
ok=1
for p in "${pids[@]}"; do wait "$p" || ok=0; done
[ "$ok" = 1 ] || { echo "build failed"; exit 2; }
nvcc $ARCH "$BUILD"/act_lu.o "$BUILD"/dact.o "$BUILD"/dact_dbias.o "$BUILD"/kernel_test.o \
  -o "$BUILD/kernel_test" || exit 2
echo "built in $(( $(date +%s) - t0 )) s"

status=0
"$BUILD/kernel_test" || status=1

if [ "${SANITIZE:-1}" != 0 ]; then
  for tool in memcheck racecheck initcheck synccheck; do
    for act in SWIGLU GELU; do
      echo "== compute-sanitizer --tool $tool ($act, quick)"
      compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
        "$BUILD/kernel_test" --quick "$act" > "$BUILD/sanitize_${tool}_${act}.log" 2>&1
      rc=$?
      tail -n 4 "$BUILD/sanitize_${tool}_${act}.log"
      [ "$rc" = 0 ] || { echo "compute-sanitizer $tool $act: exit $rc"; status=1; }
    done
  done
fi
exit $status
