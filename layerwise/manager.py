"""LayerwiseOffloadManager: streams one block list (nn.ModuleList) through a
device slot ring, one copy ahead of the compute that needs it.

Life cycle (DESIGN.md, data flow):
  plan      -> __init__           which parameter lives where (nothing changes yet)
  pack      -> _initialize_layer_weights   layers into the host arena, parameters
                                           replaced by (1,) placeholders
  (the caller moves the non-layer weights with one model.to)
  finalise  -> _finalize_initialization    slot ring, resident layers, parameters
                                           bound to slot views, first prefetches, hooks

Each streamed layer has a fixed slot (plan.assign_slots), so its parameters stay
bound to views of that slot and the hooks do O(1) work: the pre-hook makes the
compute stream wait for the layer's copy (loading it first if it is not in its
slot) and issues the next copies. A copy into a slot waits for everything the
compute stream has enqueued when it is issued (the slot's last user, its forward
hooks included) and for the slot's previous copy, so no slot is overwritten
while a layer that uses it may still be computing, and a slot whose layer is
computing (`_busy`) is never a prefetch target.

Robustness (the state contract, layerwise/contract.py): bookkeeping is marked
`_dirty` around every native call that queues a copy, so an exception or a
KeyboardInterrupt that lands in between makes the next hook resynchronise
(wait for every copy, forget what the slots hold) instead of trusting a record
that is behind what was queued. Forwards of one model hold the model's lock
from a layer's pre-hook to its post-hook, so two threads never interleave
inside a layer. Version counters say when someone wrote to a slot or to the
arena: a write through `state_dict()` views or `load_state_dict` reloads the
layer; an in-place write into a slot view is discarded and reported.
"""
from __future__ import annotations

import bisect
import collections
import functools
import logging
import sys
import threading
import time

import torch
from torch import nn

from . import _native, contract, stages
from .options import resolve_device, resolve_resident, validate_compress, validate_depth
from .plan import BLOCK_ALIGN, GroupPlan, assign_slots, build_group_plan, local_tensor, round_up

log = logging.getLogger("layerwise")

_PROGRESS_MIN_BYTES = 1 << 30
RECENT_STEPS = 16  # complete steps kept for stats()["recent_steps"] (report's averages)


def _stream_capturing(device: torch.device) -> bool:
    with torch.cuda.device(device):  # the current stream of `device`, which need not be the current device
        return torch.cuda.is_current_stream_capturing()


_CAPTURE_REFUSED = (
    "layerwise: layer {group}[{i}] was called inside CUDA graph capture (torch.cuda.graph, or the CUDA graphs "
    "of torch.compile(mode='reduce-overhead')). A streamed layer's copies are issued by hooks on the host and "
    "wait on events recorded outside the capture, so a graph cannot replay them. Run the streamed model "
    "eagerly or under torch.compile without CUDA graphs (mode='default' or 'max-autotune-no-cudagraphs')."
)


