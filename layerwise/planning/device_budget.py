"""Device-memory planner: choose resident layers (and, if it must, a smaller
prefetch depth) so that non-layer weights + slot rings + resident layers (+ the
routed experts' caches, expert_cache) fit a device budget.

The plan is a single fraction of resident layers shared by every group (the
largest that fits), spread by the residency policy. It is computed from the
plan alone, before anything in the model changes.

Rules (see apply_device_budget):

- The planner never overrides an explicit argument silently. `device_budget`
  and a non-zero `resident_layers` together are a ValueError: pass one of them.
- Every change it makes to what was asked (a lower prefetch depth, layers made
  resident) is logged as a WARNING on the "layerwise" logger, with the figures
  behind it; a plan that changes nothing is logged at INFO.
- On a CPU device, `device_budget="auto"` plans nothing: the "device" is host
  memory, which already holds the arena, so free RAM is no reason to make a
  layer resident. Residency and prefetch depth stay as asked (INFO says so).
  A number of bytes is planned against on CPU as on CUDA.
"""
from __future__ import annotations

import logging

import torch

from layerwise.options import budget_margin_bytes, resolve_resident
from layerwise.planning.layout import assign_slots, param_bytes

log = logging.getLogger("layerwise")


def non_layer_bytes(model, managers) -> int:
    managed = {id(e.param) for m in managers for lp in m.plan.layers for e in lp.params}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in managed and id(p) not in seen:
            seen.add(id(p))
            total += param_bytes(p)
    for b in model.buffers():
        total += b.numel() * b.element_size()
    return total


def record_host_budget(managers, host_budget, budget_bytes: int) -> None:
    """The host budget in force (`host_budget`: what was given, `budget_bytes`: what it
    resolved to), one layerwise.planning.host_budget.HostBudget shared by `managers`,
    goes into each group's tier plan (TierChoice.use_host_budget): checked wherever the
    bytes held change, and shown by layerwise.report (the group's `host_budget`)."""
    from layerwise.planning.host_budget import HostBudget

    ledger = HostBudget(budget_bytes, "auto" if isinstance(host_budget, str) else "given", managers)
    for m in managers:
        m.tiers.use_host_budget(ledger)


def _ring_bytes(manager, streamed: int, depth: int) -> tuple[int, int]:
    """(slots, bytes) of the group's slot ring for `streamed` layers at `depth`: slots of
    the size the manager's ring has (a gather's slots can exceed the largest layer), or
    of the largest streamed layer before it has one."""
    _, slots = assign_slots(streamed, depth)
    ring = manager.ring
    if ring is not None and ring.num_slots:
        size = ring.slots[0].numel()
    else:
        size = max((lp.nbytes for lp in manager.plan.layers if lp.index not in set(manager.resident)), default=0)
    return slots, slots * size


def streaming_saves_nothing(manager) -> str | None:
    """Why streaming this group saves no device memory, or None: every layer is
    resident, or its slot ring holds at least as many bytes as its streamed layers
    would hold resident, so keeping the group resident costs the device no more."""
    if not manager.enabled:
        return None
    resident = set(manager.resident)
    streamed = [lp.nbytes for lp in manager.plan.layers if lp.index not in resident]
    if not streamed:
        return (f"every one of its {manager.num_layers} layers is resident (resident_layers): nothing streams; "
                "configure_layerwise_offload is not needed for it, or lower resident_layers")
    depth = manager.prefetch_depth
    slots, ring = _ring_bytes(manager, len(streamed), depth)
    held = sum(streamed)
    if ring < held:
        return None
    fix = ("keep it resident instead: leave it out of layer_names (offload_pipeline: out of the component's "
           "entry in components, or the component None) and it moves to the device whole")
    # A shallower prefetch needs fewer slots: the deepest at which the ring holds less (depth is per call).
    for d in range(depth - 1, -1, -1):
        fewer, smaller = _ring_bytes(manager, len(streamed), d)
        if smaller < held:
            fix += (f"; or prefetch_depth={d} for every group of the call (a ring of {fewer} slot(s), "
                    f"{fmt_bytes(smaller)})" + (", at which each layer is copied when it is called, with no "
                                                "overlap of copy and compute" if d == 0 else ""))
            break
    return (f"its ring of {slots} slot(s) for prefetch_depth={depth} takes {fmt_bytes(ring)}, "
            f"{'as much as' if ring == held else 'more than'} its {len(streamed)} streamed layer(s) take "
            f"resident ({fmt_bytes(held)}); {fix}")


