"""The files the disk tier reads: a checkpoint's (DiskFile) and the spill files it
writes (SpillFile), each checked by CRC, closed with its group and, for a spill file,
deleted at removal, garbage collection or exit."""
from __future__ import annotations

import errno
import os
import uuid
import weakref
import zlib

import torch

from layerwise.stages.disk import source
from layerwise.stages.disk.reader import (
    PAGE,
    OpenFile,
    Reader,
    ReadError,
    aligned_staging,
    held_interrupts,
    round_to_page,
)


def crc_of(block: torch.Tensor) -> int:
    """CRC-32 of a host uint8 tensor's bytes."""
    return zlib.crc32(memoryview(block.numpy()))


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
        self.size = offset + round_to_page(block.numel())
        return offset

    def write_at(self, offset: int, block: torch.Tensor) -> None:
        n = round_to_page(block.numel())
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


_READER = []


def shared_reader() -> Reader:
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
        room = payload.untyped_storage().nbytes() - payload.storage_offset()
        if payload.data_ptr() % PAGE or room < round_to_page(n):
            block = aligned_staging(n, pinned=False)[:n]  # appended whole pages at a page boundary
            block.copy_(payload)
        offset = spill.append(block)
        return source.DiskSource(lp.index, n, [(spill.file, [(offset, n, 0)])], [(0, 0, n)], crc_of(payload), spill,
                          offset, what=what)

    return store
