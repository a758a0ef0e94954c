"""DiskTier: a group's pinned staging slots, the reads queued into them and the
copies out of them (ReadCopy: a host event a CUDA stream can wait on)."""
from __future__ import annotations

import time

import torch

from layerwise.stages.disk.reader import (
    PAGE,
    READ_CHUNK_BYTES,
    READER_THREADS,
    Reader,
    ReadError,
    read_layer,
    round_to_page,
    staging_block,
)
from layerwise.stages.result import detached
from layerwise.stages.transfer import Transfer, cuts_of


# --------------------------------------------------------------------- the tier
class ReadCopy:
    """The copy of a read layer out of staging into its slot, issued once the read
    has completed: a stage result (stages/result.py: ready, resolve, query,
    synchronize, copy_ms, start); `resolve()` returns the last copy's real Event,
    timed (a timed fetch) from the first copy's start."""

    __slots__ = ("tier", "src", "slot", "dst", "after", "timing", "ev", "error", "copies")

    def __init__(self, tier, src, slot, dst, after, timing):
        self.tier, self.src, self.slot, self.dst, self.after, self.timing = tier, src, slot, dst, after, timing
        self.ev = None
        self.error = None
        self.copies = []

    def ready(self) -> bool:
        """True once resolve() would not block (the read finished, well or not)."""
        if self.ev is not None or self.error is not None:
            return True
        try:
            return all(ev.query() for ev in self.tier.slots[self.slot].reads)
        except Exception:  # a failed read: resolve() raises it
            return True

    def resolve(self):
        if self.ev is not None:
            return self.ev
        if self.error is not None:
            raise detached(self.error)
        self.ev = self.tier.issue(self)
        return self.ev

    def query(self) -> bool:
        if self.error is not None:
            return True  # it never copied (copy_ms stays -1)
        return self.ev is not None and self.ev.query()

    def synchronize(self) -> None:
        self.resolve().synchronize()

    @property
    def copy_ms(self) -> float:
        return -1.0 if self.ev is None else self.ev.copy_ms

    @property
    def start(self):
        return None if self.ev is None else self.ev.start


class _Slot:
    __slots__ = ("buf", "arena", "cuts", "src", "version", "reads", "opened", "last", "pending", "used")

    def __init__(self, buf, arena):
        self.buf, self.arena = buf, arena
        self.cuts = cuts_of(arena, buf)
        self.src = None  # the DiskSource whose bytes it holds (or is reading)
        self.version = -1
        self.reads = []  # the read events of its current content
        self.opened = ()  # the OpenFile each of them read through
        # The last read into it or copy out of it: every earlier one completed before it
        # (a read waits for this; a copy is issued once the reads it copies completed).
        self.last = None
        self.pending = None  # a Deferred copy out of it, not issued yet
        self.used = 0

    def after(self):
        """What a new read into the slot must wait for (None: nothing in flight)."""
        ev = self.last
        if ev is None:
            return None
        try:
            return None if ev.query() else ev
        except Exception:  # completed with an error (a failed read): nothing in flight
            return None


