"""transfer: host bytes -> device memory, on the copy engine's stream(s): the
only stage that calls ``engine.copy_async`` (docs/design.md, "Tiers and stages").

Every host buffer a chain copies from (the arena, an encoded layer's block,
this rank's shares, disk staging) is a ``HostArena`` allocation; one that had
to be pinned in several registrations (``HostArena.split_points``: a block too
large to register at once) is copied in one copy per registration, chained,
so that no copy spans two (a copy across two registrations would run at
pageable speed and block the host)."""
from __future__ import annotations


def cuts_of(arena, block) -> tuple:
    """Where a copy out of `block` (a tensor in `arena`) must split: byte offsets
    into the block, normally none."""
    if arena is None or block is None or not block.numel():
        return ()
    return tuple(arena.split_points(block.data_ptr() - arena.data_ptr, block.numel()))


class Transfer:
    def __init__(self, engine):
        self.engine = engine

    def copy(self, dst, src, after=None, timing: bool = False, cuts=()):
        """Queue src (host uint8) -> dst (device uint8, as many bytes) after `after`;
        `cuts`: the split points of src's registration (cuts_of). Returns the event."""
        copy_async = self.engine.copy_async
        if not cuts:
            return copy_async(dst, src, after, timing)
        bounds = [0, *[c for c in cuts if 0 < c < src.numel()], src.numel()]
        first = None
        for a, b in zip(bounds[:-2], bounds[1:-1]):
            after = copy_async(dst[a:b], src[a:b], after, timing and first is None)
            if first is None:
                first = after
        last = copy_async(dst[bounds[-2]:], src[bounds[-2]:], after, timing)
        if timing and first is not None:
            last.start = first.start  # timed from the first piece's start: the whole copy
        return last
