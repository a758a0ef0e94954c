"""cohort: concurrent calls of one streamed model share each layer's fetch
(docs/cohort.md).

A *call* is one forward of the model on one thread: the model's root hooks
begin and end it (contract/registry.py). While two or more calls are under way,
a streamed layer's pre-hook has two phases (runtime/group.py):

1. **Join**, without holding the model's lock while it waits: the call joins
   the fetch of its layer that is in the layer's slot, or queues it if the
   schedule below gives it the slot, or waits until it does (a layer already
   in its slot is joined without the lock at all: the call computing holds
   it, and phase 2 checks the slot again anyway). On the CPU backend
   the host then waits for the bytes, still without the lock, so that another
   call computes meanwhile.
2. **Compute**, under the model's lock, as a call alone does: the layer's fetch
   is checked again (a load_state_dict, a resync or set_residency in between
   makes it reload, exactly as alone), the compute waits for it, and the next
   fetches are queued. Layers compute one at a time, as before.

**The schedule.** Each call has a position: the model-wide index of the next
layer it needs (the groups' layers one after another, in the order the groups
were configured). A slot keeps its holding (the fetch of one layer into it)
while anything computes in it and while a call that joined it has not computed
on it yet. Otherwise the slot goes to the earliest layer (model-wide index)
among each call's next layer in that slot: the call furthest behind first. The
layer the slot holds competes too, so a holding stays while the call behind
still needs it. Calls ahead therefore wait for the calls behind, which catch up
on layers that are fetched for them alone, and from then on the calls move in
step and every fetch serves them all: calls that start together never drift
apart, and a call that starts late costs the others one wait while it catches
up. A call that has waited for one turn of the ring (as many fetches as the
model streams layers, less a ring's slots) or AGE_S is *aged* and ranks
before every call that is not; it then waits at most for the fetches already
queued into the slots and the computes of the calls that joined them, so no
call waits for more than one turn of fetches. A call that stays STALL_S between two layers (in its own code, a
resident layer) does not rank: nothing is kept for it meanwhile.

No cycle of waits: the call furthest behind among those waiting (the aged ones
first) ranks first in its own slot, since every other call's next layer there
comes at or after its own; it gets the slot once the calls that joined the
holding there have computed, which they do without waiting on anything else. The schedule only
decides which fetch goes first: whatever it decides, phase 2 reloads a layer
that is not in its slot, so a call's output is exactly that of the call alone.
"""
from __future__ import annotations

import threading
import time
import weakref

from layerwise.contract import locking, registry
from layerwise.contract.registry import COHORT

RUNNING, WAITING, JOINED, COMPUTING = "running", "waiting", "joined", "computing"

# Threads whose calls stop at their next streamed layer (run_together after a Ctrl-C):
# ident -> the message of the RuntimeError they raise there.
CANCELLED: dict[int, str] = {}


def cancel(idents, message: str) -> None:
    for ident in idents:
        if ident is not None:
            CANCELLED[ident] = message


def uncancel(idents) -> None:
    for ident in idents:
        CANCELLED.pop(ident, None)


def check_cancelled() -> None:
    """Raise in a thread whose calls were cancelled (an Exception: the forward's
    post-hooks run, and the model stays exact)."""
    message = CANCELLED.get(threading.get_ident())
    if message is not None:
        raise RuntimeError(message)


class Call:
    """One forward of the model under way on one thread."""

    __slots__ = ("ident", "frames", "pos", "state", "since", "joined", "stall_s", "checked", "wait_from")

    def __init__(self, ident: int, frame):
        self.ident = ident
        self.frames = [frame]  # the model's module-call frames on this thread (a forward inside a forward: two)
        self.pos = 0  # model-wide index of the next layer it needs (Cohort.offset)
        self.state = RUNNING
        self.since = time.monotonic()  # when `state` was last set
        self.joined = None  # (group, layer) whose holding it joined and has not computed on yet
        self.stall_s = 0.0  # the host's wait for the joined fetch (CPU), for the group's figures
        self.checked = self.since  # when it was last found alive
        self.wait_from = None  # (Cohort.fetches, time) when its wait began, while it waits

    def at(self, state: str) -> None:
        self.state, self.since = state, time.monotonic()


