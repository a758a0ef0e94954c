"""OffloadOptions: every streaming option, validated once.

Each front door (configure_layerwise_offload, LayerwiseOffloadManager,
load_offloaded, offload_pipeline) builds one OffloadOptions from its arguments
before anything in the model changes (OffloadOptions.build), and hands it to
everything below it; nothing below validates or interprets an option again. A
bad value fails with an error that names the option and the value.

Defaults live in the fields of OffloadOptions. The front doors' signatures
repeat them, so that inspect.signature, help() and an IDE show each keyword with
its default (a signature generated from the fields would show only to
inspect.signature, not to an IDE reading the source); tests/test_options.py
checks that every door's defaults are the fields' own. A default that follows
from other values (disk_prefetch_depth's, budget_margin's, an expert_cache="auto"
size) is computed here too, once (disk_staging_slots, budget_margin_bytes,
auto_expert_cache_bytes), and read from the options below.

The checks below are the building blocks that build() calls; resolve_resident
and the budget planners take values already validated here.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import cast

import torch

from layerwise import _native


@dataclass(frozen=True)
class OffloadOptions:
    """The streaming options of one configure (every group, every component).

    Build it with OffloadOptions.build(**options), which validates every field
    and normalises it (the device resolved, numbers of bytes and counts as
    ints); the constructor itself takes values as they are. A changed copy:
    dataclasses.replace(options, pin_memory=False) (not validated again: the
    change is a planner's, from valid values)."""

    device: torch.device  # resolved: cpu, or cuda:N
    prefetch_depth: int = 1
    resident_layers: int | float = 0  # layers (int) or a fraction of each group (float in [0, 1])
    residency_policy: str = "leading"  # "leading" | "strided"
    pin_memory: bool | str = "auto"  # True | False | "auto"
    device_budget: int | str | None = None  # bytes | "auto" | None
    budget_margin: int | None = None  # bytes kept free with device_budget="auto" (None: 10% of the device)
    num_copy_streams: int = 1
    debug_copy_delay_us: int | None = None
    debug_read_delay_us: int | None = None
    measure_stalls: bool = True
    compress: str | None = None  # None | "lossless"
    host_budget: int | str | None = None  # bytes | "auto" | None
    spill_dir: str | None = None  # a writable directory (needs host_budget)
    disk_prefetch_depth: int | None = None  # staging slots of the disk tier (None: prefetch_depth + 1, >= 2)
    split_fetch: object = field(default=None, compare=False)  # a torch.distributed ProcessGroup, or None
    # "all" | "routed": only the experts the router picked cross the bus (layerwise/planning/experts.py)
    experts: str = "all"
    expert_modules: object = field(default=None, compare=False)  # None | (names in a layer) | predicate(name, module)
    expert_cache: int | str | None = None  # bytes | "auto" | None: device cache of recently used experts
    expert_prefetch: bool = False  # copy the experts each MoE layer used last, while the one before computes
    # False | True | a key string: the streamed layers' host blocks live in one arena per machine, packed by
    # the first process and mapped by the others (docs/share-host.md). A string asserts the weights' identity.
    share_host: bool | str = False
    # Threads that call the model at once share each layer's fetch (runtime/cohort.py, docs/cohort.md).
    share_calls: bool = True

    @classmethod
    def build(cls, *, caller: str = "OffloadOptions.build", also: tuple = (), **options) -> OffloadOptions:
        """Every option validated, once. Options not given take the defaults above
        (device: the default device, layerwise.options.default_device). An unknown
        name is a TypeError that names it and lists the options `caller` takes (the
        streaming options, and `also`: the caller's own)."""
        unknown = sorted(k for k in options if k not in OPTION_NAMES)
        if unknown:
            raise TypeError(f"{caller} got unexpected option(s) {unknown}; it takes {[*OPTION_NAMES, *also]}")
        v = {**DEFAULTS, **options}  # validated and normalised in place, in field order
        v["device"] = resolve_device(v["device"])
        v["prefetch_depth"] = validate_depth(v["prefetch_depth"])
        v["resident_layers"] = validate_residency(v["resident_layers"], v["residency_policy"])
        v["pin_memory"] = validate_pin_memory(v["pin_memory"])
        v["device_budget"], v["budget_margin"] = validate_device_budget(v["device_budget"], v["budget_margin"])
        check_explicit_residency(v["device_budget"], v["resident_layers"])
        v["num_copy_streams"], v["debug_copy_delay_us"], v["debug_read_delay_us"] = validate_engine_options(
            v["num_copy_streams"], v["debug_copy_delay_us"], v["debug_read_delay_us"])
        check_debug_delay_device(v["device"], v["debug_copy_delay_us"])
        v["measure_stalls"] = validate_flag("measure_stalls", v["measure_stalls"])
        v["compress"] = validate_compress(v["compress"])
        if v["compress"] is not None:  # the decode path of this device, checked now (CUDA: Triton on the GPU)
            from layerwise.runtime.gpu_checks import check_decode_path

            check_decode_path(v["device"])
        v["host_budget"], v["spill_dir"], v["disk_prefetch_depth"] = check_disk_options(
            v["host_budget"], v["spill_dir"], v["disk_prefetch_depth"])
        v["split_fetch"] = validate_split_fetch(v["split_fetch"])
        v["experts"], v["expert_modules"], v["expert_cache"], v["expert_prefetch"] = validate_experts(v)
        v["share_host"] = validate_share_host(v["share_host"], v["split_fetch"])
        v["share_calls"] = validate_flag("share_calls", v["share_calls"])
        return cls(**v)

    @property
    def disk_staging_slots(self) -> int:
        """The disk stage's staging slots: disk_prefetch_depth, or (None) one more than
        the ring reads ahead, at least 2. Read from a group's own options, whose
        prefetch_depth is the one the device budget's planner chose."""
        if self.disk_prefetch_depth is not None:
            return self.disk_prefetch_depth
        return max(2, self.prefetch_depth + 1)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(OffloadOptions))
