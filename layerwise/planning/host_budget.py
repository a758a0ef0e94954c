"""Host-memory planner: which streamed layers stay in the host arena and which
stay on disk (the disk tier, stages/disk/) so that host memory fits
`host_budget`.

What counts against the budget: the arenas of the layers kept in memory, the
disk tier's staging slots (and, for routed experts, the staging of the
on-demand reads of experts' rows), the scratch block a layer is packed through, the
page cache a checkpoint's reads may hold while packing (load_offloaded drops it
as it goes: `cache_bytes`), and on a CPU device (where the "device" is host
memory) the non-layer weights, the slot rings and the resident layers. The
promise is about the process's memory as measured (layerwise.planning.host_limits.
budget_memory_bytes: anonymous + shared-memory pages + the resident pages of
the checkpoint and spill files), not about the sum of what layerwise allocates. The layers kept in memory are spread
evenly over each group (every k-th layer, by bytes), so that the reads of the
disk layers are spread over the step and overlap the compute of the others.
Resident layers never go to disk.

`host_budget="auto"`: the tightest of the cgroup limit and the host's available
memory, less a reserve (layerwise.planning.host_limits), with the weights about to be packed
counted as free.

After configure the budget stays in force (`HostBudget`, shared by the groups it
was planned for): wherever the bytes held change, the change is checked first and
refused, naming the budget, before anything changes - a write that makes an
encoded layer larger (stages/decode.CodecSource.write), and on a CPU device
set_residency and layerwise.tune (rings and resident layers are host memory there).
"""
from __future__ import annotations

import functools
import logging

from layerwise.planning.device_budget import fmt_bytes, non_layer_bytes
from layerwise.planning.layout import round_up
from layerwise.stages.disk import DiskTier, spill_store

log = logging.getLogger("layerwise")

PAGE = 4096
CODEC_SEGMENT_EXTRA = 128 + 16  # a codec header and a 16-byte alignment (layerwise/codec/__init__.py)


class HostBudget:
    """The host budget in force once configured: the groups it covers (a model's,
    or every streamed component's of a pipeline), what they hold now, and the
    check each change of that makes (module doc)."""

    def __init__(self, budget: int, source: str, managers):
        self.bytes = int(budget)  # what host_budget resolved to
        self.source = source  # "given" or "auto"
        self.managers = list(managers)

    def held(self) -> int:
        """Host bytes the groups hold now, as layerwise.report counts them: their arenas
        (and the blocks their stages keep), the disk tier's staging and, on a CPU
        device, their models' non-layer weights, rings, resident layers and expert caches."""
        models: dict = {}
        total = 0
        for m in self.managers:
            if m.ring is None:  # (not streaming: removed, or never configured)
                continue
            total += m.host_bytes()
            if m.device.type == "cpu":
                models.setdefault(id(m.model), (m.model, []))[1].append(m)
        return total + sum(non_layer_bytes(model, ms) for model, ms in models.values())

    def summary(self) -> dict:
        """What layerwise.report shows of it: {"bytes", "source", "groups": the names of
        the groups it covers}."""
        return {"bytes": self.bytes, "source": self.source, "groups": [m.layer_name for m in self.managers]}

    def room(self) -> int:
        """Bytes the groups may still take on top of what they hold (0 where none)."""
        return max(0, self.bytes - self.held())

    def check(self, extra: int, what: str, fix: str) -> None:
        """Refuse (RuntimeError) `what`, which would hold `extra` more host bytes, where
        that goes over the budget; `fix`: what to do instead."""
        if extra <= 0:
            return
        held = self.held()
        if held + extra > self.bytes:
            raise RuntimeError(
                f"layerwise: {what} would take {fmt_bytes(extra)} more host memory, {fmt_bytes(held + extra)} in "
                f"all ({held + extra} bytes) against host_budget {fmt_bytes(self.bytes)} ({self.bytes} bytes, "
                f"{self.source}); {fmt_bytes(held)} is held now. {fix}. Nothing was changed.")


def resolve_host_budget(host_budget, held_bytes: int = 0) -> tuple[int, str]:
    """(bytes, how it was found) for a host_budget OffloadOptions has validated: a
    number of bytes, or "auto" (the tightest of the host's and the cgroup's limits)."""
    if host_budget == "auto":
        from layerwise.planning.host_limits import host_limits

        limits = host_limits(held_bytes, lock=False)
        tight = min(limits, key=lambda lim: lim.budget)
        return tight.budget, f"auto: {tight.describe()}"
    return int(host_budget), "given"