def warn_if_streaming_saves_nothing(managers, component: str | None = None) -> None:
    """One WARNING per group where streaming saves no device memory (configure and
    offload_pipeline call it once per call; `component`: the pipeline component the
    groups belong to). A logging WARNING on the "layerwise" logger, as every planner
    message of the package: shown on stderr where logging is not configured."""
    where = f"component {component!r}, " if component is not None else ""
    for m in managers:
        why = streaming_saves_nothing(m)
        if why:
            log.warning("layerwise: %slayer group %r: streaming saves no device memory: %s", where, m.layer_name, why)


def free_device_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes on the device; host memory for the CPU backend."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def fmt_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB' (bytes below 1 KiB as such)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def resolve_budget(device: torch.device, device_budget, budget_margin) -> int:
    """Bytes for a device budget (a number, or "auto": free device memory less
    `budget_margin`, default 10% of the device: options.budget_margin_bytes), from
    values validated by OffloadOptions.build."""
    if isinstance(device_budget, str):
        free, total = free_device_bytes(device)
        return max(0, free - budget_margin_bytes(budget_margin, total))
    return int(device_budget)


SHARE_STEPS = 64  # a resident share is planned in 64ths of each group


def largest_share(fits) -> float | None:
    """The largest share k / SHARE_STEPS of resident layers for which `fits(share)`
    holds (the cost is monotone in the share), or None where not even 0 fits."""
    best = None
    for k in range(SHARE_STEPS + 1):
        if not fits(k / SHARE_STEPS):
            break
        best = k / SHARE_STEPS
    return best