DEFAULTS = {f.name: None if f.default is dataclasses.MISSING else f.default  # (device: None, the default device)
            for f in dataclasses.fields(OffloadOptions)}


def named_options(arguments: dict) -> dict:
    """The streaming options among a front door's arguments (its `locals()`)."""
    return {k: arguments[k] for k in OPTION_NAMES if k in arguments}


def _is_default(name: str, value) -> bool:
    default = DEFAULTS[name]
    return value is default or (type(value) is type(default) and value == default)


def manager_options(options, keywords: dict, initialize: bool) -> OffloadOptions:
    """LayerwiseOffloadManager's options: `options` as given (then no keyword may
    be given too) or built from its keywords."""
    if options is None:
        return OffloadOptions.build(caller="LayerwiseOffloadManager", **keywords)
    if not isinstance(options, OffloadOptions):
        raise TypeError(f"options must be an OffloadOptions (OffloadOptions.build(...)) or None, "
                        f"got {type(options).__name__}")
    both = [k for k, v in keywords.items() if not _is_default(k, v)]
    if both:
        raise TypeError(f"LayerwiseOffloadManager got options= and the option keyword(s) {both} too: pass them "
                        f"in the options (dataclasses.replace(options, ...)) or pass only keywords")
    planned = [k for k in ("device_budget", "host_budget") if getattr(options, k) is not None]
    if initialize and planned:
        raise ValueError(f"LayerwiseOffloadManager(initialize=True) streams one group as configured and plans "
                         f"no budget, but options has {', '.join(f'{k}={getattr(options, k)!r}' for k in planned)}: "
                         "use configure_layerwise_offload, which plans them")
    return options


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
    from layerwise.runtime.gpu_checks import cuda_unusable

    why = cuda_unusable()
    if why is not None:
        raise RuntimeError(f"device {device!r}: {why}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = dev.index if dev.index is not None else (torch.cuda.current_device() if count else 0)
    if index >= count:
        raise RuntimeError(f"device {device!r} does not exist: {count} CUDA device(s) visible")
    return torch.device("cuda", index)


def validate_residency(resident_layers, policy, name: str = "resident_layers"):
    """resident_layers: an int >= 0 (layers) or a fraction >= 0 (a fraction above 1,
    like an int above a group's size, is every layer: resolve_resident warns);
    policy: "leading" or "strided". Returns resident_layers as an int or a float.
    `name`: the caller's name for the argument, in the errors (set_residency's `resident`)."""
    if policy not in ("leading", "strided"):
        raise ValueError(f"residency_policy must be 'leading' or 'strided', got {policy!r}")
    if isinstance(resident_layers, bool) or not isinstance(resident_layers, Real):
        raise TypeError(f"{name} must be an int (layers) or a fraction in [0, 1], got {resident_layers!r}")
    if isinstance(resident_layers, Integral):
        if resident_layers < 0:
            raise ValueError(f"{name} must be >= 0, got {resident_layers}")
        return int(resident_layers)
    # cast: typeshed's numbers.Real declares no __ge__, yet every Real compares with a float
    if not (math.isfinite(resident_layers) and cast(float, resident_layers) >= 0.0):
        raise ValueError(f"a fractional {name} must lie in [0, 1] (1.0: every layer resident), "
                         f"got {resident_layers}")
    return float(resident_layers)


def resolve_resident(resident_layers, num_layers: int, policy: str, group: str | None = None,
                     name: str = "resident_layers") -> list[int]:
    """Indices of the layers that stay on the device (`resident_layers` and
    `policy` as validate_residency accepts them).

    An int counts layers, a float is a fraction of the group in [0, 1]. Both
    forms are treated alike: 0 / 0.0 nothing resident, `num_layers` / 1.0 every
    layer (then nothing streams: configure warns that streaming saves nothing),
    and more than the group holds (an int above its size, a fraction above 1)
    is every layer too, with a WARNING naming the group's size when `group` is
    given (configure's check, and set_residency's; one setting may serve groups of
    several sizes). `name`: the caller's name for the argument, in the warning."""
    if isinstance(resident_layers, Integral):
        count = int(resident_layers)  # exact for an Integral
        over = count > num_layers
        r = min(count, num_layers)
    else:
        over = resident_layers > 1.0
        r = num_layers if over else int(resident_layers * num_layers)
    if over and group is not None:
        import logging

        logging.getLogger("layerwise").warning(
            "layerwise: %s=%r is more than layer group %r holds (%d layers): every layer of it is "
            "resident", name, resident_layers, group, num_layers)
    if r == 0:
        return []
    if policy == "leading":
        return list(range(r))
    return sorted({int(k * num_layers / r) for k in range(r)})


def resident_arg(resident):
    """set_residency's `resident` in plain Python types: a 1-D integer array or tensor
    of layer indices, or any other iterable of them (a generator, dict keys), becomes
    a list; numpy and 0-D tensor integers become ints (inside a list too). Bools and
    float or bool arrays are refused with a TypeError naming `resident=` (an index
    must be an integer: a float array is not a fraction, a bool one not a mask)."""
    import sys

    np = sys.modules.get("numpy")  # (an ndarray exists only where numpy was imported)
    if isinstance(resident, torch.Tensor) or (np is not None and isinstance(resident, (np.ndarray, np.generic))):
        kind = "tensor" if isinstance(resident, torch.Tensor) else "numpy value"
        dtype = resident.dtype
        integral = (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
                    if isinstance(resident, torch.Tensor) else np.issubdtype(dtype, np.integer))
        if resident.ndim == 0 and not integral and kind == "numpy value" and np.issubdtype(dtype, np.floating):
            return float(resident)  # np.float64(0.5): a fraction, as configure takes it
        if not integral or resident.ndim > 1:
            raise TypeError(
                f"set_residency(resident=...): a {resident.ndim}-D {dtype} {kind} is not layer indices: pass the "
                "indices as integers (a 1-D integer array or tensor, or a list), a count as an int, or a fraction "
                f"of the group as a Python float; got {resident!r}")
        return int(resident) if resident.ndim == 0 else [int(i) for i in resident.tolist()]
    if isinstance(resident, bool):
        raise TypeError(f"set_residency(resident=...): a bool is not a layer count or indices, got {resident!r}")
    if isinstance(resident, (str, bytes)) or not isinstance(resident, Iterable):
        return resident
    out = []
    for i in resident:
        if isinstance(i, torch.Tensor) or (np is not None and isinstance(i, (np.ndarray, np.generic))):
            i = resident_arg(i)
            if not isinstance(i, int):  # (a float scalar or an array inside the list)
                raise TypeError(f"set_residency(resident=...): layer indices must be integers, got {i!r} among "
                                f"{resident!r}")
        elif isinstance(i, bool):
            raise TypeError(f"set_residency(resident=...): layer indices must be integers, not bools (a mask is "
                            f"not taken: pass the indices of the resident layers), got {resident!r}")
        out.append(i)
    return out


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


# Each copy stream is a worker thread per group on the CPU backend (a CUDA stream on a GPU);
# one bus gains nothing from many more than a few, and thousands of threads exhaust the process.
MAX_COPY_STREAMS = 16
# The test-mode delays are per copy / per read, at random up to this; the engine and the
# reader take no more (kMaxDebugDelayUs, csrc/bindings.cpp): beyond it a test only hangs.
MAX_DEBUG_DELAY_US = 1_000_000


def _check_range(name: str, value, low: int, high: int, unit: str = "") -> None:
    if value is not None and not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}]{unit}, got {value!r}")


