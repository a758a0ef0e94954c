"""cohort: concurrent calls of one streamed model share each layer's fetch
(layerwise/runtime/cohort.py, layerwise.run_together).

K calls (K = 1, 2, 4, 8) of one streamed model, of mixed shapes (call k takes
shape k mod 3), two ways, interleaved over the repeats:

  serial     the same calls one after another on the streamed model;
  together   layerwise.run_together(model, calls): one thread per call, each
             streamed layer fetched once for the calls that need it.

Models (random weights, fp32): a tiny diffusers FluxTransformer2DModel whose
call is a denoise loop of S forwards at one of three latent sizes (token
counts), and a tiny transformers LlamaForCausalLM whose call is one prefill
forward of one of three prompt lengths. Without diffusers (transformers) the
model's rows are left out and the suite says why (both missing: skipped).

The copies cross the CPU backend's simulated bus (bus.simulated_bus), its
speed chosen in the run from the resident compute of one forward (a "pass"),
averaged over the three shapes: transfer-bound, one pass's streamed bytes take
TRANSFER_BOUND times the pass's compute; compute-bound, the compute takes
COMPUTE_BOUND times the transfer. (With LAYERWISE_SIM_BUS_GBPS set, one point
at that bus, without targets.)

Rows per model, point and K:
  wall         the K calls together against serial: "x serial" is the
               aggregate throughput (serial wall / together wall). Targets at
               K=4: transfer-bound >= 3.2x, compute-bound >= 0.95x.
  bytes/call   the bytes that crossed the bus during together (every group's
               bytes_copied) per call, against the same calls run alone (the
               serial run's bytes). Target at K=4, transfer-bound: <= 0.30x.
  latency      each call's latency (its own timestamps), together against the
               same call alone (serial): "x alone" the median over the calls of
               that ratio, "worst" the largest; the note has the worst wait for
               a layer (stats()["calls"]: wait_s_max, wait_turns_max) and says
               whether the outputs were exact. Target: every together output is
               bitwise equal to the same call run alone on the streamed model
               and to the resident model.

On 2 cores the figures depend on torch's thread count: the command line leaves
one core to the copy engine (torch.set_num_threads(cores - 1)).

    python -m layerwise.bench cohort [--quick]
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

import layerwise
from layerwise.bench import bus
from layerwise.bench.common import (
    Context,
    MiB,
    Row,
    Skip,
    Stat,
    SuiteResult,
    Target,
    bus_gibps,
    clone_module,
    compare,
    device_timer,
)

NAME = "cohort"
KS = (1, 2, 4, 8)
TARGET_K = 4
TARGET_THROUGHPUT_TB, TARGET_BYTES_TB, TARGET_THROUGHPUT_CB = 3.2, 0.30, 0.95
# The two points: one pass's bus time over its compute (the bus chosen from the measured compute)
POINTS = {"transfer-bound": 10.0, "compute-bound": 0.25}
TRANSFER_BOUND, COMPUTE_BOUND = POINTS["transfer-bound"], 1 / POINTS["compute-bound"]


@dataclass(frozen=True)
class Size:
    hidden: int  # Flux width = heads x head_dim
    heads: int
    double: int  # Flux double-stream blocks (one group)
    single: int  # Flux single-stream blocks (another group)
    tokens: tuple  # Flux latent token counts (squares), the three shapes
    steps: int  # Flux forwards per call (the denoise loop)
    llama_hidden: int
    llama_layers: int
    prompts: tuple  # Llama prefill lengths, the three shapes
    repeats: int  # rounds of (serial, together), interleaved


# More layers per group than a depth-1 ring holds (3): every layer crosses the bus in every pass.
SIZES = {
    "full": Size(256, 4, 4, 8, (64, 144, 256), 4, 256, 8, (64, 128, 192), 5),
    "quick": Size(128, 2, 4, 8, (64, 144, 256), 2, 256, 8, (32, 64, 96), 2),
    "tiny": Size(32, 2, 4, 4, (16, 36, 64), 2, 32, 4, (8, 16, 24), 1),
}
TEXT = 16  # Flux text tokens


# ------------------------------------------------------------ the models
class Workload:
    """A model, its streamed groups and the calls of one benchmark: call k (k < 8)
    takes shape k mod 3 with inputs of its own (seeded by k) and returns its output."""

    name: str
    groups: list
    forwards: int  # model forwards per call

    def call(self, k: int):
        raise NotImplementedError


class Flux(Workload):
    name = "Flux"
    groups = ["transformer_blocks", "single_transformer_blocks"]

    def __init__(self, size: Size):
        from diffusers import FluxTransformer2DModel

        h, heads = size.hidden, size.heads
        head_dim = h // heads
        rope = (head_dim - 2 * (3 * head_dim // 8), 3 * head_dim // 8, 3 * head_dim // 8)  # sums to head_dim
        torch.manual_seed(0)
        self.model = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=size.double, num_single_layers=size.single,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=h, pooled_projection_dim=h,
            axes_dims_rope=rope).eval()
        self.forwards = size.steps
        self.shapes = [f"{t} tok" for t in size.tokens]
        self.inputs = [self._inputs(size.tokens[k % 3], h, k) for k in range(max(KS))]

    @staticmethod
    def _inputs(tokens: int, h: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        side = int(round(tokens ** 0.5))
        ids = torch.zeros(side, side, 3)
        ids[..., 1] = torch.arange(side)[:, None]
        ids[..., 2] = torch.arange(side)[None]
        return dict(hidden_states=torch.randn(1, side * side, 16, generator=g),
                    encoder_hidden_states=torch.randn(1, TEXT, h, generator=g),
                    pooled_projections=torch.randn(1, h, generator=g), img_ids=ids.reshape(-1, 3),
                    txt_ids=torch.zeros(TEXT, 3))

    def call(self, k: int):
        inp, steps = self.inputs[k], self.forwards

        def denoise(model):  # Euler steps of a flow-matching sampler
            x = inp["hidden_states"]
            with torch.inference_mode():
                for s in range(steps):
                    t = torch.full((1,), 1.0 - s / steps)
                    v = model(**{**inp, "hidden_states": x}, timestep=t, return_dict=False)[0]
                    x = x - v / steps
            return x
        return denoise


class Llama(Workload):
    name = "Llama"
    groups = ["model.layers"]
    forwards = 1

    def __init__(self, size: Size):
        from transformers import LlamaConfig, LlamaForCausalLM

        h = size.llama_hidden
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=512, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=size.llama_layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(size.prompts),
            pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
        self.shapes = [f"{n}-token prompt" for n in size.prompts]
        gen = [torch.Generator().manual_seed(k) for k in range(max(KS))]
        self.inputs = [torch.randint(3, 512, (1, size.prompts[k % 3]), generator=gen[k]) for k in range(max(KS))]

    def call(self, k: int):
        ids = self.inputs[k]

        def prefill(model):
            with torch.inference_mode():
                return model(input_ids=ids, use_cache=False).logits
        return prefill


WORKLOADS = {"Flux": (Flux, "diffusers"), "Llama": (Llama, "transformers")}


# ------------------------------------------------------------ measuring
def _timed(fn, k: int, log: list):
    """`fn` that records (k, start, end) in `log` around itself."""
    def call(model):
        t0 = time.perf_counter()
        out = fn(model)
        log.append((k, t0, time.perf_counter()))
        return out
    return call


def _bytes(model) -> int:
    return sum(m.stats(sync=True)["bytes_copied"] for m in layerwise.managers_of(model))


def _serial(model, calls: list) -> tuple[float, list, list, int]:
    """The calls one after another: (wall s, outputs, latencies s, bytes). The
    bytes are read outside the clock (a read drains the copy engine)."""
    log = []
    b0 = _bytes(model)
    t0 = time.perf_counter()
    outs = [_timed(fn, k, log)(model) for k, fn in enumerate(calls)]
    wall = time.perf_counter() - t0
    return wall, outs, log, _bytes(model) - b0


def _together(model, calls: list) -> tuple[float, list, list, int]:
    """The calls at once (run_together): (wall s, outputs, latencies s, bytes)."""
    log = []
    b0 = _bytes(model)
    t0 = time.perf_counter()
    outs = layerwise.run_together(model, [_timed(fn, k, log) for k, fn in enumerate(calls)])
    wall = time.perf_counter() - t0
    return wall, outs, log, _bytes(model) - b0


def _configure(ctx: Context, work: Workload):
    model = clone_module(work.model)
    layerwise.configure_layerwise_offload(model, work.groups, device=ctx.device, prefetch_depth=1)
    return model


def _measure(ctx: Context, work: Workload, k_calls: int, repeats: int, resident_out: list) -> dict:
    """Serial and together, interleaved over `repeats` rounds (the first method of
    a round alternating) on a streamed model of its own (the cohort's wait figures
    are the model's, since its configuration)."""
    model = _configure(ctx, work)
    try:
        calls = [work.call(k) for k in range(k_calls)]
        calls[0](model)  # (warm: the ring and the hooks' first pass)
        walls = {"serial": [], "together": []}
        lat = {"serial": [], "together": []}
        moved = {"serial": [], "together": []}
        skew = []
        alone_equal = resident_equal = True
        for r in range(repeats):
            got = {}
            for method in ("serial", "together") if r % 2 == 0 else ("together", "serial"):
                wall, outs, log, nbytes = (_serial if method == "serial" else _together)(model, calls)
                walls[method].append(wall)
                lat[method].append([t1 - t0 for _, t0, t1 in sorted(log)])
                moved[method].append(nbytes)
                got[method] = outs
                if method == "together":  # how far apart the threads began their calls
                    skew.append(max(t0 for _, t0, _ in log) - min(t0 for _, t0, _ in log))
            for k in range(k_calls):
                alone_equal &= torch.equal(got["together"][k], got["serial"][k])
                resident_equal &= torch.equal(got["together"][k], resident_out[k]) \
                    and torch.equal(got["serial"][k], resident_out[k])
        figures = layerwise.managers_of(model)[0].stats()["calls"]
    finally:
        layerwise.remove_layerwise_offload(model)
    lat_ratio = [statistics.median(x[k] for x in lat["together"]) / statistics.median(x[k] for x in lat["serial"])
                 for k in range(k_calls)]
    return {"K": k_calls, "wall_s": walls, "latency_s": lat, "bytes": moved, "latency_x_alone": lat_ratio,
            "start_skew_s": skew,
            "equal_alone": alone_equal, "equal_resident": resident_equal, "calls": figures}


def _resident(ctx: Context, work: Workload) -> tuple[list, list]:
    """The resident model's outputs of calls 0..7, and its ms per forward at each shape."""
    outs = [work.call(k)(work.model) for k in range(max(KS))]
    samplers = {s: device_timer(ctx, lambda s=s: work.call(s)(work.model)) for s in range(3)}
    ms = [compare(samplers, 3, warmup=0)[s].median * 1e3 / work.forwards for s in range(3)]
    return outs, ms


def _pass_bytes(ctx: Context, work: Workload) -> int:
    """Bytes one forward streams (a call of the middle shape alone, no simulated bus)."""
    model = _configure(ctx, work)
    try:
        work.call(1)(model)
        b0 = _bytes(model)
        work.call(1)(model)
        return (_bytes(model) - b0) // work.forwards
    finally:
        layerwise.remove_layerwise_offload(model)


# ------------------------------------------------------------ the suite
def run(ctx: Context) -> SuiteResult:
    if ctx.is_cuda:
        raise Skip("the cohort suite runs on the CPU backend with the simulated bus (no CUDA rows yet)")
    size = ctx.pick(SIZES)
    missing = {}
    works = []
    for wname, (make, package) in WORKLOADS.items():
        try:
            __import__(package)
        except Exception as e:  # noqa: BLE001 - the reason goes into the result
            missing[wname] = f"{package} is not importable ({type(e).__name__}: {e})"
            continue
        works.append(make(size))
    if not works:
        raise Skip("; ".join(f"{w}: {why}" for w, why in missing.items()))
    given = os.environ.get(bus.ENV)
    result = SuiteResult(NAME, data={"config": asdict(size), "Ks": list(KS), "points": POINTS,
                                     "missing": missing, "models": {}})
    npoints = 1 if given else len(POINTS)
    with ctx.progress(len(works) * npoints * len(KS), NAME) as bar:
        for work in works:
            resident_out, res_ms = _resident(ctx, work)
            pass_ms = statistics.mean(res_ms)
            pass_bytes = _pass_bytes(ctx, work)
            data = result.data["models"][work.name] = {
                "shapes": work.shapes, "forwards_per_call": work.forwards, "resident_ms_per_forward": res_ms,
                "pass_bytes": pass_bytes, "points": {}}
            points = {"given bus": None} if given else \
                {p: pass_bytes / (t_over_c * pass_ms / 1e3) / 1e9 for p, t_over_c in POINTS.items()}
            for point, gbps in points.items():
                with bus.simulated_bus(gbps) as cfg:
                    c_over_t = pass_ms / 1e3 / (pass_bytes / (cfg["gbps"] * 1e9))
                    pd = data["points"][point] = {"bus": cfg, "C/T": c_over_t, "runs": []}
                    for k in KS:
                        # (compute-bound walls are short and vary most with the machine's load: more rounds)
                        reps = size.repeats * (3 if point == "compute-bound" else 1)
                        m = _measure(ctx, work, k, reps, resident_out)
                        pd["runs"].append(m)
                        result.rows += _rows(work, point, c_over_t, cfg["gbps"], m, targets=not given)
                        bar.update(1)
    for wname, why in missing.items():
        result.rows.append(Row(NAME, f"{wname}: not measured", "", None, note=f"skipped: {why}",
                               short=f"{wname}: not measured"))
    return result


def _rows(work: Workload, point: str, c_over_t: float, gbps: float, m: dict, targets: bool) -> list[Row]:
    k = m["K"]
    tag = f"{work.name}, {point} (C/T {c_over_t:.2g}), K={k}"
    serial, together = Stat.of(m["wall_s"]["serial"]), Stat.of(m["wall_s"]["together"])
    throughput = serial.median / together.median
    alone_b = statistics.median(m["bytes"]["serial"]) / k
    together_b = statistics.median(m["bytes"]["together"]) / k
    bytes_x = together_b / alone_b if alone_b else float("nan")
    lat_x = m["latency_x_alone"]
    lat_together = Stat.of([x for run in m["latency_s"]["together"] for x in run]).map(lambda t: t * 1e3)
    lat_alone = statistics.median(x for run in m["latency_s"]["serial"] for x in run) * 1e3
    at_k = targets and k == TARGET_K
    t_wall, t_bytes = [], []
    if at_k and point == "transfer-bound":
        t_wall = [Target.at_least(throughput, TARGET_THROUGHPUT_TB, "serial")]
        t_bytes = [Target.at_most(bytes_x, TARGET_BYTES_TB, "alone")]
    elif at_k and point == "compute-bound":
        t_wall = [Target.at_least(throughput, TARGET_THROUGHPUT_CB, "serial")]
    calls = m["calls"] or {}
    equal = m["equal_alone"] and m["equal_resident"]
    shapes = ", ".join(work.shapes[:min(k, 3)])
    what = (f"{k} call(s) of {shapes}" if work.forwards == 1
            else f"{k} call(s) of {work.forwards} forwards at {shapes}")
    note = (f"worst wait {calls.get('wait_s_max', 0.0) * 1e3:.1f} ms ({calls.get('wait_turns_max', 0.0):.2f} turns); "
            f"bitwise equal to alone: {'yes' if m['equal_alone'] else 'NO'}, to resident: "
            f"{'yes' if m['equal_resident'] else 'NO'}")
    bus_label = f"simulated bus {bus_gibps(gbps):.3g} GiB/s"
    return [
        Row(NAME, f"wall of {what} together (run_together) vs one after another, {tag}, {bus_label}", "ms",
            together.map(lambda t: t * 1e3), {"serial": serial.map(lambda t: t * 1e3)}, {"x serial": throughput},
            t_wall, short=f"wall, {tag}"),
        Row(NAME, f"bus bytes per call together vs the same calls alone, {tag}", "MiB", together_b / MiB,
            {"alone": alone_b / MiB}, {"x alone": bytes_x}, t_bytes, short=f"bytes/call, {tag}"),
        Row(NAME, f"latency of each call together vs the same call alone (x alone: the median over the calls of "
                  f"each call's ratio, worst: the largest), {tag}",
            "ms", lat_together, {"alone": lat_alone},
            {"x alone": statistics.median(lat_x), "worst": max(lat_x)},
            [Target("bitwise = alone and resident", bool(equal))], note=note, short=f"latency, {tag}"),
    ]
