"""offload_pipeline: a whole diffusers pipeline (or any object holding several
models) streamed with one call, its host memory spent where it saves the most.

A pipeline's components run one after another and compete for host memory.
Three decisions are made for the whole pipeline, before anything changes:

placement   which components stream their block lists (layerwise.detect_layer_groups,
            or the layer names given) and which move whole to the device (the
            small rest: a component without block lists).
pins        pinned host memory goes to the groups whose bytes cross the bus most
            often per request: bytes x uses, where the denoiser runs once per
            inference step and an encoder once (or uses counted by the hooks in a
            warm-up call, or given). The choice that streams the most pinned bytes
            per request within the pin budget wins (exactly, over every subset of
            groups); the others stay pageable (`pin_memory=False`) and exact.
startup     configure.configure_models: every group of every component packed,
            largest first, before any `model.to`; one `model.to` per component;
            a failure anywhere rolls every component back.

`pin_budget="auto"` is what this process may lock (pinnable_host_bytes): the
tightest of its cgroup's memory limit, RLIMIT_MEMLOCK (unless the process has
CAP_IPC_LOCK) and the host's available memory, each less a reserve.

While offloaded, the pipeline's own `to` (to another device or dtype),
`enable_model_cpu_offload`, `enable_sequential_cpu_offload` and
`enable_group_offload` are refused by instance attributes that name the
remedy (remove_pipeline_offload first); `pipe.to(<the streaming device>)` is
allowed and changes nothing. remove_pipeline_offload puts every weight back
where it was before offload_pipeline (usually the host), so a pipeline larger
than the device can be given back whole.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from layerwise import contract, stages
from layerwise.configure import configure_models, managers_of, prepare_groups
from layerwise.options import OffloadOptions, named_options, validate_bytes
from layerwise.planning.device_budget import (
    apply_device_budget,
    fmt_bytes,
    non_layer_bytes,
    record_host_budget,
    resolve_budget,
    warn_if_streaming_saves_nothing,
)
from layerwise.planning.host_budget import plan_spill
from layerwise.planning.host_limits import PinBudget, pinnable_host_bytes
from layerwise.planning.layout import local_tensor
from layerwise.planning.routes import planned_host_bytes
from layerwise.reporting import NotOffloaded
from layerwise.reporting import report as model_report

log = logging.getLogger("layerwise")

EXACT_PIN_GROUPS = 14  # up to this many streamed groups the pin choice is exact (every subset)
DEFAULT_DENOISER_USES = 28  # when the pipeline's __call__ has no num_inference_steps default


_STATE = "_layerwise_pipeline"
REFUSED = ("to", "enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload")


# ------------------------------------------------------------ components
@dataclass
class GroupPin:
    """The pin decision for one streamed group (one manager)."""

    layer_name: str
    manager: object
    arena_bytes: int  # host bytes the group's arena takes (what pinning it locks)
    streamed_bytes: int  # bytes that cross the bus each time the group runs
    uses: int  # times the group runs per request
    uses_source: str
    pin: bool | str = False  # what its manager was given: True / "auto" / False
    why: str = ""

    @property
    def value(self) -> int:
        return self.streamed_bytes * self.uses


@dataclass
class Component:
    name: str
    module: nn.Module
    layer_names: list | None  # None: resident (the whole component on the device)
    why: str  # why it streams or stays resident
    managers: list = field(default_factory=list)
    groups: list = field(default_factory=list)  # GroupPin per manager
    uses: int = 1
    uses_source: str = ""
    devices: list = field(default_factory=list)  # where every weight lived before (contract snapshot)
    weight_bytes: int = 0


@dataclass
class PipelineState:
    device: torch.device
    components: list
    pin_budget: PinBudget | None
    pin_memory: bool | str
    patched: dict  # name -> the refusing function put on the instance
    kept: list = field(default_factory=list)  # components streamed on their own before: left as they are


def _param_bytes(module: nn.Module) -> int:
    return sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in module.parameters())


def _components_of(pipe) -> dict[str, nn.Module]:
    """The nn.Module components of a pipeline: diffusers' `components`, else the
    object's attributes that are modules (the same module under two names counts once)."""
    if isinstance(pipe, nn.Module):
        raise TypeError(
            f"offload_pipeline takes a pipeline (an object holding several models), got the model "
            f"{type(pipe).__name__}; stream one model with "
            "layerwise.configure_layerwise_offload(model, 'auto', device=...)"
        )
    comps = getattr(pipe, "components", None)
    items = comps.items() if isinstance(comps, Mapping) else vars(pipe).items()
    out: dict[str, nn.Module] = {}
    seen: dict[int, str] = {}
    for name, mod in items:
        if not isinstance(mod, nn.Module) or name.startswith("_"):
            continue
        if id(mod) in seen:
            log.info("layerwise: component %r is the same module as %r: handled once, as %r", name, seen[id(mod)],
                     seen[id(mod)])
            continue
        seen[id(mod)] = name
        out[name] = mod
    if not out:
        raise TypeError(f"{type(pipe).__name__} holds no nn.Module component to offload")
    return out