def validate_engine_options(num_copy_streams, debug_copy_delay_us, debug_read_delay_us) -> tuple:
    """The copy engine's and the reader's arguments, as ints (the delays: or None),
    within the ranges the native side takes (MAX_COPY_STREAMS, MAX_DEBUG_DELAY_US)."""
    streams = validate_count("num_copy_streams", num_copy_streams, 1, allow_none=False)
    copy_delay = validate_count("debug_copy_delay_us", debug_copy_delay_us, 0, unit=" (microseconds)")
    read_delay = validate_count("debug_read_delay_us", debug_read_delay_us, 0, unit=" (microseconds)")
    _check_range("num_copy_streams", streams, 1, MAX_COPY_STREAMS, " (copy streams per layer group)")
    _check_range("debug_copy_delay_us", copy_delay, 0, MAX_DEBUG_DELAY_US,
                 " microseconds (a random delay of up to that much per copy; None: none)")
    _check_range("debug_read_delay_us", read_delay, 0, MAX_DEBUG_DELAY_US,
                 " microseconds (a random delay of up to that much per read; None: none)")
    return streams, copy_delay, read_delay


def check_debug_delay_device(device: torch.device, debug_copy_delay_us) -> None:
    """debug_copy_delay_us is a mode of the CPU backend's copy workers: a CUDA copy
    engine refuses it (csrc/bindings.cpp), so it is refused here, before packing."""
    if device.type == "cuda" and debug_copy_delay_us:
        raise ValueError(f"debug_copy_delay_us={debug_copy_delay_us!r} delays the CPU backend's copies (a test "
                         f"mode): it does not apply on {device}; leave it None there")


