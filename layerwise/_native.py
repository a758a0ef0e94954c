"""The one module that imports the compiled extension layerwise._C."""
from __future__ import annotations

import torch

try:
    from . import _C
except ImportError as e:  # pragma: no cover - exercised by hand on a broken install
    raise ImportError(
        "layerwise's native extension (layerwise._C) is not built or does not load: "
        f"{e}. Build it from the repository root with `make build` (or "
        "`pip install --no-build-isolation -e .`; LAYERWISE_BUILD=cpu|cuda picks the variant)."
    ) from e

HostArena = _C.HostArena
CopyEngine = _C.CopyEngine
Event = _C.Event


def build_info() -> dict:
    """What this build of layerwise is: CUDA or CPU only, and the versions involved."""
    info = dict(_C.build_info())
    info["torch_version"] = torch.__version__
    info["torch_cuda_version"] = torch.version.cuda
    info["cuda_devices"] = _C.cuda_device_count()
    return info


def current_stream_handle(device: torch.device) -> int:
    """torch's current compute stream on `device` as a raw handle (0 on CPU)."""
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return 0
