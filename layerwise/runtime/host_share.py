"""host_share: a layer group's part in a machine-wide shared host arena
(docs/share-host.md).

With `share_host`, the group's key (layerwise.planning.share_key) names one
rendezvous on the machine (runtime/rendezvous.py). The first process to
arrive packs the group as usual, but into a memfd (runtime/shared_arena.py)
instead of anonymous memory; it then writes the manifest (where each layer
is, encoded or not, which layers the disk tier holds), makes its own mapping
read-only, seals the file and publishes it. Every later process gets the
sealed file, checks it, maps it read-only and takes each layer's block from
the manifest: nothing is read from a checkpoint or copied, and its own
parameters only become placeholders. A process that arrives while the first
is still packing waits for it; if the packer dies or fails, one of those
waiting packs instead.

The kernel frees the file with its last mapping: a process that exits, or is
killed, takes nothing with it that others use, and leaves nothing behind.
"""
from __future__ import annotations

import logging

from layerwise import _native
from layerwise.planning import share_key
from layerwise.planning.layout import BLOCK_ALIGN, round_up

log = logging.getLogger("layerwise")


class HostShare:
    """One group's membership of its shared arena: `role` is "packer" (this process
    packs, then publishes), "attached" (it maps what another packed) or "private"
    (the packer did not finish in time: this process packs its own, unshared)."""

    def __init__(self, group: str, digest: bytes, name: str, membership):
        self.group, self.digest, self.name = group, digest, name
        self.membership = membership
        self.file = membership.value[0] if membership.role == "attached" else None
        self.manifest = membership.value[1] if membership.role == "attached" else None
        self.entries: dict[int, dict] = {}  # layer index -> its manifest entry (packer: as packed)
        if self.manifest is not None:
            self.entries = {e["index"]: e for e in self.manifest["layers"]}
        self.published = False

    @property
    def role(self) -> str:
        return self.membership.role

    @property
    def attached(self) -> bool:
        return self.role == "attached"

    @property
    def packing(self) -> bool:
        return self.role == "packer"

    @property
    def address(self) -> str:
        from layerwise.runtime import rendezvous

        return "@" + rendezvous.address(self.name)[1:].decode()

    # ------------------------------------------------------------ joining
    @classmethod
    def join(cls, plan, options, resident, group: str) -> "HostShare":
        """Find (or become) the packer of the group's arena. Raises
        shared_arena.SharedArenaError or rendezvous.RendezvousError, naming the
        address, where what is found there cannot be trusted."""
        from layerwise.runtime import rendezvous, shared_arena

        identity = options.share_host
        if identity is True:
            identity = share_key.content_identity(plan)
        digest, name = share_key.share_key(plan, options, identity, resident)
        where = "@" + rendezvous.address(name)[1:].decode()

        def validate(fd):
            return shared_arena.SharedFile.open(fd, digest, where)

        membership = rendezvous.join(name, validate=validate)
        share = cls(group, digest, name, membership)
        share.key_given = options.share_host
        # a key string the caller gave (not an identity made from files or bytes): trusted, so
        # spot-checked where the weights come from a checkpoint (HostLayers._spot_check)
        share.asserted = isinstance(identity, str) and not identity.startswith(share_key.CHECKPOINT) \
            and options.share_host is not True
        if share.attached:
            try:
                share._check_layout(plan)
            except BaseException:
                share.leave()  # (the file's fd would keep the arena alive for the life of the process)
                raise
        log.info("layerwise: %s: share_host: %s the arena %s", group,
                 {"packer": "packing", "attached": "attached to", "private": "packing a private copy of"}[share.role],
                 where)
        return share

    def _check_layout(self, plan) -> None:
        from layerwise.runtime.shared_arena import SharedArenaError

        m = self.manifest
        if m.get("layout") != share_key.layout_of(plan) or len(self.entries) != len(plan.layers):
            raise SharedArenaError(
                f"layerwise: {self.group}: the shared arena at {self.address} (packed by process "
                f"{m.get('pid')}) does not hold this group's layout although its key matches; another version of "
                "layerwise, or a forged arena. Pass share_host=False, or stop the processes streaming from it.")

    def adopt_disk_layers(self, tiers) -> None:
        """An attached group keeps on disk exactly the layers the packer kept there
        (a host_budget of "auto" resolves differently once the arena takes memory):
        its own plan's files serve them, so the sets may only differ where this
        process has a file store for the layers the packer put on disk."""
        packed = frozenset(self.manifest["disk"])
        if packed == tiers.disk_layers:
            return
        if packed and tiers.make_store is None:
            from layerwise.runtime.shared_arena import SharedArenaError

            raise SharedArenaError(
                f"layerwise: {self.group}: the shared arena at {self.address} keeps layers {sorted(packed)} on disk, "
                "but this process has no disk tier for them (its host_budget kept every layer in memory). Give "
                "every process the same host_budget in bytes (not \"auto\"), or share_host=False.")
        tiers.keep_on_disk(packed, tiers.disk_where, tiers.make_store)

    # ------------------------------------------------------------ the arena
    @staticmethod
    def upper_bound(plan, routes) -> int:
        """The data bytes a packer reserves: every layer not on disk at its raw size
        (an encoded payload is never larger: the codec keeps a layer raw where
        encoding does not pay). Pages never written cost nothing."""
        return sum(round_up(lp.nbytes, BLOCK_ALIGN) for lp, r in zip(plan.layers, routes)
                   if r.where in ("arena", "device"))

    def create_arena(self, nbytes: int, pinned: bool, cuda: bool, device: int):
        from layerwise.runtime import shared_arena

        nbytes = max(nbytes, 1)  # (every layer on disk: an arena of one page that holds nothing)
        self.file = shared_arena.SharedFile.create(self.name, nbytes)
        return _native.HostArena.over_fd(self.file.fd, self.file.data_offset, nbytes, writable=True,
                                         pinned=pinned, cuda=cuda, device=device)

    def map_arena(self, pinned: bool, cuda: bool, device: int):
        return _native.HostArena.over_fd(self.file.fd, self.file.data_offset, max(self.file.data_bytes, 1),
                                         writable=False, pinned=pinned, cuda=cuda, device=device)

    def view(self, arena, index: int):
        """(block, entry) of layer `index` as packed (attached)."""
        e = self.entries[index]
        return arena.view(e["offset"], e["length"]), e

    def record(self, arena, index: int, block, pieces=None, codec: bool = False) -> None:
        """What the packer put where (the manifest's entry of layer `index`)."""
        # (an empty block, a layer whose parameters are all another layer's, has no address)
        offset = block.data_ptr() - arena.data_ptr if block.numel() else 0
        self.entries[index] = {
            "index": index, "offset": offset, "length": block.numel(), "codec": codec,
            "pieces": None if pieces is None else [[p.enc_off, p.enc_n, p.dst_off, p.dst_n, str(p.dtype)]
                                                   for p in pieces]}

    def record_disk(self, index: int) -> None:
        self.entries[index] = {"index": index, "disk": True}

    def publish(self, plan, arena, disk_layers) -> None:
        """The packer's last step: the manifest, its mapping read-only, the seal, and
        the file served to every process that asks."""
        import os
        manifest = {
            "pid": os.getpid(),
            "group": self.group,
            "layout": share_key.layout_of(plan),
            "layers": [self.entries[lp.index] for lp in plan.layers],
            "disk": sorted(disk_layers),
        }
        arena.protect()
        self.file.seal(self.digest, manifest)
        # Marked before the fd is served: once it is, a failure (an interrupt just
        # after) must leave like any holder, not abandon an election already won.
        self.manifest, self.published = manifest, True
        self.membership.publish(self.file.fd)

    # ------------------------------------------------------------ the way out
    def abandon(self) -> None:
        """The packer failed: the processes waiting re-elect one that packs."""
        if self.packing and not self.published:
            self.membership.abandon()
        self.leave()

    def leave(self) -> None:
        """Detach (the group is removed, or its configure failed). The mapping goes
        with the last tensor that views it."""
        self.membership.leave()
        if self.file is not None:
            self.file.close()
            self.file = None

    def figures(self) -> dict:
        return {"role": self.role, "key": self.name, "address": self.address,
                "holders": self.membership.holders() if self.role != "private" else None,
                "packer_pid": (self.manifest or {}).get("pid")}


def pieces_of(entry, dtypes) -> list | None:
    """The codec pieces of a manifest entry, their dtypes named among `dtypes` (the
    layer's); Chain.attach checks them against the payload's headers."""
    if entry.get("pieces") is None:
        return None
    from layerwise.stages.decode import Piece

    named = {str(d): d for d in dtypes}
    return [Piece(a, b, c, d, named[t]) for a, b, c, d, t in entry["pieces"]]
