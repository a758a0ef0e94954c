"""Routed experts at run time (docs/moe.md; the plan: layerwise/planning/experts.py).

Run (`install_hooks`, at finalisation). A pre-hook on each expert module
reads the routing (on CUDA: one small device -> host copy of E flags per MoE
layer, a host sync), asks the expert stage (stages/experts.ExpertTier) for
the rows of exactly the experts that received tokens (from its device cache,
or copied over the bus, one copy per expert range per parameter), makes the
compute wait for them and lets the forward run. The rows of the other experts
hold stale bytes that the forward never reads (transformers' eager,
batched_mm and grouped_mm forwards index the experts that got tokens; a
per-expert ModuleList forward calls only those, or calls the others on no
tokens), so the output is bitwise the resident model's. With `expert_prefetch`, the hook then
copies, into the next MoE layer's slot, the experts that layer used at its
previous call: a wrong guess costs bytes, never correctness.

Under torch.compile the pre-hook is traced into layerwise::experts_ready, which
takes the routing tensor (runtime/ops.py): its kernel is `_ready`, so the fetch
that depends on the routing's values runs inside the compiled graph, with no
graph break.
"""
from __future__ import annotations

import functools

import torch

from layerwise.planning import experts
from layerwise.runtime import ops


# ------------------------------------------------------------------ run time
def chosen_experts(index: torch.Tensor, num_experts: int) -> list[int]:
    """The experts that received at least one token, ascending: one flag per
    expert computed where the routing is, one small copy to the host."""
    flat = index.reshape(-1).long()
    inside = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    hit = torch.zeros(num_experts + 1, dtype=torch.bool, device=flat.device).index_fill_(0, inside, True)
    return hit[:num_experts].cpu().nonzero().reshape(-1).tolist()


def install_hooks(manager) -> list:
    """A pre-hook on every expert module of the group's layers (module doc);
    returns the handles (removed with the group)."""
    plan = manager.experts
    if plan is None:
        return []
    handles = []
    order = sorted(plan.layers)
    nxt = {i: order[(k + 1) % len(order)] for k, i in enumerate(order)}
    for i, mods in plan.layers.items():
        for k, xm in enumerate(mods):
            ready = functools.partial(_ready, manager, xm, k, nxt[i])
            handles.append(ops.install_experts(xm.module, ready, xm.routing, manager.device))
    return handles


def _ready(manager, xm: experts.ExpertModule, k: int, next_layer: int, index):
    """Before expert module `xm` computes, with its routing `index` (None: the
    forward got no routing tensor): the rows of the experts it picked in the slot."""
    ring = manager.ring
    i = xm.layer
    if not manager.streaming or ring is None or ring.slot_of[i] < 0:
        return None  # removed, or a resident layer: every expert is on the device
    if i not in ring.entered:
        raise RuntimeError(
            f"layerwise: expert module {manager.layer_name}.{i}.{xm.name} was called outside the forward of its "
            f"layer {manager.layer_name}[{i}] (whose weights are streamed, and placed only while it runs): call "
            "the layer, or configure with experts='all'")
    if index is None:
        raise RuntimeError(
            f"layerwise: expert module {manager.layer_name}.{i}.{xm.name} was called without its routing "
            f"argument {xm.routing[1]!r} as a tensor: the experts to fetch are unknown. Configure with "
            "experts='all' for this model.")
    chosen = chosen_experts(index, xm.num_experts)
    tier = manager.chain.experts
    engine, stream = manager.engine, manager.compute_stream()
    with manager.queueing():  # copies queued before the record: an interrupt makes the next hook resync
        need = tier.make_ready(i, k, chosen, stream)
        spec = tier.speculate(next_layer, stream) if manager.options.expert_prefetch and k == 0 else (0, 0)
    manager.meter.moved(need.bytes + spec[0], need.copies + spec[1])
    for ev in need.events:
        manager.meter.wait(engine, ev, stream)
    tier.settle(need)
    return None