def component_modules(pipe) -> dict[str, nn.Module]:
    """{name: module} of a pipeline's nn.Module components, as offload_pipeline
    finds them (a TypeError for a model, or for an object that holds none)."""
    return _components_of(pipe)


def _select(comps: dict[str, nn.Module], components) -> list[Component]:
    """Which components stream which block lists; the others are resident."""
    if isinstance(components, str):
        if components != "auto":
            raise ValueError(f"components must be 'auto', a list of component names or a dict, got {components!r}")
        spec, explicit = {name: "auto" for name in comps}, False
    elif isinstance(components, Mapping):
        spec, explicit = dict(components), True
    elif isinstance(components, Sequence) and all(isinstance(n, str) for n in components):
        spec, explicit = {name: "auto" for name in components}, True
    else:
        raise TypeError(f"components must be 'auto', a list of component names or a dict, got {components!r}")
    unknown = [n for n in spec if n not in comps]
    if unknown:
        raise ValueError(f"components {unknown} are not nn.Module components of the pipeline; it has "
                         f"{sorted(comps)}")
    from layerwise.planning.detect import detect_layer_groups

    out = []
    for name, module in comps.items():
        if name not in spec:
            out.append(Component(name, module, None, "not named in components: moved whole to the device"))
            continue
        layers = spec[name]
        if layers is None:
            out.append(Component(name, module, None, f"components[{name!r}] is None: moved whole to the device"))
        elif isinstance(layers, str) and layers == "auto":
            try:
                names = detect_layer_groups(module)
            except ValueError:
                if explicit:
                    raise ValueError(
                        f"component {name!r} ({type(module).__name__}) has no block list that "
                        "detect_layer_groups recognises: name its layer lists, e.g. components="
                        f"{{{name!r}: ['blocks']}}, or None to keep it whole on the device"
                    ) from None
                out.append(Component(name, module, None, "no block list found: moved whole to the device"))
                continue
            out.append(Component(name, module, names, "block lists found by detect_layer_groups"))
        else:
            names = [layers] if isinstance(layers, str) else layers
            if not (isinstance(names, Sequence) and names and all(isinstance(n, str) for n in names)):
                raise TypeError(f"components[{name!r}] must be 'auto', a layer list's name, a list of them or None "
                                f"(whole on the device), got {layers!r}")
            out.append(Component(name, module, list(names), "layer names given in components"))
    return out


def _check_disjoint(parts: list[Component]) -> None:
    owner: dict[int, str] = {}
    for c in parts:
        for p in c.module.parameters():
            if id(p) in owner and owner[id(p)] != c.name:
                raise ValueError(f"components {owner[id(p)]!r} and {c.name!r} share parameters: offload_pipeline "
                                 "needs each weight in one component")
            owner[id(p)] = c.name


def _default_steps(pipe) -> int:
    try:
        p = inspect.signature(type(pipe).__call__).parameters.get("num_inference_steps")
    except (TypeError, ValueError):
        p = None
    if p is not None and isinstance(p.default, int) and p.default > 0:
        return p.default
    return DEFAULT_DENOISER_USES


def is_denoiser(name: str, module: nn.Module) -> bool:
    cls = type(module).__name__
    return (name in ("transformer", "unet") or name.startswith(("transformer_", "unet_"))
            or "Transformer" in cls or "UNet" in cls)


def _uses(pipe, c: Component, uses) -> tuple[int, str]:
    if isinstance(uses, Mapping) and c.name in uses:
        return uses[c.name], "given"
    if is_denoiser(c.name, c.module):
        n = _default_steps(pipe)
        return n, f"denoiser: once per step, {n} = {type(pipe).__name__}'s default num_inference_steps"
    return 1, "once per request"


def _validate_uses(uses, names) -> None:
    if uses is None or callable(uses):
        return
    if not isinstance(uses, Mapping):
        raise TypeError(f"uses must be a dict {{component: runs per request}}, a warm-up callable or None, "
                        f"got {uses!r}")
    for k, v in uses.items():
        if isinstance(k, tuple):  # (component, group): counted in a warm-up call
            k = k[0]
        if k not in names:
            raise ValueError(f"uses names {k!r}, which is not a component of the pipeline ({sorted(names)})")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"uses[{k!r}] must be an int >= 0 (runs per request), got {v!r}")


