"""source: where a layer's true bytes live, and how they reach its slot
(docs/design.md, "Tiers and stages").

Every streamed layer has one source: the outermost of a short chain. The
innermost holds this rank's *payload* (the bytes it keeps for the layer: all
of them, or its share; raw, or encoded) - a host block (``ArenaSource``) or a
file (``stages.disk.DiskSource``). Wrappers change what the payload means:
``stages.decode.CodecSource`` (the payload is encoded: decode into the slot),
``stages.split.ShareSource`` (the payload is this rank's share: gather the
rest from the other ranks). So a compressed, split layer read from disk is
ShareSource(CodecSource(DiskSource)): read -> transfer -> decode -> gather,
each stage taking the previous one's result (stages/result.py) and returning
the next. The manager and the state contract only use the ``Source``
interface below (the base class every source derives from, which declares
its optional abilities); a new tier is a new wrapper or holder here, not a
branch in the manager.
"""
from __future__ import annotations

import torch

from layerwise.stages.transfer import cuts_of


class Source:
    """What the manager and the state contract know of a layer's source. Every
    source derives from it (ArenaSource, DiskSource, CodecSource, ShareSource,
    ExpertSource); the optional abilities are declared here with their defaults,
    so a caller uses them directly instead of probing for them."""

    kind: str  # "arena", "disk", "lossless", "share": the outermost stage (messages, stats)
    nbytes: int  # the layer's bytes in plan layout (what its slot receives)
    stored_bytes: int  # the host memory it holds
    transfer_bytes: int  # the bytes one fetch moves over this rank's bus (stats' bytes_copied)
    writable = True  # False where write() always refuses (then refuse_write() raises why)
    # stream_only / fetch_window: its fetch can be cut to a prefix of the layer (routed
    # experts fetch the part before the experts; a file reads ahead that part only)
    fetches_window = False
    # The plan-layout bytes as a host uint8 tensor that *is* the truth (a write into it
    # reaches the model), or None where the truth is elsewhere (a file, encoded, shares).
    host: torch.Tensor | None = None
    # The payload is in the machine's shared arena (stages/shared.py): read-only, and a
    # write moves the layer to a block of this process's own.
    shared = False

    @property
    def slot_bytes(self) -> int:
        """The slot bytes its fetch writes (>= nbytes: a gather fills whole shares)."""
        return self.nbytes

    def version(self) -> int:
        """Changes whenever the true bytes change."""
        raise NotImplementedError

    def read(self) -> torch.Tensor:
        """The plan-layout bytes, host uint8: `host` itself or a fresh copy."""
        raise NotImplementedError

    def write(self, block: torch.Tensor, undo: bool = False):
        """Replace the true bytes (plan layout, host uint8, nbytes); raises, naming
        why and what to do, where it cannot be written. A write that raises leaves
        the old bytes. `undo=True` (asked of the stages a split layer's ShareSource
        wraps, stages/split/): returns a callable that puts the old bytes back
        where the write failed on another rank, with no I/O and no allocation; the
        version grows again."""
        raise NotImplementedError

    def refuse_write(self) -> None:
        """Raise why write() refuses, naming what to do (where not `writable`)."""
        raise RuntimeError(f"layerwise: internal: a {self.kind} source asked why it refuses a write it takes")

    def host_written(self) -> None:
        """`host` was written in place through a tensor with a version counter of its
        own (a state_dict() alias: contract.check_handed_out): the version grows.
        Only asked of a source whose `host` is not None."""
        raise RuntimeError(f"layerwise: internal: a {self.kind} source has no host bytes to be written")

    def fetch(self, i: int, dst: torch.Tensor, after, timing: bool):
        """Queue what makes the bytes land in `dst` (device uint8) once `after` has
        completed; returns the stage result (an event or a Deferred)."""
        raise NotImplementedError

    def fetch_failed(self, err: BaseException) -> BaseException:
        """What the manager raises where waiting for a fetch of this layer raised
        `err`: `err` itself, or the source's own error (a split gather's SplitError,
        which the native event gives back as a ReadError)."""
        return err

    def stream_only(self, hi: int) -> None:
        """Where `fetches_window`: fetch_window brings bytes [0, hi) of the layer only."""
        raise NotImplementedError(f"layerwise: internal: a {self.kind} source cannot fetch a window")

    def fetch_window(self, i: int, dst: torch.Tensor, after, timing: bool):
        """Where `fetches_window`: bytes [0, window) of the layer into `dst` (stream_only)."""
        raise NotImplementedError(f"layerwise: internal: a {self.kind} source cannot fetch a window")

    def copy_range(self, dst: torch.Tensor, lo: int, hi: int, after, timing: bool = False):
        """Queue bytes [lo, hi) of the layer into the same bytes of `dst` (a slot) after
        `after`: a part of the layer (routed experts, stages/experts.py)."""
        raise NotImplementedError(f"layerwise: internal: a {self.kind} source cannot copy a range")

    def range_bytes(self, lo: int, hi: int) -> int:
        """The bytes copy_range(dst, lo, hi) moves over the bus."""
        raise NotImplementedError(f"layerwise: internal: a {self.kind} source cannot copy a range")

    def holders(self):
        """This source and those it wraps, outermost first (the payload's holder last)."""
        yield self

    def close(self) -> None:
        """Drop what it holds (files, staging); called by remove()."""


