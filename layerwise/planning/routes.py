"""The tier plan: for each layer of a group, where its true bytes live and what
happens to them on the way to its slot, decided once, before packing, from
the options and the budgets (docs/design.md, "Tiers and stages"). The manager
packs by it (stages/chain.py builds each layer's source from its route), the
host and pin budgets count each layer at the size its route gives it, and
report() shows it.

A route (`Route`) says, per layer:

where     "device" (resident; its arena block stays), "arena" (host memory), "spill" (this process's
          spill file) or "checkpoint" (the checkpoint file, read-only)
encoded   compress="lossless" and the layer has a segment of a coded dtype (bf16, fp16,
          fp32, fp8): its payload
          is encoded (stages/decode.py; at pack time a layer whose encoding saves
          too little travels raw). A layer in the checkpoint travels raw (the
          file holds it as it is)
split     split_fetch: (share, lo, hi), the bytes of the layer this rank keeps
          and copies; the others come from the other ranks (stages/split/)

and the host bytes it takes: 0 on disk, else its payload page-rounded. An
encoded layer counts at its **exact** encoded size: the codec's choices (per
chunk: which fields are coded, their code lengths; per segment: stored or
coded) depend only on the chunks' histograms, so ``codec.encoded_size`` gives
the size without writing the encoding; it runs here on each segment packed
into a scratch buffer from the parameters' bytes, one segment at a time (a
share of a layer: in proportion).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from layerwise import codec as _codec
from layerwise.planning.layout import BLOCK_ALIGN, round_up

_ALIGN = 16  # every codec stream starts at a multiple of 16 bytes


def _a16(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _packed_segment(entries, dtype: torch.dtype, seg_off: int, seg_bytes: int) -> torch.Tensor | None:
    """The segment's bytes as packing lays them out (parameters at their offsets, zero
    gaps), in a scratch buffer. None: a parameter has no data yet (meta)."""
    out = torch.zeros(seg_bytes, dtype=torch.uint8)
    for e in entries:
        data = e.source()
        if data.is_meta or data.dtype != dtype:
            return None
        flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset()).reshape(-1).view(torch.uint8)
        at = e.offset - seg_off
        out[at : at + e.span_bytes].copy_(flat.to("cpu"))
    return out


def _expert_piece(e, lo: int, hi: int) -> torch.Tensor | None:
    """Elements [lo, hi) of entry e's storage span (one expert's rows), as host bytes."""
    data = e.source()
    if data.is_meta:
        return None
    flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())[lo:hi]
    return flat.contiguous().view(torch.uint8).to("cpu")


def _segment_bytes(seg, dtype, n: int) -> int | None:
    """Bytes codec.encode gives segment `seg` (host bytes, None: no data yet) of `n` bytes."""
    if dtype not in _codec.CODED_DTYPES:
        return _a16(_a16(_codec.HEADER_BYTES + n))
    return None if seg is None else _a16(_codec.encoded_size(seg, dtype=dtype))


def encoded_layer_bytes(lp, experts=None) -> int | None:
    """The exact byte count stages/decode.encode_segments gives layer `lp` (its
    segments one after the other, 16-byte aligned); None where its parameters
    hold no data yet. `experts` (layerwise/experts.ExpertPlan): the layer's
    expert rows are segments of their own, one per expert (ExpertPlan.segments)."""
    mods = experts.layers.get(lp.index, ()) if experts is not None else ()
    tail = {id(e) for m in mods for e in m.entries}
    total = 0
    for dtype, (off, n) in sorted(lp.segments.items(), key=lambda kv: kv[1][0]):
        seg = None
        if dtype in _codec.CODED_DTYPES:
            seg = _packed_segment([e for e in lp.params if e.dtype == dtype and id(e) not in tail], dtype, off, n)
            if seg is None:
                return None
        got = _segment_bytes(seg, dtype, n)
        if got is None:  # (never: a coded segment's data was read above)
            return None
        total += got
    for m in mods:
        for px in m.parts:
            for e, lo, hi in px:
                n = (hi - lo) * e.dtype.itemsize
                got = _segment_bytes(_expert_piece(e, lo, hi) if e.dtype in _codec.CODED_DTYPES else None,
                                     e.dtype, n)
                if got is None:
                    return None
                total += got
    return total


@dataclass(frozen=True)
class Route:
    index: int
    where: str  # "device", "arena", "spill" or "checkpoint"
    encoded: bool
    split: tuple | None  # (share, lo, hi) or None
    raw_bytes: int
    host_bytes: int

    @property
    def plain(self) -> bool:
        """Packed into the group's arena as it is, copied to its slot as it is."""
        return self.where == "arena" and not self.encoded and self.split is None

    def describe(self) -> str:
        parts = [self.where]
        if self.encoded:
            parts.append("encoded")
        if self.split is not None:
            parts.append(f"share [{self.split[1]}, {self.split[2]})")
        return ", ".join(parts)


