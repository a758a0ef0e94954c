"""configure_layerwise_offload: several block lists of one model, packed largest
first, then ONE move of the non-layer weights, then finalised in declaration
order. Startup device memory therefore never depends on the order in which the
groups are named (docs/design.md, "The multi-group startup rule")."""
from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from layerwise import contract, stages
from layerwise.contract import managers_of, move_non_layer_weights  # noqa: F401  (public through this module too)
from layerwise.options import OffloadOptions, named_options, note_cpu_threads, resolve_resident
from layerwise.planning.device_budget import record_host_budget, warn_if_streaming_saves_nothing
from layerwise.planning.host_budget import plan_spill
from layerwise.planning.layout import param_bytes, resolve_group
from layerwise.runtime.group import LayerwiseOffloadManager

log = logging.getLogger("layerwise")


def _validate_paths(model: nn.Module, names: list[str]) -> None:
    seen: dict[str, str] = {}
    modules: dict[int, str] = {}
    for path in names:
        if path in seen:
            raise ValueError(f"layer group {path!r} is named twice in layer_names")
        seen[path] = path
        module = resolve_group(model, path)
        if id(module) in modules:
            raise ValueError(f"layer groups {modules[id(module)]!r} and {path!r} are the same module")
        modules[id(module)] = path
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"layer group {b!r} is nested inside layer group {a!r}; name only one of them")
    # Groups that share blocks (the same submodule reachable from both) overlap.
    owner: dict[int, str] = {}
    for path in names:
        for sub in resolve_group(model, path).modules():
            if id(sub) in owner and owner[id(sub)] != path:
                raise ValueError(f"layer groups {owner[id(sub)]!r} and {path!r} overlap: they share a submodule")
            owner[id(sub)] = path


# The options' defaults are OffloadOptions' fields, repeated for help() and IDEs (layerwise/options.py says why).
def configure_layerwise_offload(
    model: nn.Module,
    layer_names,
    device=None,
    prefetch_depth: int = 1,
    resident_layers=0,
    residency_policy: str = "leading",
    pin_memory: bool | str = "auto",
    device_budget=None,
    budget_margin=None,
    num_copy_streams: int = 1,
    debug_copy_delay_us: int | None = None,
    compress: str | None = None,
    host_budget=None,
    spill_dir=None,
    disk_prefetch_depth: int | None = None,
    debug_read_delay_us: int | None = None,
    split_fetch=None,
    measure_stalls: bool = True,
    experts: str = "all",
    expert_modules=None,
    expert_cache=None,
    expert_prefetch: bool = False,
    share_host: bool | str = False,
    share_calls: bool = True,
) -> list[LayerwiseOffloadManager]:
    """Stream every block list in `layer_names` to `device`.

    `layer_names` is a dotted path, a sequence of them, or "auto"
    (layerwise.detect_layer_groups). `device_budget` (bytes, or "auto": free
    device memory less `budget_margin`) lets layerwise choose the resident
    layers and, if it must, a smaller prefetch depth (layerwise.planning.device_budget).
    `compress="lossless"`: the bf16/fp16 weights of streamed layers are kept
    encoded in host memory and cross the bus encoded, bit-exact
    (layerwise/stages/decode.py); None: as they are.

    `host_budget` (bytes, or "auto": the cgroup limit or available memory, less
    a reserve) caps the host memory the streamed weights take: the layers that
    do not fit are written to one spill file per group in `spill_dir` as they
    are packed, and stream back disk -> pinned staging -> device
    (layerwise.planning.host_budget, layerwise/stages/disk/). `disk_prefetch_depth`: disk
    layers read ahead (default: prefetch_depth + 1, at least 2).

    `split_fetch` (a torch.distributed ProcessGroup): ranks that run this model
    in lockstep each keep and copy only their share of every streamed layer and
    all-gather the rest (layerwise/stages/split/ says which calls are collective).

    `experts="routed"`: in a mixture-of-experts model only the experts the router
    picked cross the bus; the rest of each layer streams as before
    (layerwise/planning/experts.py). `expert_modules` names the expert modules (relative to
    a layer, or a predicate(name, module)) where detection does not find them;
    `expert_cache` (bytes or "auto") keeps recently used experts on the device;
    `expert_prefetch=True` copies the experts each MoE layer used at its previous
    call while the layer before it computes.

    `share_host=True` (or a key string) keeps the streamed layers' host blocks in
    one read-only arena per machine: the first process packs it, every other
    process that configures the same layout of the same weights maps it instead
    of packing a copy (docs/share-host.md). With True the weights' identity is a
    checksum of their bytes (one read of the model); a string asserts it.

    Threads that call the model at the same time share each layer's fetch
    (docs/cohort.md); `share_calls=False` makes each call fetch its own layers.

    `measure_stalls=False` skips the timing of waits behind stats()' stall figures.
    Every option is validated once, into a layerwise.options.OffloadOptions.

    Returns one LayerwiseOffloadManager per name, in the order given.
    Everything is validated before anything in the model changes; if packing
    fails half way, the model is put back as it was.
    """
    options = OffloadOptions.build(caller="configure_layerwise_offload", **named_options(locals()))
    managers = prepare_groups(model, layer_names, options)
    contract.check_configurable(model, managers)
    dev = options.device
    if options.device_budget is not None:
        from layerwise.planning.device_budget import apply_device_budget

        apply_device_budget(model, managers, dev, options.device_budget, options.budget_margin,
                            options.residency_policy)
    with stages.attached(managers, options):  # split fetch first: the host budget counts this rank's shares
        if options.host_budget is not None:
            held = sum(param_bytes(p) for p in model.parameters() if p.device.type == "cpu")
            plan = plan_spill(model, managers, options, held)
            record_host_budget(managers, options.host_budget, plan["budget"])
        return build_groups(model, managers, dev)


