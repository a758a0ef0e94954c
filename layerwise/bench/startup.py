"""startup: what configuring a multi-group model costs, for every order of the
group names.

Models: ``models.MultiGroupModel`` with groups small_blocks + large_blocks, and
with extra_blocks as well, plus non-layer modules (embed, norm, head); weights
start on the host.

Ours: ``configure_layerwise_offload`` (every group packed, largest first, then
one ``model.to``). Baseline: the naive per-group order, one
``LayerwiseOffloadManager(..., initialize=True)`` per group in the order named:
each packs its own group and calls ``model.to`` at once, carrying the groups
not packed yet along to the device.

Per configure: the bytes each ``model.to`` call moves (bytes of parameters that
are not (1,) placeholders, and on CUDA not already on the device, counted at
the moment of the call by a wrapper on the instance's ``to``), the peak device
memory (CUDA), the peak host RSS growth, the wall time, and the arena bytes per
streamed byte.

Targets: layerwise moves exactly the non-layer bytes, in one call, for every
order; on CUDA its device peak is non-layer + ring for every order.
"""
from __future__ import annotations

import itertools
import threading
import time

import psutil
import torch

import layerwise

from . import models
from .common import MB, Context, Row, Stat, SuiteResult, Target, clone_module, ratio

NAME = "startup"
OURS, NAIVE = "layerwise", "naive per-group"

# (non-layer width, {group: (blocks, width)}); the first two groups make the
# two-group model, all three the three-group model.
SIZES = {
    ("full", "cuda"): (4096, {"small_blocks": (8, 2048), "large_blocks": (8, 6144), "extra_blocks": (8, 4096)}),
    "full": (1024, {"small_blocks": (4, 512), "large_blocks": (4, 2048), "extra_blocks": (4, 1024)}),
    "quick": (512, {"small_blocks": (4, 256), "large_blocks": (4, 1024), "extra_blocks": (4, 512)}),
    "tiny": (128, {"small_blocks": (2, 64), "large_blocks": (2, 256), "extra_blocks": (2, 128)}),
}
ROUNDING = 2 * MB  # the CUDA caching allocator rounds each large block up to 2 MiB


class PeakRSS:
    """Peak growth of this process's resident set over a `with` block.

    Linux: reset the high-water mark through /proc/self/clear_refs and read
    VmHWM after; elsewhere a psutil thread samples the RSS every millisecond.
    """

    def __enter__(self):
        self.proc = psutil.Process()
        self.start = self.proc.memory_info().rss
        self.peak = self.start
        self.thread = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        if self.thread is not None:
            self.stop.set()
            self.thread.join()
        else:
            with open("/proc/self/status") as f:
                hwm = next(line for line in f if line.startswith("VmHWM:"))
            self.peak = int(hwm.split()[1]) * 1024
        self.growth = max(0, self.peak - self.start)
        return False


def _watch_to(ctx: Context, model) -> list[int]:
    """Wrap the instance's `to`: each call appends the bytes it is about to move."""
    calls: list[int] = []
    original = model.to

    def to(*args, **kwargs):
        calls.append(sum(p.numel() * p.element_size() for p in model.parameters()
                         if tuple(p.shape) != (1,) and not (ctx.is_cuda and p.device == ctx.device)))
        return original(*args, **kwargs)

    model.to = to
    return calls


def _configure(ctx: Context, base, order: tuple, method: str) -> dict:
    model = clone_module(base)
    calls = _watch_to(ctx, model)
    if ctx.is_cuda:
        device_base = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        if method == OURS:
            managers = layerwise.configure_layerwise_offload(model, list(order), device=ctx.device)
        else:
            managers = [layerwise.LayerwiseOffloadManager(model, g, device=ctx.device) for g in order]
        ctx.synchronize()
        seconds = time.perf_counter() - t0
    stats = [m.stats() for m in managers]
    out = {
        "order": list(order), "to_calls_bytes": calls, "moved_bytes": sum(calls), "seconds": seconds,
        "rss_growth_bytes": rss.growth,
        "ring_bytes": sum(s["ring_bytes"] for s in stats),
        "resident_bytes": sum(s["resident_bytes"] for s in stats),
        "arena_bytes": sum(s["arena_bytes"] for s in stats),
        "slots": sum(s["slots"] for s in stats),
    }
    if ctx.is_cuda:
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device) - device_base
        out["device_after_bytes"] = torch.cuda.memory_allocated(ctx.device) - device_base
    del managers, model, stats
    ctx.free_memory()  # managers and hooks form reference cycles: collect before the next configure
    return out


