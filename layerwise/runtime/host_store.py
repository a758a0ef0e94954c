"""packing: a layer group's weights on the host side (docs/design.md, data flow:
plan -> pack -> finalise).

`HostLayers.pack` packs every layer of the group by its route (layerwise.planning.routes):
a plain layer into the group's arena (its block *is* its source), any other
into a scratch block that the chain of stages keeps its way (stages/chain.py);
every managed parameter becomes a (1,) placeholder. On failure (an exception
or a KeyboardInterrupt at any point) every parameter packed so far gets its
exact bytes back and the others were never touched.

The way back (`prepare_removal`, `give_back`, `release`) is the first phase
of the removal transaction (runtime/group.py): it reads every packed parameter's
true bytes into ordinary tensors and changes nothing until `give_back`.
"""
from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from layerwise import _native, stages
from layerwise.formats import aliases, quantized
from layerwise.planning.layout import BLOCK_ALIGN, round_up

log = logging.getLogger("layerwise")

_PROGRESS_MIN_BYTES = 1 << 30



def materialize(e, block: torch.Tensor, device) -> torch.Tensor:
    """An ordinary tensor of its own with the parameter's bytes, shape and strides."""
    out = torch.empty(e.span_bytes, dtype=torch.uint8, device=device)
    out.copy_(block[e.offset : e.offset + e.span_bytes])
    return torch.as_strided(out.view(e.dtype), e.shape, e.stride)


def span_copy(e, data: torch.Tensor, device) -> torch.Tensor:
    """A tensor of its own on `device` with `data`'s storage span, shape and strides."""
    flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())
    out = torch.empty(e.span, dtype=e.dtype, device=device)
    out.copy_(flat)
    return torch.as_strided(out, e.shape, e.stride)


def bind_to_slot(e, view: torch.Tensor) -> None:
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


def bind_layer_to_slot(entries, slot: torch.Tensor) -> None:
    """Point every parameter of a layer at its view of `slot` (a quantized wrapper:
    rebuilt once over its leaves' views)."""
    leaves = []
    for e in entries:
        if e.leaf is None:
            bind_to_slot(e, e.view_in(slot))
        else:
            leaves.append((e, e.view_in(slot)))
    bind_leaves(leaves)


def assign(pairs) -> None:
    """[(entry, data)]: each parameter's .data becomes its data (a quantized
    wrapper: rebuilt once over its leaves' tensors)."""
    leaves = []
    for e, t in pairs:
        if e.leaf is None:
            e.param.data = t
        else:
            leaves.append((e, t))
    bind_leaves(leaves)


def bind_leaves(pairs) -> None:
    """[(leaf entry, tensor)]: every quantized wrapper named rebuilt once over the
    tensors given for its leaves (the others keep what they have) and swapped into
    the same parameter object (formats/quantized.py, [Note: swap, not setattr])."""
    for w, tensors in _by_wrapper(pairs):
        quantized.rebind(w.param, w.form, tensors)


class Rebinding:
    """A change of what a layer's parameters are bound to, in two phases (the
    placement change, LayerwiseOffloadManager.set_residency): built here, where
    a quantized library's `__tensor_unflatten__` may raise and nothing changed
    yet; `commit` only swaps and assigns."""

    def __init__(self):
        self.to_slot: list = []  # (plain entry, slot view): bind_to_slot
        self.to_data: list = []  # (plain entry, tensor of its own): .data
        self.swaps: list = []  # (wrapper parameter, rebuilt wrapper)
        self.names: list = []  # each swapped wrapper's qualified name

    def slot(self, entries, slot: torch.Tensor) -> None:
        """The layer's parameters onto their views of `slot` (streamed)."""
        self._add([(e, e.view_in(slot)) for e in entries], self.to_slot)

    def data(self, pairs) -> None:
        """[(entry, tensor)]: each parameter's data becomes its tensor (resident)."""
        self._add(pairs, self.to_data)

    def _add(self, pairs, plain: list) -> None:
        plain.extend((e, t) for e, t in pairs if e.leaf is None)
        for w, tensors in _by_wrapper([(e, t) for e, t in pairs if e.leaf is not None]):
            self.swaps.append((w.param, quantized.rebuilt(w.param, w.form, tensors)))
            self.names.append(w.qualname)

    def check(self, group: str) -> None:
        """Refuse, before anything changed, a wrapper that torch.utils.swap_tensors
        would refuse in `commit` (a weak reference to it, or references to its
        tensor held elsewhere)."""
        for (param, _), name in zip(self.swaps, self.names):
            why = quantized.swap_refused(param)
            if why:
                raise RuntimeError(
                    f"layerwise: {group}: set_residency cannot rebind the {quantized.library_type(param)} weight "
                    f"{name}: {why}, and torch cannot swap a rebuilt wrapper into it. Drop that reference, then call "
                    "set_residency again. The placement is unchanged.")

    def commit(self) -> None:
        for e, view in self.to_slot:
            bind_to_slot(e, view)
        for e, t in self.to_data:
            e.param.data = t
        for param, new in self.swaps:
            torch.utils.swap_tensors(param, new)


