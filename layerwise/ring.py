"""ring: a layer group's slot ring on the device, and the record of what each
slot holds (DESIGN.md, "The slot ring").

Each streamed layer has a fixed slot (plan.assign_slots), so its parameters
stay bound to views of that slot and the hooks do O(1) work. The record says,
per slot, which layer's fetch was queued last (`holder`) at which version of
its true bytes (`version`), the result of that fetch (`event`), how many
layers compute in it now (`busy`), a generation bumped at every fetch into it
(`gen`: a tensor saved for backward checks it), and the slot's version
counter when the record was made (`seen`: a change means someone wrote into
the slot in place). The manager (manager.py) keeps the record in step with
the fetches it queues; the state contract (contract.py) reads it and changes
it only through the methods below.
"""
from __future__ import annotations

import torch
from torch import nn

from .plan import assign_slots


class SlotRing:
    def __init__(self, plan, resident, depth: int, sources, device: torch.device, start=None):
        n = plan.num_layers
        resident = set(resident)
        self.streamed = [i for i in range(n) if i not in resident]
        colours, self.num_slots = assign_slots(len(self.streamed), depth)
        self.slot_of = [-1] * n
        for pos, i in enumerate(self.streamed):
            self.slot_of[i] = colours[pos]
        # The k-th streamed layer at or after layer i, for prefetch targets.
        self.next_pos = [0] * n
        pos = len(self.streamed)
        for i in reversed(range(n)):
            if i not in resident:
                pos -= 1
            self.next_pos[i] = pos
        # A source may need more than the layer's bytes in its slot (a gather fills whole shares).
        size = max((getattr(sources[i], "slot_bytes", plan.layers[i].nbytes) for i in self.streamed), default=0)
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(self.num_slots)]
        self.device = device
        # Each streamed layer's fetch destination: the front of its slot.
        self.dst = [self.slots[s][: lp.nbytes] if s >= 0 else None for s, lp in zip(self.slot_of, plan.layers)]
        self.ptrs = {t.untyped_storage().data_ptr(): s for s, t in enumerate(self.slots)}
        self.holder = [-1] * self.num_slots  # the layer whose fetch was queued last into each slot
        self.version = [-1] * self.num_slots  # the version of the holder's true bytes when it was queued
        self.busy = [0] * self.num_slots  # layers between their pre- and post-hook, per slot
        self.entered: list[int] = []  # those layers, innermost last
        self.gen = [0] * self.num_slots  # bumped at every fetch into the slot (saved-tensor checks)
        self.layer_gen = [0] * n  # bumped when a layer's true bytes change after packing
        # The last fetch into each slot. On CUDA the ring's memory may have been freed by
        # work still queued on the compute stream: the first fetches wait for `start`.
        self.event = [start] * self.num_slots
        self.fetched = [None] * n  # per layer: its fetch's result, until the compute waited on it
        self.seen = [t._version for t in self.slots]

    def holds(self, i: int, version) -> bool:
        s = self.slot_of[i]
        return self.holder[s] == i and self.version[s] == version

    def queued(self, i: int, version, result) -> None:
        """Layer i's fetch into its slot was queued: `result` is what it returned."""
        s = self.slot_of[i]
        self.holder[s], self.version[s], self.event[s], self.fetched[i] = i, version, result, result

    def forget(self, i: int) -> None:
        """Layer i's fetch failed (or its bytes changed): its slot reloads at its next use."""
        s = self.slot_of[i]
        if s >= 0 and self.holder[s] == i:
            self.holder[s] = -1
        self.fetched[i] = None

    def written(self, i: int) -> None:
        """Layer i's true bytes changed: its slot reloads, tensors saved from it are stale."""
        self.forget(i)
        self.layer_gen[i] += 1

    def kept(self, i: int, version) -> None:
        """Layer i's slot holds its true bytes (an edit wrote them there and back)."""
        s = self.slot_of[i]
        self.holder[s], self.version[s], self.seen[s] = i, version, self.slots[s]._version

    def reset(self, start=None) -> None:
        """After a resync: nothing is known of what the slots hold."""
        self.event = [start] * self.num_slots
        self.holder = [-1] * self.num_slots
        self.fetched = [None] * len(self.fetched)
        self.gen = [g + 1 for g in self.gen]

    def forget_entered(self) -> None:
        """Forget layers left 'computing' by a forward that an interrupt abandoned."""
        self.busy = [0] * self.num_slots
        self.entered = []

    def computing(self) -> bool:
        return bool(self.entered) or any(self.busy)

    def enter(self, i: int) -> None:
        s = self.slot_of[i]
        if s >= 0:
            self.busy[s] += 1
        self.entered.append(i)

    def pin(self, i: int) -> None:
        """Keep layer i in its slot (an edit in place): no prefetch overwrites it."""
        self.busy[self.slot_of[i]] += 1

    def unpin(self, i: int) -> None:
        self.busy[self.slot_of[i]] -= 1

    def leave(self, i: int) -> bool:
        """Layer i's forward ended; True if it had entered a slot."""
        if i not in self.entered:
            return False
        del self.entered[len(self.entered) - 1 - self.entered[::-1].index(i)]
        s = self.slot_of[i]
        if s >= 0:
            self.busy[s] -= 1
        return s >= 0

    def written_in_place(self, s: int) -> int | None:
        """The layer slot s held, if someone wrote into the slot in place since the
        last look (our fetches do not bump version counters); it reloads then."""
        v = self.slots[s]._version
        if v == self.seen[s]:
            return None
        self.seen[s] = v
        holder, self.holder[s] = self.holder[s], -1  # reload the true bytes
        return holder

    def aliases(self, t) -> bool:
        """`t` is a view of a slot (not a copy)."""
        return type(t) in (torch.Tensor, nn.Parameter) and t.device == self.device and \
            t.untyped_storage().data_ptr() in self.ptrs

    def own_output(self, output):
        """A block whose output is a view of its own weights (learned query tokens
        returned as they are): the output must outlive the slot, which the next
        fetches refill. Copied in that case only; None (output unchanged) otherwise."""
        if isinstance(output, torch.Tensor):
            return output.clone() if self.aliases(output) else None
        if isinstance(output, tuple) and any(self.aliases(t) for t in output):
            return tuple(t.clone() if self.aliases(t) else t for t in output)
        return None

    def release(self) -> None:
        """Events hold the tensors their fetches read and wrote: drop them with the slots."""
        self.slots, self.dst, self.event, self.fetched, self.holder, self.ptrs = [], [], [], [], [], {}
