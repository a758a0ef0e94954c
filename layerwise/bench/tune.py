"""tune: layerwise.tune against the fixed residency policies at one device budget
.

The model is a block list whose layers alternate irregularly between big, light
ones (a wide weight applied to one token: many bytes, little compute) and small,
heavy ones (``models.MixedStack``). On the CPU its copies cross the simulated bus
(csrc/sim_bus.h), its speed chosen against the compute measured in the same run:
a big layer's copy takes ``BIG_COPY_IN_HEAVY`` heavy layers' compute, so that the
big ones' copies cannot all be hidden and the choice of what stays resident
matters. (With ``LAYERWISE_SIM_BUS_GBPS`` set, that bus is used as given.)

The device budget is the non-layer weights + a depth-1 ring + ``EXTRA_LAYERS``
big layers. At that budget, each at its better prefetch depth (1 or 2) and the
largest share of resident layers that fits (as layerwise.planning.device_budget plans):
``leading`` and ``strided``, and ``layerwise.tune`` (which also prints its plan
table: resident layers and depth; predicted, measured and floor step time).

Rows: the step time of each placement against the resident model, timed in
interleaved rounds (a slow moment hits every placement alike); tune's row has
``/leading``, ``/strided``, ``/floor`` and ``/predicted``. Targets on the CPU
with the simulated bus: tune <= 1.0x both policies, measured within 10% of its
prediction. Outputs are checked bitwise against the resident model.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

import layerwise
from layerwise.bench import models
from layerwise.bench.bus import ENV, simulated_bus
from layerwise.bench.common import (
    Context,
    Row,
    SuiteResult,
    Target,
    bus_gibps,
    check_bitwise,
    clone_module,
    inference_step,
    ratio,
)
from layerwise.options import resolve_resident
from layerwise.planning.device_budget import largest_share

NAME = "tune"
BIG_COPY_IN_HEAVY = 3.0
EXTRA_LAYERS = 3
HONEST = 0.10
KINDS = "HBHHBHBBHHHBHB"
# hidden, wide, reps, tokens
SIZES = {"full": (512, 8192, 4, 512), "quick": (256, 4096, 4, 256), "tiny": (64, 1024, 2, 32)}
ROUNDS = {"full": 5, "quick": 3, "tiny": 1}
PER_ROUND = {"full": 5, "quick": 5, "tiny": 2}


def _largest_share(m, depth: int, policy: str, room: int) -> list[int]:
    """`policy`'s resident layers of `m` at the largest share that fits `room` (as
    layerwise.planning.device_budget plans)."""
    share = largest_share(lambda f: m.device_bytes(resolve_resident(f, m.num_layers, policy), depth) <= room)
    return resolve_resident(share or 0.0, m.num_layers, policy)


def _median_step(ctx: Context, step, n: int) -> float:
    ctx.synchronize()
    step()
    out = []
    for _ in range(n):
        ctx.synchronize()
        t0 = time.perf_counter()
        step()
        ctx.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run(ctx: Context) -> SuiteResult:
    hidden, wide, reps, tokens = ctx.pick(SIZES)
    base = models.build(models.MixedStack, KINDS, hidden, wide, reps, dtype=torch.float32, generate_on=ctx.device)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(ctx.device)
    resident = clone_module(base).to(ctx.device)
    heavy = inference_step(resident.blocks[0], x)
    heavy_s = _median_step(ctx, heavy, 9)
    big_bytes = sum(p.numel() * p.element_size() for p in base.blocks[KINDS.index("B")].parameters())
    chosen = None
    if not ctx.is_cuda and not os.environ.get(ENV):
        chosen = big_bytes / (BIG_COPY_IN_HEAVY * heavy_s) / 1e9
    bus = simulated_bus(chosen) if not ctx.is_cuda else contextlib.nullcontext({"gbps": None})
    with bus as b:
        return _compare(ctx, base, resident, x, b, chosen, heavy_s, big_bytes)


def _compare(ctx, base, resident, x, bus, chosen, heavy_s, big_bytes) -> SuiteResult:
    model = clone_module(base)
    (m,) = layerwise.configure_layerwise_offload(model, "blocks", device=ctx.device)
    fixed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    budget = fixed + m.device_bytes([], 1) + EXTRA_LAYERS * big_bytes
    step, ref_step = inference_step(model, x), inference_step(resident, x)
    want = ref_step()
    plan = layerwise.tune(model, lambda mm: step(), device_budget=budget)
    placements = {"tune": (list(m.resident), m.prefetch_depth)}
    for policy in ("leading", "strided"):
        options = [(_largest_share(m, d, policy, budget - fixed), d) for d in (1, 2)]
        best = None
        for res, d in options:
            m.set_residency(res, d)
            t = _median_step(ctx, step, 3)
            if best is None or t < best[0]:
                best = (t, res, d)
        placements[policy] = (best[1], best[2])
    times = {k: [] for k in (*placements, "resident")}
    n = ctx.pick(PER_ROUND)
    for _ in range(ctx.pick(ROUNDS)):  # interleaved: a slow moment hits every placement alike
        for name, (res, d) in placements.items():
            m.set_residency(res, d)
            check_bitwise({name: step}, want, f"tune, {name} placement")
            times[name].append(_median_step(ctx, step, n))
        times["resident"].append(_median_step(ctx, ref_step, n))
    ms = {k: min(v) * 1e3 for k, v in times.items()}
    used = {}
    for name, (res, d) in placements.items():
        used[name] = fixed + m.device_bytes(res, d)
    m.set_residency(*placements["tune"])
    layerwise.remove_layerwise_offload(model)
    result = SuiteResult(NAME, data={
        "kinds": KINDS, "hidden": base.proj_in.in_features, "bus": bus, "bus_source": "chosen against the measured "
        "compute" if chosen else ("given" if not ctx.is_cuda else "the device's"), "heavy_ms": heavy_s * 1e3,
        "big_layer_bytes": big_bytes, "budget": budget, "device_bytes": used,
        "placements": {k: {"resident": r, "depth": d} for k, (r, d) in placements.items()}, "step_ms": ms,
        "plan": {"predicted_ms": plan.predicted_s * 1e3, "measured_ms": plan.measured_s * 1e3,
                 "floor_ms": plan.floor_s * 1e3, "before_ms": plan.before_s * 1e3,
                 "alternatives_ms": {k: v * 1e3 for k, v in plan.alternatives.items()}, "note": plan.note,
                 "table": str(plan)}})
    sim = bool(bus.get("gbps")) and not ctx.is_cuda
    where = f"over the simulated bus ({bus_gibps(bus['gbps']):.3g} GiB/s)" if sim else "on this device"
    for name in ("leading", "strided"):
        res, d = placements[name]
        result.rows.append(Row(NAME, f"step {where}, {name} ({len(res)} resident, depth {d})", "ms", ms[name],
                               {"resident": ms["resident"]}, {"/resident": ratio(ms[name], ms["resident"])},
                               short=f"{name}, {len(res)} resident, d={d}"))
    res, d = placements["tune"]
    ratios = {"/leading": ratio(ms["tune"], ms["leading"]), "/strided": ratio(ms["tune"], ms["strided"]),
              "/floor": ratio(ms["tune"], plan.floor_s * 1e3), "/predicted": ratio(ms["tune"], plan.predicted_s * 1e3)}
    targets = []
    if sim:
        targets = [Target.at_most(ratios["/leading"], 1.0, "leading"),
                   Target.at_most(ratios["/strided"], 1.0, "strided"),
                   Target.at_most(ratios["/predicted"], 1 + HONEST, "predicted"),
                   Target.at_least(ratios["/predicted"], 1 - HONEST, "predicted")]
    note = f"tune's plan: {plan.summary()}" + (f"; {plan.note}" if plan.note else "")
    result.rows.append(Row(NAME, f"step {where}, layerwise.tune ({len(res)} resident, depth {d})", "ms", ms["tune"],
                           {"leading": ms["leading"], "strided": ms["strided"], "floor": plan.floor_s * 1e3,
                            "predicted": plan.predicted_s * 1e3}, ratios, targets, note=note,
                           short=f"tune, {len(res)} resident, d={d}"))
    return result
