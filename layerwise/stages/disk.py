"""disk: the disk tier. Layers that do not fit the host budget stay in files (the
checkpoint's own, or spill files written at pack time) and reach their ring
slot as read -> transfer: the reader threads read a layer into a pinned,
page-aligned staging slot (`read.py`), then the copy engine copies staging ->
device slot (DESIGN.md, "Tiers and stages").

The read's event is a host event, which a CUDA stream cannot wait on. So the
copy out of staging is *deferred*: `DiskSource.fetch` queues the read and
returns a `ReadCopy` (a deferred result, stages/result.py), which issues the copy once the read has completed. The
manager's hooks `pump()` the tier (copies of finished reads are issued without
blocking) and `resolve()` a layer's ReadCopy where the layer is needed: the
host blocks only there, and only if the read is not done yet. The same logic
runs on the CPU backend, so CI exercises it.

Staging: `num_slots` slots (`disk_prefetch_depth`), each the size of the
largest disk layer's staging layout. A slot is read into only after the copy
out of it was issued (the read waits on that copy's event), and the next disk
layers are read ahead (`read_ahead`) while slots are free.

Files and errors: every file is opened once and recorded (size, mtime,
ctime); a read of a file that changed since (or was replaced, or deleted), a
short read (truncated) or an I/O error fails its event. The file's identity
is its content, not its metadata: where the read's layer is needed, the file
is reopened (`DiskFile.revalidate`: its layout must be the one recorded) and
the layer read again and checked against the CRC-32 taken when the model was
loaded; every other layer read from the file is checked once, at its next
read. A change of metadata only (chmod, a hard link, atime, an xattr, an
atomic replace by an identical copy, a touch) therefore streams on exactly; a
file whose bytes differ raises ReadError (an OSError, naming the file) at
every forward that needs them, and streams exactly again once restored.

Spill files (`SpillFile`): one per group in `spill_dir`, each layer at a page
boundary in plan layout (one O_DIRECT read per layer, one copy to the slot);
written as the layers are packed, rewritten by load_state_dict, deleted by
remove_layerwise_offload, by a failed configure, when the model is garbage
collected without a remove, and at exit (by the process that made them).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
import weakref
import zlib

import torch

from layerwise.stages.read import (PAGE, READ_CHUNK_BYTES, READER_THREADS, OpenFile, ReadError, Reader, _round_up,
                                   aligned_staging, held_interrupts, read_layer, staging_block, staging_layout)
from layerwise.stages.result import detached
from layerwise.stages.transfer import Transfer, cuts_of

log = logging.getLogger("layerwise")

__all__ = ["ReadCopy", "DiskFile", "DiskSource", "DiskTier", "SpillFile", "crc_of", "spill_store"]


def crc_of(block: torch.Tensor) -> int:
    """CRC-32 of a host uint8 tensor's bytes."""
    return zlib.crc32(memoryview(block.numpy()))


def staging_slots(prefetch_depth: int, disk_prefetch_depth) -> int:
    """The disk stage's staging slots: disk_prefetch_depth, or one more than the ring reads ahead."""
    if disk_prefetch_depth is not None:  # (an int: OffloadOptions)
        return disk_prefetch_depth
    return max(2, prefetch_depth + 1)