DEFAULT_MARGIN_FRACTION = 0.1  # of the device's total memory, kept free for activations (budget_margin=None)


def budget_margin_bytes(budget_margin, device_total: int) -> int:
    """The bytes device_budget="auto" keeps free: budget_margin (validated), or (None)
    DEFAULT_MARGIN_FRACTION of the device's `device_total` bytes."""
    return int(DEFAULT_MARGIN_FRACTION * device_total) if budget_margin is None else int(budget_margin)


def validate_budget_margin(budget_margin) -> int | None:
    if budget_margin is None:
        return None
    return validate_bytes("budget_margin", budget_margin,
                          f"or None ({DEFAULT_MARGIN_FRACTION:.0%} of the device's memory)")


def validate_device_budget(device_budget, budget_margin) -> tuple:
    """device_budget: None, "auto" or a finite number of bytes >= 0; budget_margin:
    None or a finite number of bytes >= 0 (checked whether or not a budget is given).
    Returns both, numbers as ints."""
    budget_margin = validate_budget_margin(budget_margin)
    if device_budget is None or (isinstance(device_budget, str) and device_budget == "auto"):
        return device_budget, budget_margin
    return validate_bytes("device_budget", device_budget,
                          "'auto' (free device memory less budget_margin) or None"), budget_margin


