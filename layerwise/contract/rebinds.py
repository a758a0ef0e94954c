"""Derived copies are caught, never trusted (docs/design.md, pitfalls: libraries that
rebind `weight.data` behind you).

A streamed parameter stays bound to its view of its ring slot. A library may
rebind its `.data` all the same: bitsandbytes repacks an nf4 weight for the CPU
on its first eval forward and rebinds `weight.data` to the repacked copy, and
its `_save_to_state_dict` unpacks it again and rebinds to that; a module casts
`bias.data = bias.data.to(x.dtype)`. Left alone, such a parameter computes from
resident memory ever after, and what state_dict() and removal give back no
longer matches the library's own state (its quant_state describes the repacked
layout; the arena still holds the portable one).

`Bound` records, once at finalise, each streamed layer's plain parameters and
the data pointer of the slot view each one is bound to (a view's pointer is
fixed: its slot and offset are). The post-hook of layer i compares them: one
`data_ptr()` per parameter, in one `map`, at most `Bound.PER_HOOK` per call
(measured with `python -m layerwise.bench hooks --quick --device cpu`). Every rebinding
layerwise does itself (slot views, an edit, a state_dict over the true bytes)
ends on the same views, so they never fire it. A parameter found elsewhere is
settled at once (`settle`):

- adopted, when it kept its element count (a repacked layout, a copy, or a cast to
  a narrower dtype, in its place): its new bytes become the layer's true bytes
  through the manager's write path, whatever holds them (the arena; an encoded
  block, re-encoded; a spill file, rewritten; this rank's share, collectively),
  its entry takes the new shape and dtype, and the parameter is bound back to
  its slot. From then on the derived form is what streams, what state_dict()
  reads and what removal gives back: the library's own state and its bytes
  agree, as in the resident model.
- refused otherwise (another size, a wider dtype, a layer whose true bytes
  cannot be written, a sharded or wrapper parameter): it is bound back to its
  slot, its true bytes unchanged, and a RuntimeError names the parameter, its
  module and library, and what to do.

A library may keep state that describes what it made: bitsandbytes' quant_state
says "packed for the CPU" once it repacked, and never repacks again. Bound back
to its old bytes, such a layer would compute garbage from its next call on,
silently. So where only the layer's storage refuses (a checkpoint file layerwise
does not write; the new value itself could stream), what the library made is
*held*: the layer refuses every later call that would compute from or read its
bytes (forward, state_dict, load, edit, set_residency), naming the first
refusal, and removal gives each held parameter the data its library made, as the
resident model has it.
"""
from __future__ import annotations

import logging

import torch

from layerwise.formats import aliases, quantized
from layerwise.planning.layout import storage_span
from layerwise.runtime import host_store

log = logging.getLogger("layerwise")

_data_ptr = torch.Tensor.data_ptr


def _contiguous_strides(shape) -> tuple:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


