"""LayerwiseOffloadManager: streams one block list (nn.ModuleList) through a
device slot ring, one fetch ahead of the compute that needs it.

Life cycle (Lifecycle; docs/design.md, data flow): plan (__init__, the tier plan:
layerwise/planning/routes.py) -> pack (layerwise/runtime/host_store.py: the host side, each
layer's chain of stages: layerwise/stages) -> one model.to of the non-layer
weights -> finalise (the slot ring: layerwise/runtime/ring.py, parameters bound to
slot views, first prefetches, hooks). The pre-hook asks the layer's source to
make it ready in its slot and makes the compute stream wait on the result; it
names no tier. A fetch into a slot waits for everything the compute stream has
enqueued (the slot's last user) and for the slot's previous fetch; a slot whose
layer computes is never a prefetch target.

Robustness (the state contract, layerwise/contract/): the record is marked
`_dirty` around every call that queues work, so an exception or a
KeyboardInterrupt in between makes the next hook resynchronise instead of
trusting a record behind what was queued. Forwards of one model hold the
model's lock from a layer's pre-hook to its post-hook. Version counters say
when someone wrote to a slot (refused) or to a layer's true bytes (it reloads).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import threading
import time
from numbers import Integral

import torch
from torch import nn

from layerwise import _native, contract, stages
from layerwise.contract import compile_guard, rebinds
from layerwise.options import (
    OffloadOptions,
    manager_options,
    named_options,
    resident_arg,
    resolve_resident,
    validate_depth,
    validate_residency,
)
from layerwise.planning import experts
from layerwise.planning.layout import GroupPlan, build_group_plan
from layerwise.planning.layout import device_bytes as planned_device_bytes
from layerwise.planning.routes import TierChoice
from layerwise.runtime import capture, cohort, expert_hooks, gpu_checks, ops, turns
from layerwise.runtime.host_share import HostShare
from layerwise.runtime.host_store import HostLayers, Rebinding, assign, bind_layer_to_slot, materialize
from layerwise.runtime.meter import Meter
from layerwise.runtime.ring import SlotRing

log = logging.getLogger("layerwise")


class Lifecycle(enum.Enum):
    """A group's state: the hooks, the contract and removal check it."""

    PLANNED = "planned"  # built (or removed): its parameters are ordinary tensors
    PACKED = "packed"  # its weights are packed (arena, stages), the parameters placeholders
    STREAMING = "streaming"  # finalised: ring, hooks; its layers stream


# The block list records the group that streams it in its __dict__ (an instance entry, never one that
# torch registers as a parameter, buffer or module): a second configure of the same list is refused.
GROUP_KEY = "_layerwise_manager"

_PLAIN = {torch.Tensor, nn.Parameter}  # parameter types whose bytes are all there is to them


class _RingView:
    """What rebinds.Bound reads of a manager (its plan, its ring), for a ring not in force yet."""

    def __init__(self, plan, ring):
        self.plan, self.ring = plan, ring


