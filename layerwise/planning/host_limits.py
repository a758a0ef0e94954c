"""How much host memory this process may use and lock: the cgroup's memory limit
(v2 memory.max / v1 memory.limit_in_bytes, of the process's cgroup and its
ancestors), RLIMIT_MEMLOCK (unless the process has CAP_IPC_LOCK), and the
host's available memory, each less a reserve. psutil alone reports the
machine's RAM, not a container's limit. Used by the pipelines' pin budget and
the disk tier's host budget; `budget_memory_bytes` measures what a host budget
promises (the bench and the tests check the promise with it)."""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from layerwise.planning.device_budget import fmt_bytes

GiB = 1 << 30
RESERVE_FRACTION = 0.05  # of a memory limit, kept for everything else the process needs
RESERVE_MIN = 2 * GiB  # ... and at least this much of a cgroup's or the host's memory
_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a huge page-rounded number
_CAP_IPC_LOCK = 14
CGROUP_ROOT = "/sys/fs/cgroup"  # where the cgroup hierarchies are mounted (tests point these at fake files)
PROC_SELF = "/proc/self"


@dataclass
class HostLimit:
    """One bound on the host memory this process may pin."""

    source: str  # "cgroup", "memlock", "host"
    cap: int  # the limit itself (the cgroup's memory.max, RLIMIT_MEMLOCK, the host's RAM)
    room: int  # what is left of it for a host arena (weights about to be packed count as free)
    reserve: int  # kept back from the room
    where: str  # the file or call it was read from

    @property
    def budget(self) -> int:
        return max(0, self.room - self.reserve)

    def describe(self) -> str:
        return (f"{self.source} {fmt_bytes(self.cap)} ({self.where}): {fmt_bytes(self.room)} free for arenas, "
                f"less a reserve of {fmt_bytes(self.reserve)}")


@dataclass
class PinBudget:
    bytes: int
    limits: list  # every HostLimit that was read; the tightest decides
    auto: bool

    @property
    def source(self) -> str:
        if not self.auto:
            return "given"
        tight = min(self.limits, key=lambda lim: lim.budget)
        return f"auto: {tight.describe()}"


def _read_limit(path: str) -> int | None:
    """A memory limit file: bytes, or None for no limit (or no such file)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _cgroup_dirs(cgroup_root: str, proc_self: str) -> list[tuple[str, str, str]]:
    """(directory, limit file, usage file) of every cgroup whose memory limit applies
    to this process: its own cgroup and each ancestor, in the v2 hierarchy and the
    v1 memory hierarchy, as far as they are visible under `cgroup_root`. The root
    itself is always a candidate (in a container, /sys/fs/cgroup is usually the
    container's own cgroup, whatever /proc/self/cgroup says)."""
    own = {"v2": "/", "v1": "/"}
    try:
        with open(os.path.join(proc_self, "cgroup")) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                hid, controllers, path = parts
                if hid == "0" and controllers == "":
                    own["v2"] = path or "/"
                elif "memory" in controllers.split(","):
                    own["v1"] = path or "/"
    except OSError:
        pass
    out: list[tuple[str, str, str]] = []
    for version, base, limit, usage in (("v2", cgroup_root, "memory.max", "memory.current"),
                                        ("v1", os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes",
                                         "memory.usage_in_bytes")):
        parts = [p for p in own[version].split("/") if p and p not in (".", "..")]
        for k in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:k])
            if os.path.isfile(os.path.join(d, limit)) and d not in [o[0] for o in out]:
                out.append((d, limit, usage))
    return out


