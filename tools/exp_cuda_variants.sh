set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
B="--acts relu,gelu,swiglu,gelu_exact --dtypes bfloat16 --ops fwd,dact,dact+dbias --reps 5 --no-check"
for variant in base streaming; do
  flags=""; [ $variant = streaming ] && flags="-DCMAKE_CUDA_FLAGS=-DTE_JAX_EXP_STREAMING"
  t0=$(date +%s)
  CMAKE_ARGS="$flags" TE_JAX_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=/tmp/b_$variant . > $OUT/build_$variant.log 2>&1 || { tail -30 $OUT/build_$variant.log; exit 1; }
  echo "== build $variant $(( $(date +%s)-t0 ))s"
  for grid in -1 0 8; do
    echo "== variant=$variant blocks_per_sm=$grid"
    TE_JAX_EXP_BLOCKS_PER_SM=$grid python3 -m benchmarks.activations $B --out /tmp/bench_$variant$grid 2>&1 | grep -E "^\| (fwd|dact)" | awk -F'|' '{printf "%-11s %-11s te=%s xla=%s x%s\n",$2,$3,$9,$12,$13}'
  done
done