def check_explicit_residency(device_budget, resident_layers) -> None:
    """device_budget chooses the resident layers: an explicit non-zero
    resident_layers next to it is refused rather than overridden."""
    if device_budget is not None and resident_layers != 0:
        raise ValueError(
            f"device_budget={device_budget!r} and resident_layers={resident_layers!r} were both given: pass one "
            "of them. device_budget lets the planner choose the resident layers to fit the budget; "
            "resident_layers fixes them yourself (then leave device_budget=None)"
        )


def check_disk_options(host_budget, spill_dir, disk_prefetch_depth) -> tuple:
    """The disk tier's arguments (layerwise.planning.host_budget): host_budget a number of bytes,
    "auto" or None; spill_dir a writable directory, only with a host_budget;
    disk_prefetch_depth an int >= 1 or None. Returns them (numbers as ints, the
    directory as a str)."""
    if spill_dir is not None and host_budget is None:
        raise ValueError("spill_dir= is where the layers that do not fit host_budget go: give host_budget too "
                         "(bytes or 'auto'), or leave spill_dir out")
    if host_budget is not None and not (isinstance(host_budget, str) and host_budget == "auto"):
        host_budget = validate_bytes("host_budget", host_budget, "'auto' or None")
    if disk_prefetch_depth is not None:
        n = as_number(disk_prefetch_depth)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"disk_prefetch_depth must be an int >= 1 or None, got {disk_prefetch_depth!r}")
        disk_prefetch_depth = n
    if spill_dir is not None:
        spill_dir = os.fsdecode(spill_dir)
        if not os.path.isdir(spill_dir):
            raise ValueError(f"spill_dir {spill_dir!r} is not a directory: create it first (a path on a local "
                             "disk, not tmpfs, for the read speed)")
        if not os.access(spill_dir, os.W_OK | os.X_OK):
            raise ValueError(f"spill_dir {spill_dir!r} is not writable by this process")
    return host_budget, spill_dir, disk_prefetch_depth


def validate_experts(v: dict) -> tuple:
    """experts: "all" or "routed"; expert_modules: None, a sequence of module names
    (relative to a layer: "mlp.experts") or a predicate(name, module); expert_cache:
    None, bytes or "auto"; expert_prefetch: a bool. The expert options need
    experts="routed". Routed experts compose with compress="lossless" (each
    expert's rows are codec segments of their own: an expert fetch copies and
    decodes its own encoded span) and with the disk tier (host_budget, spill_dir,
    load_offloaded's checkpoint: a layer on disk is read ahead without its
    experts, whose rows are read from the file on demand), and with both (an
    encoded layer in a spill file: the encoded prefix read ahead, each expert's
    encoded rows read on demand, then decoded). Refused here, naming what to
    do: split_fetch (each rank keeps a share of the layer's bytes, not whole
    experts). The device budget's planner counts expert_cache (layerwise.planning.device_budget)."""
    experts, modules, cache, prefetch = v["experts"], v["expert_modules"], v["expert_cache"], v["expert_prefetch"]
    if not (isinstance(experts, str) and experts in ("all", "routed")):
        raise ValueError(f"experts must be 'all' (every expert streams with its layer) or 'routed' (only the "
                         f"experts the router picked cross the bus), got {experts!r}")
    if modules is not None and not callable(modules):
        if isinstance(modules, str):
            modules = [modules]
        try:
            modules = tuple(modules)
        except TypeError:
            modules = None
        if not modules or not all(isinstance(m, str) and m for m in modules):
            raise TypeError(f"expert_modules must be None, module names relative to a layer (e.g. ['mlp.experts']) "
                            f"or a predicate(name, module) -> bool, got {v['expert_modules']!r}")
    if cache is not None and not (isinstance(cache, str) and cache == "auto"):
        cache = validate_bytes("expert_cache", cache, "'auto' or None")
    prefetch = validate_flag("expert_prefetch", prefetch)
    if experts == "all":
        given = [k for k, x in (("expert_modules", modules), ("expert_cache", cache), ("expert_prefetch", prefetch))
                 if x not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(given)} given with experts='all': they apply to routed experts only; "
                             "pass experts='routed' too")
        return experts, modules, cache, prefetch
    clash = [(k, why) for k, why in (
        ("split_fetch", "each rank keeps a share of the layer's bytes, not whole experts"),
    ) if v[k] is not None]
    if clash:
        k, why = clash[0]
        raise ValueError(f"experts='routed' does not compose with {k}={v[k]!r} yet ({why}): drop {k}, or use "
                         "experts='all'. The model is unchanged.")
    return experts, modules, cache, prefetch