def plan_routes(plan, resident, compress, spans=None, disk_layers=frozenset(), disk_where: str = "spill",
                sizes: bool = True, experts=None) -> list[Route]:
    """Every layer's route (module doc). `spans`: {layer: (share, lo, hi)} of split
    fetch; `disk_layers` kept in files (`disk_where`: "spill" or "checkpoint").
    `sizes`: compute encoded sizes (histograms of the weights; else raw).
    `experts`: the group's routed experts (their rows are encoded per expert)."""
    from layerwise.stages.decode import MIN_SAVING

    resident = set(resident)
    spans = spans or {}
    out = []
    for lp in plan.layers:
        i = lp.index
        if i in resident:
            out.append(Route(i, "device", False, None, lp.nbytes, round_up(lp.nbytes, BLOCK_ALIGN)))
            continue
        where = disk_where if i in disk_layers else "arena"
        split = spans.get(i)
        encoded = (compress == "lossless" and where != "checkpoint"
                   and any(e.dtype in _codec.CODED_DTYPES for e in lp.params))
        payload = lp.nbytes if split is None else split[2] - split[1]
        host = 0
        if where == "arena":
            size = payload
            if encoded and sizes:
                enc = encoded_layer_bytes(lp, experts)
                if enc is not None and enc <= MIN_SAVING * lp.nbytes:
                    size = -(-enc * payload // max(lp.nbytes, 1))
            host = round_up(max(size, 1), BLOCK_ALIGN) if payload else 0
        out.append(Route(i, where, encoded, split, lp.nbytes, host))
    return out


def layer_host_bytes(manager) -> dict[int, int]:
    """{layer index: host bytes it will take} for the manager's tier plan, each
    page-rounded (a resident layer's arena block stays: its truth while it is resident)."""
    return {r.index: r.host_bytes for r in manager.tier_plan()}


def planned_host_bytes(manager) -> int:
    """Host bytes of the group's layers at the size their tiers keep them."""
    return sum(layer_host_bytes(manager).values()) if manager.enabled else 0


class TierChoice:
    """A group's inputs to its tier plan, set by the planners before packing:
    split fetch's share store (stages/gather.attach) and the layers the host
    budget keeps in files (layerwise.planning.host_budget, loading). Fixed once packed."""

    def __init__(self, group: str):
        self.group = group
        self.split_store = None  # this rank's ShareStore, or None
        self.disk_layers: frozenset = frozenset()
        self.disk_where = "spill"  # "spill" or "checkpoint"
        self.make_store = None  # make_store(files) -> the file store (stages/chain.py) of the disk layers
        self.experts = None  # the group's routed experts (layerwise/experts.ExpertPlan), or None
        self.host_budget = None  # the host budget in force (layerwise.planning.host_budget.HostBudget), or None
        self.fixed = False

    def _check(self) -> None:
        if self.fixed:
            raise RuntimeError(f"{self.group}: the tier plan is fixed once packed")

    def use_split(self, store) -> None:
        """Split fetch: `store` keeps this rank's shares of the streamed layers."""
        self._check()
        self.split_store = store

    def use_host_budget(self, budget) -> None:
        """`budget` (layerwise.planning.host_budget.HostBudget) is the host budget in force
        for this group (and the others it covers)."""
        self.host_budget = budget

    def release(self) -> None:
        """A front door failed: let go of what the planners attached (idempotent)."""
        if self.split_store is not None:
            self.split_store.release()

    def keep_on_disk(self, layers, where: str = "spill", make_store=None) -> None:
        """`layers` stay in files (`where`); `make_store(files)` gives the file store
        that keeps them, the files it opens appended to `files`."""
        self._check()
        self.disk_layers, self.disk_where, self.make_store = frozenset(layers), where, make_store

    def routes(self, plan, resident, compress, sizes: bool = True) -> list[Route]:
        store = self.split_store
        return plan_routes(plan, resident, compress, store.spans if store is not None else None,
                           self.disk_layers, self.disk_where, sizes, self.experts)
