"""quant: what streaming a quantized model buys. The same DiT-like block stack
(``models.DiTStack``, bf16) in bf16 and with its blocks quantized by torchao
(fp8 and int8 weight-only, int4 weight-only as IntxUnpackedToInt8Tensor), by
optimum-quanto (qint4, frozen) and as GGUF Q8_0 / Q4_0 (diffusers), each streamed by layerwise (prefetch depth 1)
with ``compress=None`` and ``compress="lossless"``, beside the same quantized
model resident on the device.

Rows per form:
  bytes per step   bytes that crossed the bus in one forward
                   (stats()["last_step"]["bytes_copied"]) against the model's
                   streamed bf16 bytes and against its quantized bytes (what
                   the quantized layers hold; target <= 1.15x, issue 23);
  step             step time streamed against the same quantized model
                   resident (no target on the CPU backend: there is no bus to
                   save there, a "copy" is a host memcpy).

Every streamed output is checked bitwise against the resident quantized model
before it is timed; a mismatch fails the suite. A library that is not
importable skips its forms (said in the notes). Diffusers' group offloading
needs a CUDA device: beside it "not measured" on a CPU. GGUF: diffusers'
``GGUFLinear`` over ``GGUFParameter`` blocks (Q8_0, Q4_0) quantized by the gguf
package, as ``from_single_file`` builds them from a GGUF file.
"""
from __future__ import annotations

import contextlib
import io

import torch

import layerwise

from . import models
from .common import (MB, Context, Row, Skip, SuiteResult, Target, check_bitwise, clone_module, compare, device_timer,
                     ratio)

NAME = "quant"
BYTES_TARGET = 1.15  # bytes per step / quantized bytes (issue 23)
SIZES = {"full": (2048, 8, 64), "quick": (512, 6, 16), "tiny": (128, 4, 4)}  # hidden, layers, tokens
REPEATS = {"full": 7, "quick": 5, "tiny": 2}


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
    from ..plan import param_bytes

    return sum(param_bytes(p) for p in model.blocks.parameters())


def run(ctx: Context) -> SuiteResult:
    hidden, layers, tokens = ctx.pick(SIZES)
    repeats = ctx.pick(REPEATS)
    base = models.build(models.DiTStack, hidden, layers, dtype=torch.bfloat16, generate_on=ctx.device)
    bf16_bytes = _layer_bytes(base)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(ctx.device)
    result = SuiteResult(NAME, data={"config": {"hidden": hidden, "layers": layers, "tokens": tokens,
                                                "bf16_layer_bytes": bf16_bytes}, "forms": {}, "skipped": {}})
    usable = {}
    for name, (library, quantize) in FORMS.items():
        why = _importable(library)
        if why:
            result.data["skipped"][name] = why
        else:
            usable[name] = quantize
    if not usable:
        raise Skip("no quantization library is importable")
    with ctx.progress(len(usable) * (repeats + 1), NAME) as bar:
        for name, quantize in usable.items():
            # (each method quantizes its own copy: not every wrapper tensor can be deep-copied)
            make = lambda q=quantize: q(clone_module(base))  # noqa: E731
            result.rows += _form(ctx, result, name, make, x, bf16_bytes, repeats, bar)
    for name, why in result.data["skipped"].items():
        result.rows.append(Row(NAME, f"bytes per step, {name}", "MB", None, {}, {}, note=f"not measured: {why}",
                               short=f"bytes/step, {name}"))
    return result


def _form(ctx: Context, result: SuiteResult, name: str, make, x, bf16_bytes: int, repeats: int, bar) -> list:
    methods = {"resident": make().to(ctx.device)}
    q_bytes = _layer_bytes(methods["resident"])
    managers = {}
    for compress in (None, "lossless"):
        label = "layerwise" + (", compress" if compress else "")
        model = make()
        managers[label] = layerwise.configure_layerwise_offload(model, ["blocks"], device=ctx.device,
                                                                prefetch_depth=1, compress=compress)
        methods[label] = model
    steps = {k: _step(m, x) for k, m in methods.items()}
    check_bitwise(steps, steps["resident"](), f"quant, {name}")
    samplers = {k: device_timer(ctx, s, prepare=s) for k, s in steps.items()}
    ms = {k: s.map(lambda t: t * 1e3) for k, s in compare(samplers, repeats, warmup=1, bar=bar).items()}
    rows = []
    data = result.data["forms"][name] = {"quantized_bytes": q_bytes, "step_ms": ms, "bytes_per_step": {}}
    for label, (m,) in managers.items():
        copied = m.stats(sync=True)["last_step"]["bytes_copied"]
        if copied <= 0:  # every layer must be copied again each step (more layers than ring slots)
            raise AssertionError(f"quant: {name}, {label}: no bytes crossed the bus in a step")
        data["bytes_per_step"][label] = copied
        per_q = copied / q_bytes
        rows.append(Row(
            NAME, f"bytes per step, {name}, {label}", "MB", copied / MB,
            {"bf16 layers": bf16_bytes / MB, "quantized": q_bytes / MB},
            {"/bf16": copied / bf16_bytes, "/quantized": per_q},
            [Target.at_most(per_q, BYTES_TARGET, "quantized")],
            short=f"bytes/step, {name}{', compress' if 'compress' in label else ''}"))
        ratios = {"/resident": ratio(ms[label], ms["resident"])}
        note = "" if ctx.is_cuda else "CPU backend: no bus, a copy is a host memcpy; diffusers: not measured (CUDA)"
        rows.append(Row(NAME, f"step, {name}, {label}", "ms", ms[label], {"resident": ms["resident"]}, ratios,
                        note=note, short=f"step, {name}{', compress' if 'compress' in label else ''}"))
    return rows