class ArenaSource(Source):
    """A payload in a host block (the group's arena, an encoded layer's block, a
    share): the truth itself. `alloc(n) -> (block, arena)` (optional) gives a
    block of another size where a write changes the size (an encoded payload)."""

    kind = "arena"
    writable = True

    def __init__(self, block: torch.Tensor, arena=None, alloc=None):
        self.alloc = alloc
        self.transfer = None  # stages.Transfer, set when the group starts
        self._version = 0
        self._set(block, arena)

    def _set(self, block: torch.Tensor, arena) -> None:
        self.block, self.arena = block, arena
        self.nbytes = self.stored_bytes = self.transfer_bytes = block.numel()
        self.cuts = cuts_of(arena, block)

    @property
    def host(self) -> torch.Tensor:
        return self.block

    def version(self) -> int:
        return self.block._version + self._version

    def read(self) -> torch.Tensor:
        return self.block

    def host_written(self) -> None:
        """`host` was written in place through a tensor with a version counter of its
        own (a state_dict() alias of the block: contract.check_handed_out): the
        version grows, so that what is keyed on it (the slot ring, the expert cache)
        takes the new bytes."""
        self._version += 1

    def _replace(self, block: torch.Tensor, arena) -> None:
        was = self.version()
        self._set(block, arena)  # a copy still reading the old block keeps it alive
        self._version = was + 1 - block._version  # versions only grow (another block's counter is its own)

    def write(self, block: torch.Tensor, undo: bool = False):
        if block.numel() != self.block.numel():
            if self.alloc is None:
                raise ValueError(f"layerwise: internal: a {block.numel()}-byte write into a "
                                 f"{self.block.numel()}-byte block")
            old = self.block, self.arena
            new, arena = self.alloc(block.numel())
            new.copy_(block)
            self._replace(new, arena)
            return (lambda: self._replace(*old)) if undo else None
        if block.data_ptr() == self.block.data_ptr():  # edited in place: nothing to copy
            if undo:
                raise ValueError("layerwise: internal: an undoable write of a block into itself (its old bytes "
                                 "are gone)")
            return None
        old = self.block.clone() if undo else None  # (a split share: this rank's part of the layer)
        self.block.copy_(block)
        return (lambda: self.block.copy_(old)) if undo else None

    def fetch(self, i: int, dst: torch.Tensor, after, timing: bool):
        return self.transfer.copy(dst[: self.nbytes], self.block, after, timing, self.cuts)

    def copy_range(self, dst: torch.Tensor, lo: int, hi: int, after, timing: bool = False):
        """Queue bytes [lo, hi) of the block into the same bytes of `dst` (a slot)
        after `after`: a part of the layer (routed experts, stages/experts.py)."""
        cuts = tuple(c - lo for c in self.cuts if lo < c < hi)
        return self.transfer.copy(dst[lo:hi], self.block[lo:hi], after, timing, cuts)

    def range_bytes(self, lo: int, hi: int) -> int:
        """The bytes copy_range(dst, lo, hi) moves over the bus."""
        return hi - lo

    def close(self) -> None:
        self.block = self.arena = None
        self.cuts = ()

    def holders(self):
        yield self
