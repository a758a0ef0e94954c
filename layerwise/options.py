"""Argument checks shared by the manager, configure and the device-budget
planner. Each one fails with an error that names the bad value, before
anything in the model changes."""
from __future__ import annotations

import math
from numbers import Integral, Real

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


def resolve_resident(resident_layers, num_layers: int, policy: str, group: str | None = None) -> list[int]:
    """Indices of the layers that stay on the device.

    An int counts layers, a float is a fraction of the group in [0, 1]. Both
    forms are treated alike: 0 / 0.0 nothing resident, `num_layers` / 1.0 every
    layer (then nothing streams: configure warns that streaming saves nothing),
    and more than the group holds (an int above its size, a fraction above 1)
    is every layer too, with a WARNING naming the group's size when `group` is
    given (configure's check; one setting may serve groups of several sizes)."""
    if policy not in ("leading", "strided"):
        raise ValueError(f"residency_policy must be 'leading' or 'strided', got {policy!r}")
    if isinstance(resident_layers, bool) or not isinstance(resident_layers, Real):
        raise TypeError(f"resident_layers must be an int (layers) or a fraction in [0, 1], got {resident_layers!r}")
    if isinstance(resident_layers, Integral):
        if resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {resident_layers}")
        over = resident_layers > num_layers
        r = min(int(resident_layers), num_layers)
    else:
        if not (math.isfinite(resident_layers) and resident_layers >= 0.0):
            raise ValueError(f"a fractional resident_layers must lie in [0, 1] (1.0: every layer resident), "
                             f"got {resident_layers}")
        over = resident_layers > 1.0
        r = num_layers if over else int(resident_layers * num_layers)
    if over and group is not None:
        import logging

        logging.getLogger("layerwise").warning(
            "layerwise: resident_layers=%r is more than layer group %r holds (%d layers): every layer of it is "
            "resident", resident_layers, group, num_layers)
    if r == 0:
        return []
    if policy == "leading":
        return list(range(r))
    return sorted({int(k * num_layers / r) for k in range(r)})


def as_number(x):
    """x as a Python int or float: ints, floats, numpy scalars and one-element
    tensors are numbers; bools, strings and sequences are not (None)."""
    if isinstance(x, (bool, str, bytes)):
        return None
    if isinstance(x, Integral):
        return int(x)
    if isinstance(x, Real):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.dtype.is_complex and x.dtype != torch.bool:
        return x.item()
    return None


def validate_bytes(name: str, value, accepted: str = "") -> int:
    """A finite number of bytes >= 0, as an int; else a ValueError naming `name`
    and what it accepts (`accepted`: the other forms, e.g. "'auto' or None")."""
    n = as_number(value)
    if n is None or not math.isfinite(n) or n < 0:
        other = f", {accepted}" if accepted else ""
        raise ValueError(f"{name} must be a finite number of bytes >= 0{other}, got {value!r}")
    return int(n)


def validate_count(name: str, value, minimum: int = 0, allow_none: bool = True, unit: str = ""):
    """An int >= minimum (or None where allowed); else a TypeError / ValueError naming `name`."""
    if value is None and allow_none:
        return None
    none = " or None" if allow_none else ""
    n = as_number(value)
    if not isinstance(n, int):
        raise TypeError(f"{name} must be an int >= {minimum}{unit}{none}, got {value!r}")
    if n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{unit}{none}, got {value!r}")
    return n


def validate_engine_options(num_copy_streams, debug_copy_delay_us, debug_read_delay_us) -> None:
    """The copy engine's and the reader's arguments (every front door)."""
    validate_count("num_copy_streams", num_copy_streams, 1, allow_none=False)
    validate_count("debug_copy_delay_us", debug_copy_delay_us, 0, unit=" (microseconds)")
    validate_count("debug_read_delay_us", debug_read_delay_us, 0, unit=" (microseconds)")


def validate_budget_margin(budget_margin) -> None:
    if budget_margin is not None:
        validate_bytes("budget_margin", budget_margin, "or None (10% of the device's memory)")


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


_THREADS_NOTED = []  # once per process


def note_cpu_threads(device: torch.device) -> None:
    """On a CPU device the copy engine's worker thread competes with torch's
    intra-op (OpenMP) threads for the cores. layerwise does not change torch's
    global thread count behind the caller's back: it says so once, at INFO, with
    the recommendation (README, "The CPU backend and torch's threads")."""
    import logging
    import os

    if device.type != "cpu" or _THREADS_NOTED:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    if cores > 1 and threads >= cores:
        _THREADS_NOTED.append(True)
        logging.getLogger("layerwise").info(
            "layerwise: device='cpu': torch uses %d intra-op threads on %d cores, and the copy worker competes with "
            "them (step times vary and may exceed resident ones). Recommended: torch.set_num_threads(%d) before "
            "running the model; layerwise leaves torch's thread count as it is", threads, cores, cores - 1)
