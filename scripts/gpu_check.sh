#!/usr/bin/env bash
# One run on a machine with a CUDA GPU and no network, sized for the device lease
# (15 minutes of device time in all, the machine's start included, with room for a
# second run): at most 360 s of stages, the most valuable first, each with its own
# limit, so that a run cut short has already returned what matters most.
#
#   scripts/gpu_check.sh RESULTS_DIR            run it (on the device: RESULTS_DIR=$OUT)
#   scripts/gpu_check.sh --dry-run [DIR]        (or DRY_RUN=1) print the stages in order, their
#                                               limits, the total and the files; run nothing
#
# Stages (STAGES below: name, limit in seconds, the files it leaves in RESULTS_DIR):
#   build    80  the CUDA variant, with the python3 found there (+ .whl/*.whl it lacks: carry .whl)
#   smoke    50  scripts/gpu_smoke.py -> smoke.json: build info, the device, pinned-arena
#                H2D GiB/s against torch's pinned copy_ at 64 MiB and 1 GiB, one bitwise
#                stream with the GPU behind the host (raw and compressed), one decode's GiB/s
#   capture  75  CUDA graphs of a streamed step first (tests/runtime/test_capture_cuda.py:
#                20 replays bitwise with the compute stream slowed, a load_state_dict
#                between replays, the refusal of an encoded group, reduce-overhead on
#                a tiny Llama; Flux where diffusers is installed), then compile-native
#                streaming's CUDA variants (tests/contract/test_compile_native.py -k cuda)
#   cuda     80  the CUDA tests of the core files, in this order: native, manager, cuda
#                path, residency, tune, loading, then routed experts and the reader
#                (LAYERWISE_CUDA_ONLY=1: their cuda variants and GPU-only tests; CI runs
#                the rest on the CPU backend)
#   kernels  25  the CUDA tests of the Triton kernels: codec (decode) and scatter
#   bench    50  python -m layerwise.bench --quick h2d compress stream
#                -> bench.json, bench.md, stream.png (compress, the decode GiB/s, before stream)
# Files (at most 8; the device tool returns 8): summary.txt (each stage's outcome, and
# under smoke and bench their key figures), run.log (each stage's output, capped),
# and the stages' own files above. A stage works in a scratch directory: when it ends,
# at its limit or not, its own files (and no others) move into RESULTS_DIR and its log
# is appended to run.log. A stage at its limit gets SIGINT (pytest prints its summary),
# then SIGKILL GRACE s later, within its limit. A failed build stops the run.
set -uo pipefail
cd "$(dirname "$0")/.."

GRACE=5
TOTAL_MAX=360
FILES_MAX=8
ALWAYS_FILES="summary.txt run.log"
# name   limit_s  files (comma-separated; - for none); a line starting with # is none
STAGES="
build    80   -
smoke    50   smoke.json
capture  75   -
cuda     80   -
kernels  25   -
bench    50   bench.json,bench.md,stream.png
"
if [ "${GPU_CHECK_SELFTEST:-0}" = 1 ]; then  # tests/bench/test_gpu_check_script.py: limits and file discipline
  STAGES="
slow     8    smoke.json
quick    6    -
"
fi

CORE_TESTS="tests/runtime/test_native.py tests/runtime/test_manager.py tests/runtime/test_cuda_path.py
 tests/runtime/test_residency.py tests/test_tune.py tests/test_loading.py tests/stages/test_moe.py
 tests/stages/test_reader.py"
CAPTURE_TESTS="tests/runtime/test_shared_cuda.py tests/runtime/test_cohort_cuda.py tests/runtime/test_capture_cuda.py tests/contract/test_compile_native.py"
KERNEL_TESTS="tests/codec/test_codec.py tests/codec/test_codec_v2.py tests/test_scatter.py"
BENCH="-m layerwise.bench --quick h2d compress stream --device cuda"

DRY=${DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi

# -------------------------------------------------------------- the stages
stage_build() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return
  fi
  # The Triton kernels live in triton_kernels/ (package_dir); a checkout links them into the
  # package, a copy of the tree may not carry the link: the tests import the package from here.
  [ -e layerwise/triton_kernels ] || ln -s ../triton_kernels layerwise/triton_kernels
  LAYERWISE_BUILD=${LAYERWISE_BUILD:-cuda} "$PY" -m pip install --no-build-isolation --no-deps --no-index -q -e . \
    || return
  "$PY" -c "import layerwise, json; print(json.dumps(layerwise.build_info()))"
}
stage_smoke() { "$PY" scripts/gpu_smoke.py "$WORK/smoke.json"; }
stage_cuda() {
  # shellcheck disable=SC2086
  LAYERWISE_CUDA_ONLY=1 "$PY" -m pytest -q -rfEs --tb=short -p no:cacheprovider $CORE_TESTS
}
stage_capture() {
  # (a compile of a tiny model takes tens of seconds: a longer limit per test than the others)
  # shellcheck disable=SC2086
  LAYERWISE_TEST_TIMEOUT=70 LAYERWISE_CUDA_ONLY=1 "$PY" -m pytest -q -rfEs --tb=short -p no:cacheprovider \
    $CAPTURE_TESTS
}
stage_kernels() {
  # shellcheck disable=SC2086
  LAYERWISE_CUDA_ONLY=1 "$PY" -m pytest -q -rfEs --tb=short -p no:cacheprovider $KERNEL_TESTS
}
stage_bench() {
  # shellcheck disable=SC2086
  "$PY" $BENCH --json "$WORK/bench.json" --markdown "$WORK/bench.md" --plot "$WORK/stream.png"
}
stage_slow() { echo '{}' > "$WORK/smoke.json"; echo x > "$WORK/stray.txt"; echo "slow: sleeping"; sleep 60; }
stage_quick() { echo "quick: done"; }