def prepare_groups(model, layer_names, options: OffloadOptions) -> list[LayerwiseOffloadManager]:
    """Plan every group with `options` (validated: OffloadOptions.build); changes
    nothing in the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(layer_names, str) and layer_names == "auto":
        from layerwise.planning.detect import detect_layer_groups

        names = detect_layer_groups(model)
        log.info("layerwise: layer_names='auto' chose %s", names)
    elif isinstance(layer_names, str):
        names = [layer_names]
    elif isinstance(layer_names, Sequence) and all(isinstance(n, str) for n in layer_names):
        names = list(layer_names)
    else:
        raise TypeError(f"layer_names must be a str or a sequence of str, got {layer_names!r}")
    if not names:
        raise ValueError("layer_names is empty: name at least one nn.ModuleList of blocks")
    if managers_of(model):
        raise RuntimeError(
            f"{type(model).__name__} is already configured for layerwise offload; "
            "call layerwise.remove_layerwise_offload(model) first"
        )
    _validate_paths(model, names)
    for path in names:  # (a WARNING for a group smaller than resident_layers)
        resolve_resident(options.resident_layers, len(resolve_group(model, path)), options.residency_policy, path)
    return [LayerwiseOffloadManager(model, path, initialize=False, options=options) for path in names]


def build_groups(model, managers, dev, fill=None, place_non_layer=None, undo=None) -> list[LayerwiseOffloadManager]:
    """Pack (largest group first), one non-layer move, finalise (declaration order).

    `fill(entry, block)`, if given, writes a parameter into its host block
    (checkpoint loading); `place_non_layer()` puts the non-layer weights on the
    device before the single model.to; `undo()` reverts what those two did.
    """
    enabled = [m for m in managers if m.enabled]
    with contract.rollback_on_failure([(model, managers)], undo, finish=lambda: _log_summary(model, managers, dev)):
        # Largest group first: weights that arrived on the device are copied back
        # to the host group by group, so the biggest share of memory frees first.
        for m in sorted(enabled, key=lambda m: -m.managed_parameter_bytes()):
            m.pack(fill)
        if place_non_layer is not None:
            place_non_layer()
        move_non_layer_weights(model, dev)
        for m in managers:
            m.finalize()
    return managers


def configure_models(parts, dev, finish=None, warn_saves_nothing: bool = True) -> None:
    """Several models' layer groups in one pass (layerwise.offload_pipeline).

    `parts`: [(model, managers)], every manager prepared (initialize=False) and
    validated; a model with no managers only moves to `dev`. The multi-group
    rule of configure_layerwise_offload, across models: every group of every
    model is packed (largest first, whichever model it belongs to) before any
    `model.to`, then one `model.to(dev)` per model, then every model's managers
    are finalised in declaration order. Startup device memory therefore does not
    depend on the order of the models either. A failure or Ctrl-C anywhere puts
    every model back exactly as it was (contract.rollback_on_failure).
    `warn_saves_nothing=False`: the caller warns about groups where streaming saves
    nothing itself (offload_pipeline: once per call, naming the component)."""
    def log_all():
        for model, managers in parts:
            if managers:
                _log_summary(model, managers, dev, warn_saves_nothing)
        if finish is not None:  # the caller's own completion, with Ctrl-C still held back
            finish()

    with contract.rollback_on_failure(parts, finish=log_all):
        enabled = [m for _, managers in parts for m in managers if m.enabled]
        for m in sorted(enabled, key=lambda m: -m.managed_parameter_bytes()):
            m.pack()
        for model, _ in parts:
            move_non_layer_weights(model, dev)
        for _, managers in parts:
            for m in managers:
                m.finalize()


def _log_summary(model, managers, dev, warn_saves_nothing: bool = True) -> None:
    if warn_saves_nothing:
        warn_if_streaming_saves_nothing(managers)
    note_cpu_threads(dev)
    per_dtype: dict = {}
    for m in managers:
        for dt, n in m.plan.bytes_per_dtype().items():
            per_dtype[dt] = per_dtype.get(dt, 0) + n
    managed = {id(e.param) for m in managers for lp in m.plan.layers for e in lp.params}
    non_layer = sum(param_bytes(p) for p in model.parameters() if id(p) not in managed)
    stats = [m.stats() for m in managers]
    log.info(
        "layerwise: %d group(s) %s, %d layers to %s; packed %s; arena %.1f MiB (%s); ring %.1f MiB; "
        "resident layers %d; non-layer weights %.1f MiB on the device",
        len(managers), [m.layer_name for m in managers], sum(m.num_layers for m in managers), dev,
        ", ".join(f"{str(k).replace('torch.', '')} {v / 2**20:.1f} MiB" for k, v in per_dtype.items()),
        sum(s["arena_bytes"] for s in stats) / 2**20,
        "pinned" if all(s["arena_pinned"] for s in stats if s["arena_bytes"]) else "not pinned",
        sum(s["ring_bytes"] for s in stats) / 2**20, sum(len(s["resident_layers"]) for s in stats),
        non_layer / 2**20,
    )


def remove_layerwise_offload(model: nn.Module) -> nn.Module:
    """Undo configure_layerwise_offload: ordinary parameters on the device, no hooks,
    ring and arena freed. Returns the model.

    A model that is not offloaded (never configured, or removed already) is left
    as it is and returned: a no-op, so a server may call it whatever the model's
    state (layerwise.is_offloaded says which). A pipeline is a TypeError: its
    offload is undone by layerwise.remove_pipeline_offload.

    Transactional: every weight is read back first, and only then is anything
    changed. If that fails (a checkpoint or spill file gone: the error names it) or
    is interrupted, the model still streams exactly; call it again to finish."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"remove_layerwise_offload takes a model (an nn.Module), got {type(model).__name__}; "
                        "a pipeline's offload is undone by layerwise.remove_pipeline_offload(pipe)")
    managers = managers_of(model)
    if not managers:
        return model
    contract.remove_models([(model, managers)])
    return model