def _proc_status(proc_self: str) -> dict:
    out = {}
    try:
        with open(os.path.join(proc_self, "status")) as f:
            for line in f:
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def _memlock_limit(proc_self: str) -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes (None: unlimited), from <proc_self>/limits,
    else resource.getrlimit."""
    try:
        with open(os.path.join(proc_self, "limits")) as f:
            for line in f:
                if line.startswith("Max locked memory"):
                    soft = line[len("Max locked memory"):].split()[0]
                    return None if soft == "unlimited" else int(soft)
    except (OSError, ValueError, IndexError):
        pass
    soft_limit, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft_limit == resource.RLIM_INFINITY else int(soft_limit)


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of the host's memory, as psutil sees them."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def host_limits(held_bytes: int = 0, cgroup_root: str | None = None, proc_self: str | None = None,
                lock: bool = True) -> list[HostLimit]:
    """Every bound on the host memory this process may fill (lock=True: and pin).

    `held_bytes`: bytes of weights the process holds now that an arena will
    replace (they are freed as they are packed), counted as free.

    - cgroup: the tightest memory limit of this process's cgroup or an ancestor
      (v2 memory.max less memory.current, v1 memory.limit_in_bytes less
      memory.usage_in_bytes), reserve max(5%, 2 GiB) of the limit;
    - memlock (lock=True): RLIMIT_MEMLOCK less what is locked already (VmLck),
      reserve 5%; absent when the limit is unlimited or the process has
      CAP_IPC_LOCK (root usually has), which is not bound by it;
    - host: psutil's available memory, reserve max(5%, 2 GiB) of the RAM.

    `cgroup_root` / `proc_self` default to CGROUP_ROOT / PROC_SELF.
    """
    cgroup_root = CGROUP_ROOT if cgroup_root is None else cgroup_root
    proc_self = PROC_SELF if proc_self is None else proc_self
    limits = []
    best = None
    for d, limit_file, usage_file in _cgroup_dirs(cgroup_root, proc_self):
        cap = _read_limit(os.path.join(d, limit_file))
        if cap is None:
            continue
        usage = _read_limit(os.path.join(d, usage_file)) or 0
        room = max(0, cap - usage) + held_bytes
        lim = HostLimit("cgroup", cap, room, max(int(RESERVE_FRACTION * cap), RESERVE_MIN),
                        os.path.join(d, limit_file))
        if best is None or lim.budget < best.budget:
            best = lim
    if best is not None:
        limits.append(best)
    if lock:
        status = _proc_status(proc_self)
        try:
            cap_ipc_lock = bool(int(status.get("CapEff", "0"), 16) >> _CAP_IPC_LOCK & 1)
        except ValueError:
            cap_ipc_lock = False
        soft = _memlock_limit(proc_self)
        if soft is not None and not cap_ipc_lock:
            locked = int(status.get("VmLck", "0 kB").split()[0]) * 1024
            limits.append(HostLimit("memlock", soft, max(0, soft - locked), int(RESERVE_FRACTION * soft),
                                    "RLIMIT_MEMLOCK"))
    available, total = _host_memory()
    limits.append(HostLimit("host", total, available + held_bytes, max(int(RESERVE_FRACTION * total), RESERVE_MIN),
                            "psutil: the host's RAM, its available memory free"))
    return limits


def pinnable_host_bytes(held_bytes: int = 0, cgroup_root: str | None = None,
                        proc_self: str | None = None) -> PinBudget:
    """What `pin_budget="auto"` resolves to: the tightest of host_limits(), each
    less its reserve."""
    limits = host_limits(held_bytes, cgroup_root, proc_self, lock=True)
    return PinBudget(min(lim.budget for lim in limits), limits, auto=True)



# ------------------------------------------------------------ what a host budget measures
# A host budget is a promise about the process's memory (docs/design.md, "Pitfalls"): the
# anonymous and shared-memory pages it holds (RssAnon + RssShmem of /proc/self/status:
# smaps_rollup's Shared_* would count a forked child's copy-on-write pages twice) and
# the page cache of the files it streams from (checkpoint, spill files), which a
# cgroup charges to it too. Code pages of libraries are not weights and do not count.

def anon_shmem_bytes(proc_self: str | None = None) -> int:
    """RssAnon + RssShmem of the process, in bytes."""
    status = _proc_status(PROC_SELF if proc_self is None else proc_self)
    return sum(int(status.get(key, "0 kB").split()[0]) * 1024 for key in ("RssAnon", "RssShmem"))


def resident_file_bytes(path) -> int:
    """The bytes of `path` in the page cache: mincore over a mapping of the file that
    is never touched, so it adds nothing; 0 for a file that is gone or empty."""
    import ctypes
    import mmap

    from layerwise import contract  # (imported here: this module sits below it)

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = -1
    try:
        try:
            with contract.defer_interrupts():  # held until the `finally` would close it
                fd = os.open(os.fsdecode(path), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return 0
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        with contract.defer_interrupts():  # mapped, looked at and unmapped as one step
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            finally:
                libc.munmap(addr, size)
        import numpy

        return int((numpy.frombuffer(vec.raw, numpy.uint8) & 1).sum()) * mmap.PAGESIZE  # (bit 0: resident)
    finally:
        if fd >= 0:
            os.close(fd)


def budget_memory_bytes(files=()) -> int:
    """What a host budget counts: anon_shmem_bytes() + resident_file_bytes(f) for each file."""
    return anon_shmem_bytes() + sum(resident_file_bytes(f) for f in files)


def _hwm_bytes() -> int:
    return int(_proc_status(PROC_SELF).get("VmHWM", "0 kB").split()[0]) * 1024


class MemoryMeter:
    """What a host budget counts, over a `with` block: growth of budget_memory_bytes()
    from its start, sampled every `interval` seconds on a thread (a sample can miss a
    peak, never invent one), and the peak RSS growth (VmHWM: the exact peak of the
    process's own pages, but it counts code pages mapped on the way too: warm up
    first; the page cache of the files is only in the samples).

    `files()`: the paths whose page cache counts (the checkpoint, the spill files
    there are at the time). After the block: `.peak` (sampled), `.end`, `.hwm`,
    `.files_peak`, `.files_end` (bytes) and `.worst`, the larger of peak and hwm."""

    def __init__(self, files=lambda: (), interval: float = 0.005):
        self.files, self.interval = files, interval
        self.peak = self.end = self.hwm = self.files_peak = self.files_end = 0

    def _files(self) -> int:
        return sum(resident_file_bytes(f) for f in self.files())

    def _sample(self) -> None:
        while True:
            files = self._files()
            self.files_peak = max(self.files_peak, files - self._files0)
            self.peak = max(self.peak, anon_shmem_bytes() + files - self._base)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> MemoryMeter:
        import threading

        self._files0 = self._files()
        self._base = anon_shmem_bytes() + self._files0
        self._hwm0 = _hwm_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="layerwise-memory-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.files_end = self._files()
        self.end = anon_shmem_bytes() + self.files_end - self._base
        self.hwm = _hwm_bytes() - self._hwm0
        self.peak = max(self.peak, self.end)

    @property
    def worst(self) -> int:
        return max(self.peak, self.hwm)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("peak", "end", "hwm", "files_peak", "files_end", "worst")}
