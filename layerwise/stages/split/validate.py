"""The configure-time check of a split-fetch group: every rank planned the same
layers, the same bytes and the same weights (CRC per layer), or every rank refuses."""
from __future__ import annotations

import hashlib
import zlib

import torch

from layerwise.stages.split import collectives, source


# ------------------------------------------------------------ configure time
def _digest(value) -> int:
    h = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


_FIELDS = ("layer groups", "layers per group", "bytes per layer", "dtypes per layer", "resident layers",
           "prefetch_depth", "split layers", "device type", "world size", "streamed layers' values")
_VALUES = len(_FIELDS) - 1


def layer_crc(lp):
    """CRC-32 of a layer's parameters' bytes (each storage span, in plan order: the
    bytes its block packs), or None where a parameter has no values yet (meta).
    zlib.crc32 runs at 4.9 GB/s on one core of the 2-core CPU VM (blake2b: 1.3;
    BENCHMARKS.md, "Split suite"): about 0.2 s per GB streamed."""
    crc = 0
    for e in lp.params:
        data = e.source()
        if data.is_meta:
            return None
        flat = torch.as_strided(data, (e.span,), (1,), data.storage_offset()).view(torch.uint8)
        crc = zlib.crc32(flat.cpu().numpy(), crc)
    return crc


def layer_values(managers, values=None) -> list:
    """Per split layer (in manager, layer order): a digest of its values that must be
    the same on every rank. `values(manager, lp)` gives it where the parameters have
    no values yet (load_offloaded: layerwise.loading says what it compares); None
    (not compared) where neither can."""
    out = []
    for m in managers:
        for i in sorted(source.split_layers(m)):
            lp = m.plan.layers[i]
            crc = layer_crc(lp)
            if crc is None and values is not None:
                crc = values(m, lp)
            out.append(-1 if crc is None else int(crc))
    return out


def describe(managers, world: int, device: torch.device, crcs=()) -> list:
    """What must match on every rank, field by field (see _FIELDS)."""
    return [
        [m.layer_name for m in managers],
        [m.num_layers for m in managers],
        [[lp.nbytes for lp in m.plan.layers] for m in managers],
        [[(str(e.dtype), e.shape, e.stride, e.offset) for e in lp.params] for m in managers for lp in m.plan.layers],
        [list(m.resident) for m in managers],
        [m.prefetch_depth for m in managers],
        [sorted(source.split_layers(m)) for m in managers],
        device.type,
        world,
        list(crcs),
    ]


def _summary(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _all_gather_rows(group: collectives.SplitGroup, row: list, what: str) -> list:
    dev = group.device if group.device.type == "cuda" else torch.device("cpu")
    mine = torch.tensor(row, dtype=torch.int64).to(dev)
    out = torch.empty(group.world * mine.numel(), dtype=torch.int64, device=dev)
    group.wait(collectives.gather(out, mine, group.pg, async_op=True), what)
    return out.view(group.world, -1).cpu().tolist()


def validate(group: collectives.SplitGroup, managers, values=None) -> None:
    """ONE all-gather of every rank's configuration digests (the streamed layers'
    values among them: a CRC per split layer); raises the same error on every rank
    (naming the fields that differ) if they disagree, and a timeout error if a rank
    does not take part. Where only the values differ, a second all-gather of the
    per-layer CRCs (the same length on every rank then) names the first layer."""
    crcs = layer_values(managers, values)
    desc = describe(managers, group.world, group.device, crcs)
    # Per field its digest, then two readable figures: layers and managed bytes.
    row = [_digest(v) for v in desc]
    total = [sum(m.num_layers for m in managers), sum(m.plan.managed_bytes for m in managers)]
    rows = _all_gather_rows(group, row + total, "the configuration check at configure time (one all-gather)")
    bad = [k for k in range(len(_FIELDS)) if len({r[k] for r in rows}) > 1]
    if not bad:
        return
    if bad == [_VALUES]:
        _refuse_values(group, managers, crcs)
    ranks_like_me = [r for r, row_r in enumerate(rows) if row_r == rows[group.rank]]
    parts = []
    for k in bad:
        groups = {}
        for r, row_r in enumerate(rows):
            groups.setdefault(row_r[k], []).append(r)
        parts.append(f"{_FIELDS[k]} (ranks grouped by value: {sorted(groups.values())}; here on rank "
                     f"{group.rank}: {_summary(desc[k])})")
    raise collectives.SplitError(
        "layerwise split fetch: the ranks of the split_fetch group configure different models or settings, "
        f"so they cannot share the layers' bytes: {'; '.join(parts)}. Per rank (layers, managed bytes): "
        f"{[(r[-2], r[-1]) for r in rows]}. Every rank must configure the same model the same way (same "
        "layer_names, prefetch_depth, resident_layers, dtypes). Rank(s) with this rank's configuration: "
        f"{ranks_like_me}. Nothing was changed."
    )


def _refuse_values(group: collectives.SplitGroup, managers, crcs: list) -> None:
    """Every rank configures the same layers, with different values (built with other
    seeds, another checkpoint): name the first layer whose values differ."""
    rows = _all_gather_rows(group, crcs, "the comparison of the streamed layers' values at configure time")
    names = [f"{m.layer_name}[{i}]" for m in managers for i in sorted(source.split_layers(m))]
    k = next(k for k in range(len(crcs)) if len({r[k] for r in rows}) > 1)
    groups = {}
    for r, row_r in enumerate(rows):
        groups.setdefault(row_r[k], []).append(r)
    others = sum(1 for j in range(len(crcs)) if len({r[j] for r in rows}) > 1) - 1
    raise collectives.SplitError(
        f"layerwise split fetch: the ranks of the split_fetch group hold different weights in layer {names[k]} "
        f"(the first of {others + 1} streamed layer(s) whose bytes differ; ranks grouped by its CRC-32: "
        f"{sorted(groups.values())}). With split_fetch every rank computes with a layer stitched from every "
        "rank's share, so every rank must hold the same weights: build the model with the same seed, or load "
        "the same checkpoint on every rank. Nothing was changed.")


def attach(managers, pg, device: torch.device, timeout_s: float | None = None, values=None) -> collectives.SplitGroup:
    """Validate (one collective) and make every manager keep only this rank's
    share of its split layers (set before packing). Raises, with nothing changed,
    for DTensor weights, a backend that does not fit the device, or ranks that
    disagree (in settings, or in the streamed layers' values: `values` as in
    layer_values)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("split_fetch: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (or pass split_fetch=None)")
    for m in managers:
        for lp in m.plan.layers:
            for e in lp.params:
                if e.dspec is not None:
                    raise ValueError(
                        f"split_fetch: {e.qualname} is a DTensor (tensor-parallel weights): each rank holds its "
                        "own shard already, there is no replicated layer to split. Pass split_fetch=None; split "
                        "fetch is for ranks that hold the same full weights (sequence / context parallel).")
    group = collectives.SplitGroup(pg, device, timeout_s)
    want = {"cpu": "gloo", "cuda": "nccl"}[device.type]
    if want not in group.backend:  # "gloo", "nccl", or a device map such as "cpu:gloo,cuda:nccl"
        raise ValueError(f"split_fetch: streaming to {device} needs a {want} process group, got a "
                         f"{group.backend} one (create it with dist.new_group(backend={want!r}))")
    validate(group, managers, values)
    group.make_private_groups()
    for m in managers:
        if not m.enabled:
            continue
        # its tier plan splits the streamed layers (layerwise.planning.routes)
        m.tiers.use_split(source.ShareStore(m, group))
    return group
