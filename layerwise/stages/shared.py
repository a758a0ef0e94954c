"""shared: a payload in the machine's shared host arena (docs/share-host.md).

Every process that streams a group with `share_host` reads its layers from
one arena that the first of them packed and sealed; the mapping is read-only
in every process, the packer's included. So a layer's true bytes there are
never written: a write (load_state_dict, a LoRA merge, set_residency's
write-back of a changed resident layer) copies the layer into a block of this
process's own first (copy on write), and from then on that block is the
layer's truth in this process only. The other processes keep streaming the
shared bytes.

`host` is None while the payload is shared, as for a layer in a file or
encoded: the manager then reads a copy, edits it and writes it back
(LayerwiseOffloadManager.write_layer), and state_dict() hands out copies.
"""
from __future__ import annotations

import torch

from layerwise import _native
from layerwise.planning.layout import BLOCK_ALIGN
from layerwise.stages.source import ArenaSource


def private_block(n: int, device: torch.device, pin_memory, what: str):
    """(block, arena): an exact-size host block of this process's own, pinned as
    `pin_memory` says (a copy on write of a shared layer)."""
    cuda = device.type == "cuda"
    arena = _native.HostArena(max(n, 1), pinned=pin_memory is not False, cuda=cuda,
                              device=device.index if cuda else -1)
    if arena.pin_error:
        _native.check_pinned(arena, pin_memory, what)
    return arena.allocate(max(n, 1), alignment=BLOCK_ALIGN)[:n], arena


class SharedSource(ArenaSource):
    """A payload in the shared arena (read-only) until its first write, then in a
    private block (`alloc(n) -> (block, arena)`) like any ArenaSource."""

    def __init__(self, block: torch.Tensor, arena, alloc):
        super().__init__(block, arena, alloc)
        self.shared = True
        self.copied_bytes = 0  # the private block a copy on write took

    @property
    def host(self) -> torch.Tensor | None:
        return None if self.shared else self.block

    def read(self) -> torch.Tensor:
        """A copy while shared (write_layer edits what read() returns)."""
        return self.block.clone() if self.shared else self.block

    def write(self, block: torch.Tensor, undo: bool = False):
        if not self.shared:
            return super().write(block, undo)
        if block.numel() == self.block.numel() and torch.equal(block, self.block):
            # the bytes it has (a reload of the same checkpoint): a copy would only
            # cost this process a private block of what the machine holds once
            return (lambda: None) if undo else None
        old = self.block, self.arena
        new, arena = self.alloc(block.numel())
        new.copy_(block)
        self._replace(new, arena)
        self.shared, self.copied_bytes = False, new.numel()

        def back():
            self._replace(*old)
            self.shared, self.copied_bytes = True, 0
        return back if undo else None
