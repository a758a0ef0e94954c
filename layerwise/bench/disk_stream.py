"""disk (streaming part): a model streamed with host_budget at 25% of its size
from a checkpoint on a disk file system, against the same model streamed from
the host arena, in one run; and the host memory of such a load in a fresh
process, against the budget: what a budget promises (layerwise.planning.host_limits.
MemoryMeter: anonymous + shared-memory pages, and the checkpoint's pages in the
page cache; the peak over the load and 3 steps), after a warm-up on a small
model (one-time imports, e.g. torch._dynamo's ~76 MiB, are not the load's).

Model: DiTStack (bf16; quick 48 blocks of hidden 512 = 192 MiB; full 48 of
1024 = 768 MiB; tiny 12 of 128), saved with safetensors under the disk suite's
work directory. host_budget = 25% of the model, or the smallest budget the
planner accepts if that is more (on a CPU device the slot ring, staging and
non-layer weights are host memory too, and count against it). Methods,
interleaved, medians of the step time:

  resident     the whole model on the device (what the outputs are checked against)
  in memory    load_offloaded(...) with no budget: every layer in the arena
  disk tier    load_offloaded(..., host_budget=B): most layers read from the
               checkpoint (O_DIRECT into pinned staging) at every step

The disk tier's step row has three floors, each measured in the same run:
  read floor   the step's disk bytes (stats()["last_step"]["bytes_read"]) / the
               best plain O_DIRECT bandwidth (1, 2 or 4 threads) of the disk suite;
  bus floor    the step's bytes copied to the device (["bytes_copied"]: out of
               staging and out of the arena) / the host -> device bandwidth
               (bus.transfer_bandwidth: arena copies of one layer; on the CPU a
               host memcpy, or the simulated bus when LAYERWISE_SIM_BUS_GBPS
               sets one);
  floor        max(resident step, read floor, bus floor), and /floor against it.
No target there (the disk is a shared VM's: see BENCHMARKS.md). On the CPU
(without ``LAYERWISE_SIM_BUS_GBPS`` set) the disk tier's step is timed again,
against resident, with its copies across the CPU backend's simulated bus
(bus.simulated_bus), its speed chosen so that the step's copies take BUS_OVER
(4) times its read floor or its resident step, whichever is longer: the step
is then transfer-bound (C/T at most 0.25, so a resident step measured up to
twice as slow on the second pass still counts as transfer-bound) and the bus
floor the floor, so the row shows whether the reads and the compute hide
behind the copies. It carries the bus suite's target for the regime it shows
(transfer-bound <= 1.10x the floor); a miss says what the step waited
on the copies and on reads, and what reads and copies one after the other
would take.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import torch

from layerwise.bench import bus
from layerwise.bench.common import (
    Context,
    GiB,
    MiB,
    Row,
    Target,
    bus_gibps,
    compare,
    device_timer,
    inference_step,
    median,
    ratio,
)
from layerwise.bench.models import DiTStack, build
from layerwise.bench.stream import regime

SHAPES = {"full": (1024, 48, 256), "quick": (512, 48, 64), "tiny": (128, 12, 8)}  # hidden, layers, tokens
REPEATS = {"full": 7, "quick": 5, "tiny": 2}
BUS_OVER = 4.0  # the CPU's bus point: the step's copies take 4x its read floor or resident step, the longer
# (at 2x a resident-bound step sat on the regime's edge, C/T 0.5: a slower second pass made it "balanced")

RSS_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import layerwise
    from layerwise.bench.models import DiTStack
    from layerwise.planning.host_limits import MemoryMeter
    torch.set_num_threads({threads})
    hidden, layers, tokens = {shape}
    ckpt = {ckpt!r}

    x = torch.randn(1, tokens, hidden).to(torch.bfloat16)
    # the same code paths once on a small model: one-time imports and kernels' own memory are not the load's
    small = DiTStack(hidden, 2).to(torch.bfloat16)
    layerwise.configure_layerwise_offload(small, "blocks", device="cpu")
    small(x)
    layerwise.remove_layerwise_offload(small)
    del small
    with torch.device("meta"):
        model = DiTStack(hidden, layers).to(torch.bfloat16)
    fd = os.open(ckpt, os.O_RDONLY)  # written by the bench: its page cache is not the load's
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    kw = {{"host_budget": {budget}}} if {budget} else {{}}
    with MemoryMeter(lambda: [ckpt]) as meter:
        (m,) = layerwise.load_offloaded(model, ckpt, "blocks", device="cpu", **kw)
        with torch.inference_mode():
            for _ in range(3):
                model(x)
    disk = m.stats()["disk"]
    print(json.dumps({{**meter.as_dict(), "staging": disk["staging_bytes"] if disk else 0}}))
""")


