#!/usr/bin/env bash
# One-shot check on a machine with a CUDA GPU and no network:
#   scripts/gpu_check.sh RESULTS_DIR
# builds the CUDA variant with the python3 found there, runs every test (the
# CUDA variants included), runs the full GPU benchmark, writes logs, JSON, the
# plot and a Markdown table into RESULTS_DIR (7 files) and prints a short
# summary last. Stage limits add up to 580 s.
# Python packages missing there (diffusers, for its baselines and real-model
# tests) can travel as wheels in .whl/ (see the device tool's README).
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
  status+=("$(printf '%-6s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-100)")")
  return $rc
}

build() {
  if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return
  fi
  LAYERWISE_BUILD=cuda "$PY" -m pip install --no-build-isolation --no-deps --no-index -q -e . || return
  "$PY" -c "import layerwise, json; print(json.dumps(layerwise.build_info()))"
}
export -f build  # `timeout` runs programs, not shell functions: stage runs it through bash -c
export PY PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
  > "$OUT/gpu.txt" 2>&1 || true
stage build 150 bash -c build
stage tests 150 "$PY" -m pytest -q -rfE -p no:cacheprovider tests
stage bench 280 "$PY" -m layerwise.bench --device cuda --json "$OUT/bench.json" --plot "$OUT/stream.png" \
  --markdown "$OUT/bench.md"

echo
echo "== summary ($(tail -n 1 "$OUT/gpu.txt"))"
printf '%s\n' "${status[@]}"
