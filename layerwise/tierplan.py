"""The tier plan: for each layer of a group, where its true bytes live and what
happens to them on the way to its slot, decided once, before packing, from
the options and the budgets (DESIGN.md, "Tiers and stages"). The manager
packs by it (stages/chain.py builds each layer's source from its route), the
host and pin budgets count each layer at the size its route gives it, and
report() shows it.

A route (`Route`) says, per layer:

where     "device" (resident; its arena block stays), "arena" (host memory), "spill" (this process's
          spill file) or "checkpoint" (the checkpoint file, read-only)
encoded   compress="lossless" and the layer has a bf16/fp16 segment: its payload
          is encoded (stages/decode.py; at pack time a layer whose encoding saves
          too little travels raw). A layer in the checkpoint travels raw (the
          file holds it as it is)
split     split_fetch: (share, lo, hi), the bytes of the layer this rank keeps
          and copies; the others come from the other ranks (stages/gather.py)

and the host bytes it takes: 0 on disk, else its payload page-rounded. An
encoded layer counts at its **exact** encoded size: the codec's choice per
segment (code width, stored or coded) depends only on the histogram of the
segment's symbols (exponents), which is computed here from the parameters'
bytes without encoding (a share of one: in proportion).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import codec as _codec
from .plan import BLOCK_ALIGN, round_up

_ALIGN = 16  # every codec stream starts at a multiple of 16 bytes
_MAX_WIDTH = {torch.bfloat16: 5, torch.float16: 4}
_EXTRA_BITS = {torch.bfloat16: 0, torch.float16: 3}
_SYMBOL = {torch.bfloat16: (7, 0xFF, 256), torch.float16: (10, 0x1F, 32)}  # shift, mask, symbols
_CHUNK = 1 << 22  # values per histogram step (bounds the temporaries)


def _a16(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _coded_total(n_values: int, field_bits: int, n_exc: int) -> int:
    """csrc/codec.cpp coded_layout(...).total."""
    blocks = -(-n_values // _codec.BLOCK_VALUES)
    off_fields = _a16(_codec.HEADER_BYTES + 4 * (blocks + 1))
    off_raw = _a16(off_fields + -(-n_values * field_bits // 8))
    off_exc = _a16(off_raw + n_values)
    return _a16(off_exc + n_exc)


def segment_encoded_bytes(hist: torch.Tensor, n_bytes: int, dtype: torch.dtype) -> int:
    """Bytes codec.encode gives a segment of `n_bytes` of `dtype` whose symbol
    histogram is `hist` (csrc/codec.cpp plan_encode, mirrored)."""
    stored = _a16(_codec.HEADER_BYTES + n_bytes)
    n_values = n_bytes // 2
    if dtype not in _MAX_WIDTH or n_values == 0 or n_values >= 1 << 32:
        return stored
    counts = sorted((int(c) for c in hist.tolist() if c), reverse=True)
    best = None
    for w in range(1, _MAX_WIDTH[dtype] + 1):
        covered = sum(counts[: (1 << w) - 1])
        total = _coded_total(n_values, w + _EXTRA_BITS[dtype], n_values - covered)
        best = total if best is None or total < best else best
    return stored if best * 100 > n_bytes * 97 else best


def _flat(e, lo: int = 0, hi: int | None = None) -> torch.Tensor | None:
    """Elements [lo, hi) of entry e's storage span, as int16 (None: no data yet)."""
    data = e.source()
    if data.is_meta:
        return None
    flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset())
    return flat[lo: e.span if hi is None else hi]


def _histogram(flats, dtype: torch.dtype, seg_bytes: int) -> torch.Tensor | None:
    """Symbol histogram of one packed segment: the values in `flats` (tensors of
    `dtype`), and zeros for the alignment gaps. None: one has no data (meta)."""
    shift, mask, n_sym = _SYMBOL[dtype]
    hist = torch.zeros(n_sym, dtype=torch.int64)
    values = 0
    for flat in flats:
        if flat is None or flat.dtype != dtype:
            return None
        flat = flat.view(torch.int16)
        for k in range(0, flat.numel(), _CHUNK):
            sym = (flat[k : k + _CHUNK] >> shift) & mask
            hist += torch.bincount(sym.reshape(-1).to("cpu"), minlength=n_sym)
        values += flat.numel()
    hist[0] += seg_bytes // 2 - values  # the gaps are zero bytes: symbol 0
    return hist


def _segment_bytes(flats, dtype, n: int) -> int | None:
    if dtype not in _MAX_WIDTH:
        return _a16(_a16(_codec.HEADER_BYTES + n))
    hist = _histogram(flats, dtype, n)
    return None if hist is None else _a16(segment_encoded_bytes(hist, n, dtype))


def encoded_layer_bytes(lp, experts=None) -> int | None:
    """The exact byte count stages/decode.encode_segments gives layer `lp` (its
    segments one after the other, 16-byte aligned); None where its parameters
    hold no data yet. `experts` (layerwise/experts.ExpertPlan): the layer's
    expert rows are segments of their own, one per expert (ExpertPlan.segments)."""
    mods = experts.layers.get(lp.index, ()) if experts is not None else ()
    tail = {id(e) for m in mods for e in m.entries}
    total = 0
    for dtype, (_, n) in sorted(lp.segments.items(), key=lambda kv: kv[1][0]):
        got = _segment_bytes([_flat(e) for e in lp.params if e.dtype == dtype and id(e) not in tail], dtype, n)
        if got is None:
            return None
        total += got
    for m in mods:
        for px in m.parts:
            for e, lo, hi in px:
                got = _segment_bytes([_flat(e, lo, hi)], e.dtype, (hi - lo) * e.dtype.itemsize)
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
    from .stages.decode import MIN_SAVING

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
    budget keeps in files (layerwise.hostplan, loading). Fixed once packed."""

    def __init__(self, group: str):
        self.group = group
        self.split_store = None  # this rank's ShareStore, or None
        self.disk_layers: frozenset = frozenset()
        self.disk_where = "spill"  # "spill" or "checkpoint"
        self.make_store = None  # make_store(files) -> the file store (stages/chain.py) of the disk layers
        self.experts = None  # the group's routed experts (layerwise/experts.ExpertPlan), or None
        self.fixed = False

    def _check(self) -> None:
        if self.fixed:
            raise RuntimeError(f"{self.group}: the tier plan is fixed once packed")

    def use_split(self, store) -> None:
        """Split fetch: `store` keeps this rank's shares of the streamed layers."""
        self._check()
        self.split_store = store

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
