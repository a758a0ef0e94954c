"""experts: the routed-experts stage (docs/design.md, "Routed experts"; the plan
and the hooks: layerwise/planning/experts.py).

A layer of a group with routed experts is laid out with its expert
parameters last (plan.LayerPlan.layout(tail=...)). Its source is an
``ExpertSource`` around the layer's ``ArenaSource``: the layer's ordinary
fetch (the manager's) copies only the prefix before the experts, so that
fetch is "a second kind of fetch" without a branch in the manager. The rows
of the experts a forward needs are made ready by ``ExpertTier.make_ready``
(from the expert module's pre-hook): taken from the device expert cache
(a device-to-device copy into the slot) or copied over the bus from the
arena, one copy per contiguous range of each expert parameter.

The inner source copies ranges of the layer (`copy_range`, `range_bytes`):
a host block (ArenaSource), an encoded one (stages/decode.CodecSource: each
expert's rows are codec segments of their own, so a range is copied encoded
and decoded into the slot), or a file (stages/disk.DiskSource: the tier reads
ahead the prefix only, `stream_only`; a range is read from the file on demand,
DiskTier.read_range).

What each slot holds is recorded per slot: the layer and the fetch
generation (ring.gen) and version of its true bytes it was stamped with, and
the experts whose rows are in place. A new fetch into the slot (another
layer, or this one reloaded) changes the stamp, so nothing stale is ever
taken for present. Every fetch into a slot of such a group waits for the
expert copies still in flight into it (``before_fetch``): every layer of the
group gets an ExpertSource (one without experts copies all of itself).

The expert cache (``ExpertCache``): fixed-size device entries, one expert
(its rows of every expert parameter) each, least recently used out first,
keyed by (layer, module, expert) and the version of the layer's true bytes
(a load_state_dict, or a write through a state_dict() tensor, makes its
entries stale). A miss is inserted once it has arrived; a hit costs a copy on
the device and no bus bytes. Its size is fixed when the group starts
(``cache_size``): at most one entry per expert of the layers streamed then,
since more could never be used (a bigger ask is capped, and stats() says so);
set_residency and layerwise.tune share its entries out again, never resize it,
so the device budget's planner and tune count it as a constant.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import torch

from layerwise._native import current_stream_handle
from layerwise.options import auto_expert_cache_bytes
from layerwise.stages.result import is_deferred
from layerwise.stages.source import Source

log = logging.getLogger("layerwise")

ENTRY_ALIGN = 256


class ExpertSource(Source):
    """A layer of a group with routed experts (module doc): the layer's source
    `inner` (an ArenaSource), whose fetch copies only bytes [0, base)."""

    def __init__(self, inner, base: int, tier: "ExpertTier"):
        self.inner, self.base, self.tier = inner, base, tier
        # A layer in a file (stages/disk.DiskSource, or one encoded in it): its tier reads
        # and copies the prefix only (read ahead, as any disk layer); the experts' rows are
        # read on demand.
        self.tiered = inner.fetches_window
        if self.tiered:
            inner.stream_only(base)

    kind = property(lambda self: self.inner.kind)
    nbytes = property(lambda self: self.inner.nbytes)
    stored_bytes = property(lambda self: self.inner.stored_bytes)
    slot_bytes = property(lambda self: self.inner.slot_bytes)
    writable = property(lambda self: self.inner.writable)
    host = property(lambda self: self.inner.host)

    @property
    def transfer_bytes(self) -> int:
        # the prefix as it travels (encoded: its pieces); the experts' rows are counted as
        # they are copied (layerwise/planning/experts.py)
        return self.inner.range_bytes(0, self.base)

    def version(self) -> int:
        return self.inner.version()

    def host_written(self) -> None:
        self.inner.host_written()

    def read(self) -> torch.Tensor:
        return self.inner.read()

    def write(self, block: torch.Tensor, undo: bool = False):
        return self.inner.write(block, undo)

    def fetch(self, i: int, dst: torch.Tensor, after, timing: bool):
        after = self.tier.before_fetch(dst, after)
        if self.tiered:
            return self.inner.fetch_window(i, dst, after, timing)
        return self.inner.copy_range(dst, 0, self.base, after, timing)

    def copy_range(self, dst, lo: int, hi: int, after, timing: bool = False):
        return self.inner.copy_range(dst, lo, hi, after, timing)

    def range_bytes(self, lo: int, hi: int) -> int:
        return self.inner.range_bytes(lo, hi)

    def refuse_write(self) -> None:
        self.inner.refuse_write()

    def close(self) -> None:
        self.inner.close()

    def holders(self):
        yield from self.inner.holders()


@dataclass
class Need:
    """What one expert module's call needs (ExpertTier.make_ready)."""

    layer: int
    module: int
    events: list = field(default_factory=list)  # what the compute waits on
    bytes: int = 0  # copied over the bus for it
    copies: int = 0
    inserts: list = field(default_factory=list)  # experts to put in the cache once arrived


