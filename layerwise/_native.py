"""The one module that imports the compiled extension layerwise._C."""
from __future__ import annotations

import atexit
import threading
import warnings

import torch

try:
    from layerwise import _C
except ImportError as e:  # pragma: no cover - exercised by hand on a broken install
    raise ImportError(
        "layerwise's native extension (layerwise._C) is not built or does not load: "
        f"{e}. Build it from the repository root with `make build` (or "
        "`pip install --no-build-isolation -e .`; LAYERWISE_BUILD=cpu|cuda picks the variant)."
    ) from e

HostArena = _C.HostArena
CopyEngine = _C.CopyEngine
Event = _C.Event
Reader = _C.Reader
ReadError = _C.ReadError
codec = _C.codec  # lossless codec of float segments (csrc/codec.h); layerwise/codec/__init__.py wraps it
sim_bus = _C.sim_bus  # the CPU backend's simulated bus as the copy engines read it (csrc/sim_bus.h; the bench)
host_event = _C.host_event  # an event a host thread completes (a split gather on a CPU device)

# Copy worker threads (and disk reader threads) must be finished and joined while the interpreter is still
# whole: a thread that outlives it is ended mid-way by finalisation (SIGABRT,
# "terminate called without an active exception"). atexit handlers run before
# finalisation, and in reverse order of registration: this one runs before
# torch's own.
atexit.register(_C.shutdown_all)


class LayerwisePinningWarning(UserWarning):
    """Host memory asked to be pinned (pin_memory=True) stayed pageable."""


_pin_warned: set[str] = set()
_pin_warned_lock = threading.Lock()


def warn_unpinned(arena, what: str) -> bool:
    """Warn, once per process and reason, when `arena` was asked to be pinned and
    is not. `what` names what the arena holds (a layer group). True if it warned."""
    reason = arena.pin_error
    if not reason:
        return False
    with _pin_warned_lock:
        if reason in _pin_warned:
            return False
        _pin_warned.add(reason)
    warnings.warn(
        f"layerwise: the host memory of {what} ({arena.capacity / 2**20:.1f} MiB) could not be pinned and stays "
        f"pageable: {reason}. Copies to the device from pageable memory run at about half the bandwidth of pinned "
        "memory, and on CUDA they block the host, so copies and compute no longer overlap. To pin it, raise the "
        "locked-memory limit (`ulimit -l unlimited`, or memlock in /etc/security/limits.conf or the container's "
        "--ulimit memlock=-1) or grant the process CAP_IPC_LOCK; to choose pageable memory and silence this, pass "
        "pin_memory=False.",
        LayerwisePinningWarning,
        stacklevel=2,
    )
    return True


def check_pinned(arena, pin_memory, what: str, warn: bool = True) -> None:
    """The pinning policy, for every host buffer a group copies from (its arena,
    encoded blocks, shares, disk staging): with pin_memory=True a buffer that could
    not be pinned is an error naming the way out; with "auto" it stays pageable
    with a warning (warn_unpinned); with False nothing was asked."""
    if not arena.pin_error:
        return
    if pin_memory is True:
        raise RuntimeError(
            f"layerwise: pin_memory=True, but the host memory of {what} could not be pinned: {arena.pin_error}. "
            "Raise the locked-memory limit or grant CAP_IPC_LOCK, or pass pin_memory='auto' (pinned where "
            "possible, else pageable with a warning) or pin_memory=False.")
    if pin_memory == "auto" and warn:
        warn_unpinned(arena, what)


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


def dedicated_cuda_stream(device: torch.device) -> "torch.cuda.ExternalStream":
    """A CUDA stream on `device` that nothing else is handed: ``torch.cuda.Stream()``
    takes one of a pool of 32 per device and priority, round-robin (c10's "stream
    pool note"), so the model or another library may hold the same stream, and work
    on it would queue behind theirs. This one is a copy engine's own stream
    (cudaStreamCreateWithFlags, non-blocking), wrapped for torch; the engine, which
    destroys it, lives as long as the returned object."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    owner = CopyEngine(f"cuda:{index}")
    stream = torch.cuda.ExternalStream(owner.stream_handle(0), device=torch.device("cuda", index))
    stream.layerwise_owner = owner  # (keeps the engine, and so the stream, alive)
    return stream
