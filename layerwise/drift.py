"""Derived copies are caught, never trusted (DESIGN.md, pitfalls: libraries that
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
"""
from __future__ import annotations

import logging

import torch

from . import packing
from .formats import aliases, quantized
from .plan import storage_span

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

    def check(self, manager, i: int, where: str = "its forward") -> None:
        """Layer i's parameters (PER_HOOK of them, in turn) still point into its slot;
        the others are settled. (Sliced once at setup: the hook only compares.)"""
        chunks = self.chunks.get(i)
        if chunks is None:
            return
        c = self.cursor[i]
        if len(chunks) > 1:
            self.cursor[i] = c + 1 if c + 1 < len(chunks) else 0
        params, ptrs, start = chunks[c]
        if [*map(_data_ptr, params)] != ptrs:
            self._settle(manager, i, start, start + len(params), where)

    def check_all(self, manager, layers=None, where: str = "its module") -> None:
        """Every parameter of `layers` (default: every streamed layer), before their
        true bytes are read or written."""
        for i in self.layers if layers is None else layers:
            rec = self.layers.get(i)
            if rec is not None and [*map(_data_ptr, rec[0])] != rec[1]:
                self._settle(manager, i, 0, len(rec[0]), where)

    def _settle(self, manager, i, start, end, where) -> None:
        params, ptrs, entries = self.layers[i]
        settle(manager, i, [e for e, p, x in zip(entries[start:end], params[start:end], ptrs[start:end])
                            if p.data_ptr() != x], where)


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
    if not manager._src[i].writable:
        return "its layer's true bytes are read from a file that layerwise does not write"
    return None


def _describe(e, now=None) -> str:
    owner = e.owner
    module = f"{type(owner).__module__}.{type(owner).__qualname__}" if owner is not None else "its module"
    lib = aliases.library_of(owner) if owner is not None else "?"
    became = f" to a {now.dtype}{list(now.shape)} tensor" if isinstance(now, torch.Tensor) else ""
    return (f"{e.qualname} ({module}, library {lib!r}) was rebound{became} outside its slot (it streams as "
            f"{e.dtype}{list(e.shape)})")


def settle(manager, i: int, drifted: list, where: str) -> None:
    """Entries of layer i whose parameters were rebound away from their slot views:
    adopted or refused (module doc)."""
    ring = manager.ring
    slot = ring.slots[ring.slot_of[i]]
    found = [(e, e.param.data) for e in drifted]
    refused = [(e, now, why) for e, now in found for why in [_why_not(manager, i, e, now)] if why is not None]
    if refused:
        for e, _ in found:
            packing.bind_to_slot(e, e.view_in(slot))  # its true bytes never changed
        e, now, why = refused[0]
        remedy = ("Give that parameter the dtype its module computes in before configuring (cast the model, or "
                  f"that parameter), or keep {type(e.owner).__qualname__} modules out of the streamed groups"
                  if isinstance(now, torch.Tensor) and now.dtype != e.dtype else
                  f"Keep {type(e.owner).__qualname__} modules out of the streamed groups (a resident layer, or a "
                  "narrower layer group), or call layerwise.remove_layerwise_offload(model) first")
        raise RuntimeError(
            f"layerwise: {_describe(e, now)} by {where}; {why}. The parameter is bound to its true bytes again, "
            f"unchanged. {remedy}.")
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
            manager._write_layer(i, edit)
    except BaseException:
        for e, shape, stride, dtype, span in old:
            e.shape, e.stride, e.dtype, e.span = shape, stride, dtype, span
        for e, _ in found:
            packing.bind_to_slot(e, e.view_in(slot))
        raise
    for e, now in found:
        aliases.follow(e.param, e.owner, data=now)  # a library's own references to the derived copy
        packing.bind_to_slot(e, e.view_in(slot))
        log.info("layerwise: %s by %s; its new bytes are the layer's true bytes and stream from now on",
                 _describe(e, now), where)
