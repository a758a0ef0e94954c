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
slot) and issues the next copies; the post-hook records "slot free". A copy into
a slot always waits on the slot's last event, so no slot is overwritten while a
layer that uses it may still be computing.
"""
from __future__ import annotations

import functools
import logging
import sys
import time
from numbers import Real

import torch
from torch import nn

from . import _native
from .plan import BLOCK_ALIGN, GroupPlan, assign_slots, build_group_plan, local_tensor, round_up

log = logging.getLogger("layerwise")

_PROGRESS_MIN_BYTES = 1 << 30


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


def _validate_depth(prefetch_depth) -> int:
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int):
        raise TypeError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
    return prefetch_depth


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
        pin_memory: bool = True,
        initialize: bool = True,
        num_copy_streams: int = 1,
        debug_copy_delay_us: int | None = None,
        measure_stalls: bool = True,
    ):
        self.prefetch_depth = _validate_depth(prefetch_depth)
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
        self.pin_memory = bool(pin_memory)
        self.num_copy_streams = int(num_copy_streams)
        if self.num_copy_streams < 1:
            raise ValueError(f"num_copy_streams must be >= 1, got {num_copy_streams}")
        self.debug_copy_delay_us = debug_copy_delay_us
        self.measure_stalls = measure_stalls
        self.enabled = self.num_layers > 0 and self.plan.managed_bytes > 0
        self.next_manager: LayerwiseOffloadManager = self  # whose layers follow our last one
        self._packed = False
        self._finalized = False
        self._arena = None
        self._host_blocks: list[torch.Tensor | None] = []
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
        self.prefetch_depth = _validate_depth(prefetch_depth)

    def _device_bytes(self, resident: list[int] | None = None, prefetch_depth: int | None = None) -> int:
        """Device bytes of ring + resident layers for a residency plan (default: the current one)."""
        resident = set(self.resident if resident is None else resident)
        depth = self.prefetch_depth if prefetch_depth is None else prefetch_depth
        streamed = [lp.nbytes for lp in self.plan.layers if lp.index not in resident]
        _, slots = assign_slots(len(streamed), depth)
        return slots * max(streamed, default=0) + sum(self.plan.layers[i].nbytes for i in resident)

    # ------------------------------------------------------------------ pack
    def _arena_capacity(self) -> int:
        return sum(round_up(lp.nbytes, BLOCK_ALIGN) for lp in self.plan.layers)

    def _initialize_layer_weights(self, fill=None) -> None:
        """Pack every layer into the host arena; managed parameters become (1,) placeholders.

        Originals are freed as each parameter is packed (and the arena's pages are
        committed and pinned as they are filled), so host memory holds the model
        about once. No other parameter moves. On failure the group is restored.
        `fill(entry, block)`, if given, writes each parameter's values into its
        place in the layer's host block instead of copying the parameter (it
        reads them from a checkpoint, say).
        """
        if self._packed or not self.enabled:
            return
        total = self._arena_capacity()
        self._arena = _native.HostArena(total, pinned=self.pin_memory, cuda=self.device.type == "cuda")
        self._placeholders = {}
        self._host_blocks = []
        bar = None
        if total >= _PROGRESS_MIN_BYTES and sys.stderr.isatty():
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"layerwise: packing {self.layer_name}")
        try:
            for lp in self.plan.layers:
                block = self._arena.allocate(lp.nbytes, alignment=BLOCK_ALIGN)
                self._host_blocks.append(block)
                for e in lp.params:
                    if fill is not None:
                        fill(e, block)
                    else:  # the parameter's storage span, byte for byte
                        data = local_tensor(e.param.data)
                        flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())
                        block[e.offset : e.offset + e.span_bytes].copy_(flat.view(torch.uint8))
                        del data, flat
                    e.param.data = e.wrap(self._placeholder(e.dtype))
                if bar is not None:
                    bar.update(round_up(lp.nbytes, BLOCK_ALIGN))
        except BaseException:
            self._restore_parameters(original_devices=True)
            raise
        finally:
            if bar is not None:
                bar.close()
        self._packed = True
        self.plan.module_list._layerwise_manager = self

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.zeros((1,), dtype=dtype, device=self.device)
        return self._placeholders[dtype]

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
            slot_bytes = max((layers[i].nbytes for i in self._streamed), default=0)
            self._ring = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.num_slots)]
            self._slot_holder = [-1] * self.num_slots
            self._active = -1  # the layer between its pre- and post-hook
            # The last copy into, or last use of, each slot. On CUDA the ring's memory may
            # have been freed by work still queued on the compute stream: wait for it.
            start = self._engine.record(self._stream(), False) if self._engine.is_cuda else None
            self._slot_event = [start] * self.num_slots
            self._copy_event = [None] * self.num_layers
            self._resident_blocks = {}
            for i in self.resident:
                buf = torch.empty(layers[i].nbytes, dtype=torch.uint8, device=self.device)
                self._engine.copy_async(buf, self._host_blocks[i], start).synchronize()
                self._resident_blocks[i] = buf
            # Each streamed layer's copy destination: the front of its slot.
            self._dst = [self._ring[s][: lp.nbytes] if s >= 0 else None for s, lp in zip(self._slot_of, layers)]
            for lp in layers:
                block = self._resident_blocks.get(lp.index)
                if block is None:
                    block = self._ring[self._slot_of[lp.index]]
                for e in lp.params:
                    e.param.data = e.wrap(e.view_in(block))
            for i in self._streamed[: self.prefetch_depth]:
                self._load(i, prefetch=True)
            # Hooks run eagerly under torch.compile: dynamo skips them instead of
            # tracing into the copy engine (one graph per block, no recompiles).
            for lp in layers:
                pre = torch.compiler.disable(functools.partial(self._pre_hook, lp.index))
                post = torch.compiler.disable(functools.partial(self._post_hook, lp.index))
                self._hooks.append(lp.module.register_forward_pre_hook(pre))
                self._hooks.append(lp.module.register_forward_hook(post, always_call=True))
        self._finalized = True
        self._reset_stats()

    def initialize(self) -> None:
        """Pack, one model.to(device) (skipped for DTensor weights), finalise."""
        from .configure import _attach, move_non_layer_weights

        self._initialize_layer_weights()
        move_non_layer_weights(self.model, self.device)
        self._finalize_initialization()
        _attach(self.model, [self])

    # -------------------------------------------------------------- runtime
    def _stream(self) -> int:
        return _native.current_stream_handle(self.device)

    def _load(self, i: int, prefetch: bool) -> None:
        """Issue the copy of streamed layer i into its slot, unless it is there already."""
        s = self._slot_of[i]
        if self._slot_holder[s] == i:
            return
        if prefetch and self._active >= 0 and self._slot_holder[s] == self._active:
            return  # never overwrite the slot of the layer that is computing
        dst = self._dst[i]
        ev = self._engine.copy_async(dst, self._host_blocks[i], self._slot_event[s])
        self._slot_holder[s] = i
        self._slot_event[s] = ev
        self._copy_event[i] = ev
        self._bytes += dst.numel()
        self._copies += 1
        if not prefetch:
            self._sync_loads += 1

    def _prefetch_after(self, i: int) -> None:
        """Issue copies of the next prefetch_depth streamed layers after layer i,
        continuing into the next group (and wrapping around) at the end."""
        want = self.prefetch_depth
        mgr, pos = self, self._next_pos[i] + (1 if self._slot_of[i] >= 0 else 0)
        for _ in range(64):  # a walk over the chain of groups, bounded
            for j in mgr._streamed[pos : pos + want]:
                if mgr is self and j == i:
                    return  # wrapped back onto the computing layer
                mgr._load(j, prefetch=True)
                want -= 1
            if want <= 0:
                return
            mgr, pos = mgr.next_manager, 0

    def _pre_hook(self, i: int, module, args):
        if i == 0:
            self._new_step()
        self._active = i
        s = self._slot_of[i]
        if s >= 0:
            if self._slot_holder[s] != i:
                self._load(i, prefetch=False)
            ev = self._copy_event[i]
            if ev is not None:
                stream = self._stream()
                if self.measure_stalls:
                    if self._engine.is_cuda:
                        start = self._engine.record(stream, True)
                        self._engine.wait(ev, stream)
                        self._stall_pairs.append((start, self._engine.record(stream, True)))
                    else:
                        t0 = time.perf_counter()
                        self._engine.wait(ev, stream)
                        self._stall_s += time.perf_counter() - t0
                else:
                    self._engine.wait(ev, stream)
                self._copy_event[i] = None
        self._prefetch_after(i)

    def _post_hook(self, i: int, module, args, output):
        self._active = -1
        s = self._slot_of[i]
        if s >= 0 and self._engine.is_cuda:
            # The next copy into this slot waits for the compute enqueued so far.
            # (On the CPU backend compute is synchronous: the slot is free now.)
            self._slot_event[s] = self._engine.record(self._stream(), False)

    # ---------------------------------------------------------------- stats
    def _reset_stats(self) -> None:
        self._bytes = self._copies = self._sync_loads = 0
        self._stall_s = 0.0
        self._stall_pairs = []
        self._steps = 0
        self._step_mark = (0, 0, 0, 0.0)
        self._step_t0 = None
        self._last_step = None

    def _resolve_stalls(self) -> None:
        pending = []
        for a, b in self._stall_pairs:
            if b.query():
                self._stall_s += a.elapsed_ms(b) / 1e3
            else:
                pending.append((a, b))
        self._stall_pairs = pending

    def _new_step(self) -> None:
        self._resolve_stalls()
        now = (self._bytes, self._copies, self._sync_loads, self._stall_s)
        t = time.perf_counter()
        if self._steps:
            self._last_step = dict(zip(("bytes_copied", "copies", "sync_loads", "stall_s"),
                                       (a - b for a, b in zip(now, self._step_mark))))
            self._last_step["wall_s"] = t - self._step_t0  # host time from one step's start to the next
        self._step_mark = now
        self._step_t0 = t
        self._steps += 1

    def stats(self) -> dict:
        """Bytes copied, copies, synchronous loads and compute-stream stall time,
        in total and for the last complete step, plus the memory this group uses."""
        if self.enabled and self._finalized and self._engine.is_cuda:
            self._engine.synchronize()
            torch.cuda.synchronize(self.device)
        self._resolve_stalls()
        return {
            "group": self.layer_name,
            "device": str(self.device),
            "layers": self.num_layers,
            "resident_layers": list(self.resident),
            "prefetch_depth": self.prefetch_depth,
            "slots": getattr(self, "num_slots", 0),
            "ring_bytes": sum(t.numel() for t in getattr(self, "_ring", [])),
            "resident_bytes": sum(t.numel() for t in getattr(self, "_resident_blocks", {}).values()),
            "arena_bytes": self._arena.capacity if self._arena is not None else 0,
            "arena_pinned": bool(self._arena.pinned) if self._arena is not None else False,
            "managed_bytes": self._managed_parameter_bytes(),
            "steps": self._steps,
            "bytes_copied": self._bytes,
            "copies": self._copies,
            "sync_loads": self._sync_loads,
            "stall_s": self._stall_s,
            "last_step": self._last_step,
        }

    # --------------------------------------------------------------- remove
    def _restore_parameters(self, original_devices: bool = False) -> None:
        """Give every packed parameter an ordinary tensor again, read from the arena."""
        for lp, block in zip(self.plan.layers, self._host_blocks):
            if block is None:
                continue
            for e in lp.params:
                dev = e.orig_device if original_devices else self.device
                if dev.type == "meta":
                    continue  # it had no data to give back (checkpoint loading swaps it back)
                out = torch.empty(e.span_bytes, dtype=torch.uint8, device=dev)
                out.copy_(block[e.offset : e.offset + e.span_bytes])
                e.param.data = e.wrap(torch.as_strided(out.view(e.dtype), e.shape, e.stride))  # its own storage
        self._host_blocks = []
        self._arena = None
        self._packed = False

    def remove(self, original_devices: bool = False) -> None:
        """Undo the offload of this group: hooks removed, ordinary parameters on the
        device (or, with original_devices, where each one was before packing)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._finalized:
            self._engine.synchronize()
            self._resolve_stalls()
        # Events hold the tensors their copies read and wrote (ring slices, arena
        # blocks): drop them, or the ring and the pinned arena outlive the removal.
        self._slot_event, self._copy_event, self._slot_holder, self._stall_pairs = [], [], [], []
        self._placeholders = {}
        if self._packed:
            # Parameters not yet restored are still bound to slot views or placeholders.
            self._restore_parameters(original_devices)
        self._ring = []
        self._dst = []
        self._resident_blocks = {}
        self._engine = None
        self._finalized = False
        if getattr(self.plan.module_list, "_layerwise_manager", None) is self:
            del self.plan.module_list._layerwise_manager

    def __repr__(self) -> str:
        return (f"LayerwiseOffloadManager({self.layer_name!r}, layers={self.num_layers}, device={self.device}, "
                f"prefetch_depth={self.prefetch_depth}, resident={len(self.resident)}, enabled={self.enabled})")
