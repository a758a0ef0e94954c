"""compile: a streamed model under ``torch.compile(fullgraph=True)`` beside the
same model eager and resident, at a compute-bound and a transfer-bound point.

Model: ``models.DiTStack`` (the stream suite's; fp32 on the CPU, bf16 on CUDA).
Five configurations, each on its own copy of the weights, timed interleaved:
  eager resident     the plain model;
  eager streamed     configure_layerwise_offload, prefetch depth 1;
  compiled resident  the plain model under torch.compile(fullgraph=True);
  compiled twin      the model configured with every layer resident (nothing
                     streams), compiled the same way: the streamed model's
                     operator boundaries (layerwise::layer_ready / layer_done
                     around every block), so inductor fuses the same kernels. It is
                     the bitwise reference of compiled streaming: the plain
                     compiled model may differ in the last bits, inductor fusing
                     across block boundaries there;
  compiled streamed  the streamed model under torch.compile(fullgraph=True).

Points. On the CPU both points run the same tokens (compiled once) over the
simulated bus (docs/simulated-bus.md), its speed set from the compiled resident
step measured in the same run: one step's streamed bytes take a quarter of it
(compute-bound), then four times it (transfer-bound). On CUDA the bus is the
real one and the points are two token counts (each shape compiled once). A row
names the regime its own figures show: C/T = compiled resident step / (streamed
bytes / the bandwidth measured through the same bus).

A step is the median of the timed repetitions after a warm-up round; the first
call of a shape, which compiles, is timed apart (its seconds include tracing,
inductor, and one step; inductor's caches as torch configures them, so a graph
compiled before, by the twin or by an earlier run, loads from the cache).

Counted, in the JSON: the graph breaks dynamo meets tracing the streamed model
without fullgraph (torch._dynamo.explain, its breaks read from dynamo's counters;
torch.compile(module) calls the root module's hooks outside the forward's frame,
so dynamo traces them as two graphs of their own: 3 graphs, no break), and those
of each real compile; the graphs each configuration's first call of a shape
compiled; recompiles: graphs compiled while a configuration was timed. With a
break, every configuration is compiled without fullgraph, so that the suite
still times it and its row shows the miss.

On the CPU the suite sets the simulated bus itself at each point (a
LAYERWISE_SIM_BUS_GBPS in the environment is set aside meanwhile).

Targets (compiled streamed rows): compute-bound (C/T >= 2) <= 1.05x compiled
resident, transfer-bound (C/T <= 0.5) <= 1.10x the floor max(compiled resident
step, streamed bytes / bandwidth); at every point 0 graph breaks, 0 recompiles
and an output bitwise equal to the compiled twin's. The eager streamed output
must equal the eager resident's bitwise (a mismatch fails the suite, as in the
stream suite); its floor is max(eager resident step, the same transfer).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict, dataclass

import torch

import layerwise
from layerwise.bench import bus, models
from layerwise.bench.common import (
    Context,
    GiB,
    Row,
    SuiteResult,
    Target,
    bus_gibps,
    clone_module,
    compare,
    device_timer,
    inference_step,
    ratio,
)
from layerwise.bench.stream import regime

NAME = "compile"
EAGER_RESIDENT, EAGER_STREAMED = "eager resident", "eager streamed"
COMPILED, TWIN, STREAMED = "compiled resident", "compiled twin", "compiled streamed"
CONFIGS = (EAGER_RESIDENT, EAGER_STREAMED, COMPILED, TWIN, STREAMED)
COMPILED_CONFIGS = (COMPILED, STREAMED, TWIN)  # compile order: the streamed graph before its twin's identical one
TARGET_RESIDENT, TARGET_FLOOR = bus.TARGET_RESIDENT, bus.TARGET_FLOOR
GROUPS = ["blocks"]
COMPILE_NOTE = ("a first call traces, compiles and runs one step; compiled in this order: compiled resident (the "
                "process's first compile also starts inductor), compiled streamed, compiled twin (the streamed "
                "graph's operators again: mostly loaded from inductor's caches)")


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int  # more than a depth-1 ring holds: every layer crosses the bus every step
    tokens: tuple  # per point, the compute-bound point first
    repeats: int
    bus_ct: tuple = ()  # CPU, per point: the C/T the simulated bus is set for


SIZES = {
    # 2 CPU cores of an AMD EPYC VM, fp32, 1 compute thread: a 256-wide block is 2 MiB and computes 256
    # tokens in about 4 ms, long beside a hook's cost; compile takes most of the suite's time.
    ("full", "cpu"): Size(512, 8, (256, 256), 9, (4.0, 0.25)),
    ("quick", "cpu"): Size(256, 8, (256, 256), 9, (4.0, 0.25)),
    ("tiny", "cpu"): Size(64, 4, (16, 16), 2, (4.0, 0.25)),
    # bf16, the stream suite's CUDA sizes: 65536 tokens compute several times a layer's copy,
    # 256 tokens a small part of it.
    ("full", "cuda"): Size(4096, 16, (65536, 256), 5),
    ("quick", "cuda"): Size(2048, 16, (65536, 256), 4),
    ("tiny", "cuda"): Size(256, 4, (256, 16), 2),
}


@contextlib.contextmanager
def _quiet_layerwise():
    """The twin's configure warns that every layer resident saves no memory: true, and
    the point of the twin; the warning would only be noise in the bench's output."""
    log = logging.getLogger("layerwise")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def configurations(ctx: Context, base) -> tuple[dict, dict]:
    """The five configurations' models, uncompiled (each from its own copy of `base`),
    and the layerwise managers of the streamed two by configuration name."""
    out = {EAGER_RESIDENT: clone_module(base).to(ctx.device), COMPILED: clone_module(base).to(ctx.device)}
    managers = {}
    for name in (EAGER_STREAMED, STREAMED):
        out[name] = clone_module(base)
        managers[name] = layerwise.configure_layerwise_offload(out[name], GROUPS, device=ctx.device,
                                                               prefetch_depth=1)
    out[TWIN] = clone_module(base)
    with _quiet_layerwise():
        layerwise.configure_layerwise_offload(out[TWIN], GROUPS, device=ctx.device,
                                              resident_layers=len(base.blocks))
    return {name: out[name] for name in CONFIGS}, managers