def staging_slot_bytes(manager, layers, spill: bool = True) -> int:
    """A disk layer's staging size: the bytes its route keeps in the file (this rank's
    share under split fetch; raw, the most an encoding keeps) rounded to a page in a
    spill file; from a checkpoint, an upper bound (a page of head and tail per tensor:
    its runs start anywhere in a page)."""
    routes = manager.tier_plan(sizes=False)
    pad = (lambda i: 0) if spill else (lambda i: 2 * PAGE * (len(manager.plan.layers[i].params) + 1))

    def payload(i):
        split = routes[i].split
        # (routed experts: staging holds the prefix, encoded at most a codec header and an
        # alignment more per segment; the experts' rows are read on demand)
        lp = manager.plan.layers[i]
        if split is not None:
            return split[2] - split[1]
        if lp.base_bytes == lp.nbytes:
            return lp.nbytes
        return lp.base_bytes + (CODEC_SEGMENT_EXTRA * len(lp.segments) if routes[i].encoded else 0)

    return max((round_up(payload(i), PAGE) + pad(i) for i in layers), default=0)


def range_staging_bytes(manager, layers, spill: bool = True) -> int:
    """The staging of on-demand reads of a group whose disk `layers` have routed
    experts (stages/disk.DiskTier.read_range), 0 otherwise. In a spill file a
    layer is contiguous: one run per read; in a checkpoint each tensor is one."""
    plan = manager.experts
    if plan is None or not any(i in plan.layers for i in layers):
        return 0
    return DiskTier.range_staging_bytes(plan.range_chunk(), 1 if spill else plan.range_runs())


def plan_spill(model, managers, options, held_bytes: int) -> dict:
    """An in-memory model's (or pipeline's) disk tier: plan against the budget, then
    the layers that do not fit go to spill files in `options.spill_dir` as they are
    packed. Returns the plan (plan_host_budget)."""
    spill_dir = options.spill_dir
    plan = plan_host_budget(model, managers, options, held_bytes=held_bytes, disk=spill_dir is not None)
    for m in managers:
        if m.tiers.disk_layers:
            m.tiers.keep_on_disk(m.tiers.disk_layers, "spill", functools.partial(spill_store, m.layer_name, spill_dir))
    return plan


