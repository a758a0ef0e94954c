"""The model lock: one reentrant lock per offloaded model, held by a forward from a
layer's pre-hook to its post-hook, that survives a forward abandoned by an interrupt
(see ModelLock)."""
from __future__ import annotations

import sys
import threading
import time
import weakref

from torch import nn

from layerwise.contract import registry

LOCK = "_layerwise_lock"


class ModelLock:
    """One model's reentrant lock, shared by all its groups (prefetch crosses groups).

    A forward holds it from a layer's pre-hook to its post-hook. torch runs
    always_call forward hooks when an Exception leaves a module, not a
    KeyboardInterrupt or SystemExit: such a forward leaves its hold behind. A hold
    is *stale* once its thread has died or has left the module call that took it
    (that call's frame is no longer on the thread's stack); a thread waiting for the
    lock then takes it over (`on_take_over` forgets the layers the abandoned forward
    left marked as computing) instead of waiting for that thread to call the model
    again. Holds taken by `with` blocks are released by Python, never stale.

    Mutual exclusion is a C RLock (`threading.RLock`), whose acquire and release a
    signal cannot split; taking over replaces it with a fresh one (the abandoned
    hold keeps the old one, which nobody waits on any more). The bookkeeping next to
    it (owner, holds) is Python and may be cut short by a KeyboardInterrupt: a lock
    held with no bookkeeping is taken over too, once it has stayed so for a while.
    `wait` / `notify_all` stand in for a condition on the lock (the removal waits
    for forwards with them), by polling."""

    _POLL = 0.05  # s between looks at a held lock's owner
    _UNKNOWN_S = 1.0  # a lock held with no owner on record for this long is taken over

    def __init__(self):
        self._rl = threading.RLock()
        self._swap = threading.Lock()  # one take-over at a time
        self._owner = None
        self._holds: list = []  # the owner's holds: (module-call frame or None, the RLock it holds)
        self._reset_pending = False
        self.on_take_over = None
        self.taken_over = 0

    def _stale(self, unknown_since: float | None) -> bool:
        owner, holds = self._owner, list(self._holds)
        if owner is None or not holds:  # held, with nothing on record (a hold cut short)
            return unknown_since is not None and time.monotonic() - unknown_since > self._UNKNOWN_S
        if any(f is None for f, _ in holds):
            return False
        return not on_stack(owner, {id(f) for f, _ in holds})

    def acquire(self, frame=None) -> bool:
        me = threading.get_ident()
        unknown_since = None
        while True:
            rl = self._rl
            if rl.acquire(timeout=self._POLL):
                if rl is not self._rl:  # taken over meanwhile: the current one is the lock
                    rl.release()
                    continue
                if self._owner != me:
                    self._owner, self._holds = me, []
                elif any(f is not None for f, _ in self._holds):
                    self._drop_abandoned(me)
                self._holds.append((frame, rl))
                if self._reset_pending:
                    self._reset_pending = False
                    if self.on_take_over is not None:
                        self.on_take_over()
                return True
            known = self._owner is not None and bool(self._holds)
            unknown_since = None if known else (unknown_since or time.monotonic())
            if self._stale(unknown_since):
                with self._swap:
                    if self._rl is rl:
                        self._rl = threading.RLock()
                        self._owner, self._holds, self._reset_pending = None, [], True
                        self.taken_over += 1

    def _drop_abandoned(self, me) -> None:
        """This thread holds the lock again: its holds from module calls that are no
        longer on its stack (a block called alone that a KeyboardInterrupt left) are
        dropped, and what they left marked computing is forgotten (on_take_over)."""
        live = {id(f) for f in _stack_frames(me)}
        keep = [(f, rl) for f, rl in self._holds if f is None or id(f) in live]
        if len(keep) == len(self._holds):
            return
        for f, rl in self._holds:
            if f is not None and id(f) not in live:
                rl.release()
        self._holds = keep
        self._reset_pending = True

    def release(self) -> None:
        """Release this thread's last hold (nothing, where it holds none on record)."""
        if self._owner != threading.get_ident() or not self._holds:
            return
        _, rl = self._holds.pop()
        if not self._holds:
            self._owner = None
        rl.release()

    def is_owned(self) -> bool:
        """This thread holds the lock (a hold on record)."""
        return self._owner == threading.get_ident() and bool(self._holds)

    def release_all(self) -> None:
        """Release every hold of this thread (a forward that an interrupt abandoned
        left its holds behind: the model's root pre-hook, tune after its run)."""
        while self.is_owned():
            self.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def wait(self, timeout: float | None = None) -> None:
        """Release every hold of this thread, sleep a little (at most `timeout`),
        and hold the lock again as before."""
        me = threading.get_ident()
        saved = list(self._holds) if self._owner == me else []
        if saved:
            self._owner, self._holds = None, []
            for _, rl in reversed(saved):
                rl.release()
        again = 0
        try:
            time.sleep(min(0.01, timeout) if timeout is not None else 0.01)
            for frame, _ in saved:
                self.acquire(frame)
                again += 1
        except BaseException:
            for _ in range(again):  # interrupted: hold nothing rather than part
                self.release()
            raise

    def notify_all(self) -> None:
        """(The waiters poll.)"""


def _stack_frames(ident):
    frame = sys._getframe() if ident == threading.get_ident() else sys._current_frames().get(ident)
    while frame is not None:
        yield frame
        frame = frame.f_back


def on_stack(ident, frame_ids: set) -> bool:
    """Whether thread `ident` is alive and one of `frame_ids` is on its stack."""
    return any(id(f) in frame_ids for f in _stack_frames(ident))


def module_call_frame():
    """The frame of torch's module call that runs the calling hook (None where there
    is none: such a hold is never taken over). The frame object itself, held with
    the hold: an id alone could be reused by the next call at the same depth.

    An eager hook is called by that frame itself. A hook that torch.compile traced
    runs as an operator's kernel (runtime/ops.py) from inside the compiled code, a
    dozen frames or more below the module call that encloses it; where the compiled
    code was called as a function (torch.compile(fn), the model's call traced into
    it), no module call encloses it, and the outermost frame of torch.compile's
    entry does. Without one, an exception raised inside a compiled forward (an
    out-of-memory error) leaves a hold that no other thread could ever take over."""
    frame = sys._getframe(2)
    for _ in range(8):  # (the eager hook's path: its module call is a frame or two up)
        if frame is None:
            return None
        if frame.f_code is _CALL_IMPL:
            return frame
        frame = frame.f_back
    entry = getattr(sys.modules.get("torch._dynamo.eval_frame"), "__file__", None)
    outermost = None
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            return frame
        if frame.f_code.co_filename == entry:
            outermost = frame
        frame = frame.f_back
    return outermost


_CALL_IMPL = nn.Module._call_impl.__code__


def model_lock(model: nn.Module) -> ModelLock:
    lock = model.__dict__.get(LOCK)
    if lock is None:
        lock = model.__dict__.setdefault(LOCK, ModelLock())
        ref = weakref.ref(model)
        lock.on_take_over = lambda: registry.forget_abandoned(ref())
    return lock


def threads_alive(threads, me) -> bool:
    alive = {t.ident for t in threading.enumerate()}
    return any(t in alive for t in threads if t != me)