class Bound:
    """The slot-view pointer of every plain streamed parameter, per layer.

    A post-hook checks at most PER_HOOK parameters of its layer (round robin over
    the layer's forwards), so that its cost stays flat in the parameter count; a
    parameter rebound meanwhile computes from what its library made (as in the
    resident model) until it is seen. Everything that reads or writes a layer's
    true bytes (state_dict, load_state_dict, an edit, removal) checks the whole
    layer first (`check_all`), so nothing reads bytes a library has replaced."""

    PER_HOOK = 16

    def __init__(self, manager):
        ring = manager.ring
        self.layers: dict = {}
        self.chunks: dict = {}  # layer -> [(params, their slot-view pointers, index of the first)], PER_HOOK each
        self.cursor: dict = {}
        for i in ring.streamed:
            base = ring.slots[ring.slot_of[i]].data_ptr()
            entries = [e for e in manager.plan.layers[i].params if e.leaf is None and e.dspec is None and e.numel]
            if entries:
                params, ptrs = tuple(e.param for e in entries), [base + e.offset for e in entries]
                self.layers[i] = (params, ptrs, entries)
                self.chunks[i] = [(params[k:k + self.PER_HOOK], ptrs[k:k + self.PER_HOOK], k)
                                  for k in range(0, len(params), self.PER_HOOK)]
                self.cursor[i] = 0
        self.held: dict = {}  # layer -> (why it refuses, {id(entry): (entry, the data its library made)})

    def check(self, manager, i: int, where: str = "its forward") -> None:
        """Layer i's parameters (PER_HOOK of them, in turn) still point into its slot;
        the others are settled. (Sliced once at setup: the hook only compares.)"""
        if self.held and i in self.held:
            self._refuse_held(manager, i, where)
        chunks = self.chunks.get(i)
        if chunks is None:
            return
        c = self.cursor[i]
        if len(chunks) > 1:
            self.cursor[i] = c + 1 if c + 1 < len(chunks) else 0
        params, ptrs, start = chunks[c]
        if [*map(_data_ptr, params)] != ptrs:
            self._settle(manager, i, start, start + len(params), where)

    def check_all(self, manager, layers=None, where: str = "its module", removing: bool = False) -> None:
        """Every parameter of `layers` (default: every streamed layer), before their
        true bytes are read or written; a held layer refuses (module doc), but to
        `removing`, which takes what its library made (`give_back_held`)."""
        for i in self.layers if layers is None else layers:
            if self.held and i in self.held and not removing:
                self._refuse_held(manager, i, where)
            rec = self.layers.get(i)
            if rec is not None and [*map(_data_ptr, rec[0])] != rec[1]:
                self._settle(manager, i, 0, len(rec[0]), where, quiet=removing)

    def _settle(self, manager, i, start, end, where, quiet: bool = False) -> None:
        params, ptrs, entries = self.layers[i]
        settle(manager, i, [e for e, p, x in zip(entries[start:end], params[start:end], ptrs[start:end])
                            if p.data_ptr() != x], where, quiet)

    def _refuse_held(self, manager, i: int, where: str) -> None:
        """Layer i holds what its library made (module doc): whatever the library
        rebound since is held in turn, and the call is refused."""
        rec = self.layers.get(i)
        if rec is not None and [*map(_data_ptr, rec[0])] != rec[1]:
            self._settle(manager, i, 0, len(rec[0]), where, quiet=True)  # (held in turn: what it made last)
        raise RuntimeError(f"layerwise: layer {i} of group {manager.layer_name!r} refuses {where}, as since an "
                           f"earlier call: {self.held[i][0]}")

    def hold(self, i: int, why: str, found) -> None:
        """Layer i refuses from now on (`why`, the first refusal's); `found` [(entry, data
        its library made)], the latest kept."""
        first, data = self.held.get(i, (why, {}))
        data.update({id(e): (e, now) for e, now in found})
        self.held[i] = (first, data)

    def give_back_held(self, prepared: list, original_devices: bool = False) -> list:
        """Removal's [(entry, new data)] with each held parameter given the data its
        library made (on its original device with `original_devices`)."""
        made = {k: v for _, data in self.held.values() for k, v in data.items()}
        if not made:
            return prepared
        out = []
        for e, new in prepared:
            if e is not None and id(e) in made:
                now = made[id(e)][1]
                dev = e.orig_device if original_devices else now.device
                new = now if dev.type == "meta" or dev == now.device else now.to(dev)
            out.append((e, new))
        return out


def _why_not(manager, i: int, e, now) -> str | None:
    """Why a rebound parameter's new data cannot become its true bytes (None: it can)."""
    if quantized.is_wrapper(now) or quantized.is_dtensor(now):
        return f"it became a {quantized.library_type(now)}"
    if now.numel() != e.numel:
        return "a streamed parameter keeps its number of elements while offloaded (its slot is planned for it)"
    # A narrower dtype in its place is a write of bytes wherever the layer's bytes are kept (the codec
    # is lossless for any bit pattern in a segment planned for another dtype; a file holds bytes).
    if now.dtype != e.dtype and now.element_size() > e.dtype.itemsize:
        return (f"a streamed parameter can take a narrower dtype in its place, not a wider one ({now.dtype} "
                f"does not fit where {e.numel} {e.dtype} elements were planned)")
    if now.device.type == "meta":
        return "its new data is on the meta device"
    if not manager.sources[i].writable:
        return _READ_ONLY
    return None