def _model_rows(ctx: Context, label: str, base, runs: dict) -> list[Row]:
    non_layer = base.non_layer_bytes()
    layer_bytes = sum(base.group_bytes().values())
    ours, naive = runs[OURS], runs[NAIVE]
    n = len(ours)
    rows = []

    exact = all(r["to_calls_bytes"] == [non_layer] for r in ours)
    worst = max(r["moved_bytes"] for r in ours)
    rows.append(Row(NAME, f"{label}: bytes moved by model.to, worst of {n} orders", "MB", worst / MB,
                    {"naive worst": max(r["moved_bytes"] for r in naive) / MB,
                     "naive best": min(r["moved_bytes"] for r in naive) / MB, "non-layer": non_layer / MB},
                    {"/non-layer": worst / non_layer},
                    [Target("= non-layer, 1 call, every order", exact)]))

    if ctx.is_cuda:
        # The peak must be what stays allocated after configure (no transient), and
        # that must be non-layer + ring (+ resident), up to the allocator's rounding
        # of each device tensor (slots, non-layer parameters, placeholders).
        tensors = len(base.non_layer_parameters())
        expected = [non_layer + r["ring_bytes"] + r["resident_bytes"] for r in ours]
        ok = all(r["device_peak_bytes"] <= r["device_after_bytes"] + MB
                 and abs(r["device_after_bytes"] - e) <= ROUNDING * (r["slots"] + tensors + len(r["order"]))
                 for r, e in zip(ours, expected))
        worst = max(r["device_peak_bytes"] for r in ours)
        rows.append(Row(NAME, f"{label}: device peak during configure, worst order", "MB", worst / MB,
                        {"naive worst": max(r["device_peak_bytes"] for r in naive) / MB,
                         "naive best": min(r["device_peak_bytes"] for r in naive) / MB,
                         "non-layer + ring": max(expected) / MB},
                        {"/expected": worst / max(expected)},
                        [Target("= non-layer + ring, every order", ok)]))

    t_ours = Stat.of([r["seconds"] * 1e3 for r in ours])
    t_naive = Stat.of([r["seconds"] * 1e3 for r in naive])
    rows.append(Row(NAME, f"{label}: configure time, over orders", "ms", t_ours, {NAIVE: t_naive},
                    {f"/{NAIVE}": ratio(t_ours, t_naive)}))

    rss = max(r["rss_growth_bytes"] for r in ours)
    rss_naive = max(r["rss_growth_bytes"] for r in naive)
    rows.append(Row(NAME, f"{label}: peak host RSS growth, worst order", "MB", rss / MB,
                    {NAIVE: rss_naive / MB, "model": (non_layer + layer_bytes) / MB},
                    {"/model": rss / (non_layer + layer_bytes)}))

    arena = max(r["arena_bytes"] for r in ours)
    rows.append(Row(NAME, f"{label}: host arena bytes per streamed byte", "B/B", arena / layer_bytes,
                    {"per model byte": arena / (non_layer + layer_bytes)}))
    return rows


def run(ctx: Context) -> SuiteResult:
    width, groups = ctx.pick(SIZES)
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    names = list(groups)
    variants = {"2 groups": names[:2], "3 groups": names}
    orders = {label: list(itertools.permutations(g)) for label, g in variants.items()}
    result = SuiteResult(NAME)
    with ctx.progress(sum(2 * len(o) for o in orders.values()), NAME) as bar:
        for label, group_names in variants.items():
            base = models.build(models.MultiGroupModel, width, {g: groups[g] for g in group_names},
                                dtype=dtype, generate_on=ctx.device)
            runs = {OURS: [], NAIVE: []}
            for order in orders[label]:  # the two methods alternate, order by order
                for method in runs:
                    runs[method].append(_configure(ctx, base, order, method))
                    bar.update(1)
            result.data[label] = {"group_bytes": base.group_bytes(), "non_layer_bytes": base.non_layer_bytes(),
                                  "runs": runs}
            result.rows += _model_rows(ctx, label, base, runs)
            del base
    return result