# ------------------------------------------------------------- pin choice
def choose_pins(groups: list[GroupPin], budget: int | None) -> set[int]:
    """Indices of the groups to pin: the set with the most streamed bytes x uses
    whose arenas fit `budget` (None: no limit). Exact over every subset up to
    EXACT_PIN_GROUPS groups (ties: fewer pinned bytes), else greedy by bytes x
    uses. A group that never runs is never pinned."""
    idx = [i for i, g in enumerate(groups) if g.value > 0]
    if budget is None:
        return set(idx)
    if len(idx) > EXACT_PIN_GROUPS:
        chosen, left = set(), budget
        for i in sorted(idx, key=lambda i: (-groups[i].value, i)):
            if groups[i].arena_bytes <= left:
                chosen.add(i)
                left -= groups[i].arena_bytes
        return chosen
    best, best_key = set(), (0, 0)
    for r in range(1, len(idx) + 1):
        for subset in itertools.combinations(idx, r):
            size = sum(groups[i].arena_bytes for i in subset)
            if size > budget:
                continue
            key = (sum(groups[i].value for i in subset), -size)
            if key > best_key:
                best, best_key = set(subset), key
    return best


def _resolve_pin_budget(pin_budget, held: int) -> PinBudget | None:
    if pin_budget is None:
        return None
    if isinstance(pin_budget, str) and pin_budget == "auto":
        return pinnable_host_bytes(held)
    n = validate_bytes("pin_budget", pin_budget, "'auto' (what this process may lock) or None (no limit)")
    return PinBudget(n, [], auto=False)


def _plan_pins(parts: list[Component], budget: PinBudget | None, pin_memory) -> None:
    groups = [g for c in parts for g in c.groups]
    if pin_memory is False:
        for g in groups:
            g.pin, g.why = False, "pageable: pin_memory=False"
        return
    chosen = choose_pins(groups, None if budget is None else budget.bytes)
    order = sorted(range(len(groups)), key=lambda i: (-groups[i].value, i))
    rank = {i: k + 1 for k, i in enumerate(order)}
    pinned = sum(groups[i].arena_bytes for i in chosen)
    for i, g in enumerate(groups):
        worth = f"rank {rank[i]} of {len(groups)} by bytes x uses ({fmt_bytes(g.streamed_bytes)} x {g.uses})"
        if i in chosen:
            g.pin = pin_memory
            g.why = "pinned: " + worth + (" within the pin budget" if budget is not None else ", no pin budget")
        elif g.value == 0:
            g.pin, g.why = False, "pageable: it does not run in a request (0 uses)"
        else:
            g.pin = False
            g.why = (f"pageable: {worth}; its arena ({fmt_bytes(g.arena_bytes)}) did not fit the pin budget "
                     f"({fmt_bytes(budget.bytes)}, {fmt_bytes(pinned)} of it pinned for groups worth more)")
    if pin_memory is True:
        left = [f"{c.name}.{g.layer_name}" for c in parts for g in c.groups if g.pin is False]
        if left:
            raise ValueError(
                f"pin_memory=True asks every arena to be pinned, but the pin budget of {fmt_bytes(budget.bytes)} "
                f"({budget.source}) leaves {left} pageable; raise pin_budget, pass pin_budget=None, or use "
                "pin_memory='auto' (pinned within the budget, pageable beyond it)"
            )


# ----------------------------------------------------------- device plan
def _plan_device_budget(parts: list[Component], options: OffloadOptions) -> None:
    """Split one device budget across components: resident components and every
    component's non-layer weights and rings first; what is left makes layers
    resident, in the order of bytes x uses (the denoiser first)."""
    dev, device_budget, margin, policy = (options.device, options.device_budget, options.budget_margin,
                                          options.residency_policy)
    if device_budget is None:
        return
    streamed = [c for c in parts if c.managers]
    if isinstance(device_budget, str) and device_budget == "auto" and dev.type == "cpu":
        for c in streamed:  # plans nothing on a CPU device, and says so (budget.apply_device_budget)
            apply_device_budget(c.module, c.managers, dev, "auto", margin, policy)
        return
    total = resolve_budget(dev, device_budget, margin)
    whole = sum(_param_bytes(c.module) + sum(b.numel() * b.element_size() for b in c.module.buffers())
                for c in parts if not c.managers)

    def minimum(c: Component) -> int:
        depth = max((m.prefetch_depth for m in c.managers), default=0)
        # (an expert_cache="auto" takes a share of what is left: room=0 gives the least it holds, none)
        return non_layer_bytes(c.module, c.managers) + sum(m.device_bytes([], depth) + m.expert_cache_bytes([], room=0)
                                                           for m in c.managers if m.enabled)

    need = {c.name: minimum(c) for c in streamed}
    left = total - whole
    order = sorted(streamed, key=lambda c: -c.uses * sum(m.plan.managed_bytes for m in c.managers))
    for k, c in enumerate(order):
        later = sum(need[o.name] for o in order[k + 1:])  # the least every component after this one needs
        mine = left - later
        try:
            plan = apply_device_budget(c.module, c.managers, dev, max(0, mine), None, policy)
        except RuntimeError as e:
            raise RuntimeError(
                f"device_budget {fmt_bytes(total)}: component {c.name!r} gets {fmt_bytes(max(0, mine))} after "
                f"{fmt_bytes(whole)} of resident components and {fmt_bytes(later)} that the components after it "
                f"need at least: {e}"
            ) from None
        left -= plan["needed"]


