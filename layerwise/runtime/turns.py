"""turns: run_together's calls on a split-fetch model (docs/cohort.md, "Split fetch").

The ranks of a split_fetch group must issue the same collectives in the same
order: the slot gathers of every fetch, and any collective inside a layer (a
sequence-parallel all-to-all). The timing of threads differs from rank to rank,
so the cohort's schedule (runtime/cohort.py), which decides from timing, cannot
serve calls on a split model. run_together's calls there take *turns* instead,
which decide from what every rank agreed:

- A **turn** is one forward of one model of the split group by a set of calls,
  its members. When no turn is under way and a call of this rank waits at a
  model's root pre-hook, one waiting thread (the leader) runs the agreement on
  every rank: an all-gather, after the lockstep tag check, of where each of the
  session's calls waits (the model's number, or -1) and how many agreements
  passed it over. The turn's model is the one where the call passed over most
  often waits (the lowest-numbered first); its members are the calls waiting
  there on any rank (the union: a call that waits on one rank arrives on the
  others, since each call does the same things on every rank). Calls waiting
  elsewhere wait for a later turn; passed over, they rank before the calls
  that just had a turn, so a call waits for the turn under way when it
  arrives and at most one turn of each other model where calls wait.
- Within a turn, **one member runs at a time**, in index order, from one
  layer's pre-hook to its next layer's pre-hook (or the end of its forward),
  then hands the baton to the next member. Every rank therefore runs the same
  sequence of layer computes and code between layers, the members' fetches are
  the same as one call's (member k+1 finds the layer member k fetched in its
  slot), and the collectives inside layers pair up call by call.
- A member whose forward ends leaves the turn; the turn ends with its last
  member. A member whose forward an exception left is found gone (its forward's
  frame off its thread's stack) and leaves likewise.

Exactness does not rest on turns: every layer computes as a call alone does (the
model's lock, the slot checked again). Turns only make the ranks' collectives
agree. A call that never arrives where another rank's call of the same number
waits, or arrives at another model, is a rank out of lockstep: SplitError on
that rank (and the timeout on the others), as for any collective.
"""
from __future__ import annotations

import threading
import time
import weakref

import torch

from layerwise.contract import locking
from layerwise.stages.split import collectives

POLL_S = 0.05  # s between looks while a call waits (every change also wakes the waiters)
GRACE_S = 0.5  # at most this long the leader waits for the session's other calls before it agrees
TURNS = "_layerwise_turns"  # model.__dict__: (the split group's Turns, the model's number in it)


class Session:
    """One run_together over split-fetch models: its calls' numbers, by thread."""

    def __init__(self, n: int):
        self.n = n
        self.index: dict[int, int] = {}  # thread ident -> call number, while the call runs
        self.done: set[int] = set()  # call numbers whose callable has ended

    def enlist(self, k: int) -> None:
        self.index[threading.get_ident()] = k

    def discharge(self, k: int) -> None:
        self.index.pop(threading.get_ident(), None)
        self.done.add(k)
        for t in list(_ALL):  # a turn may be waiting for this call
            t.wake()


SESSION: list = []  # [the open Session] while a run_together over a split-fetch model runs
_MU = threading.Lock()
_ALL: weakref.WeakSet = weakref.WeakSet()
_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def open_session(n: int) -> Session:
    """run_together's calls on split-fetch models: one such run_together at a time in
    a process (the ranks pair their calls by number)."""
    with _MU:
        if SESSION:
            raise RuntimeError(
                "layerwise.run_together: another run_together on a split_fetch model is under way in this "
                "process. On a split model every rank must run the same calls in the same order, which two "
                "batches at once cannot promise: run the batches one after another (or put their calls in one "
                "run_together).")
        s = Session(n)
        SESSION.append(s)
        return s


def close_session(s: Session) -> None:
    with _MU:
        if SESSION and SESSION[0] is s:
            SESSION.clear()


def of(group) -> "Turns":
    """The turns of a split-fetch group (made at its first use)."""
    with _MU:
        t = _OF.get(group)
        if t is None:
            t = _OF[group] = Turns(group)
            _ALL.add(t)
        return t


def attach(model, group, number: int) -> None:
    """A group of `model` streams through split-fetch group `group` as layer group
    `number` (its ShareStore's number): the model's turns are the group's, and its
    number in the agreement is the lowest of its groups' (the same on every rank)."""
    had = model.__dict__.get(TURNS)
    model.__dict__[TURNS] = (of(group), number if had is None else min(had[1], number))


