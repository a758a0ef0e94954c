"""A streamed group's step under CUDA graph capture (docs/compile.md, "CUDA graphs").

While the device's current stream captures (torch.cuda.graph, or the CUDA graphs of
torch.compile(mode="reduce-overhead")), the group's hooks do not use the copy
engine: a graph replays device work only, never the host bookkeeping of the slot
ring, so the captured step must carry its whole schedule. CaptureSchedule issues
it with torch's own streams and events, which the capture records:

- each streamed layer is copied from its host block (pinned) into its fixed slot on
  a copy stream forked from the capturing stream by an event, after the slot's
  previous layer in this step has computed (an event recorded after its compute);
- the capturing stream waits on the copy's event before the layer computes, so
  every fork is joined inside the capture;
- the next `prefetch_depth` streamed layers of the group are issued as soon as
  their slots are free, so a replay overlaps copies with compute as eager does;
  nothing is prefetched past the group's last layer (the next replay starts from
  slots whose contents it cannot know, and copies its first layers itself).

The slots are fixed and the host blocks do not move, so the schedule is static:
every replay moves the same bytes from the same host blocks, and a write into a
block between replays (load_state_dict) is what the next replay copies. What a
graph touches (the slots, the host blocks, the resident layers' tensors) is kept
on the model (KEPT) for its lifetime: a set_residency or a removal after a capture
never frees memory a replay still uses; the old graph keeps computing with the
placement it captured.

`refusal(group)` names what cannot be captured: a disk read, a decode of an
encoded layer, a split gather (host work and collectives), routed experts (the
host picks the rows after the router ran), pageable host blocks, and a capture
with grad enabled. The stream and event calls go through `api`, so the schedule is
tested on the CPU with a recording stand-in (tests/runtime/test_capture.py).
"""
from __future__ import annotations

import torch

# On the model: what captured graphs of its groups copy into, from and compute with
# (slots, host blocks, the parameters' tensors), kept alive for the model's lifetime.
KEPT = "_layerwise_captured"


class CudaApi:
    """The stream and event calls of a schedule, on a CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def record(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()


def refusal(group, api) -> str | None:
    """Why `group`'s step cannot be captured, or None."""
    name = group.layer_name
    if torch.is_grad_enabled() and any(p.requires_grad for p in group.plan.module_list.parameters()):
        return (f"{name}: capture with grad enabled (a backward would read weights from slots that later layers "
                "refill); capture under torch.no_grad() or torch.inference_mode()")
    if group.experts is not None:
        return (f"{name}: routed experts (experts='routed'): the host picks the expert rows to copy after the "
                "router ran, which a graph cannot replay; configure with experts='all'")
    if group.calls_under_way() > 1:
        return (f"{name}: another call of the model is under way on another thread, and a captured step's copies "
                "are its own (they cannot join another call's fetches); capture while no other thread calls the model")
    for i in group.ring.streamed:
        src = group.sources[i]
        if src.kind != "arena":
            what = {"disk": "a disk read (host work, not device work)",
                    "lossless": "a decode of an encoded layer (compress='lossless')",
                    "share": "a split-fetch gather (a collective across ranks)"}.get(src.kind, f"a {src.kind} fetch")
            return (f"{name}[{i}]: {what} cannot be captured; capture a model streamed from host memory "
                    "(no spill_dir/host_budget spill, compress=None, split_fetch=None)")
        if src.shared:
            return (f"{name}[{i}]: its host block is in the machine's shared arena (share_host), and a write "
                    "(load_state_dict, a LoRA merge) would move it to a block of this process's own that a captured "
                    "graph would not read; capture a model configured with share_host=False")
        if not api.pinned(src.host):
            return (f"{name}[{i}]: its host block is not pinned (pin_memory was off or refused), and a copy from "
                    "pageable memory cannot be captured; configure with pin_memory=True")
    return None


class CaptureSchedule:
    """The copies and waits of one captured step of a group (see the module docstring)."""

    def __init__(self, ring, blocks, depth: int, api, copy_stream=None):
        self.ring, self.blocks, self.depth, self.api = ring, blocks, depth, api
        self.copy_stream = copy_stream if copy_stream is not None else api.new_stream()
        self.copied: dict[int, object] = {}  # layer -> the event after its copy
        self.waited: set[int] = set()
        self.occupant: dict[int, int] = {}  # slot -> the layer copied into it last in this step
        self.free: dict[int, object] = {}  # slot -> the event after its occupant computed
        self.left: set[int] = set()  # the layers that computed: all of them make the step whole

    def _issue(self, j: int, needed: bool) -> bool:
        if j in self.copied:
            return True
        s = self.ring.slot_of[j]
        k = self.occupant.get(s)
        if k is None:  # the slot's first use in this step: after everything captured so far
            after = self.api.record(self.api.current_stream())
        else:
            after = self.free.get(s)
            if after is None:  # its layer has not computed yet
                if needed:
                    raise RuntimeError(
                        f"layerwise: layer {j} was called while layer {k}, which shares its slot, was copied for "
                        "this captured step and has not run yet: a captured step must call its layers in order")
                return False
        self.api.wait(self.copy_stream, after)
        # (through .data: a copy of ours must not bump the slot's version counter,
        # which tells the state contract that someone wrote into the slot)
        self.api.copy(self.copy_stream, self.ring.dst[j].data, self.blocks[j])
        self.copied[j] = self.api.record(self.copy_stream)
        self.occupant[s] = j
        self.free.pop(s, None)
        return True

    def _prefetch(self, i: int) -> None:
        pos = self.ring.next_pos[i] + (1 if self.ring.slot_of[i] >= 0 else 0)
        for j in self.ring.streamed[pos : pos + self.depth]:
            if not self._issue(j, needed=False):
                break

    def enter(self, i: int) -> None:
        if self.ring.slot_of[i] >= 0:
            if i in self.waited:
                raise RuntimeError(f"layerwise: layer {i} was called twice in one captured step; a captured "
                                   "step calls each streamed layer once")
            self._issue(i, needed=True)
            self.api.wait(self.api.current_stream(), self.copied[i])
            self.waited.add(i)
        self._prefetch(i)

    def leave(self, i: int) -> bool:
        """Layer i computed; True once every layer of the group has (the step is
        whole: every fork joined)."""
        if self.ring.slot_of[i] >= 0:
            self.free[self.ring.slot_of[i]] = self.api.record(self.api.current_stream())
        self.left.add(i)
        if len(self.left) == len(self.ring.slot_of):
            self.join()
            return True
        self._prefetch(i)
        return False

    def join(self) -> None:
        """Join every copy the capturing stream has not waited on (a capture must
        end with no fork left open)."""
        for j, ev in self.copied.items():
            if j not in self.waited:
                self.api.wait(self.api.current_stream(), ev)
                self.waited.add(j)