# --------------------------------------------------------------- public
# The options' defaults are OffloadOptions' fields, repeated for help() and IDEs (layerwise/options.py says why).
def offload_pipeline(pipe, device=None, components="auto", prefetch_depth: int = 1, pin_budget="auto",
                     host_budget=None, device_budget=None, **options) -> dict[str, list]:
    """Stream a whole pipeline's block lists to `device`; the rest goes there whole.

    pipe: a diffusers DiffusionPipeline (its `components`), or any object whose
        attributes include nn.Modules.
    components: "auto" (every component with block lists streams them, the
        others move whole to the device), a list of component names (those
        stream, detected block lists; the others move whole), or a dict
        {component: "auto" | layer name(s) | None (whole on the device)}.
    pin_budget: bytes of host memory that may be pinned, "auto" (see
        pinnable_host_bytes) or None (no limit). Groups that do not fit are
        pageable, and exact.
    host_budget: bytes (or "auto") the streamed weights may take in host
        memory, counted as every front door counts it (layerwise.planning.host_budget); with
        `spill_dir`, the layers that do not fit go to spill files there (the
        disk tier), else a budget that would leave a layer out is an error.
    device_budget: bytes or "auto", shared by every component (planning/device_budget.py plans
        resident layers; the denoiser gets them first).
    options: resident_layers, residency_policy, pin_memory ("auto" default,
        True: every arena pinned or an error, False: none), budget_margin,
        num_copy_streams, debug_copy_delay_us, compress, spill_dir, disk_prefetch_depth,
        debug_read_delay_us, split_fetch, measure_stalls as in configure_layerwise_offload
        (validated once, with device, prefetch_depth and the budgets, into a
        layerwise.options.OffloadOptions), and `uses`: {component: runs per request}, or a callable warm-up
        `uses(pipe)` whose runs are counted by the hooks (the pipeline is
        offloaded pageable for it, then offloaded again with the counts).

    Returns {component name: [LayerwiseOffloadManager, ...]} for the streamed
    components. Everything is validated and planned before any component
    changes; a failure while packing puts every component back as it was.
    """
    uses = options.pop("uses", None)
    opts = OffloadOptions.build(caller="offload_pipeline", also=("uses",), **named_options(locals()), **options)
    if not (pin_budget is None or isinstance(pin_budget, str) and pin_budget == "auto"):
        _resolve_pin_budget(pin_budget, 0)  # checked before a warm-up call offloads anything
    if callable(uses) and not isinstance(uses, Mapping):
        return _offload_with_warmup(pipe, uses, components, pin_budget, opts)
    return _offload(pipe, opts, components, pin_budget, uses)


def _offload(pipe, options: OffloadOptions, components, pin_budget, uses, warmup: bool = False) -> dict[str, list]:
    """offload_pipeline with its options validated (`uses`: a dict or None; `warmup`: the
    pageable pass that counts uses, whose groups are told about at the final pass)."""
    if _STATE in getattr(pipe, "__dict__", {}):
        raise RuntimeError(f"{type(pipe).__name__} is already offloaded by layerwise.offload_pipeline; call "
                           "layerwise.remove_pipeline_offload(pipe) first")
    dev = options.device
    comps = _components_of(pipe)
    _validate_uses(uses, comps)
    parts = _select(comps, components)
    _check_disjoint(parts)

    # A component streamed on its own before (configure_layerwise_offload, load_offloaded)
    # is kept as it is: the pipeline neither repacks nor moves it, and gives it back so.
    kept = [c for c in parts if managers_of(c.module)]
    parts = [c for c in parts if not managers_of(c.module)]
    for c in kept:
        log.info("layerwise: %s is already streamed on its own: offload_pipeline keeps it as it is", c.name)

    # Plan every component; nothing in the pipeline changes until configure_models.
    for c in parts:
        c.weight_bytes = _param_bytes(c.module)
        if c.layer_names is None:
            contract.check_configurable(c.module, [])
            continue
        c.managers = prepare_groups(c.module, c.layer_names, _component_options(options, c.name))
        contract.check_configurable(c.module, c.managers)
    for c in parts:
        c.uses, c.uses_source = _uses(pipe, c, uses)
    _plan_device_budget(parts, options)
    streamed_managers = [m for c in parts for m in c.managers]
    # split_fetch: one collective over every group of every component (stages.attached);
    # first, so that the host budget counts this rank's shares
    with stages.attached(streamed_managers, options):
        budget = _plan_and_configure(pipe, parts, kept, streamed_managers, options, pin_budget, uses)
    if not warmup:
        for c in parts:
            warn_if_streaming_saves_nothing(c.managers, component=c.name)
    pinned = [f"{c.name}.{g.layer_name}" for c in parts for g in c.groups if g.manager.stats()["arena_pinned"]]
    log.info("layerwise: %s offloaded to %s: streamed %s, whole on the device %s; pin budget %s (%s); pinned %s",
             type(pipe).__name__, dev, [c.name for c in parts if c.managers],
             [c.name for c in parts if not c.managers],
             "none" if budget is None else fmt_bytes(budget.bytes), "no limit" if budget is None else budget.source,
             pinned or "nothing")
    return {c.name: list(c.managers) for c in parts if c.managers}