def smallest_budget(hidden: int, layers: int, ckpt: str, device) -> int:
    """The smallest host_budget the planner accepts for this model (to 1/64)."""
    import layerwise

    def fits(b):
        with torch.device("meta"):
            probe = DiTStack(hidden, layers).to(torch.bfloat16)
        try:
            layerwise.load_offloaded(probe, ckpt, "blocks", device=device, host_budget=b)
        except ValueError:
            return False
        layerwise.remove_layerwise_offload(probe)
        return True

    hi = MiB // 4
    while not fits(hi):
        hi *= 2
    lo = hi // 2
    while hi - lo > hi // 64:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def peak_rss(ckpt: str, shape, budget: int) -> dict:
    script = RSS_SCRIPT.format(threads=torch.get_num_threads(), shape=tuple(shape), ckpt=ckpt, budget=budget)
    import layerwise

    root = os.path.dirname(os.path.dirname(os.path.abspath(layerwise.__file__)))  # this layerwise, not another
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"peak RSS subprocess failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load(ckpt: str, hidden: int, layers: int, device, x, want, name: str, **kw):
    """The DiTStack loaded with load_offloaded(**kw), its output checked against `want`."""
    import layerwise

    with torch.device("meta"):
        m = DiTStack(hidden, layers).to(torch.bfloat16)
    layerwise.load_offloaded(m, ckpt, "blocks", device=device, **kw)
    with torch.inference_mode():
        if not torch.equal(m(x), want):
            raise RuntimeError(f"{name}: the streamed output differs from the resident model's")
    return m


def _link(ctx: Context) -> str:
    """What the copies to the device crossed in this run, for a note."""
    from layerwise._native import sim_bus

    if ctx.is_cuda:
        return "host -> device"
    gbps = sim_bus()["gbps"]
    return f"simulated bus ({bus_gibps(gbps):.3g} GiB/s)" if gbps else "host memcpy (the CPU backend: no bus)"


def _timed(ctx: Context, models: dict, x, repeats: int, bar, direct_gibps: float) -> tuple[dict, dict, dict]:
    """The step times of `models` (interleaved), the disk tier's stats, and its floors:
    the read floor (disk bytes at `direct_gibps`, None without it) and the bus floor
    (copied bytes at the bandwidth measured here, across whatever bus the copies cross
    now)."""
    import layerwise

    (mgr,) = layerwise.contract.managers_of(models["disk tier"])
    bandwidth = bus.transfer_bandwidth(ctx, mgr.plan.layers[0].nbytes)
    samplers = {name: device_timer(ctx, inference_step(m, x)) for name, m in models.items()}
    times = compare(samplers, repeats=repeats, warmup=1, bar=bar)
    st = mgr.stats(sync=True)
    last = st["last_step"]
    read_floor = last["bytes_read"] / (direct_gibps * GiB) if direct_gibps else None
    return times, st, {"read floor": read_floor, "bus floor": last["bytes_copied"] / bandwidth,
                       "h2d_bandwidth_GiBps": bandwidth / GiB, "link": _link(ctx)}


def _step_row(measure: str, short: str, times: dict, f: dict, last: dict, targets: bool = False) -> Row:
    """The disk tier's step against resident, in memory (when timed) and its floors;
    with `targets`, the bus suite's at the step's C/T (resident / bus floor), a miss
    saying what the step waited on."""
    resident = times["resident"].median
    floor = max(resident, f["read floor"] or 0.0, f["bus floor"])
    ours = times["disk tier"]
    base = {**{k: times[k] for k in ("in memory", "resident") if k in times},
            **({"read floor": f["read floor"]} if f["read floor"] else {}), "bus floor": f["bus floor"], "floor": floor}
    ratios = {"/floor": ratio(ours, floor)}
    if "in memory" in times:
        ratios["/in memory"] = ratio(ours, times["in memory"])
    if f["read floor"]:
        ratios["/read floor"] = ratio(ours, f["read floor"])
    note = ("floor = max(resident step, read floor: the step's disk bytes at the best plain O_DIRECT bandwidth of "
            f"this run; bus floor: the step's copied bytes at the bandwidth measured for the {f['link']})")
    checks = []
    if targets:
        ratios["/resident"] = ratio(ours, times["resident"])
        kind = regime(resident / f["bus floor"])
        checks = bus.step_targets(kind, ratios)
        measure += f" ({kind})"
        if not all(t.met for t in checks):
            reads, copies = (f["read floor"] or 0.0) * 1e3, f["bus floor"] * 1e3
            note = bus.miss_note(last["stall_s"], copies, resident * 1e3,
                                 f"not on reads (the host waited {last['read_wait_s'] * 1e3:.2f} ms on them); one "
                                 f"after the other, reads and copies would take {reads + copies:.0f} ms, compute and "
                                 f"copies {resident * 1e3 + copies:.0f} ms, against the step's "
                                 f"{median(ours) * 1e3:.0f} ms") + "; " + note
    else:
        note += "; no target"
    return Row("disk", measure, "s", ours, base, ratios, checks, short=short, note=note)


