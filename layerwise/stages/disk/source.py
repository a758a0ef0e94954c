"""DiskSource: a layer whose payload lives in a file; its fetch is read (into a
pinned staging slot) -> transfer, and its true bytes are written back in place."""
from __future__ import annotations

import errno
import threading

import torch

from layerwise.stages.disk import files, staging
from layerwise.stages.disk.reader import (
    Reader,
    ReadError,
    aligned_staging,
    read_layer,
    round_to_page,
    staging_layout,
)
from layerwise.stages.source import Source


class _Part:
    __slots__ = ("file", "extents")

    def __init__(self, file: files.DiskFile, extents):
        self.file, self.extents = file, extents


class DiskSource(Source):
    """A layer whose truth is in a file (stages/source.py interface).

    `parts`: [(DiskFile, [(file_offset, length, staging_offset), ...])], the
    layer's extents per file, laid out in staging by `read.staging_layout`;
    `copies`: [(staging_offset, plan_offset, length)], what the transfer copies
    into the slot; `crc`: CRC-32 of the plan-layout bytes when loaded.
    `spill`: the SpillFile it lives in (writable), else None (a checkpoint)."""

    kind = "disk"
    host = None
    stored_bytes = 0
    fetches_window = True  # (the tier reads and copies the window's extents only)

    def __init__(self, index: int, nbytes: int, parts, copies, crc: int, spill: files.SpillFile | None = None,
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
        self.capacity = round_to_page(nbytes)  # a spill layer's region: its bytes, page-rounded
        self.spare = None  # a spill layer's second region (offset, capacity): where the next write goes
        self.what = what  # "layer group[i]" for messages
        self.tier: staging.DiskTier | None = None
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
        if files.crc_of(block) != self.crc:
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
        reader = tier.reader if tier is not None else files.shared_reader()
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
        if self.spare is None or round_to_page(n) > self.spare[1]:
            self.spare = (self.spill.append(staging[:n]), round_to_page(n))
        else:
            try:
                self.spill.write_at(self.spare[0], staging[:n])
            finally:
                self.spill.refresh()
        old = self.spill_offset, self.capacity, self.nbytes, self.crc
        self._switch(*self.spare, n, files.crc_of(block))
        # (nothing reads the new region before an undo: the write and its undo are one call of ShareSource.write)
        return (lambda: self._switch(*old)) if undo else None

    def holders(self):
        yield self

    def close(self) -> None:
        self.tier = None
