#!/usr/bin/env bash
# Idempotent set-up for `make test` / `make bench`: a .venv that reuses an
# importable torch (system site-packages) or installs one, plus what the tests
# and benchmark import. Re-running it when everything is there costs ~2 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_SPEC=${LAYERWISE_TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV (reusing the system's packages where importable)"
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"

if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: no importable torch; installing $TORCH_SPEC"
  "$VPY" -m pip install -q "$TORCH_SPEC"
fi

need=()
for mod_pkg in triton:triton pybind11:pybind11 ninja:ninja pytest:pytest numpy:numpy safetensors:safetensors \
               tqdm:tqdm psutil:psutil matplotlib:matplotlib rich:rich setuptools:setuptools wheel:wheel \
               diffusers:diffusers transformers:transformers accelerate:accelerate; do
  mod=${mod_pkg%%:*}; pkg=${mod_pkg##*:}
  "$VPY" -c "import $mod" 2>/dev/null || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  "$VPY" -m pip install -q "${need[@]}"
fi