def plan_host_budget(model, managers, options, held_bytes: int = 0, why_not_disk=None, spill: bool = True,
                     cache_bytes: int = 0, disk: bool = True) -> dict:
    """Choose each manager's disk layers (`m.tiers.keep_on_disk`) so that host memory
    fits `options.host_budget` on `options.device`, each layer that stays in memory
    counted at the size its route gives it (layerwise.planning.routes: encoded, this
    rank's share), and each group's staging at the slots its own options give
    (OffloadOptions.disk_staging_slots: at the prefetch depth planned); returns the
    plan (also logged).

    `cache_bytes`: the most page cache of the files read while packing that the
    process may hold at once (counted with the packing scratch).

    `why_not_disk(manager, index) -> str | None`: a reason a layer cannot stay
    on disk (then it must be in the arena). `disk=False` (an in-memory model
    without spill_dir): every layer must fit, or a ValueError says what it needs."""
    from layerwise.planning.routes import layer_host_bytes

    device = options.device
    budget, how = resolve_host_budget(options.host_budget, held_bytes)
    enabled = [m for m in managers if m.enabled]
    for m in enabled:
        m.tiers.keep_on_disk(())
    mem = {m: layer_host_bytes(m) for m in enabled}  # each layer's host bytes where it stays in memory
    streamed = {m: [lp.index for lp in m.plan.layers if lp.index not in set(m.resident)] for m in enabled}
    fixed = max((lp.nbytes for m in enabled for lp in m.plan.layers), default=0)  # the packing scratch
    fixed += cache_bytes
    # A resident layer's host block stays (its truth while it is resident: set_residency
    # takes it back from there), besides its copy on the device.
    kept = sum(mem[m][i] for m in enabled for i in m.resident)
    fixed += kept
    on_host_device = device.type == "cpu"
    if on_host_device:  # (`model`: a module, or the modules of a pipeline)
        models = model if isinstance(model, (list, tuple)) else [model]
        fixed += sum(non_layer_bytes(mm, managers) for mm in models) + sum(m.device_bytes() + m.expert_cache_bytes()
                                                                          for m in enabled)
    reasons = {}
    if why_not_disk is not None:
        for m in enabled:
            for i in streamed[m]:
                why = why_not_disk(m, i)
                if why:
                    reasons[(m, i)] = why
    forced = {m: [i for i in streamed[m] if (m, i) in reasons] for m in enabled}

    def staging(disk_sets):
        return sum(m.options.disk_staging_slots * staging_slot_bytes(m, d, spill)
                   + range_staging_bytes(m, d, spill) for m, d in disk_sets.items() if d)

    every = sum(mem[m][i] for m in enabled for i in streamed[m])
    figures = {"budget": budget, "how": how, "fixed_bytes": fixed, "every_bytes": every, "needed_bytes": fixed + every}
    if fixed + every <= budget:
        log.info("layerwise: host_budget %s (%s): every layer fits in host memory (%s of layers, %s else)",
                 fmt_bytes(budget), how, fmt_bytes(every), fmt_bytes(fixed))
        return {**figures, "disk_layers": 0, "disk_bytes": 0, "arena_bytes": every, "staging_bytes": 0}
    if not disk:
        raise ValueError(
            f"host_budget {fmt_bytes(budget)} ({how}) is too small to keep every layer in host memory, and an "
            f"in-memory model has no file to stream the others from: host memory needs {fmt_bytes(fixed + every)} "
            f"({fixed + every} bytes: {fmt_bytes(every)} of layers, each counted at the size its tiers keep it (its "
            "encoded size under compress='lossless', this rank's share under split_fetch), and "
            f"{fmt_bytes(fixed)} for the packing scratch" + (", the host blocks of resident layers" if kept else "")
            + (" and, on a CPU device, the non-layer weights, slot rings and resident layers" if on_host_device
               else "")
            + "). Pass spill_dir=<a directory on a local disk> (the disk tier: the layers that do not fit are "
            "written there while packing, and deleted by remove_layerwise_offload and at exit), or raise host_budget"
        )

    # Which groups take part in the disk tier: the largest first, as few as work (each one that
    # does costs its staging slots). Staging is counted as if every layer of those groups not
    # forced into the arena went to disk: the most it can be.
    def arena_of(m, layers):
        return sum(mem[m][i] for i in layers)

    order = sorted(enabled, key=lambda m: -arena_of(m, streamed[m]))
    for k in range(1, len(order) + 1):
        part, rest = order[:k], order[k:]
        worst = {m: [i for i in streamed[m] if i not in forced[m]] for m in part}
        room = budget - fixed - staging(worst) - sum(arena_of(m, streamed[m]) for m in rest)
        forced_bytes = sum(arena_of(m, forced[m]) for m in part)
        if room >= forced_bytes:
            break
    else:
        worst = {m: [i for i in streamed[m] if i not in forced[m]] for m in enabled}
        forced_bytes = sum(arena_of(m, forced[m]) for m in enabled)
        need = fixed + staging(worst) + forced_bytes
        raise ValueError(
            f"host_budget {fmt_bytes(budget)} ({how}) is too small: even with every streamed layer on disk, host "
            f"memory needs {fmt_bytes(need)} ({need} bytes: {fmt_bytes(staging(worst))} of staging slots, "
            f"{fmt_bytes(fixed)} for the packing scratch" + (", the host blocks of resident layers" if kept else "")
            + (" and the page cache of the reads" if cache_bytes else "")
            + (" and, on a CPU device, the non-layer weights, slot rings and resident layers" if on_host_device
               else "")
            + (f", {fmt_bytes(forced_bytes)} of layers that cannot stay on disk" if forced_bytes else "")
            + "). Raise host_budget, or lower disk_prefetch_depth / prefetch_depth."
            + (f" {len(reasons)} layer(s) cannot stay on disk as stored ({next(iter(reasons.values()))}): give "
               "spill_dir= to write them to spill files in the dtype and layout the model uses." if reasons else "")
        )
    total_part = sum(m.plan.layers[i].nbytes for m in part for i in streamed[m])
    fraction = (room - forced_bytes) / max(1, total_part)
    on_disk: dict[object, list[int]] = {}  # manager -> its layers on disk
    kept_bytes = forced_bytes  # of the groups taking part (what `room` is for)
    for m in enabled:
        d = []
        if m in part:
            credit = 0.0
            for i in streamed[m]:
                nb = m.plan.layers[i].nbytes
                if i in forced[m]:
                    continue
                credit += fraction * nb
                size = mem[m][i]
                if credit >= size and kept_bytes + size <= room:
                    credit -= size
                    kept_bytes += size
                else:
                    d.append(i)
        on_disk[m] = d
        m.tiers.keep_on_disk(d)
    kept_bytes += sum(arena_of(m, streamed[m]) for m in rest)
    disk_bytes = sum(m.plan.layers[i].nbytes for m in enabled for i in on_disk[m])
    per_group = "; ".join(
        f"{m.layer_name}: {len(streamed[m]) - len(on_disk[m])} in memory, {len(on_disk[m])} on disk" for m in enabled)
    stage = staging(on_disk)
    log.info(
        "layerwise: host_budget %s (%s): %s. Host arena %s, disk %s (read every step), staging %s, other host "
        "memory %s", fmt_bytes(budget), how, per_group, fmt_bytes(kept_bytes), fmt_bytes(disk_bytes),
        fmt_bytes(stage), fmt_bytes(fixed))
    return {**figures, "disk_layers": sum(len(d) for d in on_disk.values()), "disk_bytes": disk_bytes,
            "arena_bytes": kept_bytes, "staging_bytes": stage}
