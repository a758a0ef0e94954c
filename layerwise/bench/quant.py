"""quant: what streaming a quantized model buys. The same DiT-like block stack
(``models.DiTStack``, bf16) in bf16 and with its blocks quantized by torchao
(fp8 and int8 weight-only, int4 weight-only as IntxUnpackedToInt8Tensor), by
optimum-quanto (qint4, frozen) and as GGUF Q8_0 / Q4_0 (diffusers), each streamed by layerwise (prefetch depth 1)
with ``compress=None`` and ``compress="lossless"``, beside the same quantized
model resident on the device.

Rows per form and ``compress``:
  bytes per step   bytes that crossed the bus in one forward
                   (stats()["last_step"]["bytes_copied"]) against the model's
                   streamed bf16 bytes and against its quantized bytes (what
                   the quantized layers hold; target <= 1.15x);
  step             step time streamed against the same quantized model
                   resident and against the floor ``max(resident quantized
                   step, bytes per step / measured bandwidth)``, the bandwidth
                   measured in the same run (bus.transfer_bandwidth: arena
                   copies of one bf16 layer). No target on CUDA (not measured
                   yet) nor on the CPU without a simulated bus (a "copy" is a
                   host memcpy on the compute's cores; the floor is then that
                   memcpy's);
  bus step         (CPU) the same step with the copies across the CPU
                   backend's simulated bus (bus.simulated_bus), its speed
                   chosen in the run so that bf16 is transfer-bound: one
                   step's bf16 bytes take BUS_BF16_CT_INVERSE times the
                   resident bf16 step (C/T 0.1): a form whose compute is about
                   bf16's stays transfer-bound with half the bytes (C/T about
                   0.2) or a quarter (about 0.4), so its step shows what its
                   bytes buy (a form whose CPU kernels are slow is
                   compute-bound there: fp8 and GGUF dequantize in Python). The
                   floor as above, with the bandwidth measured through that bus
                   (bus.bus_bandwidth); the bus suite's targets at each form's
                   own C/T: compute-bound (>= 2) <= 1.05x resident,
                   transfer-bound (<= 0.5) <= 1.10x the floor. A miss says what
                   the step waited on the copies (and, compressed, what
                   decoding took on the copy worker). With
                   ``LAYERWISE_SIM_BUS_GBPS`` already set, every step runs over
                   that bus and the step rows carry these targets (no separate
                   bus rows).

Every streamed output is checked bitwise against the resident quantized model
before it is timed (over the bus too); a mismatch fails the suite. A library that is not
importable skips its forms (said in the notes). Diffusers' group offloading
needs a CUDA device: beside it "not measured" on a CPU. GGUF: diffusers'
``GGUFLinear`` over ``GGUFParameter`` blocks (Q8_0, Q4_0) quantized by the gguf
package, as ``from_single_file`` builds them from a GGUF file.
"""
from __future__ import annotations

import contextlib
import io
import os

import torch

import layerwise
from layerwise._native import sim_bus
from layerwise.bench import bus, models
from layerwise.bench.common import (
    Context,
    GiB,
    MiB,
    Row,
    Skip,
    SuiteResult,
    Target,
    bus_gibps,
    check_bitwise,
    clone_module,
    compare,
    device_timer,
    ratio,
)
from layerwise.bench.stream import regime

NAME = "quant"
BYTES_TARGET = 1.15  # bytes per step / quantized bytes
SIZES = {"full": (2048, 8, 64), "quick": (512, 6, 16), "tiny": (128, 4, 4)}  # hidden, layers, tokens
REPEATS = {"full": 7, "quick": 4, "tiny": 2}
BUS_BF16_CT_INVERSE = 10  # the chosen bus: one step's bf16 bytes cross it in 10x the resident bf16 step


def _in_blocks(module, fqn: str) -> bool:
    return fqn.startswith("blocks.") and isinstance(module, torch.nn.Linear)


