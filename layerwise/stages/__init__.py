"""Stages of a layer's way to its ring slot (docs/design.md, "Tiers and stages").

The manager asks one question, "make layer i ready in slot s", of the layer's
source and gets one result back (result.py: an event, or a deferred one; both
answer resolve()); it names no tier. A source is a short chain, innermost
first (source.py): where the payload lives, then what happens on the way.
A compressed, split layer read from disk is ShareSource(CodecSource(
DiskSource)): read -> transfer -> decode -> gather. Each stage is a small
module of this package:

    result.py     the one result type: Deferred, then(), a group's Pending queue
    source.py     the Source protocol; ArenaSource (a payload in a host block)
    transfer.py   host -> device: the only caller of copy_async (registration splits)
    decode.py     CodecSource: the payload is encoded -> decode into the slot
    planning/experts.py    ExpertSource / ExpertTier: routed experts (the layer's fetch copies
                  its non-expert prefix; the experts a forward needs come from the
                  device expert cache or over the bus, from the expert hooks)
    disk/         a payload in a file (checkpoint or spill): reader.py (file extents ->
                  pinned staging, the reader threads), files.py, staging.py (DiskTier:
                  read -> transfer), source.py (DiskSource)
    split/        the payload is this rank's share -> all-gather: collectives.py (the
                  private group and its thread, the lockstep check), validate.py,
                  source.py (ShareStore, ShareSource)
    chain.py      one group's stages: builds each layer's source from its route
                  (layerwise.planning.routes), starts them, runs their work at the hooks
"""
from layerwise.stages import split
from layerwise.stages.chain import Chain, attached
from layerwise.stages.decode import CodecSource, CodecTier
from layerwise.stages.disk import DiskSource, DiskTier, ReadCopy, SpillFile
from layerwise.stages.experts import ExpertSource, ExpertTier
from layerwise.stages.result import Deferred, Pending, is_deferred, then
from layerwise.stages.source import ArenaSource, Source
from layerwise.stages.transfer import Transfer

__all__ = ["ArenaSource", "Chain", "attached", "CodecSource", "CodecTier", "Deferred", "DiskSource", "DiskTier",
           "ExpertSource", "ExpertTier", "Pending", "ReadCopy", "Source", "SpillFile", "Transfer", "is_deferred",
           "split", "then"]