def explain(model, x) -> dict:
    """Graphs and graph breaks of `model(x)` traced by dynamo without fullgraph
    (torch._dynamo.explain; it resets dynamo before and after: run it before
    compiling what is timed). The breaks are those dynamo's counters saw during the
    trace: explain's own break_reasons leaves out some (torch 2.13: a
    torch._dynamo.graph_break() inside a module hook), and its graph_break_count
    counts the root hooks' graphs (see the module's docstring) as breaks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    with torch.inference_mode():
        e = torch._dynamo.explain(model)(x)
    seen = {k: n - before.get(k, 0) for k, n in counters["graph_break"].items() if n > before.get(k, 0)}
    reasons = list(dict.fromkeys([k.splitlines()[0] for k in seen] + [str(r.reason).splitlines()[0]
                                                                       for r in e.break_reasons]))
    return {"graphs": e.graph_count, "graph_breaks": max(sum(seen.values()), len(e.break_reasons)),
            "break_reasons": reasons}


def _graph_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks met) in this process so far, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _counting(sampler, recompiles: dict, name: str):
    """`sampler`, adding the graphs compiled during each sample to recompiles[name]
    (read outside the clock)."""
    def sample() -> float:
        before = _graph_counts()[0]
        t = sampler()
        recompiles[name] += _graph_counts()[0] - before
        return t
    return sample


def run(ctx: Context) -> SuiteResult:
    import torch._dynamo

    size = ctx.pick(SIZES)
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    base = models.build(models.DiTStack, size.hidden, size.layers, dtype=dtype, generate_on=ctx.device)
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    xs = {t: torch.randn(t, size.hidden, generator=gen, device=ctx.device).to(dtype)
          for t in dict.fromkeys(size.tokens)}
    layer_bytes = sum(p.numel() * p.element_size() for p in base.blocks[0].parameters())
    configs, managers = configurations(ctx, base)
    del base
    try:
        return _measure(ctx, size, dtype, xs, layer_bytes, configs, managers)
    finally:
        # compiled code holds guards on these models; the suites after this one start clean
        torch._dynamo.reset()


def _measure(ctx, size, dtype, xs, layer_bytes, configs, managers) -> SuiteResult:
    explained = explain(configs[STREAMED], xs[size.tokens[0]])
    # (with a break, compiled without fullgraph: the breaks counted and the steps still timed)
    fullgraph = explained["graph_breaks"] == 0
    for name in COMPILED_CONFIGS:
        configs[name] = torch.compile(configs[name], fullgraph=fullgraph)
    result = SuiteResult(NAME, data={
        "config": {**asdict(size), "dtype": str(dtype), "layer_bytes": layer_bytes, "prefetch_depth": 1},
        "explain": explained, "fullgraph": fullgraph, "compile": {}, "points": []})
    first_shape = {}
    with ctx.progress(len(size.tokens) * (size.repeats + 1), NAME) as bar:
        for k, tokens in enumerate(size.tokens):
            x = xs[tokens]
            steps = {name: inference_step(m, x) for name, m in configs.items()}
            if tokens not in first_shape:
                first_shape[tokens] = _first_calls(ctx, steps)
                result.data["compile"][str(tokens)] = first_shape[tokens]
                result.rows.append(_compile_row(tokens, first_shape[tokens]))
            gbps = None
            if not ctx.is_cuda:
                gbps = _bus_for(ctx, steps, managers, size.bus_ct[k])
            with bus.simulated_bus(gbps) if gbps is not None else contextlib.nullcontext():
                point = _point(ctx, size, tokens, steps, managers, layer_bytes, bar)
            point["bus_ct_chosen"] = size.bus_ct[k] if size.bus_ct else None
            point["bitwise_vs_twin"] = point["bitwise_vs_twin"] and first_shape[tokens]["bitwise_vs_twin"]
            result.data["points"].append(point)
            result.rows += _rows(point, explained)
    points = result.data["points"]
    result.data["graph_breaks"] = explained["graph_breaks"]
    result.data["recompiles"] = sum(sum(p["recompiles"].values()) for p in points)
    result.data["bitwise_vs_twin"] = all(p["bitwise_vs_twin"] for p in points)
    return result


def _first_calls(ctx: Context, steps: dict) -> dict:
    """The first call of every compiled configuration at this shape (it compiles): its
    seconds, the graphs it compiled and the graph breaks it met; and whether the
    compiled streamed output equals the twin's (and the plain compiled model's)."""
    configs, outs = {}, {}
    for name in COMPILED_CONFIGS:
        graphs, breaks = _graph_counts()
        ctx.synchronize()
        t0 = time.perf_counter()
        outs[name] = steps[name]()
        ctx.synchronize()
        seconds = time.perf_counter() - t0
        g, b = _graph_counts()
        configs[name] = {"first_call_s": seconds, "graphs": g - graphs, "graph_breaks": b - breaks}
    return {"configs": configs, "bitwise_vs_twin": torch.equal(outs[STREAMED], outs[TWIN]),
            "bitwise_vs_compiled_resident": torch.equal(outs[STREAMED], outs[COMPILED])}


def _bus_for(ctx: Context, steps: dict, managers: dict, ct: float) -> float:
    """The simulated bus (GB/s) over which one step's streamed bytes take 1/`ct` of the
    compiled resident step, measured now."""
    resident_s = compare({COMPILED: device_timer(ctx, steps[COMPILED])}, repeats=3, warmup=1)[COMPILED].median
    steps[STREAMED]()
    moved = managers[STREAMED][0].stats(sync=True)["last_step"]["bytes_copied"]
    return moved / (resident_s / ct) / 1e9


def _point(ctx, size, tokens, steps, managers, layer_bytes, bar) -> dict:
    from layerwise._native import sim_bus

    bandwidth = bus.transfer_bandwidth(ctx, layer_bytes)
    simulated = None if ctx.is_cuda else dict(sim_bus())
    # outputs at this point: eager streamed == eager resident (the engine's contract), compiled
    # streamed == the compiled twin (the same operator boundaries)
    reference = steps[EAGER_RESIDENT]()
    for k in (1, 2):
        out = steps[EAGER_STREAMED]()
        if not torch.equal(out, reference):
            diff = (out.float() - reference.float()).abs().max().item()
            raise AssertionError(f"compile, {tokens} tokens, eager streamed, step {k}: output differs from the "
                                 f"resident model's (max |diff| {diff:.3g})")
    twin, streamed = steps[TWIN](), steps[STREAMED]()
    bitwise = torch.equal(streamed, twin)
    plain = torch.equal(streamed, steps[COMPILED]())

    recompiles = dict.fromkeys(COMPILED_CONFIGS, 0)
    samplers = {}
    for name, step in steps.items():
        sampler = device_timer(ctx, step, prepare=step)
        samplers[name] = _counting(sampler, recompiles, name) if name in COMPILED_CONFIGS else sampler
    ms = {k: s.map(lambda t: t * 1e3) for k, s in compare(samplers, size.repeats, warmup=1, bar=bar).items()}
    last = {name: m[0].stats(sync=True)["last_step"] for name, m in managers.items()}
    moved = last[STREAMED]["bytes_copied"]
    transfer_ms = moved / bandwidth * 1e3
    c = ms[COMPILED].median / transfer_ms
    floor_ms = max(ms[COMPILED].median, transfer_ms)
    eager_floor_ms = max(ms[EAGER_RESIDENT].median, transfer_ms)
    return {"tokens": tokens, "bus": simulated, "bandwidth_GiBps": bandwidth / GiB, "bytes_moved": moved,
            "transfer_ms": transfer_ms, "compute_transfer_ratio": c, "regime": regime(c), "floor_ms": floor_ms,
            "eager_floor_ms": eager_floor_ms, "step_ms": ms, "last_step": last, "recompiles": recompiles,
            "bitwise_vs_twin": bitwise, "bitwise_vs_compiled_resident": plain,
            "ratios": {"compiled streamed /compiled resident": ratio(ms[STREAMED], ms[COMPILED]),
                       "compiled streamed /floor": ratio(ms[STREAMED], floor_ms),
                       "compiled streamed /twin": ratio(ms[STREAMED], ms[TWIN]),
                       "eager streamed /eager resident": ratio(ms[EAGER_STREAMED], ms[EAGER_RESIDENT]),
                       "eager streamed /floor": ratio(ms[EAGER_STREAMED], eager_floor_ms),
                       "compiled resident /eager resident": ratio(ms[COMPILED], ms[EAGER_RESIDENT])}}


def _compile_row(tokens: int, first: dict) -> Row:
    s = {name: c["first_call_s"] for name, c in first["configs"].items()}
    # (no ratio: a compile's seconds depend on what inductor's caches held, and on whether it was the first
    # compile of the process)
    return Row(NAME, f"first call (compiles), {tokens} tok, {STREAMED}", "s", s[STREAMED],
               {COMPILED: s[COMPILED], TWIN: s[TWIN]}, note=COMPILE_NOTE,
               short=f"{tokens} tok, first call, {STREAMED}")


def _rows(point: dict, explained: dict) -> list[Row]:
    ms, kind, c = point["step_ms"], point["regime"], point["compute_transfer_ratio"]
    floor, eager_floor = point["floor_ms"], point["eager_floor_ms"]
    where = f"{point['tokens']} tok (C/T {c:.2g}, {kind})"
    if point["bus"] is not None:
        where = f"over the simulated bus ({bus_gibps(point['bus']['gbps']):.3g} GiB/s), {where}"
    short = f"C/T {c:.2g}"  # (the tokens are in the measure; the default table has 120 columns)
    rows = []

    def add(name, baselines, ratios, targets=(), note=""):
        rows.append(Row(NAME, f"step {where}, {name}", "ms", ms[name], baselines, ratios, list(targets), note=note,
                        short=f"{short}, {name}"))

    add(EAGER_RESIDENT, {}, {})
    add(EAGER_STREAMED, {EAGER_RESIDENT: ms[EAGER_RESIDENT], "floor": eager_floor},
        {"/resident": ratio(ms[EAGER_STREAMED], ms[EAGER_RESIDENT]), "/floor": ratio(ms[EAGER_STREAMED], eager_floor)})
    add(COMPILED, {EAGER_RESIDENT: ms[EAGER_RESIDENT]}, {"/eager": ratio(ms[COMPILED], ms[EAGER_RESIDENT])})
    ratios_twin = ratio(ms[TWIN], ms[COMPILED])
    add(TWIN, {COMPILED: ms[COMPILED]}, {"/compiled": ratios_twin})
    ratios = {"/compiled": ratio(ms[STREAMED], ms[COMPILED]), "/twin": ratio(ms[STREAMED], ms[TWIN]),
              "/floor": ratio(ms[STREAMED], floor)}
    targets = []
    if kind == "compute-bound":
        targets.append(Target.at_most(ratios["/compiled"], TARGET_RESIDENT, "compiled resident"))
    elif kind == "transfer-bound":
        targets.append(Target.at_most(ratios["/floor"], TARGET_FLOOR, "floor"))
    recompiled = sum(point["recompiles"].values())
    targets += [Target("0 graph breaks", explained["graph_breaks"] == 0),
                Target("0 recompiles", recompiled == 0),
                Target("bitwise = twin", bool(point["bitwise_vs_twin"]))]
    notes = []
    if not targets[0].met and kind != "balanced":
        notes.append(bus.miss_note(point["last_step"][STREAMED]["stall_s"], point["transfer_ms"], ms[COMPILED].median,
                                   f"hook time, the operators' boundaries (the twin: {ratios_twin:.3g}x compiled "
                                   "resident) and the copies' memcpy on the shared cores"))
    if explained["graph_breaks"]:
        notes.append(f"{explained['graph_breaks']} graph break(s): " + "; ".join(explained["break_reasons"]))
    if recompiled:
        notes.append(f"recompiled while timed: {point['recompiles']}")
    note = "; ".join(notes)
    add(STREAMED, {COMPILED: ms[COMPILED], TWIN: ms[TWIN], "floor": floor}, ratios, targets, note)
    return rows