class LayerwiseOffloadManager:
    """Streams the layers of `model.<layer_name>` to `device` (see module doc).

    What the rest of layerwise uses of a group (the state contract, the planners,
    tune, the front doors, the bench) is declared here, as FSDP2's param group
    declares its own: its lifecycle (`state`, `packed`, `streaming`), its layers'
    sources (`sources`, `chain`), a layer's true bytes (`read_layer`, `write_layer`,
    `layer_host`, `refresh_resident`), a layer made ready (`wait_ready`), the model
    lock and the copy engine (`lock`, `engine`, `compute_stream`, `queueing`), the
    planners' inputs (`plan_residency`, `device_bytes`, `tiers`), and the steps of
    a configure and a removal (`pack`, `finalize`, `commit_configure`,
    `prepare_removal`, `commit_removal`). Nothing else reads or sets its private
    fields (ruff's SLF001 checks it)."""

    @property
    def packed(self) -> bool:
        """Its weights are packed (arena, stages): PACKED or STREAMING."""
        return self.state is not Lifecycle.PLANNED

    @property
    def streaming(self) -> bool:
        """Finalised: ring, hooks; its layers stream (Lifecycle.STREAMING)."""
        return self.state is Lifecycle.STREAMING

    _packed = packed  # (the seed's names, kept for callers outside the package)
    _finalized = streaming

    @property
    def prefetch_depth(self) -> int:
        """The prefetch depth in force: the group's options are its one copy (the
        device budget's planner and set_residency change it there)."""
        return self.options.prefetch_depth

    # The options' defaults are OffloadOptions' fields, repeated for help() and IDEs (layerwise/options.py says why).
    def __init__(
        self,
        model: nn.Module,
        layer_name: str,
        num_layers: int | None = None,
        device=None,
        prefetch_depth: int = 1,
        resident_layers=0,
        residency_policy: str = "leading",
        pin_memory: bool | str = "auto",
        initialize: bool = True,
        num_copy_streams: int = 1,
        debug_copy_delay_us: int | None = None,
        measure_stalls: bool = True,
        compress: str | None = None,
        disk_prefetch_depth: int | None = None,
        debug_read_delay_us: int | None = None,
        split_fetch=None,
        options: OffloadOptions | None = None,
    ):
        # The streaming options: `options` (OffloadOptions.build), or built from the keywords; validated there, once.
        self.options = options = manager_options(options, named_options(locals()), initialize)
        self.compress = options.compress
        self.device = options.device
        self.plan: GroupPlan = build_group_plan(model, layer_name, num_layers)
        if self.plan.module_list.__dict__.get(GROUP_KEY) is not None:
            raise RuntimeError(
                f"layer group {layer_name!r} is already offloaded; call layerwise.remove_layerwise_offload(model) first"
            )
        self.model = model  # the model whose block list this group streams
        self.layer_name = layer_name  # the block list's path in the model
        self.num_layers = self.plan.num_layers  # its layers, streamed or resident
        self.resident = resolve_resident(options.resident_layers, self.num_layers, options.residency_policy)
        # the tier plan's inputs, set by the planners (layerwise/planning/routes.py)
        self.tiers = TierChoice(layer_name)
        # experts="routed": the group's expert modules, its layers laid out expert-last (layerwise/planning/experts.py)
        self.experts = self.tiers.experts = experts.plan_experts(self.plan, options)
        self.enabled = self.num_layers > 0 and self.plan.managed_bytes > 0  # False: nothing to stream
        self.next_manager: LayerwiseOffloadManager = self  # whose layers follow our last one
        self.state = Lifecycle.PLANNED  # PLANNED -> PACKED -> STREAMING (-> PLANNED: removed)
        # the layers' host copies and sources (layerwise/runtime/host_store.py)
        self._host = HostLayers(self.plan, layer_name, self.device, self.pin_memory)
        self._resident_bytes = 0  # device bytes of the resident layers
        self._grad_hooks: list = []  # saved-tensor hooks pushed by pre-hooks, popped by post-hooks: [(thread, ctx)]
        self._hooks = []  # the forward hooks' handles (and the expert modules'), removed with the group
        self._capture: capture.CaptureSchedule | None = None  # the step being captured into a CUDA graph
        self._captured = False  # a CUDA graph of a step exists: its replays change the slots behind the record
        self._capture_stream = None
        self._guard_hooks = []  # the state contract's hooks on the streamed layers (installed again by set_residency)
        self.placement = None  # who chose the placement in force, when not configure (set_residency's `note`)
        self.ring: SlotRing | None = None  # the slot ring and its record (layerwise/runtime/ring.py), once finalised
        # the group's figures (layerwise/runtime/meter.py)
        self.meter = Meter(self.options.measure_stalls, self._stage_counts)
        # Filled when the group is finalised (_finalize_initialization), emptied by its removal:
        self._engine = None  # the copy engine (layerwise._native.CopyEngine): its copy streams and events
        self._lock = None  # the model's lock (contract.ModelLock), shared by the model's groups
        self._cohort: cohort.Cohort | None = None  # the model's calls under way (runtime/cohort.py)
        self._dirty = False  # the ring's record may be behind what was queued: the next hook resyncs
        self.guard: contract.GroupGuard | None = None  # the state contract's own record of this group
        self.bound: rebinds.Bound | None = None  # where each streamed parameter must still point (rebinds.py)
        if initialize:
            self.initialize()

    # ------------------------------------------------------------------ plan
    def _managed_parameter_bytes(self) -> int:
        """Local bytes of the parameters this group streams: those whose layer index
        matches and is below num_layers (a DTensor's local shard; a quantized
        weight's stored tensors). The size the multi-group initialisation packs the
        largest group first by (configure_layerwise_offload, offload_pipeline)."""
        return self.plan.managed_bytes

    def managed_parameter_bytes(self) -> int:
        """_managed_parameter_bytes (the seed's name)."""
        return self._managed_parameter_bytes()

    def plan_residency(self, resident: list[int], prefetch_depth: int, expert_cache=None) -> None:
        """The device-budget planner's choice (from validated options). `expert_cache`:
        the expert cache's bytes it counted, kept so ("auto" on CUDA reads the free
        device memory, which is less once the ring is allocated)."""
        if self.streaming:
            raise RuntimeError(f"{self.layer_name}: residency is fixed once finalised")
        self.resident = sorted(resident)
        self.options = dataclasses.replace(self.options, prefetch_depth=prefetch_depth)
        if expert_cache is not None and self.options.expert_cache == "auto":
            self.options = dataclasses.replace(self.options, expert_cache=expert_cache or None)

    def set_residency(self, resident, prefetch_depth: int | None = None, *, note=None) -> None:
        """Change which layers stay on the device, and the prefetch depth, while the
        group streams. `resident`: layer indices (a list, a 1-D integer array or
        tensor, any iterable of ints), or a count / fraction of the group spread by
        its residency_policy (as `resident_layers` at configure);
        `prefetch_depth`: default, the one in force. `note`: what chose it (shown by
        layerwise.report; layerwise.tune passes its plan).

        Only the device side changes: the slot ring is rebuilt and the layers that
        change placement are bound again. The host side stays as packed (arena,
        encoded blocks, files; the disk stage keeps the staging slots it was planned
        with). A layer that leaves the device takes its current bytes with it (a
        load_state_dict into it while resident is kept; parameters that
        load_state_dict(..., assign=True) put in its modules are the ones that then
        stream, or, where one cannot take the packed one's place, the change is
        refused). While it changes, device memory holds the old ring and the new
        one. Tensors of a state_dict() taken before are snapshots for the layers
        that changed placement.

        Transactional: if it raises (no memory, a checkpoint file that cannot take a
        changed layer back) or is interrupted, the old placement stays in force,
        whole. Called between forwards (it waits for a forward in flight on another
        thread); refused inside one, between a forward under grad mode and the end
        of its backward (the graph uses the parameters it would rebind), and for a
        split-fetch group (its ranks' shares are planned for the layers streamed at
        configure)."""
        if not self.streaming:
            raise RuntimeError(f"layerwise: {self.layer_name}: set_residency changes the placement of a streaming "
                               "group; before configure, pass resident_layers / prefetch_depth to configure")
        new = self._resident_list(resident)
        depth = self.prefetch_depth if prefetch_depth is None else validate_depth(prefetch_depth)
        if self.options.split_fetch is not None:
            raise RuntimeError(
                f"layerwise: {self.layer_name}: set_residency is not supported with split_fetch: each rank keeps "
                "only its share of the layers streamed at configure. Configure again with the resident_layers "
                "you want (layerwise.remove_layerwise_offload(model), then configure_layerwise_offload).")
        with self._lock:
            if self.ring.entered:
                raise RuntimeError(f"layerwise: {self.layer_name}: set_residency was called inside a forward of "
                                   "the model (a hook, or a block calling it): call it between forwards")
            if self.guard.backward_pending():
                raise RuntimeError(
                    f"layerwise: {self.layer_name}: set_residency between a forward and its backward: a forward "
                    "under grad mode built a graph through this group's layers that is still alive, and its "
                    "backward has not finished; the change would rebind the parameters that graph uses, and torch "
                    "would fail that backward. Run the backward first, or drop the graph (del the loss and the "
                    "outputs), or run forwards that need no backward under torch.no_grad() or "
                    "torch.inference_mode(); then change the placement. The placement is unchanged.")
            if self.guard.handed_out:
                contract.check_handed_out(self)
            self._drain()
            if self._dirty:
                self._resync()
            # A parameter a library (or the user) rebound since the last check is settled
            # first (layerwise/rebinds.py: adopted or refused): the rebinding below would drop it.
            self.bound.check_all(self)
            old = list(self.resident)
            if new == old and depth == self.prefetch_depth:
                self.placement = note
                return
            self._check_host_budget(new, depth)
            self._adopt_replaced(sorted(set(old) - set(new)))
            # Phase one builds everything and changes nothing the model computes with.
            # A layer leaving the device writes its device bytes back to its source
            # first (where they changed): its source then agrees with its truth.
            for i in sorted(set(old) - set(new)):
                source = self.read_layer(i)  # (read once: a layer on disk is a file read)
                block = self._resident_block(i, source)
                if not torch.equal(block, source):
                    if not self.sources[i].writable:
                        try:
                            self.sources[i].refuse_write()
                        except RuntimeError as err:
                            raise RuntimeError(
                                f"layerwise: {self.layer_name}: set_residency: layer {self.layer_name}[{i}] was "
                                "changed while resident (load_state_dict, or a write into its weights) and cannot "
                                f"leave the device: {err} Keep it resident (leave {i} in the resident layers), "
                                "or load its original values back first. The placement is unchanged.") from None
                    self.write_layer(i, lambda b, block=block: b.copy_(block))
            layers = self.plan.layers
            start = self._engine.record(self.compute_stream(), False) if self._engine.is_cuda else None
            with torch.inference_mode(False), torch.no_grad():
                ring = SlotRing(self.plan, new, depth, self.sources, self.device, start, self.ring.layer_gen)
                binding = Rebinding()
                for i in sorted(set(new) - set(old)):
                    block = self.read_layer(i)
                    binding.data([(e, e.wrap(materialize(e, block, self.device))) for e in layers[i].params])
                for i in ring.streamed:
                    binding.slot(layers[i].params, ring.slots[ring.slot_of[i]])
                binding.check(self.layer_name)  # a wrapper torch cannot swap is refused here, not half-way
                bound = rebinds.Bound(_RingView(self.plan, ring))
            self._commit_residency(ring, binding, bound, new, depth, note)
        log.info("layerwise: %s: placement changed: %d of %d layers resident (%s), prefetch depth %d",
                 self.layer_name, len(new), self.num_layers, new[:16], depth)

    def _check_host_budget(self, resident: list[int], prefetch_depth: int) -> None:
        """On a CPU device the rings and resident layers are host memory: a placement
        that takes more of it must fit the host budget in force (refused before
        anything changes, naming it)."""
        budget = self.tiers.host_budget
        if budget is None or self.device.type != "cpu":
            return
        budget.check(self.device_bytes(resident, prefetch_depth) - self.device_bytes(),
                     f"{self.layer_name}: set_residency({resident[:16]}, prefetch_depth={prefetch_depth}) on a CPU "
                     "device (its rings and resident layers are host memory)",
                     "Keep fewer layers resident (or a lower prefetch_depth), or configure again with a larger "
                     "host_budget")

    def _commit_residency(self, ring, binding, bound, new, depth, note) -> None:
        """set_residency's phase two, with Ctrl-C held back: the state contract's hooks
        of the new placement first (they patch the modules in place, so the old ones
        go first; a failure there puts the old ones back and changes nothing else),
        then only rebinds and releases."""
        with contract.defer_interrupts():
            for h in self._guard_hooks:
                h.remove()
            try:
                guards = contract.install_layer_hooks(self, ring.streamed)  # (on failure: none of them stays)
            except BaseException:
                try:
                    self._guard_hooks = contract.install_layer_hooks(self)  # the old placement's again
                except BaseException:  # a second failure: the group refuses to run rather than run unguarded
                    self._guard_hooks = []
                    self.guard.error = (f"layerwise: {self.layer_name}: the state contract's hooks could not be "
                                        "installed again after a failed set_residency; call "
                                        "layerwise.remove_layerwise_offload(model) (the weights are exact) and "
                                        "configure again")
                raise
            try:
                contract.unwatch(self, keep=ring.streamed)
            except Exception:  # noqa: BLE001 - stale records only make guards refuse: never wrong
                log.warning("layerwise: %s: could not forget the modules of the layers made resident", self.layer_name)
            self.ring.release()
            self.ring = ring
            binding.commit()
            self.resident = new
            self.options = dataclasses.replace(self.options, prefetch_depth=depth)
            self._resident_bytes = sum(self.plan.layers[i].nbytes for i in new)
            self.bound = bound
            self.chain.restream(self.num_layers, ring.streamed, ring)
            self._guard_hooks = guards
            self.placement = note
            try:
                for i in ring.streamed[:depth]:
                    self._load(i, prefetch=True)
            except Exception:  # noqa: BLE001 - raised again where the layer is needed (dirty: the next hook resyncs)
                pass

    def _adopt_replaced(self, layers) -> None:
        """Resident `layers` leave the device: a parameter that its module holds as
        another object than the one packed (load_state_dict(..., assign=True) into a
        resident layer, or `module.weight = nn.Parameter(...)`) is the one the layer
        computes with, so it is the one that streams: its record takes it (its bytes
        then go to the layer's source with the others'). One that cannot take the
        packed one's place in the slot (another dtype, shape or strides, a quantized or
        sharded parameter, none) is refused first, with nothing changed."""
        found = []
        for i in layers:
            for e in self.plan.layers[i].params:
                path, _, attr = e.qualname.rpartition(".")
                now = self.model.get_submodule(path)._parameters.get(attr)
                if now is e.param:
                    continue
                if not isinstance(now, torch.Tensor):
                    why = f"it is {type(now).__name__} now"
                elif e.leaf is not None or e.dspec is not None or not {type(now), type(e.param)} <= _PLAIN:
                    why = (f"it is a {type(now).__name__} where a {type(e.param).__name__} was packed (only a plain "
                           "parameter takes the place of a plain one)")
                elif now.dtype != e.dtype or tuple(now.shape) != e.shape:
                    why = f"it is {now.dtype}{list(now.shape)}, and its place is planned for {e.dtype}{list(e.shape)}"
                elif tuple(now.stride()) != e.stride:
                    why = f"its strides {tuple(now.stride())} differ from the {e.stride} its place is planned for"
                elif now.device.type == "meta":
                    why = "it is on the meta device"
                else:
                    found.append((e, now))
                    continue
                raise RuntimeError(
                    f"layerwise: {self.layer_name}: set_residency: {e.qualname} was replaced by another tensor while "
                    f"layer {self.layer_name}[{i}] was resident (load_state_dict(..., assign=True), or an assignment "
                    f"to the module), and {why}: the layer cannot leave the device. Keep it resident (leave {i} in "
                    "the resident layers), or load into it without assign=True (load_state_dict copies into the "
                    "parameter packed), or call layerwise.remove_layerwise_offload(model) and configure again. "
                    "The placement is unchanged.")
        for e, now in found:
            e.param = now  # (the module's own: a resident layer's truth is what it computes with)

    def _resident_list(self, resident) -> list[int]:
        resident = resident_arg(resident)  # (arrays, tensors, generators of indices: a list of ints)
        n = self.num_layers
        if isinstance(resident, (list, tuple, set, frozenset, range)):
            out = sorted(set(resident))
            bad = [i for i in out if isinstance(i, bool) or not isinstance(i, Integral) or not 0 <= i < n]
            if bad:
                raise ValueError(f"layerwise: {self.layer_name}: set_residency: resident= must be layer indices "
                                 f"in [0, {n}), got {bad[:8]}")
            return [int(i) for i in out]
        policy = self.options.residency_policy  # (a count or fraction: checked and warned about as at configure)
        return resolve_resident(validate_residency(resident, policy, name="resident"), n, policy, self.layer_name,
                                name="resident")

    def _resident_block(self, i: int, source: torch.Tensor) -> torch.Tensor:
        """Resident layer i's bytes as its device tensors hold them, in plan layout (host);
        `source`: its bytes as its source holds them (the gaps between parameters)."""
        block = source.clone()
        for e in self.plan.layers[i].params:
            data = e.source()
            if data.dtype != e.dtype or tuple(data.shape) != tuple(e.shape) or tuple(data.stride()) != tuple(e.stride):
                raise RuntimeError(
                    f"layerwise: {e.qualname} is {data.dtype}{list(data.shape)} on the device now, not the "
                    f"{e.dtype}{list(e.shape)} it was packed as: its layer cannot leave the device "
                    "(layerwise.remove_layerwise_offload(model), then configure again)")
            flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())
            block[e.offset : e.offset + e.span_bytes].copy_(flat.view(torch.uint8).reshape(-1))
        return block

    def refresh_resident(self, i: int) -> None:
        """Resident layer i's true bytes in its source changed (a state_dict() alias
        handed out while it streamed, written since): its device tensors take them."""
        block = self.read_layer(i)
        with torch.no_grad():
            for e in self.plan.layers[i].params:
                data = e.source()
                flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())
                flat.view(torch.uint8).reshape(-1).copy_(block[e.offset : e.offset + e.span_bytes])

    def device_bytes(self, resident: list[int] | None = None, prefetch_depth: int | None = None) -> int:
        """Device bytes of ring + resident layers for a residency plan (default: the current one)."""
        return planned_device_bytes(self.plan, self.resident if resident is None else resident,
                                    self.prefetch_depth if prefetch_depth is None else prefetch_depth)

    def expert_cache_bytes(self, resident: list[int] | None = None, room: int | None = None) -> int:
        """Bytes of the routed experts' cache on the group's device (experts="routed"
        with expert_cache; else 0): once streaming, the cache held (its size is fixed
        then: set_residency shares its entries out again); before, the one the
        residency plan `resident` (default: the one in force) would give, an "auto"
        one at most a quarter of `room` (stages/experts.cache_size)."""
        if self.experts is None or self.options.expert_cache is None or not self.enabled:
            return 0
        if self.streaming:
            return self.chain.experts.cache_bytes
        keep = set(self.resident if resident is None else resident)
        streamed = [i for i in range(self.num_layers) if i not in keep]
        return stages.experts.cache_size(self.options.expert_cache, self.experts, streamed, self.device,
                                         self.layer_name, room)[0]

    @property
    def host_budget(self) -> dict | None:
        """The host budget in force for this group (HostBudget.summary: its bytes, "given"
        or "auto", the groups it covers), or None where none was given."""
        budget = self.tiers.host_budget
        return None if budget is None else budget.summary()

    def host_bytes(self) -> int:
        """Host memory the group holds now, as a host budget in force counts it
        (layerwise.planning.host_budget.HostBudget; stats()' arena figure and the rest): its arena
        and the blocks its stages keep, the disk tier's staging and, on a CPU device
        (whose memory is the host's), its ring, resident layers and expert cache. Its
        model's non-layer weights are not the group's (HostBudget adds them)."""
        if not self.enabled or not self.packed:
            return 0
        total = sum(self._host.held())  # (a shared arena: this process relies on all of it, once)
        disk = self.chain.disk if self.chain is not None else None
        total += disk.staging_bytes if disk is not None else 0
        if self.streaming and self.device.type == "cpu":
            total += sum(t.numel() for t in self.ring.slots) + self._resident_bytes + self.expert_cache_bytes()
        return total

    def fetch_bytes(self) -> list[int]:
        """Per layer, the bytes its fetch moves over the bus (encoded, a split share)."""
        return [src.transfer_bytes for src in self.sources] if self.packed else [lp.nbytes for lp in self.plan.layers]

    # ------------------------------------------------------------- tier plan
    def tier_plan(self, sizes: bool = True) -> list:
        """Each layer's route (layerwise.planning.routes.Route): where its bytes live and what
        happens on the way to its slot. Fixed once packed; before, from the options
        and the planners' choices so far (`self.tiers`)."""
        if self._host.routes is not None:
            return self._host.routes
        return self.tiers.routes(self.plan, self.resident, self.compress, sizes)

    # ------------------------------------------------------------------ pack
    @property
    def sources(self) -> list:
        """Each layer's source of truth (stages/source.py: a stages.Source), once packed."""
        return self._host.src

    @property
    def chain(self):
        """The group's chain of stages (stages.Chain: its disk, codec, split and expert
        stages and their queues), once packed; else None."""
        return self._host.chain

    _src, _chain = sources, chain  # (names kept for callers outside the package)

    @property
    def lock(self):
        """The model's lock (contract.ModelLock), held by a forward from a layer's
        pre-hook to its post-hook; what changes the group's record holds it. None
        before the group is finalised."""
        return self._lock

    @property
    def engine(self):
        """The copy engine (layerwise._native.CopyEngine) while the group streams; else None."""
        return self._engine

    def _arena_capacity(self) -> int:
        return HostLayers.capacity(self.plan, self.tier_plan(sizes=False))

    def _initialize_layer_weights(self, fill=None) -> None:
        """Pack every layer by its route (layerwise/runtime/host_store.py); managed parameters
        become (1,) placeholders. Originals are freed as each parameter is packed, so
        host memory holds the model about once. On failure every parameter packed so
        far gets its exact bytes back. `fill(entry, block)`: as HostLayers.pack."""
        if self.packed or not self.enabled:
            return
        share = None
        if self.options.share_host:  # the machine's one arena of this group (runtime/host_share.py)
            share = HostShare.join(self.plan, self.options, self.resident, self.layer_name)
        try:
            if share is not None and share.attached:
                share.adopt_disk_layers(self.tiers)
            routes = self.tier_plan(sizes=False)
            chain = stages.Chain.for_group(self.layer_name, self.options, self.tiers)
        except BaseException:
            if share is not None:
                share.abandon()  # (an attached one only leaves)
            raise
        self._host = HostLayers(self.plan, self.layer_name, self.device, self.pin_memory, share)
        with torch.inference_mode(False):  # arena blocks must be ordinary tensors (version counters)
            try:
                self._host.pack(routes, chain, fill)
            except BaseException:
                with contract.defer_interrupts():
                    self._host.chain = chain  # (its files, closed with it)
                    self._restore_parameters(original_devices=True)
                    if share is not None:
                        share.abandon()
                raise
        self.state, self.tiers.fixed = Lifecycle.PACKED, True
        self.plan.module_list.__dict__[GROUP_KEY] = self

    def pack(self, fill=None) -> None:
        """Step one of a configure: _initialize_layer_weights (the seed's name)."""
        self._initialize_layer_weights(fill)

    def commit_configure(self) -> None:
        """The whole configure succeeded: drop what a rollback would have needed."""
        self._host.commit()

    # -------------------------------------------------------------- finalise
    def _finalize_initialization(self) -> None:
        """Ring, resident layers, parameter views, first prefetches and hooks.

        Called by the caller's own sequence rather than a front door (managers built
        with initialize=False, each _initialize_layer_weights(), one model.to, each
        _finalize_initialization(): the multi-group order of docs/design.md), the group is
        also recorded on the model as configure records it: layerwise.managers_of,
        remove_layerwise_offload, report and the state contract's guards see it, and
        the groups finalised so far prefetch across into each other."""
        if self.streaming:
            return
        if not self.enabled:
            contract.register_outside_front_door(self)
            return
        if not self.packed:
            raise RuntimeError(f"{self.layer_name}: _initialize_layer_weights() must run before finalisation")
        with torch.inference_mode(False), torch.no_grad():
            self._engine = _native.CopyEngine(
                str(self.device),
                num_streams=self.options.num_copy_streams,
                debug_delay_us=-1 if self.options.debug_copy_delay_us is None else self.options.debug_copy_delay_us,
            )
            self._lock = contract.model_lock(self.model)
            self._cohort = cohort.of(self.model)
            # Calls share fetches where every group of the model does; split_fetch's ranks
            # must issue the same collectives in the same order, which threads' timing cannot promise.
            self._cohort.sharing = self._cohort.sharing and self.options.share_calls \
                and self.options.split_fetch is None
            store = self.tiers.split_store
            # run_together's calls take turns instead, share_calls or not: without them two
            # calls at once issue the rank's gathers in the order of its threads' timing.
            if store is not None:
                turns.attach(self.model, store.group, store.id)
            layers = self.plan.layers
            self._grad_hooks = []
            self._dirty = False
            self.guard = contract.GroupGuard()
            start = self._engine.record(self.compute_stream(), False) if self._engine.is_cuda else None
            # The copy stream of captured steps, made now: a stream made inside a capture is not safe.
            self._capture_stream = capture.CudaApi(self.device).new_stream() if self._engine.is_cuda else None
            self.ring = SlotRing(self.plan, self.resident, self.prefetch_depth, self.sources, self.device, start)
            # Resident layers become ordinary device tensors (one storage each, as in a
            # resident model); streamed ones are bound to views of their slot.
            for i in self.resident:
                block = self.sources[i].read()
                assign([(e, e.wrap(materialize(e, block, self.device))) for e in layers[i].params])
            self._resident_bytes = sum(layers[i].nbytes for i in self.resident)
            for i in self.ring.streamed:
                bind_layer_to_slot(layers[i].params, self.ring.slots[self.ring.slot_of[i]])
            self.bound = rebinds.Bound(self)
            # The chain of stages that makes a layer ready in its slot (layerwise/stages):
            # each source knows its own; the stages get their buffers, reader and queues.
            self.chain.start(self._engine, self.sources, self.ring.streamed, start, self.ring)
            for i in self.ring.streamed[: self.prefetch_depth]:
                self._load(i, prefetch=True)
            # Under torch.compile the hooks are traced into two operators per layer
            # (layerwise/runtime/ops.py), whose kernels are enter_layer and leave_layer;
            # each block takes its streamed class, so that no graph traced without
            # the hooks runs it (layerwise/contract/compile_guard.py).
            # The pre-hook goes first, so that a user's pre-hook registered earlier
            # (weight_norm computes `weight` in one) reads the layer's own weights.
            # Registered with Ctrl-C held back: a hook whose handle was never recorded
            # could not be removed by a rollback.
            with contract.defer_interrupts():
                for lp in layers:
                    compile_guard.mark_streamed(lp.module)
                    self._hooks.append(ops.install(
                        lp.module, functools.partial(self._pre_hook, lp.index, None),
                        functools.partial(self._post_hook, lp.index, None, None),
                        functools.partial(self.leave_layer, lp.index), self.device))
                self._hooks.extend(expert_hooks.install_hooks(self))  # routed experts: the expert modules' pre-hooks
                self._guard_hooks = contract.install_layer_hooks(self)
            compile_guard.drop_instance_graphs()
        self.state = Lifecycle.STREAMING
        self._reset_stats()
        contract.register_outside_front_door(self)

    def finalize(self) -> None:
        """The last step of a configure: _finalize_initialization (the seed's name)."""
        self._finalize_initialization()

    def initialize(self) -> None:
        """Pack, one model.to(device) (skipped for DTensor weights), finalise."""
        contract.check_configurable(self.model, [self])
        with stages.attached([self], self.options), contract.rollback_on_failure([(self.model, [self])]):
            self._initialize_layer_weights()
            contract.move_non_layer_weights(self.model, self.device)
            self._finalize_initialization()

    # -------------------------------------------------------------- runtime
    def compute_stream(self) -> int:
        """The handle of the stream the device computes on now (0: the CPU backend)."""
        return _native.current_stream_handle(self.device)

    def _load(self, i: int, prefetch: bool) -> bool:
        """Queue the fetch of streamed layer i into its slot, unless it is there
        already (and its true bytes have not changed since). False when a prefetch
        finds the slot busy: the layer that computes there keeps it."""
        ring, src = self.ring, self._host.src[i]
        version = src.version()
        if ring.holds(i, version):
            return True
        s = ring.slot_of[i]
        if ring.busy[s] and not ring.may_take(i, prefetch, self.layer_name):
            return False
        if prefetch and self._cohort.shared() and not self._cohort.may_fill(self, i, self._held(s)):
            return False  # calls still need what the slot holds, or another layer goes first
        self._dirty = True  # until the record below matches what the engine has queued
        after = ring.event[s]
        if after is not None:
            try:
                after = after.resolve()  # the slot's last fetch (a deferred one is issued now)
            except Exception:  # that fetch failed: nothing was written, its error stays with it
                self._engine.synchronize()
                after = None
        if self._engine.is_cuda:
            # Everything enqueued on the compute stream so far (the slot's last user
            # and its forward hooks) and the slot's previous fetch come before this one.
            stream = self.compute_stream()
            if after is not None:
                self._engine.wait(after, stream)
            for done in ring.take_done(s):  # other calls' computes on the slot, on their own streams
                self._engine.wait(done, stream)
            after = self._engine.record(stream, False)
        ring.gen[s] += 1
        self._cohort.fetches += 1
        ev = src.fetch(i, ring.dst[i], after, self.meter.timing)
        ring.queued(i, version, ev)
        self.meter.fetched(src, prefetch, ev, i)
        self._dirty = False
        return True

    # ------------------------------------------------- a layer's true bytes
    def layer_host(self, i: int):
        """Layer i's plan-layout bytes as a host tensor that is the truth (a write
        reaches the model), or None where the truth is elsewhere (disk, encoded)."""
        return self.sources[i].host

    def read_layer(self, i: int) -> torch.Tensor:
        """Layer i's true bytes in plan layout (host uint8; the arena block or a copy)."""
        if self.streaming and self.sources[i].host is None:
            with self._lock:  # a file's recovery changes shared state
                return self.sources[i].read()
        return self.sources[i].read()

    def write_layer(self, i: int, edit) -> None:
        """Change layer i's true bytes: `edit(block)` writes into its plan-layout
        host bytes, which then become the truth (the source refuses, before
        anything changes, where it cannot be written). Its slot reloads."""
        src = self.sources[i]
        block = src.host
        if block is None:
            block = src.read()
            if block is src.host:
                block = block.clone()
            edit(block)
            with self.queueing(self.streaming):  # a disk source waits for its reads and rewrites its file
                if self.streaming:
                    self.chain.flush()  # nothing queued still reads what the write replaces
                with contract.defer_interrupts():  # the layer's bytes, CRC and version change together
                    src.write(block)
        else:
            edit(block)
        contract.arena_written(self, i)

    def _resync(self) -> None:
        """After an interrupt between a queued copy and its record: wait for every
        copy and forget what the slots hold; the next uses reload."""
        self.chain.forget()
        try:
            self._engine.synchronize()
        except Exception:  # noqa: BLE001 - a failed copy (after a failed split gather, say): the engine stops
            self.ring.wait_for_fetches()  # at it: wait for each slot's last fetch instead
        self.ring.reset(self._engine.record(self.compute_stream(), False) if self._engine.is_cuda else None)
        self._dirty = False

    def _fetch_failed(self, i: int, err: BaseException) -> None:
        """Waiting for layer i's fetch raised `err`: the slot reloads at its next use;
        raises the source's own error where it has one (a split gather's SplitError,
        which the native event gives back as a ReadError), else returns (re-raise)."""
        self.ring.forget(i)
        exc = self.sources[i].fetch_failed(err)
        if exc is not err:
            raise exc from None

    def forget_slots(self) -> None:
        """What the slots hold is unknown (a split-fetch collective failed): the
        next hook waits for every copy and reloads the layers it needs."""
        self._dirty = True

    def forget_entered(self) -> None:
        """Forget layers left 'computing' by a forward that an interrupt abandoned."""
        self.ring.forget_entered()
        self._dirty = True

    def forget_abandoned_forward(self) -> None:
        """No forward of this thread is in flight (the model's root pre-hook, tune
        after its run): what a forward that an exception or an interrupt abandoned
        inside a layer left behind (layers marked computing, this thread's
        saved-tensor hooks) is forgotten. Called holding the model's lock."""
        me = threading.get_ident()
        if self.ring.computing() or any(o == me for o, _ in self._grad_hooks):
            self._reset_entered()

    def link_next(self, group: "LayerwiseOffloadManager") -> None:
        """`group`'s layers follow this group's last one: its prefetches continue into
        them (cross-group prefetch, contract.registry.link)."""
        self.next_manager = group
        if self._cohort is not None:
            self._cohort.regroup()

    def _reset_entered(self) -> None:
        """forget_entered, and this thread's saved-tensor hooks of that forward."""
        self.forget_entered()
        me = threading.get_ident()
        for owner, ctx in reversed(self._grad_hooks):
            if owner == me:
                ctx.__exit__(None, None, None)
        self._grad_hooks = [(o, c) for o, c in self._grad_hooks if o != me]

    def _prefetch_after(self, i: int, extra: int = 0) -> None:
        """Issue copies of the next prefetch_depth (+ extra) streamed layers after
        layer i, continuing into the next group (and wrapping around) at the end."""
        want = self.options.prefetch_depth + extra
        mgr, pos = self, self.ring.next_pos[i] + (1 if self.ring.slot_of[i] >= 0 else 0)
        for _ in range(64):  # a walk over the chain of groups, bounded
            for j in mgr.ring.streamed[pos : pos + want]:
                if mgr is self and j == i:
                    want = 0
                    break  # wrapped back onto the computing layer
                if mgr._dirty:
                    mgr._resync()
                mgr._load(j, prefetch=True)
                want -= 1
            if want <= 0 or self._captured:  # (a replay cannot know what an eager prefetch left in a slot)
                break
            mgr, pos = mgr.next_manager, 0
        chain = self._host.chain
        if chain.reads_ahead:
            with self.queueing():  # reads queued and not recorded yet: an interrupt makes the next hook resync
                chain.read_ahead(i)

    @contextlib.contextmanager
    def queueing(self, mark: bool = True):
        """Around a call that queues work the records do not show yet: an exception or
        an interrupt inside leaves the group marked dirty (the next hook resyncs)."""
        self._dirty = mark
        yield
        self._dirty = False

    def _ready(self, i: int, s: int, load: bool = True):
        """Make streamed layer i ready in its slot s: queue its fetch if the slot does
        not hold it (`load`), issue what it waits on (a deferred stage: a disk read, a
        gather); returns the event the compute must wait on, or None."""
        if load:
            self._load(i, prefetch=False)
        ev = self.ring.fetched[i]
        if ev is None or (not self._host.chain.pending.items and not stages.is_deferred(ev)):
            return ev  # (nothing deferred: the hot path stays free of the context manager)
        try:
            with self.queueing():
                self.chain.settle()  # collectives queued before this layer's, in order
                return ev.resolve()
        except BaseException:
            self.ring.forget(i)  # the next call of the layer fetches it again
            raise

    def add_hooks(self, handles) -> None:
        """Hook handles removed with the group (the contract's guards on modules added later)."""
        self._hooks.extend(handles)

    def wait_ready(self, i: int) -> None:
        """Layer i in its slot, waited for on the host (an edit in place, contract.editing)."""
        if self._dirty:
            self._resync()
        s = self.ring.slot_of[i]
        ev = self._ready(i, s)
        if ev is not None:
            try:
                ev.synchronize()
            except Exception as err:
                self._fetch_failed(i, err)  # a split gather's failure is a SplitError
                raise
            self.ring.fetched[i] = None
        if s >= 0:
            self.chain.fill(i)  # rows a stage copies on demand only (routed experts), for the edit

    def _check_slot_writes(self, s: int) -> None:
        """Our fetches do not bump version counters: a change means someone wrote into
        the slot in place (a streamed weight edited outside load_state_dict)."""
        if self.ring.slots[s]._version != self.ring.seen[s]:
            self.ring.refuse_write_in_place(s, self.plan, self._host.blocks, self._engine, self.layer_name)

    def calls_under_way(self) -> int:
        """Forwards of the model under way now, on every thread (runtime/cohort.py)."""
        return len(self._cohort.calls) if self._cohort is not None else 0

    def _held(self, s: int) -> int:
        """The layer whose current bytes slot s holds (fetched or queued), or -1."""
        h = self.ring.holder[s]
        return h if h >= 0 and self.ring.version[s] == self._host.src[h].version() else -1

    def _join(self, i: int) -> None:
        """Phase 1 of streamed layer i's pre-hook while other calls of the model are
        under way (runtime/cohort.py): join the fetch of layer i in its slot, or queue
        it when the schedule lets the slot be refilled, or wait (without the model's
        lock) until it does; then, on the CPU backend, wait for the bytes, still
        without the lock, so that another call computes meanwhile. Phase 2 (the rest
        of the pre-hook, under the lock) checks the slot again: nothing here decides
        what a layer computes with."""
        co, lock = self._cohort, self._lock
        call = co.mine()
        if call is None or lock.is_owned():  # a block called alone, or inside another block
            return
        ring = self.ring
        s = ring.slot_of[i]
        if s >= 0 and not self._dirty and self._held(s) == i and call.state == cohort.RUNNING:
            # The fast path: a prefetch (or another call) queued layer i into its slot, so
            # the call joins it without the model's lock, which the call computing now
            # holds: calls in step hand each layer on with one lock round trip, not two.
            # Read without the lock, what it finds may change at once; phase 2 checks
            # the slot again under the lock (a holding replaced meanwhile reloads).
            co.joined_held(call, self, i)
            ev = ring.fetched[i]
        else:
            ev = self._join_slow(co, lock, call, i)
        if ev is not None and not self._engine.is_cuda and not stages.is_deferred(ev):
            t = time.perf_counter()
            try:
                ev.synchronize()
            except Exception:  # noqa: BLE001 - waited for again under the lock, where the failure is handled
                pass
            call.stall_s += time.perf_counter() - t

    def _join_slow(self, co, lock, call, i: int):
        """Phase 1 under the model's lock: join, queue or wait (_join); the result
        of the fetch it joined or queued, or None."""
        ev, waited, loaded = None, False, False
        try:
            while True:
                seq = co.seq()
                with lock:
                    if self.state is not Lifecycle.STREAMING or self.guard.error is not None or self._capturing():
                        return None
                    # (read under the lock at each look: set_residency meanwhile replaces the ring)
                    s = self.ring.slot_of[i]
                    if s < 0:
                        return None  # made resident meanwhile: nothing to fetch
                    if self._dirty:
                        self._resync()
                    co.waiting(call, self, i)
                    held = self._held(s)
                    loaded = held != i and co.may_fill(self, i, held)
                    if loaded:
                        self._load(i, prefetch=False)
                    if loaded or held == i:
                        ev = self.ring.fetched[i]
                        co.joined(call, self, i, not loaded, waited)
                        break
                waited = True
                co.wait(seq)
                if cohort.CANCELLED:
                    cohort.check_cancelled()
        finally:
            if call.state == cohort.WAITING:  # (an interrupt, or the model stopped streaming)
                call.at(cohort.RUNNING)
        if loaded:
            co.notify()
        return ev

    def _pre_hook(self, i: int, module, args):
        call = None
        if turns.SESSION and self.state is Lifecycle.STREAMING and not self._lock.is_owned() \
                and turns.layer(self.model):
            # A call of run_together on a split-fetch model, its turn's baton in hand
            # (runtime/turns.py): then as a call alone, the fetch kept for the other members.
            # (Not cancelled here: a turn runs to its end on every rank; a Ctrl-C stops the
            # calls at the next turn's agreement.)
            call = self._cohort.mine()
        else:
            if cohort.CANCELLED:
                cohort.check_cancelled()
            if self.state is Lifecycle.STREAMING and self._cohort.shared() and self.ring.slot_of[i] >= 0:
                self._join(i)
                call = self._cohort.mine()
        # Released by the post-hook (which also runs when a forward raises; a hold that
        # a KeyboardInterrupt abandons is taken over by the next thread: contract.ModelLock).
        self._lock.acquire(contract.module_call_frame())
        if call is not None:
            call.at(cohort.COMPUTING)
            if call.stall_s:
                self.meter.stalled(call.stall_s)
                call.stall_s = 0.0
        if self.state is not Lifecycle.STREAMING:  # removed while this call waited for the lock: runs plain
            if call is not None:
                self._cohort.left(call, self, i)
            self._lock.release()
            return
        if self.guard.error is not None:
            raise RuntimeError(self.guard.error)
        if self._capturing():
            self._enter_captured(i)
            return
        self._capture = None  # (a capture that failed part way leaves nothing behind)
        if self._dirty:
            self._resync()
        if i == 0 and not self.meter.root_driven:
            self.new_step()  # blocks called without the model's forward: a step per layer 0
        chain = self._host.chain  # (the hooks run per layer: locals, not properties, on their path)
        if chain.reads_ahead or chain.pending.items:
            with self.queueing():
                chain.pump()
        s = self.ring.slot_of[i]
        if s >= 0:
            self._check_slot_writes(s)
            self._load(i, prefetch=False)
            self.ring.enter(i)
            ev = self._ready(i, s, load=False)
            # The next layers' copies are queued before this one is waited for: where the wait
            # blocks the host (the CPU backend), the bus then never idles between two layers.
            self._prefetch_after(i)
            if ev is not None:
                try:
                    meanwhile = chain.meanwhile(i) if chain.reads_ahead else None
                    if meanwhile is None:
                        self.meter.wait(self._engine, ev, self.compute_stream())
                    else:
                        with self.queueing():  # (reads and copies issued while the host waits)
                            self.meter.wait(self._engine, ev, self.compute_stream(), meanwhile)
                except Exception as err:
                    self._fetch_failed(i, err)
                    raise
                if call is None:  # (calls that share the fetch each make their own stream wait for it)
                    self.ring.fetched[i] = None
            if torch.is_grad_enabled():
                ctx = contract.saved_slot_hooks(self)
                ctx.__enter__()
                self._grad_hooks.append((threading.get_ident(), ctx))
        else:
            self.ring.enter(i)
            self._prefetch_after(i)

    def enter_layer(self, i: int) -> None:
        """Layer i is about to compute: its weights ready in its slot, the compute
        stream waiting for them, the next prefetches issued (the pre-hook; the kernel
        of layerwise::layer_ready). Holds the model's lock until leave_layer."""
        self._pre_hook(i, None, None)

    def leave_layer(self, i: int, outputs=()) -> None:
        """Layer i has computed (the forward hook; the kernel of
        layerwise::layer_done, with the output's tensors). A compiled graph cannot
        take a replaced output: an output that is a view of the layer's own slot
        is refused (eager, the hook returns a copy instead)."""
        aliased = self.streaming and self.ring.slot_of[i] >= 0 and any(self.ring.aliases(t) for t in outputs)
        self._post_hook(i, None, None, None)
        if aliased:
            raise RuntimeError(
                f"layerwise: layer {self.layer_name}[{i}] returned a view of its own streamed weights under "
                "torch.compile; the next fetch into its slot would change that output. Return a copy "
                "(.clone()) from the block's forward, or keep the layer resident (resident=[...]).")

    def _capturing(self) -> bool:
        """The device's current stream captures a CUDA graph (never on the CPU backend)."""
        return self._engine.is_cuda and gpu_checks.stream_capturing(self.device)

    def _enter_captured(self, i: int) -> None:
        """The pre-hook under CUDA graph capture: the step's copies and waits as
        captured work (runtime/capture.py); the ring's record is not used, and is
        forgotten at the next eager step (replays refill the slots behind it)."""
        # A schedule begins at the step's first hook: the root pre-hook (new_step) and the
        # end of the last step (every layer computed) leave none.
        if self._capture is None:
            api = capture.CudaApi(self.device)
            why = capture.refusal(self, api)
            if why is not None:
                raise RuntimeError(f"layerwise: this step cannot be captured into a CUDA graph: {why}.")
            blocks = {j: self.sources[j].host for j in self.ring.streamed}
            # A graph replays into these slots from these blocks, and reads the resident
            # layers' tensors, whatever set_residency or a removal does later: they live
            # as long as the model (a graph of a model rarely outlives it).
            kept = self.model.__dict__.setdefault(capture.KEPT, [])
            if not any(k[0] is self.ring.slots for k in kept):
                kept.append((self.ring.slots, blocks, [p.data for p in self.plan.module_list.parameters()]))
            self._capture = capture.CaptureSchedule(self.ring, blocks, self.options.prefetch_depth, api,
                                                    self._capture_stream)
            self._captured = True
        self._capture.enter(i)
        self.ring.enter(i)

    def end_captured_step(self) -> None:
        """The model's forward ends under capture (its root post-hook): the copies of
        layers it did not call are joined, so that the capture can end."""
        if self._capture is not None:
            try:
                self._capture.join()
            finally:
                self._capture = None

    def _post_hook(self, i: int, module, args, output):
        if not self._lock.is_owned():
            return  # this thread's pre-hook never ran (an earlier hook raised)
        replaced = None
        if self._capture is not None and self.state is Lifecycle.STREAMING and self._capturing():
            try:
                self.ring.leave(i)
                if self._capture.leave(i):
                    self._capture = None
                return self.ring.own_output(output)
            finally:
                call = self._cohort.mine()
                if call is not None:  # (a captured step's copies are its own: no prefetch for other calls)
                    self._cohort.left(call, self, i)
                self._lock.release()
        try:
            chain = self._host.chain
            # (dirty: the records are stale; the next hook resyncs)
            if self.state is Lifecycle.STREAMING and not self._dirty and chain.pending.items:
                with self.queueing():  # collectives for the layers prefetched: after this layer's forward
                    chain.settle()
            if self.ring.slot_of[i] >= 0:
                replaced = self.ring.own_output(output)
            if torch.is_grad_enabled():  # its graph holds the group's parameters until its backward
                contract.track_backward(self, output if replaced is None else replaced)
            if self.ring.leave(i):
                me = threading.get_ident()
                for k in range(len(self._grad_hooks) - 1, -1, -1):
                    if self._grad_hooks[k][0] == me:
                        self._grad_hooks.pop(k)[1].__exit__(None, None, None)
                        break
                self.bound.check(self, i)  # a parameter its module rebound is adopted or refused
        finally:
            try:
                self._leave_cohort(i)
            finally:
                self._lock.release()
        return replaced

    def _leave_cohort(self, i: int) -> None:
        """This call computed layer i: the cohort's schedule moves on (runtime/cohort.py)."""
        co = self._cohort
        call = co.mine()
        if call is None:
            return
        co.left(call, self, i)
        if self.state is not Lifecycle.STREAMING or self._dirty:
            return
        shared = co.shared()
        s = self.ring.slot_of[i]
        if s >= 0 and self._engine.is_cuda and (shared or (turns.SESSION and self.tiers.split_store is not None)):
            # the next fetch into the slot waits for this call's compute (on its own stream)
            stream = self.compute_stream()
            self.ring.computed(s, stream, self._engine.record(stream, False))
        if not shared:
            return
        if s >= 0 and co.joined_to(self, i):
            # Calls that joined layer i still compute on it: its slot stays, and this call's
            # move changed no other slot's ranks. The last of them queues and wakes.
            return
        self._prefetch_after(i, extra=1)  # (the slot of layer i may be free now)
        co.notify()

    # ---------------------------------------------------------------- stats
    def _reset_stats(self) -> None:
        self.meter.reset(cuda=self.streaming and self._engine.is_cuda)

    def new_step(self, joining: bool = False) -> None:
        """A step of the model begins (its root pre-hook; layer 0 where blocks are called alone).
        `joining`: the forward joins calls under way on other threads, whose step it shares."""
        if self.guard.handed_out:
            contract.check_handed_out(self)
        if self._capturing():
            self._capture = None  # a step begins: a schedule an interrupted capture left is not this one's
        elif self._captured:
            self._resync()  # graph replays may have refilled the slots behind the record
        if not (joining and self.meter.step_open):
            self.meter.new_step()

    def _stage_counts(self) -> tuple:
        chain = getattr(self, "_chain", None)
        return chain.counts() if chain is not None else (0, 0.0)

    def stats(self, sync: bool = False) -> dict:
        """Bytes copied, copies, synchronous loads and compute-stream stall time,
        in total and for the last complete step, plus the memory this group uses.
        Never waits for the device unless `sync=True` (then every copy and the
        compute stream are drained first, so every figure is final)."""
        if sync and self.enabled and self.streaming:
            if not self.chain.idle():
                with self._lock, self.queueing():
                    self.chain.flush(collectives=False)  # (stats() is not collective)
            self._engine.synchronize()
            if self._engine.is_cuda:
                torch.cuda.synchronize(self.device)
        if self.streaming:
            self.meter.resolve()
        host = self._host.figures(self.packed, self.streaming)
        out = {
            "group": self.layer_name,
            "device": str(self.device),
            "layers": self.num_layers,
            "resident_layers": list(self.resident),
            "prefetch_depth": self.prefetch_depth,
            "slots": self.ring.num_slots if self.ring is not None else 0,
            "ring_bytes": sum(t.numel() for t in self.ring.slots) if self.ring is not None else 0,
            "resident_bytes": self._resident_bytes,
            "placement": self.placement,  # what chose it, where set_residency changed it (layerwise.tune)
            **host,  # arena bytes and pinning, and the stages' own figures (compress, disk, split fetch)
            "managed_bytes": self.plan.managed_bytes,
            **self.meter.figures(),
            # the model's calls under way at once and the fetches they shared (runtime/cohort.py)
            "calls": {**self._cohort.figures(), **turns.figures(self.model)} if self._cohort is not None else None,
        }
        return out

    # --------------------------------------------------------------- remove
    # Removal is a transaction in two phases. `prepare_removal` builds every packed
    # parameter's ordinary tensor with its true bytes and changes nothing: a failure
    # (a file gone, no memory) or a Ctrl-C there leaves the group streaming exactly,
    # and a retry starts over. `commit_removal` only rebinds and releases, nothing
    # that can fail; callers hold Ctrl-C back around it (contract.defer_interrupts).
    def _drain(self) -> None:
        """Wait for every read and copy in flight (they write into staging and the ring)."""
        if not self.streaming:
            return
        with self.queueing():  # an interrupt in here: the next hook resynchronises
            self.chain.flush()
        self._engine.synchronize()
        self.meter.resolve()

    def prepare_removal(self, original_devices: bool = False) -> list:
        """[(entry, new data or None)] for every packed parameter (HostLayers.prepare_removal)."""
        self._drain()
        if not self.streaming:
            return self._host.prepare_removal(set(), self.device, original_devices)
        with self._lock:  # a parameter a library rebound gives back what it computes from
            self.bound.check_all(self, removing=True)
        prepared = self._host.prepare_removal(set(self.resident), self.device, original_devices)
        return self.bound.give_back_held(prepared, original_devices)

    def commit_removal(self, prepared: list) -> None:
        """Rebind every parameter to what `prepare_removal` built, then release the
        hooks, ring, engine, arena, tiers and files. Nothing here raises."""
        for h in self._hooks + self._guard_hooks:
            h.remove()
        self._hooks, self._guard_hooks = [], []
        for lp in self.plan.layers:
            compile_guard.unmark_streamed(lp.module)
        for _, ctx in self._grad_hooks:
            try:
                ctx.__exit__(None, None, None)
            except Exception:  # (a saved-tensor hook stack another thread popped)
                pass
        HostLayers.give_back(prepared)
        # Events hold the tensors their copies read and wrote (ring slices, arena
        # blocks): drop them, or the ring and the pinned arena outlive the removal.
        if self.ring is not None:
            self.ring.release()
        self.ring = None
        self.meter.dropped()
        self._grad_hooks = []
        self._host.release()
        self._resident_bytes = 0
        self._engine = None
        self.state = Lifecycle.PLANNED
        if self.plan.module_list.__dict__.get(GROUP_KEY) is self:
            del self.plan.module_list.__dict__[GROUP_KEY]
        compile_guard.drop_instance_graphs()

    def _restore_parameters(self, original_devices: bool = False) -> None:
        """Give every packed parameter an ordinary tensor again with its true bytes
        (a configure's rollback: Ctrl-C is held back by the caller)."""
        self.commit_removal(self.prepare_removal(original_devices))

    def remove(self, original_devices: bool = False) -> None:
        """Undo the offload of this group: hooks removed, ordinary parameters on the
        device (or, with original_devices, where each one was before packing).
        Transactional: if it raises (or is interrupted), the group still streams
        exactly and remove() can be called again."""
        contract.remove_models([(self.model, [self])], original_devices)

    def __reduce_ex__(self, protocol):
        raise TypeError(contract.COPY_REFUSED)

    def __deepcopy__(self, memo):
        raise TypeError(contract.COPY_REFUSED)

    def __repr__(self) -> str:
        return (f"LayerwiseOffloadManager({self.layer_name!r}, layers={self.num_layers}, device={self.device}, "
                f"prefetch_depth={self.prefetch_depth}, resident={len(self.resident)}, enabled={self.enabled})")


for _name in ("pin_memory", "residency_policy", "num_copy_streams", "debug_copy_delay_us", "measure_stalls",
              "disk_prefetch_depth", "debug_read_delay_us", "split_fetch"):  # read-only: set them through `options`
    setattr(LayerwiseOffloadManager, _name, property(lambda self, _n=_name: getattr(self.options, _n)))
