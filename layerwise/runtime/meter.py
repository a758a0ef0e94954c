"""meter: a layer group's figures (bytes copied, copies, synchronous loads,
compute-stream stall, copy time), in total, per step and for the recent steps:
what `LayerwiseOffloadManager.stats()` reports and `layerwise.report` reads.

A step is one forward of the model (the root hooks, contract/), prefetches
for the next one included; for blocks called without the model's forward, it
runs from one layer 0 to the next. On CUDA the compute-stream stall is timed
with event pairs on one step in `STALL_SAMPLE_EVERY` (each pair costs two
events and two native calls per layer); pairs and timed copies resolve when
they have completed, never by a sync.

A fetch is timed from its first copy's start to the event it ends in (a copy, a
decode, a gather: the stages give that event the first copy's start,
`Event.start`), on both backends; a timed fetch that moved bytes and completed
without a start is counted in `unstarted` (a stage that lost its start: its
time is missing from copy_s and from tune's bus samples).
"""
from __future__ import annotations

import collections
import time

RECENT_STEPS = 16  # complete steps kept for stats()["recent_steps"] (report's averages)
STALL_SAMPLE_EVERY = 8
_STEP_KEYS = ("bytes_copied", "copies", "sync_loads", "stall_s", "bytes_raw", "bytes_read", "read_wait_s")