def _torchao(config_name: str):
    def quantize(model):
        with contextlib.redirect_stderr(io.StringIO()):  # its optional CUDA kernels say they did not load
            import torchao.quantization as q

        if config_name == "int4":
            config = q.IntxWeightOnlyConfig(weight_dtype=torch.int4)
        else:
            config = getattr(q, config_name)()
        q.quantize_(model, config, filter_fn=_in_blocks)
        return model
    return quantize


def _quanto(qtype: str):
    def quantize(model):
        from optimum import quanto

        quanto.quantize(model.blocks, weights=getattr(quanto, qtype))
        quanto.freeze(model.blocks)
        return model
    return quantize


def _gguf(qtype_name: str):
    """Every nn.Linear of the blocks as diffusers' GGUFLinear over a GGUFParameter of
    the weight quantized by the gguf package (what from_single_file builds from a
    GGUF file), the bias kept in bf16."""
    def quantize(model):
        import gguf
        from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

        qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
        for block in model.blocks:
            for name, lin in list(block.named_children()):
                if not isinstance(lin, torch.nn.Linear):
                    continue
                new = GGUFLinear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                 compute_dtype=torch.bfloat16)
                data = torch.from_numpy(gguf.quantize(lin.weight.detach().float().numpy(), qtype))
                new.weight = GGUFParameter(data, quant_type=qtype)
                if lin.bias is not None:
                    new.bias = torch.nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
                setattr(block, name, new)
        return model
    return quantize


FORMS = {  # name -> (library, quantize(model) in place)
    "bf16": (None, lambda model: model),
    "fp8 (torchao)": ("torchao", _torchao("Float8WeightOnlyConfig")),
    "int8 (torchao)": ("torchao", _torchao("Int8WeightOnlyConfig")),
    "int4 (torchao, int8 storage)": ("torchao", _torchao("int4")),  # IntxUnpackedToInt8Tensor: a byte per value
    "qint4 (quanto)": ("optimum.quanto", _quanto("qint4")),
    "GGUF Q8_0": ("gguf", _gguf("Q8_0")),
    "GGUF Q4_0": ("gguf", _gguf("Q4_0")),
}


def _importable(library: str | None) -> str | None:
    """None, or why `library` cannot be used here."""
    if library is None:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            __import__(library)
    except Exception as e:  # noqa: BLE001 - ImportError or a broken install
        return f"{library} is not importable ({type(e).__name__}: {e})"
    return None


def _step(model, x):
    """model(x) under no_grad (quanto's packed int4 fails under inference_mode, resident
    or not: "Cannot set version_counter for inference tensor")."""
    def step():
        with torch.no_grad():
            return model(x)
    return step


def _layer_bytes(model) -> int:
    """The bytes the streamed blocks hold (a quantized wrapper: its inner tensors)."""
    from layerwise.planning.layout import param_bytes

    return sum(param_bytes(p) for p in model.blocks.parameters())


def _choose_bus(ctx: Context, base, x, bf16_bytes: int) -> float:
    """GB/s (decimal, as LAYERWISE_SIM_BUS_GBPS) of a simulated bus over which one step's bf16 bytes take
    BUS_BF16_CT_INVERSE times the resident bf16 step (measured here)."""
    resident_s = bus.resident_ms(ctx, base, {"bf16": x}, 3)["bf16"] / 1e3
    return bf16_bytes / (BUS_BF16_CT_INVERSE * resident_s) / 1e9