def run(ctx: Context, work: str, direct_gibps: float, fs: str) -> tuple[list[Row], dict]:
    import layerwise

    hidden, layers, tokens = ctx.pick(SHAPES)
    repeats = ctx.pick(REPEATS)
    ref = build(DiTStack, hidden, layers, dtype=torch.bfloat16, generate_on=torch.device("cpu"))
    model_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    ckpt = os.path.join(work, "model.safetensors")
    from safetensors.torch import save_file

    save_file(ref.state_dict(), ckpt)
    x = torch.randn(1, tokens, hidden, dtype=torch.float32).to(torch.bfloat16).to(ctx.device)
    resident = ref.to(ctx.device)
    with torch.inference_mode():
        want = resident(x)
    del ref

    budget = max(model_bytes // 4, smallest_budget(hidden, layers, ckpt, ctx.device))
    load = functools.partial(_load, ckpt, hidden, layers, ctx.device, x, want)
    models = {"resident": resident, "in memory": load("in memory"), "disk tier": load("disk tier", host_budget=budget)}
    # On the CPU without a simulated bus: the same step again over one, its speed such that the step's copies
    # take BUS_OVER times its read floor or its resident step, the longer: the step is then transfer-bound,
    # and shows whether the reads and the compute hide behind the bus.
    over_bus = not ctx.is_cuda and not os.environ.get(bus.ENV) and direct_gibps > 0
    with ctx.progress((repeats + 1) * (2 if over_bus else 1), "disk stream") as bar:
        times, st, floors = _timed(ctx, models, x, repeats, bar, direct_gibps)
        disk, last = st["disk"], st["last_step"]
        for name in ("in memory", "disk tier"):
            layerwise.remove_layerwise_offload(models.pop(name))
        ctx.free_memory()
        bus_data = None
        if over_bus:
            longer = max(floors["read floor"], times["resident"].median)
            gbps = last["bytes_copied"] / (BUS_OVER * longer) / 1e9
            with bus.simulated_bus(gbps) as cfg:
                models["disk tier"] = load("disk tier over the simulated bus", host_budget=budget)
                bus_times, bus_st, bus_floors = _timed(ctx, models, x, repeats, bar, direct_gibps)
                layerwise.remove_layerwise_offload(models.pop("disk tier"))
            bus_data = {"bus": cfg, "bus_over": BUS_OVER, "chosen_for_s": longer,
                        "step_s": {k: v.median for k, v in bus_times.items()}, "last_step": bus_st["last_step"],
                        "read_floor_s": bus_floors["read floor"], "bus_floor_s": bus_floors["bus floor"],
                        "h2d_bandwidth_GiBps": bus_floors["h2d_bandwidth_GiBps"]}
    models.clear()
    del resident
    ctx.free_memory()

    rss = {"disk tier": peak_rss(ckpt, (hidden, layers, tokens), budget) if ctx.device.type == "cpu" else None}
    data = {"model_bytes": model_bytes, "host_budget": budget, "disk_layers": disk["layers"],
            "disk_bytes_per_step": last["bytes_read"], "bytes_copied_per_step": last["bytes_copied"],
            "read_gbps_per_read": disk["read_gbps"], "read_wait_s_total": disk["read_wait_s"],
            "bytes_direct": disk["bytes_direct"], "h2d_bandwidth_GiBps": floors["h2d_bandwidth_GiBps"],
            "step_s": {k: v.median for k, v in times.items()}, "read_floor_s": floors["read floor"],
            "bus_floor_s": floors["bus floor"], "last_step": last, "over_bus": bus_data, "rss": rss}

    shape = f"DiTStack {layers}x{hidden} bf16, {model_bytes / MiB:.0f} MiB, {tokens} tokens, {fs}"
    pct = 100 * budget / model_bytes
    what = f"host_budget {pct:.0f}% of the model ({disk['layers']} of {layers} layers read from the checkpoint every " \
           f"step; {shape})"
    rows = [_step_row(f"step, {what}", f"step, host_budget {pct:.0f}%", times, floors, last)]
    if bus_data is not None:
        g = bus_data["bus"]["gbps"]
        rows.append(_step_row(f"step over the simulated bus ({bus_gibps(g):.3g} GiB/s: its copies {BUS_OVER:g}x the "
                              f"read floor or the resident step), {what}", f"bus step, host_budget {pct:.0f}%",
                              bus_times, bus_floors, bus_data["last_step"], targets=True))
    if rss["disk tier"] is not None:
        r = rss["disk tier"]
        limit = budget * 1.05
        rows.append(Row(
            "disk", f"host memory of load + 3 steps (anonymous + shared pages + the checkpoint's page cache, peak), "
                    f"host_budget {budget / MiB:.0f} MiB ({pct:.0f}% of {model_bytes / MiB:.0f} MiB)", "MiB",
            r["worst"] / MiB, {"budget": budget / MiB, "model": model_bytes / MiB},
            {"/budget": r["worst"] / budget},
            [Target(f"<= budget + 5% ({limit / MiB:.0f} MiB)", bool(r["worst"] <= limit))],
            short="host memory, disk tier",
            note="layerwise.planning.host_limits.MemoryMeter in a fresh process after a warm-up: the larger of the "
                 "sampled peak of RssAnon + RssShmem + the checkpoint's resident pages, and the VmHWM growth",
        ))
    return rows, data
