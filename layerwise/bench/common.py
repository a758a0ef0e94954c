"""What every suite shares: the run context, interleaved timing, robust
statistics, the rows of the final table and small formatting helpers.

Timing rules (docs/design.md, "Performance targets"): warm up first, interleave the methods
(round-robin, the starting method rotated every round), report the median with
the 20% / 80% quantiles. On CUDA a sample is timed with CUDA events on the
current stream; on the CPU with ``time.perf_counter`` around synchronous work.
"""
from __future__ import annotations

import copy
import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

# One convention in every row, label and note: sizes in MiB, bandwidths in GiB/s
# (the sizes measured are powers of two: a 64 MiB copy, 16 MiB layers, 2 MiB
# allocator blocks).
MiB = 1 << 20
GiB = 1 << 30


def bus_gibps(gbps: float) -> float:
    """The simulated bus's bandwidth in GiB/s: LAYERWISE_SIM_BUS_GBPS and
    ``_C.sim_bus()["gbps"]`` give it in decimal GB/s, as the library reports
    its own copy rates."""
    return gbps * 1e9 / GiB


class Skip(Exception):
    """Raised by a suite (or a method inside one) that cannot run here; the message says why."""


# ---------------------------------------------------------------- context
@dataclass
class Context:
    """Where and how big the run is.

    scale: "full" (sized for a big GPU, or a long CPU run), "quick" (what
    ``make bench`` runs on a CPU, minutes) or "tiny" (the test suite, seconds).
    """

    device: torch.device
    scale: str = "full"
    show_progress: bool = True

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def pick(self, table: dict):
        """table[(scale, device type)], falling back to table[scale]."""
        return table.get((self.scale, self.device.type), table.get(self.scale))

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def free_memory(self) -> None:
        """Collect garbage (managers hold reference cycles) and return cached device memory."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def progress(self, total: int, desc: str):
        """A progress bar on stderr (tqdm; silent when stderr is not a terminal)."""
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                    disable=None if self.show_progress else True)


def stream_handle(device: torch.device) -> int:
    """torch's current stream on `device` as a raw handle, for CopyEngine.wait/record (0 on CPU)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def inference_step(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A callable that runs model(x) under inference_mode and returns the output."""
    def step() -> torch.Tensor:
        with torch.inference_mode():
            return model(x)
    return step


def check_bitwise(steps: dict, reference: torch.Tensor, what: str) -> None:
    """The first and the second step of every layerwise method (its name starts with
    "layerwise") equal `reference`, or an AssertionError says which differs and how much."""
    for name, step in steps.items():
        if not name.startswith("layerwise"):
            continue
        for k in (1, 2):
            out = step()
            if not torch.equal(out, reference):
                diff = (out.float() - reference.float()).abs().max().item()
                raise AssertionError(f"{what}, {name}, step {k}: output differs from the resident model's "
                                     f"(max |diff| {diff:.3g})")


