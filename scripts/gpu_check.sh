#!/usr/bin/env bash
# One-shot check on a machine with a CUDA GPU and no network:
#   scripts/gpu_check.sh RESULTS_DIR
# builds the CUDA variant with the python3 found there, runs every test (the
# CUDA variants included), runs the full GPU benchmark, writes logs and JSON
# into RESULTS_DIR and prints a short table last. Budget: under 8 minutes.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh RESULTS_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=()

stage() {  # stage NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, remember the outcome
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  status+=("$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")")
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
  > "$OUT/gpu.txt" 2>&1 || true
stage build 180 env LAYERWISE_BUILD=cuda "$PY" -m pip install --no-build-isolation --no-deps --no-index -q -e . \
  && stage info 60 "$PY" -c "import layerwise, json; print(json.dumps(layerwise.build_info()))"
stage tests 240 "$PY" -m pytest -q -x -p no:cacheprovider --junitxml="$OUT/tests.xml" tests
stage bench 300 "$PY" -m layerwise.bench --device cuda --json "$OUT/bench.json" --plot "$OUT/stream.png" --markdown "$OUT/bench.md"

echo
echo "== summary ($(head -n 2 "$OUT/gpu.txt" | tail -n 1))"
printf '%s\n' "${status[@]}"