def _by_wrapper(pairs) -> list:
    """[(leaf entry, tensor)] -> [(Wrapped, {leaf path: tensor})] for each wrapper
    named, its leaves not given keeping the tensors they have."""
    wrappers: dict = {}
    for e, t in pairs:
        wrappers.setdefault(id(e.wrapped), (e.wrapped, {}))[1][e.leaf] = t
    return [(w, {x.leaf: given[x.leaf] if x.leaf in given else x.source() for x in w.entries})
            for w, given in wrappers.values()]


def _plain(route) -> bool:
    return route.plain or route.where == "device"


class HostLayers:
    """The group's arena, each layer's source and the parameters' placeholders."""

    def __init__(self, plan, group: str, device: torch.device, pin_memory, share=None):
        self.plan, self.group, self.device, self.pin_memory = plan, group, device, pin_memory
        self.share = share  # runtime/host_share.HostShare (share_host), or None
        self.arena = None
        self.blocks: list = []  # arena blocks (None: the layer lives elsewhere)
        self.src: list = []  # each layer's source of truth (stages/source.py)
        self.chain = None  # stages.Chain
        self.routes = None  # the tier plan packed by
        self._placeholders: dict = {}

    @staticmethod
    def capacity(plan, routes) -> int:
        """The arena bytes of the plain (and resident) layers."""
        return sum(round_up(lp.nbytes, BLOCK_ALIGN) for lp, r in zip(plan.layers, routes) if _plain(r))

    def placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.zeros((1,), dtype=dtype, device=self.device)
        return self._placeholders[dtype]

    def leaf_placeholder(self, e) -> torch.Tensor:
        """A quantized wrapper's leaf while packed: the dtype's placeholder at the leaf's
        shape with zero strides (no memory), since libraries check their leaves' shapes
        when a wrapper is built (torchao's IntxUnpackedToInt8Tensor does)."""
        return torch.as_strided(self.placeholder(e.dtype), e.shape, (0,) * len(e.shape))

    def pack(self, routes, chain, fill=None) -> None:
        """Pack every layer by its route (module doc). `fill(entry, block)`, if given,
        writes each parameter's values into its place in the layer's block instead of
        copying the parameter (from a checkpoint, say); a parameter that had data of
        its own keeps it until the whole configure succeeds (`commit`)."""
        self.chain = chain
        share = self.share if self.share is not None and self.share.role != "private" else None
        try:
            self._pack(routes, chain, fill, share)
        except BaseException:
            if share is not None:
                share.abandon()  # (those waiting for it re-elect a packer)
            raise

    def _private_block(self, n: int):
        from layerwise.stages.shared import private_block

        return private_block(n, self.device, self.pin_memory, f"layer group {self.group!r} (a layer copied on write)")

    def _shared(self, n: int, alloc):
        """An encoded payload's place in the shared arena being packed (Chain.keep's `place`)."""
        from layerwise.stages.shared import SharedSource

        return SharedSource(self.arena.allocate(max(n, 1), alignment=BLOCK_ALIGN)[:n], self.arena, alloc)

    def _pack(self, routes, chain, fill, share) -> None:
        from layerwise.stages.shared import SharedSource

        total = self.capacity(self.plan, routes)
        cuda = self.device.type == "cuda"
        pin = dict(pinned=self.pin_memory is not False, cuda=cuda, device=self.device.index if cuda else -1)
        attached = share is not None and share.attached
        # a key string with weights from a checkpoint: the first and last layers attached are
        # read from it and compared (two checkpoints of one layout under one key never share)
        held = [lp.index for lp, r in zip(self.plan.layers, routes) if r.where in ("arena", "device") and lp.nbytes]
        spot = {held[0], held[-1]} if held else set()
        if share is None:
            self.arena = _native.HostArena(total, **pin)
        elif attached:
            self.arena = share.map_arena(**pin)
        else:
            self.arena = share.create_arena(share.upper_bound(self.plan, routes), **pin)
        bar = None
        if total >= _PROGRESS_MIN_BYTES and sys.stderr.isatty():
            from tqdm.auto import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"layerwise: packing {self.group}")
        scratch = None
        try:
            for lp, route in zip(self.plan.layers, routes):
                elsewhere = not _plain(route)
                if attached and route.where in ("arena", "device"):  # another process packed it
                    self._attach(lp, chain, share, check=fill is None)
                    if fill is not None and share.asserted and lp.nbytes and lp.index in spot:
                        self._spot_check(lp, fill, share)
                    continue
                if elsewhere:  # packed into scratch, then kept by the layer's chain of stages
                    if scratch is None:
                        size = max(self.plan.layers[r.index].nbytes for r in routes if not _plain(r))
                        scratch = stages.disk.reader.aligned_staging(size, pinned=False)
                    block = scratch[: lp.nbytes]
                    block.zero_()  # alignment gaps included: the layer's bytes (and CRC) are deterministic
                    self.blocks.append(None)
                else:
                    block = self.arena.allocate(lp.nbytes, alignment=BLOCK_ALIGN)
                    self.blocks.append(block)
                # (for a layer stored elsewhere: what a failure restores from, until stored)
                if share is not None and not elsewhere:
                    self.src.append(SharedSource(block, self.arena, self._private_block))
                else:
                    self.src.append(stages.ArenaSource(block, None if elsewhere else self.arena))
                wrapped = []  # quantized wrappers' leaves: copied here, rebound together below
                for e in lp.params:
                    if fill is not None:
                        fill(e, block)
                        if not e.param.is_meta:
                            e.saved = e.param.data  # given back if configure fails later
                    else:  # the parameter's storage span, byte for byte
                        data = e.source()
                        flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())
                        block[e.offset : e.offset + e.span_bytes].copy_(flat.view(torch.uint8))
                        del data, flat
                    if e.leaf is not None:
                        wrapped.append(e)
                        continue
                    self._to_placeholder(e)  # (its original freed now, before the next is copied)
                self._leaves_to_placeholders(wrapped)
                del wrapped
                if elsewhere:
                    place = self._shared if share is not None and route.where == "arena" else None
                    self.src[-1] = chain.keep(lp, route, block, place)
                else:
                    self.src[-1] = chain.keep_plain(lp, self.src[-1])
                if share is not None:
                    self._record(lp, route, share)
                if bar is not None:
                    bar.update(round_up(lp.nbytes, BLOCK_ALIGN))
        finally:
            if bar is not None:
                bar.close()
        self.routes = routes
        if share is not None and not attached:
            share.publish(self.plan, self.arena, [r.index for r in routes if r.where in ("spill", "checkpoint")])
        # pin_memory=True: pageable memory would silently cost the overlap, an error (the
        # caller's rollback gives every parameter back); "auto": a warning.
        _native.check_pinned(self.arena, self.pin_memory, f"layer group {self.group!r}")

    def _placeholders_for(self, lp, own: bool) -> None:
        """Layer `lp`'s parameters become placeholders (their bytes are in the arena
        another process packed). A parameter with data of its own keeps it until the
        whole configure succeeds (`commit`), so that a rollback gives back exactly
        what it had (`own`: the parameters hold the weights; else as `pack` with a
        fill keeps them)."""
        for e in lp.params:
            if own and not e.source().is_meta:
                e.saved = e.source() if e.leaf is not None else e.param.data
            elif not own and not e.param.is_meta:
                e.saved = e.param.data
            if e.leaf is None:
                self._to_placeholder(e)
        self._leaves_to_placeholders([e for e in lp.params if e.leaf is not None])

    def _to_placeholder(self, e) -> None:
        """A plain parameter whose bytes are in the arena becomes a placeholder.
        Marked before the swap: a rollback that finds the mark restores the same
        bytes from the arena even if the swap never happened."""
        e.packed = True
        if e.dspec is None:
            aliases.follow(e.param, e.owner)  # they follow the parameter from here on
        e.param.data = e.wrap(self.placeholder(e.dtype))

    def _leaves_to_placeholders(self, leaves) -> None:
        """Quantized wrappers' leaves (bytes in the arena): each wrapper rebuilt once
        over placeholders (marked before the rebind, as _to_placeholder)."""
        for e in leaves:
            e.packed = True
        assign([(e, self.leaf_placeholder(e)) for e in leaves])

    def _attach(self, lp, chain, share, check: bool) -> None:
        """Layer `lp` from the shared arena another process packed: its block as the
        manifest places it; nothing read or copied. A layer the packer encoded is
        encoded here too (its pieces checked against the payload's headers).
        `check`: the parameters hold the weights (not a checkpoint's fill): they
        must be the arena's bytes (_check_same)."""
        from layerwise.runtime.host_share import pieces_of
        from layerwise.stages.shared import SharedSource

        block, entry = share.view(self.arena, lp.index)
        if entry.get("disk"):
            raise RuntimeError(f"layerwise: internal: {self.group}[{lp.index}] is on disk in the shared arena")
        if entry["codec"]:
            if chain.codec is None:
                raise RuntimeError(f"layerwise: internal: {self.group}[{lp.index}] is encoded in the shared arena "
                                   "but this group does not compress")
            inner = SharedSource(block, self.arena, chain.codec.host_block)
            pieces = pieces_of(entry, {e.dtype for e in lp.params})
            self.blocks.append(None)
            self.src.append(chain.attach(lp, inner, pieces))
        else:
            if block.numel() != lp.nbytes:
                raise RuntimeError(f"layerwise: internal: {self.group}[{lp.index}] is {block.numel()} bytes in the "
                                   f"shared arena, {lp.nbytes} in this plan")
            self.blocks.append(block)
            self.src.append(chain.keep_plain(lp, SharedSource(block, self.arena, self._private_block)))
        if check and any(not e.source().is_meta for e in lp.params):
            self._check_same(lp, self.src[-1].read() if entry["codec"] else block, share)
        self._placeholders_for(lp, check)

    def _spot_check(self, lp, fill, share) -> None:
        """Layer `lp` read from this process's checkpoint (`fill`) must be the bytes
        of the arena another process packed under the caller's key string: a key
        given to two checkpoints of one layout would otherwise stream the other's
        weights. One layer read, and compared to the arena's (decoded) bytes."""
        scratch = torch.zeros(lp.nbytes, dtype=torch.uint8)
        for e in lp.params:
            fill(e, scratch)
        src = self.src[-1]
        self._check_same(lp, src.read(), share, theirs=scratch)

    def _check_same(self, lp, block, share, theirs=None) -> None:
        """Where this process has the weights itself (configure of a model in memory;
        or `theirs`: a layer read from its checkpoint), the arena's bytes must be
        them: a key string that two different models give would otherwise stream
        another model's weights. One compare per parameter (memory speed)."""
        from layerwise.runtime.shared_arena import SharedArenaError

        for e in lp.params:
            if theirs is not None:  # (the layer as this process's checkpoint has it)
                flat = theirs[e.offset : e.offset + e.span_bytes]
            else:
                data = e.source()
                if data.is_meta:
                    continue
                flat = torch.as_strided(data.detach(), (e.span,), (1,), data.storage_offset()).contiguous()
                flat = flat.view(torch.uint8).cpu()
            if not torch.equal(flat, block[e.offset : e.offset + e.span_bytes]):
                raise SharedArenaError(
                    f"layerwise: {self.group}: parameter {e.qualname!r} differs from the bytes of the shared arena "
                    f"at {share.address}, which another model (here or in another process) packed under the same "
                    f"share_host key ({share.key_given!r}): the key names other weights. Give each model its own "
                    "key, or share_host=True (then the checkpoint files, or a model's bytes in memory, identify the "
                    "weights). The model is unchanged.")

    def _record(self, lp, route, share) -> None:
        """The packer's manifest entry for layer `lp`, from the source just kept."""
        if route.where in ("spill", "checkpoint"):
            share.record_disk(lp.index)
            return
        holders = list(self.src[-1].holders())
        codec = next((h for h in holders if getattr(h, "kind", None) == "lossless"), None)
        payload = holders[-1]
        share.record(self.arena, lp.index, payload.block, codec.pieces if codec is not None else None,
                     codec is not None)

    def commit(self) -> None:
        """The whole configure succeeded: drop what a rollback would have needed."""
        for lp in self.plan.layers:
            for e in lp.params:
                e.saved = None

    def held(self) -> tuple[int, int]:
        """(shared, private): the host bytes of the group's layers in the machine's
        shared arena (what this process maps of it, counted once however many map
        it), and those of this process's own (its arena, the blocks its stages keep,
        layers copied on write)."""
        if self.arena is None:
            return 0, 0
        if self.share is None or self.share.role == "private":
            return 0, self.arena.capacity + sum(src.stored_bytes for src, blk in zip(self.src, self.blocks)
                                                if blk is None)
        payloads = [list(src.holders())[-1] for src in self.src]
        return self.arena.used, sum(h.stored_bytes for h in payloads if not h.shared)

    def share_figures(self) -> dict | None:
        """stats()' `share_host` section: the arena's key and address, this process's
        role, the processes that hold it now (best effort), the bytes shared and
        private and the layers copied on write."""
        if self.share is None:
            return None
        shared, private = self.held()
        cow = [i for i, src in enumerate(self.src) if getattr(list(src.holders())[-1], "copied_bytes", 0)]
        return {**self.share.figures(), "shared_bytes": shared, "private_bytes": private,
                "copied_layers": cow}

    def figures(self, packed: bool, streaming: bool) -> dict:
        """The host memory the group takes (its arena and what its stages keep, pinned
        or not), the stages' own figures (the disk stage's once streaming) and the
        tier plan, for stats()."""
        arena = self.arena
        shared, private = self.held()
        chain = self.chain if packed else None
        stage_pinned, stage_pin_error = chain.pinned() if chain is not None else (True, None)
        pinned = bool(arena.pinned) if arena is not None else False
        if chain is not None and chain.codec is not None and arena is not None:  # an empty arena does not count
            pinned = (pinned or not arena.capacity) and stage_pinned
        return {
            "arena_bytes": shared + private,
            "share_host": self.share_figures(),
            "arena_pinned": pinned,
            "arena_pin_error": (arena.pin_error or None if arena is not None else None) or stage_pin_error,
            **(chain.stats() if chain is not None else {"compress": None}),
            **({} if streaming else {"disk": None}),
            "tier_plan": [r.describe() for r in self.routes] if self.routes is not None else None,
            # tensors a parameter subclass keeps beside its data (quant_state, scales): resident
            "side_tensor_bytes": aliases.side_bytes(e for lp in self.plan.layers for e in lp.params) if packed else 0,
        }

    # ------------------------------------------------------------ the way back
    def prepare_removal(self, resident, device, original_devices: bool = False) -> list:
        """[(entry, new data or None: keep what it has)] for every packed parameter:
        the data it had before a load (if kept), its resident copy (moved back with
        original_devices), or its bytes read from the layer's source. Parameters
        never packed are not touched; a meta parameter had no data to give back."""
        out = []
        with torch.no_grad(), torch.inference_mode(False):
            for lp, src in zip(self.plan.layers, self.src):
                block = None
                for e in lp.params:
                    if not e.packed:
                        continue
                    dev = e.orig_device if original_devices else device
                    new = None
                    if original_devices and e.saved is not None:
                        new = e.saved
                    elif lp.index in resident:  # an ordinary device tensor: the truth already
                        if original_devices and dev.type != "meta" and dev != device:
                            new = e.wrap(span_copy(e, e.source(), dev))
                    elif dev.type != "meta":
                        if block is None:
                            block = src.read()
                        new = e.wrap(materialize(e, block, dev))
                    out.append((e, new))
            # A quantized wrapper is rebuilt over its new leaves here, in phase one: the
            # library's __tensor_unflatten__ may raise, and give_back only swaps.
            rebuilt = [(w.param, quantized.rebuilt(w.param, w.form, tensors)) for w, tensors in
                       _by_wrapper([(e, new) for e, new in out if e.leaf is not None and new is not None])]
        return [(e, new) for e, new in out if e.leaf is None] + [(e, None) for e, _ in out if e.leaf is not None] \
            + [(None, pair) for pair in rebuilt]

    @staticmethod
    def give_back(prepared: list) -> None:
        """Rebind every parameter to what prepare_removal built (nothing raises: a
        quantized wrapper was rebuilt there, and is swapped in here)."""
        assign([(e, new) for e, new in prepared if e is not None and new is not None])
        for e, pair in prepared:
            if e is None:
                torch.utils.swap_tensors(*pair)
        for e, _ in prepared:
            if e is None:
                continue
            if e.leaf is None and e.dspec is None:
                aliases.release(e.param, e.owner)
            e.saved = None
            e.packed = False

    def release(self) -> None:
        """Close sources, stages and files (spill files are deleted): best effort, logged."""
        def attempt(what, fn, *args):
            try:
                fn(*args)
            except Exception as err:  # a leak at worst; the parameters are whole already
                log.warning("layerwise: %s of group %r failed while removing: %s", what, self.group, err)

        for src in self.src:
            attempt("closing a layer source", src.close)
        if self.chain is not None:
            self.chain.close(attempt)
        if self.share is not None:  # (others keep the arena; the kernel frees it with the last mapping)
            attempt("leaving the shared arena", self.share.leave)
            self.share = None
        self.chain = self.routes = self.arena = None
        self.blocks, self.src, self._placeholders = [], [], {}
