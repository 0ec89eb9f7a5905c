#!/usr/bin/env bash
# Everything te_jax needs checked on a GPU machine, in stages, logs under $OUT:
#   bash tools/gpu_check.sh build test sanitize bench
#   bash tools/gpu_check.sh build dbench
# build     pip install (CUDA forced on) against the machine's own jaxlib; skipped if this machine
#           already has a te_jax with the CUDA extension from this tree; where only Python sources
#           changed since, they are copied over the installed package instead (seconds, not minutes)
# test      the full pytest suite (the same files CI runs on the CPU); PYTEST_ARGS picks a part
#           (a device call is limited to 600 s); PYTEST_JOBS=n deals the collected tests to n
#           pytest processes sharing the GPU (the GPUs, dealt round-robin; CUDA_VISIBLE_DEVICES=2,3
#           deals them over those two only); PYTEST_DEADLINE=s stops them s seconds after the
#           script started and lists the tests not run in $OUT/notrun.txt, which PYTEST_IDS=<file>
#           runs in the next call; XLA's GEMM autotuning is off (PYTEST_XLA_FLAGS= to keep it)
# sanitize  the standalone kernel test, plain and under compute-sanitizer (memcheck, racecheck,
#           initcheck, synccheck); reuses the native build of a preceding `ab` stage
# ab        A/B of the native kernels: the ffi/ tree under $AB_OLD (an older revision, e.g.
#           `git archive <rev> ffi | tar x -C .ab_old`, carried to the device) and this one, both
#           built, then quant_test --bench of each, interleaved, $AB_ROUNDS rounds (default 2)
# bench     the activation benchmark table (benchmarks/activations.py), Markdown + JSON under $OUT
# qbench    the quantization benchmark table (benchmarks/quantize.py), Markdown + JSON under $OUT
# dbench    the dense (GEMM + bias + GELU, bf16 and FP8) benchmark (benchmarks/dense.py), Markdown
#           + JSON under $OUT/bench, log in $OUT/dbench.log; ~2 min on an H100 (stops starting new
#           work after 210 s); DBENCH_ARGS adds options (e.g. "--rows gelu")
# mbench    the LayerNormMLP step benchmark (benchmarks/mlp.py: te_jax Linen / NNX against the
#           Flax-native block and Flax fp8_ops), Markdown + JSON under $OUT/bench; MBENCH_ARGS adds
#           options (e.g. "--blocks gelu --plot"); then the Flax rows again with Triton GEMMs off
#           (Flax fp8_ops' best flags), into the same log
# multi      on every GPU of the host (NCCL, NVLink multicast off): examples/train_sharded.py for
#           DP, FSDP, TP and (4+ GPUs) DP x TP, each recipe, 20 steps checked against one GPU and
#           the replicas compared, log in $OUT/multi.log; then the scaling benchmark
#           (benchmarks/scaling.py, SCALING_ARGS adds options), Markdown + JSON + PNG under
#           $OUT/bench, log in $OUT/scaling.log; MULTI_PARTS picks "train", "scaling" or both,
#           MULTI_MESHES (";"-separated) the meshes
# gemmtune  benchmarks.dense's te:dot and te:gelu_vjp rows (with their XLA baselines) once per
#           TE_JAX_GEMM_CANDIDATES in $GEMM_CANDIDATES (default "8 32 64"), log in gemmtune.log
# gsanitize the FFI handlers under compute-sanitizer: $GSANITIZE_TESTS (default
#           tests/test_gemm_primitive.py; GSANITIZE_K: a -k expression) through pytest, once per
#           tool in $GTOOLS (default memcheck), log in $OUT/gsanitize.log;
#           GSANITIZE_CONTROL=<-k expression> adds the controls for hazards inside cuBLASLt's own
#           kernels (XLA's autotuned GEMM of the same shape; those tests with no candidate timing)
# Exit status: non-zero if any stage failed. At most 8 files come back from a device run, so the
# stages write one log each (the sanitizer summaries are folded into sanitize.log).
set -u
OUT="${OUT:-/tmp/te_jax_gpu_out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
stamp() { echo "== $(date +%T) $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"

for stage in "$@"; do
  case "$stage" in
    build)
      hash() { find "$@" -type f -not -path "*/__pycache__/*" | sort | xargs sha1sum | sha1sum | cut -c1-12; }
      tree=$(hash ffi src CMakeLists.txt pyproject.toml)
      native=$(hash ffi CMakeLists.txt pyproject.toml)
      if [ -f /tmp/te_jax_built_native ] && [ "$(cat /tmp/te_jax_built_native)" = "$native" ] && \
         python3 -c "import te_jax, sys; sys.exit(0 if te_jax.ffi_available('cuda') else 1)"; then
        if [ "$(cat /tmp/te_jax_built_tree 2>/dev/null)" = "$tree" ]; then
          stamp "build: already built for this tree"; continue
        fi
        # Only Python sources changed: copy them over the installed package (the generated
        # _build_config.py stays).
        pkg=$(cd /tmp && python3 -c "import os, te_jax; print(os.path.dirname(te_jax.__file__))")
        (cd src/te_jax && find . -name "*.py" -not -name _build_config.py -not -path "*/__pycache__/*" \
          -exec cp --parents {} "$pkg/" \;)
        echo "$tree" > /tmp/te_jax_built_tree
        stamp "build: native code unchanged; Python sources copied into $pkg"; continue
      fi
      stamp "build"
      t0=$(date +%s)
      if TE_JAX_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -v \
           --no-build-isolation --no-deps -Cbuild-dir=/tmp/te_jax_build . >"$OUT/build.log" 2>&1; then
        echo "built in $(( $(date +%s) - t0 )) s"; echo "$tree" > /tmp/te_jax_built_tree
        echo "$native" > /tmp/te_jax_built_native
        grep -E "warning|ptxas info" "$OUT/build.log" | grep -v "^--" | head -20
      else
        tail -n 60 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
      fi
      (cd /tmp && python3 -c "import te_jax; print('ffi cpu', te_jax.ffi_available('cpu'), 'cuda', te_jax.ffi_available('cuda'), te_jax._ffi._load_errors)")
      ;;
    test)
      stamp "pytest ${PYTEST_ARGS:-tests} in ${PYTEST_JOBS:-1} process(es)"
      # faulthandler_timeout: a test stuck for 300 s dumps every thread's stack into the log.
      # -v: one line per finished test, so a run cut short still says which tests it ran.
      popts=(-v -p no:cacheprovider --maxfail=20 -rfE --durations=5 -o faulthandler_timeout=300)
      # XLA's autotuning of its own GEMMs picks among equivalent kernels at compile time; the
      # tests check results, not speed, so it is off unless asked for.
      # Only the pytest processes get it: a benchmark stage after this one keeps XLA's defaults.
      test_xla_flags="${XLA_FLAGS:-} ${PYTEST_XLA_FLAGS---xla_gpu_autotune_level=0}"
      jobs=${PYTEST_JOBS:-1}
      # The ids: collected, or those a cut-short run left (PYTEST_IDS, a file in the tree).
      if [ -n "${PYTEST_IDS:-}" ]; then
        cp "$PYTEST_IDS" /tmp/te_jax_ids
      else
        # shellcheck disable=SC2086
        python3 -m pytest -q -p no:cacheprovider --collect-only ${PYTEST_ARGS:-tests} 2>/dev/null \
          | grep "::" > /tmp/te_jax_ids || { echo "collection failed"; status=1; continue; }
      fi
      echo "$(wc -l < /tmp/te_jax_ids) tests to run"
      # PYTEST_DEADLINE: seconds after this script started by which every process is stopped
      # (SIGINT: pytest reports what it ran), leaving time for the stages after this one.
      left=$(( ${PYTEST_DEADLINE:-100000} - SECONDS ))
      # On a host with several GPUs, each process gets one of them (round-robin): those listed
      # in CUDA_VISIBLE_DEVICES, else every GPU of the host.
      if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        IFS=',' read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
      else
        mapfile -t gpus < <(seq 0 $(( $(nvidia-smi -L 2>/dev/null | grep -c "^GPU") - 1 )))
      fi
      rm -f /tmp/te_jax_pytest_*.log
      pids=()
      for j in $(seq 0 $((jobs - 1))); do
        # The ids dealt round-robin to $jobs processes sharing the GPU (the suite is bound by
        # compilation on the host), one log each, folded into pytest.log.
        awk -v n="$jobs" -v j="$j" 'NR % n == j' /tmp/te_jax_ids > "/tmp/te_jax_ids_$j"
        mapfile -t ids < "/tmp/te_jax_ids_$j"
        [ "${#ids[@]}" -eq 0 ] && continue
        gpu=""
        [ "${#gpus[@]}" -gt 0 ] && gpu=${gpus[$((j % ${#gpus[@]}))]}
        env XLA_FLAGS="$test_xla_flags" ${gpu:+CUDA_VISIBLE_DEVICES=$gpu} timeout -s INT -k 30 "$left" python3 -m pytest "${popts[@]}" "${ids[@]}" \
          >"/tmp/te_jax_pytest_$j.log" 2>&1 &
        pids+=("$j:$!")
      done
      for jp in "${pids[@]}"; do
        j=${jp%%:*}
        wait "${jp#*:}" || status=1
        { echo "==== process $j"; grep -vE " PASSED( +\[ *[0-9]+%\])?$" "/tmp/te_jax_pytest_$j.log"; } \
          >>"$OUT/pytest.log"
        echo "process $j: $(tail -n 1 "/tmp/te_jax_pytest_$j.log")"
      done
      # Which ids never reported a result (a process stopped at the deadline): $OUT/notrun.txt,
      # to be put in the tree and passed back as PYTEST_IDS.
      cat /tmp/te_jax_pytest_*.log 2>/dev/null \
        | sed -nE 's/^(tests\/.*::.*) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( \(.*\))?( +\[ *[0-9]+%\])?$/\1/p' \
        | sort -u > /tmp/te_jax_ran
      grep -vxFf /tmp/te_jax_ran /tmp/te_jax_ids > "$OUT/notrun.txt"
      echo "$(wc -l < /tmp/te_jax_ran) ran, $(wc -l < "$OUT/notrun.txt") not run (notrun.txt)"
      [ -s "$OUT/notrun.txt" ] || rm "$OUT/notrun.txt"
      grep -h "^FAILED\|^ERROR" "$OUT/pytest.log" | head -n 30
      ;;
    sanitize)
      stamp "kernel test + compute-sanitizer"
      skip=0; [ -x /tmp/te_jax_kernel_test/quant_test ] && [ -n "${AB_BUILT:-}" ] && skip=1
      SKIP_BUILD=$skip BUILD=/tmp/te_jax_kernel_test bash ffi/cuda/tests/run.sh \
        >"$OUT/sanitize.log" 2>&1 || status=1
      tail -n 40 "$OUT/sanitize.log"
      grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" /tmp/te_jax_kernel_test/sanitize_*.log
      ;;
    ab)
      stamp "A/B native kernels: ${AB_OLD:?set AB_OLD} against this tree"
      BUILD_ONLY=1 BUILD=/tmp/ab_old bash "$AB_OLD/ffi/cuda/tests/run.sh" >"$OUT/ab.log" 2>&1 &
      old_pid=$!
      BUILD_ONLY=1 BUILD=/tmp/te_jax_kernel_test bash ffi/cuda/tests/run.sh >>"$OUT/ab.log" 2>&1 \
        || { status=1; echo "A/B: this tree did not build"; tail -n 30 "$OUT/ab.log"; continue; }
      wait $old_pid || { status=1; echo "A/B: the old tree did not build"; continue; }
      AB_BUILT=1
      for round in $(seq "${AB_ROUNDS:-2}"); do
        for side in old new; do
          bin=/tmp/te_jax_kernel_test/quant_test; [ $side = old ] && bin=/tmp/ab_old/quant_test
          echo "== round $round: $side" >>"$OUT/ab.log"
          "$bin" --bench >"$OUT/ab_${side}_$round.txt" 2>&1 || status=1
          cat "$OUT/ab_${side}_$round.txt" >>"$OUT/ab.log"; rm "$OUT/ab_${side}_$round.txt"
        done
      done
      grep -c . "$OUT/ab.log"
      ;;
    bench)
      stamp "benchmarks"
      python3 -m benchmarks.activations --small --out "$OUT/bench" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1 || status=1
      tail -n 80 "$OUT/bench.log"
      ;;
    qbench)
      stamp "quantization benchmarks"
      python3 -m benchmarks.quantize --out "$OUT/bench" ${QBENCH_ARGS:-} >"$OUT/qbench.log" 2>&1 || status=1
      tail -n 40 "$OUT/qbench.log"
      ;;
    gsanitize)
      for tool in ${GTOOLS:-memcheck}; do
        stamp "compute-sanitizer --tool $tool: ${GSANITIZE_TESTS:-tests/test_gemm_primitive.py}"
        # XLA allocates its own pools; only te_jax's kernels and cuBLASLt's are of interest here.
        # application-only: XLA's child processes (ptxas) are not followed (following them
        # crashed the sanitizer in an XLA FP8 dot).
        # shellcheck disable=SC2086
        compute-sanitizer --tool "$tool" --error-exitcode 7 --target-processes application-only \
          python3 -m pytest -q -p no:cacheprovider ${GSANITIZE_TESTS:-tests/test_gemm_primitive.py} \
          -k "${GSANITIZE_K:-not nothing}" \
          >>"$OUT/gsanitize.log" 2>&1 || status=1
        grep -E "ERROR SUMMARY|passed|failed" "$OUT/gsanitize.log" | tail -n 3
      done
      if [ -n "${GSANITIZE_CONTROL:-}" ]; then
        # Controls for hazards reported inside cuBLASLt's own kernels: the same tools over XLA's
        # cuBLASLt GEMM + bias of the same shape with XLA's autotuner timing its candidates,
        # then over the $GSANITIZE_CONTROL tests with te_jax timing none (one heuristic pick).
        for tool in ${GTOOLS:-memcheck}; do
          stamp "control, compute-sanitizer --tool $tool: XLA's x @ w + b, autotuned" >>"$OUT/gsanitize.log"
          XLA_FLAGS=--xla_gpu_autotune_level=4 compute-sanitizer --tool "$tool" \
            --target-processes application-only python3 -c "