class DiskFile:
    """A file the tier reads: opened once, with the size, mtime and ctime it had;
    after a failed read it is reopened (`revalidate`) and its generation bumped,
    so that every layer read from it is verified once more (CRC-32)."""

    def __init__(self, path: str, check_layout=None):
        self.path = os.fsdecode(path)
        self.check_layout = check_layout  # callable(OpenFile) -> None, raises if the layout changed
        self.on_reopen = None  # callable(OpenFile): a spill file's write descriptors follow a replaced file
        self.of = OpenFile.open(self.path)
        self.gen = 0
        self.failed = False

    def revalidate(self, reader: Reader) -> None:
        """Reopen after a failed read: the file must be back (same layout); raises
        ReadError naming the file where it is not."""
        try:
            new = OpenFile.open(self.path)
        except OSError as err:
            raise ReadError(err.errno or errno.EIO,
                            f"layerwise: {self.path} cannot be opened again after a failed read ({err.strerror}); "
                            "restore the file, or reload the model") from None
        try:
            if self.check_layout is not None:
                self.check_layout(new)
            if self.on_reopen is not None:
                self.on_reopen(new)
        except BaseException as err:
            new.close()
            if isinstance(err, ReadError) or not isinstance(err, Exception):
                raise
            raise ReadError(getattr(err, "errno", None) or errno.EIO,
                            f"layerwise: {self.path} cannot be streamed from any more ({err}). Restore the file "
                            "the model was loaded from, or load the model again.") from None
        with held_interrupts():  # the old descriptor is closed and forgotten by the reader as it is replaced
            old, self.of = self.of, new
            self.gen += 1
            self.failed = False
            old.close(reader)

    def close(self, reader: Reader | None = None) -> None:
        if _READER and self.of.fd >= 0:  # reads outside a tier used the shared reader: its cached fd too
            _READER[0].forget(self.of.fd)
        self.of.close(reader)


# ------------------------------------------------------------------ spill files
def _drop_spill(path: str, pid: int, fds: list) -> None:
    """Close a spill file's write descriptors and delete it: SpillFile.close, or its
    finalizer when it is garbage collected unclosed, or at exit (weakref.finalize
    runs those left then). Only the process that made the file deletes it (a forked
    child's exit must not delete the files its parent streams from). Takes no lock:
    a finalizer may run inside any allocation."""
    for k, fd in enumerate(fds):
        if fd >= 0:
            fds[k] = -1
            try:
                os.close(fd)
            except OSError:
                pass
    if os.getpid() == pid:
        try:
            os.unlink(path)
        except OSError:
            pass


