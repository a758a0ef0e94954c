"""h2d: bandwidth of copies out of the host arena, against torch's own copies.

Ours: ``CopyEngine.copy_async`` from a ``HostArena`` block into a device
tensor (on CUDA: pinned arena, the engine's copy stream, the current stream
waits on the copy's event, so the CUDA events that time it see its end).
Baselines on CUDA: ``dst.copy_(src, non_blocking=True)`` from a torch pinned
tensor and from pageable memory. On the CPU the engine copies host -> host on
its worker thread and is compared with ``dst.copy_(src)`` of the same bytes.

Targets: CUDA, copies of 64 MiB and more: >= 0.95x the pinned ``copy_``; CPU:
>= 0.8x torch's ``copy_``.
"""
from __future__ import annotations

import torch

import layerwise
from layerwise.bench.common import (
    Context,
    GiB,
    MiB,
    Row,
    SuiteResult,
    Target,
    compare,
    device_timer,
    ratio,
    stream_handle,
)

NAME = "h2d"

SIZES_MB = {  # MiB
    ("full", "cuda"): [1, 4, 16, 64, 256, 1024],
    ("quick", "cuda"): [1, 16, 256],
    ("tiny", "cuda"): [1, 4],
    ("full", "cpu"): [1, 16, 64, 256],
    ("quick", "cpu"): [1, 16, 64],
    ("tiny", "cpu"): [1, 4],
}
# Back-to-back copies in one sample: at least this many bytes, so that launch
# latency is amortised for small copies.
BYTES_PER_SAMPLE = {"cuda": 256 * MiB, "cpu": 32 * MiB}
REPEATS = {"full": 30, "quick": 40, "tiny": 3}
GPU_TARGET_MIN_BYTES = 64 * MiB  # below this, per-copy latency dominates: no target


def engine_copy(ctx: Context, engine, dst: torch.Tensor, src: torch.Tensor):
    """One engine copy, as a callable a timer can repeat: on CUDA the current
    stream waits on the copy (timed by events), on the CPU the call blocks."""
    if ctx.is_cuda:
        stream = stream_handle(ctx.device)
        return lambda: engine.wait(engine.copy_async(dst, src), stream)
    return lambda: engine.copy_async(dst, src).synchronize()


def inner_copies(ctx: Context, nbytes: int) -> int:
    return max(1, min(64, BYTES_PER_SAMPLE[ctx.device.type] // nbytes))


def arena_bandwidth(ctx: Context, nbytes: int, repeats: int = 5) -> float:
    """Median bytes/s of engine copies of `nbytes` out of a fresh arena (for the
    stream suite's bandwidth floor)."""
    arena = layerwise.HostArena(nbytes, pinned=True, cuda=ctx.is_cuda)
    src = arena.allocate(nbytes).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    engine = layerwise.CopyEngine(str(ctx.device))
    sampler = device_timer(ctx, engine_copy(ctx, engine, dst, src), inner=inner_copies(ctx, nbytes))
    stat = compare({"arena": sampler}, repeats=repeats, warmup=1)["arena"]
    engine.synchronize()
    return nbytes / stat.median


def run(ctx: Context) -> SuiteResult:
    sizes = [mb * MiB for mb in ctx.pick(SIZES_MB)]
    repeats = ctx.pick(REPEATS)
    biggest = max(sizes)
    arena = layerwise.HostArena(biggest, pinned=True, cuda=ctx.is_cuda)
    arena_src = arena.allocate(biggest).fill_(1)
    pageable = torch.ones(biggest, dtype=torch.uint8)
    dst = torch.empty(biggest, dtype=torch.uint8, device=ctx.device)
    engine = layerwise.CopyEngine(str(ctx.device))
    if ctx.is_cuda:
        pinned = torch.ones(biggest, dtype=torch.uint8).pin_memory()
        base_names, ref = ("pinned copy_", "pageable copy_"), "pinned copy_"
    else:
        base_names, ref = ("torch copy_",), "torch copy_"

    # Read after allocate: pages are pinned as they are handed out, and a failure
    # turns pin_kind to "none" with the reason in pin_error.
    result = SuiteResult(NAME, data={"arena_pin_kind": arena.pin_kind, "arena_pinned": arena.pinned,
                                     "arena_pin_error": arena.pin_error, "engine_streams": engine.num_streams,
                                     "sizes": []})
    unpinned = "" if arena.pinned else f"arena NOT pinned ({arena.pin_error}): pageable copies"
    peaks: dict[str, float] = {}
    with ctx.progress(len(sizes) * (repeats + 2), NAME) as bar:
        for n in sizes:
            d = dst[:n]
            copies = {"arena": engine_copy(ctx, engine, d, arena_src[:n])}
            if ctx.is_cuda:
                copies["pinned copy_"] = lambda d=d, s=pinned[:n]: d.copy_(s, non_blocking=True)
                copies["pageable copy_"] = lambda d=d, s=pageable[:n]: d.copy_(s, non_blocking=True)
            else:
                copies["torch copy_"] = lambda d=d, s=pageable[:n]: d.copy_(s)
            inner = inner_copies(ctx, n)
            times = compare({k: device_timer(ctx, f, inner=inner) for k, f in copies.items()},
                            repeats=repeats, warmup=2, bar=bar)
            bw = {k: s.map(lambda t, n=n: n / t / GiB) for k, s in times.items()}
            for k, s in bw.items():
                peaks[k] = max(peaks.get(k, 0.0), s.median)
            r = ratio(bw["arena"], bw[ref])
            if ctx.is_cuda:
                targets = [Target.at_least(r, 0.95, ref)] if n >= GPU_TARGET_MIN_BYTES else []
            else:
                targets = [Target.at_least(r, 0.8, ref)]
            result.rows.append(Row(NAME, f"{n // MiB} MiB copy", "GiB/s", bw["arena"],
                                   {k: bw[k] for k in base_names}, {f"/{ref}": r}, targets,
                                   note=unpinned or ("" if targets else "small copy: latency-bound, no target")))
            result.data["sizes"].append({"bytes": n, "inner_copies": inner, "bandwidth_GiBps": bw})
    engine.synchronize()

    r = peaks["arena"] / peaks[ref]
    targets = [Target.at_least(r, 0.95 if ctx.is_cuda else 0.8, ref)]
    result.rows.append(Row(NAME, "peak over sizes", "GiB/s", peaks["arena"], {k: peaks[k] for k in base_names},
                           {f"/{ref}": r}, targets))
    result.data["peak_GiBps"] = peaks
    return result
