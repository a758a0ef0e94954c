"""Backward through streamed layers (docs/design.md, "The state contract").

A forward under grad mode may save slot views for its backward, and its graph holds
the streamed parameters it used. Saved-tensor hooks give a saved slot view back as it
was even after the slot was refilled (its layer's bytes are read back from the host),
and `track_backward` records which graphs are still waiting for their backward, so a
placement change (set_residency, tune) is refused until they ran or were dropped.
"""
from __future__ import annotations

import torch
from torch import nn

from layerwise.contract import state_dict
from layerwise.formats import quantized


# ------------------------------------------------------------------ backward
class _SlotRef:
    __slots__ = ("tensor", "ring", "slot", "gen", "layer", "version", "slot_ptr", "slot_bytes", "__weakref__")

    def __init__(self, tensor, ring, slot, gen, layer, version):
        self.tensor, self.ring, self.slot, self.gen, self.layer, self.version = tensor, ring, slot, gen, layer, version
        base = ring.slots[slot]  # (a ring replaced since, set_residency, no longer names it)
        self.slot_ptr, self.slot_bytes = base.untyped_storage().data_ptr(), base.numel()


def _slot_of(ring, t):
    """The ring slot a saved tensor's bytes live in, or None: a plain tensor by its
    storage, a quantized wrapper (formats/quantized.py) by its leaves' (a library's
    autograd function may save the weight wrapper itself: quanto's does)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return ring.ptrs.get(t.untyped_storage().data_ptr())
    if quantized.is_wrapper(t):
        for leaf in quantized.leaf_tensors(t).values():
            s = ring.ptrs.get(leaf.untyped_storage().data_ptr())
            if s is not None:
                return s
    return None


class _Graph:
    """A layer forward under grad mode: pending until a backward through its output
    has finished. It lives as long as that output's graph (a hook of a node of it
    holds it), so a graph dropped without its backward takes it along."""

    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False

    def finish(self) -> None:
        self.done = True


def _grad_fns(output) -> list:
    """The autograd nodes of the tensors a layer returned (a tensor, or tuples,
    lists and dicts of them: a model output); a few suffice."""
    out, todo = [], [output]
    while todo and len(out) < 8:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            if o.grad_fn is not None:
                out.append(o.grad_fn)
        elif isinstance(o, (tuple, list)):
            todo.extend(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
    return out


def track_backward(manager, output) -> None:
    """A layer of `manager` returned `output` under grad mode. Its graph may use the
    group's parameters without saving them (`x + self.shift`: an AccumulateGrad node
    holds the parameter itself), which saved_slot_hooks never sees: a placement change
    swaps those parameters (torch.utils.swap_tensors), and torch then fails the
    backward ("AccumulateGrad node that was poisoned by swap_tensors"), or, where the
    swap lands in the middle of a backward on another thread, leaves their gradients
    unset. So the group counts the graph as pending (GroupGuard.backward_pending)
    until a backward through the output has finished: a hook on the output's node
    queues a callback that the autograd engine runs once the whole backward is done,
    so no change gets in while any part of it runs. Recorded under the model's lock,
    which set_residency holds for its check and its swap."""
    fns = _grad_fns(output)
    if not fns:
        return
    graph = _Graph()

    def started(grad_outputs):
        torch.autograd.Variable._execution_engine.queue_callback(graph.finish)

    for fn in fns:
        fn.register_prehook(started)
    manager.guard.graphs.add(graph)


def saved_slot_hooks(manager):
    """Autograd saved-tensor hooks for one streamed layer's forward: a tensor
    saved from a ring slot is given back as it was even if the slot has been
    refilled since (its layer's bytes are read back from the arena)."""

    def pack(t):
        s = _slot_of(manager.ring, t) if t.device == manager.device else None
        if s is None:
            # Not ours: kept as autograd would keep it, but never with its grad_fn: an op that
            # saves its own output (tanh, softmax) would hold its node through the output,
            # a cycle through C++ that no collector frees (a graph dropped without its
            # backward would never be). Unpacking puts the grad_fn back.
            return t.detach() if t.grad_fn is not None else t
        ring = manager.ring
        i = ring.holder[s]
        ref = _SlotRef(t, ring, s, ring.gen[s], i, ring.layer_gen[i])
        manager.guard.saved.add(ref)
        return ref

    def unpack(ref):
        if type(ref) is not _SlotRef:
            return ref
        if manager.streaming and manager.guard.handed_out:
            state_dict.check_handed_out(manager)  # a write through state_dict() since the forward
        if manager.streaming and manager.ring is ref.ring and manager.ring.gen[ref.slot] == ref.gen:
            return ref.tensor
        if not manager.streaming or manager.ring.layer_gen[ref.layer] != ref.version:
            raise RuntimeError(
                f"layerwise: backward needs the weights of {manager.layer_name}[{ref.layer}] as they were in "
                "the forward, but they were changed (load_state_dict) or the model was un-offloaded since. "
                "Run forward and backward without changing the weights in between."
            )
        t = ref.tensor
        block = manager.read_layer(ref.layer)
        fresh = torch.empty(ref.slot_bytes, dtype=torch.uint8, device=manager.device)
        fresh[: block.numel()].copy_(block)

        def again(x):  # x as it was, over `fresh` where it was a view of the slot
            if x.untyped_storage().data_ptr() != ref.slot_ptr:
                return x
            out = torch.empty(0, dtype=x.dtype, device=manager.device)
            return out.set_(fresh.untyped_storage(), x.storage_offset(), x.size(), x.stride())

        if quantized.is_wrapper(t):
            return quantized.rebuild(quantized.structure(t),
                                     {path: again(x) for path, x in quantized.leaf_tensors(t).items()})
        return again(t)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