class SpillFile:
    """One group's spill file: layers appended at page boundaries, in plan layout,
    written with O_DIRECT where the file system takes it (no page cache held)."""

    def __init__(self, spill_dir, group: str):
        spill_dir = os.fsdecode(spill_dir)
        if not os.path.isdir(spill_dir):
            raise ValueError(f"spill_dir {spill_dir!r} is not a directory (create it first)")
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in group)
        self.path = os.path.join(spill_dir, f"layerwise-{os.getpid()}-{safe}-{uuid.uuid4().hex[:8]}.spill")
        self.file: DiskFile | None = None
        self.size = 0
        self._fds = [-1, -1]  # [fd, direct_fd]: shared with the finalizer, which closes what is there
        with held_interrupts():  # the file and the finalizer that deletes it come together
            self._fds[0] = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            self._finalizer = weakref.finalize(self, _drop_spill, self.path, os.getpid(), self._fds)
        try:
            self._open_direct()
            self.file = DiskFile(self.path)
            self.file.on_reopen = self._follow
        except BaseException:
            self.close()
            raise

    @property
    def fd(self) -> int:
        return self._fds[0]

    @property
    def direct_fd(self) -> int:
        return self._fds[1]

    def _open_direct(self) -> None:
        try:
            with held_interrupts():  # recorded where the finalizer closes it
                self._fds[1] = os.open(self.path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:  # tmpfs and others: buffered writes
            self._fds[1] = -1

    def _follow(self, of: OpenFile) -> None:
        """The file was reopened for reading: if another file now has the name (an
        atomic replace by a copy), writes go to that one too."""
        st = os.fstat(self.fd)
        if (st.st_dev, st.st_ino) == (of.dev, of.ino):
            return
        old = self._fds[:]
        with held_interrupts():  # the new descriptors take the old ones' place in the record whole
            self._fds[0] = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            self._open_direct()
            for f in old:
                if f >= 0:
                    os.close(f)

    def append(self, block: torch.Tensor) -> int:
        """Write a page-aligned host block (its length rounded up to a page; the
        tensor's storage must extend that far) at the end; returns its offset.
        The file's recorded size and mtime follow whatever was written, even by
        a write that failed half way (the layers already in it stay readable)."""
        offset = self.size
        try:
            self.write_at(offset, block)
        finally:
            self.refresh()
        self.size = offset + _round_up(block.numel())
        return offset

    def write_at(self, offset: int, block: torch.Tensor) -> None:
        n = _round_up(block.numel())
        raw = torch.empty(0, dtype=torch.uint8).set_(block.untyped_storage(), block.storage_offset(), (n,))
        view = memoryview(raw.numpy())
        fd = self.direct_fd if self.direct_fd >= 0 and block.data_ptr() % PAGE == 0 else self.fd
        done = 0
        while done < n:
            try:
                k = os.pwrite(fd, view[done:], offset + done)
            except OSError as err:
                if fd == self.direct_fd and err.errno == errno.EINVAL:
                    fd = self.fd
                    continue
                raise OSError(err.errno, f"layerwise: writing the spill file {self.path} failed "
                                         f"({err.strerror}); free space in spill_dir or choose another") from None
            done += k

    def refresh(self) -> None:
        """After a write of our own: record the file's new size and mtime."""
        if self.fd < 0 or self.file is None:
            return
        st = os.fstat(self.fd)
        self.file.of.size, self.file.of.mtime_ns, self.file.of.ctime_ns = st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def close(self, reader: Reader | None = None) -> None:
        """Close and delete the file."""
        if self.file is not None:
            self.file.close(reader)
        self._finalizer()


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
        self.ev = self.tier._issue(self)
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
            if best is None or (s.pending is None, -s.used) > (self.slots[best].pending is None, -self.slots[best].used):
                best = k
        if best is None:  # every slot's bytes are wanted: take the least recently used anyway
            best = min(range(len(self.slots)), key=lambda j: self.slots[j].used)
        self._settle(self.slots[best].pending)
        return best

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

    def _issue(self, d: ReadCopy):
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
        return DiskTier.RANGE_BUFFERS * (_round_up(chunk) + 2 * PAGE * runs)

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
        return any(not self._staged(src) and not src.file_failed() for src in upcoming) and \
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
            if self._staged(src):
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


class _Part:
    __slots__ = ("file", "extents")

    def __init__(self, file: DiskFile, extents):
        self.file, self.extents = file, extents


class DiskSource:
    """A layer whose truth is in a file (stages/source.py interface).

    `parts`: [(DiskFile, [(file_offset, length, staging_offset), ...])], the
    layer's extents per file, laid out in staging by `read.staging_layout`;
    `copies`: [(staging_offset, plan_offset, length)], what the transfer copies
    into the slot; `crc`: CRC-32 of the plan-layout bytes when loaded.
    `spill`: the SpillFile it lives in (writable), else None (a checkpoint)."""

    kind = "disk"
    host = None
    stored_bytes = 0

    def __init__(self, index: int, nbytes: int, parts, copies, crc: int, spill: SpillFile | None = None,
                 spill_offset: int = 0, what: str = ""):
        self.index = index
        self.nbytes = nbytes
        self.transfer_bytes = sum(c[2] for c in copies)
        self.parts = [_Part(f, ex) for f, ex in parts]
        self.copies = copies
        self.read_bytes = sum(length for _, ex in parts for _, length, _ in ex)
        self.crc = crc
        self.spill = spill
        self.spill_offset = spill_offset
        self.capacity = _round_up(nbytes)  # a spill layer's region: its bytes, page-rounded
        self.spare = None  # a spill layer's second region (offset, capacity): where the next write goes
        self.what = what  # "layer group[i]" for messages
        self.tier: DiskTier | None = None
        self.slot = None
        self._version = 0
        self.verified = {id(p.file): p.file.gen for p in self.parts}
        self.lock = threading.Lock()
        self.window = None  # stream_only: the tier's fetch reads bytes [0, window) only
        self._windowed()

    # ------------------------------------------------------ parts of the layer
    def extents_for(self, lo: int, hi: int):
        """([(DiskFile, extents)], copies, staging bytes) that read bytes [lo, hi) of the
        payload (plan layout) into a staging buffer and copy them to their place:
        as `parts` and `copies`, cut to the range."""
        want: dict = {}  # id(file) -> (file, [(file_offset, length, plan_offset)])
        for soff, poff, n in self.copies:
            a, b = max(poff, lo), min(poff + n, hi)
            if a >= b:
                continue
            sa, sb = soff + a - poff, soff + b - poff
            for p in self.parts:
                for fo, length, so in p.extents:
                    x, y = max(so, sa), min(so + length, sb)
                    if x < y:
                        want.setdefault(id(p.file), (p.file, []))[1].append((fo + x - so, y - x, a + x - sa))
        parts, copies, base = [], [], 0
        for f, items in want.values():
            extents, size = staging_layout([(fo, n) for fo, n, _ in items], base)
            parts.append((f, extents))
            copies += [(d, po, n) for (_, n, d), (_, _, po) in zip(extents, items)]
            base += size
        return parts, sorted(copies, key=lambda c: c[1]), base

    def stream_only(self, hi: int) -> None:
        """The tier's fetch reads and copies bytes [0, hi) of the payload only (routed
        experts, stages/experts.ExpertSource: the experts' rows are read on demand,
        copy_range); read() and write() keep the whole layer."""
        self.window = hi
        self._windowed()

    def _windowed(self) -> None:
        if self.window is None:
            self.fetch_parts, self.fetch_copies = self.parts, self.copies
            self.fetch_read_bytes, self.fetch_staging_size = self.read_bytes, self.staging_size
            return
        parts, self.fetch_copies, self.fetch_staging_size = self.extents_for(0, self.window)
        self.fetch_parts = [_Part(f, ex) for f, ex in parts]
        self.fetch_read_bytes = sum(n for _, ex in parts for _, n, _ in ex)

    def fetch_window(self, i: int, dst: torch.Tensor, after, timing: bool):
        """Bytes [0, window) of the payload into `dst` (stream_only), as the tier fetches."""
        return self.tier.fetch(self, dst, after, timing)

    def copy_range(self, dst: torch.Tensor, lo: int, hi: int, after, timing: bool = False):
        """Bytes [lo, hi) of the payload into the same bytes of `dst` (a slot), read from
        the file now, then copied after `after` (DiskTier.read_range): a part of the
        layer (routed experts, stages/experts.py)."""
        return self.tier.read_range(self, dst, lo, hi, after, timing)

    def range_bytes(self, lo: int, hi: int) -> int:
        """The bytes copy_range(dst, lo, hi) moves over the bus."""
        return hi - lo

    @property
    def writable(self) -> bool:
        return self.spill is not None

    def fetch(self, i, dst, after, timing):
        return self.tier.fetch(self, dst, after, timing)

    def version(self) -> int:
        return self._version

    # -------------------------------------------------------------- failures
    def file_failed(self) -> bool:
        return any(p.file.failed or self.verified[id(p.file)] != p.file.gen for p in self.parts)

    def read_failed(self, err=None, opened=None) -> None:
        """Mark the files failed (reopened at the next try). `opened`: the OpenFile
        each part was read through; a file reopened since (by another layer's
        recovery) is not reopened again: this layer is verified once anyway."""
        parts = self.parts if opened is None else self.fetch_parts  # (`opened`: of a fetch, stage())
        for k, p in enumerate(parts):
            if opened is None or opened[k] is p.file.of:
                p.file.failed = True

    def recover(self, reader: Reader) -> torch.Tensor:
        """After a failed read: reopen the files, then check this layer's bytes
        against the CRC taken at load, once per reopening; returns them. Anything
        that fails on the way leaves the files marked failed (reopened again at
        the next try: a file restored byte-exact then streams on)."""
        for attempt in range(2):
            try:
                for p in self.parts:
                    if p.file.failed:
                        reader.synchronize()
                        p.file.revalidate(reader)
                block = self._read_sync(reader)
                break
            except ReadError:
                # (the file changed again since another layer reopened it: reopen once more)
                self.read_failed()
                if attempt:
                    raise
            except BaseException:
                self.read_failed()
                raise
        if crc_of(block) != self.crc:
            self.read_failed()
            raise ReadError(errno.EIO, f"layerwise: {self.what}: its bytes in {self.parts[0].file.path} are not "
                                       "the ones loaded (CRC-32 differs): the file was modified while the model "
                                       "streams from it. Restore the file, or load the model again.")
        for p in self.parts:
            self.verified[id(p.file)] = p.file.gen
        return block

    # --------------------------------------------------------- the contract
    @property
    def staging_size(self) -> int:
        """The staging bytes its extents need (their staging layout's end)."""
        return max((off + length for p in self.parts for _, length, off in p.extents), default=0)

    def _read_sync(self, reader: Reader) -> torch.Tensor:
        staging = aligned_staging(self.staging_size, pinned=False)
        evs = [read_layer(reader, p.file.of, p.extents, staging) for p in self.parts]
        for ev in evs:
            ev.synchronize()
        out = torch.zeros(self.nbytes, dtype=torch.uint8)
        for soff, poff, length in self.copies:
            out[poff:poff + length].copy_(staging[soff:soff + length])
        return out

    def read(self) -> torch.Tensor:
        tier = self.tier
        reader = tier.reader if tier is not None else _shared_reader()
        if not self.file_failed():
            try:
                return self._read_sync(reader)
            except ReadError as err:
                self.read_failed(err)
        return self.recover(reader)

    def refuse_write(self) -> None:
        """Raise the error that says why this layer cannot be written (a checkpoint file)."""
        if self.spill is None:
            raise RuntimeError(
                f"layerwise: {self.what} streams from the checkpoint file {self.parts[0].file.path}, which "
                "layerwise does not write. Give load_offloaded a spill_dir= (layers kept on disk then live in spill "
                "files of their own, which can be changed), or a host_budget that holds the layer."
            )

    def _switch(self, offset: int, capacity: int, n: int, crc: int) -> None:
        """Read the layer from the region at `offset` (its `n` bytes, CRC-32 `crc`)
        from now on; the region it leaves becomes the spare."""
        self.spare, self.spill_offset, self.capacity = (self.spill_offset, self.capacity), offset, capacity
        self.nbytes = self.transfer_bytes = self.read_bytes = n
        self.parts[0].extents = [(offset, n, 0)]
        self.copies = [(0, 0, n)]
        self.crc = crc
        self._version += 1
        self._windowed()

    def write(self, block: torch.Tensor, undo: bool = False):
        """Replace the payload (a spill layer; its size may change: an encoded one).
        Written to the layer's other region (appended where it has none, or where
        the bytes do not fit it), then switched to: a write that fails half way (a
        full disk) leaves the current bytes whole, and `undo` switches back to the
        old region (the spare now), which the write left as it was."""
        self.refuse_write()
        tier = self.tier
        if tier is not None:
            tier.flush()
            tier.synchronize()
        n = block.numel()
        staging = aligned_staging(n, pinned=False)
        staging[:n].copy_(block)
        if self.spare is None or _round_up(n) > self.spare[1]:
            self.spare = (self.spill.append(staging[:n]), _round_up(n))
        else:
            try:
                self.spill.write_at(self.spare[0], staging[:n])
            finally:
                self.spill.refresh()
        old = self.spill_offset, self.capacity, self.nbytes, self.crc
        self._switch(*self.spare, n, crc_of(block))
        # (nothing reads the new region before an undo: the write and its undo are one call of ShareSource.write)
        return (lambda: self._switch(*old)) if undo else None

    def holders(self):
        yield self

    def close(self) -> None:
        self.tier = None


_READER = []


def _shared_reader() -> Reader:
    if not _READER:
        _READER.append(Reader(num_threads=1))
    return _READER[0]


def spill_store(group: str, spill_dir, files: list):
    """A file store (stages/chain.py) for layers kept in a spill file: each payload
    is appended to the group's spill file (made at the first, added to `files`,
    which remove() closes) as the layer is packed. `store(lp, payload, span, what)`."""
    spill = None

    def store(lp, payload, span, what):
        nonlocal spill
        if spill is None:
            with held_interrupts():  # made and recorded where remove() and a failed configure close it
                spill = SpillFile(spill_dir, group)
                files.append(spill)
        n = payload.numel()
        block = payload
        if payload.data_ptr() % PAGE or payload.untyped_storage().nbytes() - payload.storage_offset() < _round_up(n):
            block = aligned_staging(n, pinned=False)[:n]  # appended whole pages at a page boundary
            block.copy_(payload)
        offset = spill.append(block)
        return DiskSource(lp.index, n, [(spill.file, [(offset, n, 0)])], [(0, 0, n)], crc_of(payload), spill,
                          offset, what=what)

    return store