class Meter:
    """One group's counters. `extra()` gives the stages' running counts (bytes read
    and the host's wait for reads, stages/chain.py) that steps difference too."""

    def __init__(self, measure_stalls: bool, extra=lambda: (0, 0.0)):
        self.measure_stalls = measure_stalls
        self.extra = extra
        self.copy_log: list | None = None  # (layer, bytes, seconds) of each timed copy, while a probe listens
        self.reset(cuda=False)

    def reset(self, cuda: bool) -> None:
        self.cuda = cuda
        self.bytes = self.bytes_raw = self.copies = self.sync_loads = 0
        self.stall_s = 0.0
        self.stall_pairs = []  # (step, start event, end event), CUDA
        self._step_stall: dict[int, float] = {}
        self.timed_copies = []  # (step, copy result) of the timed steps
        self.copy_s = 0.0
        self.unstarted = 0  # timed fetches that moved bytes and came back with no start
        self._step_copy: dict[int, float] = {}
        self.steps = 0
        self._mark = self._now()
        self._t0 = None
        self.step_open = False
        self.root_driven = False  # steps follow the model's forward (contract._root_*_hook)
        self.timing = self.measure_stalls
        self.last_step = None
        self.recent = collections.deque(maxlen=RECENT_STEPS)  # the last complete steps, oldest first

    def _now(self) -> tuple:
        return (self.bytes, self.copies, self.sync_loads, self.stall_s, self.bytes_raw, *self.extra())

    # ------------------------------------------------------------ recording
    def listen(self, on: bool) -> list | None:
        """Time every copy of every step and log each one per layer (layerwise.tune's
        probe), or stop; returns the log: (layer, bytes that crossed, seconds)."""
        log, self.copy_log = self.copy_log, ([] if on else None)
        self.timing = self._timed_step()
        return self.copy_log if on else log

    def _timed_step(self) -> bool:
        """This step is timed: every step on the CPU or while a probe listens, else one in STALL_SAMPLE_EVERY."""
        return self.measure_stalls and (self.copy_log is not None or not self.cuda
                                        or self.steps % STALL_SAMPLE_EVERY == 1)

    def fetched(self, src, prefetch: bool, result, layer: int = -1) -> None:
        """A fetch of `src` (layer `layer`) was queued (`result`: what it returned)."""
        if self.timing:
            self.timed_copies.append((self.steps, result, layer, src.transfer_bytes))
        self.bytes += src.transfer_bytes
        self.bytes_raw += src.nbytes
        self.copies += 1
        if not prefetch:
            self.sync_loads += 1

    def moved(self, nbytes: int, copies: int) -> None:
        """Copies queued beside the layers' fetches (routed experts' rows: layerwise/planning/experts.py)."""
        self.bytes += nbytes
        self.bytes_raw += nbytes
        self.copies += copies

    def wait(self, engine, ev, stream, meanwhile=None) -> None:
        """Make the compute stream wait for `ev`, timing the stall on timed steps
        (CUDA: an event pair, resolved later; CPU: the host's wait, `meanwhile(ev)`
        included: what the stages do while the host waits, stages.Chain.meanwhile)."""
        if not self.timing:
            if meanwhile is not None:
                meanwhile(ev)
            engine.wait(ev, stream)
        elif engine.is_cuda:
            start = engine.record(stream, True)
            engine.wait(ev, stream)
            self.stall_pairs.append((self.steps, start, engine.record(stream, True)))
        else:
            t0 = time.perf_counter()
            if meanwhile is not None:
                meanwhile(ev)
            engine.wait(ev, stream)
            self.stall_s += time.perf_counter() - t0

    def stalled(self, seconds: float) -> None:
        """The host waited `seconds` for a fetch outside wait() (a call sharing
        it with others waits before it takes the model's lock: runtime/cohort.py)."""
        if self.timing and not self.cuda:
            self.stall_s += seconds

    def dropped(self) -> None:
        """Events it holds keep tensors alive (ring slices, host blocks): drop them."""
        self.stall_pairs, self.timed_copies = [], []

    # ------------------------------------------------------------ steps
    def follow_root(self) -> None:
        """Steps follow the model's forward from now on (the root hooks, contract/)."""
        self.root_driven = True

    def new_step(self) -> None:
        self.resolve()
        if self.step_open:
            self.end_step()
        self._mark = self._now()
        self._t0 = time.perf_counter()
        self.step_open = True
        self.steps += 1
        self.timing = self._timed_step()

    def end_step(self) -> None:
        """Close the step: its figures become the last complete step's."""
        self.step_open = False
        last = dict(zip(_STEP_KEYS, (a - b for a, b in zip(self._now(), self._mark))))
        last["step"] = self.steps
        last["wall_s"] = time.perf_counter() - self._t0  # host time of the step, not of the pause after it
        last["stall_measured"] = self.timing
        last["copy_s"] = None  # filled from its copies' timings as they complete (figures())
        if self.cuda:
            last["stall_s"] = None  # filled from its event pairs as they complete (figures())
        self._step_stall = {k: v for k, v in self._step_stall.items() if k >= self.steps}
        self._step_copy = {k: v for k, v in self._step_copy.items() if k >= self.steps}
        self.last_step = last
        self.recent.append(last)

    def resolve(self) -> None:
        """Add up the timings that have completed."""
        pending = []
        for item in self.timed_copies:
            step, ev, layer, nbytes = item
            try:
                done = ev.query()
            except Exception:  # a failed fetch (a split gather): raised where its layer was needed, not timed
                continue
            if not done:
                pending.append(item)
                continue
            ms = ev.copy_ms  # from the fetch's first copy's start (Event.start) to its last event
            if ms >= 0:
                self.copy_s += ms / 1e3
                self._step_copy[step] = self._step_copy.get(step, 0.0) + ms / 1e3
                if self.copy_log is not None:
                    self.copy_log.append((layer, nbytes, ms / 1e3))
            elif nbytes:
                self.unstarted += 1
        self.timed_copies = pending
        pending = []
        for step, a, b in self.stall_pairs:
            if b.query():
                dt = a.elapsed_ms(b) / 1e3
                self.stall_s += dt
                self._step_stall[step] = self._step_stall.get(step, 0.0) + dt
            else:
                pending.append((step, a, b))
        self.stall_pairs = pending

    def figures(self) -> dict:
        """The counters for stats(): totals, the last complete step, the recent ones."""
        last = self.last_step
        if last is not None and last["stall_measured"] and last["stall_s"] is None:
            if not any(step == last["step"] for step, _, _ in self.stall_pairs):
                last["stall_s"] = self._step_stall.get(last["step"], 0.0)
        if last is not None and last["stall_measured"] and last["copy_s"] is None:
            if not any(item[0] == last["step"] for item in self.timed_copies):
                last["copy_s"] = self._step_copy.get(last["step"], 0.0)
        return {
            "steps": self.steps,
            "bytes_copied": self.bytes,  # bytes that crossed the bus (encoded where a layer travels so)
            "bytes_raw": self.bytes_raw,  # the same loads' bytes as the layers hold them (uncompressed)
            "copies": self.copies,
            "sync_loads": self.sync_loads,
            "stall_s": self.stall_s,
            "copy_s": self.copy_s,
            "last_step": dict(last) if last is not None else None,
            "recent_steps": [dict(r) for r in self.recent],  # up to RECENT_STEPS, oldest first
        }
