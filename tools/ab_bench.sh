#!/usr/bin/env bash
# A/B of the Python-level benchmarks between this tree and an older one, on one GPU, in one call:
#   git archive <rev> src ffi benchmarks CMakeLists.txt pyproject.toml README.md | tar x -C .ab_old
#   AB_OLD=.ab_old bash tools/ab_bench.sh                 (carry .ab_old to the device)
# Builds both trees (this one installed, the old one into /tmp/old_site), then for each name in
# AB_BENCHES (default "mlp dense") runs `python -m benchmarks.<name>` from each tree in turn,
# AB_ROUNDS times (default 1), logs in $OUT/<name>_<tree><round>.log. Options per benchmark:
# AB_MLP_ARGS (default: the GELU block, flax:bf16 and te_linen bf16 / delayed, 5 samples) and
# AB_DENSE_ARGS (default: the GELU rows, 5 samples).
set -u
cd "$(dirname "$0")/.."
: "${AB_OLD:?AB_OLD must name the older tree}" "${OUT:?}"
( cd "$AB_OLD" && TE_JAX_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=8 python3 -m pip install -q \
    --no-build-isolation --no-deps --target /tmp/old_site -Cbuild-dir=/tmp/old_build . \
    > "$OUT/oldbuild.log" 2>&1 ) &
old=$!
bash tools/gpu_check.sh build > "$OUT/steps.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
wait $old || { tail -30 "$OUT/oldbuild.log"; exit 1; }
declare -A args=(
  [mlp]="${AB_MLP_ARGS:---blocks gelu --rows flax:bf16,te_linen:bf16,te_linen:delayed --reps 5}"
  [dense]="${AB_DENSE_ARGS:---rows gelu --reps 5}"
)
for round in $(seq "${AB_ROUNDS:-1}"); do
  for name in ${AB_BENCHES:-mlp dense}; do
    for tree in new old; do
      dir=. pp=
      [ "$tree" = old ] && dir=$AB_OLD && pp=/tmp/old_site
      ( cd "$dir" && PYTHONPATH=$pp timeout 200 python3 -m "benchmarks.$name" ${args[$name]} \
          --out "/tmp/ab_${tree}_$name" ) > "$OUT/${name}_${tree}$round.log" 2>&1
      echo "== $name $tree (round $round)"; grep -E "^\||^gelu |^swiglu " "$OUT/${name}_${tree}$round.log"
    done
  done
done
