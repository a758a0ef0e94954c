#!/usr/bin/env bash
# One-shot check on a machine with a CUDA GPU and no network:
#   scripts/gpu_check.sh RESULTS_DIR
# Stages, each writing its results into RESULTS_DIR the moment it ends, so that a
# run cut short still returns what it measured:
#   build      the CUDA variant, with the python3 found there (+ .whl/*.whl)  <= 150 s
#   cuda       the CUDA-specific tests first (-k cuda over every test file)   <= 90 s
#   tests      the CPU variants of the engine's own test files               <= 150 s
#   bench      the GPU benchmark suites, compress included (files after each) <= 150 s
# At most 540 s of stages (under 6 minutes with start-up), files: gpu.txt,
# build.log, cuda.log, cuda.xml, tests.log, tests.xml, bench.log, bench.json,
# bench.md, stream.png, summary.txt (11 files; the device tool returns 8: pass
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
CPU_TESTS="tests/test_native.py tests/test_manager.py tests/test_contract.py tests/test_cuda_path.py
 tests/test_scatter.py tests/test_loading.py tests/test_reader.py tests/test_codec.py tests/test_disk_tier.py"

gpu_file="$OUT/gpu.txt"
[ "$FEW" = 1 ] && gpu_file="$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
  >> "$gpu_file" 2>&1 || echo "no nvidia-smi" >> "$gpu_file"

stage build 150 bash -c build
# shellcheck disable=SC2046
stage cuda 90 "$PY" -m pytest -q -rfE -p no:cacheprovider -k cuda $(junit cuda) tests
# shellcheck disable=SC2046
stage tests 150 "$PY" -m pytest -q -rfE -p no:cacheprovider -k "not cuda" $(junit tests) ${GPU_CHECK_TESTS:-$CPU_TESTS}
# shellcheck disable=SC2086
stage bench 150 "$PY" -m layerwise.bench ${BENCH_SUITES:-h2d scatter stream startup hooks disk compress} \
  --device "${BENCH_DEVICE:-cuda}" ${BENCH_ARGS:-} \
  --json "$OUT/bench.json" --plot "$OUT/stream.png" --markdown "$OUT/bench.md"

echo
echo "== summary"
cat "$OUT/summary.txt"
