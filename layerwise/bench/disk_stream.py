"""disk (streaming part): a model streamed with host_budget at 25% of its size
from a checkpoint on a disk file system, against the same model streamed from
the host arena, in one run; and the host memory of such a load in a fresh
process, against the budget: what a budget promises (layerwise.hostmem.
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
No target (the disk is a shared VM's: see BENCHMARKS.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from . import bus
from .common import GB, MB, Context, Row, Target, compare, device_timer, inference_step, ratio
from .models import DiTStack, build

SHAPES = {"full": (1024, 48, 256), "quick": (512, 48, 64), "tiny": (128, 12, 8)}  # hidden, layers, tokens
REPEATS = {"full": 7, "quick": 5, "tiny": 2}

RSS_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import layerwise
    from layerwise.bench.models import DiTStack
    from layerwise.hostmem import MemoryMeter
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

    hi = MB // 4
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


def run(ctx: Context, work: str, direct_gbps: float, fs: str) -> tuple[list[Row], dict]:
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
    models = {"resident": resident}
    for name, kw in (("in memory", {}), ("disk tier", {"host_budget": budget})):
        with torch.device("meta"):
            m = DiTStack(hidden, layers).to(torch.bfloat16)
        layerwise.load_offloaded(m, ckpt, "blocks", device=ctx.device, **kw)
        with torch.inference_mode():
            if not torch.equal(m(x), want):
                raise RuntimeError(f"{name}: the streamed output differs from the resident model's")
        models[name] = m
    (mgr,) = layerwise.contract.managers_of(models["disk tier"])
    bandwidth = bus.transfer_bandwidth(ctx, mgr.plan.layers[0].nbytes)
    samplers = {name: device_timer(ctx, inference_step(m, x)) for name, m in models.items()}
    with ctx.progress(repeats + 1, "disk stream") as bar:
        times = compare(samplers, repeats=repeats, warmup=1, bar=bar)
    st = mgr.stats(sync=True)
    disk = st["disk"]
    per_step = st["last_step"]["bytes_read"]
    copied = st["last_step"]["bytes_copied"]
    read_floor = per_step / (direct_gbps * GB) if direct_gbps else None
    bus_floor = copied / bandwidth
    floor = max(times["resident"].median, read_floor or 0.0, bus_floor)
    for name, m in models.items():
        if name != "resident":
            layerwise.remove_layerwise_offload(m)
    models.clear()
    del resident
    ctx.free_memory()

    rss = {"disk tier": peak_rss(ckpt, (hidden, layers, tokens), budget) if ctx.device.type == "cpu" else None}
    data = {"model_bytes": model_bytes, "host_budget": budget, "disk_layers": disk["layers"],
            "disk_bytes_per_step": per_step, "bytes_copied_per_step": copied, "read_gbps_per_read": disk["read_gbps"],
            "read_wait_s_total": disk["read_wait_s"], "bytes_direct": disk["bytes_direct"],
            "h2d_bandwidth_GBps": bandwidth / 1e9, "step_s": {k: v.median for k, v in times.items()},
            "read_floor_s": read_floor, "bus_floor_s": bus_floor, "floor_s": floor,
            "last_step": st["last_step"], "rss": rss}

    shape = f"DiTStack {layers}x{hidden} bf16, {model_bytes / MB:.0f} MiB, {tokens} tokens, {fs}"
    pct = 100 * budget / model_bytes
    if ctx.is_cuda:
        link = "host -> device"
    else:
        gbps = layerwise._native._C.sim_bus()["gbps"]
        link = f"simulated bus ({gbps:.3g} GB/s)" if gbps else "host memcpy (the CPU backend: no bus)"
    rows = [Row(
        "disk", f"step, host_budget {pct:.0f}% of the model ({disk['layers']} of {layers} layers read from the "
                f"checkpoint every step; {shape})", "s", times["disk tier"],
        {"in memory": times["in memory"], "resident": times["resident"],
         **({"read floor": read_floor} if read_floor else {}), "bus floor": bus_floor, "floor": floor},
        {"/floor": ratio(times["disk tier"], floor), "/in memory": ratio(times["disk tier"], times["in memory"]),
         **({"/read floor": ratio(times["disk tier"], read_floor)} if read_floor else {})},
        [], short=f"step, host_budget {pct:.0f}%",
        note="floor = max(resident step, read floor: the step's disk bytes at the best plain O_DIRECT bandwidth of "
             f"this run; bus floor: the step's copied bytes at the bandwidth measured for the {link}); no target",
    )]
    if rss["disk tier"] is not None:
        r = rss["disk tier"]
        limit = budget * 1.05
        rows.append(Row(
            "disk", f"host memory of load + 3 steps (anonymous + shared pages + the checkpoint's page cache, peak), "
                    f"host_budget {budget / MB:.0f} MiB ({pct:.0f}% of {model_bytes / MB:.0f} MiB)", "MiB",
            r["worst"] / MB, {"budget": budget / MB, "model": model_bytes / MB},
            {"/budget": r["worst"] / budget},
            [Target(f"<= budget + 5% ({limit / MB:.0f} MiB)", bool(r["worst"] <= limit))],
            short="host memory, disk tier",
            note="layerwise.hostmem.MemoryMeter in a fresh process after a warm-up: the larger of the sampled peak "
                 "of RssAnon + RssShmem + the checkpoint's resident pages, and the VmHWM growth",
        ))
    return rows, data