class Cohort:
    """The calls of one model under way, and the schedule they share."""

    STALL_S = 0.1  # s between two layers after which a call's next layer is no longer kept for it
    AGE_S = 0.5  # s of waiting after which a call is aged even if the ring has not turned
    CHECK_S = 1.0  # s a call may keep a holding before its thread is checked for life
    POLL_S = 0.05  # s between looks while a call waits (a wake-up is also sent at every change)

    def __init__(self, model=None):
        self._model = weakref.ref(model) if model is not None else (lambda: None)
        self._offsets: dict[int, int] = {}
        self._groups: list = []  # the model's groups, in the order of their offsets
        self.fetches = 0  # fetches queued by the model's groups
        self.calls: dict[int, Call] = {}  # replaced whole at every change: readers iterate what they took
        self._mu = threading.Lock()  # (begin, end and drop replace `calls`)
        self._cond = threading.Condition(threading.Lock())
        self._seq = 0  # bumped at every change a waiting call may be waiting for
        self.sharing = True  # every group of the model has share_calls (and no split_fetch)
        self.calls_max = 0
        self.joins = 0  # joins of a fetch that another call had queued or joined
        self.loads = 0  # fetches queued by a call for its own layer in phase 1
        self.waits = 0  # joins that had to wait for the schedule
        self.wait_s_max = 0.0  # the longest of those waits, seconds
        self.wait_turns_max = 0.0  # the longest, in turns: the model's fetches over its streamed layers
        self.deferred = 0  # fetches put off because a call needed another layer of the slot first
        self.dropped = 0  # calls found dead (their thread gone, or their forward left by an interrupt)

    # ------------------------------------------------------------ calls
    def shared(self) -> bool:
        """Two or more calls are under way and the model shares them."""
        return self.sharing and len(self.calls) > 1

    def mine(self) -> Call | None:
        return self.calls.get(threading.get_ident())

    def begin(self, frame) -> None:
        """A forward of the model begins on this thread (its root pre-hook)."""
        me = threading.get_ident()
        with self._mu:
            call = self.calls.get(me)
            if call is not None and call.frames and locking.on_stack(me, {id(f) for f in call.frames}):
                call.frames.append(frame)  # the model called inside its own forward: one call
                return
            calls = {k: c for k, c in self.calls.items() if k != me and self._live(c)}
            self.dropped += len(self.calls) - len(calls) - (call is not None)
            calls[me] = Call(me, frame)
            self.calls = calls
            self.calls_max = max(self.calls_max, len(calls))
        if len(calls) > 1:  # (alone, nobody waits: a call alone pays no wake-up per forward)
            self.notify()

    def end(self) -> None:
        """This thread's forward of the model ends (its root post-hook)."""
        me = threading.get_ident()
        with self._mu:
            call = self.calls.get(me)
            if call is None:
                return
            if len(call.frames) > 1:
                call.frames.pop()
                return
            self.calls = {k: c for k, c in self.calls.items() if k != me}
        if self.calls:
            self.notify()

    @staticmethod
    def _live(call: Call) -> bool:
        return locking.on_stack(call.ident, {id(f) for f in call.frames if f is not None}) \
            if any(f is not None for f in call.frames) else locking.threads_alive([call.ident], None)

    def _alive(self, call: Call, now: float) -> bool:
        """`call` may keep what it holds: checked for life once it has kept it CHECK_S."""
        if now - call.checked < self.CHECK_S:
            return True
        if self._live(call):
            call.checked = now
            return True
        self._drop(call)
        return False

    def _drop(self, call: Call) -> None:
        with self._mu:
            if self.calls.get(call.ident) is call:
                self.calls = {k: c for k, c in self.calls.items() if c is not call}
                self.dropped += 1

    # ------------------------------------------------------------ waits
    def seq(self) -> int:
        return self._seq

    def notify(self) -> None:
        with self._cond:
            self._seq += 1
            self._cond.notify_all()

    def wait(self, seq: int) -> None:
        """Sleep until a change after `seq` (or POLL_S)."""
        with self._cond:
            if self._seq == seq:
                self._cond.wait(self.POLL_S)

    # ------------------------------------------------------------ the schedule
    def offset(self, group) -> int:
        """The model-wide index of `group`'s layer 0: the groups' layers one after
        another, in the order they were configured."""
        off = self._offsets.get(id(group))
        if off is None:
            model = self._model()
            groups = list(registry.managers_of(model)) if model is not None else []
            if all(m is not group for m in groups):
                groups.append(group)
            self._offsets, self._groups, at = {}, groups, 0
            for m in groups:
                self._offsets[id(m)] = at
                at += m.num_layers
            off = self._offsets[id(group)]
        return off

    def turn(self) -> int:
        """Fetches in one turn of the ring: the streamed layers of the model's groups
        (as of the last offset(), which every decision makes first)."""
        return max(1, sum(len(m.ring.streamed) for m in self._groups if m.ring is not None))

    def regroup(self) -> None:
        """The model's groups changed (configured, removed): offsets are made again."""
        self._offsets = {}

    def _rank(self, call: Call, group, s: int, off: int, now: float, turn: int):
        """(rank, layer): the next layer `call` needs from slot s of `group`, ranked
        (smaller first) by whether the call is aged, then by that layer's model-wide
        index (the call furthest behind first); None where it needs none in this forward."""
        ring = group.ring
        p = call.pos
        if p >= off + group.num_layers:
            return None
        w = ring.first_in_slot(max(0, p - off), s)
        if w < 0:
            return None
        aged = call.wait_from is not None and (self.fetches - call.wait_from[0] >= turn
                                               or now - call.wait_from[1] > self.AGE_S)
        return (not aged, off + w), w

    def may_fill(self, group, i: int, held: int) -> bool:
        """May slot(i) of `group`, which holds layer `held` (-1: nothing valid), take
        layer i now? Called under the model's lock."""
        ring = group.ring
        s = ring.slot_of[i]
        if ring.busy[s]:
            return False
        now = time.monotonic()
        off = self.offset(group)
        # Aged a ring's worth of fetches before the turn is over: once aged, a call
        # waits at most for the fetches already queued into the slots.
        rings = [m.ring for m in self._groups if m.ring is not None]
        turn = max(1, self.turn() - max((r.num_slots for r in rings), default=0))
        best = None
        me = threading.get_ident()
        for call in list(self.calls.values()):
            if call.state == COMPUTING and call.ident != me:
                # No other call computes while this thread holds the model's lock: that
                # call's forward was abandoned inside a layer (a KeyboardInterrupt skips
                # the post-hook), and nothing should be kept or put off for it.
                self._drop(call)
                continue
            if call.state != RUNNING and not self._alive(call, now):
                continue  # (its thread died, or left its forward, while joined or waiting)
            joined = call.joined
            if joined is not None and joined[0] is group and joined[1] == held >= 0 and self._alive(call, now):
                return False  # it has not computed on the holding yet
            if call.state == RUNNING and now - call.since > self.STALL_S:
                continue  # between two layers for long: not waited for
            ranked = self._rank(call, group, s, off, now, turn)
            if ranked is None or (ranked[1] == held and not self._alive(call, now)):
                continue
            if best is None or ranked[0] < best[0]:
                best = ranked
        if best is None:
            return True
        if best[1] != i and best[1] != held:
            self.deferred += 1
        return best[1] == i

    def joined(self, call: Call, group, i: int, shared: bool, waited: bool) -> None:
        """`call` joined layer i's holding: it found it (`shared`) or queued it;
        `waited`: not at its first look. Counted under the cohort's own lock: a call
        joins under the model's lock, or without it (joined_held)."""
        with self._mu:
            if waited and call.wait_from is not None:
                self.waits += 1
                self.wait_s_max = max(self.wait_s_max, time.monotonic() - call.wait_from[1])
                # (its own fetch, queued just now, is not part of its wait)
                fetches = self.fetches - call.wait_from[0] - (not shared)
                self.wait_turns_max = max(self.wait_turns_max, fetches / self.turn())
            call.joined = (group, i)
            call.at(JOINED)
            call.wait_from = None
            if shared:
                self.joins += 1
            else:
                self.loads += 1

    def joined_held(self, call: Call, group, i: int) -> None:
        """`call` joins layer i's holding, found in its slot without the model's lock
        (the fast path of phase 1: a prefetch queued it)."""
        call.pos = self.offset(group) + i
        self.joined(call, group, i, True, False)

    def joined_to(self, group, i: int) -> bool:
        """A call has joined layer i of `group` and not computed on it yet."""
        return any(c.joined is not None and c.joined[0] is group and c.joined[1] == i
                   for c in list(self.calls.values()))

    def waiting(self, call: Call, group, i: int) -> None:
        """`call` waits for layer i of `group` (phase 1, under the model's lock)."""
        call.pos = self.offset(group) + i
        if call.state != WAITING:
            call.at(WAITING)
            call.wait_from = (self.fetches, call.since)

    def left(self, call: Call, group, i: int) -> None:
        """`call` computed layer i of `group` (its post-hook, under the model's lock)."""
        call.pos = self.offset(group) + i + 1
        call.joined = None
        call.at(RUNNING)

    def figures(self) -> dict:
        return {
            "share_calls": self.sharing,
            "calls_now": len(self.calls),
            "calls_max": self.calls_max,
            "joins": self.joins,
            "loads": self.loads,
            "waits": self.waits,
            "wait_s_max": self.wait_s_max,
            "wait_turns_max": self.wait_turns_max,
            "deferred": self.deferred,
            "dropped": self.dropped,
        }


def of(model) -> Cohort:
    """The model's cohort (made with its first group's finalisation, dropped with its last group)."""
    co = model.__dict__.get(COHORT)
    if co is None:
        co = model.__dict__.setdefault(COHORT, Cohort(model))
    return co