import jax, jax.numpy as jnp
k = jax.random.split(jax.random.key(0), 3)
x, w = (jax.random.normal(a, s, jnp.bfloat16) for a, s in zip(k, [(1040, 1024), (1024, 1032)]))
b = jax.random.normal(k[2], (1032,), jnp.bfloat16)
print(float(jax.jit(lambda x, w, b: jnp.sum(x @ w + b, dtype=jnp.float32))(x, w, b)))" \
            >>"$OUT/gsanitize.log" 2>&1
          grep -E "SUMMARY" "$OUT/gsanitize.log" | tail -n 1
          stamp "control, --tool $tool: -k '$GSANITIZE_CONTROL', TE_JAX_GEMM_CANDIDATES=1" >>"$OUT/gsanitize.log"
          TE_JAX_GEMM_CANDIDATES=1 compute-sanitizer --tool "$tool" --target-processes application-only \
            python3 -m pytest -q -p no:cacheprovider tests/test_gemm_primitive.py -k "$GSANITIZE_CONTROL" \
            >>"$OUT/gsanitize.log" 2>&1
          grep -E "SUMMARY|passed|failed" "$OUT/gsanitize.log" | tail -n 2
        done
      fi
      ;;
    mbench)
      stamp "MLP block benchmarks"
      # shellcheck disable=SC2086
      python3 -m benchmarks.mlp --out "$OUT/bench" ${MBENCH_ARGS:-} >"$OUT/mbench.log" 2>&1 || status=1
      # Flax fp8_ops at its best flags (Triton GEMMs off: XLA then rewrites its QDQ to FP8
      # cuBLASLt); XLA_FLAGS are per process, so a second run, its table into the same log.
      stamp "Flax rows with --xla_gpu_enable_triton_gemm=false" >>"$OUT/mbench.log"
      # shellcheck disable=SC2086
      XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 -m benchmarks.mlp --out /tmp/mbench_flags \
        --rows flax:bf16,flax:fp8_ops,flax:te_delayed,flax:te_current $(echo ${MBENCH_ARGS:-} | sed -E 's/--plot//; s/--profile +[^ ]+//') >>"$OUT/mbench.log" 2>&1 || status=1
      tail -n 80 "$OUT/mbench.log"
      ;;
    multi)
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      n=$(python3 -c "import jax; print(len(jax.devices()))")
      if [[ " ${MULTI_PARTS:-train scaling} " == *" train "* ]]; then
        meshes=("data=$n" "data=$n --fsdp" "tensor=$n" "tensor=$n --family nnx")
        [ "$n" -ge 4 ] && meshes+=("data=2,tensor=$((n / 2))" "data=2,tensor=$((n / 2)) --sp")
        # MULTI_MESHES="data=2,tensor=2;data=2,tensor=2 --sp" runs those meshes only.
        [ -n "${MULTI_MESHES:-}" ] && IFS=';' read -r -a meshes <<<"$MULTI_MESHES"
        for m in "${meshes[@]}"; do
          stamp "train_sharded --mesh $m on $n GPUs"
          # shellcheck disable=SC2086
          python3 examples/train_sharded.py --mesh $m --recipe all --steps 20 >>"$OUT/multi.log" 2>&1 \
            || { status=1; echo "FAILED: --mesh $m"; }
          grep -A4 "^summary" "$OUT/multi.log" | tail -n 4
        done
        grep "^ERROR" "$OUT/multi.log"
      fi
      if [[ " ${MULTI_PARTS:-train scaling} " == *" scaling "* ]]; then
        stamp "scaling benchmark on $n GPUs"
        # shellcheck disable=SC2086
        python3 -m benchmarks.scaling --out "$OUT/bench" --plot ${SCALING_ARGS:-} \
          >"$OUT/scaling.log" 2>&1 || status=1
        tail -n 50 "$OUT/scaling.log"
      fi
      ;;
    gemmtune)
      # te_jax's GEMM with each number of timed cuBLASLt candidates (TE_JAX_GEMM_CANDIDATES; a
      # process each, the choice is cached per process) against XLA's autotuned GEMM.
      for n in ${GEMM_CANDIDATES:-8 32 64}; do
        stamp "dense GEMM rows, TE_JAX_GEMM_CANDIDATES=$n" >>"$OUT/gemmtune.log"
        TE_JAX_GEMM_CANDIDATES=$n python3 -m benchmarks.dense --out "/tmp/gemmtune_$n" \
          --rows "${GEMMTUNE_ROWS:-te:dot,te:gelu_vjp}" --reps 5 >>"$OUT/gemmtune.log" 2>&1 || status=1
      done
      grep -E "^== |te:dot |te:gelu_vjp |xla:dot |xla:gelu_vjp " "$OUT/gemmtune.log" | head -60
      ;;
    dbench)
      stamp "dense benchmarks"
      python3 -m benchmarks.dense --out "$OUT/bench" ${DBENCH_ARGS:-} >"$OUT/dbench.log" 2>&1 || status=1
      tail -n 60 "$OUT/dbench.log"
      ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
stamp "done (status $status)"
exit $status