class _SlotRows:
    """What one ring slot holds of its layer's experts."""

    __slots__ = ("stamp", "units", "pending")

    def __init__(self):
        self.stamp = None  # (layer, ring generation, version of its true bytes)
        self.units: dict = {}  # (module, expert) -> (event or None, speculative)
        self.pending: list = []  # expert copies into the slot that may be in flight


class ExpertCache:
    """Device entries of one expert each, shared out evenly among the MoE layers
    streamed, least recently used out first within a layer. (One LRU over all
    layers would evict every entry before its next use: a step visits the layers
    in a cycle, and a cycle longer than the cache defeats LRU.)"""

    def __init__(self, capacity: int, entry_bytes: int, device: torch.device, layers, experts: dict):
        self.entry_bytes = entry_bytes
        self.entries = capacity // entry_bytes
        self.pool = torch.empty(self.entries * entry_bytes, dtype=torch.uint8, device=device)
        self.experts = experts  # {layer: its experts}: the most entries a layer can use
        self.layers = sorted(layers)
        self.clear()

    @property
    def nbytes(self) -> int:
        return self.pool.numel()

    def shares(self) -> dict:
        """{layer: entries}: the entries shared out evenly among the layers, none given
        a layer beyond one per expert it has (what one layer cannot use goes to the
        others); an uneven remainder goes to the first layers."""
        got = {i: 0 for i in self.layers}
        left = self.entries
        open_ = [i for i in self.layers if self.experts.get(i, 0) > 0]
        while left > 0 and open_:
            q = left // len(open_)
            if q == 0:
                for i in open_[:left]:
                    got[i] += 1
                break
            for i in open_:
                add = min(q, self.experts[i] - got[i])
                got[i] += add
                left -= add
            open_ = [i for i in open_ if got[i] < self.experts[i]]
        return got

    def clear(self) -> None:
        self.lru: dict = {i: collections.OrderedDict() for i in self.layers}  # key -> (entry, version)
        self.free: dict = {}
        j = 0
        for i, m in self.shares().items():
            self.free[i] = list(range(j + m - 1, j - 1, -1))
            j += m

    def __len__(self) -> int:
        return sum(len(d) for d in self.lru.values())

    def get(self, key, version) -> int | None:
        lru = self.lru.get(key[0])
        got = lru.get(key) if lru is not None else None
        if got is None:
            return None
        j, v = got
        if v != version:  # the layer's true bytes changed since
            del lru[key]
            self.free[key[0]].append(j)
            return None
        lru.move_to_end(key)
        return j

    def has(self, key, version) -> bool:
        lru = self.lru.get(key[0])
        got = lru.get(key) if lru is not None else None
        return got is not None and got[1] == version

    def put(self, key, version) -> int | None:
        """The entry that holds `key` from now on (None: its layer has no entries)."""
        lru, free = self.lru.get(key[0]), self.free.get(key[0])
        if lru is None:
            return None
        if key in lru:
            j = lru.pop(key)[0]
        elif free:
            j = free.pop()
        elif lru:
            j = lru.popitem(last=False)[1][0]
        else:
            return None
        lru[key] = (j, version)
        return j

    def view(self, j: int) -> torch.Tensor:
        return self.pool[j * self.entry_bytes: (j + 1) * self.entry_bytes]


