"""Checks, made before anything is packed, that a CUDA device's paths can run
here: a missing piece found at configure is an error that says what to do, not
a failure in the first forward's hook with the model half set up.

check_decode_path runs in the options validation (OffloadOptions.build), at
every front door; stream_capturing in every pre-hook of a CUDA group (a captured
step takes the capture path: runtime/capture.py).
"""
from __future__ import annotations

import os
import re
import sys

import torch

# The decode kernel (layerwise.triton_kernels.decode) is written for Triton 3.6 and later.
MIN_TRITON = (3, 6)
# Values of TRITON_INTERPRET that Triton reads as "on" (its env_bool knob).
_ON = ("1", "true", "yes", "on", "y")


def _version(text: str) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_unusable() -> str | None:
    """Why layerwise cannot stream to a CUDA device in this process, or None. The
    causes are checked in the order a user fixes them: torch itself first (a
    rebuilt extension would not help a CPU-only torch or a machine with no GPU
    visible), then layerwise's own build."""
    from layerwise import _native

    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build: it cannot use a GPU. Install a CUDA "
                "build of torch (https://pytorch.org/get-started/locally/), then build layerwise with "
                "LAYERWISE_BUILD=cuda; or pass device='cpu'")
    if not torch.cuda.is_available():
        return (f"torch (built with CUDA {torch.version.cuda}) sees no GPU: torch.cuda.is_available() is False "
                "(no device visible: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES); or pass "
                "device='cpu'")
    if not _native.build_info()["with_cuda"]:
        return ("torch can use the GPU, but this build of layerwise has no CUDA backend: rebuild it with "
                "LAYERWISE_BUILD=cuda (`LAYERWISE_BUILD=cuda pip install --no-build-isolation -e .`)")
    return None


def check_decode_path(device) -> None:
    """Raise RuntimeError unless compress="lossless" can decode on `device`: on a
    CUDA device the Triton decode kernel must be compiled for the GPU, which needs
    triton >= 3.6 importable and TRITON_INTERPRET off (the interpreter runs kernels
    on host tensors only). On any other device it does nothing: the C++ decoder
    runs on the copy engine's worker threads."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    what = f'compress="lossless" on {device} decodes each layer with a Triton kernel on the GPU'
    interpret = os.environ.get("TRITON_INTERPRET", "")
    if interpret.strip().lower() in _ON:
        raise RuntimeError(
            f"layerwise: {what}, but TRITON_INTERPRET={interpret!r} is set in this process: Triton would run "
            "the kernel in its CPU interpreter, which takes host tensors only. Unset TRITON_INTERPRET before "
            "Python starts (`unset TRITON_INTERPRET`; Triton reads it when a kernel is defined), or pass "
            "compress=None.")
    decode = sys.modules.get("layerwise.triton_kernels.decode")
    if decode is not None and getattr(decode, "_INTERPRET", False):
        raise RuntimeError(
            f"layerwise: {what}, but layerwise.triton_kernels.decode was imported while TRITON_INTERPRET=1 was "
            "set, so its kernel stays interpreted (host tensors only) in this process. Start the process "
            "without TRITON_INTERPRET, or pass compress=None.")
    need = ".".join(map(str, MIN_TRITON))
    try:
        import triton
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install that fails on import
        raise RuntimeError(
            f"layerwise: {what}, which needs triton >= {need}, but `import triton` failed "
            f"({type(e).__name__}: {e}). Install it (`pip install 'triton>={need}'`, the version your torch "
            "build pairs with), or pass compress=None.") from None
    have = getattr(triton, "__version__", "")
    version = _version(have)
    if version is None or version < MIN_TRITON:
        raise RuntimeError(
            f"layerwise: {what}, which needs triton >= {need}; this process has triton {have or '(no version)'} "
            f"from {getattr(triton, '__file__', '?')}. Upgrade it (`pip install 'triton>={need}'`), or pass "
            "compress=None.")


def stream_capturing(device: torch.device) -> bool:
    """The current stream of `device` (which need not be the current device) is capturing."""
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()