def _plan_and_configure(pipe, parts, kept, streamed_managers, options: OffloadOptions, pin_budget, uses):
    """offload_pipeline once split fetch is attached: the host budget, the pin plan,
    then every component packed and the pipeline patched; returns the pin budget."""
    dev = options.device
    if options.host_budget is not None:  # one meaning for every front door (layerwise.planning.host_budget)
        plan = plan_spill([c.module for c in parts], streamed_managers, options, _held_bytes(parts))
        record_host_budget(streamed_managers, options.host_budget, plan["budget"])
    for c in parts:
        for m in c.managers:
            if not m.enabled:
                continue
            counted = uses.get((c.name, m.layer_name)) if isinstance(uses, Mapping) else None
            n, source = (counted, "counted in a warm-up call") if counted is not None else (c.uses, c.uses_source)
            resident = set(m.resident)
            streamed = sum(lp.nbytes for lp in m.plan.layers if lp.index not in resident)
            # At the size its tiers keep each layer (encoded, this rank's share, on disk: tierplan)
            c.groups.append(GroupPin(m.layer_name, m, planned_host_bytes(m), streamed, n, source))
        if c.groups and any(g.uses_source == "counted in a warm-up call" for g in c.groups):
            c.uses, c.uses_source = max(g.uses for g in c.groups), "counted in a warm-up call"
    budget = _resolve_pin_budget(pin_budget, _held_bytes(parts))
    _plan_pins(parts, budget, options.pin_memory)
    for c in parts:
        for g in c.groups:  # each group's own pin_memory, in its options (the group's one copy)
            g.manager.options = dataclasses.replace(g.manager.options, pin_memory=g.pin)
        c.devices = contract.snapshot_devices(c.module)

    state = PipelineState(dev, parts, budget, options.pin_memory, {}, [c.name for c in kept])

    def finish():  # runs with Ctrl-C held back, once every component is whole
        try:
            _patch(pipe, state)
            pipe.__dict__[_STATE] = state
        except BaseException:
            _unpatch(pipe, state)
            for c in parts:
                _restore_component(c)
            raise

    configure_models([(c.module, c.managers) for c in parts], dev, finish=finish, warn_saves_nothing=False)
    return budget


def _component_options(options: OffloadOptions, name: str) -> OffloadOptions:
    """A component's options. A share_host key string names the pipeline's weights:
    each component shares under it with the same component of another pipeline,
    never with another component of this one (two of one class, as Wan 2.2's two
    transformers, have the same layout and group paths but other weights)."""
    if isinstance(options.share_host, str):
        return dataclasses.replace(options, share_host=f"{options.share_host} (component {name})")
    return options


def _held_bytes(parts: list[Component]) -> int:
    """Bytes of streamed weights in host memory now: the arenas replace them."""
    total = 0
    for c in parts:
        for m in c.managers:
            for lp in m.plan.layers:
                for e in lp.params:
                    if e.param.device.type == "cpu":
                        total += e.span_bytes
    return total


def _offload_with_warmup(pipe, warmup: Callable, components, pin_budget, options: OffloadOptions) -> dict[str, list]:
    """uses=<callable>: offload pageable, run the warm-up, count how often each
    group ran (its first layer's hook), put the pipeline back and offload it
    again with those counts."""
    managers = _offload(pipe, dataclasses.replace(options, pin_memory=False), components, None, None, warmup=True)
    try:
        before = {(name, m.layer_name): m.stats()["steps"] for name, ms in managers.items() for m in ms}
        warmup(pipe)
        counted = {(name, m.layer_name): m.stats()["steps"] - before[(name, m.layer_name)]
                   for name, ms in managers.items() for m in ms}
    finally:
        remove_pipeline_offload(pipe)
    log.info("layerwise: runs per request counted in the warm-up call: %s",
             ", ".join(f"{c}.{g}: {n}" for (c, g), n in counted.items()))
    return _offload(pipe, options, components, pin_budget, counted)


