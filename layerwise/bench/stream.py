"""stream: step time of a DiT-like block stack whose blocks are streamed, from
far below to far above the point where compute per layer covers transfer per
layer.

Model: ``models.DiTStack`` (LayerNorm + 4x MLP blocks; bf16 on CUDA, fp32 on
the CPU). The token count is swept; the x axis of the sweep is the
compute/transfer ratio ``resident step / (streamed bytes / bandwidth)``, the
bandwidth being measured in the same run by arena copies of one layer.

Methods (all timed interleaved, steady state: each sample runs one untimed
step, then times ``steps`` back-to-back steps):
  resident                  the whole model on the device;
  layerwise d=1, d=2        configure_layerwise_offload, prefetch depth 1 and 2;
  naive                     accelerate's cpu_offload if importable (CUDA), else
                            synchronous per-tensor copies in block hooks;
  diffusers group offload   (CUDA, if importable) block level, 1 block/group,
                            use_stream=True.
The layerwise outputs must equal the resident output bitwise (first and second
step of every point); a mismatch fails the suite.

Targets (CUDA): compute-bound points (ratio >= 2) <= 1.01x resident;
transfer-bound points (ratio <= 0.5) <= 1.05x the floor
``max(resident, streamed bytes / bandwidth)``; faster than diffusers at every
point. On the CPU there is no bus: the ratios against resident and the floor (a
host memcpy's bandwidth) carry no target; ``python -m layerwise.bench bus`` runs
the same sweep over the simulated bus, with targets.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

import layerwise
from layerwise.bench import baselines, h2d, models
from layerwise.bench.common import (
    Context,
    GiB,
    Row,
    Skip,
    SuiteResult,
    Target,
    check_bitwise,
    clone_module,
    compare,
    device_timer,
    inference_step,
    median,
    ratio,
)

NAME = "stream"
RESIDENT = "resident"
COMPUTE_BOUND = 2.0  # compute/transfer ratio at or above which a point counts as compute-bound
TRANSFER_BOUND = 0.5  # ... at or below which it counts as transfer-bound


@dataclass(frozen=True)
class Sweep:
    hidden: int
    layers: int
    tokens: tuple
    repeats: int
    steps: int  # timed back-to-back steps per sample


SWEEPS = {
    # H200, bf16: a 4096-wide layer is 256 MiB (about 5.4 ms at 46.6 GiB/s); 65536 tokens
    # compute about 5x longer than that, 256 tokens about 50x shorter.
    ("full", "cuda"): Sweep(4096, 16, (256, 1024, 4096, 16384, 65536), 5, 2),
    ("quick", "cuda"): Sweep(2048, 16, (256, 4096, 65536), 4, 2),
    ("tiny", "cuda"): Sweep(256, 4, (16, 256), 2, 1),
    # 2 CPU cores, fp32: a 512-wide layer is 8 MiB; compute covers its copy near 30 tokens.
    ("full", "cpu"): Sweep(1024, 8, (4, 32, 256), 5, 1),
    ("quick", "cpu"): Sweep(512, 8, (2, 16, 64, 256), 7, 1),
    ("tiny", "cpu"): Sweep(128, 4, (4, 64), 2, 1),
}


def regime(c: float) -> str:
    if c >= COMPUTE_BOUND:
        return "compute-bound"
    if c <= TRANSFER_BOUND:
        return "transfer-bound"
    return "balanced"


def layerwise_methods(ctx: Context, base, methods: dict) -> dict:
    """`base` streamed at prefetch depth 1 and 2 (each its own copy), added to
    `methods` by name; returns their managers by the same names."""
    managers = {}
    for depth in (1, 2):
        model = clone_module(base)
        managers[f"layerwise d={depth}"] = layerwise.configure_layerwise_offload(
            model, ["blocks"], device=ctx.device, prefetch_depth=depth)
        methods[f"layerwise d={depth}"] = model
    return managers


def _prepare(ctx: Context, base) -> tuple[dict, dict, dict]:
    """Every method's model (each from its own copy of `base`), the layerwise
    managers by method name, and the methods skipped here with the reason."""
    methods = {RESIDENT: clone_module(base).to(ctx.device)}
    managers = layerwise_methods(ctx, base, methods)
    model, label = baselines.naive_offload(clone_module(base), ["blocks"], ctx.device)
    methods[label] = model
    skipped = {}
    try:
        model, label = baselines.diffusers_group_offload(clone_module(base), ctx.device)
        methods[label] = model
    except Skip as e:
        skipped["diffusers group offload"] = str(e)
    except Exception as e:  # noqa: BLE001 - a baseline that fails to set up is not our failure
        skipped["diffusers group offload"] = f"set-up failed: {type(e).__name__}: {e}"
    return methods, managers, skipped


def run(ctx: Context) -> SuiteResult:
    sw = ctx.pick(SWEEPS)
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    base = models.build(models.DiTStack, sw.hidden, sw.layers, dtype=dtype, generate_on=ctx.device)
    methods, managers, skipped = _prepare(ctx, base)
    del base
    lw = managers["layerwise d=1"][0]
    layer_bytes = lw.plan.layers[0].nbytes
    bandwidth = h2d.arena_bandwidth(ctx, layer_bytes)

    result = SuiteResult(NAME, data={
        "config": {**asdict(sw), "dtype": str(dtype), "layer_bytes": layer_bytes},
        "h2d_bandwidth_GiBps": bandwidth / GiB, "methods": list(methods), "skipped_methods": skipped,
        "points": []})
    others = [m for m in methods if m != RESIDENT and not m.startswith("layerwise")]
    diffusers = next((m for m in others if m.startswith("diffusers")), None)

    gen = torch.Generator(device=ctx.device).manual_seed(1)
    with ctx.progress(len(sw.tokens) * (sw.repeats + 1), NAME) as bar:
        for tokens in sw.tokens:
            x = torch.randn(tokens, sw.hidden, generator=gen, device=ctx.device).to(dtype)
            steps = {name: inference_step(model, x) for name, model in methods.items()}
            check_bitwise(steps, steps[RESIDENT](), f"stream, {tokens} tokens")
            samplers = {name: device_timer(ctx, step, inner=sw.steps, prepare=step) for name, step in steps.items()}
            ms = {k: s.map(lambda t: t * 1e3) for k, s in compare(samplers, sw.repeats, warmup=1, bar=bar).items()}

            last = {name: mgrs[0].stats(sync=True)["last_step"] for name, mgrs in managers.items()}
            streamed = last["layerwise d=1"]["bytes_copied"]
            transfer_ms = streamed / bandwidth * 1e3
            floor_ms = max(ms[RESIDENT].median, transfer_ms)
            c = ms[RESIDENT].median / transfer_ms
            point = {"tokens": tokens, "compute_transfer_ratio": c, "regime": regime(c),
                     "streamed_bytes": streamed, "transfer_ms": transfer_ms, "floor_ms": floor_ms,
                     "step_ms": ms,
                     "ratios": {k: {"/resident": ratio(v, ms[RESIDENT]), "/floor": ratio(v, floor_ms)}
                                for k, v in ms.items()},
                     "layerwise_last_step": last}
            result.data["points"].append(point)
            result.rows += _rows(ctx, point, managers, others, diffusers)
            del x, steps, samplers
    return result


def _rows(ctx: Context, point: dict, managers: dict, others: list, diffusers: str | None) -> list[Row]:
    ms, c, floor = point["step_ms"], point["compute_transfer_ratio"], point["floor_ms"]
    rows = []
    for name in managers:
        ours = ms[name]
        base = {RESIDENT: ms[RESIDENT], **{k: ms[k] for k in others}, "floor": floor}
        ratios = {"/resident": ratio(ours, ms[RESIDENT]), "/floor": ratio(ours, floor)}
        targets = []
        if ctx.is_cuda:  # (on a CPU the "bus" is a memcpy on the compute's cores: no target; the bus suite has one)
            if point["regime"] == "compute-bound":
                targets.append(Target.at_most(ratios["/resident"], 1.01, "resident"))
            elif point["regime"] == "transfer-bound":
                targets.append(Target.at_most(ratios["/floor"], 1.05, "floor"))
            if diffusers is not None:
                ratios["/diffusers"] = ratio(ours, ms[diffusers])
                targets.append(Target("< diffusers", bool(median(ours) < median(ms[diffusers]))))
        measure = f"step, {point['tokens']} tok (C/T {c:.2g}, {point['regime']}), {name}"
        # the default table's label: the legend says what C/T, its regimes and d=N are
        short = f"{point['tokens']} tok, C/T {c:.2g}, {name.removeprefix('layerwise ')}"
        rows.append(Row(NAME, measure, "ms", ours, base, ratios, targets, short=short))
    return rows