def mlp_stack(layers: int, d: int) -> nn.Module:
    """A module whose `blocks` are `layers` MLP blocks (d -> 4d -> d, no bias, a
    residual): 32 d^2 bytes of fp32 weights each. The model of the multi-process
    suites (split, shared), whose processes build it by name."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(d, 4 * d, bias=False)
            self.down = nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])

        def forward(self, x):  # (the split suite's run_together calls the model; the others call the blocks)
            for b in self.blocks:
                x = b(x)
            return x

    return Stack()


def finish_processes(procs: list, outs: list, timeout: float, what: str) -> list:
    """Wait for the worker processes of a multi-process suite (split, shared), then
    read the JSON each wrote to its path in `outs`. A worker still running at
    `timeout` is killed; the first that failed is raised with its stderr's tail
    (`what`: the suite and run, for the message)."""
    import json

    errs = []
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [(i, p.returncode, e) for i, (p, e) in enumerate(zip(procs, errs)) if p.returncode != 0]
    if bad:
        i, rc, err = bad[0]
        raise RuntimeError(f"{what}: process {i} exited with {rc}:\n{(err or '')[-3000:]}")
    res = []
    for path in outs:
        with open(path) as f:
            res.append(json.load(f))
    return res


def clone_module(model: nn.Module) -> nn.Module:
    """An independent copy of a (host) model: every method gets its own weights."""
    return copy.deepcopy(model)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------- statistics
@dataclass
class Stat:
    """Median and 20% / 80% quantiles of repeated samples."""

    median: float
    q20: float
    q80: float
    samples: list = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, samples) -> Stat:
        xs = [float(x) for x in samples]
        if not xs:
            raise ValueError("no samples")
        q20, med, q80 = (float(q) for q in np.quantile(xs, [0.2, 0.5, 0.8]))
        return cls(*_ordered(med, q20, q80, min(xs), max(xs)), xs)

    def shown(self) -> tuple[float, float, float]:
        """(median, q20, q80) as printed: inside the measured range [min, max] of
        the samples (when they are known) and ordered q20 <= median <= q80."""
        if not self.samples:
            return _ordered(self.median, self.q20, self.q80, -math.inf, math.inf)
        return _ordered(self.median, self.q20, self.q80, min(self.samples), max(self.samples))

    def map(self, f: Callable[[float], float]) -> Stat:
        """The statistic of f(sample) (f may be decreasing, e.g. time -> bandwidth)."""
        return Stat.of([f(x) for x in self.samples])

    def to_json(self) -> dict:
        return {"median": self.median, "q20": self.q20, "q80": self.q80, "n": len(self.samples),
                "samples": self.samples}


def _ordered(med: float, q20: float, q80: float, lo: float, hi: float) -> tuple[float, float, float]:
    """Clamp the three to [lo, hi] and order them around the median (guards
    against float rounding and against statistics built by hand or read back)."""
    med = min(max(med, lo), hi)
    return med, min(max(q20, lo), med), max(min(q80, hi), med)


def median(v) -> float | None:
    """The central value of a Stat or a plain number."""
    return v.median if isinstance(v, Stat) else v


# ----------------------------------------------------------------- timing
Sampler = Callable[[], float]  # one timed sample, in seconds


def device_timer(ctx: Context, fn: Callable[[], object], inner: int = 1,
                 prepare: Callable[[], object] | None = None) -> Sampler:
    """A sampler: seconds per call of `fn`, over `inner` back-to-back calls.

    The device is synchronised before each sample; `prepare` (not timed) runs
    right before the timed calls without a synchronisation in between, so a
    pipeline it starts (prefetches in flight) is in its steady state when the
    clock starts. CUDA: events on the current stream; CPU: perf_counter (fn
    must be synchronous there).
    """
    if ctx.is_cuda:
        def sample() -> float:
            torch.cuda.synchronize(ctx.device)
            if prepare is not None:
                prepare()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
    else:
        def sample() -> float:
            if prepare is not None:
                prepare()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t0) / inner
    return sample


def host_timer(ctx: Context, fn: Callable[[], object], inner: int = 1) -> Sampler:
    """A sampler: host (CPU) seconds per call of `fn`; device work is synchronised
    before and after the sample, outside the clock."""
    def sample() -> float:
        ctx.synchronize()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        dt = time.perf_counter() - t0
        ctx.synchronize()
        return dt / inner
    return sample


def compare(samplers: dict[str, Sampler], repeats: int, warmup: int = 1, bar=None) -> dict[str, Stat]:
    """Time every method `warmup + repeats` times, interleaved round-robin.

    The first `warmup` rounds are discarded. The order inside a round rotates,
    so no method always runs first (or right after the same neighbour).
    """
    names = list(samplers)
    samples: dict[str, list] = {n: [] for n in names}
    for r in range(warmup + repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t = samplers[name]()
            if r >= warmup:
                samples[name].append(t)
        if bar is not None:
            bar.update(1)
    return {n: Stat.of(s) for n, s in samples.items()}


# ------------------------------------------------------------ table rows
@dataclass
class Target:
    """A pass/fail criterion on one of a row's ratios: ratio <= limit (or >= limit)."""

    label: str  # e.g. ">= 0.95x pinned"
    met: bool

    @classmethod
    def at_least(cls, ratio: float, limit: float, of: str) -> Target:
        return cls(f">= {limit:g}x {of}", bool(ratio >= limit))

    @classmethod
    def at_most(cls, ratio: float, limit: float, of: str) -> Target:
        return cls(f"<= {limit:g}x {of}", bool(ratio <= limit))


@dataclass
class Row:
    """One line of the final table.

    ours / baselines: a Stat (timed, median shown) or a plain number;
    ratios: name -> value, e.g. {"/pinned": 0.97}; targets: the criteria that
    apply on this device (none: the table says "n/a"); note: shown with the
    row (a footnote in the default table); short: a shorter label for the
    default 120-column table (``measure`` when empty; --wide and the JSON
    always carry ``measure``).
    """

    suite: str
    measure: str
    unit: str
    ours: Stat | float | None
    baselines: dict = field(default_factory=dict)
    ratios: dict = field(default_factory=dict)
    targets: list = field(default_factory=list)
    note: str = ""
    short: str = ""

    @property
    def met(self) -> bool | None:
        return all(t.met for t in self.targets) if self.targets else None

    def to_json(self) -> dict:
        return {
            "suite": self.suite, "measure": self.measure, "unit": self.unit,
            "ours": self.ours, "baselines": self.baselines, "ratios": self.ratios,
            "targets": [{"label": t.label, "met": t.met} for t in self.targets],
            "met": self.met, "note": self.note, "short": self.short,
        }


@dataclass
class SuiteResult:
    name: str
    status: str = "ok"  # ok | skipped | error
    reason: str = ""
    rows: list = field(default_factory=list)
    data: dict = field(default_factory=dict)
    wall_s: float = 0.0


def ratio(a, b) -> float:
    """median(a) / median(b), NaN when undefined."""
    a, b = median(a), median(b)
    if a is None or b is None or b == 0:
        return math.nan
    return a / b


def fmt_num(x) -> str:
    """A number with about 3-4 significant digits, no exponent for ordinary magnitudes."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    x = float(x)
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.1f}"
    if ax >= 10:
        return f"{x:.2f}"
    if ax >= 0.01 or ax == 0:
        return f"{x:.3f}"
    return f"{x:.2e}"


def fmt_value(v) -> str:
    """A plain number, or a Stat as ``median [q20, q80]`` (a comma between the
    quantiles, so a minus sign cannot pass for a dash)."""
    if isinstance(v, Stat):
        med, q20, q80 = v.shown()
        return f"{fmt_num(med)} [{fmt_num(q20)}, {fmt_num(q80)}]"
    return fmt_num(v)
