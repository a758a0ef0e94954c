"""Device-memory planner: choose resident layers (and, if it must, a smaller
prefetch depth) so that non-layer weights + slot rings + resident layers fit a
device budget.

The plan is a single fraction of resident layers shared by every group (the
largest that fits), spread by the residency policy. It is computed from the
plan alone, before anything in the model changes.
"""
from __future__ import annotations

import logging

import torch

from .options import resolve_resident

log = logging.getLogger("layerwise")

DEFAULT_MARGIN_FRACTION = 0.1  # of the device's total memory, kept for activations


def non_layer_bytes(model, managers) -> int:
    managed = {id(e.param) for m in managers for lp in m.plan.layers for e in lp.params}
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in managed and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for b in model.buffers():
        total += b.numel() * b.element_size()
    return total


def free_device_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes on the device; host memory for the CPU backend."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def resolve_budget(device: torch.device, device_budget, budget_margin) -> int:
    if isinstance(device_budget, str):
        if device_budget != "auto":
            raise ValueError(f"device_budget must be a number of bytes or 'auto', got {device_budget!r}")
        free, total = free_device_bytes(device)
        margin = int(DEFAULT_MARGIN_FRACTION * total) if budget_margin is None else int(budget_margin)
        return max(0, free - margin)
    if isinstance(device_budget, bool) or not isinstance(device_budget, (int, float)) or device_budget < 0:
        raise ValueError(f"device_budget must be a number of bytes >= 0 or 'auto', got {device_budget!r}")
    return int(device_budget)


def apply_device_budget(model, managers, device, device_budget, budget_margin, policy) -> dict:
    """Re-plan every manager's residency to fit the budget; returns the plan."""
    budget = resolve_budget(device, device_budget, budget_margin)
    fixed = non_layer_bytes(model, managers)
    enabled = [m for m in managers if m.enabled]
    depth0 = max((m.prefetch_depth for m in enabled), default=0)

    def cost(fraction: float, depth: int):
        plans = []
        for m in enabled:
            n = m.num_layers
            resident = list(range(n)) if fraction >= 1.0 else resolve_resident(fraction, n, policy)
            plans.append((m, resident))
        return fixed + sum(m._device_bytes(r, depth) for m, r in plans), plans

    # Deepest prefetch that fits with nothing resident, then the most residency at that depth.
    for depth in range(depth0, -1, -1):
        need, plans = cost(0.0, depth)
        if need <= budget:
            break
    else:
        raise RuntimeError(
            f"device_budget of {budget} bytes is too small: even streaming every layer at prefetch depth 0 "
            f"needs {need} bytes ({fixed} for non-layer weights and buffers, {need - fixed} for the slot rings)"
        )
    steps = [k / 64 for k in range(65)]
    lo = 0
    for k in range(1, len(steps)):  # the cost is monotone in the resident fraction
        if cost(steps[k], depth)[0] <= budget:
            lo = k
        else:
            break
    need, plans = cost(steps[lo], depth)
    for m, resident in plans:
        m._set_residency(resident, depth)
    plan = {
        "budget": budget, "needed": need, "non_layer_bytes": fixed, "prefetch_depth": depth,
        "resident": {m.layer_name: len(r) for m, r in plans},
    }
    log.info(
        "layerwise: device budget %.1f MiB: non-layer %.1f MiB + rings/resident %.1f MiB = %.1f MiB; "
        "prefetch depth %d; resident layers %s",
        budget / 2**20, fixed / 2**20, (need - fixed) / 2**20, need / 2**20, depth, plan["resident"],
    )
    return plan