# ----------------------------------------------------- refused pipeline calls
_REMEDY = {
    "to": "to move or cast the pipeline, call layerwise.remove_pipeline_offload(pipe) first, then "
          "pipe.to(...), then layerwise.offload_pipeline(pipe, ...) again if you want streaming back. "
          "pipe.to({dev!r}) itself is allowed (the pipeline is there already)",
    "enable_model_cpu_offload": "layerwise already streams this pipeline from host memory. To use diffusers' model "
                                "offload instead, call layerwise.remove_pipeline_offload(pipe) first, then "
                                "pipe.enable_model_cpu_offload(...)",
    "enable_sequential_cpu_offload": "layerwise already streams this pipeline from host memory. To use diffusers' "
                                     "sequential offload instead, call layerwise.remove_pipeline_offload(pipe) "
                                     "first, then pipe.enable_sequential_cpu_offload(...)",
    "enable_group_offload": "layerwise already streams this pipeline block by block. To use diffusers' group "
                            "offload instead, call layerwise.remove_pipeline_offload(pipe) first, then "
                            "pipe.enable_group_offload(...)",
}


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        return ia == b.index
    return True


def _to_target(args, kwargs):
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif a is not None:
            device = a
    return (torch.device(device) if device is not None else None), dtype


def _refuse(pipe, name: str, state: PipelineState):
    cls = type(pipe).__name__
    remedy = _REMEDY[name].format(dev=str(state.device))
    original = getattr(pipe, name)

    if name == "to":
        def guarded(*args, **kwargs):
            try:
                device, dtype = _to_target(args, kwargs)
            except (RuntimeError, TypeError):
                device, dtype = torch.device("meta"), None  # not a device: refused below
            if dtype is None and (device is None or _same_device(device, state.device)):
                return original(*args, **kwargs)  # everything is on that device already
            call = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
            raise RuntimeError(f"layerwise: {cls}.to({call}) is refused while the pipeline is offloaded by "
                               f"layerwise.offload_pipeline (its block lists stream from host memory to "
                               f"{state.device}); {remedy}. Nothing was changed.")
    else:
        def guarded(*args, **kwargs):
            raise RuntimeError(f"layerwise: {cls}.{name}() is refused while the pipeline is offloaded by "
                               f"layerwise.offload_pipeline: {remedy}. Nothing was changed.")

    functools.update_wrapper(guarded, original)
    guarded.layerwise_guard = True
    return guarded


def _patch(pipe, state: PipelineState) -> None:
    for name in REFUSED:
        if callable(getattr(pipe, name, None)):
            state.patched[name] = _refuse(pipe, name, state)
    for name, fn in state.patched.items():
        pipe.__dict__[name] = fn  # an instance attribute: diffusers' __setattr__ would register it in the config


def _unpatch(pipe, state: PipelineState) -> None:
    for name, fn in state.patched.items():
        if pipe.__dict__.get(name) is fn:
            del pipe.__dict__[name]
    pipe.__dict__.pop(_STATE, None)


def remove_pipeline_offload(pipe):
    """Undo offload_pipeline: every weight back where it was before (ordinary
    tensors, usually on the host), no hooks, arenas and rings freed, the
    pipeline's own methods back. Returns the pipeline.

    A pipeline that offload_pipeline does not stream (never offloaded, or removed
    already) is left as it is and returned: a no-op, as remove_layerwise_offload is
    for a model. What offload_pipeline did not configure stays as it is here too
    (a component streamed on its own, by configure_layerwise_offload or
    load_offloaded: remove it with layerwise.remove_layerwise_offload(pipe.<name>)).
    A model is a TypeError: its offload is undone by remove_layerwise_offload.

    One transaction over every component: if reading a weight back fails (the
    error names it) or the call is interrupted, every component still streams
    exactly; call it again to finish."""
    if isinstance(pipe, nn.Module):
        raise TypeError(f"remove_pipeline_offload takes a pipeline, got the model {type(pipe).__name__}; a "
                        "model's offload is undone by layerwise.remove_layerwise_offload(model)")
    state: PipelineState | None = getattr(pipe, "__dict__", {}).get(_STATE)
    if state is None:
        return pipe
    _remove_components(state.components, finish=lambda: _unpatch(pipe, state))
    return pipe


