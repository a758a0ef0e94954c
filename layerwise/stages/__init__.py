"""Stages of a layer's way to its ring slot (DESIGN.md, "Tiers and stages").

The manager asks one question, "make layer i ready in slot s", and gets one
event back; it does not know how a stage works. A stage object has

    fetch(i, dst, after, timing) -> Event

which queues whatever makes layer i's bytes land in `dst` (the front of its
slot, a uint8 tensor on the device) once `after` has completed, and returns the
event that completes when they have. Stages compose by holding the next one:
a compressed layer read from disk is read -> transfer -> decode. Each stage is
a small module of this package:

    source.py     where a layer's true bytes live (ArenaSource: the host arena), and
                  the interface the manager and the state contract use for them
    read.py       file extents -> pinned host staging (the disk tier's reader threads)
    disk.py       the disk tier: layers in files (checkpoint or spill), read -> transfer
    transfer.py   host arena -> device slot (the copy engine)
    decode.py     layers kept encoded (compress="lossless"): copy to device staging,
                  then decode into the slot (CodecTier, CodecSource)
    gather.py     split fetch: this rank's share of a layer -> its part of the
                  slot, then an all-gather over the ranks completes the slot
"""
from . import gather
from .decode import CodecSource, CodecTier
from .disk import Deferred, DiskSource, DiskTier, SpillFile
from .read import Read
from .source import ArenaSource
from .transfer import Transfer

__all__ = ["ArenaSource", "CodecSource", "CodecTier", "Deferred", "DiskSource", "DiskTier", "Read", "SpillFile",
           "Transfer", "gather"]
