"""source: where a layer's true bytes live (DESIGN.md, "Tiers and stages").

Every streamed layer has one source. The manager and the state contract only
talk to it through this interface, so a new tier (a file on disk, an encoded
arena, this rank's share of the layer) is a new source class here, not a
branch in the manager:

    nbytes          the layer's bytes in plan layout (what its slot receives)
    stored_bytes    the host memory it holds (its part of the arena)
    transfer_bytes  the bytes one fetch moves over the bus (stats' bytes_copied)
    slot_bytes      the slot bytes its fetch writes (>= nbytes; a gather fills whole
                    shares: gather.py); optional, nbytes where absent
    host            the plan-layout bytes as a host uint8 tensor that *is* the
                    truth (a write into it reaches the model), or None where the
                    truth is elsewhere (then read() gives a copy)
    version()       changes whenever the true bytes change
    read()          the plan-layout bytes, host uint8: `host` itself or a fresh copy
    write(block)    replace the true bytes with `block` (plan layout, host uint8,
                    nbytes); raises, naming why and what to do, where the source
                    cannot be written (a checkpoint file that is not ours)
    writable        False where write() always refuses (checked before a
                    load_state_dict changes anything); such a source has
                    refuse_write(), which raises the error write() would
    fetch           the stage that brings the bytes to a slot (stages/__init__.py)
    close()         drop what it holds (files, staging); called by remove()
"""
from __future__ import annotations

import torch


class ArenaSource:
    """The layer's block in the host arena, in plan layout: the truth itself."""

    kind = "arena"
    writable = True

    def __init__(self, block: torch.Tensor, fetch=None):
        self.block = block
        self.nbytes = block.numel()
        self.stored_bytes = block.numel()
        self.transfer_bytes = block.numel()
        self.slot_bytes = block.numel()
        self.fetch = fetch

    @property
    def host(self) -> torch.Tensor:
        return self.block

    def version(self) -> int:
        return self.block._version

    def read(self) -> torch.Tensor:
        return self.block

    def write(self, block: torch.Tensor) -> None:
        if block.data_ptr() != self.block.data_ptr():
            self.block.copy_(block)

    def close(self) -> None:
        self.block = None