def run(ctx: Context) -> SuiteResult:
    hidden, layers, tokens = ctx.pick(SIZES)
    repeats = ctx.pick(REPEATS)
    base = models.build(models.DiTStack, hidden, layers, dtype=torch.bfloat16, generate_on=ctx.device)
    bf16_bytes = _layer_bytes(base)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(ctx.device)
    given = not ctx.is_cuda and bool(os.environ.get(bus.ENV))  # every copy already crosses that bus
    bandwidth = bus.transfer_bandwidth(ctx, bf16_bytes // layers)
    result = SuiteResult(NAME, data={"config": {"hidden": hidden, "layers": layers, "tokens": tokens,
                                                "bf16_layer_bytes": bf16_bytes},
                                     "bandwidth_GiBps": bandwidth / GiB, "forms": {}, "skipped": {}})
    over_bus = None  # the chosen bus: (GB/s, bandwidth measured across it)
    if not ctx.is_cuda and not given:
        gbps = _choose_bus(ctx, base, x, bf16_bytes)
        with bus.simulated_bus(gbps) as cfg:
            over_bus = (gbps, bus.bus_bandwidth(bf16_bytes // layers))
        result.data["bus"] = {**cfg, "source": f"chosen: bf16 at C/T 1/{BUS_BF16_CT_INVERSE}",
                              "bandwidth_GiBps": over_bus[1] / GiB}
    elif given:
        result.data["bus"] = {**sim_bus(), "source": "given"}
    usable = {}
    for name, (library, quantize) in FORMS.items():
        why = _importable(library)
        if why:
            result.data["skipped"][name] = why
        else:
            usable[name] = quantize
    if not usable:
        raise Skip("no quantization library is importable")
    with ctx.progress(len(usable) * (repeats + 1) * (2 if over_bus else 1), NAME) as bar:
        for name, quantize in usable.items():
            # (each method quantizes its own copy: not every wrapper tensor can be deep-copied)
            make = lambda q=quantize: q(clone_module(base))  # noqa: E731
            result.rows += _form(ctx, result, name, make, x, bf16_bytes, repeats, bar, bandwidth, given, over_bus)
    for name, why in result.data["skipped"].items():
        result.rows.append(Row(NAME, f"bytes per step, {name}", "MiB", None, {}, {}, note=f"not measured: {why}",
                               short=f"bytes/step, {name}"))
    return result


def _streamed(ctx: Context, make, methods: dict, prefix: str = "") -> dict:
    """A streamed copy of the form per ``compress`` (None, "lossless"), added to
    `methods` by label; returns their managers by the same labels."""
    managers = {}
    for compress in (None, "lossless"):
        label = "layerwise" + (", compress" if compress else "")
        model = make()
        managers[label] = layerwise.configure_layerwise_offload(model, ["blocks"], device=ctx.device,
                                                                prefetch_depth=1, compress=compress)
        methods[label] = model
    return managers


def _timed(ctx: Context, methods: dict, x, what: str, repeats: int, bar) -> dict:
    """Every method's step (ms), interleaved, after the bitwise check against the resident one."""
    steps = {k: _step(m, x) for k, m in methods.items()}
    check_bitwise(steps, steps["resident"](), what)
    samplers = {k: device_timer(ctx, s, prepare=s) for k, s in steps.items()}
    return {k: s.map(lambda t: t * 1e3) for k, s in compare(samplers, repeats, warmup=1, bar=bar).items()}


def _decode_ms(stats: dict) -> float | None:
    """The mean time one step spent decoding on the copy worker (compressed layers), or None."""
    c = stats.get("compress")
    if not c or not c.get("decodes_timed"):
        return None
    return c["decode_s"] / c["decodes_timed"] * stats["last_step"]["copies"] * 1e3


def _step_row(name: str, label: str, ms: dict, stats: dict, bandwidth: float, with_targets: bool,
              gbps: float | None, note: str) -> tuple[Row, dict]:
    """The step row of one streamed form against its resident model and its floor
    ``max(resident, bytes copied / bandwidth)``; the bus suite's targets when
    `with_targets`, and a miss says what the step waited on."""
    last = stats["last_step"]
    resident = ms["resident"].median
    transfer_ms = last["bytes_copied"] / bandwidth * 1e3
    floor_ms = max(resident, transfer_ms)
    c = resident / transfer_ms
    kind = regime(c)
    ratios = {"/resident": ratio(ms[label], ms["resident"]), "/floor": ratio(ms[label], floor_ms)}
    targets = bus.step_targets(kind, ratios) if with_targets else []
    decode = _decode_ms(stats)
    if not all(t.met for t in targets):
        note = bus.miss_note(last["stall_s"], transfer_ms, resident,
                             f"decoding on the copy worker ({decode:.2f} ms a step), hook time and the copies' "
                             "memcpy on the shared cores" if decode else "")
    compressed = ", compress" if "compress" in label else ""
    where = f"step over the simulated bus ({bus_gibps(gbps):.3g} GiB/s)" if gbps else "step"
    row = Row(NAME, f"{where}, {name}, {label} (C/T {c:.2g}, {kind})", "ms", ms[label],
              {"resident": ms["resident"], "floor": floor_ms}, ratios, targets, note=note,
              short=f"{'bus step' if gbps else 'step'}, {name}{compressed}, C/T {c:.2g}")
    data = {"step_ms": ms[label], "resident_ms": ms["resident"], "bytes_per_step": last["bytes_copied"],
            "transfer_ms": transfer_ms, "floor_ms": floor_ms, "compute_transfer_ratio": c, "regime": kind,
            "stall_s": last["stall_s"], "decode_ms": decode}
    return row, data


def _form(ctx: Context, result: SuiteResult, name: str, make, x, bf16_bytes: int, repeats: int, bar,
          bandwidth: float, given: bool, over_bus) -> list:
    methods = {"resident": make().to(ctx.device)}
    q_bytes = _layer_bytes(methods["resident"])
    managers = _streamed(ctx, make, methods)
    ms = _timed(ctx, methods, x, f"quant, {name}", repeats, bar)
    rows = []
    data = result.data["forms"][name] = {"quantized_bytes": q_bytes, "step_ms": ms, "bytes_per_step": {},
                                         "step": {}, "bus_step": {}}
    gbps = result.data["bus"]["gbps"] if given else None
    if ctx.is_cuda:
        note = "no target on CUDA yet (not measured)"
    elif given:
        note = ""
    else:
        note = ("CPU backend, no simulated bus: a copy is a host memcpy (the floor's bandwidth is that memcpy's), no "
                "target; diffusers: not measured (CUDA)")
    for label, (m,) in managers.items():
        stats = m.stats(sync=True)
        copied = stats["last_step"]["bytes_copied"]
        if copied <= 0:  # every layer must be copied again each step (more layers than ring slots)
            raise AssertionError(f"quant: {name}, {label}: no bytes crossed the bus in a step")
        data["bytes_per_step"][label] = copied
        per_q = copied / q_bytes
        rows.append(Row(
            NAME, f"bytes per step, {name}, {label}", "MiB", copied / MiB,
            {"bf16 layers": bf16_bytes / MiB, "quantized": q_bytes / MiB},
            {"/bf16": copied / bf16_bytes, "/quantized": per_q},
            [Target.at_most(per_q, BYTES_TARGET, "quantized")],
            short=f"bytes/step, {name}{', compress' if 'compress' in label else ''}"))
        row, data["step"][label] = _step_row(name, label, ms, stats, bandwidth, given, gbps, note)
        rows.append(row)
    if over_bus is None:
        return rows
    for model in [m for k, m in methods.items() if k != "resident"]:
        layerwise.remove_layerwise_offload(model)
    gbps, bus_bw = over_bus
    with bus.simulated_bus(gbps):
        methods = {"resident": methods["resident"]}
        managers = _streamed(ctx, make, methods)
        ms = _timed(ctx, methods, x, f"quant over the simulated bus, {name}", repeats, bar)
        for label, (m,) in managers.items():
            row, data["bus_step"][label] = _step_row(name, label, ms, m.stats(sync=True), bus_bw, True, gbps, "")
            rows.append(row)
        for model in [m for k, m in methods.items() if k != "resident"]:
            layerwise.remove_layerwise_offload(model)
    return rows