class LayerwiseOffloadManager:
    """Streams the layers of `model.<layer_name>` to `device` (see module doc)."""

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
    ):
        self.prefetch_depth = validate_depth(prefetch_depth)
        self.compress = validate_compress(compress)
        self.device = resolve_device(device)
        self.plan: GroupPlan = build_group_plan(model, layer_name, num_layers)
        if getattr(self.plan.module_list, "_layerwise_manager", None) is not None:
            raise RuntimeError(
                f"layer group {layer_name!r} is already offloaded; call layerwise.remove_layerwise_offload(model) first"
            )
        self.model = model
        self.layer_name = layer_name
        self.num_layers = self.plan.num_layers
        self.resident = resolve_resident(resident_layers, self.num_layers, residency_policy)
        self.residency_policy = residency_policy
        if pin_memory not in (True, False, "auto"):
            raise ValueError(f"pin_memory must be True, False or 'auto', got {pin_memory!r}")
        self.pin_memory = pin_memory
        self.num_copy_streams = int(num_copy_streams)
        if self.num_copy_streams < 1:
            raise ValueError(f"num_copy_streams must be >= 1, got {num_copy_streams}")
        self.debug_copy_delay_us = debug_copy_delay_us
        self.measure_stalls = measure_stalls
        self.disk_prefetch_depth = disk_prefetch_depth
        self.debug_read_delay_us = debug_read_delay_us
        self._disk = None  # the disk tier (stages/disk.py), when some layers stay in files
        self._disk_files: list = []  # files its layers are read from (closed by remove)
        self.split_fetch = split_fetch  # a ProcessGroup: ranks share the fetch (stages/gather.py), or None
        self.enabled = self.num_layers > 0 and self.plan.managed_bytes > 0
        self.next_manager: LayerwiseOffloadManager = self  # whose layers follow our last one
        self._packed = False
        self._finalized = False
        self._arena = None
        self._host_blocks: list[torch.Tensor | None] = []  # arena blocks (None: the layer lives elsewhere)
        self._src: list = []  # each layer's source of truth (stages/source.py)
        self._tiers: list = []  # tiers that keep layers outside the arena (stages/decode.py: CodecTier)
        self._resident_bytes = 0
        self._grad_hooks: list = []
        self._hooks = []
        self._reset_stats()
        if initialize:
            self.initialize()

    # ------------------------------------------------------------------ plan
    def _managed_parameter_bytes(self) -> int:
        """Local bytes of the parameters this manager owns (layer index < num_layers)."""
        return self.plan.managed_bytes

    def _set_residency(self, resident: list[int], prefetch_depth: int) -> None:
        if self._finalized:
            raise RuntimeError(f"{self.layer_name}: residency is fixed once finalised")
        self.resident = sorted(resident)
        self.prefetch_depth = validate_depth(prefetch_depth)

    def _device_bytes(self, resident: list[int] | None = None, prefetch_depth: int | None = None) -> int:
        """Device bytes of ring + resident layers for a residency plan (default: the current one)."""
        resident = set(self.resident if resident is None else resident)
        depth = self.prefetch_depth if prefetch_depth is None else prefetch_depth
        streamed = [lp.nbytes for lp in self.plan.layers if lp.index not in resident]
        _, slots = assign_slots(len(streamed), depth)
        return slots * max(streamed, default=0) + sum(self.plan.layers[i].nbytes for i in resident)

    # ------------------------------------------------------------------ pack
    # Layers whose truth lives elsewhere than a plain arena block (the disk tier, ...):
    # `_store(lp, scratch) -> source` takes the layer's plan-layout bytes, packed into a
    # host scratch block, and keeps them its way. None: every layer in the arena.
    _store = None
    _stored_elsewhere: frozenset = frozenset()  # their indices (no arena block of their own)
    _disk_layers: frozenset = frozenset()  # those the disk tier keeps (layerwise.hostplan)
    _disk_store = None  # its `_store`
    _split = None  # split fetch: this rank's ShareStore (stages/gather.py), which keeps its split layers

    def _choose_tiers(self) -> None:
        """Which layers a tier keeps instead of the arena, decided per layer from the
        plan and the final residency (right before packing): the disk tier's layers
        (chosen by layerwise.hostplan: `_disk_layers`, kept by `_disk_store`) stay in
        files as they are; with split_fetch (`_split`) this rank keeps its share of
        each split layer; with compress="lossless" the codec keeps the other
        streamed layers encoded (split and disk layers travel raw)."""
        self._tiers = []
        disk = self._disk_layers
        split = frozenset(self._split.spans) if self._split is not None else frozenset()
        codec: frozenset = frozenset()
        tier = None
        if self.compress == "lossless":
            tier = stages.CodecTier(self.layer_name, self.device, self.pin_memory)
            self._tiers.append(tier)
            codec = frozenset(tier.select(self.plan, self.resident)) - disk - split
        self._stored_elsewhere = disk | split | codec
        disk_store, split_store = self._disk_store, self._split

        def store(lp, scratch):
            if lp.index in disk:
                return disk_store(lp, scratch)
            if lp.index in split:
                return split_store.keep(lp, scratch)
            return tier.store(lp, scratch)

        self._store = store

    def _arena_capacity(self) -> int:
        elsewhere = self._stored_elsewhere | self._disk_layers
        return sum(round_up(lp.nbytes, BLOCK_ALIGN) for lp in self.plan.layers if lp.index not in elsewhere)

    def _initialize_layer_weights(self, fill=None) -> None:
        """Pack every layer into the host arena; managed parameters become (1,) placeholders.

        Originals are freed as each parameter is packed (and the arena's pages are
        committed and pinned as they are filled), so host memory holds the model
        about once. No other parameter moves. On failure (an exception or a
        KeyboardInterrupt at any point) every parameter packed so far gets its
        exact bytes back and the others were never touched.
        `fill(entry, block)`, if given, writes each parameter's values into its
        place in the layer's host block instead of copying the parameter (it
        reads them from a checkpoint, say); a parameter that had data of its own
        keeps it until the whole configure succeeds, so a failure gives it back.
        """
        if self._packed or not self.enabled:
            return
        with torch.inference_mode(False):  # arena blocks must be ordinary tensors (version counters)
            self._pack(fill)

    def _pack(self, fill) -> None:
        self._choose_tiers()
        total = self._arena_capacity()
        cuda = self.device.type == "cuda"
        self._arena = _native.HostArena(total, pinned=self.pin_memory is not False, cuda=cuda,
                                        device=self.device.index if cuda else -1)
        self._placeholders = {}
        self._host_blocks = []
        self._src = []
        bar = None
        if total >= _PROGRESS_MIN_BYTES and sys.stderr.isatty():
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"layerwise: packing {self.layer_name}")
        scratch = None
        try:
            for lp in self.plan.layers:
                elsewhere = lp.index in self._stored_elsewhere
                if elsewhere:  # packed into scratch, then kept by the tier's store
                    if scratch is None:
                        size = max(self.plan.layers[i].nbytes for i in self._stored_elsewhere)
                        scratch = stages.read.aligned_staging(size, pinned=False)
                    block = scratch[: lp.nbytes]
                    block.zero_()  # alignment gaps included: the layer's bytes (and CRC) are deterministic
                    self._host_blocks.append(None)
                else:
                    block = self._arena.allocate(lp.nbytes, alignment=BLOCK_ALIGN)
                    self._host_blocks.append(block)
                # (for a layer stored elsewhere: what a failure restores from, until stored)
                self._src.append(stages.ArenaSource(block))
                for e in lp.params:
                    if fill is not None:
                        fill(e, block)
                        if not e.param.is_meta:
                            e.saved = e.param.data  # given back if configure fails later
                    else:  # the parameter's storage span, byte for byte
                        data = local_tensor(e.param.data)
                        flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())
                        block[e.offset : e.offset + e.span_bytes].copy_(flat.view(torch.uint8))
                        del data, flat
                    # Marked before the swap: a rollback that finds the mark restores the
                    # same bytes from the arena even if the swap below never happened.
                    e.packed = True
                    e.param.data = e.wrap(self._placeholder(e.dtype))
                if elsewhere:
                    self._src[-1] = self._store(lp, block)
                if bar is not None:
                    bar.update(round_up(lp.nbytes, BLOCK_ALIGN))
        except BaseException:
            with contract.defer_interrupts():
                self._restore_parameters(original_devices=True)
            raise
        finally:
            if bar is not None:
                bar.close()
        self._packed = True
        self.plan.module_list._layerwise_manager = self
        if self.pin_memory is True and self._arena.pin_error:
            # Asked for explicitly: pageable memory would silently cost the overlap. The
            # caller's rollback gives every parameter back.
            raise RuntimeError(
                f"layerwise: pin_memory=True, but the host memory of layer group {self.layer_name!r} could not be "
                f"pinned: {self._arena.pin_error}. Raise the locked-memory limit or grant CAP_IPC_LOCK, or pass "
                "pin_memory='auto' (pinned where possible, else pageable with a warning) or pin_memory=False."
            )
        if self.pin_memory == "auto":
            _native.warn_unpinned(self._arena, f"layer group {self.layer_name!r}")

    @staticmethod
    def _bind_to_slot(e, view: torch.Tensor) -> None:
        """Point a streamed parameter at its slot view. `param.data = view` would give
        it a version counter of its own; swapping in a parameter made from the view
        (which shares the slot's) keeps the Python object and lets an in-place write
        into any parameter of the slot show as a change of the slot's version."""
        p = e.param
        if e.dspec is None and isinstance(p, nn.Parameter):
            new = torch.Tensor._make_subclass(type(p), view, p.requires_grad)
            new.__dict__.update(p.__dict__)  # swap_tensors swaps __dict__ too
            try:
                torch.utils.swap_tensors(p, new)
                return
            except RuntimeError:  # referenced from C++ or weakly: bind the plain way
                pass
        p.data = e.wrap(view)

    @staticmethod
    def _materialize(e, block: torch.Tensor, device) -> torch.Tensor:
        """An ordinary tensor of its own with the parameter's bytes, shape and strides."""
        out = torch.empty(e.span_bytes, dtype=torch.uint8, device=device)
        out.copy_(block[e.offset : e.offset + e.span_bytes])
        return torch.as_strided(out.view(e.dtype), e.shape, e.stride)

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.zeros((1,), dtype=dtype, device=self.device)
        return self._placeholders[dtype]

    def _commit(self) -> None:
        """The whole configure succeeded: drop what a rollback would have needed."""
        for lp in self.plan.layers:
            for e in lp.params:
                e.saved = None

    # -------------------------------------------------------------- finalise
    def _finalize_initialization(self) -> None:
        """Ring, resident layers, parameter views, first prefetches and hooks."""
        if self._finalized or not self.enabled:
            return
        if not self._packed:
            raise RuntimeError(f"{self.layer_name}: _initialize_layer_weights() must run before finalisation")
        with torch.inference_mode(False), torch.no_grad():
            self._engine = _native.CopyEngine(
                str(self.device),
                num_streams=self.num_copy_streams,
                debug_delay_us=-1 if self.debug_copy_delay_us is None else self.debug_copy_delay_us,
            )
            self._lock = contract.model_lock(self.model)
            layers = self.plan.layers
            resident = set(self.resident)
            self._streamed = [i for i in range(self.num_layers) if i not in resident]
            colours, self.num_slots = assign_slots(len(self._streamed), self.prefetch_depth)
            self._slot_of = [-1] * self.num_layers
            for pos, i in enumerate(self._streamed):
                self._slot_of[i] = colours[pos]
            # The k-th streamed layer at or after layer i, for prefetch targets.
            self._next_pos = [0] * self.num_layers
            pos = len(self._streamed)
            for i in reversed(range(self.num_layers)):
                if i not in resident:
                    pos -= 1
                self._next_pos[i] = pos
            # A source may need more than the layer's bytes in its slot (a gather fills whole shares).
            slot_bytes = max((getattr(self._src[i], "slot_bytes", layers[i].nbytes) for i in self._streamed),
                             default=0)
            self._ring = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.num_slots)]
            self._slot_holder = [-1] * self.num_slots  # the layer whose copy was queued last into each slot
            self._busy = [0] * self.num_slots  # layers between their pre- and post-hook, per slot
            self._entered: list[int] = []  # those layers, innermost last
            self._loaded_version = [-1] * self.num_slots  # arena version of the holder when it was queued
            self._slot_gen = [0] * self.num_slots  # bumped at every copy into the slot (saved-tensor checks)
            self._grad_hooks: list = []  # saved-tensor hooks pushed by pre-hooks, popped by post-hooks
            self._dirty = False
            self._handed_out: list = []  # state_dict() tensors that alias the arena (contract.check_handed_out)
            self._arena_gen = [0] * self.num_layers  # bumped when a layer's arena bytes change after packing
            self._loaded_keys: set[str] = set()  # taken by the load_state_dict pre-hooks (contract.py)
            self._contract_error: str | None = None  # a broken contract found outside a forward
            # The last copy into each slot. On CUDA the ring's memory may have been
            # freed by work still queued on the compute stream: the first copies wait for it.
            start = self._engine.record(self._stream(), False) if self._engine.is_cuda else None
            self._slot_event = [start] * self.num_slots
            self._copy_event = [None] * self.num_layers
            # Resident layers become ordinary device tensors (one storage each, as in a
            # resident model); streamed ones are bound to views of their slot.
            for i in self.resident:
                block = self._src[i].read()
                for e in layers[i].params:
                    e.param.data = e.wrap(self._materialize(e, block, self.device))
            self._resident_bytes = sum(layers[i].nbytes for i in self.resident)
            # Each streamed layer's copy destination: the front of its slot.
            self._dst = [self._ring[s][: lp.nbytes] if s >= 0 else None for s, lp in zip(self._slot_of, layers)]
            for i in self._streamed:
                for e in layers[i].params:
                    self._bind_to_slot(e, e.view_in(self._ring[self._slot_of[i]]))
            self._ring_version = [r._version for r in self._ring]
            # Where a layer's host block spans two pinned registrations (a block too large
            # to register at once), its copy is split there: normally none.
            base = self._arena.data_ptr if self._arena is not None else 0
            self._splits = [self._arena.split_points(self._host_blocks[i].data_ptr() - base, layers[i].nbytes)
                            if i in self._streamed and self._host_blocks[i] is not None else []
                            for i in range(self.num_layers)]
            # The chain of stages that makes a layer ready in its slot (layerwise/stages):
            # each source knows its own; arena layers go through the copy engine.
            transfer = stages.Transfer(self._engine, self._host_blocks, self._splits)
            for src in self._src:
                if src.fetch is None:
                    src.fetch = transfer.fetch
            for tier in self._tiers:  # their own stages (staging buffers on the device)
                tier.start(self._engine, self.device)
            self._slot_ptrs = {r.untyped_storage().data_ptr(): s for s, r in enumerate(self._ring)}
            self._disk_order = [i for i in self._streamed if self._src[i].kind == "disk"]
            if self._disk_order:
                self._start_disk_tier()
            for i in self._streamed[: self.prefetch_depth]:
                self._load(i, prefetch=True)
            # Hooks run eagerly under torch.compile: dynamo skips them instead of
            # tracing into the copy engine (one graph per block, no recompiles).
            # The pre-hook goes first, so that a user's pre-hook registered earlier
            # (weight_norm computes `weight` in one) reads the layer's own weights.
            # Registered with Ctrl-C held back: a hook whose handle was never recorded
            # could not be removed by a rollback.
            with contract.defer_interrupts():
                for lp in layers:
                    pre = torch.compiler.disable(functools.partial(self._pre_hook, lp.index))
                    post = torch.compiler.disable(functools.partial(self._post_hook, lp.index))
                    self._hooks.append(lp.module.register_forward_pre_hook(pre, prepend=True))
                    self._hooks.append(lp.module.register_forward_hook(post, always_call=True))
                self._hooks.extend(contract.install_layer_hooks(self))
        self._finalized = True
        self._reset_stats()

    def _start_disk_tier(self) -> None:
        from .hostplan import staging_slots

        srcs = [self._src[i] for i in self._disk_order]
        self._disk = stages.DiskTier(
            self._engine, staging_slots(self, self.disk_prefetch_depth), max(src.staging_size for src in srcs),
            self.device, pinned=self.pin_memory is not False, debug_read_delay_us=self.debug_read_delay_us)
        for src in srcs:
            src.tier = self._disk
        # The disk layers streamed after layer i, in order (wrapping around), as many as
        # there are staging slots: what the hooks read ahead, fixed once here.
        n = min(len(self._disk.slots), len(srcs))
        self._upcoming_disk = []
        for i in range(self.num_layers):
            k = bisect.bisect_right(self._disk_order, i)
            self._upcoming_disk.append([srcs[(k + j) % len(srcs)] for j in range(n)])

    def initialize(self) -> None:
        """Pack, one model.to(device) (skipped for DTensor weights), finalise."""
        contract.check_configurable(self.model, [self])
        if self.split_fetch is not None:  # one collective: every rank of the group configures the same
            stages.gather.attach([self], self.split_fetch, self.device)
        with contract.rollback_on_failure([(self.model, [self])]):
            self._initialize_layer_weights()
            contract.move_non_layer_weights(self.model, self.device)
            self._finalize_initialization()

    # -------------------------------------------------------------- runtime
    def _stream(self) -> int:
        return _native.current_stream_handle(self.device)

    def _load(self, i: int, prefetch: bool) -> bool:
        """Queue the copy of streamed layer i into its slot, unless it is there
        already (and the arena has not changed since). False when a prefetch
        finds the slot busy: the layer that computes there keeps it."""
        s = self._slot_of[i]
        src = self._src[i]
        version = src.version()
        if self._slot_holder[s] == i and self._loaded_version[s] == version:
            return True
        if self._busy[s]:
            if prefetch:
                return False
            raise RuntimeError(
                f"layerwise: layer {self.layer_name}[{i}] is called while layer "
                f"{self.layer_name}[{self._slot_holder[s]}], which shares its ring slot {s}, is still computing "
                "(a block that calls another block of the same list). Keep one of them resident "
                "(resident_layers) or raise prefetch_depth so that the two get distinct slots."
            )
        self._dirty = True  # until the records below match what the engine has queued
        after = self._slot_event[s]
        if type(after) is stages.Deferred:  # the slot's last copy, out of disk staging
            try:
                after = after.resolve()
            except Exception:  # that layer's read failed: nothing was copied, its error stays with it
                self._engine.synchronize()
                after = None
        if self._engine.is_cuda:
            # Everything enqueued on the compute stream so far (the slot's last user
            # and its forward hooks) and the slot's previous copy come before this one.
            stream = self._stream()
            if after is not None:
                self._engine.wait(after, stream)
            after = self._engine.record(stream, False)
        self._slot_gen[s] += 1
        timing = self._timing
        ev = src.fetch(i, self._dst[i], after, timing)
        if timing:
            self._timed_copies.append((self._steps, ev))
        self._slot_holder[s] = i
        self._slot_event[s] = ev
        self._copy_event[i] = ev
        self._loaded_version[s] = version
        self._bytes += src.transfer_bytes
        self._bytes_raw += src.nbytes
        self._copies += 1
        if not prefetch:
            self._sync_loads += 1
        self._dirty = False
        return True

    # ------------------------------------------------- a layer's true bytes
    def _layer_host(self, i: int):
        """Layer i's plan-layout bytes as a host tensor that is the truth (a write
        reaches the model), or None where the truth is elsewhere (disk, encoded)."""
        return self._src[i].host

    def _read_layer(self, i: int) -> torch.Tensor:
        """Layer i's true bytes in plan layout (host uint8; the arena block or a copy)."""
        if self._finalized and self._src[i].host is None:
            with self._lock:  # a file's recovery changes shared state
                return self._src[i].read()
        return self._src[i].read()

    def _write_layer(self, i: int, edit) -> None:
        """Change layer i's true bytes: `edit(block)` writes into its plan-layout
        host bytes, which then become the truth (the source refuses, before
        anything changes, where it cannot be written). Its slot reloads."""
        src = self._src[i]
        block = src.host
        if block is None:
            block = src.read()
            if block is src.host:
                block = block.clone()
            edit(block)
            self._dirty = self._finalized  # a disk source waits for its reads and rewrites its file
            with contract.defer_interrupts():  # the layer's bytes, CRC and version change together
                src.write(block)
            self._dirty = False
        else:
            edit(block)
        contract.arena_written(self, i)

    def _resync(self) -> None:
        """After an interrupt between a queued copy and its record: wait for every
        copy and forget what the slots hold; the next uses reload."""
        if self._disk is not None:
            self._disk.forget()
        try:
            self._engine.synchronize()
        except Exception:  # noqa: BLE001 - a failed copy (after a failed split gather, say): the engine stops
            # at it, so wait for each slot's last copy instead; failed ones are finished too. Their layers
            # reload below (nothing computes with their bytes) and fail again, raising, if the cause stays.
            for ev in self._slot_event:
                if ev is not None and type(ev) is not stages.Deferred:
                    try:
                        ev.synchronize()
                    except Exception:  # noqa: BLE001 - as above
                        pass
        start = self._engine.record(self._stream(), False) if self._engine.is_cuda else None
        self._slot_event = [start] * self.num_slots
        self._slot_holder = [-1] * self.num_slots
        self._copy_event = [None] * self.num_layers
        self._slot_gen = [g + 1 for g in self._slot_gen]
        self._dirty = False

    def _fetch_failed(self, i: int, s: int, err: BaseException) -> BaseException:
        """Waiting for layer i's fetch into slot s raised `err`: the slot reloads at its
        next use; the error to raise is the source's own where it has one (a split
        gather's SplitError, which the native event gives back as a ReadError)."""
        self._slot_holder[s] = -1
        self._copy_event[i] = None
        failed = getattr(self._src[i], "fetch_failed", None)
        return err if failed is None else failed(err)

    def forget_slots(self) -> None:
        """What the slots hold is unknown (a split-fetch collective failed): the
        next hook waits for every copy and reloads the layers it needs."""
        self._dirty = True

    def _forget_entered(self) -> None:
        """Forget layers left 'computing' by a forward that an interrupt abandoned."""
        self._busy = [0] * self.num_slots
        self._entered = []
        self._dirty = True

    def _reset_entered(self) -> None:
        """_forget_entered, and this thread's saved-tensor hooks of that forward."""
        self._forget_entered()
        me = threading.get_ident()
        for owner, ctx in reversed(self._grad_hooks):
            if owner == me:
                ctx.__exit__(None, None, None)
        self._grad_hooks = [(o, c) for o, c in self._grad_hooks if o != me]

    def _prefetch_after(self, i: int) -> None:
        """Issue copies of the next prefetch_depth streamed layers after layer i,
        continuing into the next group (and wrapping around) at the end."""
        want = self.prefetch_depth
        mgr, pos = self, self._next_pos[i] + (1 if self._slot_of[i] >= 0 else 0)
        for _ in range(64):  # a walk over the chain of groups, bounded
            for j in mgr._streamed[pos : pos + want]:
                if mgr is self and j == i:
                    want = 0
                    break  # wrapped back onto the computing layer
                if mgr._dirty:
                    mgr._resync()
                mgr._load(j, prefetch=True)
                want -= 1
            if want <= 0:
                break
            mgr, pos = mgr.next_manager, 0
        if self._disk is not None:
            self._dirty = True  # reads queued and not recorded yet: an interrupt makes the next hook resync
            self._disk.read_ahead(self._upcoming_disk[i])
            self._dirty = False

    def _check_slot_writes(self, s: int) -> None:
        """Our copies do not bump version counters: a change means someone wrote
        into the slot in place (a streamed weight edited outside load_state_dict)."""
        v = self._ring[s]._version
        if v != self._ring_version[s]:
            self._ring_version[s] = v
            holder, self._slot_holder[s] = self._slot_holder[s], -1  # reload the true bytes
            # Which parameter: those whose bytes in the slot differ from the holder's in the arena (once
            # the copies queued are done). A prefetch may have overwritten the write already, and a
            # layer kept elsewhere (disk, encoded, split) has no arena bytes: then name the candidates.
            lp = self.plan.layers[holder] if 0 <= holder < len(self.plan.layers) else None
            host = self._host_blocks[holder] if lp is not None and holder < len(self._host_blocks) else None
            changed = []
            if host is not None:
                self._engine.synchronize()
                changed = [e.qualname for e in lp.params if not torch.equal(
                    self._ring[s][e.offset : e.offset + e.span_bytes].cpu(), host[e.offset : e.offset + e.span_bytes])]
            if changed:
                what = f"{', '.join(map(repr, changed[:6]))}, in ring slot {s}"
            else:
                sharing = [i for i, sl in enumerate(self._slot_of) if sl == s]
                rel = [e.qualname.removeprefix(f"{self.layer_name}.{holder}.") for e in (lp.params if lp else ())]
                what = (f"one bound to ring slot {s}: {', '.join(rel[:6])}{' ...' if len(rel) > 6 else ''} of "
                        f"{self.layer_name}.<i> for i in {sharing[:8]}{' ...' if len(sharing) > 8 else ''}")
            raise RuntimeError(
                f"layerwise: an in-place write to a streamed parameter ({what}) was detected and discarded: "
                "streamed weights live in the host arena "
                "and a write into the device copy would be lost or land on another layer (an optimizer step is "
                "such a write: training streamed weights is not supported). Change them with "
                "model.load_state_dict(...), or call layerwise.remove_layerwise_offload(model) first. "
                "The model computes with the weights it had."
            )

    def _pre_hook(self, i: int, module, args):
        # Released by the post-hook (which also runs when a forward raises; a hold that
        # a KeyboardInterrupt abandons is taken over by the next thread: contract.ModelLock).
        self._lock.acquire(contract.module_call_frame())
        if not self._finalized:  # removed while this call waited for the lock: the layer runs plain
            self._lock.release()
            return
        if self._engine.is_cuda and _stream_capturing(self.device):
            raise RuntimeError(_CAPTURE_REFUSED.format(group=self.layer_name, i=i))
        if self._contract_error is not None:
            raise RuntimeError(self._contract_error)
        if self._dirty:
            self._resync()
        if i == 0 and not self._root_driven:
            self._new_step()  # blocks called without the model's forward: a step per layer 0
        if self._disk is not None:
            self._dirty = True
            self._disk.pump()
            self._dirty = False
        s = self._slot_of[i]
        if s >= 0:
            self._check_slot_writes(s)
            self._load(i, prefetch=False)
            self._busy[s] += 1
            self._entered.append(i)
            ev = self._copy_event[i]
            if type(ev) is stages.Deferred:  # read from disk: its copy is issued once the read is done
                self._dirty = True
                try:
                    ev = ev.resolve()
                except BaseException:
                    self._slot_holder[s] = -1  # the next call of the layer reads it again
                    self._copy_event[i] = None
                    raise
                self._dirty = False
            if ev is not None:
                stream = self._stream()
                try:
                    if self._timing:
                        if self._engine.is_cuda:
                            start = self._engine.record(stream, True)
                            self._engine.wait(ev, stream)
                            self._stall_pairs.append((self._steps, start, self._engine.record(stream, True)))
                        else:
                            t0 = time.perf_counter()
                            self._engine.wait(ev, stream)
                            self._stall_s += time.perf_counter() - t0
                    else:
                        self._engine.wait(ev, stream)
                except Exception as err:
                    exc = self._fetch_failed(i, s, err)
                    if exc is err:
                        raise
                    raise exc from None
                self._copy_event[i] = None
            if torch.is_grad_enabled():
                ctx = contract.saved_slot_hooks(self)
                ctx.__enter__()
                self._grad_hooks.append((threading.get_ident(), ctx))
        else:
            self._entered.append(i)
        self._prefetch_after(i)

    def _post_hook(self, i: int, module, args, output):
        if not self._lock._is_owned():
            return  # this thread's pre-hook never ran (an earlier hook raised)
        replaced = None
        try:
            if self._slot_of[i] >= 0:
                replaced = self._own_output(output)
            if i in self._entered:
                del self._entered[len(self._entered) - 1 - self._entered[::-1].index(i)]
                s = self._slot_of[i]
                if s >= 0:
                    self._busy[s] -= 1
                    me = threading.get_ident()
                    for k in range(len(self._grad_hooks) - 1, -1, -1):
                        if self._grad_hooks[k][0] == me:
                            self._grad_hooks.pop(k)[1].__exit__(None, None, None)
                            break
        finally:
            self._lock.release()
        return replaced

    def _own_output(self, output):
        """A block whose output is a view of its own weights (learned query tokens
        returned as they are): the output must outlive the slot, which the next
        copies refill. Copied in that case only; None (output unchanged) otherwise."""
        def aliased(t):
            return type(t) in (torch.Tensor, nn.Parameter) and t.device == self.device and \
                t.untyped_storage().data_ptr() in self._slot_ptrs
        if isinstance(output, torch.Tensor):
            return output.clone() if aliased(output) else None
        if isinstance(output, tuple) and any(aliased(t) for t in output):
            return tuple(t.clone() if aliased(t) else t for t in output)
        return None

    # ---------------------------------------------------------------- stats
    # A step is one forward of the model (the root hooks, contract.py), prefetches
    # for the next one included; for blocks called without the model's forward, it
    # runs from one layer 0 to the next. On CUDA the compute-stream stall is timed with event pairs on
    # one step in `stall_sample_every` (each pair costs two events and two native
    # calls per layer); pairs resolve when they have completed, never by a sync.
    stall_sample_every = 8

    def _reset_stats(self) -> None:
        self._bytes = self._bytes_raw = self._copies = self._sync_loads = 0
        self._stall_s = 0.0
        self._stall_pairs = []  # (step, start event, end event), CUDA
        self._step_stall: dict[int, float] = {}
        self._timed_copies = []  # (step, copy event) of the timed steps
        self._copy_s = 0.0
        self._step_copy: dict[int, float] = {}
        self._steps = 0
        self._step_mark = (0, 0, 0, 0.0, 0, *self._disk_counts())
        self._step_t0 = None
        self._step_open = False
        self._root_driven = False  # steps follow the model's forward (contract._root_*_hook)
        self._timing = self.measure_stalls
        self._last_step = None
        self._recent = collections.deque(maxlen=RECENT_STEPS)  # the last complete steps, oldest first

    def _resolve_stalls(self) -> None:
        pending = []
        for step, ev in self._timed_copies:
            try:
                done = ev.query()
            except Exception:  # a failed fetch (a split gather): raised where its layer was needed, not timed
                continue
            if not done:
                pending.append((step, ev))
                continue
            ms = ev.copy_ms
            if ms >= 0:
                self._copy_s += ms / 1e3
                self._step_copy[step] = self._step_copy.get(step, 0.0) + ms / 1e3
        self._timed_copies = pending
        pending = []
        for step, a, b in self._stall_pairs:
            if b.query():
                dt = a.elapsed_ms(b) / 1e3
                self._stall_s += dt
                self._step_stall[step] = self._step_stall.get(step, 0.0) + dt
            else:
                pending.append((step, a, b))
        self._stall_pairs = pending

    def _new_step(self) -> None:
        if self._handed_out:
            contract.check_handed_out(self)
        self._resolve_stalls()
        if self._step_open:
            self._end_step()
        self._step_mark = (self._bytes, self._copies, self._sync_loads, self._stall_s, self._bytes_raw,
                           *self._disk_counts())
        self._step_t0 = time.perf_counter()
        self._step_open = True
        self._steps += 1
        cuda = self._finalized and self._engine.is_cuda
        self._timing = self.measure_stalls and (not cuda or self._steps % self.stall_sample_every == 1)

    def _end_step(self) -> None:
        """Close the step: its figures become the last complete step's."""
        self._step_open = False
        now = (self._bytes, self._copies, self._sync_loads, self._stall_s, self._bytes_raw, *self._disk_counts())
        last = dict(zip(("bytes_copied", "copies", "sync_loads", "stall_s", "bytes_raw", "bytes_read",
                         "read_wait_s"),
                        (a - b for a, b in zip(now, self._step_mark))))
        last["step"] = self._steps
        last["wall_s"] = time.perf_counter() - self._step_t0  # host time of the step, not of the pause after it
        last["stall_measured"] = self._timing
        last["copy_s"] = None  # filled from its copies' timings as they complete (stats())
        if self._finalized and self._engine.is_cuda:
            last["stall_s"] = None  # filled from its event pairs as they complete (stats())
        self._step_stall = {k: v for k, v in self._step_stall.items() if k >= self._steps}
        self._step_copy = {k: v for k, v in self._step_copy.items() if k >= self._steps}
        self._last_step = last
        self._recent.append(last)

    def _disk_counts(self) -> tuple:
        d = getattr(self, "_disk", None)
        return (d.bytes_read, d.read_wait_s) if d is not None else (0, 0.0)

    def _disk_stats(self) -> dict | None:
        d = self._disk
        if d is None:
            return None
        r = d.reader.stats()
        srcs = [self._src[i] for i in self._disk_order]
        return {
            "layers": len(srcs),
            "layer_bytes": sum(src.nbytes for src in srcs),
            "files": sorted({p.file.path for src in srcs for p in src.parts}),
            "spill": any(src.spill is not None for src in srcs),
            "staging_bytes": d.staging_bytes,
            "staging_slots": len(d.slots),
            "bytes_read": d.bytes_read,
            "reads": d.reads,
            "read_wait_s": d.read_wait_s,
            "read_gbps": d.timed_bytes / d.read_s / 1e9 if d.read_s else None,
            "bytes_direct": r.get("bytes_direct", 0),
            "bytes_buffered": r.get("bytes_buffered", 0),
            "read_failures": r.get("failed", 0),
        }

    def stats(self, sync: bool = False) -> dict:
        """Bytes copied, copies, synchronous loads and compute-stream stall time,
        in total and for the last complete step, plus the memory this group uses.
        Never waits for the device unless `sync=True` (then every copy and the
        compute stream are drained first, so every figure is final)."""
        if sync and self.enabled and self._finalized:
            if self._disk is not None:
                with self._lock:
                    self._dirty = True
                    self._disk.flush()
                    self._disk.synchronize()
                    self._dirty = False
            self._engine.synchronize()
            if self._engine.is_cuda:
                torch.cuda.synchronize(self.device)
        if self._finalized:
            self._resolve_stalls()
        last = self._last_step
        if last is not None and last["stall_measured"] and last["stall_s"] is None:
            pending = any(step == last["step"] for step, _, _ in self._stall_pairs)
            if not pending:
                last["stall_s"] = self._step_stall.get(last["step"], 0.0)
        if last is not None and last["stall_measured"] and last["copy_s"] is None:
            if not any(step == last["step"] for step, _ in self._timed_copies):
                last["copy_s"] = self._step_copy.get(last["step"], 0.0)
        arena = self._arena
        # Layers a tier keeps (encoded, ...) are host memory of this group too.
        tier_bytes = sum(src.stored_bytes for src, blk in zip(self._src, self._host_blocks) if blk is None)
        tier_stats = [t.stats() for t in self._tiers]
        pinned = bool(arena.pinned) if arena is not None else False
        if tier_stats and arena is not None:  # an arena left empty by a tier does not count
            pinned = (pinned or not arena.capacity) and all(t["pinned"] for t in tier_stats)
        out = {
            "group": self.layer_name,
            "device": str(self.device),
            "layers": self.num_layers,
            "resident_layers": list(self.resident),
            "prefetch_depth": self.prefetch_depth,
            "slots": getattr(self, "num_slots", 0),
            "ring_bytes": sum(t.numel() for t in getattr(self, "_ring", [])),
            "resident_bytes": self._resident_bytes,
            "arena_bytes": (arena.capacity if arena is not None else 0) + tier_bytes,
            "arena_pinned": pinned,
            "arena_pin_error": ((getattr(arena, "pin_error", None) or None) if arena is not None else None)
            or next((t["pin_error"] for t in tier_stats if t["pin_error"]), None),
            "managed_bytes": self._managed_parameter_bytes(),
            "steps": self._steps,
            "bytes_copied": self._bytes,  # bytes that crossed the bus (encoded where a layer travels so)
            "bytes_raw": self._bytes_raw,  # the same loads' bytes as the layers hold them (uncompressed)
            "copies": self._copies,
            "sync_loads": self._sync_loads,
            "stall_s": self._stall_s,
            "copy_s": self._copy_s,
            "disk": self._disk_stats() if self._finalized else None,
            "last_step": dict(last) if last is not None else None,
            "recent_steps": [dict(r) for r in self._recent],  # up to RECENT_STEPS, oldest first
            "compress": tier_stats[0] if tier_stats else None,
        }
        if self._split is not None:  # split fetch: its own figures (stages/gather.py)
            out.update(self._split.stats())
        return out

    # --------------------------------------------------------------- remove
    # Removal is a transaction in two phases. `_prepare_removal` builds every packed
    # parameter's ordinary tensor with its true bytes and changes nothing: a failure
    # (a file gone, no memory) or a Ctrl-C there leaves the group streaming exactly,
    # and a retry starts over. `_commit_removal` only rebinds and releases, nothing
    # that can fail; callers hold Ctrl-C back around it (contract.defer_interrupts).
    def _drain(self) -> None:
        """Wait for every read and copy in flight (they write into staging and the ring)."""
        if not self._finalized:
            return
        if self._disk is not None:
            self._dirty = True  # an interrupt in here: the next hook resynchronises
            self._disk.flush()
            self._disk.synchronize()
            self._dirty = False
        self._engine.synchronize()
        self._resolve_stalls()

    @staticmethod
    def _span_copy(e, data: torch.Tensor, device) -> torch.Tensor:
        """A tensor of its own on `device` with `data`'s storage span, shape and strides."""
        flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())
        out = torch.empty(e.span, dtype=e.dtype, device=device)
        out.copy_(flat)
        return torch.as_strided(out, e.shape, e.stride)

    def _prepare_removal(self, original_devices: bool = False) -> list:
        """[(entry, new data or None: keep what it has)] for every packed parameter:
        the data it had before a load (if kept), its resident copy (moved back with
        original_devices), or its bytes read from the layer's source. Parameters
        never packed are not touched; a meta parameter had no data to give back."""
        self._drain()
        resident = set(self.resident) if self._finalized else set()
        out = []
        with torch.no_grad(), torch.inference_mode(False):
            for lp, src in zip(self.plan.layers, self._src):
                block = None
                for e in lp.params:
                    if not e.packed:
                        continue
                    dev = e.orig_device if original_devices else self.device
                    new = None
                    if original_devices and e.saved is not None:
                        new = e.saved
                    elif lp.index in resident:  # an ordinary device tensor: the truth already
                        if original_devices and dev.type != "meta" and dev != self.device:
                            new = e.wrap(self._span_copy(e, local_tensor(e.param.data), dev))
                    elif dev.type != "meta":
                        if block is None:
                            block = src.read()
                        new = e.wrap(self._materialize(e, block, dev))
                    out.append((e, new))
        return out

    def _commit_removal(self, prepared: list) -> None:
        """Rebind every parameter to what `_prepare_removal` built, then release the
        hooks, ring, engine, arena, tiers and files. Nothing here raises."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for _, ctx in self._grad_hooks:
            try:
                ctx.__exit__(None, None, None)
            except Exception:  # (a saved-tensor hook stack another thread popped)
                pass
        for e, new in prepared:
            if new is not None:
                e.param.data = new
            e.saved = None
            e.packed = False
        # Events hold the tensors their copies read and wrote (ring slices, arena
        # blocks): drop them, or the ring and the pinned arena outlive the removal.
        self._slot_event, self._copy_event, self._slot_holder, self._stall_pairs = [], [], [], []
        self._timed_copies = []
        self._grad_hooks = []
        self._placeholders = {}
        self._release_storage()
        self._ring = []
        self._dst = []
        self._resident_bytes = 0
        self._engine = None
        self._finalized = False
        if getattr(self.plan.module_list, "_layerwise_manager", None) is self:
            del self.plan.module_list._layerwise_manager

    def _release_storage(self) -> None:
        """Close sources, tiers and files (spill files are deleted): best effort, logged."""
        def attempt(what, fn, *args):
            try:
                fn(*args)
            except Exception as err:  # a leak at worst; the parameters are whole already
                log.warning("layerwise: %s of group %r failed while removing: %s", what, self.layer_name, err)

        for src in self._src:
            attempt("closing a layer source", src.close)
        for tier in self._tiers:
            attempt("closing a tier", tier.close)
        self._tiers = []
        self._host_blocks = []
        self._src = []
        self._arena = None
        self._packed = False
        reader = self._disk.reader if self._disk is not None else None
        for f in self._disk_files:
            attempt(f"closing {getattr(f, 'path', 'a file')}", f.close, reader)
        self._disk_files = []
        if self._disk is not None:
            attempt("closing the disk tier", self._disk.close)
            self._disk = None

    def _restore_parameters(self, original_devices: bool = False) -> None:
        """Give every packed parameter an ordinary tensor again with its true bytes
        (a configure's rollback: Ctrl-C is held back by the caller)."""
        self._commit_removal(self._prepare_removal(original_devices))

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