_READ_ONLY = "its layer's true bytes are read from a file that layerwise does not write"


def _describe(e, now=None) -> str:
    owner = e.owner
    module = f"{type(owner).__module__}.{type(owner).__qualname__}" if owner is not None else "its module"
    lib = aliases.library_of(owner) if owner is not None else "?"
    became = f" to a {now.dtype}{list(now.shape)} tensor" if isinstance(now, torch.Tensor) else ""
    return (f"{e.qualname} ({module}, library {lib!r}) was rebound{became} outside its slot (it streams as "
            f"{e.dtype}{list(e.shape)})")


def settle(manager, i: int, drifted: list, where: str, quiet: bool = False) -> None:
    """Entries of layer i whose parameters were rebound away from their slot views:
    adopted, refused or held (module doc; `quiet`: one held does not raise)."""
    ring = manager.ring
    slot = ring.slots[ring.slot_of[i]]
    found = [(e, e.param.data) for e in drifted]
    refused = [(e, now, why) for e, now in found for why in [_why_not(manager, i, e, now)] if why is not None]
    if refused:
        for e, _ in found:
            host_store.bind_to_slot(e, e.view_in(slot))  # its true bytes never changed
        e, now, why = refused[0]
        held = all(w is _READ_ONLY for _, _, w in refused)
        cls = type(e.owner).__qualname__
        if held:
            remedy = ("Call layerwise.remove_layerwise_offload(model) (it gives each such parameter the data its "
                      "library made) and load again with spill_dir= (the layers on disk are then kept in spill files "
                      f"that layerwise writes), or keep {cls} modules out of the streamed groups")
        elif isinstance(now, torch.Tensor) and now.dtype != e.dtype:
            remedy = ("Give that parameter the dtype its module computes in before configuring (cast the model, or "
                      f"that parameter), or keep {cls} modules out of the streamed groups")
        else:
            remedy = (f"Keep {cls} modules out of the streamed groups (a resident layer, or a narrower layer "
                      "group), or call layerwise.remove_layerwise_offload(model) first")
        why = (f"{_describe(e, now)} by {where}; {why}. The parameter is bound to its true bytes again, unchanged"
               + (", and its layer refuses every call from now on (its library's own state may describe the data "
                  "it made)" if held else "") + f". {remedy}.")
        if held:
            manager.bound.hold(i, why, found)
            if quiet:
                return
        raise RuntimeError(f"layerwise: {why}")
    old = [(e, e.shape, e.stride, e.dtype, e.span) for e, _ in found]

    def edit(block):
        for e, now in found:
            if now.dtype != e.dtype:  # (narrower, in its place: the block's layout does not move)
                e.dtype, e.span = now.dtype, e.numel
            # Its strides kept where they are dense (a transposed layout computes differently on the CPU).
            dense = storage_span(now) == now.numel() and min(now.stride(), default=1) >= 0
            e.shape, e.stride = tuple(now.shape), tuple(now.stride()) if dense else _contiguous_strides(now.shape)
            e.view_in(block).copy_(now)

    try:
        with torch.no_grad(), torch.inference_mode(False):
            manager.write_layer(i, edit)
    except BaseException:
        for e, shape, stride, dtype, span in old:
            e.shape, e.stride, e.dtype, e.span = shape, stride, dtype, span
        for e, _ in found:
            host_store.bind_to_slot(e, e.view_in(slot))
        raise
    for e, now in found:
        aliases.follow(e.param, e.owner, data=now)  # a library's own references to the derived copy
        host_store.bind_to_slot(e, e.view_in(slot))
        log.info("layerwise: %s by %s; its new bytes are the layer's true bytes and stream from now on",
                 _describe(e, now), where)