class DiskTier:
    """A manager's reader, staging slots and the reads in flight."""

    def __init__(self, engine, num_slots: int, slot_bytes: int, device, pinned: bool,
                 reader_threads: int = READER_THREADS, debug_read_delay_us: int | None = None, direct: bool = True):
        self.engine = engine
        self.transfer = Transfer(engine)  # the only caller of copy_async
        self.device, self.pinned = device, pinned
        self.pin_memory = pinned  # the policy for its staging (check_pinned); the chain sets the group's
        self.reader = Reader(num_threads=reader_threads, direct=direct, chunk_bytes=READ_CHUNK_BYTES,
                             debug_delay_us=-1 if debug_read_delay_us is None else debug_read_delay_us)
        self.slots = [_Slot(*self._staging(slot_bytes)) for _ in range(max(1, num_slots))]
        self.pending: list[ReadCopy] = []
        self._clock = 0
        # figures
        self.bytes_read = 0
        self.reads = 0
        self.read_wait_s = 0.0  # host time the hooks blocked on reads
        self.read_s = 0.0  # time reads took, from start to end, summed (several run at once)
        self.timed_bytes = 0.0  # the bytes of those reads
        self.copies_meanwhile = 0  # copies issued while the host waited for another fetch (Chain.meanwhile)
        self.range_reads = 0  # on-demand reads of parts of layers (routed experts: read_range)
        self.range_bytes_read = 0  # their bytes (counted in bytes_read too)
        self._ranges: list = []  # read_range's staging buffers: (buf, arena, last copy out of it)
        self._range_next = 0
        # in_place(src): src's current bytes are in its device slot now (the chain sets it
        # from the slot ring). Reading such a layer ahead is wasted: concurrent calls share
        # the slot (runtime/cohort.py), and a call behind the others would otherwise read
        # again a layer the call ahead has already copied out of staging.
        self.in_place = None

    def _staging(self, nbytes: int):
        cuda = self.device.type == "cuda"
        return staging_block(nbytes, pinned=self.pinned, device=self.device.index if cuda else -1)

    @property
    def staging_bytes(self) -> int:
        return sum(s.buf.numel() for s in self.slots) + sum(b.numel() for b, _, _ in self._ranges)

    # ------------------------------------------------------------ staging
    @staticmethod
    def _settle(d: ReadCopy | None) -> None:
        """Issue a pending copy (blocking on its read) so that its slot may be reused;
        a failed read stays with the Deferred, raised where its layer is needed."""
        if d is not None:
            try:
                d.resolve()
            except Exception:
                pass

    def _free_slot(self, protect=()) -> int:
        """A slot to read into: one holding nothing, else the least recently used
        one whose bytes are not wanted (`protect`), else the least recently used
        of all; a copy still pending out of it is issued first."""
        best = None
        for k, s in enumerate(self.slots):
            if s.src is None and s.pending is None:
                return k
            if s.src in protect and s.pending is None:
                continue
            if best is None or ((s.pending is None, -s.used)
                                > (self.slots[best].pending is None, -self.slots[best].used)):
                best = k
        if best is None:  # every slot's bytes are wanted: take the least recently used anyway
            best = min(range(len(self.slots)), key=lambda j: self.slots[j].used)
        self._settle(self.slots[best].pending)
        return best

    def _in_place(self, src) -> bool:
        return self.in_place is not None and self.in_place(src)

    def _staged(self, src) -> bool:
        """A slot holds (or is reading) src's current bytes."""
        k = src.slot
        return k is not None and self.slots[k].src is src and self.slots[k].version == src.version()

    def stage(self, src, protect=()) -> int:
        """The staging slot that holds (or is reading) `src`'s current bytes;
        queues the read if none does."""
        if self._staged(src):
            return src.slot
        if src.file_failed():
            src.recover(self.reader)
        k = self._free_slot(protect)
        s = self.slots[k]
        if s.src is not None and s.src.slot == k:
            s.src.slot = None
        s.src, s.version, s.reads = None, -1, []
        if src.fetch_staging_size > s.buf.numel():  # a write made the layer larger (an encoding): regrow, once free
            if s.last is not None:
                try:
                    s.last.synchronize()
                except Exception:  # noqa: BLE001 - a failed read: nothing in flight
                    pass
                s.last = None
            s.buf, s.arena = self._staging(src.fetch_staging_size)
            s.cuts = cuts_of(s.arena, s.buf)
        reads = []
        for part in src.fetch_parts:  # one after the other: `last` covers them all
            reads.append(read_layer(self.reader, part.file.of, part.extents, s.buf, after=s.after()))
            s.last = reads[-1]
        s.src, s.version, s.reads, s.opened = src, src.version(), reads, tuple(p.file.of for p in src.fetch_parts)
        self._clock += 1
        s.used = self._clock
        src.slot = k
        self.bytes_read += src.fetch_read_bytes
        self.reads += 1
        return k

    def fetch(self, src, dst, after, timing) -> ReadCopy:
        k = self.stage(src)
        s = self.slots[k]
        if s.pending is not None:  # an earlier copy out of this slot, not issued yet: issue it first
            self._settle(s.pending)
            k = self.stage(src)  # (a failed read freed the slot)
            s = self.slots[k]
        d = ReadCopy(self, src, k, dst, after, timing)
        s.pending = d
        self.pending.append(d)
        return d

    # A failed read is retried after the file's recovery (reopened, the layer's CRC
    # checked): a change of metadata only, or a file restored byte-exact, streams on.
    # Bounded: a file that keeps changing under the reads is an error.
    read_retries = 2

    def issue(self, d: ReadCopy):
        """Wait for d's read (host), then queue its copies staging -> slot. A read
        that failed is read again once the file is back (`DiskSource.recover`)."""
        attempt = 0
        while True:
            s = self.slots[d.slot]
            try:
                self._wait_reads(s)
                break
            except BaseException as err:
                opened = s.opened or None
                self._drop_read(d, s)
                if not isinstance(err, Exception):  # interrupted: the read may still be in flight (the manager resyncs)
                    self._give_up(d, RuntimeError("layerwise: a disk read was interrupted; the layer is read again"))
                    raise
                d.src.read_failed(err, opened)
                if attempt == self.read_retries:
                    self._give_up(d, err)
                    raise
            attempt += 1
            try:
                d.src.recover(self.reader)  # ReadError while the file differs from what was loaded
                d.slot = self.stage(d.src)
                self.slots[d.slot].pending = d
            except BaseException as err:
                self._give_up(d, err if isinstance(err, Exception) else
                              RuntimeError("layerwise: a disk read was interrupted; the layer is read again"))
                raise
        for ev in s.reads:
            ms = ev.copy_ms
            if ms >= 0:
                self.read_s += ms / 1e3
                self.timed_bytes += d.src.fetch_read_bytes / len(s.reads)
        after = d.after
        ev = None
        for soff, poff, length in d.src.fetch_copies:
            cuts = tuple(c - soff for c in s.cuts if soff < c < soff + length)
            ev = self.transfer.copy(d.dst[poff:poff + length], s.buf[soff:soff + length], after, d.timing, cuts)
            d.copies.append(ev)
            after = ev
        if d.timing and len(d.copies) > 1:
            ev.start = d.copies[0].start  # the fetch is timed from its first copy's start
        s.last = ev
        if s.pending is d:
            s.pending = None
        if d in self.pending:
            self.pending.remove(d)
        return ev

    # ------------------------------------------------------------ ranges (routed experts)
    range_chunk = 1 << 22  # bytes per on-demand read (the chain sets one expert's largest rows)
    range_runs = 2  # the most file runs one such read touches (the chain sets it)
    RANGE_BUFFERS = 2  # the copy out of one overlaps the read into the other

    @staticmethod
    def range_staging_bytes(chunk: int, runs: int = 2) -> int:
        """The host staging read_range keeps for reads of `chunk` bytes (each read's runs
        start anywhere in a page): what a host budget counts."""
        return DiskTier.RANGE_BUFFERS * (round_to_page(chunk) + 2 * PAGE * runs)

    def _range_buffer(self, size: int):
        """The next range staging buffer of at least `size` bytes, free (its last copy
        out waited for on the host), and its cuts."""
        bufs, k = self._ranges, self._range_next
        self._range_next = (k + 1) % self.RANGE_BUFFERS
        if k < len(bufs):
            buf, arena, last = bufs[k]
            if last is not None:
                last.synchronize()
            if buf.numel() >= size:
                bufs[k] = (buf, arena, None)
                return k, buf, arena
        buf, arena = self._staging(max(size, self.range_staging_bytes(self.range_chunk, self.range_runs)
                                       // self.RANGE_BUFFERS))
        if k < len(bufs):
            bufs[k] = (buf, arena, None)
        else:
            bufs.append((buf, arena, None))
        return k, buf, arena

    def read_range(self, src, dst: torch.Tensor, lo: int, hi: int, after, timing: bool = False):
        """Bytes [lo, hi) of `src`'s payload into the same bytes of `dst` (a slot): read
        from the file now (the host waits: they are needed now), in chunks of
        `range_chunk`, each then copied after `after` (and the chunk before); returns
        the last copy's event (timed: from the first copy's start). A failed read is
        read again once the file is back (DiskSource.recover: the layer's CRC-32), once."""
        ev = after
        first = None
        for a in range(lo, hi, self.range_chunk):
            b = min(a + self.range_chunk, hi)
            for attempt in range(2):
                parts, copies, size = src.extents_for(a, b)
                k, buf, arena = self._range_buffer(size)
                try:
                    if src.file_failed():
                        src.recover(self.reader)
                        parts, copies, size = src.extents_for(a, b)
                    evs = [read_layer(self.reader, f.of, ex, buf) for f, ex in parts]
                    t0 = time.perf_counter()
                    for e in evs:
                        e.synchronize()
                    self.read_wait_s += time.perf_counter() - t0
                    break
                except ReadError as err:
                    src.read_failed(err)
                    if attempt:
                        raise
            n_read = sum(n for _, ex in parts for _, n, _ in ex)
            self.bytes_read += n_read
            self.range_bytes_read += n_read
            self.range_reads += 1
            cuts = cuts_of(arena, buf)
            for soff, poff, n in copies:
                cs = tuple(c - soff for c in cuts if soff < c < soff + n)
                ev = self.transfer.copy(dst[poff:poff + n], buf[soff:soff + n], ev, timing, cs)
                first = ev if first is None else first
            self._ranges[k] = (buf, arena, ev)
        if timing and first is not None and first is not ev:
            ev.start = first.start
        return ev

    def _wait_reads(self, s: _Slot) -> None:
        t0 = None
        try:
            for ev in s.reads:
                if not ev.query():
                    if t0 is None:
                        t0 = time.perf_counter()
                    ev.synchronize()
        finally:
            if t0 is not None:
                self.read_wait_s += time.perf_counter() - t0

    def _drop_read(self, d: ReadCopy, s: _Slot) -> None:
        """The slot's read failed: it holds nothing."""
        if s.pending is d:
            s.pending = None
        s.src, s.version, s.reads, s.opened = None, -1, [], ()
        if d.src.slot == d.slot:
            d.src.slot = None

    def _give_up(self, d: ReadCopy, err: Exception) -> None:
        d.error = detached(err)
        if d in self.pending:
            self.pending.remove(d)

    def pump(self) -> None:
        """Issue the copies of reads that have finished, without blocking."""
        for d in list(self.pending):
            if d.ev is None and d.error is None and d.ready():
                self._settle(d)

    def _room_for(self, want: set) -> bool:
        """A slot holds nothing wanted sooner (nor a copy still to issue out of it)."""
        return any(s.pending is None and (s.src is None or s.src not in want) for s in self.slots)

    def can_read_ahead(self, upcoming) -> bool:
        """read_ahead(upcoming) would queue a read now."""
        upcoming = upcoming[: len(self.slots)]
        return any(not self._staged(src) and not self._in_place(src) and not src.file_failed()
                   for src in upcoming) and \
            self._room_for(set(upcoming))

    def issue_while_waiting(self, ev, upcoming, poll_s: float) -> None:
        """Until `ev` completes (the host blocks on it: the CPU backend), issue the copies
        of reads that finish and reads into slots that free up, so that the bus does not
        wait for the next hook; returns early once nothing is left to issue."""
        while not ev.query():
            if not self.pending and not self.can_read_ahead(upcoming):
                return  # nothing left to issue: block on ev
            before = len(self.pending)
            self.pump()
            self.copies_meanwhile += before - len(self.pending)
            self.read_ahead(upcoming)
            time.sleep(poll_s)

    def read_ahead(self, upcoming) -> None:
        """Queue reads of the next disk layers (`upcoming`, in order) while slots
        hold nothing that is wanted sooner."""
        upcoming = upcoming[: len(self.slots)]
        want = set(upcoming)
        for src in upcoming:
            if self._staged(src) or self._in_place(src):
                continue
            if src.file_failed():
                return  # its recovery happens where it is needed
            if not self._room_for(want):
                return  # every slot holds bytes wanted sooner
            self.stage(src, protect=want)

    def flush(self) -> None:
        """Issue every pending copy (blocking on its read); errors stay with their Deferred."""
        for d in list(self.pending):
            self._settle(d)

    def forget(self) -> None:
        """Wait for every read and drop what the slots hold (after an interrupt)."""
        self.reader.synchronize()
        for d in self.pending:
            d.error = d.error or RuntimeError("layerwise: internal: a forgotten disk copy was used")
        self.pending = []
        for s in self.slots:
            if s.src is not None and s.src.slot is not None:
                s.src.slot = None
            s.src, s.version, s.reads, s.opened, s.pending = None, -1, [], (), None

    def synchronize(self) -> None:
        self.reader.synchronize()

    def close(self) -> None:
        self.reader.synchronize()
        self.pending = []
        self._ranges = []
        for s in self.slots:
            s.src, s.reads, s.opened, s.pending, s.last = None, [], (), None, None
        self.reader.drop_retired() if hasattr(self.reader, "drop_retired") else None
        self.slots = []