def detach(model) -> None:
    model.__dict__.pop(TURNS, None)


def figures(model) -> dict:
    """stats()["calls"]'s turn figures (None where the model has no split-fetch turns)."""
    t = model.__dict__.get(TURNS)
    return t[0].figures() if t is not None else {"turns": None, "admitted_late": None, "passed_over_max": None}


def _me():
    """(session, this thread's call number) for a thread of run_together's split session, else None."""
    if not SESSION:
        return None
    s = SESSION[0]
    k = s.index.get(threading.get_ident())
    return None if k is None else (s, k)


def _cancelled(session: Session) -> bool:
    """run_together was interrupted here (runtime/cohort.py's cancel table)."""
    from layerwise.runtime import cohort  # (here: cohort imports the registry, which imports this module)

    return any(ident in cohort.CANCELLED for ident in list(session.index))


def begin(model, frame) -> None:
    """A forward of `model` begins on this thread (its root pre-hook): a call of
    run_together's split session waits for its turn and then for the baton."""
    t = model.__dict__.get(TURNS)
    if t is None or not SESSION:
        return
    me = _me()
    if me is not None:
        t[0].begin(me[0], me[1], t[1], frame)


def end(model) -> None:
    """A forward of `model` ends on this thread (its root post-hook)."""
    t = model.__dict__.get(TURNS)
    if t is None or not SESSION:
        return
    me = _me()
    if me is not None:
        t[0].end(me[1], t[1])


def layer(model) -> bool:
    """A layer of `model` is about to compute on this thread: a member of a turn on
    it hands the baton on (if it computed a layer since it took it) and waits for
    it back. True where this thread is such a member."""
    t = model.__dict__.get(TURNS)
    if t is None or not SESSION:
        return False
    me = _me()
    return me is not None and t[0].layer(me[1], t[1])


class Member:
    __slots__ = ("arrived", "ident", "frame", "depth", "ran")

    def __init__(self):
        self.arrived = False
        self.ident = None
        self.frame = None  # the frame of its forward: off its thread's stack, the forward is over
        self.depth = 0  # forwards of the model on its thread (the model called inside itself: 2)
        self.ran = False  # it computed a layer since it took the baton


