"""read: a layer's bytes in a file -> a page-aligned (pinned) host staging
buffer, on the reader threads of ``layerwise._C.Reader`` (the disk tier's first
stage; docs/design.md, "Tiers and stages"): the API the disk stage
(stages/disk/, DiskTier.stage) reads with.

A layer is a list of extents ``(file_offset, length, dst_offset)``: where each
of its tensors lies in the file and where it goes in the staging buffer.
``Reader.read_async`` reads one layer with one vectored read (``preadv``, one
iovec per tensor) per run of extents contiguous in the file, a run longer than
``chunk_bytes`` (default 4 MiB) cut into pieces that its threads read side by
side (a drive needs several requests in flight), and returns an ``Event`` of
the CPU copy engine's kind:
``CopyEngine("cpu").copy_async(dst, staging, after=event)`` waits on it, and a
read can wait on a copy (``after=``; any event, a CUDA one included: the reader
thread waits for it on the host) - which is how a staging slot is reused only
once the copy out of it has finished.

Zero-copy O_DIRECT: ``O_DIRECT`` needs the buffer, the file offset and the
length aligned to 4096 (``Reader.alignment``). Checkpoint tensors start
anywhere (a safetensors data section starts right after its JSON header), so
the reader reads the aligned superset of a run - from the page boundary below
its first byte to the one above its last - straight into the staging buffer,
and the caller places the run so that this lands on whole pages of the buffer:
``dst_offset == file_offset (mod 4096)``, each run on pages of its own.
``staging_layout`` computes such a placement and the staging size it needs;
the tensor then lies at its ``dst_offset`` and the head/tail bytes of its
first/last page are file bytes nobody asked for. This keeps the common case
(a layer's tensors in one contiguous run) at one O_DIRECT read and no memcpy on
the host: the bytes go disk -> staging by DMA, staging -> device by the copy
engine. A bounce buffer would have cost a host memcpy of every byte (on a
2-core host, about as slow as the disk itself). Where the layout does not allow
it (dst offsets not congruent, a run scattered into a padded slot layout), on a
memory file system (tmpfs: O_DIRECT gains nothing there) or where the file
system refuses O_DIRECT, the run is read buffered (``preadv`` through the page
cache, still one call per run). ``Reader.stats()`` counts which path was taken.

Errors: an I/O error, a short read (the file is shorter than an extent: it was
truncated) or a file that changed since it was recorded (``expect=(size,
mtime_ns)``, checked with ``fstat`` by the reader thread right before and right
after the read - the authoritative check, no race with a check in Python; a
file deleted since it was opened fails too) complete the event with an error:
``Event.synchronize()`` (and ``query()``) raise ``ReadError`` (an ``OSError``)
naming the file, the offset and the errno text. A copy that waited on a failed
read copies nothing and raises the same error. The reader goes on with later
reads.

CUDA: a read's event is a host event. A CUDA copy engine cannot make its stream
wait on it, so the H2D copy out of staging is issued once the read has
completed: stages/disk/ (ReadCopy) does that.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import torch

from layerwise._native import HostArena, Reader, ReadError

PAGE = Reader.alignment  # 4096
# The disk tier's reader: enough requests in flight for the drive. A layer's read is
# cut into pieces of READ_CHUNK_BYTES read side by side by READER_THREADS threads
# (csrc/reader.h). On a 2-core VM's virtio disk one O_DIRECT reader got 1.1 GB/s and
# 2-4 got 1.5 GB/s (`python -m layerwise.bench disk --quick`, BENCHMARKS.md).
READER_THREADS = 4
READ_CHUNK_BYTES = 4 << 20

__all__ = ["PAGE", "READER_THREADS", "READ_CHUNK_BYTES", "OpenFile", "ReadError", "Reader", "aligned_staging",
           "filesystem_type", "staging_block", "read_layer", "staging_layout"]


def round_to_page(x: int, a: int = PAGE) -> int:
    return (x + a - 1) // a * a


def aligned_staging(nbytes: int, pinned: bool = True, device: int = -1) -> torch.Tensor:
    """A page-aligned uint8 host buffer of ``nbytes`` rounded up to a page, in a
    ``HostArena`` of its own (pinned: mlock on CPU builds, cudaHostRegister on
    CUDA builds where a GPU is visible; where pinning fails it stays pageable,
    with the reason in the arena's ``pin_error``). The tensor keeps the mapping
    alive; reads into it may be O_DIRECT whatever its pinning."""
    return staging_block(nbytes, pinned, device)[0]


def staging_block(nbytes: int, pinned: bool = True, device: int = -1):
    """aligned_staging's buffer and the HostArena that holds it (a copy out of it
    honours its registration's split points: stages/transfer.py)."""
    if nbytes < 0:
        raise ValueError(f"aligned_staging: nbytes must be >= 0, got {nbytes}")
    size = max(round_to_page(nbytes), PAGE)
    arena = HostArena(size, pinned=pinned, device=device)
    return arena.allocate(size, alignment=PAGE), arena


def staging_layout(file_extents, base: int = 0) -> tuple[list[tuple[int, int, int]], int]:
    """Where to put a layer's tensors in a (page-aligned) staging buffer so that
    the reader reads them with O_DIRECT straight into place.

    ``file_extents``: ``[(file_offset, length), ...]`` in any order. Returns
    ``(extents, nbytes)``: ``extents[k] = (file_offset_k, length_k, dst_offset_k)``
    in the given order, for ``Reader.read_async``, and the staging bytes the
    layer needs from ``base`` (a page multiple; ``base`` must be page aligned).
    Extents contiguous in the file stay contiguous in the buffer (one read per
    run); each run starts at its file offset's position within a page and has
    pages of its own, so the aligned reads of two runs never overwrite each other.
    """
    if base % PAGE:
        raise ValueError(f"staging_layout: base must be a multiple of {PAGE}, got {base}")
    order = sorted(range(len(file_extents)), key=lambda k: file_extents[k][0])
    out: list = [None] * len(file_extents)
    cursor = base  # page aligned: where the next run's first page starts
    run_start = run_end = run_dst = None
    for k in order:
        off, length = (int(v) for v in file_extents[k][:2])
        if off < 0 or length < 0:
            raise ValueError(f"staging_layout: extent {k} ({off}, {length}) has a negative field")
        if run_end is None or off != run_end:  # a new run, on fresh pages
            if run_end is not None:
                cursor = round_to_page(run_dst + (run_end - run_start))
            run_start, run_end, run_dst = off, off, cursor + off % PAGE
        out[k] = (off, length, run_dst + (off - run_start))
        run_end = off + length
    if run_end is not None:
        cursor = round_to_page(run_dst + (run_end - run_start))
    return out, cursor - base


def held_interrupts():
    """Ctrl-C held back (contract.defer_interrupts) while a descriptor or file is made
    and the record that closes it is set up (a finalizer, a list that a rollback
    closes): Python raises a pending KeyboardInterrupt right after a native call such
    as os.open returns, which would leave the descriptor with nothing to close it."""
    from layerwise import contract  # (imported here: the contract is built on the stages)

    return contract.defer_interrupts()


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


@dataclass
class OpenFile:
    """A file opened for reading, with the size, mtime and ctime it had when
    opened: a read through it fails (ReadError) if the file has changed since,
    or was deleted. Close it (or use it as a context manager) when done; ``reader``
    (if given to ``close``) also drops its cached O_DIRECT descriptor. One that
    is garbage collected unclosed closes its descriptor then."""

    path: str
    fd: int
    size: int
    mtime_ns: int
    ctime_ns: int = -1  # moves on every write, even one that sets mtime back (cp -p, rsync --inplace -t)
    ino: int = -1
    dev: int = -1
    _closer: weakref.finalize | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.fd >= 0:
            self._closer = weakref.finalize(self, _close_fd, self.fd)

    @classmethod
    def open(cls, path) -> OpenFile:
        path = os.fsdecode(path)
        with held_interrupts():  # until its finalizer closes the descriptor
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                return cls(path, fd, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
            except BaseException:
                os.close(fd)
                raise

    @property
    def expect(self) -> tuple[int, int, int]:
        return (self.size, self.mtime_ns, self.ctime_ns)

    def close(self, reader: Reader | None = None) -> None:
        if self.fd >= 0:
            if reader is not None:
                reader.forget(self.fd)
            if self._closer is not None:
                self._closer()  # closes the descriptor, once
            else:
                os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_layer(reader: Reader, file, extents, staging: torch.Tensor, after=None):
    """Queue the read of one layer: ``extents`` ``[(file_offset, length,
    dst_offset), ...]`` of ``file`` into ``staging`` (a contiguous uint8 host
    tensor, e.g. from ``aligned_staging``), after the event ``after``.

    ``file``: an ``OpenFile`` (its descriptor; the read fails if the file changed
    since it was opened), an open descriptor (int) or a path (opened by the
    reader thread for this read). Returns the read's Event; errors are raised by
    its ``synchronize()``, except bad arguments, which raise here.
    """
    if isinstance(file, OpenFile):
        if file.fd < 0:
            raise ValueError(f"read_layer: {file.path} was closed")
        return reader.read_async(file.fd, extents, staging, after=after, expect=file.expect)
    return reader.read_async(file, extents, staging, after=after)


def filesystem_type(path) -> str:
    """The type of the file system that holds ``path`` ("ext4", "tmpfs", ...),
    from /proc/mounts (the longest mount point above it); "" if unknown."""
    path = os.path.realpath(os.fsdecode(path))
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return ""
    return kind