def apply_device_budget(model, managers, device, device_budget, budget_margin, policy) -> dict:
    """Re-plan every manager's residency to fit the budget; returns the plan.

    `device_budget` is a number of bytes, or "auto": free device memory less
    `budget_margin` (default 10% of the device's memory). The planner keeps the
    prefetch depth that was asked if the rings fit with nothing resident, else
    the deepest that fits (a WARNING with the ring bytes at each depth; depth 0
    means every layer loads synchronously, with no overlap), then makes the
    largest share of layers resident that still fits (a WARNING with the
    figures). If even depth 0 with nothing resident does not fit: RuntimeError.

    A non-zero `resident_layers` together with a budget is refused before this
    runs (OffloadOptions.build: options.check_explicit_residency): the planner
    never overrides an explicit argument. On a CPU device "auto" plans nothing
    (host memory already holds the arena; see the module docstring).
    """
    enabled = [m for m in managers if m.enabled]
    asked_depth = max((m.prefetch_depth for m in enabled), default=0)
    if isinstance(device_budget, str) and device_budget == "auto" and device.type == "cpu":
        log.info(
            "layerwise: device_budget='auto' on a CPU device plans nothing: the device is host memory, which "
            "already holds the arena, so no layer is made resident and prefetch depth stays %d. "
            "Pass device_budget=<bytes> to plan against a budget on CPU.", asked_depth,
        )
        return {"budget": None, "needed": None, "non_layer_bytes": None, "prefetch_depth": asked_depth,
                "ring_bytes": None, "resident": {m.layer_name: len(m.resident) for m in managers}}
    budget = resolve_budget(device, device_budget, budget_margin)
    fixed = non_layer_bytes(model, managers)

    def placed(fraction: float) -> list:
        plans = []
        for m in enabled:
            n = m.num_layers
            resident = list(range(n)) if fraction >= 1.0 else resolve_resident(fraction, n, policy)
            plans.append((m, resident))
        return plans

    # Ring bytes (nothing resident) at each depth from the one asked down to 0.
    rings = {d: sum(m.device_bytes(r, d) for m, r in placed(0.0)) for d in range(asked_depth, -1, -1)}
    # The routed experts' caches (expert_cache) hold device memory too: each group's is
    # counted at the size it will have for the residency planned (an "auto" one takes at
    # most a quarter of what the budget leaves after the non-layer weights and the rings).
    auto = max(1, sum(1 for m in enabled if m.options.expert_cache == "auto"))

    def caches(plans, depth: int) -> dict:
        room = (budget - fixed - rings[depth]) // auto
        return {m: m.expert_cache_bytes(r, room=room) for m, r in plans}

    def cost(fraction: float, depth: int):
        plans = placed(fraction)
        return fixed + sum(m.device_bytes(r, depth) for m, r in plans) + sum(caches(plans, depth).values()), plans

    ring_text = ", ".join(f"{fmt_bytes(r)} at depth {d}" for d, r in rings.items())
    cache0 = {d: sum(caches(placed(0.0), d).values()) for d in rings}
    head = (f"layerwise: device_budget {fmt_bytes(budget)} ({budget} bytes): non-layer weights and buffers "
            f"{fmt_bytes(fixed)}; slot rings with nothing resident: {ring_text}"
            + (f"; expert cache {fmt_bytes(cache0[asked_depth])}" if cache0[asked_depth] else ""))

    # Deepest prefetch that fits with nothing resident, then the most residency at that depth.
    fitting = [d for d, r in rings.items() if fixed + r + cache0[d] <= budget]
    if not fitting:
        raise RuntimeError(
            f"device_budget of {budget} bytes is too small: even streaming every layer at prefetch depth 0 "
            f"needs {fixed + rings[0] + cache0[0]} bytes ({fixed} for non-layer weights and buffers, {rings[0]} for "
            "the slot rings" + (f", {cache0[0]} for the expert cache (expert_cache: give fewer bytes, or None)"
                                if cache0[0] else "") + ")"
        )
    depth = fitting[0]
    share = largest_share(lambda f: cost(f, depth)[0] <= budget)
    assert share is not None, "a depth in `fitting` fits with nothing resident (share 0)"
    need, plans = cost(share, depth)
    held = caches(plans, depth)
    for m, resident in plans:
        m.plan_residency(resident, depth, expert_cache=held[m])
    plan = {
        "budget": budget, "needed": need, "non_layer_bytes": fixed, "prefetch_depth": depth,
        "ring_bytes": rings, "resident": {m.layer_name: len(r) for m, r in plans},
        "expert_cache_bytes": sum(held.values()),
    }

    if depth < asked_depth:
        msg = (f"{head}. prefetch_depth={asked_depth} does not fit "
               f"({fmt_bytes(fixed + rings[asked_depth] + cache0[asked_depth])} needed): "
               f"lowered to {depth}")
        if depth == 0:
            msg += (". At prefetch depth 0 every layer loads synchronously when it is called, with no overlap of "
                    f"copies and compute; a budget of {fixed + rings[1] + cache0[1]} bytes would allow prefetch "
                    "depth 1")
        log.warning(msg)
    n_res = sum(len(r) for _, r in plans)
    res_bytes = sum(m.plan.layers[i].nbytes for m, r in plans for i in r)
    per_group = ", ".join(f"{m.layer_name}: {len(r)} of {m.num_layers}" for m, r in plans)
    if n_res:
        log.warning(
            "%s. At prefetch depth %d the planner made %d layer(s) resident (%s; %s): %s of %s used",
            head, depth, n_res, per_group, fmt_bytes(res_bytes), fmt_bytes(need), fmt_bytes(budget),
        )
    elif depth == asked_depth:
        log.info("%s. Prefetch depth %d as asked; no layer fits resident on top: %s of %s used",
                 head, depth, fmt_bytes(need), fmt_bytes(budget))
    return plan
