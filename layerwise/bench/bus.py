"""bus: the stream sweep over the CPU backend's simulated bus
(csrc/sim_bus.h, docs/simulated-bus.md).

On a CPU there is no bus to hide: a copy is a host memcpy, and the stream suite's
CPU rows carry no target. Here the CPU engine's copies cross a simulated bus
(``LAYERWISE_SIM_BUS_GBPS``), its speed chosen against the compute measured in
the same run: the DiTStack's resident step at the sweep's smallest and largest
token counts, the bus set so that one step's streamed bytes take the geometric
mean of the two. The sweep then covers transfer-bound, balanced and
compute-bound points, as on a GPU. (With ``LAYERWISE_SIM_BUS_GBPS`` already set,
that bus is used as given.)

Per point, for layerwise at prefetch depth 1 and 2 against the resident model:
the step time, ``/resident``, and ``/floor`` with the floor
``max(resident step, bytes moved / measured bandwidth)``, the bandwidth measured
through the same bus by copies of one layer out of a pinned arena, 16 in flight
(``bus_bandwidth``). Targets (docs/design.md, the CPU
with the simulated bus): compute-bound points (C/T >= 2) <= 1.05x resident,
transfer-bound points (C/T <= 0.5) <= 1.10x the floor. A miss says what the
step waited on the copies (the compute-side stall the hooks measured) beside
what the floor allows. Outputs are checked bitwise against the resident model.
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict

import torch

import layerwise
from layerwise._native import sim_bus
from layerwise.bench import h2d, models
from layerwise.bench.common import (
    Context,
    GiB,
    Row,
    Skip,
    SuiteResult,
    Target,
    bus_gibps,
    check_bitwise,
    clone_module,
    compare,
    device_timer,
    inference_step,
    ratio,
)
from layerwise.bench.stream import Sweep, layerwise_methods, regime

NAME = "bus"
ENV = "LAYERWISE_SIM_BUS_GBPS"
TARGET_RESIDENT, TARGET_FLOOR = 1.05, 1.10

# quick: 512 tokens at most (the bus then at the geometric mean of 1 and 512 tokens' compute, the sweep
# still spans transfer-bound to compute-bound): the largest point's compute is most of the suite's time
SWEEPS = {"full": Sweep(1024, 8, (1, 16, 128, 1024), 5, 1), "quick": Sweep(512, 8, (1, 16, 128, 512), 5, 1),
          "tiny": Sweep(128, 6, (1, 1024), 2, 1)}  # (6 layers: more than a depth-2 ring holds)


def bus_bandwidth(layer_bytes: int, copies: int = 16, repeats: int = 5) -> float:
    """Bytes/s across the simulated bus, measured as the manager uses it: `copies`
    copies of one layer out of a pinned arena in flight at once (one copy waited for
    at a time would add two thread wake-ups per copy, which the pipelined stream
    does not pay)."""
    import time

    arena = layerwise.HostArena(layer_bytes, pinned=True, cuda=False)
    src = arena.allocate(layer_bytes).fill_(1)
    dst = torch.empty(layer_bytes, dtype=torch.uint8)
    engine = layerwise.CopyEngine("cpu")
    engine.copy_async(dst, src).synchronize()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        evs = [engine.copy_async(dst, src) for _ in range(copies)]
        for ev in evs:
            ev.synchronize()
        rates.append(copies * layer_bytes / (time.perf_counter() - t0))
    return sorted(rates)[len(rates) // 2]


def transfer_bandwidth(ctx: Context, nbytes: int) -> float:
    """Bytes/s of host -> device copies of `nbytes` as a streamed step sees them, for
    a floor: on CUDA arena copies to the device (h2d.arena_bandwidth); on the CPU
    across the simulated bus when there is one (bus_bandwidth), else a host memcpy
    (h2d.arena_bandwidth)."""
    if not ctx.is_cuda:
        layerwise.CopyEngine("cpu")  # (the bus as the environment gives it now)
        if sim_bus()["gbps"] > 0:
            return bus_bandwidth(nbytes)
    return h2d.arena_bandwidth(ctx, nbytes)


@contextlib.contextmanager
def simulated_bus(gbps: float | None):
    """CPU copy engines created inside copy across a simulated bus of `gbps` GB/s
    (decimal, as LAYERWISE_SIM_BUS_GBPS; None: the bus that variable gives, if any). Every CPU engine reads the
    bus when it is created and the bus is one per process (the last engine created
    sets it for every engine), so on the way out the environment is restored and an
    engine created: the engines that follow copy as they did before. Yields the bus
    (``_C.sim_bus()``)."""
    saved = os.environ.get(ENV)
    try:
        if gbps is not None:
            os.environ[ENV] = f"{gbps:.6g}"
        layerwise.CopyEngine("cpu")
        yield dict(sim_bus())
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
        layerwise.CopyEngine("cpu")


def step_targets(kind: str, ratios: dict) -> list[Target]:
    """The targets of a step over the simulated bus at a point of regime `kind`
    (stream.regime; docs/design.md, the CPU with the simulated bus): compute-bound
    <= 1.05x resident, transfer-bound <= 1.10x the floor, balanced none."""
    if kind == "compute-bound":
        return [Target.at_most(ratios["/resident"], TARGET_RESIDENT, "resident")]
    if kind == "transfer-bound":
        return [Target.at_most(ratios["/floor"], TARGET_FLOOR, "floor")]
    return []


def miss_note(stall_s: float, transfer_ms: float, resident_ms: float, rest: str = "") -> str:
    """What a step that missed its target waited on: the compute-side stall the hooks
    measured beside what the floor allows beyond the compute, and `rest` (else: hook
    time and the copies' memcpy on the shared cores)."""
    return (f"missed: the step waited {stall_s * 1e3:.2f} ms on copies (the floor allows "
            f"{max(0.0, transfer_ms - resident_ms):.2f} ms beyond the compute); the rest is "
            + (rest or "hook time and the copies' memcpy on the shared cores"))


def resident_ms(ctx: Context, model, xs: dict, repeats: int) -> dict:
    samplers = {t: device_timer(ctx, inference_step(model, x), prepare=inference_step(model, x)) for t, x in xs.items()}
    return {t: s.median * 1e3 for t, s in compare(samplers, repeats, warmup=1).items()}


def run(ctx: Context) -> SuiteResult:
    if ctx.is_cuda:
        raise Skip("the simulated bus is the CPU backend's; on a GPU the stream suite measures the real one")
    sw = ctx.pick(SWEEPS)
    base = models.build(models.DiTStack, sw.hidden, sw.layers, dtype=torch.float32, generate_on=ctx.device)
    gen = torch.Generator().manual_seed(1)
    xs = {t: torch.randn(t, sw.hidden, generator=gen) for t in sw.tokens}
    resident = clone_module(base)
    layer_bytes = sum(p.numel() * p.element_size() for p in base.blocks[0].parameters())
    step_bytes = layer_bytes * sw.layers  # every layer is copied each step (more layers than ring slots)
    given = os.environ.get(ENV)
    chosen = None
    if not given:
        ms = resident_ms(ctx, resident, {t: xs[t] for t in (min(sw.tokens), max(sw.tokens))}, 3)
        transfer_s = math.sqrt(ms[min(sw.tokens)] * ms[max(sw.tokens)]) / 1e3
        chosen = step_bytes / transfer_s / 1e9
    with simulated_bus(chosen):  # (off again for what follows)
        return _sweep(ctx, sw, base, resident, xs, layer_bytes, given, chosen)


def _sweep(ctx, sw, base, resident, xs, layer_bytes, given, chosen) -> SuiteResult:
    methods = {"resident": resident}
    managers = layerwise_methods(ctx, base, methods)
    bandwidth = bus_bandwidth(layer_bytes)
    bus = dict(sim_bus())
    result = SuiteResult(NAME, data={"config": asdict(sw), "layer_bytes": layer_bytes, "bus": bus,
                                     "bus_source": "given" if given else "chosen against the measured compute",
                                     "bandwidth_GiBps": bandwidth / GiB, "points": []})
    with ctx.progress(len(sw.tokens) * (sw.repeats + 1), NAME) as bar:
        for tokens in sw.tokens:
            steps = {name: inference_step(m, xs[tokens]) for name, m in methods.items()}
            check_bitwise(steps, steps["resident"](), f"bus, {tokens} tokens")
            samplers = {name: device_timer(ctx, s, prepare=s) for name, s in steps.items()}
            ms = {k: s.map(lambda t: t * 1e3) for k, s in compare(samplers, sw.repeats, warmup=1, bar=bar).items()}
            last = {name: ms_[0].stats(sync=True)["last_step"] for name, ms_ in managers.items()}
            moved = last["layerwise d=1"]["bytes_copied"]
            transfer_ms = moved / bandwidth * 1e3
            floor_ms = max(ms["resident"].median, transfer_ms)
            c = ms["resident"].median / transfer_ms
            kind = regime(c)  # (the stream suite's: C/T >= 2 compute-bound, <= 0.5 transfer-bound)
            point = {"tokens": tokens, "compute_transfer_ratio": c, "regime": kind, "bytes_moved": moved,
                     "transfer_ms": transfer_ms, "floor_ms": floor_ms, "step_ms": ms, "last_step": last}
            result.data["points"].append(point)
            for name in managers:
                ours = ms[name]
                ratios = {"/resident": ratio(ours, ms["resident"]), "/floor": ratio(ours, floor_ms)}
                targets, note = step_targets(kind, ratios), ""
                if not all(t.met for t in targets):
                    note = miss_note(last[name]["stall_s"], transfer_ms, ms["resident"].median)
                rows_short = f"{tokens} tok, C/T {c:.2g}, {name.removeprefix('layerwise ')}"
                result.rows.append(Row(NAME, f"step over the simulated bus ({bus_gibps(bus['gbps']):.3g} GiB/s), "
                                             f"{tokens} tok (C/T {c:.2g}, {kind}), {name}", "ms", ours,
                                       {"resident": ms["resident"], "floor": floor_ms}, ratios, targets, note=note,
                                       short=rows_short))
    return result