def entry_bytes(plan) -> int:
    """One cache entry: the rows of the largest expert, in whole ENTRY_ALIGN units."""
    return max(-(-m.unit_bytes // ENTRY_ALIGN) * ENTRY_ALIGN for m in plan.modules())


def layer_experts(plan) -> dict:
    """{layer: the experts of its expert modules}: the most cache entries it can use."""
    return {i: sum(m.num_experts for m in mods) for i, mods in plan.layers.items()}


def cache_size(spec, plan, streamed, device: torch.device, group: str = "",
               room: int | None = None) -> tuple[int, int, int]:
    """(bytes the cache holds, bytes asked, bytes it can ever use) for
    expert_cache=`spec` with the layers `streamed`, each in whole entries.

    Asked: bytes as given; "auto": a quarter of the streamed layers' expert bytes,
    and at most a quarter of `room` (the device budget's planner: what the budget
    leaves after the non-layer weights and the rings; default, on CUDA, the free
    device memory). It can use one entry per expert of the streamed layers: a
    bigger ask is capped, and where no expert streams (or "auto" comes to less
    than one entry) it holds nothing. A size given below one entry, where experts
    stream, is refused (ValueError): it could hold nothing."""
    if spec is None:
        return 0, 0, 0
    entry = entry_bytes(plan)
    per = layer_experts(plan)
    limit = entry * sum(per.get(i, 0) for i in streamed)
    if spec == "auto":
        if room is None and device.type == "cuda":
            room, _ = torch.cuda.mem_get_info(device)
        asked = auto_expert_cache_bytes(plan.expert_bytes(streamed), room) // entry * entry
    else:
        asked = int(spec)
        if limit and asked < entry:
            raise ValueError(f"layerwise: expert_cache={spec!r} holds no expert of group {group!r}: one expert "
                             f"takes {entry} bytes; give at least that, or None")
    return min(asked, limit) // entry * entry, asked, limit


class ExpertTier:
    def __init__(self, group: str, plan, device: torch.device, cache=None):
        self.group, self.plan, self.device, self.cache_spec = group, plan, device, cache
        self.engine = self.ring = self.cache = None
        self.cache_asked = 0  # the bytes expert_cache asked for (cache_size): held, at most what can be used
        self.sources: list = []
        self.rows: list[_SlotRows] = []
        self.alias: list = []
        self.last_used: dict = {}  # (layer, module) -> the experts of its last call
        self.used = self.cache_hits = self.slot_hits = self.misses = 0
        self.demand_bytes = self.spec_bytes = self.spec_used_bytes = 0

    # ------------------------------------------------------------ set up
    def start(self, engine, sources: list, ring) -> None:
        self.engine, self.sources = engine, sources
        self.restream(ring)
        n, self.cache_asked, limit = cache_size(self.cache_spec, self.plan, ring.streamed, self.device, self.group)
        if self.cache_spec is None:
            return
        if n == 0:
            log.info("layerwise: %s: expert_cache=%r holds nothing: %s", self.group, self.cache_spec,
                     "a quarter of the streamed experts is less than one expert" if limit else
                     "no layer with experts streams (every one is resident)")
            return
        if self.cache_asked > limit:
            log.info("layerwise: %s: expert_cache=%r capped at %d bytes, one entry for each expert of the layers "
                     "streamed: more could never be used", self.group, self.cache_spec, n)
        self.cache = ExpertCache(n, entry_bytes(self.plan), self.device,
                                 [i for i in ring.streamed if i in self.plan.layers], layer_experts(self.plan))

    @property
    def cache_bytes(self) -> int:
        """The bytes the expert cache holds (on the group's device)."""
        return self.cache.nbytes if self.cache is not None else 0

    def restream(self, ring) -> None:
        """A new ring (start, or set_residency): nothing is known of its slots."""
        self.ring = ring
        self.rows = [_SlotRows() for _ in ring.slots]
        # Writes into a slot through these aliases leave the slot's version counter alone
        # (the manager reads a change of it as a user's in-place write).
        self.alias = [torch.empty(0, dtype=torch.uint8, device=self.device).set_(t.untyped_storage())
                      for t in ring.slots]
        if self.cache is not None:  # its entries are shared out again among the layers streamed now
            self.cache.layers = sorted(i for i in ring.streamed if i in self.plan.layers)
            self.cache.clear()

    def forget(self) -> None:
        """After an interrupt (the engine is synchronised next): nothing is known."""
        for r in self.rows:
            r.stamp, r.units, r.pending = None, {}, []
        if self.cache is not None:
            self.cache.clear()

    # ------------------------------------------------------------ run time
    def _rows(self, i: int, s: int) -> _SlotRows:
        stamp = (i, self.ring.gen[s], self.sources[i].version())
        r = self.rows[s]
        if r.stamp != stamp:
            r.stamp, r.units = stamp, {}
        return r

    def _after(self, stream):
        """What expert copies into a slot wait for: on CUDA everything enqueued on
        the compute stream (the slot's previous users); on the CPU nothing (the
        compute ran on this thread)."""
        return self.engine.record(stream, False) if self.engine.is_cuda else None

    def _copy(self, i: int, s: int, spans, after, r: _SlotRows):
        """Queue the copies of `spans` of layer i into slot s, chained; the last event."""
        src = self.sources[i]
        ev = after
        for lo, hi in spans:
            ev = src.copy_range(self.ring.slots[s], lo, hi, ev)
            if is_deferred(ev):  # (issued now: the compute waits on it next; the next copy is after it)
                ev = ev.resolve()
        r.pending = [e for e in r.pending if not e.query()] + [ev]
        return ev

    def _bytes(self, i: int, spans) -> int:
        """The bytes copies of `spans` of layer i move over the bus (encoded: less)."""
        src = self.sources[i]
        return sum(src.range_bytes(lo, hi) for lo, hi in spans)

    def _unit(self, xm, x: int):
        """(offset in the block, bytes) of expert x's rows of each expert parameter."""
        return xm.units[x]

    def make_ready(self, i: int, k: int, chosen, stream) -> Need:
        """Expert module k of layer i is about to run with `chosen` experts: queue
        what brings their rows into the layer's slot; the compute waits on
        Need.events, then settle(Need) fills the cache."""
        s = self.ring.slot_of[i]
        r = self._rows(i, s)
        xm = self.plan.layers[i][k]
        version = r.stamp[2]
        need = Need(i, k)
        missing = []
        self.last_used[(i, k)] = chosen
        for x in chosen:
            self.used += 1
            unit = r.units.get((k, x))
            if unit is not None:
                ev, spec = unit
                if ev is not None and not ev.query():
                    need.events.append(ev)
                if spec:
                    self.spec_used_bytes += self._bytes(i, xm.spans([x]))
                    r.units[(k, x)] = (ev, False)
                    need.inserts.append(x)
                self.slot_hits += 1
                continue
            j = self.cache.get((i, k, x), version) if self.cache is not None else None
            if j is not None:
                entry, dst, at = self.cache.view(j), self.alias[s], 0
                for off, n in self._unit(xm, x):
                    dst[off: off + n].copy_(entry[at: at + n])
                    at += n
                r.units[(k, x)] = (None, False)
                self.cache_hits += 1
                continue
            missing.append(x)
        if missing:
            spans = xm.spans(missing)
            ev = self._copy(i, s, spans, self._after(stream), r)
            for x in missing:
                r.units[(k, x)] = (ev, False)
            need.events.append(ev)
            need.bytes = self._bytes(i, spans)
            need.copies = len(spans)
            need.inserts.extend(missing)
            self.misses += len(missing)
            self.demand_bytes += need.bytes
        return need

    def settle(self, need: Need) -> None:
        """After the compute waited for Need.events: the experts that crossed the
        bus for it go into the cache (a copy on the device, ordered after the wait)."""
        if self.cache is None or not need.inserts:
            return
        i, k = need.layer, need.module
        s = self.ring.slot_of[i]
        r = self.rows[s]
        xm = self.plan.layers[i][k]
        src = self.alias[s]
        for x in need.inserts:
            j = self.cache.put((i, k, x), r.stamp[2])
            if j is None:
                continue
            entry, at = self.cache.view(j), 0
            for off, n in self._unit(xm, x):
                entry[at: at + n].copy_(src[off: off + n])
                at += n

    def speculate(self, j: int, stream) -> tuple[int, int]:
        """Copy into layer j's slot the experts it used at its previous call, where
        the slot holds j (its fetch queued) and nothing computes in it; returns
        (bytes, copies). A wrong guess costs its bytes only."""
        ring = self.ring
        s = ring.slot_of[j]
        if s < 0 or ring.busy[s] or ring.holder[s] != j or ring.version[s] != self.sources[j].version():
            return 0, 0
        r = self._rows(j, s)
        version = r.stamp[2]
        total = copies = 0
        after = None
        for k, xm in enumerate(self.plan.layers[j]):
            want = [x for x in self.last_used.get((j, k), ())
                    if (k, x) not in r.units and (self.cache is None or not self.cache.has((j, k, x), version))]
            if not want:
                continue
            if after is None:
                after = self._after(stream)
            spans = xm.spans(want)
            ev = self._copy(j, s, spans, after, r)
            for x in want:
                r.units[(k, x)] = (ev, True)
            total += self._bytes(j, spans)
            copies += len(spans)
        self.spec_bytes += total
        return total, copies

    def before_fetch(self, dst: torch.Tensor, after):
        """A fetch into the slot `dst` lies in waits for the expert copies still in
        flight into it (an unused speculative one, say); returns its `after`."""
        s = self.ring.ptrs.get(dst.untyped_storage().data_ptr()) if self.ring is not None else None
        if s is None:
            return after
        r = self.rows[s]
        pending = [ev for ev in r.pending if not ev.query()]
        r.pending, r.units, r.stamp = [], {}, None
        if not pending:
            return after
        if not self.engine.is_cuda:
            for ev in pending:
                ev.synchronize()
            return after
        stream = current_stream_handle(self.device)
        for ev in pending:
            self.engine.wait(ev, stream)
        return self.engine.record(stream, False)

    def fill(self, i: int) -> None:
        """Every expert of layer i in its slot, waited for on the host (an edit in
        place of the layer: contract.editing writes the whole slot back)."""
        s = self.ring.slot_of[i]
        if s < 0 or i not in self.plan.layers:
            return
        stream = current_stream_handle(self.device)
        for k, xm in enumerate(self.plan.layers[i]):
            need = self.make_ready(i, k, list(range(xm.num_experts)), stream)
            for ev in need.events:
                ev.synchronize()
        if self.engine.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------ figures
    def stats(self) -> dict:
        return {
            "modules": sum(1 for _ in self.plan.modules()),
            "layers": sorted(self.plan.layers),
            "expert_bytes": self.plan.expert_bytes(),  # every expert of every layer
            "experts_used": self.used,  # (layer, module, expert) demanded by forwards
            "hits": self.cache_hits + self.slot_hits,  # served without a demand copy over the bus
            "cache_hits": self.cache_hits,
            "slot_hits": self.slot_hits,  # rows in the slot already (this call's prefetch, or not overwritten)
            "misses": self.misses,  # copied over the bus on demand
            "demand_bytes": self.demand_bytes,
            "speculative_bytes": self.spec_bytes,
            "speculative_used_bytes": self.spec_used_bytes,
            "speculative_wasted_bytes": self.spec_bytes - self.spec_used_bytes,
            "cache_bytes": self.cache.nbytes if self.cache is not None else 0,
            "cache_asked_bytes": self.cache_asked,  # what expert_cache asked ("auto": a quarter of the experts)
            "cache_entries": self.cache.entries if self.cache is not None else 0,
            "cached": len(self.cache) if self.cache is not None else 0,
        }

    def close(self) -> None:
        self.cache = None
        self.rows, self.alias, self.sources, self.ring = [], [], [], None
