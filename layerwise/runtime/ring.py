"""ring: a layer group's slot ring on the device, and the record of what each
slot holds (docs/design.md, "The slot ring and fixed slots").

Each streamed layer has a fixed slot (plan.assign_slots), so its parameters
stay bound to views of that slot and the hooks do O(1) work. The record says,
per slot, which layer's fetch was queued last (`holder`) at which version of
its true bytes (`version`), the result of that fetch (`event`), how many
layers compute in it now (`busy`), a generation bumped at every fetch into it
(`gen`: a tensor saved for backward checks it), and the slot's version
counter when the record was made (`seen`: a change means someone wrote into
the slot in place). The manager (runtime/group.py) keeps the record in step with
the fetches it queues; the state contract (contract/) reads it and changes
it only through the methods below.
"""
from __future__ import annotations

import torch
from torch import nn

from layerwise.planning.layout import assign_slots


class SlotRing:
    def __init__(self, plan, resident, depth: int, sources, device: torch.device, start=None, layer_gen=None):
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
        size = max((sources[i].slot_bytes for i in self.streamed), default=0)
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
        # bumped when a layer's true bytes change after packing (a ring that replaces another,
        # set_residency, carries its counts on: tensors saved for backward check them)
        self.layer_gen = list(layer_gen) if layer_gen is not None else [0] * n
        # The last fetch into each slot. On CUDA the ring's memory may have been freed by
        # work still queued on the compute stream: the first fetches wait for `start`.
        self.event = [start] * self.num_slots
        self.fetched = [None] * n  # per layer: its fetch's result, until the compute waited on it
        self.seen = [t._version for t in self.slots]
        # CUDA, calls sharing the ring (runtime/cohort.py, turns.py): per slot and per
        # stream, the event that marks the end of the last compute on the slot there; the
        # next fetch into the slot waits for them. (One per stream: a stream runs in order,
        # so its last event covers the ones before, and a slot never refilled keeps one.)
        self.done: list[dict] = [{} for _ in range(self.num_slots)]
        self._first = None  # first_in_slot's table, made at its first use

    def first_in_slot(self, i: int, s: int) -> int:
        """The first streamed layer at or after layer i that lives in slot s, or -1."""
        if self._first is None:
            n = len(self.slot_of)
            table, nxt = [None] * (n + 1), [-1] * self.num_slots
            table[n] = tuple(nxt)
            for j in reversed(range(n)):
                if self.slot_of[j] >= 0:
                    nxt[self.slot_of[j]] = j
                table[j] = tuple(nxt)
            self._first = table
        return self._first[min(i, len(self._first) - 1)][s]

    def computed(self, s: int, stream: int, event) -> None:
        """A call's compute on slot s ends at `event` on `stream` (CUDA)."""
        self.done[s][stream] = event

    def take_done(self, s: int) -> list:
        done, self.done[s] = self.done[s], {}
        return list(done.values())

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

    def may_take(self, i: int, prefetch: bool, group: str) -> bool:
        """Layer i's slot is busy (its holder computes): a prefetch leaves it (False);
        a layer called while another one of its slot computes is an error."""
        if prefetch:
            return False
        s = self.slot_of[i]
        raise RuntimeError(
            f"layerwise: layer {group}[{i}] is called while layer {group}[{self.holder[s]}], which shares its "
            f"ring slot {s}, is still computing (a block that calls another block of the same list). Keep one "
            "of them resident (resident_layers) or raise prefetch_depth so that the two get distinct slots.")

    def wait_for_fetches(self) -> None:
        """Wait for each slot's last fetch; failed ones are finished too. Their layers
        reload (nothing computes with their bytes) and fail again if the cause stays."""
        for ev in self.event:
            try:
                ev = ev.resolve() if ev is not None else None  # (one the chain forgot raises: never queued)
                if ev is not None:
                    ev.synchronize()
            except Exception:  # noqa: BLE001 - as above
                pass

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

    def refuse_write_in_place(self, s: int, plan, blocks, engine, group: str) -> None:
        """Someone wrote into slot s in place: the slot reloads its holder's true bytes,
        and the error names the parameter (those whose bytes in the slot differ from
        the holder's block, once the fetches queued are done) or, where a prefetch
        overwrote the write already or the layer has no host block of its own
        (disk, encoded, split), the candidates."""
        holder = self.written_in_place(s)
        if holder is None:
            return
        slot = self.slots[s]
        lp = plan.layers[holder] if 0 <= holder < len(plan.layers) else None
        host = blocks[holder] if lp is not None and holder < len(blocks) else None
        changed = []
        if host is not None:
            engine.synchronize()
            changed = [e.qualname for e in lp.params if not torch.equal(
                slot[e.offset : e.offset + e.span_bytes].cpu(), host[e.offset : e.offset + e.span_bytes])]
            changed = list(dict.fromkeys(changed))  # (a quantized wrapper's leaves share its name)
        if changed:
            what = f"{', '.join(map(repr, changed[:6]))}, in ring slot {s}"
        else:
            sharing = [i for i, sl in enumerate(self.slot_of) if sl == s]
            rel = list(dict.fromkeys(e.qualname.removeprefix(f"{group}.{holder}.") for e in (lp.params if lp else ())))
            what = (f"one bound to ring slot {s}: {', '.join(rel[:6])}{' ...' if len(rel) > 6 else ''} of "
                    f"{group}.<i> for i in {sharing[:8]}{' ...' if len(sharing) > 8 else ''}")
        raise RuntimeError(
            f"layerwise: an in-place write to a streamed parameter ({what}) was detected and discarded: "
            "streamed weights live in the host arena "
            "and a write into the device copy would be lost or land on another layer (an optimizer step is "
            "such a write: training streamed weights is not supported). Change them with "
            "model.load_state_dict(...), or call layerwise.remove_layerwise_offload(model) first. "
            "The model computes with the weights it had."
        )

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
        self.done = [{} for _ in self.done]
