"""Argument checks shared by the manager, configure and the device-budget
planner. Each one fails with an error that names the bad value, before
anything in the model changes."""
from __future__ import annotations

from numbers import Real

import torch

from . import _native


def default_device() -> torch.device:
    if _native.build_info()["with_cuda"] and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device) -> torch.device:
    """A torch.device that this build can stream to, or a clear error."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device: {e}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {device!r}: layerwise streams to 'cpu' or 'cuda[:N]', not {dev.type!r}")
    if not _native.build_info()["with_cuda"]:
        raise RuntimeError(
            f"device {device!r}: this build of layerwise has no CUDA backend; rebuild with LAYERWISE_BUILD=cuda"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = dev.index if dev.index is not None else (torch.cuda.current_device() if count else 0)
    if index >= count:
        raise RuntimeError(f"device {device!r} does not exist: {count} CUDA device(s) visible")
    return torch.device("cuda", index)


def resolve_resident(resident_layers, num_layers: int, policy: str) -> list[int]:
    """Indices of the layers that stay on the device."""
    if policy not in ("leading", "strided"):
        raise ValueError(f"residency_policy must be 'leading' or 'strided', got {policy!r}")
    if isinstance(resident_layers, bool) or not isinstance(resident_layers, Real):
        raise TypeError(f"resident_layers must be an int or a fraction in [0, 1), got {resident_layers!r}")
    if isinstance(resident_layers, int):
        if resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {resident_layers}")
        r = min(resident_layers, num_layers)
    else:
        if not 0.0 <= resident_layers < 1.0:
            raise ValueError(f"a fractional resident_layers must lie in [0, 1), got {resident_layers}")
        r = int(resident_layers * num_layers)
    if r == 0:
        return []
    if policy == "leading":
        return list(range(r))
    return sorted({int(k * num_layers / r) for k in range(r)})


def validate_depth(prefetch_depth) -> int:
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int):
        raise TypeError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
    return prefetch_depth


def validate_compress(compress):
    """None (layers travel as they are) or "lossless" (bf16/fp16 segments travel
    encoded, layerwise/codec.py)."""
    if compress is not None and not (isinstance(compress, str) and compress == "lossless"):
        raise ValueError(f"compress must be None or 'lossless' (bf16/fp16 weights cross the bus losslessly "
                         f"encoded), got {compress!r}")
    return compress
