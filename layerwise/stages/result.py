"""result: what every stage returns (docs/design.md, "Tiers and stages").

A stage's result is either a native event (``layerwise._C.Event``: a copy, a
decode, a gather, a read) or a ``Deferred``: work that cannot be queued yet
because what it waits on is a host event a CUDA stream cannot wait on (a disk
read), or because it is a collective that must be issued at a point every rank
reaches in the same order (a split-fetch gather). Both answer the same calls:

    resolve()      the event to wait on (a Deferred issues its work first, blocking
                   on the host for what it waits on if that is not done yet);
                   raises the stage's error where the work failed
    query()        True once the work has completed (a Deferred not issued: False)
    synchronize()  resolve(), then wait for it
    copy_ms        the timed work's milliseconds once completed, else -1
    start          where a timed fetch's time starts: its first copy's start (an
                   event), or None (not issued yet, not timed)

Stages compose with ``then(prev, fn)``: ``fn(event)`` queues the next stage
after ``prev``'s event and returns its result. Where ``prev`` is an event (or
None) it runs at once; where it is a Deferred, ``then`` returns a Deferred that
runs ``fn`` when resolved. A Deferred is registered with its group's
``Pending`` queue, which issues the ones whose inputs are ready (``pump``, from
the hooks, never blocking) and the collective ones in the order they were made
(``settle``, from the hooks at points every rank reaches alike).

A Deferred that failed raises its error where its own layer is needed. Where a
stage only waits on it without taking its bytes (the next copy into a codec
staging buffer; a gather, which must still tell the other ranks), ``Recovered``
turns that failure into what the next stage gets instead, so that one layer's
failure is not every later layer's.
"""
from __future__ import annotations

import copy

__all__ = ["Deferred", "Pending", "Recovered", "detached", "is_deferred", "then"]


def is_deferred(result) -> bool:
    """A result whose work is not queued yet (it has ready(); a native event has not)."""
    return hasattr(result, "ready")


def detached(err: Exception) -> Exception:
    """A copy of `err` with no traceback, cause or context: what a Deferred keeps
    and raises again. A kept traceback holds the failed forward's frames, and
    through their tensors the autograd graph and its saved-tensor hooks, which
    hold the manager: a cycle through C++ that gc cannot see."""
    try:
        new = copy.copy(err)
    except Exception:  # noqa: BLE001  (an exception type that cannot be rebuilt from its args)
        new = RuntimeError(str(err))
    new.__traceback__ = new.__cause__ = new.__context__ = None
    return new


class Deferred:
    """Work queued once `prev` (a stage result, or None) has resolved: `fn(event)`
    returns the work's result (an event, None, or another Deferred, resolved in
    turn). `collective`: issued only by `Pending.settle` or where it is needed."""

    __slots__ = ("prev", "fn", "ev", "error", "collective", "done", "__weakref__")

    def __init__(self, fn, prev=None, collective: bool = False):
        self.prev, self.fn, self.collective = prev, fn, collective
        self.ev = None
        self.error = None
        self.done = False

    def ready(self) -> bool:
        """True once resolve() would not block on the host."""
        if self.done or self.error is not None:
            return True
        prev = self.prev
        if prev is None:
            return True
        if is_deferred(prev):
            return prev.ready()
        try:
            return prev.query()
        except Exception:  # noqa: BLE001 - failed: resolve() raises it
            return True

    def resolve(self):
        if self.done:
            return self.ev
        if self.error is not None:
            raise detached(self.error)
        try:
            prev = self.prev.resolve() if self.prev is not None else None
            out = self.fn(prev)
            while is_deferred(out):
                out = out.resolve()  # a Deferred made by fn: issued now too
        except BaseException as err:
            if isinstance(err, Exception):
                self.error = detached(err)
            raise
        self.ev, self.done, self.prev, self.fn = out, True, None, None
        return out

    def query(self) -> bool:
        if self.error is not None:
            return True  # it never ran (copy_ms stays -1)
        return self.done and (self.ev is None or self.ev.query())

    def synchronize(self) -> None:
        ev = self.resolve()
        if ev is not None:
            ev.synchronize()

    @property
    def copy_ms(self) -> float:
        return self.ev.copy_ms if self.done and self.ev is not None else -1.0

    @property
    def start(self):
        return self.ev.start if self.done and self.ev is not None else None


class Recovered:
    """A Deferred `prev` as the input of the next stage, where its failure is not the
    next stage's: resolves to `prev`'s event, or to `on_error(err)` where it failed
    (what the next stage waits on instead). An interrupt is raised as it is."""

    __slots__ = ("prev", "on_error")

    def __init__(self, prev, on_error):
        self.prev, self.on_error = prev, on_error

    def ready(self) -> bool:
        return self.prev.ready()

    def resolve(self):
        try:
            return self.prev.resolve()
        except Exception as err:  # noqa: BLE001 - its own layer raises it; the next stage gets on_error's
            return self.on_error(err)


def then(prev, fn, pending: Pending | None = None, collective: bool = False):
    """`fn(event)` after `prev`: now where `prev` is an event or None (and the work
    is not collective), else a Deferred registered with `pending`."""
    if not collective and not is_deferred(prev):
        return fn(prev)
    d = Deferred(fn, prev, collective)
    if pending is not None:
        pending.add(d)
    return d


class Pending:
    """A group's Deferreds not issued yet, oldest first."""

    def __init__(self):
        self.items: list[Deferred] = []

    def add(self, d: Deferred) -> None:
        self.items.append(d)

    def _issue(self, d: Deferred) -> None:
        try:
            d.resolve()
        except Exception:  # noqa: BLE001 - the error stays with the Deferred: raised where its layer is needed
            pass

    def pump(self) -> None:
        """Issue the non-collective ones whose inputs are ready (never blocks)."""
        if not self.items:
            return
        for d in list(self.items):
            if not d.collective and not d.done and d.error is None and d.ready():
                self._issue(d)
        self._prune()

    def settle(self) -> None:
        """Issue the collective ones, in the order they were made (blocking on what
        they wait on): every rank issues its collectives in the same order."""
        if not self.items:
            return
        for d in list(self.items):
            if d.collective and not d.done and d.error is None:
                self._issue(d)
        self._prune()

    def flush(self, collectives: bool = True) -> None:
        """Issue every one (the collective ones only if `collectives`), in order (blocking)."""
        for d in list(self.items):
            if not d.done and d.error is None and (collectives or not d.collective):
                self._issue(d)
        self._prune()

    def forget(self) -> None:
        """Drop them unissued (after an interrupt: their layers reload)."""
        for d in self.items:
            if not d.done and d.error is None:
                d.error = RuntimeError("layerwise: internal: a forgotten deferred fetch was used")
        self.items = []

    def _prune(self) -> None:
        self.items = [d for d in self.items if not d.done and d.error is None]