def _remove_components(components, finish=None) -> None:
    """Every component back where its weights were (contract.remove_models), with
    the moves of the non-layer weights built before anything changes and made in
    the commit."""
    parts = [(c.module, managers_of(c.module)) for c in components]
    managed = {id(e.param) for _, ms in parts for m in ms for lp in m.plan.layers for e in lp.params}
    moves = []

    def prepare():  # with every component held: a load_state_dict on another thread is not lost
        with torch.no_grad():
            moves.extend(contract.device_moves(c.devices, managed) for c in components)

    def commit():
        for c, todo in zip(components, moves):
            contract.apply_moves(todo)
            c.managers, c.devices = [], []
        if finish is not None:
            finish()

    contract.remove_models(parts, original_devices=True, finish=commit, prepare=prepare)


def _restore_component(c: Component) -> None:
    _remove_components([c])


def is_offloaded_pipeline(obj) -> bool:
    return _STATE in getattr(obj, "__dict__", {})


def streamed_components(pipe) -> list:
    """[(name, module)] of the components of an offloaded pipeline that stream (layerwise.tune)."""
    state: PipelineState = pipe.__dict__[_STATE]
    return [(c.name, c.module) for c in state.components if managers_of(c.module)]


def resident_component_bytes(pipe) -> int:
    """Device bytes of the components of an offloaded pipeline kept whole on the
    device (counted against a device budget as offload_pipeline counts them)."""
    state: PipelineState = pipe.__dict__[_STATE]
    return sum(_param_bytes(c.module) + sum(b.numel() * b.element_size() for b in c.module.buffers())
               for c in state.components if not managers_of(c.module))


# ----------------------------------------------------------------- report
WIDTH = 120
_COLUMNS = [("component", "component", str), ("class", "class", str), ("placement", "placement", str),
            ("weights", "weight_bytes", fmt_bytes), ("host arena", "arena_bytes", fmt_bytes),
            ("pinned", "pinned", str), ("uses", "uses", str)]


