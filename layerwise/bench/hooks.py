"""hooks: CPU time spent in the offload hooks per layer, for layers of 8 and of
200 parameters.

Model: ``models.HolderStack``, N blocks whose forward returns its input, so a
forward costs the module calls plus whatever the hooks do. Every layer holds
the same bytes (200 x 256 B: 8 parameters of 1600 floats or 200 of 64), so only
the parameter count changes between the two cases. Cost per layer =
(host time of an offloaded forward - median host time of the plain forward) / N,
the two interleaved in one run, per sample; a sample that came out below the
plain median (timing noise) counts as 0, since a cost is never negative.
Device work is synchronised outside the clock.

Ours: layerwise (each layer's parameters stay bound to views of its ring slot,
so a hook does O(1) work). Baselines: the naive per-tensor hooks
(``baselines.NaiveOffload``) and accelerate's ``cpu_offload`` when importable (CUDA).
Target: our cost for 200 parameters <= 1.5x our cost for 8.
"""
from __future__ import annotations

import torch

import layerwise
from layerwise.bench import baselines, models
from layerwise.bench.common import (
    Context,
    Row,
    Skip,
    Stat,
    SuiteResult,
    Target,
    compare,
    host_timer,
    inference_step,
    ratio,
)

NAME = "hooks"
OURS, PLAIN = "layerwise", "no offload"
PARAM_COUNTS = (8, 200)
# On CUDA a naive forward of 200 parameters costs ~200 synchronous copies per layer
# (milliseconds), so the layer count stays moderate.
LAYERS = {"full": 64, "quick": 64, "tiny": 16}
REPEATS = {"full": 25, "quick": 25, "tiny": 5}
FLATNESS_LIMIT = 1.5
LAYER_BYTES = 200 * 256  # the same for every parameter count


def per_layer_cost(forward: Stat, plain_s: float, layers: int) -> Stat:
    """Microseconds per layer that offloading adds to a forward: each timed
    forward (seconds) less the plain forward's median, over the layers, floored
    at 0. Its median and quantiles therefore never fall below 0 or below the
    smallest (floored) measured difference."""
    return forward.map(lambda t: max(0.0, (t - plain_s) / layers * 1e6))


def less_wait(cost: Stat, wait_us: float) -> Stat:
    """A per-layer cost less the copy wait the stall counter saw, floored at 0."""
    return cost.map(lambda t: max(0.0, t - wait_us))


def _stack(layers: int, num_params: int) -> models.HolderStack:
    return models.HolderStack(layers, num_params, numel=LAYER_BYTES // (4 * num_params))


def _methods(ctx: Context, layers: int, num_params: int) -> tuple[dict, dict]:
    """Models for every method (the same architecture, separate weights) and the
    methods not available here with the reason."""
    out = {PLAIN: _stack(layers, num_params).to(ctx.device)}
    model = _stack(layers, num_params)
    layerwise.configure_layerwise_offload(model, ["blocks"], device=ctx.device)
    out[OURS] = model
    model, label = baselines.naive_offload(_stack(layers, num_params), ["blocks"], ctx.device,
                                           prefer_accelerate=False)
    out[label] = model
    skipped = {}
    try:
        model, label = baselines.accelerate_offload(_stack(layers, num_params), ctx.device,
                                                    preload_module_classes=["ParamHolder"])
        out[label] = model
    except Skip as e:
        skipped["accelerate cpu_offload"] = str(e)
    return out, skipped


def run(ctx: Context) -> SuiteResult:
    layers, repeats = ctx.pick(LAYERS), ctx.pick(REPEATS)
    x = torch.zeros(4, device=ctx.device)
    result = SuiteResult(NAME, data={"layers": layers, "layer_bytes": LAYER_BYTES})
    # Both parameter counts and every method are interleaved in one round-robin,
    # so that load from elsewhere on the machine hits them alike.
    samplers, ours = {}, {}
    for p in PARAM_COUNTS:
        methods, result.data["skipped_methods"] = _methods(ctx, layers, p)
        ours[p] = methods[OURS]
        samplers.update({(k, p): host_timer(ctx, inference_step(m, x)) for k, m in methods.items()})
    with ctx.progress(repeats + 2, NAME) as bar:
        times = compare(samplers, repeats=repeats, warmup=2, bar=bar)
    del samplers, methods
    cost: dict[int, dict] = {p: {} for p in PARAM_COUNTS}
    for p in PARAM_COUNTS:
        plain = times[(PLAIN, p)].median
        for (k, q), s in times.items():
            if q == p and k != PLAIN:
                cost[p][k] = per_layer_cost(s, plain, layers)
        result.data[f"{p} params"] = {"plain_forward_s": plain, "hook_us_per_layer": cost[p]}
    # With a block that computes nothing, no copy is hidden: the hook time includes
    # waiting for the next layer's copy. Our own stall counter separates the two.
    stall_us = {}
    for p, model in ours.items():
        st = layerwise.configure.managers_of(model)[0].stats(sync=True)
        stall_us[p] = st["stall_s"] / max(1, st["steps"]) / layers * 1e6
    del ours
    ctx.free_memory()

    others = [k for k in cost[PARAM_COUNTS[0]] if k != OURS]
    for p in PARAM_COUNTS:
        result.rows.append(Row(NAME, f"pre+post hook time per layer, {p} params", "us", cost[p][OURS],
                               {k: cost[p][k] for k in others},
                               {f"/{k}": ratio(cost[p][OURS], cost[p][k]) for k in others},
                               short=f"hook time, {p} params"))
        if ctx.device.type == "cpu":  # on CUDA the stall is device time, not host time: no difference to take
            result.rows.append(Row(NAME, f"hook CPU time per layer without the copy wait, {p} params", "us",
                                   less_wait(cost[p][OURS], stall_us[p]), {"copy wait": stall_us[p]},
                                   {}, short=f"hook time less the copy wait, {p} params"))
    lo, hi = PARAM_COUNTS
    growth = {k: ratio(cost[hi][k], cost[lo][k]) for k in cost[lo]}
    result.rows.append(Row(NAME, f"hook time growth, {hi} vs {lo} params", "x", growth[OURS],
                           {k: growth[k] for k in others}, {f"{hi}/{lo}": growth[OURS]},
                           [Target.at_most(growth[OURS], FLATNESS_LIMIT, f"{lo}-param cost")]))
    return result