class Turns:
    """The turns of one split-fetch group (the models configured with it)."""

    def __init__(self, group):
        self._group = weakref.ref(group)
        self._cond = threading.Condition()
        self.count = 0  # turns agreed so far (the same on every rank: checked by the agreement)
        self.model = None  # the model number of the turn under way, or None
        self.members: dict[int, Member] = {}  # the turn's members by call number, in index order
        self.baton = None  # the call number that runs now
        self.moves = 0  # turns agreed, batons handed on and members gone so far (progress)
        self.waiting: dict[int, int] = {}  # call number -> model number, waiting for a turn
        self.agreeing = False  # a leader runs the agreement now
        self.broken: str | None = None  # why the turn under way cannot go on (SplitError on its members)
        self.failed = None  # (session, error class, why): an agreement failed or was told to stop the session
        self.turn_s = 0.0  # the last turn's length
        self._started = 0.0
        self.admitted_late = 0  # members admitted before they arrived on this rank (figures)
        self.last_members: set = set()  # the last turn's members (the leader waits a little for them)
        self.passed: dict[int, int] = {}  # call number -> agreements that passed it over while it waited here
        self.passed_max = 0  # the most agreements that passed one call over (figures)
        self.last_session = None

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------ a forward
    def begin(self, session: Session, k: int, model_no: int, frame) -> None:
        with self._cond:
            m = self.members.get(k)
            if m is not None and m.arrived and not locking.on_stack(m.ident, {id(m.frame)}):
                self._leave(k)  # its last forward was left by an exception before anyone noticed
                m = None
            if m is not None and m.arrived and self.model == model_no:
                m.depth += 1  # the model called inside its own forward: one call
                return
            if m is not None and m.arrived:
                # This call's own error, made by its code on every rank: the turn goes on for
                # the others (its outer forward, left by the error, leaves the turn as usual).
                raise collectives.SplitError(
                    f"layerwise run_together on a split-fetch model: call {k} began a forward of layer group "
                    f"#{model_no} inside its turn on layer group #{self.model}; a call on split-fetch models runs "
                    "one model's forward at a time")
            self.waiting[k] = model_no
            self._cond.notify_all()  # (a leader may be waiting for this call)
            try:
                self._admitted(session, k, model_no)
            finally:
                self.waiting.pop(k, None)
                self.passed.pop(k, None)
            m = self.members[k]
            m.arrived, m.ident, m.frame, m.depth, m.ran = True, threading.get_ident(), frame, 1, False
            self._cond.notify_all()
            self._wait_baton(session, k)

    def end(self, k: int, model_no: int) -> None:
        with self._cond:
            m = self.members.get(k)
            if m is None or not m.arrived or self.model != model_no:
                return
            m.depth -= 1
            if m.depth <= 0:
                self._leave(k)

    def layer(self, k: int, model_no: int) -> bool:
        with self._cond:
            m = self.members.get(k)
            if m is None or not m.arrived or self.model != model_no:
                return False
            if m.ran:  # its segment (a layer and the code after it) is over: the next member's turn
                self._hand_on(k)
                self._wait_baton(SESSION[0] if SESSION else None, k)
            m.ran = True
            return True

    # ------------------------------------------------------------ inside
    def _admitted(self, session: Session, k: int, model_no: int) -> None:
        """Wait (holding the condition) until call k is a member of a turn on model_no."""
        group = self._group()
        timeout_s = group.timeout_s if group is not None else 300.0
        limit, moves = time.monotonic() + timeout_s, self.moves
        while True:
            self._check_failed(session)
            m = self.members.get(k)
            if m is not None:
                if self.model != model_no:
                    raise self._fail(f"call {k} began a forward of layer group #{model_no} here, while the ranks "
                                     f"agreed that it runs layer group #{self.model} now")
                return
            if self.model is None and not self.agreeing:
                self._lead(session)
                continue
            if self.model is not None:
                self._check_members(session)
            if self.moves != moves:  # turns go on (other calls' forwards): waiting for them is no sign of ranks apart
                limit, moves = time.monotonic() + timeout_s, self.moves
            if time.monotonic() > limit:
                raise collectives.SplitError(
                    f"layerwise run_together: call {k} waited {timeout_s:g} s for a turn on its split-fetch model, "
                    "while no turn went on; the other ranks did not run the same calls (every rank runs "
                    "run_together with the same calls, each doing the same forwards in the same order)")
            self._cond.wait(POLL_S)

    def _lead(self, session: Session) -> None:
        """Agree on the next turn with the other ranks (holding the condition; released
        while the leader waits for the session's other calls and for the ranks)."""
        self.agreeing = True
        try:
            # The last turn's other members are usually a few milliseconds behind (their
            # code between two forwards): admitted now they share this turn's fetches. A
            # call elsewhere for long (a pipeline's decode) costs one grace, not one per
            # turn. At a batch's first turn, every call, for up to GRACE_S: they start
            # together (run_together's start gate), however loaded the machine.
            if self.last_session is session:
                grace, expect = min(GRACE_S, max(0.005, self.turn_s / 4)), self.last_members
            else:
                grace, expect = GRACE_S, range(session.n)
            until = time.monotonic() + grace
            while time.monotonic() < until:
                if all(j in self.waiting or j in session.done for j in expect):
                    break
                self._cond.wait(until - time.monotonic())
            # (and whether run_together was interrupted here: every rank stops at this agreement)
            n = session.n
            mine = [self.waiting.get(j, -1) for j in range(n)] + [self.passed.get(j, 0) for j in range(n)] \
                + [int(_cancelled(session))]
            self._cond.release()
            try:
                rows = self._agree(mine)
            finally:
                self._cond.acquire()
            self._start(rows, session)
        except collectives.SplitError as e:
            # Every rank fails at the same agreement: the session's other calls raise it too,
            # without another collective (a failed one leaves the ranks' queues apart).
            self.failed = (session, collectives.SplitError, str(e))
            raise
        finally:
            self.agreeing = False
            self._cond.notify_all()

    def _agree(self, mine: list) -> list:
        group = self._group()
        if group is None:
            raise collectives.SplitError("layerwise run_together: the split-fetch group is gone")
        count, n = self.count, (len(mine) - 1) // 2

        def run():
            group.agree(collectives.TURN, -1, count, n, 0)
            out = torch.empty(group.world * len(mine), dtype=torch.int64)
            group.wait(collectives.gather(out, torch.tensor(mine, dtype=torch.int64), group.host_pg, async_op=True),
                       f"the agreement on run_together's turn {count}")
            return out.view(group.world, len(mine)).tolist()

        return group.call(run)

    def _start(self, rows: list, session: Session) -> None:
        n = session.n
        stopped = [r for r, row in enumerate(rows) if row[2 * n]]
        if stopped:
            self.count += 1
            ranks = ", ".join(map(str, stopped))
            self.failed = (session, RuntimeError,
                           f"layerwise.run_together: cancelled by Ctrl-C on rank{'s' if len(stopped) > 1 else ''} "
                           f"{ranks} of the split_fetch group: every rank's calls stop at the same turn (the "
                           "forwards under way finished on every rank), so the ranks stay in lockstep")
            self._check_failed(session)
        where = []
        for j in range(n):
            seen = {row[j] for row in rows if row[j] >= 0}
            if len(seen) > 1:
                raise self._fail(f"call {j} waits at different layer groups on different ranks "
                                 f"({sorted(seen)}): the ranks are out of lockstep")
            where.append(seen.pop() if seen else -1)
        # The turn goes to the model of the call passed over most often (on any rank), the
        # lowest-numbered first: a call waiting at one component while the others keep
        # coming back to another is passed over once, not for as long as they come.
        waiting = [j for j in range(n) if where[j] >= 0]
        self.count += 1
        if not waiting:
            return  # (no rank had a call waiting: cannot happen, a leader waits; nothing to run)
        first = max(waiting, key=lambda j: (max(row[n + j] for row in rows), -j))
        self.model = where[first]
        self.members = {j: Member() for j in range(n) if where[j] == self.model}
        self.admitted_late += sum(j not in self.waiting for j in self.members)
        for j in self.waiting:
            if j in self.members:
                self.passed.pop(j, None)
            else:
                self.passed[j] = self.passed.get(j, 0) + 1
                self.passed_max = max(self.passed_max, self.passed[j])
        self.baton = next(iter(self.members))
        self.moves += 1
        self.broken = None
        self.last_members, self.last_session = set(self.members), session
        self._started = time.monotonic()

    def _wait_baton(self, session, k: int) -> None:
        """Wait (holding the condition) until call k holds the baton."""
        while self.baton != k:
            if self.broken is not None:
                why = self.broken
                self._leave(k)
                raise collectives.SplitError(why)
            self._check_members(session)
            if self.baton != k:
                self._cond.wait(POLL_S)

    def _check_members(self, session) -> None:
        """The baton's holder: gone (its forward left by an exception) it leaves the
        turn; admitted and never to arrive here (its callable ended) the turn breaks."""
        b = self.baton
        m = self.members.get(b)
        if m is None:
            return
        if m.arrived:
            if m.frame is not None and not locking.on_stack(m.ident, {id(m.frame)}):
                self._leave(b)
        elif session is not None and b in session.done:
            self.broken = (f"layerwise run_together: call {b} ended on this rank without the forward of layer group "
                           f"#{self.model} that another rank's call {b} began: the ranks are out of lockstep "
                           "(every rank runs the same calls, each doing the same forwards in the same order)")
            self._cond.notify_all()

    def _check_failed(self, session) -> None:
        if self.failed is not None and self.failed[0] is session:
            raise self.failed[1](self.failed[2])

    def _hand_on(self, k: int) -> None:
        order = list(self.members)
        self.baton = order[(order.index(k) + 1) % len(order)]
        self.moves += 1
        self._cond.notify_all()

    def _leave(self, k: int) -> None:
        if k not in self.members:
            return
        if self.baton == k and len(self.members) > 1:
            self._hand_on(k)
        del self.members[k]
        self.moves += 1
        if not self.members:
            self.turn_s = time.monotonic() - self._started
            self.model, self.baton = None, None
        self._cond.notify_all()

    def _fail(self, why: str) -> collectives.SplitError:
        self.broken = f"layerwise run_together on a split-fetch model: {why}"
        self._cond.notify_all()
        return collectives.SplitError(self.broken)


    def figures(self) -> dict:
        return {"turns": self.count, "admitted_late": self.admitted_late, "passed_over_max": self.passed_max}
