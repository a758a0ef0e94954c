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

Per configure: the bytes each ``model.to`` call moves to the device (counted at
the moment of the call by a wrapper on the instance's ``to``, see _watch_to; on
the CPU, what a GPU would receive), the peak device memory (CUDA), the peak
host RSS growth, the wall time, and the arena bytes per streamed byte.

Targets: layerwise moves exactly the non-layer bytes, in one call, for every
order; on CUDA its device peak is non-layer + ring for every order; its host
RSS growth stays within the largest layer + 5% of the model (docs/design.md's host
peak; on the CPU plus the ring, which lives in host memory there).

The suite runs in a fresh interpreter, so that the allocator's state left by
earlier suites does not blur the host-memory figures (see unmap_freed_memory).
"""
from __future__ import annotations

import ctypes
import itertools
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import torch

import layerwise
from layerwise.bench import models
from layerwise.bench.common import Context, MiB, Row, Stat, SuiteResult, Target, clone_module, ratio
from layerwise.stages.disk.reader import held_interrupts

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
ROUNDING = 2 * MiB  # the CUDA caching allocator rounds each large block up to 2 MiB


def unmap_freed_memory() -> bool:
    """Make every host tensor its own mapping, unmapped when freed (glibc only;
    True if applied). Call it before anything large is allocated.

    glibc serves allocations below a dynamic mmap threshold (which grows up to
    32 MiB as large blocks are freed), and any that fit a free chunk of its
    heap, from that heap and keeps them there when freed: the RSS would not
    fall as configure frees each original, and the growth would show the
    allocator's retention, not what the packer holds. Hence a fixed 64 KiB
    threshold, in a fresh process whose heap holds no earlier suite's chunks.
    """
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024) == 1  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


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


def _watch_to(ctx: Context, model, streamed: set) -> list[int]:
    """Wrap the instance's `to`: each call appends the bytes a GPU would receive.

    Counted: parameters that are not (1,) placeholders, not in a group named in
    `streamed` (groups already configured: their parameters are views of the
    ring, which a GPU holds already) and not already on the device: on CUDA the
    parameter's device says so; on the CPU, where everything is "on the device",
    a parameter counted by an earlier call is taken to be there.
    """
    calls: list[int] = []
    moved: set[int] = set()
    original = model.to

    def on_device(p) -> bool:
        return p.device == ctx.device if ctx.is_cuda else id(p) in moved

    def to(*args, **kwargs):
        skip = {id(p) for g in streamed for p in model.get_submodule(g).parameters()}
        params = [p for p in model.parameters() if tuple(p.shape) != (1,) and id(p) not in skip and not on_device(p)]
        calls.append(sum(p.numel() * p.element_size() for p in params))
        moved.update(id(p) for p in params)
        return original(*args, **kwargs)

    model.to = to
    return calls


def _configure(ctx: Context, base, order: tuple, method: str) -> dict:
    """Configure a fresh copy of `base` by `method` with the groups in `order`;
    the figures of that one configure."""
    model = clone_module(base)
    streamed: set[str] = set()
    calls = _watch_to(ctx, model, streamed)
    if ctx.is_cuda:
        device_base = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        if method == OURS:
            managers = layerwise.configure_layerwise_offload(model, list(order), device=ctx.device)
        else:
            managers = []
            for g in order:
                managers.append(layerwise.LayerwiseOffloadManager(model, g, device=ctx.device))
                streamed.add(g)
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


def _model_rows(ctx: Context, label: str, base, runs: dict, unmap_on_free: bool) -> list[Row]:
    non_layer = base.non_layer_bytes()
    layer_bytes = sum(base.group_bytes().values())
    ours, naive = runs[OURS], runs[NAIVE]
    n = len(ours)
    rows = []

    exact = all(r["to_calls_bytes"] == [non_layer] for r in ours)
    worst = max(r["moved_bytes"] for r in ours)
    rows.append(Row(NAME, f"{label}: bytes moved by model.to, worst of {n} orders", "MiB", worst / MiB,
                    {"naive worst": max(r["moved_bytes"] for r in naive) / MiB,
                     "naive best": min(r["moved_bytes"] for r in naive) / MiB, "non-layer": non_layer / MiB},
                    {"/non-layer": worst / non_layer},
                    [Target("= non-layer, 1 call, every order", exact)]))

    if ctx.is_cuda:
        # The peak must be what stays allocated after configure (no transient), and
        # that must be non-layer + ring (+ resident), up to the allocator's rounding
        # of each device tensor (slots, non-layer parameters, placeholders).
        tensors = len(base.non_layer_parameters())
        expected = [non_layer + r["ring_bytes"] + r["resident_bytes"] for r in ours]
        ok = all(r["device_peak_bytes"] <= r["device_after_bytes"] + MiB
                 and abs(r["device_after_bytes"] - e) <= ROUNDING * (r["slots"] + tensors + len(r["order"]))
                 for r, e in zip(ours, expected))
        worst = max(r["device_peak_bytes"] for r in ours)
        rows.append(Row(NAME, f"{label}: device peak during configure, worst order", "MiB", worst / MiB,
                        {"naive worst": max(r["device_peak_bytes"] for r in naive) / MiB,
                         "naive best": min(r["device_peak_bytes"] for r in naive) / MiB,
                         "non-layer + ring": max(expected) / MiB},
                        {"/expected": worst / max(expected)},
                        [Target("= non-layer + ring, every order", ok)]))

    t_ours = Stat.of([r["seconds"] * 1e3 for r in ours])
    t_naive = Stat.of([r["seconds"] * 1e3 for r in naive])
    rows.append(Row(NAME, f"{label}: configure time, over orders", "ms", t_ours, {NAIVE: t_naive},
                    {f"/{NAIVE}": ratio(t_ours, t_naive)}))

    # docs/design.md: peak host memory during configure <= model + the largest layer
    # + a few percent, i.e. RSS growth (the model is resident before) <= the
    # largest layer + 5% of the model; on the CPU the "device" ring is host
    # memory too. Judged only where freed memory leaves the RSS.
    model_bytes = non_layer + layer_bytes
    rss = max(r["rss_growth_bytes"] for r in ours)
    rss_naive = max(r["rss_growth_bytes"] for r in naive)
    ok = all(r["rss_growth_bytes"] <= base.largest_layer_bytes() + 0.05 * model_bytes
             + (0 if ctx.is_cuda else r["ring_bytes"] + r["resident_bytes"]) for r in ours)
    label_ring = "" if ctx.is_cuda else " + ring"
    targets = [Target(f"<= largest layer{label_ring} + 5% of model", ok)] if unmap_on_free else []
    rows.append(Row(NAME, f"{label}: peak host RSS growth, worst order", "MiB", rss / MiB,
                    {NAIVE: rss_naive / MiB, "largest layer": base.largest_layer_bytes() / MiB,
                     "model": model_bytes / MiB},
                    {"/model": rss / model_bytes}, targets,
                    note="" if unmap_on_free else "freed memory stays resident here: no target"))

    arena = max(r["arena_bytes"] for r in ours)
    rows.append(Row(NAME, f"{label}: host arena bytes per streamed byte", "B/B", arena / layer_bytes,
                    {"per model byte": arena / (non_layer + layer_bytes)}))
    return rows


def run(ctx: Context) -> SuiteResult:
    """Measure in a fresh interpreter (see unmap_freed_memory): the suite's result
    comes back pickled; its progress and errors go to this process's stderr."""
    with held_interrupts():  # made with the finalizer that removes it (at exit at the latest) as one step
        made = tempfile.TemporaryDirectory()
    with made as tmp:
        out = os.path.join(tmp, "result.pkl")
        args = [str(ctx.device), ctx.scale, str(int(ctx.show_progress)), str(torch.get_num_threads()), out]
        proc = subprocess.run([sys.executable, "-c", f"from {__name__} import _child; _child()", *args])
        if proc.returncode != 0:
            raise RuntimeError(f"the startup suite's process exited with status {proc.returncode} (traceback above)")
        with open(out, "rb") as f:
            return pickle.load(f)