command_of() {  # what stage NAME runs, in words (the dry run)
  case $1 in
    build) echo "pip install -e . (LAYERWISE_BUILD=cuda; .whl/*.whl first)" ;;
    smoke) echo "python scripts/gpu_smoke.py smoke.json" ;;
    capture) echo "LAYERWISE_CUDA_ONLY=1 python -m pytest" $CAPTURE_TESTS ;;
    cuda) echo "LAYERWISE_CUDA_ONLY=1 python -m pytest" $CORE_TESTS ;;
    kernels) echo "LAYERWISE_CUDA_ONLY=1 python -m pytest" $KERNEL_TESTS ;;
    bench) echo "python $BENCH --json bench.json --markdown bench.md --plot stream.png" ;;
    *) echo "stage_$1" ;;
  esac
}

# ---------------------------------------------------------- the plan, once
total=0
files="$ALWAYS_FILES"
while read -r name limit out; do
  [ -n "$name" ] && [ "${name:0:1}" != "#" ] || continue
  total=$((total + limit))
  [ "$out" = - ] || files="$files ${out//,/ }"
done <<< "$STAGES"
nfiles=$(wc -w <<< "$files")
if [ "$total" -gt "$TOTAL_MAX" ] || [ "$nfiles" -gt "$FILES_MAX" ]; then
  echo "gpu_check: the stages take $total s (at most $TOTAL_MAX) and write $nfiles files (at most $FILES_MAX):" \
       "rebalance STAGES" >&2
  exit 2
fi

if [ "$DRY" = 1 ]; then
  echo "gpu_check dry run: stages in order (each limit includes ${GRACE} s between SIGINT and SIGKILL)"
  k=0
  while read -r name limit out; do
    [ -n "$name" ] && [ "${name:0:1}" != "#" ] || continue
    k=$((k + 1))
    printf '  %d. %-8s %4s s  files: %-30s %s\n' "$k" "$name" "$limit" "$out" "$(command_of "$name")"
  done <<< "$STAGES"
  echo "total: $total s of stages (at most $TOTAL_MAX)"
  echo "files ($nfiles of at most $FILES_MAX): $files"
  exit 0
fi

OUT=${1:?usage: scripts/gpu_check.sh [--dry-run] RESULTS_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python3}
export PY WORK CORE_TESTS CAPTURE_TESTS KERNEL_TESTS BENCH PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export LAYERWISE_TEST_TIMEOUT=${LAYERWISE_TEST_TIMEOUT:-40}  # one test past it fails instead of eating the stage
export -f stage_build stage_smoke stage_capture stage_cuda stage_kernels stage_bench stage_slow stage_quick

{
  echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv,noheader 2>&1 | head -n 4 || echo "no nvidia-smi"
  echo "plan: $total s of stages; files: $files"
} > "$OUT/summary.txt"
: > "$OUT/run.log"

cap_log() {  # a stage's log for run.log: its head and tail where it is long
  local n
  n=$(wc -l < "$1")
  if [ "$n" -le 400 ]; then
    cat "$1"
  else
    head -n 80 "$1"
    echo "... ($((n - 380)) lines left out) ..."
    tail -n 300 "$1"
  fi
}

stopped=""
while read -r name limit out; do
  [ -n "$name" ] && [ "${name:0:1}" != "#" ] || continue
  if [ -n "$stopped" ]; then
    printf '%-8s not run: %s\n' "$name" "$stopped" >> "$OUT/summary.txt"
    continue
  fi
  echo "== $name (limit ${limit} s): $(command_of "$name")"
  t0=$SECONDS
  timeout -s INT -k "$GRACE" "$((limit - GRACE))" bash -c "stage_$name" > "$WORK/$name.log" 2>&1
  rc=$?
  took=$((SECONDS - t0))
  if [ "$out" != - ]; then
    for f in ${out//,/ }; do
      [ -f "$WORK/$f" ] && mv -f "$WORK/$f" "$OUT/$f"
    done
  fi
  { echo "== $name: rc=$rc in ${took} s (limit ${limit} s)"; cap_log "$WORK/$name.log"; echo; } >> "$OUT/run.log"
  last=$(grep -v '^\s*$' "$WORK/$name.log" | tail -n 1 | cut -c1-110)
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && last="STOPPED AT ITS LIMIT; last: $last"
  printf '%-8s rc=%-3s %4s s of %-4s %s\n' "$name" "$rc" "$took" "$limit" "$last" >> "$OUT/summary.txt"
  for f in ${out//,/ }; do  # the key figures, as soon as they are there (no torch import: a second)
    case $f in
      *.json) [ -f "$OUT/$f" ] && "$PY" scripts/gpu_smoke.py --key-figures "$OUT/$f" 2>&1 | sed 's/^/    /' \
                >> "$OUT/summary.txt" ;;
    esac
  done
  tail -n 15 "$WORK/$name.log"
  [ "$name" = build ] && [ "$rc" != 0 ] && stopped="the build failed"
done <<< "$STAGES"

echo
echo "== summary ($OUT)"
cat "$OUT/summary.txt"
