"""transfer: a layer's block in the host arena -> its device slot, on the copy
engine's stream(s). A block that had to be pinned in several registrations
(HostArena.split_points: one too large to register at once) is copied in one
copy per registration, chained, so that no copy spans two."""
from __future__ import annotations


class Transfer:
    def __init__(self, engine, host_blocks, splits):
        self.engine = engine
        self.host_blocks = host_blocks  # layer index -> uint8 host tensor
        self.splits = splits  # layer index -> byte offsets where the copy must split

    def fetch(self, i: int, dst, after, timing: bool):
        block = self.host_blocks[i]
        cuts = self.splits[i]
        if not cuts:
            return self.engine.copy_async(dst, block, after, timing)
        cuts = [0, *cuts, block.numel()]
        for a, b in zip(cuts[:-2], cuts[1:-1]):
            after = self.engine.copy_async(dst[a:b], block[a:b], after)
        return self.engine.copy_async(dst[cuts[-2]:], block[cuts[-2]:], after, timing)