def _child() -> None:
    unmap_on_free = unmap_freed_memory()
    device, scale, progress, threads, out = sys.argv[1:]
    torch.set_num_threads(int(threads))
    result = measure(Context(torch.device(device), scale, show_progress=progress == "1"), unmap_on_free)
    with open(out, "wb") as f:
        pickle.dump(result, f)


def measure(ctx: Context, unmap_on_free: bool = False) -> SuiteResult:
    """The suite itself, in this process (host-RSS figures are judged only when
    `unmap_on_free` was applied first)."""
    width, groups = ctx.pick(SIZES)
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    names = list(groups)
    variants = {"2 groups": names[:2], "3 groups": names}
    orders = {label: list(itertools.permutations(g)) for label, g in variants.items()}
    result = SuiteResult(NAME, data={"unmap_on_free": unmap_on_free})
    # Warm-up, discarded: the first configure in a process pays one-time costs
    # (lazy imports, the first engine and its threads, allocator pools).
    small_width, small_groups = SIZES["tiny"]
    small = models.build(models.MultiGroupModel, small_width, small_groups, dtype=dtype, generate_on=ctx.device)
    for method in (OURS, NAIVE):
        _configure(ctx, small, tuple(small_groups), method)
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
            result.rows += _model_rows(ctx, label, base, runs, unmap_on_free)
            del base
    return result