class PipelineReport(dict):
    """{"device", "pin_budget", "host_budget", "components": [...]}: prints as a
    table within 120 columns, the pin and host budgets, then plain lines per
    component and group."""

    def table(self) -> str:
        cells = [[h for h, _, _ in _COLUMNS]]
        for r in self["components"]:
            cells.append(["-" if r.get(k) is None else fmt(r[k]) for _, k, fmt in _COLUMNS])
        widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
        over = sum(widths) + 2 * (len(widths) - 1) - WIDTH
        if over > 0:  # long class names give way first
            widths[1] = max(len("class"), widths[1] - over)
            for row in cells:
                row[1] = row[1] if len(row[1]) <= widths[1] else row[1][: widths[1] - 3] + "..."
        lines = ["  ".join(v.ljust(w) if i < 3 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()
                 for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def lines(self) -> list[str]:
        out = textwrap.wrap(self["pin_budget"]["text"], WIDTH, subsequent_indent="    ")
        if self.get("host_budget"):
            out += textwrap.wrap(self["host_budget"]["text"], WIDTH, subsequent_indent="    ")
        for r in self["components"]:
            out += textwrap.wrap(f"{r['component']}: {r['why']}", WIDTH, subsequent_indent="    ")
            for g in r["groups"]:
                out += textwrap.wrap(f"{r['component']}.{g['group']}: {g['layers']} layers, arena "
                                     f"{fmt_bytes(g['arena_bytes'])}, {g['why']}", WIDTH,
                                     initial_indent="  ", subsequent_indent="      ")
        return out

    def __str__(self) -> str:
        return "\n".join([self.table(), "", *self.lines()])


def report_pipeline(pipe) -> PipelineReport:
    """Per component: streamed or whole on the device and why, its weights, its
    host arena, pinned or pageable and why, runs per request; per streamed
    group the same, from each manager's live stats. (layerwise.report(pipe)
    gives the same.) Per-group streaming figures: layerwise.report(pipe.<name>).
    A pipeline that offload_pipeline does not stream gives a report.NotOffloaded
    that says so (and names its components streamed on their own, if any)."""
    state: PipelineState | None = getattr(pipe, "__dict__", {}).get(_STATE)
    if state is None:
        return _not_offloaded(pipe)
    rows = []
    for c in state.components:
        groups = []
        for g in c.groups:
            s = g.manager.stats()
            why = g.why
            if g.pin is not False and not s["arena_pinned"]:
                why = f"pageable: chosen for pinning, but pinning failed: {s['arena_pin_error'] or 'unknown reason'}"
            groups.append({"group": g.layer_name, "layers": s["layers"], "arena_bytes": s["arena_bytes"],
                           "arena_pinned": s["arena_pinned"], "uses": g.uses, "uses_source": g.uses_source,
                           "streamed_bytes": g.streamed_bytes, "why": why})
        n_pinned = sum(g["arena_pinned"] for g in groups)
        if not c.managers:
            placement, pinned = "resident", None
        else:
            placement = f"streamed, {len(c.managers)} group{'s' if len(c.managers) != 1 else ''}"
            pinned = "yes" if n_pinned == len(groups) else "no" if n_pinned == 0 else f"{n_pinned} of {len(groups)}"
        why = f"{'streamed' if c.managers else 'whole on ' + str(state.device)} ({c.why})"
        if c.managers:
            why += f"; runs {c.uses}x per request ({c.uses_source})"
        rows.append({
            "component": c.name, "class": type(c.module).__name__, "streamed": bool(c.managers),
            "placement": placement, "weight_bytes": c.weight_bytes,
            "arena_bytes": sum(g["arena_bytes"] for g in groups) if c.managers else None,
            "pinned_bytes": sum(g["arena_bytes"] for g in groups if g["arena_pinned"]),
            "pinned": pinned, "uses": c.uses if c.managers else None, "uses_source": c.uses_source,
            "groups": groups, "why": why,
        })
    for name in state.kept:
        module = getattr(pipe, name)
        mgrs = managers_of(module)
        rows.append({
            "component": name, "class": type(module).__name__, "streamed": bool(mgrs),
            "placement": f"own offload, {len(mgrs)} group{'s' if len(mgrs) != 1 else ''}" if mgrs else "own",
            "weight_bytes": _param_bytes(module), "arena_bytes": sum(m.stats()["arena_bytes"] for m in mgrs),
            "pinned_bytes": 0, "pinned": None, "uses": None, "uses_source": "", "groups": [],
            "why": "streamed on its own before offload_pipeline (configure_layerwise_offload / load_offloaded): "
                   "kept as it is; layerwise.report(pipe.%s) has its figures" % name,
        })
    b = state.pin_budget
    pinned_total = sum(r["pinned_bytes"] for r in rows)
    if state.pin_memory is False:
        text = "pin budget: not used (pin_memory=False): every arena is pageable"
    elif b is None:
        text = (f"pin budget: none (pin_budget=None): every streamed arena asked to be pinned; "
                f"{fmt_bytes(pinned_total)} pinned")
    else:
        text = f"pin budget {fmt_bytes(b.bytes)} ({b.source}); {fmt_bytes(pinned_total)} of it pinned"
    budget = {"bytes": None if b is None else b.bytes, "source": None if b is None else b.source,
              "pinned_bytes": pinned_total, "text": text,
              "limits": [] if b is None else [vars(lim) | {"budget": lim.budget} for lim in b.limits]}
    return PipelineReport(offloaded=True, device=str(state.device), pin_budget=budget, components=rows,
                          host_budget=_host_budget_use(state))


def _not_offloaded(pipe) -> NotOffloaded:
    own = [name for name, module in component_modules(pipe).items() if managers_of(module)]
    text = f"{type(pipe).__name__} is not offloaded by layerwise.offload_pipeline"
    if own:
        text += (f"; its component(s) {own} stream on their own (configure_layerwise_offload / load_offloaded): "
                 f"layerwise.report(pipe.{own[0]}) has their figures")
    else:
        text += ": nothing in it streams"
    return NotOffloaded(offloaded=bool(own), components=[], streamed_components=own, text=text)


def _host_budget_use(state: PipelineState) -> dict | None:
    """The host budget in force (budget.record_host_budget) and what the streamed
    components' weights take of it now: their arenas and disk staging slots, and on
    a CPU device their non-layer weights, rings and resident layers."""
    managers = [m for c in state.components for m in c.managers]
    hb = next((m.host_budget for m in managers if m.host_budget is not None), None)
    if hb is None:
        return None
    stats = [m.stats() for m in managers]
    used = sum(s["arena_bytes"] + (s["disk"]["staging_bytes"] if s["disk"] else 0) for s in stats)
    if state.device.type == "cpu":
        used += sum(non_layer_bytes(c.module, c.managers) for c in state.components if c.managers)
        used += sum(s["ring_bytes"] + s["resident_bytes"] for s in stats)
        used += sum(m.expert_cache_bytes() for m in managers)
    share = f" ({100 * used / hb['bytes']:.0f}%)" if hb["bytes"] else ""
    return {"bytes": hb["bytes"], "source": hb["source"], "used_bytes": used,
            "text": f"host budget {fmt_bytes(hb['bytes'])} ({hb['source']}): {fmt_bytes(used)} used by the streamed "
                    f"components{share}: arenas, disk staging"
                    + (", and on this CPU device their non-layer weights, rings and resident layers"
                       if state.device.type == "cpu" else "")}


def report(obj, *args, **kwargs):
    """layerwise.report: a pipeline gives report_pipeline(obj); a model,
    layerwise.reporting.report(model). One that is not offloaded gives a
    report.NotOffloaded that says so ({"offloaded": False, ..., "text"}), not an
    error; every report has the "offloaded" key."""
    if is_offloaded_pipeline(obj) or not isinstance(obj, nn.Module):
        return report_pipeline(obj)
    return model_report(obj, *args, **kwargs)
