"""chain: one layer group's stages (docs/design.md, "Tiers and stages").

The manager packs each streamed layer and hands the chain its plan-layout
bytes and its route (layerwise.planning.routes.Route: where the true bytes live and
what happens on the way); the chain builds the layer's source, innermost
first (stages/source.py):

    payload   the layer's bytes, or this rank's share of them (route.split)
    encoded   route.encoded: the payload encoded (stages/decode.py), where that pays
    holder    a host block (ArenaSource), or a file (route.where: "spill" or
              "checkpoint": stages/disk.DiskSource, read -> transfer)
    wrappers  CodecSource (-> decode) and ShareSource (-> gather) around it

At finalisation `start` gives every stage what it needs on the device and the
host (the transfer, decode staging, disk staging and reader, the gather's
queue), and at the hooks the manager asks the chain, never a tier, to issue
what is ready (`pump`), the collectives (`settle`), the reads ahead
(`read_ahead`), and on the way out to `flush`, `forget` or `close`.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import logging

import torch

from layerwise.stages.decode import CodecSource, CodecTier, segments_of
from layerwise.stages.disk import DiskSource, DiskTier
from layerwise.stages.experts import ExpertSource, ExpertTier
from layerwise.stages.result import Pending
from layerwise.stages.source import ArenaSource
from layerwise.stages.transfer import Transfer

log = logging.getLogger("layerwise")

POLL_S = 50e-6  # between looks at a fetch the host waits for (Chain.meanwhile)


class Chain:
    def __init__(self, group: str, options, split=None, file_store=None, experts=None):
        """`options`: the group's OffloadOptions as they are when it packs, the planners'
        choices in them (its device, pin_memory, compress, the disk stage's staging
        slots and read delay, expert_cache); the host side is fixed from then on (a
        later set_residency changes the ring, not the staging). `split`: its share
        store; `experts`: its routed experts' plan."""
        self.group = group
        self.options = options
        self.codec = CodecTier(group, options.device, options.pin_memory) if options.compress == "lossless" else None
        self.split = split  # stages.split.ShareStore, or None
        self.file_store = file_store  # store(lp, payload, span, what) -> DiskSource, or None
        self.files: list = []  # the files its disk sources read (closed by close())
        self.pending = Pending()
        self.disk: DiskTier | None = None
        self.transfer: Transfer | None = None
        self._disk_of: dict[int, DiskSource] = {}  # layer index -> the disk source in its chain
        self._upcoming: list = []
        self._meanwhile: list = []  # per layer: what the disk stage does while the host waits (meanwhile)
        self.host_blocks = False  # a wait for a fetch blocks the host (the CPU backend's engine)
        # routed experts (layerwise/planning/experts.py plans them): every layer's ordinary fetch copies its
        # non-expert prefix; the experts' rows are copied by this stage from the expert modules' hooks
        self.experts = ExpertTier(group, experts, options.device, options.expert_cache) if experts is not None else None

    @classmethod
    def for_group(cls, group: str, options, tiers) -> "Chain":
        """The chain of a group whose options are `options` (its own: the planners'
        choices in them) and whose tier plan is `tiers` (layerwise.planning.routes.TierChoice,
        set by the planners): its codec, its share store, the store of its disk layers
        (whose files it opens: closed with it)."""
        chain = cls(group, options, tiers.split_store, experts=tiers.experts)
        if chain.codec is not None:  # (a write that re-encodes a layer larger is checked against it)
            chain.codec.host_budget = tiers.host_budget
        if tiers.disk_layers:
            try:
                chain.file_store = tiers.make_store(chain.files)
            except BaseException:
                chain.close()
                raise
        return chain

    # ------------------------------------------------------------ pack time
    def keep(self, lp, route, block: torch.Tensor, place=None):
        """Layer `lp`'s source for `route`, from its plan-layout bytes `block` (a
        scratch block: the chain keeps its own copy, or a file). `place(n, alloc)`,
        if given, is where an encoded payload is kept instead of a block of the
        codec's own: a SharedSource in the machine's shared arena (stages/shared.py)."""
        what = f"layer {self.group}[{lp.index}]"
        lo, hi = (route.split[1], route.split[2]) if route.split is not None else (0, lp.nbytes)
        payload = block[lo:hi]
        pieces = None
        codec = self.codec if route.encoded else None
        if codec is not None:
            # (routed experts: each expert's rows a segment of its own, so that they decode alone)
            segments = segments_of(lp, lo, hi) if self.experts is None else self.experts.plan.segments(lp)
            payload, pieces = codec.keep(segments, payload)
        if route.where in ("spill", "checkpoint"):
            src = self.file_store(lp, payload, route.split and (lo, hi), what)
            self._disk_of[lp.index] = src
        elif codec is not None:
            if place is not None:
                src = place(payload.numel(), codec.host_block)
            else:
                src = ArenaSource(*codec.host_block(payload.numel()), alloc=codec.host_block)
            src.block.copy_(payload)
        elif self.split is not None and route.split is not None:
            src = self.split.hold(payload)
        else:
            raise ValueError(f"layerwise: internal: {what} has a plain route; it belongs in the arena")
        if codec is not None:
            src = CodecSource(codec, lp.index, segments, hi - lo, src, pieces)
        if route.split is not None:
            src = self.split.wrap(lp.index, lp.nbytes, src)
        return self.keep_plain(lp, src)

    def attach(self, lp, inner, pieces):
        """The source of an encoded layer that another process packed into the shared
        arena: `inner` (a SharedSource) holds its payload, `pieces` its encoding as
        the manifest gives it (None: kept raw); checked here (CodecTier.adopt)."""
        segments = segments_of(lp) if self.experts is None else self.experts.plan.segments(lp)
        src = CodecSource(self.codec, lp.index, segments, lp.nbytes, inner, self.codec.adopt(inner.block, pieces))
        return self.keep_plain(lp, src)

    def keep_plain(self, lp, src):
        """The source of a layer (`src`: its ArenaSource in the arena, or the chain
        keep() built): itself, or in a group with routed experts an ExpertSource
        around it (every layer of such a group: its fetches wait for expert copies)."""
        if self.experts is None:
            return src
        return ExpertSource(src, lp.base_bytes, self.experts)

    # ------------------------------------------------------------ run time
    def start(self, engine, sources: list, streamed: list[int], compute_ready=None, ring=None) -> None:
        """Give every stage what it needs (once the group is packed): `sources` every
        layer's source, `streamed` the streamed layers in order, `compute_ready` an
        event on the compute stream (CUDA) that the first write into new device
        buffers waits on. The disk stage gets the staging slots the host budget
        counted (options.disk_staging_slots: at the prefetch depth planned)."""
        self.transfer = Transfer(engine)
        self.host_blocks = not engine.is_cuda
        for src in sources:
            for h in src.holders():
                if isinstance(h, ArenaSource):
                    h.transfer = self.transfer
        if self.codec is not None:
            self.codec.start(engine, self.transfer, self.pending, compute_ready)
        if self.split is not None:
            self.split.start(engine, self.pending)
        if self.experts is not None:
            self.experts.start(engine, sources, ring)
        order = [i for i in streamed if i in self._disk_of]
        if not order:
            return
        srcs = [self._disk_of[i] for i in order]
        opts = self.options
        self.disk = DiskTier(engine, opts.disk_staging_slots, max(s.fetch_staging_size for s in srcs), opts.device,
                             pinned=opts.pin_memory is not False, debug_read_delay_us=opts.debug_read_delay_us)
        if self.experts is not None:  # on-demand reads of experts' rows: one expert's largest rows at a time
            self.disk.range_chunk = self.experts.plan.range_chunk()
            self.disk.range_runs = 1 if all(s.spill is not None for s in srcs) else self.experts.plan.range_runs()
        for s in srcs:
            s.tier = self.disk
        self._sources = sources
        self.restream(len(sources), streamed)
        self._follow_ring(ring)

    def restream(self, num_layers: int, streamed: list[int], ring=None) -> None:
        """The streamed layers are `streamed` now (start, or a placement change:
        LayerwiseOffloadManager.set_residency; `ring`: the new slot ring). The disk
        stage keeps the staging it was planned with (the host side does not change);
        what it reads ahead follows: the disk layers streamed after layer i, in order
        (wrapping around), as many as there are staging slots."""
        if ring is not None and self.experts is not None:
            self.experts.restream(ring)
        if self.disk is None:
            return
        self._follow_ring(ring)
        order = [i for i in streamed if i in self._disk_of]
        srcs = [self._disk_of[i] for i in order]
        n = min(len(self.disk.slots), len(srcs))
        self._upcoming = []
        for i in range(num_layers):
            k = bisect.bisect_right(order, i)
            self._upcoming.append([srcs[(k + j) % len(srcs)] for j in range(n)])
        # (split fetch: the wait is on a gather, after a collective; reads queued during it
        # were measured to read a layer twice per step: the hooks' own pace is kept there)
        self._meanwhile = []
        if self.host_blocks and self.split is None:
            self._meanwhile = [functools.partial(self.disk.issue_while_waiting, upcoming=up, poll_s=POLL_S)
                               for up in self._upcoming]

    def _follow_ring(self, ring) -> None:
        """The disk stage reads ahead no layer that `ring` holds now (DiskTier.in_place)."""
        if ring is None or self.disk is None:
            return
        index = {id(src): i for i, src in self._disk_of.items()}
        sources = self._sources

        def in_place(src) -> bool:
            i = index.get(id(src))
            return i is not None and ring.holds(i, sources[i].version())

        self.disk.in_place = in_place

    @property
    def reads_ahead(self) -> bool:
        """A stage works from the hooks even with nothing queued (the disk stage's reads)."""
        return self.disk is not None

    def pump(self) -> None:
        """Issue the work whose inputs are ready (copies of finished reads, the
        decodes after them), never blocking."""
        if self.disk is not None:
            self.disk.pump()
        self.pending.pump()

    def settle(self) -> None:
        """Issue the collectives queued so far, in order (blocking on what they wait
        on): called where every rank of a split-fetch group is at the same point."""
        self.pending.settle()

    def read_ahead(self, i: int) -> None:
        if self.disk is not None:
            self.disk.read_ahead(self._upcoming[i])

    def meanwhile(self, i: int):
        """What the stages do while the host waits for layer i's fetch, or None: where
        the wait blocks the host (the CPU backend), the disk stage keeps the bus busy
        by issuing, as they finish, the copies of reads done and reads into staging
        slots freed (else they would wait for the next hook, one compute later).
        Made once per layer (restream), not per call."""
        return self._meanwhile[i] if self._meanwhile else None

    def flush(self, collectives: bool = True) -> None:
        """Issue everything queued (blocking on reads; the collectives too unless
        `collectives=False`: stats() issues none); then wait for the reads and the
        gathers (their own stream on CUDA: remove frees the slots they write). The
        copies and decodes run on the copy engine's streams: engine.synchronize()."""
        if self.disk is not None:
            self.disk.flush()
        self.pending.flush(collectives)
        if self.disk is not None:
            self.disk.synchronize()
        if self.split is not None:
            self.split.synchronize()

    def fill(self, i: int) -> None:
        """Layer i whole in its slot (waited for on the host): the rows a stage copies
        only on demand (routed experts) too. For an edit of the layer in place."""
        if self.experts is not None:
            self.experts.fill(i)

    def forget(self) -> None:
        """After an interrupt: wait for the reads, drop what is queued and not issued."""
        self.pending.forget()
        if self.experts is not None:
            self.experts.forget()
        if self.codec is not None:
            self.codec.forget()
        if self.disk is not None:
            self.disk.forget()

    def idle(self) -> bool:
        """Nothing queued that flush() would issue or wait for (stats(sync=True) skips it then)."""
        return self.disk is None and self.split is None and not self.pending.items

    # ------------------------------------------------------------ figures
    def counts(self) -> tuple:
        d = self.disk
        return (d.bytes_read, d.read_wait_s) if d is not None else (0, 0.0)

    def disk_stats(self) -> dict | None:
        d = self.disk
        if d is None:
            return None
        r = d.reader.stats()
        srcs = list(self._disk_of.values())
        return {
            "layers": len(srcs),
            "layer_bytes": sum(src.nbytes for src in srcs),
            "files": sorted({p.file.path for src in srcs for p in src.parts}),
            "spill": any(src.spill is not None for src in srcs),
            "staging_bytes": d.staging_bytes,
            "staging_slots": len(d.slots),
            "bytes_read": d.bytes_read,
            "reads": d.reads,
            "read_wait_s": d.read_wait_s,
            "read_gbps": d.timed_bytes / d.read_s / 1e9 if d.read_s else None,
            "bytes_direct": r.get("bytes_direct", 0),
            "bytes_buffered": r.get("bytes_buffered", 0),
            "read_failures": r.get("failed", 0),
            "copies_meanwhile": d.copies_meanwhile,  # issued while the host waited for a fetch (meanwhile)
            "reads_on_demand": d.range_reads,  # routed experts' rows read from the files when routed to
            "bytes_read_on_demand": d.range_bytes_read,  # (in bytes_read too)
        }

    def stats(self) -> dict:
        """The stages' own sections of the group's stats(): compress, disk, split fetch."""
        out = {"compress": self.codec.stats() if self.codec is not None else None,
               "disk": self.disk_stats(),
               "experts": self.experts.stats() if self.experts is not None else None}
        if self.split is not None:
            out.update(self.split.stats())
        return out

    def pinned(self) -> tuple[bool, str | None]:
        """(every host block of the stages pinned, the first pin error)."""
        if self.codec is None:
            return True, None
        st = self.codec.stats()
        return st["pinned"], st["pin_error"]

    # ------------------------------------------------------------ the way out
    def close(self, attempt) -> None:
        """Close the stages and files: `attempt(what, fn, *args)` runs each, logging a failure."""
        if self.codec is not None:
            attempt("closing the codec stage", self.codec.close)
        if self.experts is not None:
            attempt("closing the experts stage", self.experts.close)
        reader = self.disk.reader if self.disk is not None else None
        for f in self.files:
            attempt(f"closing {getattr(f, 'path', 'a file')}", f.close, reader)
        self.files = []
        if self.disk is not None:
            attempt("closing the disk stage", self.disk.close)
            self.disk = None
        if self.split is not None:  # (also where no share was kept yet: a configure that failed early)
            attempt("releasing the split-fetch shares", self.split.release)
        self._disk_of = {}
        self._upcoming, self._meanwhile = [], []


@contextlib.contextmanager
def attached(managers, options, values=None):
    """The stages a group joins before it is packed, for every front door: split
    fetch (stages.split.attach: one collective validates every group of every rank,
    the streamed layers' values too, `values` as in split.layer_values; then each
    manager keeps only this rank's shares, so that the host budget counts them).
    The block is the rest of the front door: if it fails, what they hold is released
    (a manager that never streams keeps nothing of the split group)."""
    if options.split_fetch is None:
        yield
        return
    from layerwise.stages import split

    split.attach(managers, options.split_fetch, options.device, values=values)
    try:
        yield
    except BaseException:
        for m in managers:
            m.tiers.release()
        raise