def auto_expert_cache_bytes(expert_bytes: int, room: int | None) -> int:
    """The bytes expert_cache="auto" asks for: a quarter of the streamed layers'
    `expert_bytes`, and at most a quarter of `room` (what the device budget leaves,
    or the free device memory; None: no bound). The cache rounds it to whole
    entries (stages/experts.cache_size)."""
    asked = expert_bytes // 4
    return asked if room is None else min(asked, max(room, 0) // 4)


def validate_share_host(share_host, split_fetch):
    """False, True (the weights' identity from the checkpoint files or the weights'
    bytes) or a key string (the caller asserts that every process giving it
    streams the same weights). Needs Linux's memfd_create (sealed shared memory
    that no SIGKILL can leak); refused with split_fetch, which already keeps one
    copy per host, shared out between ranks in lockstep."""
    if share_host is False or share_host is None:
        return False
    if share_host is not True:
        if not isinstance(share_host, str) or not share_host.strip() or len(share_host) > 256 \
                or not share_host.isprintable():
            raise ValueError(f"share_host must be False, True or a non-empty printable key string of at most 256 "
                             f"characters, got {share_host!r}")
    if not hasattr(os, "memfd_create"):
        raise ValueError("share_host needs Linux (os.memfd_create: sealed shared memory that the kernel frees with "
                         "its last process); this platform has none. Drop share_host. The model is unchanged.")
    if split_fetch is not None:
        raise ValueError("share_host does not compose with split_fetch: split_fetch already keeps one copy of the "
                         "layers per host, shared out between ranks in lockstep. Pass one of them. The model is "
                         "unchanged.")
    return share_host


def validate_pin_memory(pin_memory):
    """True (pinned, or an error), False (pageable) or "auto" (pinned where it can be)."""
    try:
        ok = pin_memory in (True, False, "auto")
    except (RuntimeError, TypeError, ValueError):  # a tensor of several values, say
        ok = False
    if not ok:
        raise ValueError(f"pin_memory must be True, False or 'auto', got {pin_memory!r}")
    return "auto" if isinstance(pin_memory, str) else bool(pin_memory)


def validate_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def validate_split_fetch(split_fetch):
    """None, or a torch.distributed ProcessGroup (layerwise/stages/split/ checks the
    group itself, collectively, before packing)."""
    if split_fetch is None:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(split_fetch, dist.ProcessGroup)):
        raise TypeError(f"split_fetch must be a torch.distributed ProcessGroup (dist.group.WORLD, or one from "
                        f"dist.new_group) or None, got {type(split_fetch).__name__}")
    return split_fetch


def validate_depth(prefetch_depth) -> int:
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int):
        raise TypeError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
    return prefetch_depth


def validate_compress(compress):
    """None (layers travel as they are) or "lossless" (bf16/fp16/fp32/fp8 segments travel
    encoded, layerwise/codec/__init__.py)."""
    if compress is not None and not (isinstance(compress, str) and compress == "lossless"):
        raise ValueError(f"compress must be None or 'lossless' (bf16/fp16/fp32/fp8 weights cross the bus losslessly "
                         f"encoded), got {compress!r}")
    return compress


_THREADS_NOTED: list[bool] = []  # once per process


def note_cpu_threads(device: torch.device) -> None:
    """On a CPU device the copy engine's worker thread competes with torch's
    intra-op (OpenMP) threads for the cores. layerwise does not change torch's
    global thread count behind the caller's back: it says so once, at INFO, with
    the recommendation (docs/supported.md, "The CPU backend and torch's threads")."""
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
