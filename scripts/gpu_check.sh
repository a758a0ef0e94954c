#!/usr/bin/env bash
# One-shot check on a machine with a CUDA GPU and no network:
#   scripts/gpu_check.sh RESULTS_DIR
# Stages, each writing its results into RESULTS_DIR the moment it ends, so that a
# run cut short still returns what it measured:
#   build      the CUDA variant, with the python3 found there (+ .whl/*.whl)  <= 150 s
#   cuda       the CUDA-specific tests (-k cuda over every test file), the   <= 120 s
#              CUDA paths the CPU cannot show first (CUDA_PATH_TESTS below)
#   tests      the CPU variants of the engine's own test files               <= 120 s
#   bench      the GPU benchmark suites, compress included (files after each) <= 150 s
# At most 540 s of stages (under 6 minutes with start-up), files: gpu.txt,
# build.log, cuda.log, cuda-paths.xml, cuda.xml, tests.log, tests.xml, bench.log,
# bench.json, bench.md, stream.png, summary.txt (12 files; the device tool returns 8: pass
# GPU_CHECK_FEW_FILES=1 to drop the JUnit XML and fold gpu.txt into summary.txt).
# A stage past its limit gets SIGINT first (pytest then prints its summary), and
# SIGKILL 10 s later. Every test also has its own limit (LAYERWISE_TEST_TIMEOUT).
# Python packages missing there (diffusers, peft) can travel as wheels in .whl/.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh RESULTS_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FEW=${GPU_CHECK_FEW_FILES:-0}
export PYTHONUNBUFFERED=1 LAYERWISE_TEST_TIMEOUT=${LAYERWISE_TEST_TIMEOUT:-60}
: > "$OUT/summary.txt"

stage() {  # stage NAME LIMIT_S CMD...: run, log to $OUT/NAME.log, append the outcome to summary.txt
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  # tee has exited with the pipeline: the log is complete when it is read here.
  printf '%-6s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-110)" >> "$OUT/summary.txt"
  return "$rc"
}

build() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return
  fi
  LAYERWISE_BUILD=${LAYERWISE_BUILD:-cuda} "$PY" -m pip install --no-build-isolation --no-deps --no-index -q -e . || return
  "$PY" -c "import layerwise, json; print(json.dumps(layerwise.build_info()))"
}
export -f build  # `timeout` runs programs, not shell functions: stage runs it through bash -c
export PY PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

junit() {  # --junitxml into the results, unless the file count must stay at 8
  [ "$FEW" = 1 ] || echo "--junitxml=$OUT/$1.xml"
}

# The CPU variants of the files that exercise this build's engine and kernels (CI
# runs every test on CPU; the whole suite would not fit the stage's limit).
CPU_TESTS="tests/test_native.py tests/test_manager.py tests/test_contract.py
 tests/test_scatter.py tests/test_loading.py tests/test_reader.py tests/test_codec.py tests/test_disk_tier.py"

# The CUDA paths that the CPU backend cannot show (issue 22), run first in the cuda
# stage. Each fails on a broken path; their CPU variants run in CI.
#   reader CPU while waiting on CUDA events:
#     test_a_read_waiting_on_a_late_copy_does_not_spin_a_core[cuda]   one read after a late copy
#     test_reader_threads_stay_idle_through_a_disk_tier_forward[cuda]  /proc CPU time of every thread
#                                                    but the main one, compute-bound forward: < 0.5 core
#   pinned blocks freed under a copy in flight, no cudaDeviceSynchronize:
#     test_a_freed_pinned_block_keeps_its_bytes_until_its_copy_completes[cuda]
#   decode (Triton) with a staging regrow under random delays: sleeps on the copy streams,
#   on the compute stream (rule 1: staging and slots wait on the compute stream's last use), both:
#     test_decode_regrows_its_staging_under_random_copy_delays[cuda-copies|cuda-compute|cuda-both]
#   split fetch (NCCL, one GPU per rank: these skip with fewer than 2 GPUs, and NCCL
#   refuses two ranks on one GPU, so a 1-GPU host cannot run them):
#     test_split_fetch_beside_an_all_to_all_on_the_same_group[cuda]   + the gather stream is
#                                                                      none of torch's pool streams
#     test_split_fetch_remove_under_rank_skew[cuda]
#   capture check on the managed device's stream (the 2-device half needs 2 GPUs),
#   the dedicated gather stream, the decode path ready (triton >= 3.6, TRITON_INTERPRET unset):
#     test_capture_check_on_the_gpu, test_the_dedicated_stream_is_none_of_torchs_pool_streams,
#     test_decode_path_is_ready_on_this_gpu_host
#   CUDA copy out of staging, the next read after it: test_reader.py (its cuda test)
CUDA_COPY_READ=tests/test_reader.py::test_cuda_copy_out_of_staging_and_reading_after_a_cuda_copy
CUDA_PATH_TESTS="tests/test_cuda_path.py $CUDA_COPY_READ"

cuda_tests() {  # the CUDA paths first (pytest would fold them into the directory's order), then the rest
  local paths rest
  # shellcheck disable=SC2046,SC2086
  "$PY" -m pytest -q -rfEs -p no:cacheprovider $(junit cuda-paths) $CUDA_PATH_TESTS 2>&1 | tee -i "$OUT/.paths"
  paths=${PIPESTATUS[0]}
  # shellcheck disable=SC2046
  "$PY" -m pytest -q -rfE -p no:cacheprovider -k cuda --ignore=tests/test_cuda_path.py --deselect "$CUDA_COPY_READ" \
    $(junit cuda) tests 2>&1 | tee -i "$OUT/.rest"
  rest=${PIPESTATUS[0]}
  echo "paths: $(grep -v '^\s*$' "$OUT/.paths" | tail -n 1) | rest: $(grep -v '^\s*$' "$OUT/.rest" | tail -n 1)"
  rm -f "$OUT/.paths" "$OUT/.rest"
  [ "$paths" = 0 ] && return "$rest"
  return "$paths"
}
export -f cuda_tests junit
export OUT FEW CUDA_PATH_TESTS CUDA_COPY_READ

gpu_file="$OUT/gpu.txt"
[ "$FEW" = 1 ] && gpu_file="$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
  >> "$gpu_file" 2>&1 || echo "no nvidia-smi" >> "$gpu_file"

stage build 150 bash -c build
stage cuda 120 bash -c cuda_tests
# shellcheck disable=SC2046
stage tests 120 "$PY" -m pytest -q -rfE -p no:cacheprovider -k "not cuda" $(junit tests) ${GPU_CHECK_TESTS:-$CPU_TESTS}
# shellcheck disable=SC2086
stage bench 150 "$PY" -m layerwise.bench ${BENCH_SUITES:-h2d scatter stream tune startup hooks disk compress} \
  --device "${BENCH_DEVICE:-cuda}" ${BENCH_ARGS:-} \
  --json "$OUT/bench.json" --plot "$OUT/stream.png" --markdown "$OUT/bench.md"

echo
echo "== summary"
cat "$OUT/summary.txt"
